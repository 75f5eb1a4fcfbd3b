"""The image models of PipeDream and GPipe, as torchvision builds them (examples/resnet.py,
examples/vgg.py): their units, analytic and measured profiles, a solve at the papers' sizes,
and training parity with one process under PP2 (1F1B) cut beside an in-place ReLU.

Parity uses the harness and tolerances of test_runtime_parity.py (losses 1e-5 relative,
parameters 1e-4 absolute, explained there), on models with nothing that depends on how the
batch is split:
- ResNet runs with GroupNorm (`norm="group"`, Wu & He 2018) instead of its BatchNorm. In
  training mode BatchNorm normalises with the statistics of the batch it is given, and a
  pipeline gives it one micro-batch, a data-parallel rank its shard: the statistics, hence
  the losses, differ from the one-process run's by far more than rounding (GPipe, section 2.2,
  accepts this and recomputes them over the whole batch only for evaluation). No example
  model carries BatchNorm for this reason (examples/cnn.py, examples/unet.py).
  Images are 64x64, not 32x32: at 32x32 layer4 is 1x1, GroupNorm normalises 2 values per
  group, which maps them to about +-1 whatever their gap, and the rounding of a changed
  summation order is amplified past the tolerance (seen: 3e-5 relative on the third loss).
- VGG runs with dropout=0: a dropout mask drawn on a rank differs from the reference's.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from conftest import EXAMPLES
from planner.profiler import profile_model
from planner.profiler.measure import UnitJob, unit_costs
from tests.runtime_plans import make_plan

RESNET_ARGS = dict(depth=50, width=8, image_size=32)  # the paper's blocks, 1/8 of its channels
VGG_ARGS = dict(depth=16, width=8, hidden=64, image_size=32)
RESNET_UNITS = (["conv1", "bn1", "relu", "maxpool"]
                + [f"layer{i + 1}.{j}" for i, n in enumerate([3, 4, 6, 3]) for j in range(n)] + ["avgpool", "fc"])
RESNET18_UNITS = ["conv1", "bn1", "relu", "maxpool"] + [f"layer{i}.{j}" for i in range(1, 5) for j in range(2)] + ["avgpool", "fc"]
# VGG-16: 13 convolutions with their ReLUs and 5 max-pools, the pool, 3 linears, 2 ReLUs, 2 dropouts:
# every layer is a unit, as PipeDream cuts it.
VGG_UNITS = [f"features.{i}" for i in range(31)] + ["avgpool"] + [f"classifier.{i}" for i in range(7)]


def _path(name: str) -> str:
    return str(EXAMPLES / f"{name}.py")


def test_units_of_the_papers_models():
    resnet = profile_model(_path("resnet"), {}, [1], device="meta")
    assert resnet.unit_names() == RESNET_UNITS
    assert resnet.model.num_parameters == 25_557_032 - 1000 * 2049 + 10 * 2049  # torchvision's resnet50, 10 classes
    # torchvision's VGG keeps every convolution in one nn.Sequential of mixed layers: the planner
    # opens it, so a pipeline may cut between any two layers.
    vgg = profile_model(_path("vgg"), {}, [1], device="meta")
    assert vgg.unit_names() == VGG_UNITS
    assert vgg.model.num_parameters == 138_357_544 - 1000 * 4097 + 10 * 4097  # torchvision's vgg16, 10 classes


def test_in_place_op_on_a_unit_input_is_counted_and_timed():
    """A unit that overwrites its input (ReLU(inplace=True) cut out of ResNet's stem) runs alone
    on inputs that are not autograd leaves, as inside the model."""
    relu, x = nn.ReLU(inplace=True), torch.randn(2, 4, 8, 8, requires_grad=True) * 1  # an activation, as in the model
    costs = unit_costs(relu, (x,), {}, analytic_gpu=None, dtype="float32")
    assert costs.saved_bytes == x.numel() * 4  # ReLU saves its output for backward
    job = UnitJob(relu, (x.detach().clone().requires_grad_(True) * 1,), {})
    job.run(keep=True)
    assert len(job.forward_s) == 1
    captured = torch.tensor([-1.0, 2.0])
    UnitJob(relu, (captured,), {}).run(keep=False)
    assert captured.tolist() == [-1.0, 2.0]  # the captured input is left as it was for the next run


@pytest.mark.parametrize("name, args", [("resnet", RESNET_ARGS), ("vgg", VGG_ARGS)])
def test_analytic_and_measured_profiles_agree(name, args):
    measured = profile_model(_path(name), args, [2], device="cpu", repeats=1, warmup=0)
    meta = profile_model(_path(name), args, [2], device="meta")
    assert measured.model.fingerprint == meta.model.fingerprint
    for m, a in zip(measured.units, meta.units):
        cm, ca = m.costs[2], a.costs[2]
        assert (cm.forward_flops, cm.backward_flops) == (ca.forward_flops, ca.backward_flops), m.name
        assert (cm.output_bytes, cm.input_bytes, cm.saved_bytes) == (ca.output_bytes, ca.input_bytes, ca.saved_bytes), m.name
        assert cm.forward_time_s > 0 and cm.backward_time_s > 0, m.name
    assert [c.bytes for c in measured.cuts] == [c.bytes for c in meta.cuts]
    assert sum(u.costs[2].forward_flops for u in meta.units) > 0


@pytest.mark.parametrize("name", ["resnet", "vgg"])
def test_papers_sizes_solve_with_pipeline_cuts(name):
    import planner
    from planner.cluster import make_cluster
    from planner.solver.solve import Pins

    prof = profile_model(_path(name), {"image_size": 224, "num_classes": 1000}, [1, 2, 4], device="meta", gpu="a100-80gb",
                         dtype="bfloat16")
    plan = planner.solve(prof, make_cluster(8, gpu="a100-80gb"), global_batch_size=256, pins=Pins(pp=2))
    assert plan.layout.pp_degree == 2 and [u for s in plan.stages for u in s.units] == prof.unit_names()


# --- spawned ranks: training parity through `python -m runtime` (see the module docstring) ---

PARITY = {
    "resnet": (dict(RESNET_ARGS, depth=18, image_size=64, norm="group"), RESNET18_UNITS),
    "vgg": (dict(VGG_ARGS, dropout=0.0), VGG_UNITS),
}
# Both models' solved plans (pp2 1F1B, dp2 ZeRO 3, tp2) run against the reference in
# tests/test_solver_plans_run.py; here, the pipeline cuts beside their in-place ReLUs.


@pytest.mark.slow
def test_parity_with_a_cut_before_an_in_place_relu(tmp_path):
    """A stage that begins with ResNet's ReLU(inplace=True) writes into the tensor it received."""
    from tests.test_runtime_parity import check_parity

    args, units = PARITY["resnet"]
    check_parity(make_plan(model="resnet", args=args, units=units, pp=2, m=2, cuts=[0, 2, len(units)]), tmp_path)


@pytest.mark.slow
def test_parity_with_a_cut_after_an_in_place_relu(tmp_path):
    """The stage after the cut replays VGG's classifier.1, a ReLU(inplace=True) that returns its
    input: its stand-in must return the received tensor itself, not a meta copy."""
    from tests.test_runtime_parity import check_parity

    args, units = PARITY["vgg"]
    cut = units.index("classifier.1") + 1
    check_parity(make_plan(model="vgg", args=args, units=units, pp=2, m=2, cuts=[0, cut, len(units)]), tmp_path)
