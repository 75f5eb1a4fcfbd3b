"""The profiler's numbers on models small enough to check by hand."""

from __future__ import annotations

import pytest
import torch

from planner.errors import PlannerError
from planner.profile_schema import load_profile
from planner.profiler import profile_model

MLP = """
import torch
from torch import nn

def build_model(d_in=8, d_hidden=16, d_out=4, **_):
    return nn.Sequential(nn.Linear(d_in, d_hidden), nn.ReLU(), nn.Linear(d_hidden, d_out))

def make_batch(batch_size, d_in=8, d_out=4, **_):
    return torch.randn(batch_size, d_in), torch.randint(d_out, (batch_size,))
"""

SKIP = """
import torch
from torch import nn

class Skip(nn.Module):
    def __init__(self, d=4):
        super().__init__()
        self.stem = nn.Linear(d, d)
        self.blocks = nn.ModuleList([nn.Linear(d, d) for _ in range(3)])
        self.head = nn.Linear(2 * d, d)

    def forward(self, x):
        h = self.stem(x)
        skip = h
        for block in self.blocks:
            h = block(h) + 1
        return self.head(torch.cat([h, skip], dim=-1))

def build_model(**_):
    return Skip()

def make_batch(batch_size, **_):
    return torch.randn(batch_size, 4), torch.randint(4, (batch_size,))
"""

F32 = 4


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_linear_flops_are_exact(write_model, device):
    """A Linear's forward is 2*batch*in*out FLOPs; its backward (input + weight grads) twice that,
    but for the first one's, which takes the batch: no gradient for it, as in the model."""
    prof = profile_model(str(write_model(MLP)), {}, [3, 5], device=device, repeats=1, warmup=0)
    assert [u.name for u in prof.units] == ["0", "1", "2"]
    for b in (3, 5):
        first, relu, last = (u.costs[b] for u in prof.units)
        assert first.forward_flops == 2 * b * 8 * 16
        assert first.backward_flops == first.forward_flops
        assert last.forward_flops == 2 * b * 16 * 4
        assert last.backward_flops == 2 * last.forward_flops
        assert relu.forward_flops == 0


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_parameter_and_activation_bytes_are_exact(write_model, device):
    prof = profile_model(str(write_model(MLP)), {}, [2], device=device, repeats=1, warmup=0)
    first, relu, last = prof.units
    assert (first.num_parameters, first.parameter_bytes) == (8 * 16 + 16, (8 * 16 + 16) * F32)
    assert (last.num_parameters, last.parameter_bytes) == (16 * 4 + 4, (16 * 4 + 4) * F32)
    assert prof.model.num_parameters == 8 * 16 + 16 + 16 * 4 + 4
    b = 2
    # Linear saves its input for the weight gradient (the weight is a parameter, not counted);
    # ReLU saves its output for the mask.
    assert first.costs[b].saved_bytes == b * 8 * F32
    assert relu.costs[b].saved_bytes == b * 16 * F32
    assert last.costs[b].saved_bytes == b * 16 * F32
    assert first.costs[b].output_bytes == b * 16 * F32
    assert last.costs[b].output_bytes == b * 4 * F32
    assert [c.bytes[b] for c in prof.cuts] == [b * 16 * F32, b * 16 * F32]


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_skip_connection_crosses_every_cut(write_model, device):
    prof = profile_model(str(write_model(SKIP)), {}, [2], device=device, repeats=1, warmup=0)
    assert prof.unit_names() == ["stem", "blocks.0", "blocks.1", "blocks.2", "head"]
    b, row = 2, 2 * 4 * F32
    first = prof.cuts[0]
    assert [(t.producer, t.consumers) for t in first.tensors] == [("stem", ["blocks.0", "glue:after:blocks.2"])]
    for cut in prof.cuts[1:]:
        producers = sorted(t.producer for t in cut.tensors)
        # the skip from the stem, plus the block output that the glue `+ 1` (next stage) consumes
        assert producers == sorted(["stem", cut.after])
        assert cut.bytes[b] == 2 * row


def test_measured_profile_records_times_and_whole_model(write_model):
    prof = profile_model(str(write_model(MLP)), {}, [4], device="cpu", repeats=3, warmup=1)
    assert prof.mode == "measured"
    for unit in prof.units:
        assert unit.costs[4].forward_time_s > 0
    whole = prof.whole_model[4]
    assert whole.forward_backward_time_s > 0 and whole.sum_of_units_time_s > 0
    assert whole.ratio == pytest.approx(whole.forward_backward_time_s / whole.sum_of_units_time_s)
    assert prof.optimizer_step_s > 0
    # Zero bubble's B and W, timed apart where a unit's input takes a gradient (not the batch's).
    first, *rest = prof.units
    assert first.costs[4].backward_input_time_s is None and first.costs[4].backward_weight_time_s is None
    for unit in rest:
        assert unit.costs[4].backward_input_time_s > 0 and unit.costs[4].backward_weight_time_s >= 0
    analytic = profile_model(str(write_model(MLP)), {}, [4], device="meta")
    assert all(u.costs[4].backward_input_time_s is None for u in analytic.units)


THREADS = """
import torch
from torch import nn

class Checked(nn.Linear):
    def forward(self, x):
        assert torch.get_num_threads() == self.expected, f"measured with {torch.get_num_threads()} threads"
        return super().forward(x)

def build_model(threads=1, **_):
    layers = nn.Sequential(Checked(8, 8), Checked(8, 4))
    for layer in layers:
        layer.expected = threads
    return layers

def make_batch(batch_size, **_):
    return torch.randn(batch_size, 8), torch.randint(4, (batch_size,))
"""


@pytest.mark.parametrize("threads", [1, 2])
def test_cpu_profile_measures_with_the_threads_asked_for_and_records_them(write_model, threads):
    import torch

    before = torch.get_num_threads()
    prof = profile_model(str(write_model(THREADS)), {"threads": threads}, [2], device="cpu", repeats=1, warmup=0, threads=threads)
    assert prof.cpu_threads == threads
    assert torch.get_num_threads() == before  # put back for whatever runs next in this process
    assert profile_model(str(write_model(THREADS)), {"threads": torch.get_num_threads()}, [2], device="meta").cpu_threads is None
    with pytest.raises(PlannerError, match="--threads must be at least 1"):
        profile_model(str(write_model(THREADS)), {}, [2], device="cpu", threads=0)


def test_analytic_times_follow_the_roofline(write_model):
    """On a big Linear the analytic time is FLOPs over achievable FLOP/s (compute-bound)."""
    from planner.hardware import get_gpu

    source = MLP.replace("d_in=8, d_hidden=16", "d_in=4096, d_hidden=4096").replace("d_in=8, d_out", "d_in=4096, d_out")
    prof = profile_model(str(write_model(source)), {}, [4096], device="meta", gpu="a100-80gb", dtype="bfloat16",
                         precision="pure")  # the product alone; autocast would add the casts of its operands
    gpu = get_gpu("a100-80gb")
    first = prof.units[0].costs[4096]
    compute_s = first.forward_flops / gpu.achievable_flops("bfloat16")
    assert compute_s <= first.forward_time_s <= compute_s * 1.2
    assert prof.target_gpu == "a100-80gb" and prof.device_name == "analytic:a100-80gb"


UNCALLED_TOWER = """
import torch
from torch import nn

class TextOnly(nn.Module):
    def __init__(self, d=8):
        super().__init__()
        self.text = nn.ModuleList([nn.Linear(d, d) for _ in range(2)])
        self.vision = nn.ModuleDict({"patch": nn.Linear(d, d), "layers": nn.ModuleList([nn.Linear(d, d) for _ in range(3)])})
        self.projector = nn.Linear(d, d)

    def forward(self, x):
        for layer in self.text:
            x = layer(x)
        return x

def build_model(**_):
    return TextOnly()

def make_batch(batch_size, **_):
    return torch.randn(batch_size, 8), torch.randint(8, (batch_size,))
"""


def test_uncalled_submodules_are_named_by_their_shallowest_uncalled_ancestor(write_model):
    """A tower the batch never reaches (a vision-language model fed text) is one name with a count,
    in the unused-modules note and in the note on parameters no unit holds."""
    from planner.profile_schema import collapsed_names

    from planner.solver.solve import pp_refusal

    profile = profile_model(str(write_model(UNCALLED_TOWER)), {}, [2], device="meta")
    notes = profile.notes
    assert "modules never called in forward (left out of the units): vision (4 modules), projector" in notes
    assert "parameters held outside every unit: vision (8 parameters), projector (2 parameters)" in notes
    # No pipeline stage owns them: the refusal says why, and what to profile instead.
    assert "modules the forward never calls (vision (8 parameters), projector (2 parameters))" in pp_refusal(profile)
    assert collapsed_names(["a.b.c", "a.b.d", "a.e"], ["a.f", "a.e2"]) == ["a.b (2 modules)", "a.e"]


def test_profile_round_trips_through_json(write_model, tmp_path):
    prof = profile_model(str(write_model(SKIP)), {}, [1, 2], device="meta")
    path = prof.save(tmp_path / "p.json")
    assert load_profile(path) == prof


def test_corrupt_and_foreign_profiles_are_refused(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(PlannerError, match="not valid JSON"):
        load_profile(bad)
    bad.write_text('{"hello": 1}')
    with pytest.raises(PlannerError, match="not a profile"):
        load_profile(bad)


LOSSY = """
    import torch
    import torch.nn.functional as F
    from torch import nn

    def build_model():
        return nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 4096))

    def make_batch(batch_size):
        return torch.randn(batch_size, 64), torch.randint(4096, (batch_size,))

    def loss_fn(output, targets):
        return F.cross_entropy(output, targets)
"""


def test_analytic_profile_counts_the_loss_with_the_last_unit(write_model):
    """The loss runs on the last stage after the last unit: an analytic profile counts its forward
    and backward with that unit (time, traffic), not its saved tensors (the memory model prices
    the loss's own). A loss that does not take the last unit's output is left out, and said."""
    import torch
    import torch.nn.functional as F

    from planner.hardware import get_gpu
    from planner.profiler.counters import OpCostMode
    from planner.profiler.__init__ import LOSS_NOT_COUNTED

    with_loss = profile_model(str(write_model(LOSSY)), {}, [512], device="meta", gpu="h100-80gb")
    without = profile_model(str(write_model(LOSSY.replace("F.cross_entropy(output,", "F.cross_entropy(output[0],"),
                                            "other.py")), {}, [512], device="meta", gpu="h100-80gb")
    assert LOSS_NOT_COUNTED in without.notes and LOSS_NOT_COUNTED not in with_loss.notes
    a, b = with_loss.units[-1].costs[512], without.units[-1].costs[512]
    assert a.saved_bytes == b.saved_bytes and a.output_bytes == b.output_bytes
    logits = torch.empty(512, 4096, device="meta", requires_grad=True)
    forward, backward = OpCostMode(get_gpu("h100-80gb")), OpCostMode(get_gpu("h100-80gb"))
    with forward:
        loss = F.cross_entropy(logits, torch.empty(512, dtype=torch.long, device="meta"))
    with backward:
        loss.backward()
    assert a.forward_time_s == pytest.approx(b.forward_time_s + forward.totals.roofline_time_s, rel=1e-9)
    assert a.forward_memory_traffic_bytes == b.forward_memory_traffic_bytes + forward.totals.traffic_bytes
    # backward starts from the loss: its gradient replaces the ones the unit alone is given
    assert a.backward_time_s > b.backward_time_s
    assert with_loss.units[0].costs[512] == without.units[0].costs[512]


CACHED = """
import torch
from torch import nn

class Keys:
    '''A key cache every layer appends to, as Hugging Face's DynamicCache is: state the
    forward mutates, passed to every layer.'''
    def __init__(self):
        self.keys = {}

    def update(self, layer, k):
        self.keys[layer] = torch.cat([self.keys[layer], k], dim=1) if layer in self.keys else k
        return self.keys[layer]

class Layer(nn.Module):
    def __init__(self, index, d=8):
        super().__init__()
        self.index = index
        self.proj = nn.Linear(d, d)

    def forward(self, x, cache):
        k = cache.update(self.index, self.proj(x))
        return x + torch.softmax(x @ k.transpose(1, 2), dim=-1) @ k

class Model(nn.Module):
    def __init__(self, d=8):
        super().__init__()
        self.layers = nn.ModuleList([Layer(i, d) for i in range(3)])
        self.head = nn.Linear(d, 4)

    def forward(self, x):
        cache = Keys()
        for layer in self.layers:
            x = layer(x, cache)
        return self.head(x).mean(dim=1)

def build_model(**_):
    return Model()

def make_batch(batch_size, **_):
    return torch.randn(batch_size, 6, 8), torch.randint(4, (batch_size,))
"""


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_a_unit_alone_sees_state_its_forward_updates_as_it_was_when_called(write_model, device):
    """Each layer appends its keys to one cache object. Run alone, a layer must start from the
    cache as it was when the layer was called in the whole forward, not as the forward left it
    (its own keys already there: twice the keys to attend over, and, measured, a backward
    through the graph the first run freed)."""
    prof = profile_model(str(write_model(CACHED)), {}, [2], device=device, repeats=2, warmup=1)
    b, t, d = 2, 6, 8
    attention = 2 * (2 * b * t * t * d)  # the scores and their product with the keys, 6 keys each
    for unit in prof.units[:3]:
        assert unit.costs[b].forward_flops == 2 * b * t * d * d + attention


WIDTHS_FROM_TENSORS = """
import torch
from torch import nn

def build_model(**_):
    # torchvision's RegNet derives its stage widths so: tensor arithmetic read back to Python.
    widths = (torch.arange(3) * 4 + 8).tolist()
    layers, width = [], 8
    for w in widths:
        layers += [nn.Linear(width, w), nn.ReLU()]
        width = w
    model = nn.Sequential(*layers, nn.Linear(width, 4))
    model.register_buffer("scale", torch.ones(4))
    return model

def make_batch(batch_size, **_):
    return torch.randn(batch_size, 8), torch.randint(4, (batch_size,))
"""


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_a_model_that_computes_its_shape_with_tensors_profiles(write_model, device):
    # Under torch.device("meta") its arithmetic has no values; built again with only its
    # parameters and buffers sent to meta (planner/model_file.py `ModelFile.build_on_meta`).
    from planner.model_file import load_model_file

    path = write_model(WIDTHS_FROM_TENSORS)
    model = load_model_file(path).build_on_meta()
    assert all(p.is_meta for p in model.parameters()) and all(b.is_meta for b in model.buffers())
    assert [m.out_features for m in model if isinstance(m, torch.nn.Linear)] == [8, 12, 16, 4]
    import torch.nn as nn

    assert nn.Module.register_parameter.__name__ == "register_parameter"  # restored afterwards
    prof = profile_model(str(path), {}, [2], device=device, repeats=2, warmup=1)
    assert prof.model.num_parameters == sum(p.numel() for p in model.parameters())


def test_a_unit_whose_backward_dwarfs_its_forward_is_named_once_per_kind():
    """A Python loop over the sequence that reads one step at a time gets a full-size gradient per
    step in the backward (Jamba's Mamba layers: 200 times their forward); the profile says so, once
    per kind of unit, and leaves out units with no FLOPs (an embedding's backward writes its whole
    table) and ordinary ones."""
    from planner.profile_schema import UnitCosts
    from planner.profiler import SLOW_BACKWARD, _slow_backward_notes

    def cost(forward_s: float, backward_s: float, flops: int = 10**9) -> dict[int, UnitCosts]:
        return {1: UnitCosts(forward_time_s=forward_s, backward_time_s=backward_s, forward_flops=flops, backward_flops=2 * flops,
                             forward_memory_traffic_bytes=0, backward_memory_traffic_bytes=0, input_bytes=0, output_bytes=0,
                             saved_bytes=0)}

    units = ["embed", "mamba.0", "attention.1", "mamba.2"]
    fingerprints = {"embed": "e", "mamba.0": "m", "attention.1": "a", "mamba.2": "m"}
    costs = {"embed": cost(1e-4, 30e-4, flops=0), "mamba.0": cost(0.12, 25.0), "attention.1": cost(0.1, 0.25),
             "mamba.2": cost(0.12, 25.0)}
    (note,) = _slow_backward_notes(units, fingerprints, costs, 1)
    assert "mamba.0 (25 s against 0.12 s)" in note and "mamba.2" not in note
    assert "embed" not in note and "attention" not in note and "--device cuda" in note
    costs["mamba.0"] = costs["mamba.2"] = cost(0.12, 0.12 * SLOW_BACKWARD)
    assert _slow_backward_notes(units, fingerprints, costs, 1) == []


def test_saved_bytes_count_a_storage_at_the_address_of_a_dead_one(monkeypatch):
    """A tensor saved by a branch no output reaches dies at once, and a storage saved later may
    get its address: counted by address alone, the later one was missed, and how many were missed
    depended on the heap (planner/profiler/counters.py `SavedBytes`; Nemotron-H's MoE block moved
    by 14% between draws). The allocator's reuse is simulated: every storage gets one address."""
    from planner.profiler.counters import SavedBytes

    monkeypatch.setattr(SavedBytes, "_address", staticmethod(lambda storage: 0))
    x = torch.randn(64, 64, requires_grad=True)
    saved = SavedBytes()
    with saved.hooks():
        dead = x * 2
        dead.sin()  # saves `dead`; this branch is dropped at once
        del dead
        live = (x * 3).sin()  # saves a new storage "at the same address"
    assert saved.bytes == 2 * 64 * 64 * 4
    live.sum().backward()
