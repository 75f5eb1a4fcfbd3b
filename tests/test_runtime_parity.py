"""Parity: every parallel layout trains to the one-process reference's losses and parameters.

Each case writes a plan, runs it on gloo CPU processes (`python -m runtime` on each rank with
torchrun's environment, tests/ranks.py, under a timeout) and the same plan with `--reference` (one process, whole global batch),
then compares the per-step losses and the final parameters.

Tolerances: float32 throughout. Splitting the batch over ranks and micro-batches changes
the order in which gradients are summed (rounding ~1e-7 relative), and AdamW divides each
update by sqrt(v): for parameters whose gradient is near zero that ratio amplifies the
rounding, so after 3 steps at lr 1e-3 a parameter may differ by up to ~1e-4 (each update
is at most lr in size). Losses agree to 1e-5 relative. A wrong layout misses by orders of
magnitude more (a mis-sharded head or an unscaled gradient changes the first update).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.conftest import ROOT
from tests.ranks import run_ranks
from tests.runtime_plans import GPT_TP, GPT_UNITS, make_plan

STEPS = 3
LOSS_RTOL, PARAM_ATOL = 1e-5, 1e-4


def run(plan_path, out_dir, world_size: int, reference: bool = False, extra=()):
    if reference and (not extra or (len(extra) == 2 and extra[0] == "--steps")):
        return _reference_here(plan_path, out_dir, int(extra[1]) if extra else STEPS)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    tag = "ref" if reference else "par"
    args = [str(plan_path), "--steps", str(STEPS), "--output", str(out_dir / f"{tag}.json"),
            "--save-params", str(out_dir / f"{tag}.pt"), *extra]
    if reference:
        done = subprocess.run([sys.executable, "-m", "runtime", *args, "--reference"], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=240)
    else:
        done = run_ranks(world_size, args, ROOT, env)  # torchrun's environment without its agent (tests/ranks.py)
    assert done.returncode == 0, done.stderr[-3000:]
    metrics = json.loads((out_dir / f"{tag}.json").read_text())
    if reference:
        return metrics, torch.load(out_dir / f"{tag}.pt")
    params = {}
    for rank in range(world_size):
        path = out_dir / f"{tag}.rank{rank}.pt"
        if path.exists():
            params.update(torch.load(path))
    return metrics, params


def check_parity(plan, tmp_path, noise_only: tuple[str, ...] = (), param_atol: float = PARAM_ATOL):
    """The plan's losses and trained parameters against the one-process reference's. `noise_only`:
    name suffixes of parameters whose gradient is zero in exact arithmetic (attention's key bias:
    softmax ignores a constant added to one query's scores), which Adam moves by rounding noise
    alone (its first steps are about lr x sign(g)), so they are checked to exist but not compared.
    `param_atol`: the parameters' tolerance, tighter than the default where a case is known to
    reach float rounding only."""
    path = plan.save(tmp_path / "plan.json")
    ref_metrics, ref_params = run(path, tmp_path, 1, reference=True)
    par_metrics, par_params = run(path, tmp_path, plan.world_size)
    assert par_metrics["losses"] == pytest.approx(ref_metrics["losses"], rel=LOSS_RTOL)
    assert set(par_params) == set(ref_params), set(ref_params) ^ set(par_params)
    worst = max((par_params[k] - ref_params[k]).abs().max().item() for k in ref_params if not k.endswith(noise_only))
    assert worst < param_atol, worst
    moved = max((ref_params[k] - v0).abs().max().item() for k, v0 in _initial(path, tmp_path).items())
    assert moved > 10 * PARAM_ATOL  # training changed the parameters far more than the tolerance


def _reference_train(path, steps: int):
    """`python -m runtime PLAN --steps N --reference` in this process: the one-process reference
    needs no process group, and a process of its own (interpreter, torch, the model file) cost
    more than its few steps. torch's generator and thread count are restored afterwards."""
    from planner.plan import load_plan
    from runtime.launch import resolve_model_file
    from runtime.train import train

    plan = load_plan(path)
    threads = torch.get_num_threads()
    try:
        with torch.random.fork_rng(devices=[]):  # the run seeds torch's generator
            return train(plan, resolve_model_file(plan, str(path), None), steps, 0, None, True)
    finally:
        torch.set_num_threads(threads)  # and sets the plan's thread count


def _reference_here(path, out_dir, steps: int):
    """`run(..., reference=True)` in this process: (metrics as the CLI writes them, parameters)."""
    result = _reference_train(path, steps)
    metrics = result.metrics.model_copy(update={"plan": str(path), "reference": True})
    metrics.save(out_dir / "ref.json")
    return json.loads((out_dir / "ref.json").read_text()), result.params


def _initial(path, tmp_path):
    """The reference's initial parameters (`python -m runtime PLAN --steps 0 --reference
    --save-params`): a step-less reference run only materialises the model from its seed."""
    return _reference_train(path, 0).params


# Hand-written plans. tests/test_solver_plans_run.py runs the solver's plans for plain tp (GPT and
# Llama), GPipe, zero bubble and ZeRO 3 on examples/gpt.py, so those are not repeated here.
CASES = {
    "dp2": dict(dp=2),
    # ZeRO-1 accumulates 2 micro-batches unreduced and reduce-scatters once per step; ZeRO-2
    # reduce-scatters each micro-batch's gradient into its shard.
    "dp2-zero1-accumulated": dict(dp=2, zero=1, m=2),
    "dp2-zero2-m2": dict(dp=2, zero=2, m=2),
    "pp2-1f1b": dict(pp=2, schedule="1f1b", m=4),
    "pp2-interleaved-v2": dict(pp=2, schedule="interleaved-1f1b", v=2, m=4),
    "pp2-non-uniform": dict(pp=2, m=4, cuts=[0, 2, len(GPT_UNITS)]),
    "pp2-llama": dict(model="llama", pp=2, m=2),
    "recompute-full-dp2": dict(dp=2, recompute="full"),
    "recompute-selective-pp2": dict(pp=2, m=2, recompute="selective"),
    "pp2xdp2": dict(pp=2, dp=2, m=2),
    # Two stages per rank with ZeRO 0's overlapped reduction (checked tighter below).
    "pp2xdp2-interleaved-v2": dict(pp=2, dp=2, schedule="interleaved-1f1b", v=2, m=2),
    "pp2xtp2": dict(pp=2, tp=2, m=2, tp_plan=GPT_TP),
    "dp2xtp2": dict(dp=2, tp=2, tp_plan=GPT_TP),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_parity(case, tmp_path):
    # Interleaved under ZeRO 0: torch divides the chunk whose backward ends first by m while the
    # other's still runs, and one bucket carries both; a second division of that chunk left its
    # weights 3e-5 off, inside the default tolerance (runtime/apply_dp.py `GradientReducer`).
    tight = dict(noise_only=("wk.bias",), param_atol=1e-5) if case == "pp2xdp2-interleaved-v2" else {}
    check_parity(make_plan(**CASES[case]), tmp_path, **tight)


# Recomputation per unit (planner/plan.py `Stage.unit_recompute`): full, selective and none
# units in one stage. Layout, then unit -> mode over the stages' `recompute` ("none").
UNIT_RECOMPUTE_CASES = {
    "unit-recompute-mixed-pp2": (dict(pp=2, m=2), {"blocks.0": "full", "blocks.1": "selective", "blocks.3": "full"}),
    "unit-recompute-mixed-dp2": (dict(dp=2), {"blocks.0": "full", "blocks.2": "selective"}),
}


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", sorted(UNIT_RECOMPUTE_CASES))
def test_parity_unit_recompute(case, tmp_path):
    layout, modes = UNIT_RECOMPUTE_CASES[case]
    plan = make_plan(**layout)
    stages = [type(s).model_validate({**s.model_dump(), "unit_recompute": {u: r for u, r in modes.items() if u in s.units}})
              for s in plan.stages]
    assert len({r for s in stages for r in s.unit_modes().values()}) == 3  # the three modes in the plan
    check_parity(plan.model_copy(update={"stages": stages}), tmp_path)


def _on_model(plan, path):
    """`plan` for the model file at `path` (no model arguments): a hand-written plan for a test's own model."""
    from planner.plan import ModelRef

    return plan.model_copy(update={"model": ModelRef(file=str(path), args={})})


IN_PLACE_HEAD = """
import torch
from torch import nn

class Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.act = nn.ReLU(inplace=True)  # as EfficientNet's classifier starts with Dropout(inplace=True)
        self.fc = nn.Linear(16, 4)

    def forward(self, x):
        return self.fc(self.act(x))

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Linear(8, 16)
        self.head = Head()

    def forward(self, x):
        return self.head(self.stem(x))

def build_model(**_):
    return Net()

def make_batch(batch_size, **_):
    return torch.randn(batch_size, 8), torch.randint(4, (batch_size,))
"""


@pytest.mark.slow
@pytest.mark.parametrize("zero", [1, 3])
def test_parity_of_a_unit_that_writes_its_input_in_place_under_fsdp(zero, tmp_path, write_model):
    # FSDP2 hands a sharded unit its inputs as views a custom Function made, which autograd will
    # not let the unit's in-place ReLU write (runtime/apply_dp.py `_clone_inputs_written_in_place`).
    plan = make_plan(dp=2, zero=zero, units=["stem", "head"], args={})
    plan = _on_model(plan, write_model(IN_PLACE_HEAD, "in_place_head.py"))
    check_parity(plan, tmp_path)


NAMED_SEQUENTIAL = """
from collections import OrderedDict
import torch
from torch import nn

def build_model(**_):
    # DenseNet's features are a Sequential with named children (conv0, denseblock1, transition1, ...)
    return nn.Sequential(OrderedDict(stem=nn.Linear(8, 16), act=nn.ReLU(), mid=nn.Linear(16, 16), head=nn.Linear(16, 4)))

def make_batch(batch_size, **_):
    return torch.randn(batch_size, 8), torch.randint(4, (batch_size,))
"""


@pytest.mark.slow
def test_parity_of_a_pipeline_cut_inside_a_sequential_with_named_children(tmp_path, write_model):
    # A stage replaces the units it does not run, and recomputation wraps the ones it does, by
    # their names in their parent (runtime/pp_split.py `make_stage`, runtime/recompute.py).
    plan = make_plan(pp=2, m=2, units=["stem", "act", "mid", "head"], args={}, recompute="full")
    plan = _on_model(plan, write_model(NAMED_SEQUENTIAL, "named.py"))
    check_parity(plan, tmp_path)


SAVED_AND_SENT = """
import torch
from torch import nn

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem, self.u1, self.u2, self.u3 = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 16)
        self.head = nn.Linear(32, 4)

    def forward(self, x):
        h1 = self.u1(self.stem(x))
        return self.head(torch.cat([self.u3(self.u2(h1)), h1], dim=-1))  # h1 feeds u2 and skips to the head

def build_model(**_):
    return Net()

def make_batch(batch_size, **_):
    return torch.randn(batch_size, 8), torch.randint(4, (batch_size,))
"""


@pytest.mark.slow
def test_parity_of_zero_bubble_when_a_tensor_a_stage_saves_also_crosses_its_cut(tmp_path, write_model):
    # Chunk [u1, u2] sends h1 on (to the head) and u2 saved it for its weight gradient. torch's
    # input-gradient pass detaches the chunk's outputs in place, which left the weight pass a
    # detached saved tensor (GoogLeNet cut inside an inception block): outputs are sent as copies.
    plan = make_plan(pp=2, v=2, schedule="zero-bubble", m=4, cuts=[0, 1, 3, 4, 5],
                     units=["stem", "u1", "u2", "u3", "head"], args={})
    plan = _on_model(plan, write_model(SAVED_AND_SENT, "saved_and_sent.py"))
    check_parity(plan, tmp_path)
