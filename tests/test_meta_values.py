"""Data-dependent Python on the meta device (planner/meta_values.py).

A model's forward may read tensor values (`if mask.all()`, `.item()`, `nonzero`, boolean
indexing). On the meta device those have no data; `KnownValues` answers them exactly where the
value follows from the batch or from factory ops, samples where it follows from parameters,
and otherwise names the model's line.
"""

from __future__ import annotations

import random

import torch
from torch import nn

import pytest

from planner.errors import PlannerError
from planner.meta_values import DataDependentError, KnownValues
from planner.units import trace_on_meta


class Branchy(nn.Module):
    """Takes one branch or the other by a value computed from the input ids."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, ids):
        positions = torch.arange(ids.shape[1], device=ids.device)
        h = self.embed(ids)
        if (ids.sum() > 100).item() and bool((positions >= 0).all()):
            return self.a(h)
        return self.b(h)


class LoopOverExperts(nn.Module):
    """A router and a Python loop over the experts it picked (Mixtral's eager code, 4.x)."""

    def __init__(self, num_experts: int = 4, top_k: int = 2):
        super().__init__()
        self.router = nn.Linear(8, num_experts, bias=False)
        self.experts = nn.ModuleList(nn.Linear(8, 8) for _ in range(num_experts))
        self.top_k = top_k

    def forward(self, x):
        tokens = x.reshape(-1, x.shape[-1])
        weights, chosen = torch.topk(self.router(tokens).softmax(-1), self.top_k)
        out = torch.zeros_like(tokens)
        for e in torch.unique(chosen).tolist():  # data-dependent: which experts were hit
            rows, slot = torch.where(chosen == e)  # data-dependent shape
            out[rows] += weights[rows, slot, None] * self.experts[e](tokens[rows])
        return out.reshape(x.shape)


def test_values_that_follow_from_the_batch_are_exact():
    model_meta = Branchy().to("meta")
    for ids, branch in ((torch.full((2, 8), 15), "a"), (torch.zeros(2, 8, dtype=torch.long), "b")):
        trace = trace_on_meta(model_meta, (ids,))
        assert trace.units == ["embed", branch]  # the branch the real run takes


def test_parameter_dependent_control_flow_follows_sampled_values_and_says_so():
    values = KnownValues()
    model = LoopOverExperts().to("meta")
    with values:
        out = model(values.to_meta(torch.randn(2, 16, 8)))
    assert out.shape == (2, 16, 8) and out.is_meta
    ops = {op for op, _ in values.sampled_decisions}
    assert ops & {"_unique2", "unique_dim", "_local_scalar_dense", "nonzero"}, values.sampled_decisions
    lines = " ".join(line for _, line in values.sampled_decisions)
    assert "test_meta_values.py" in lines  # the model's own line, not torch's or the planner's


def test_sampled_routing_is_about_balanced():
    """Top-2 of 8 over standard-normal logits: every expert gets tokens, none most of them."""
    values = KnownValues(max_numel=4096)
    with values:
        # A router's logits from hidden states too large to shadow: the logits themselves are sampled.
        hidden = torch.empty(512, 64, device="meta")
        logits = hidden @ torch.empty(64, 8, device="meta")
        _, chosen = torch.topk(logits, 2)
        counts = torch.bincount(chosen.flatten(), minlength=8)
        hits = [int(counts[e].item()) for e in range(8)]
    assert sum(hits) == 1024 and min(hits) > 1024 / 8 / 2 and max(hits) < 1024 / 8 * 2, hits


def test_a_costly_op_on_sampled_values_is_drawn_not_computed(monkeypatch):
    """A matmul of sampled shadows is computed while it is cheap; past MAX_SAMPLED_FLOPS its
    output is a fresh draw (a VGG convolution at 224x224 cost seconds of CPU per call)."""
    import planner.meta_values as mv

    exact = torch.randn(4, 8)

    def product(values):
        with values:
            x = values.to_meta(exact)  # exact: bound from the batch
            w = torch.empty(8, 8, device="meta").normal_()  # sampled: a parameter's initialisation
            y = x @ w
        assert w in values.sampled and y in values.sampled
        return values.values[y], values.values[x] @ values.values[w]

    shadow, computed = product(KnownValues())  # 512 FLOPs
    torch.testing.assert_close(shadow, computed)
    monkeypatch.setattr(mv, "MAX_SAMPLED_FLOPS", 100)
    shadow, computed = product(KnownValues())
    assert shadow.shape == computed.shape and not torch.allclose(shadow, computed)


def test_sampled_shadows_kept_alive_by_a_loop_stay_within_their_budget(monkeypatch):
    """A scan written as a Python loop over the sequence (Jamba's Mamba, Qwen3-Next's gated delta
    rule) makes small tensors at every step, all kept for the backward: their sampled shadows took
    more than 12 GiB for one layer of Jamba. They stop at SAMPLED_BYTES, exact values do not, and
    the budget comes back as the tensors die."""
    import planner.meta_values as mv

    monkeypatch.setattr(mv, "SAMPLED_BYTES", 100 * 64 * 4)  # a hundred states of 64 float32
    values = KnownValues()
    with values:
        decay = torch.empty(64, device="meta").normal_()  # sampled: a parameter's initialisation
        state, kept = torch.zeros(64, device="meta"), []
        for _ in range(300):
            state = state * decay + 1.0
            kept.append(state)
        positions = torch.arange(1000, device="meta")
    assert values.sampled_bytes <= mv.SAMPLED_BYTES
    assert sum(t in values.values for t in kept) < 100 and kept[0] in values.values
    assert values.exact(positions) is not None  # exact values are not held back by the budget
    kept.clear()
    del state
    import gc

    gc.collect()
    assert values.sampled_bytes <= 64 * 4  # `decay` alone


def test_a_write_with_unknown_data_forgets_the_shadows_of_every_view_of_it():
    """A buffer written slice by slice (a recurrent scan's outputs) keeps no stale shadow: a
    write whose data is unknown drops the buffer's shadow and its views', however many other
    shadows there are, and a write of known data updates the views. A write of sampled data
    makes the views sampled: none of them is exact any more."""
    values = KnownValues(sample=False)
    with values:
        others = [torch.arange(8, device="meta") + i for i in range(2000)]  # shadows of unrelated storages
        buffer = torch.zeros(4, 8, device="meta")
        row, col = buffer[1], buffer[:, 2]
        buffer[1].fill_(3.0)  # known data: the views see it
        assert row.sum().item() == 24.0 and col.sum().item() == 3.0
        buffer[2].copy_(torch.empty(8, device="meta"))  # unknown data
        for view in (buffer, row, col):
            assert view not in values.values
            with pytest.raises(DataDependentError):
                view.sum().item()
        assert all(t in values.values for t in others)

    values = KnownValues()
    with values:
        buffer = torch.zeros(4, 8, device="meta")
        row = buffer[1]
        assert values.exact(row) is not None
        buffer[1].copy_(torch.empty(8, device="meta").normal_())  # a parameter's draw
        assert values.exact(row) is None and values.exact(buffer) is None and row in values.values


def test_a_value_that_cannot_be_known_names_the_line_and_the_operation():
    values = KnownValues(max_numel=16)  # nothing larger than 16 elements gets a value

    def forward(x, w):
        h = x @ w
        return h[h > 0]  # the shape depends on every value of a large parameter-dependent tensor

    with pytest.raises(DataDependentError) as info, values:
        forward(torch.empty(64, 64, device="meta"), torch.empty(64, 64, device="meta"))
    message = str(info.value)
    assert "aten.nonzero" in message or "aten.index" in message, message
    assert "test_meta_values.py" in message and "return h[h > 0]" in message
    assert "--device cpu" in info.value.hint


MODEL_READS_A_LARGE_VALUE = """
import torch
from torch import nn

class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(1100, 1100)
        self.b = nn.Linear(1100, 4)

    def forward(self, x):
        h = self.a(x)
        h = h * (h > 0).any(-1, keepdim=True)  # fine: no Python reads a value
        return self.b(h[:, h.sum((0, 2)) > 0])  # a data-dependent shape from a 1.2M-element tensor

def build_model():
    return Model()

def make_batch(batch_size):
    return torch.randn(batch_size, 1100, 1100), torch.zeros(batch_size)

def loss_fn(output, targets):
    return output.pow(2).mean()
"""


def test_meta_profile_refuses_with_the_models_line_and_measured_profile_falls_back(write_model):
    from planner.profiler import profile_model

    path = write_model(MODEL_READS_A_LARGE_VALUE)
    with pytest.raises(PlannerError) as info:
        profile_model(str(path), device="meta")
    assert "reads a tensor's value" in str(info.value) and "h[:, h.sum((0, 2)) > 0]" in str(info.value)
    measured = profile_model(str(path), device="cpu", repeats=1, warmup=0)
    assert [u.name for u in measured.units] == ["a", "b"]
    assert any("traced on the real model" in note for note in measured.notes)


def test_a_meta_kernel_that_refuses_float32_runs_in_bfloat16_for_its_shape():
    """torch's pipeline shape inference runs a stage's units on meta (runtime/apply_pp.py): a Hugging
    Face MoE layer's `_grouped_mm`, whose meta kernel takes bfloat16 alone, gets its float32 shape."""
    from planner.meta_values import Bfloat16Retry

    x, w = torch.empty(6, 16, device="meta"), torch.empty(3, 16, 32, device="meta")  # 16-byte aligned in bfloat16
    offs = torch.tensor([2, 4, 6], dtype=torch.int32, device="meta")
    with pytest.raises(RuntimeError, match="BF16"):
        torch._grouped_mm(x, w, offs=offs)
    with Bfloat16Retry():
        out = torch._grouped_mm(x, w, offs=offs)
    assert out.shape == (6, 32) and out.dtype == torch.float32 and out.device.type == "meta"


def test_leaves_are_pytrees_leaves():
    """`leaves`, the profiler modes' fast walk over an op's arguments, finds what pytree's
    `tree_flatten` finds, in the same order: the leaves of nested lists, tuples (sizes and named
    tuples such as torch.return_types too) and dicts."""
    from collections import OrderedDict

    from torch.utils._pytree import tree_flatten

    from planner.meta_values import leaves

    t = [torch.zeros(i + 1) for i in range(6)]
    cases = [t[0], (t[0], [t[1], 2.0, None], {"a": t[2], "b": (t[3], "x")}), ((t[0], torch.Size([2, 3])), {"k": [t[1]]}),
             torch.max(torch.ones(2, 3), 1), OrderedDict(z=t[4], y=[t[5]]), [], ()]
    for case in cases:
        expected = tree_flatten(case)[0]
        found = leaves(case)
        assert len(found) == len(expected) and all(a is b or a == b for a, b in zip(found, expected, strict=True)), case


def _operand(rng: random.Random, shape: list[int]):
    """A meta tensor of `shape` (or of one broadcasting to it) laid out as models make them:
    contiguous, permuted, sliced out of a larger one, channels-last, or expanded; or a scalar."""
    kind = rng.choice(["contiguous", "permuted", "sliced", "channels_last", "expanded", "expanded", "python", "cpu"])
    if kind == "python":
        return rng.choice([2, 2.5, True])
    if kind == "cpu":
        return torch.tensor(rng.choice([2, 2.5]))
    dtype = rng.choice([torch.float32, torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.bool])
    own = [1 if rng.random() < 0.3 else s for s in shape[rng.randint(0, len(shape)):]]  # broadcasting
    if kind == "permuted" and len(own) >= 2:
        perm = rng.sample(range(len(own)), len(own))
        return torch.empty([own[p] for p in perm], dtype=dtype, device="meta").permute([perm.index(i) for i in range(len(own))])
    if kind == "sliced":
        return torch.empty([s * rng.choice([1, 2]) for s in own], dtype=dtype, device="meta")[tuple(slice(0, s) for s in own)]
    if kind == "channels_last" and len(own) == 4:
        return torch.empty(own, dtype=dtype, device="meta").to(memory_format=torch.channels_last)
    if kind == "expanded":
        return torch.empty([1 if rng.random() < 0.5 else s for s in own], dtype=dtype, device="meta").expand(own)
    return torch.empty(own, dtype=dtype, device="meta")


def test_fast_binary_gives_torchs_meta_output():
    """Meta add/sub/mul/div run torch's Python references (0.5 ms a call); `fast_binary` gives
    the same output (shape, strides as torch derives them from the operands', dtype) or defers to
    torch (None) where it does not claim to know. 20,000 random pairs of operands, seeded: torch's
    stride rules turn on size-1 and broadcast dimensions that a few hundred draws rarely reach."""
    from planner.meta_values import fast_binary

    rng = random.Random(0)
    answered = 0
    for _ in range(20_000):
        shape = [rng.choice([0, 1, 1, 2, 3, 4]) for _ in range(rng.randint(0, 5))]
        func = rng.choice([torch.ops.aten.add.Tensor, torch.ops.aten.sub.Tensor, torch.ops.aten.mul.Tensor,
                           torch.ops.aten.div.Tensor])
        a, b = _operand(rng, shape), _operand(rng, shape)
        got = fast_binary(func, (a, b), {})
        if got is None:
            continue
        answered += 1
        want = func(a, b)
        assert (got.shape, got.stride(), got.dtype, got.device) == (want.shape, want.stride(), want.dtype, want.device), (
            func, [(x.shape, x.stride(), x.dtype) if isinstance(x, torch.Tensor) else x for x in (a, b)])
    assert answered > 10_000


def test_fast_binary_decides_the_common_layouts_itself():
    """The cases a traced model runs most (a Mamba scan's slices times its state; a tensor times a
    scalar; broadcasting a bias) are answered without torch's references."""
    from planner.meta_values import fast_binary

    aten = torch.ops.aten
    state = torch.empty(1, 64, 16, device="meta")
    sliced = torch.empty(1, 64, 32, 16, device="meta")[:, :, 3, :]
    cases = [(aten.mul.Tensor, (sliced, state)), (aten.add.Tensor, (state, sliced)), (aten.mul.Tensor, (state, 0.5)),
             (aten.add.Tensor, (state, torch.empty(16, device="meta"))), (aten.div.Tensor, (state.to(torch.int64), 2))]
    for func, args in cases:
        got = fast_binary(func, args, {})
        assert got is not None, (func, args)
        want = func(*args)
        assert (got.shape, got.stride(), got.dtype) == (want.shape, want.stride(), want.dtype)
    assert fast_binary(aten.add.Tensor, (state, state), {"alpha": 2}) is None
    assert fast_binary(aten.sub.Tensor, (state.bool(), state.bool()), {}) is None
