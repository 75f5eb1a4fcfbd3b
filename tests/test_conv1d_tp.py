"""Tensor parallelism for linears recognised by structure: Hugging Face's Conv1D (GPT-2), and
Falcon's FalconLinear (`x @ weight.T`).

Conv1D stores its weight [in, out] and computes `addmm(bias, x, weight)`. The op graph must
record it as a linear with that orientation, the ILP must read its features the right way
round and keep the fused q|k|v projection `c_attn` replicated, and the runtime must shard it
so that a solved tp=2 plan trains like one process. FalconLinear multiplies by a transposed
view of an [out, in] weight, and Falcon writes its MLP's output in place, which the plan
must list for the runtime to copy (`Stage.tp_copy_outputs`).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

pytest.importorskip("transformers")

import planner.hf_config_model as hf  # noqa: E402
from planner.cluster import make_cluster  # noqa: E402
from planner.profiler import profile_model  # noqa: E402
from planner.profiler.opgraph import linear_weight_orientation  # noqa: E402
from planner.solver.intra_op import IntraOpProblem, solve_intra_op  # noqa: E402
from planner.solver.solve import Pins, solve  # noqa: E402
from tests.conftest import EXAMPLES  # noqa: E402

GPT2 = dict(config=str(EXAMPLES / "hf" / "gpt2.json"), n_layer=2, n_embd=64, n_head=4, vocab_size=256,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, seq_len=32)


class _Collectives:
    """Cheap collectives, so that the ILP's only reason to replicate is what it may not shard."""

    def all_reduce_s(self, nbytes):
        return 1e-9 * nbytes

    all_gather_s = reduce_scatter_s = all_to_all_s = all_reduce_s


class _OutIn(nn.Module):
    """A hand-written linear (not nn.Linear) that stores its weight [out, in] as nn.Linear does."""

    def __init__(self, n_in, n_out):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n_out, n_in))

    def forward(self, x):
        return nn.functional.linear(x, self.weight)


class _NotLinear(nn.Module):
    """Owns a square 2-D weight but uses it elementwise: no multiplication with its input."""

    def __init__(self, n):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n, n))

    def forward(self, x):
        return x * self.weight.sum(0)


class _Transposed(nn.Linear):
    """nn.Linear's [out, in] weight multiplied through a transposed view, as FalconLinear does."""

    def __init__(self, n_in, n_out, how):
        super().__init__(n_in, n_out)
        self.how = how

    def forward(self, x):
        w = self.weight
        transposed = {"T": lambda: w.T, "t": lambda: w.t(), "transpose": lambda: w.transpose(-1, -2),
                      "mT": lambda: w.mT, "twice": lambda: w.T @ w}[self.how]()
        return x @ transposed + self.bias if self.how != "twice" else x @ transposed


def test_orientation_is_read_from_the_forward_not_the_class():
    from transformers.pytorch_utils import Conv1D

    assert linear_weight_orientation(Conv1D(12, 4)) is True  # weight (4, 12): x @ W
    assert linear_weight_orientation(Conv1D(8, 8)) is True  # square: only the forward can tell
    assert linear_weight_orientation(_OutIn(4, 12)) is False
    assert linear_weight_orientation(_NotLinear(8)) is None
    assert linear_weight_orientation(nn.LayerNorm(8)) is None


@pytest.mark.parametrize("how", ["T", "t", "transpose", "mT"])
def test_a_transposed_weight_view_is_an_out_in_linear(how):
    from transformers.models.falcon.modeling_falcon import FalconLinear

    assert linear_weight_orientation(_Transposed(12, 4, how)) is False
    assert linear_weight_orientation(_Transposed(8, 8, how)) is False  # square: the transpose tells
    assert linear_weight_orientation(FalconLinear(12, 4)) is False


def test_a_weight_used_twice_is_not_a_linear():
    assert linear_weight_orientation(_Transposed(8, 8, "twice")) is None  # x @ (W^T W): not one product with x


class _Router(nn.Module):
    """GPT-OSS's router: multiplies by its own [experts, in] weight, then returns the logits with the
    top-k scores and indices, a tuple."""

    def __init__(self, n_in, experts):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(experts, n_in))

    def forward(self, x):
        logits = nn.functional.linear(x, self.weight)
        scores, indices = logits.topk(2, dim=-1)
        return logits, scores, indices


class _Routed(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.router = nn.Linear(8, 8), _Router(8, 4)

    def forward(self, x):
        logits, _, _ = self.router(x)
        return self.up(x) * logits.softmax(-1).sum(-1, keepdim=True)


def test_a_module_returning_more_than_its_product_is_not_a_linear():
    """A TP style's output hook takes the module's one output tensor: GPT-OSS's router, planned
    colwise as a linear by structure, failed every tp plan with 'tuple' has no attribute
    'placements'. Such a module is not recorded as a linear, so it stays replicated."""
    from planner.profiler.opgraph import record_op_graph

    ops = {op.name: op for op in record_op_graph(_Routed().to("meta"), (torch.empty(2, 3, 8, device="meta"),), {})}
    assert linear_weight_orientation(_Router(8, 4)) is False  # a linear by structure...
    assert set(ops) == {"up"}  # ...but not a shardable one


class _WritesInPlace(nn.Module):
    """A unit that adds into its second linear's output in place (as Falcon's decoder layer does)."""

    def __init__(self, how):
        super().__init__()
        self.up, self.down, self.how = nn.Linear(8, 16), nn.Linear(16, 8), how

    def forward(self, x):
        h = self.down(torch.relu(self.up(x)))
        if self.how == "iadd":
            h += x
        elif self.how == "method":
            h.add_(x)
        elif self.how == "view":
            h[..., :4] = 0.0
        else:
            h = h + x
        return h


@pytest.mark.parametrize("how,written", [("iadd", True), ("method", True), ("view", True), ("out-of-place", False)])
def test_op_graph_flags_a_linear_output_written_in_place(how, written):
    from planner.profiler.opgraph import record_op_graph

    ops = {op.name: op for op in record_op_graph(_WritesInPlace(how).to("meta"), (torch.empty(2, 3, 8, device="meta"),), {})}
    assert ops["down"].output_written_in_place is written
    assert ops["up"].output_written_in_place is False  # relu makes a new tensor


@pytest.fixture(scope="module")
def gpt2_meta_profile():
    return profile_model(hf.__file__, GPT2, [1], device="meta")


def test_op_graph_records_conv1d_linears_with_orientation(gpt2_meta_profile):
    block = next(u for u in gpt2_meta_profile.units if u.kind == "GPT2Block")
    ops = {op.name: op for op in block.ops}
    linears = {n: (op.weight_shape, op.weight_in_out) for n, op in ops.items() if op.kind == "linear"}
    assert linears == {"attn.c_attn": ([64, 192], True), "attn.c_proj": ([64, 64], True),
                       "mlp.c_fc": ([64, 256], True), "mlp.c_proj": ([256, 64], True)}
    assert [n for n, op in ops.items() if op.fused_attention_input] == ["attn.c_attn"]
    assert ops["mlp.c_proj"].inputs == ["mlp.c_fc"]
    assert ops["mlp.c_fc"].forward_flops == 2 * 32 * 64 * 256  # tokens x in x out multiply-adds
    head = next(u for u in gpt2_meta_profile.units if u.name == "lm_head")
    assert head.ops[0].weight_in_out is False  # nn.Linear keeps [out, in]


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_ilp_shards_gpt2_mlp_and_keeps_fused_qkv_replicated(gpt2_meta_profile, sequence_parallel):
    block = next(u for u in gpt2_meta_profile.units if u.kind == "GPT2Block")
    problem = IntraOpProblem(tuple(block.ops), 2, 4, 1e-12, _Collectives(), sequence_parallel=sequence_parallel,
                             require_sharding=True)
    plan = solve_intra_op(problem).tp_plan
    assert plan["attn.c_attn"] == "replicate"  # a contiguous column shard of [q | k | v] is not whole heads
    if sequence_parallel:  # Megatron's SP layout needs every linear sharded: the block stays replicated
        assert set(plan.values()) == {"replicate"}
    else:
        assert (plan["mlp.c_fc"], plan["mlp.c_proj"]) == ("colwise", "rowwise")


def test_ilp_reads_in_out_weights_the_right_way_round(gpt2_meta_profile):
    """At tp=128 only the 256-feature side of the MLP splits: c_fc (weight [64, 256], out 256) is
    colwise only, c_proj ([256, 64], in 256) rowwise only. Reading them as [out, in] swaps both."""
    from planner.solver.intra_op import _op_strategies

    block = next(u for u in gpt2_meta_profile.units if u.kind == "GPT2Block")
    ops = {op.name: op for op in block.ops}
    assert set(_op_strategies(ops["mlp.c_proj"], 128, {})) == {"replicate", "rowwise"}
    assert set(_op_strategies(ops["mlp.c_fc"], 128, {})) == {"replicate", "colwise"}


@pytest.mark.slow
def test_solved_gpt2_tp2_plan_trains_like_one_process(tmp_path):
    from tests.test_runtime_parity import check_parity

    profile = profile_model(hf.__file__, GPT2, [1, 2], device="cpu", repeats=1, warmup=0)
    plan = solve(profile, make_cluster(2, gpu="cpu"), 4, Pins(tp=2))
    shards = {n: s for st in plan.stages for n, s in st.tp_plan.items() if s != "replicate"}
    assert {"transformer.h.0.mlp.c_fc", "transformer.h.0.mlp.c_proj"} <= set(shards), shards
    assert all(not n.endswith("attn.c_attn") for n in shards)
    check_parity(plan, tmp_path)


class _FusedGlu(nn.Module):
    """gate|up in one projection, cut in two (Phi-3's MLP), and a q projection viewed into heads
    whose last dim is sliced for rotary (Llama's): only the first is a cut of the features."""

    def __init__(self, how):
        super().__init__()
        self.gate_up, self.down, self.q, self.how = nn.Linear(8, 32), nn.Linear(16, 8), nn.Linear(8, 8), how

    def forward(self, x):
        y = self.gate_up(x)
        gate, up = {"chunk": lambda: y.chunk(2, dim=-1), "split": lambda: torch.split(y, 16, -1),
                    "slice": lambda: (y[..., :16], y[..., 16:]),
                    "transposed": lambda: (t.transpose(1, 2) for t in y.transpose(1, 2).chunk(2, dim=1))}[self.how]()
        q = self.q(x).view(*x.shape[:2], 2, 4)
        half = q[..., :2]  # rotary's rotate_half: a cut of the head dim, not of q's features
        return self.down(gate * up) + half.sum()


@pytest.mark.parametrize("how", ["chunk", "split", "slice", "transposed"])
def test_op_graph_flags_a_linear_output_cut_along_its_features(how):
    from planner.profiler.opgraph import record_op_graph

    ops = {op.name: op for op in record_op_graph(_FusedGlu(how).to("meta"), (torch.empty(2, 3, 8, device="meta"),), {})}
    assert ops["gate_up"].output_split_on_features is True
    assert ops["q"].output_split_on_features is False and ops["down"].output_split_on_features is False


class _NormedProjection(nn.Module):
    """q normalised over all its features before the heads are split (OLMo 2), beside a per-head
    norm (Qwen 3's, over head_dim: not a reduction of the projection's features)."""

    def __init__(self, how):
        super().__init__()
        self.q, self.k, self.how = nn.Linear(8, 8), nn.Linear(8, 8), how

    def forward(self, x):
        q = self.q(x)
        q = {"rms": lambda: q * q.pow(2).mean(-1, keepdim=True).rsqrt(), "layer_norm": lambda: F.layer_norm(q, (8,)),
             "softmax": lambda: q.softmax(dim=-1)}[self.how]()
        k = self.k(x).view(*x.shape[:2], 2, 4)
        k = F.rms_norm(k, (4,))
        return q + k.flatten(-2)


@pytest.mark.parametrize("how", ["rms", "layer_norm", "softmax"])
def test_op_graph_flags_a_linear_output_reduced_over_its_features(how):
    from planner.profiler.opgraph import record_op_graph

    ops = {op.name: op for op in record_op_graph(_NormedProjection(how).to("meta"), (torch.empty(2, 3, 8, device="meta"),), {})}
    assert ops["q"].output_reduced_on_features is True
    assert ops["k"].output_reduced_on_features is False  # per head


class _Heads(nn.Module):
    """Projections viewed into heads: inferred count (Llama's view(b, s, -1, head_dim)), written-out
    count with the sequence inferred (OPT's view(bsz, -1, num_heads, head_dim)), written-out count
    with the head dim inferred, and BLOOM's fused view(b, s, num_heads, 3, head_dim)."""

    def __init__(self, how):
        super().__init__()
        self.q, self.how = nn.Linear(8, 8), how

    def forward(self, x):
        b, s, _ = x.shape
        q = self.q(x)
        return {"inferred": lambda: q.view(b, s, -1, 4), "shape": lambda: q.view((*x.shape[:2], -1, 4)),
                "opt": lambda: q.view(b, -1, 2, 4), "reshape": lambda: q.reshape(b, s, 2, 4),
                "head_dim_inferred": lambda: q.view(b, s, 2, -1),
                "bloom": lambda: q.view(b, s, 2, 2, 2), "bloom_inferred": lambda: q.view(b, s, -1, 2, 2)}[self.how]()


@pytest.mark.parametrize("how,fixed", [("inferred", False), ("shape", False), ("opt", True), ("reshape", True),
                                       ("head_dim_inferred", True), ("bloom", True), ("bloom_inferred", False)])
def test_op_graph_flags_heads_written_out_in_a_view(how, fixed):
    from planner.profiler.opgraph import record_op_graph

    ops = {op.name: op for op in record_op_graph(_Heads(how).to("meta"), (torch.empty(2, 3, 8, device="meta"),), {})}
    assert ops["q"].output_heads_fixed is fixed


class _FusedAttention(nn.Module):
    """One projection feeding more than one of q, k and v of a fused attention (2 heads of 4), then
    `dense` on the attention's output:
    - "neox": `qkv` viewed into (b, s, -1, 3 x head_dim), each head's q, k, v side by side (GPT-NeoX);
    - "gpt2": `qkv` cut into [q | k | v] along its features first (GPT-2's c_attn);
    - "falcon": `qkv` viewed into (-1, 3 x head_dim) blocks, then q, k and v reshaped with the head
      count written out (as Falcon's new decoder architecture does), which a column shard breaks;
    - "mla": `kv` gives each head its k and v side by side, k completed by a rotary part that the
      replicated `rope` gives every head, copied into a fresh tensor (DeepSeek-V3's kv_b_proj)."""

    def __init__(self, how):
        super().__init__()
        self.how, self.dense = how, nn.Linear(8, 8)
        if how == "mla":
            self.q, self.kv, self.rope = nn.Linear(8, 12), nn.Linear(8, 16), nn.Linear(8, 2)
        else:
            self.qkv = nn.Linear(8, 24)

    def forward(self, x):
        b, s, _ = x.shape
        if self.how == "mla":
            k_nope, v = self.kv(x).view(b, s, -1, 8).transpose(1, 2).split([4, 4], dim=-1)
            k = k_nope.new_empty(*k_nope.shape[:-1], 6)
            k[..., :4].copy_(k_nope)
            k[..., 4:].copy_(self.rope(x).view(b, 1, s, 2).expand(-1, k_nope.shape[1], -1, -1))
            q = self.q(x).view(b, s, -1, 6).transpose(1, 2)
        elif self.how == "gpt2":
            q, k, v = (t.view(b, s, -1, 4).transpose(1, 2) for t in self.qkv(x).split(8, dim=2))
        else:
            q, k, v = self.qkv(x).view(b, s, -1, 12).transpose(1, 2).chunk(3, dim=-1)
            if self.how == "falcon":
                q, k, v = (t.reshape(b, 2, s, 4) for t in (q, k, v))
        return self.dense(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, s, -1))


def _fused_ops(how):
    from planner.profiler.counters import MetaAttentionMode
    from planner.profiler.opgraph import record_op_graph

    with MetaAttentionMode():
        return {op.name: op for op in record_op_graph(_FusedAttention(how).to("meta"), (torch.empty(2, 3, 8, device="meta"),), {})}


@pytest.mark.parametrize("how,fused", [("neox", False), ("gpt2", True), ("falcon", True)])
def test_a_projection_feeding_q_k_and_v_head_by_head_may_be_column_sharded(how, fused):
    """A projection whose output holds q, k and v is column-sharded only where a shard holds whole
    heads of each, and the unit's code runs on one (the profiler tries it, `_shards_whole_heads`)."""
    from planner.solver.intra_op import _heads_of, _op_strategies

    ops = _fused_ops(how)
    assert ops["qkv"].fused_attention_input is fused
    assert ops["qkv"].output_heads == (None if how == "gpt2" else 2)
    assert ("colwise" in _op_strategies(ops["qkv"], 2, _heads_of(list(ops.values())))) is not fused


def test_what_a_unit_writes_into_a_view_reaches_what_reads_it():
    """DeepSeek-V3 fills its keys by copies into slices of a fresh tensor: the replicated rotary
    projection reaches the attention through them, so attention is not sharded over heads that
    part of k is not (each rank would sum that projection's gradient over its own heads only)."""
    from planner.solver.intra_op import IntraOpProblem, solve_intra_op

    ops = _fused_ops("mla")
    attention = next(op for op in ops.values() if op.kind == "attention")
    assert set(attention.inputs) == {"q", "kv", "rope"}
    assert ops["kv"].output_heads == 2 and not ops["kv"].fused_attention_input  # each head's k and v side by side
    problem = IntraOpProblem(ops=tuple(ops.values()), tp_degree=2, dtype_bytes=2, seconds_per_flop=1e-6,
                             collectives=_Collectives(), require_sharding=True)
    assert solve_intra_op(problem).strategies[attention.name] != "heads"


class _SubNorms(nn.Module):
    """A block that norms what several ops combine into: "bitnet" norms the attention's output over
    all heads before o_proj and act(gate) * up over the intermediate features before down (BitNet's
    attn_sub_norm and ffn_sub_norm); "gemma" norms o_proj's and down's outputs, after the
    projections, before they join the residual stream (Gemma 2's post-norms)."""

    def __init__(self, how):
        super().__init__()
        self.how = how
        self.attn = nn.ModuleDict({name: nn.Linear(8, 8) for name in "qkvo"})
        self.mlp = nn.ModuleDict(dict(gate=nn.Linear(8, 16), up=nn.Linear(8, 16), down=nn.Linear(16, 8)))

    def forward(self, x):
        b, s, _ = x.shape
        a, m = self.attn, self.mlp
        q, k, v = (a[name](x).view(b, s, -1, 4).transpose(1, 2) for name in "qkv")
        attn = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, s, -1)
        if self.how == "bitnet":
            h = x + a["o"](F.rms_norm(attn, (8,)))
            return h + m["down"](F.rms_norm(F.silu(m["gate"](h)) * m["up"](h), (16,)))
        h = x + F.rms_norm(a["o"](attn), (8,))
        return h + F.rms_norm(m["down"](F.silu(m["gate"](h)) * m["up"](h)), (8,))


@pytest.mark.parametrize("how", ["bitnet", "gemma"])
def test_a_norm_over_what_several_ops_combine_keeps_them_whole(how):
    """BitNet's sub-norms read whole features: sharded, each rank normed its half with a whole
    weight (its tp 2 plan failed at the first forward), and under SP the ILP, its Megatron layout
    barred, chose one the runtime ran to other parameters. The gate, the up projection and the
    attention's heads are never sharded, and SP keeps such a unit whole; Gemma's post-norms after
    the projections change neither."""
    from planner.profiler.counters import MetaAttentionMode
    from planner.profiler.opgraph import record_op_graph
    from planner.solver.intra_op import _heads_of, _op_strategies, _sequence_parallel_blocked

    with MetaAttentionMode():
        ops = {op.name: op for op in record_op_graph(_SubNorms(how).to("meta"), (torch.empty(2, 3, 8, device="meta"),), {})}
    attention = next(op for op in ops.values() if op.kind == "attention")
    bitnet = how == "bitnet"
    assert {n for n, op in ops.items() if op.output_reduced_on_features} == (
        {attention.name, "mlp.gate", "mlp.up"} if bitnet else {"attn.o", "mlp.down"})
    heads = _heads_of(list(ops.values()))
    assert ("heads" in _op_strategies(attention, 2, heads)) is not bitnet
    assert ("colwise" in _op_strategies(ops["mlp.gate"], 2, heads)) is not bitnet
    assert _sequence_parallel_blocked(list(ops.values())) is bitnet


def test_a_profile_written_before_the_output_checks_gets_no_tensor_parallelism(gpt2_meta_profile, tmp_path):
    """Its flags read false whatever the model does: tp is refused with the fix named, pinned or free."""
    import json

    from planner.errors import PlannerError
    from planner.profile_schema import OP_CHECKS, load_profile

    path = gpt2_meta_profile.save(tmp_path / "current.json")
    assert load_profile(path).op_checks == OP_CHECKS >= 2
    data = json.loads(path.read_text())
    del data["op_checks"]
    (tmp_path / "old.json").write_text(json.dumps(data))
    old = load_profile(tmp_path / "old.json")
    assert old.op_checks == 0
    cluster = make_cluster(2, None, "a100-80gb")
    with pytest.raises(PlannerError, match="re-profile"):
        solve(old, cluster, 8, Pins(tp=2))
    plan = solve(old, cluster, 8)
    assert plan.layout.tp_degree == 1
    assert any("re-profile" in note for note in plan.search.notes)
    assert solve(load_profile(path), cluster, 8, Pins(tp=2)).layout.tp_degree == 2


class _BloomAttention(nn.Module):
    """BLOOM's attention: one fused projection viewed into (heads, 3, head_dim) with the heads
    written out, and scores by hand on (batch x heads, s, s) tensors."""

    def __init__(self):
        super().__init__()
        self.qkv, self.dense = nn.Linear(8, 24), nn.Linear(8, 8)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 2, 3, 4).unbind(3)
        q, k, v = (t.transpose(1, 2).reshape(b * 2, s, 4) for t in (q, k, v))
        probs = torch.bmm(q, k.transpose(1, 2)).softmax(-1)
        return self.dense(torch.bmm(probs, v).view(b, 2, s, 4).transpose(1, 2).reshape(b, s, 8))


def test_a_unit_whose_hand_written_attention_reads_an_unshardable_projection_stays_replicated_under_sp():
    """Its projection cannot be column-sharded (heads written out), so its attention would stay
    replicated and, under SP, mix only this rank's share of the tokens: the unit is kept whole."""
    from planner.profiler.opgraph import record_op_graph
    from planner.solver.intra_op import _sequence_parallel_blocked

    ops = record_op_graph(_BloomAttention().to("meta"), (torch.empty(2, 3, 8, device="meta"),), {})
    assert {op.name: op.output_heads_fixed for op in ops if op.kind == "linear"} == {"qkv": True, "dense": False}
    assert _sequence_parallel_blocked(ops)


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_plan_says_what_tensor_parallelism_leaves_whole(gpt2_meta_profile, sequence_parallel):
    """GPT-2 under tp 2 keeps its fused q|k|v (and, beside it, the attention's output projection)
    whole on every rank, and shards its tied embedding along the vocabulary in both holders; the
    plan's note gives the share of weights split, counted from the plan's own TP plan, and names
    the whole modules by pattern with why. GPT-2's own vocabulary (50257, odd) keeps the tied
    pair whole, and the note says why."""
    import math
    import re

    plan = solve(gpt2_meta_profile, make_cluster(2, gpu="cpu"), 4, Pins(tp=2, pp=1, sequence_parallel=sequence_parallel))
    note = next(n for n in plan.search.notes if n.startswith("tensor parallelism"))
    styles = {name: style for stage in plan.stages for name, style in stage.tp_plan.items()}
    sizes = {f"{u.name}.{op.module}" if op.module else u.name: math.prod(op.weight_shape)
             for u in gpt2_meta_profile.units for op in u.ops if op.weight_shape}
    sizes.pop("lm_head")  # tied to transformer.wte: one weight
    split = sum(size for name, size in sizes.items() if styles.get(name, "replicate") != "replicate")
    assert f"splits {split / sum(sizes.values()):.0%} of the weights" in note
    assert "transformer.h.*.attn.c_attn x2 (its output holds q, k and v together" in note
    assert (styles["transformer.wte"], styles["lm_head"]) == ("rowwise", "colwise") and "wte" not in note
    odd = profile_model(hf.__file__, {**GPT2, "vocab_size": 257}, [1], device="meta")
    plan = solve(odd, make_cluster(2, gpu="cpu"), 4, Pins(tp=2, pp=1, sequence_parallel=sequence_parallel))
    note = next(n for n in plan.search.notes if n.startswith("tensor parallelism"))
    assert "transformer.wte (tied to lm_head: a tied weight is sharded only where every holder can split its first dim 2 ways)" \
        in note, note
    if sequence_parallel:  # the fused projection keeps each block whole under SP, MLP included
        assert re.search(r"mlp.c_fc x2 \(sequence parallelism keeps its unit whole", note), note
    else:
        assert "mlp" not in note  # the MLP splits: c_fc colwise, c_proj rowwise


def test_plan_says_a_megatron_gpt_splits_every_weight():
    """examples/gpt.py at a size where the collectives pay on H100s: every weight splits, and the
    note says so without a list; a plan without TP has no such note."""
    prof = profile_model(str(EXAMPLES / "gpt.py"), dict(n_layers=2, d_model=2048, n_heads=16, vocab_size=8192, seq_len=1024),
                         [1], device="meta", gpu="h100-80gb", dtype="bfloat16")
    cluster = make_cluster(2, gpu="h100-80gb")
    plan = solve(prof, cluster, 4, Pins(tp=2, pp=1))
    assert "tensor parallelism (tp 2) splits 100% of the weights of linears, embeddings and convolutions" in plan.search.notes
    assert not any(note.startswith("tensor parallelism") for note in solve(prof, cluster, 4, Pins(tp=1)).search.notes)


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_copies_of_outputs_written_in_place_are_priced(sequence_parallel):
    """The runtime clones a sharded output the model writes in place (`Stage.tp_copy_outputs`):
    one read and one write of the local output per forward, at the GPU's bandwidth. Flagging
    examples/gpt.py's MLP outputs as written in place adds exactly that to each block's forward
    (and to its full recomputation), not to its backward: the colwise up-projection's slice of the
    features, the rowwise down-projection's whole output (its slice of the sequence under SP)."""
    import math

    from planner.cost.collectives import CollectiveModel, group_placement
    from planner.cost.compute import ComputeModel
    from planner.solver.costs import UnitCosts

    args = dict(n_layers=2, d_model=1024, n_heads=16, d_ff=4096, vocab_size=32000, seq_len=2048)
    plain = profile_model(str(EXAMPLES / "gpt.py"), args, [1, 2], device="meta", gpu="h100-80gb", dtype="bfloat16")
    written = plain.model_copy(deep=True)
    for unit in written.units:
        for op in unit.ops:
            op.output_written_in_place = op.kind == "linear" and op.module is not None and op.module.startswith("mlp")
    cluster = make_cluster(8, 8, "h100-80gb")
    coll = CollectiveModel(cluster)

    def table(profile):
        costs = UnitCosts(profile, ComputeModel(profile, cluster.gpu, "bfloat16"),
                          lambda t: coll.for_group(group_placement(cluster, t, 1)), "bfloat16")
        return costs.table(2, sequence_parallel, 2)

    before, after = table(plain), table(written)
    block = next(u for u in plain.units if u.name == "blocks.0")
    styles = {op.module: before.tp_plans[block.index][op.module] for op in block.ops if op.module and op.module.startswith("mlp")}
    assert sorted(styles.values()) == ["colwise", "rowwise"]
    local = sum(math.prod(op.output_shape) * 2 / (1 if styles[op.module] == "rowwise" and not sequence_parallel else 2)
                for op in block.ops if op.module in styles)  # micro-batch 2: twice the traced batch of 1
    copy_s = 2 * local * 2 / cluster.gpu.achievable_bandwidth
    assert after.forward_s[block.index] - before.forward_s[block.index] == pytest.approx(copy_s, rel=1e-9)
    assert after.recompute_s["full"][block.index] - before.recompute_s["full"][block.index] == pytest.approx(copy_s, rel=1e-9)
    assert after.backward_s[block.index] == before.backward_s[block.index]
    head = next(u for u in plain.units if u.name == "head")
    assert after.forward_s[head.index] == before.forward_s[head.index]


class _GatedMix(nn.Module):
    """Qwen3.5's gated delta net in small: a whole-width core computed from one projection,
    gated elementwise by another before the output projection."""

    def __init__(self):
        super().__init__()
        self.in_proj_qkv, self.in_proj_z, self.out_proj = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        core = torch.tanh(self.in_proj_qkv(x))
        return self.out_proj(core * torch.sigmoid(self.in_proj_z(x)))


class _GatedUnit(nn.Module):
    def __init__(self):
        super().__init__()
        self.mix = _GatedMix()

    def forward(self, x):
        return x + self.mix(x)


def _gated_problem():
    from planner.profiler.opgraph import record_op_graph

    ops = tuple(record_op_graph(_GatedUnit().to("meta"), (torch.empty(2, 3, 8, device="meta"),), {}))
    return IntraOpProblem(ops, 2, 4, 1e-12, _Collectives(), require_sharding=True)


@pytest.mark.parametrize("strategies,blamed", [
    # Qwen3.5's plan that failed at the first forward: the sharded z gating the whole core; out_proj
    # paired with z, reading that merge. (in_proj_qkv, rowwise, was paired then by its colwise
    # sibling yet fed the replicated input; paired by data flow, it slices that input, as priced.)
    (dict(qkv="rowwise", z="colwise", out="rowwise"), {"z", "out"}),
    (dict(qkv="replicate", z="colwise", out="rowwise"), {"z", "out"}),  # a Megatron pair, but z gates a whole core
    (dict(qkv="replicate", z="replicate", out="rowwise"), set()),  # alone: slices its replicated input
    (dict(qkv="colwise", z="replicate", out="replicate"), set()),  # alone: gathers its output
])
def test_plans_the_runtime_cannot_run_as_priced_are_found(strategies, blamed):
    from planner.solver.intra_op import _unrunnable

    names = {"qkv": "mix.in_proj_qkv", "z": "mix.in_proj_z", "out": "mix.out_proj"}
    chosen = {names[k]: v for k, v in strategies.items()}
    assert _unrunnable(_gated_problem(), chosen) == {names[k] for k in blamed}


class _PerByte:
    """Every collective at `seconds` per byte."""

    def __init__(self, seconds: float):
        self.seconds = seconds

    def all_reduce_s(self, nbytes):
        return self.seconds * nbytes

    all_gather_s = reduce_scatter_s = all_to_all_s = all_reduce_s


class _HeadsWrittenOut(nn.Module):
    """Attention whose projections are viewed into a written-out head count (OPT's `view(b, s,
    num_heads, head_dim)`): no colwise q, k or v, so sharded heads could only come from slicing or
    reduce-scattering their outputs, which the ILP prices and the runtime cannot do."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(16, 16) for _ in range(4))

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (p(x).view(b, s, 2, 8).transpose(1, 2) for p in (self.q, self.k, self.v))
        return x + self.o(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, 16))


def test_solved_unit_plans_are_runnable_as_priced(gpt2_meta_profile):
    """The ILP alone gives that attention sharded heads (q, k, v rowwise, or replicated and
    sliced, whatever the collectives cost); the solver re-solves with the blamed attention
    replicated, so its answer runs as priced. A Megatron MLP is left as it was."""
    from planner.profiler.opgraph import record_op_graph
    from planner.solver.intra_op import _solve, _unrunnable

    ops = tuple(record_op_graph(_HeadsWrittenOut().to("meta"), (torch.empty(2, 64, 16, device="meta"),), {}))
    for per_byte in (1e-12, 1e-6):
        problem = IntraOpProblem(ops, 2, 4, 1e-9, _PerByte(per_byte), require_sharding=True)
        assert _unrunnable(problem, _solve(problem).strategies) == {"attention_1"}
        solution = solve_intra_op(problem)
        assert solution.strategies["attention_1"] == "replicate" and not _unrunnable(problem, solution.strategies)
        assert {"rowwise", "colwise"} & set(solution.tp_plan.values())  # TP is pinned: something still shards
    problem = _gated_problem()
    assert not _unrunnable(problem, solve_intra_op(problem).strategies)
    block = next(u for u in gpt2_meta_profile.units if u.kind == "GPT2Block")
    plan = solve_intra_op(IntraOpProblem(tuple(block.ops), 2, 4, 1e-12, _Collectives(), require_sharding=True)).tp_plan
    assert (plan["mlp.c_fc"], plan["mlp.c_proj"]) == ("colwise", "rowwise")


class _SplitSiblings(nn.Module):
    """BERT's layer in small: q, k and v under one module, the output projection under another;
    the MLP's two linears under two more (`intermediate.dense`, `output.dense`)."""

    def __init__(self, d=8, heads=2):
        super().__init__()
        self.heads = heads
        self.self_attn = nn.ModuleDict(dict(query=nn.Linear(d, d), key=nn.Linear(d, d), value=nn.Linear(d, d)))
        self.attn_out = nn.ModuleDict(dict(dense=nn.Linear(d, d)))
        self.intermediate = nn.ModuleDict(dict(dense=nn.Linear(d, 4 * d)))
        self.output = nn.ModuleDict(dict(dense=nn.Linear(4 * d, d)))

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (self.self_attn[n](x).view(b, s, -1, 4).transpose(1, 2) for n in ("query", "key", "value"))
        a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, s, -1)
        h = x + self.attn_out["dense"](a)
        return h + self.output["dense"](F.gelu(self.intermediate["dense"](h)))


def _split_siblings(sequence_parallel: bool = False):
    from planner.profiler.opgraph import record_unit

    ops, regions = record_unit(_SplitSiblings().to("meta"), (torch.empty(2, 3, 8, device="meta"),), {})
    return IntraOpProblem(tuple(ops), 2, 4, 1e-12, _Collectives(), require_sharding=True,
                          sequence_parallel=sequence_parallel), regions


def test_a_column_and_a_row_shard_pair_by_data_flow_not_by_parent():
    """The row-parallel modules read column-sharded features from modules under other parents:
    paired all the same (`sharded_feeds`), so the plan runs as the ILP priced it (no gather of
    the intermediate features, no slice), and the plan tells the runtime so (`Stage.tp_feeds`).
    Under sequence parallelism, whose gathers sit at a pair's parent, such pairs are blamed."""
    from planner.solver.intra_op import _unrunnable, sharded_feeds

    problem, _ = _split_siblings()
    megatron = {"self_attn.query": "colwise", "self_attn.key": "colwise", "self_attn.value": "colwise",
                "attention_1": "heads", "attn_out.dense": "rowwise", "intermediate.dense": "colwise",
                "output.dense": "rowwise"}
    assert sharded_feeds(list(problem.ops), megatron) == {
        "attn_out.dense": ["self_attn.key", "self_attn.query", "self_attn.value"],
        "output.dense": ["intermediate.dense"]}
    assert _unrunnable(problem, megatron) == frozenset()
    solution = solve_intra_op(problem)
    assert solution.strategies["intermediate.dense"] == "colwise" and solution.strategies["output.dense"] == "rowwise"
    under_sp, _ = _split_siblings(sequence_parallel=True)
    assert _unrunnable(under_sp, megatron) == set(megatron) - {"attention_1"}


def test_saved_bytes_are_told_apart_by_the_ops_they_come_from():
    """What the unit saves for backward, by the ops each tensor was computed from: the unit's
    input (saved by q, k and v), what attention keeps (its own copies of q, k and v in heads,
    its output, the log-sum-exp; made inside the kernel, so its own), the residual stream after
    the output projection (which mixes in the input), the MLP's column-sharded features (GELU's
    input and output). A TP layout splits the regions whose every op splits its output."""
    from planner.solver.costs import split_saved_share

    problem, regions = _split_siblings()
    by_ops = {tuple(r.ops): r.bytes for r in regions}
    row = 2 * 3 * 4  # bytes of one (b, s) position's float32 features, per feature
    assert by_ops[("input",)] == row * 8
    assert by_ops[("intermediate.dense",)] == 2 * row * 32  # GELU's input and its output
    assert by_ops[("attn_out.dense", "input")] == row * 8  # h, saved by intermediate.dense
    assert by_ops[("attention_1",)] >= 4 * row * 8  # q, k, v and the output, at least
    assert set(by_ops) == {("input",), ("intermediate.dense",), ("attn_out.dense", "input"), ("attention_1",)}
    unit = SimpleNamespace(saved_regions=regions)
    megatron = {"self_attn.query": "colwise", "self_attn.key": "colwise", "self_attn.value": "colwise",
                "attention_1": "heads", "attn_out.dense": "rowwise", "intermediate.dense": "colwise",
                "output.dense": "rowwise"}
    total = sum(by_ops.values())
    split = total - by_ops[("input",)] - by_ops[("attn_out.dense", "input")]
    assert split_saved_share(unit, megatron, False) == pytest.approx(split / total)
    mlp_only = {**megatron, **{n: "replicate" for n in ("self_attn.query", "self_attn.key", "self_attn.value",
                                                        "attn_out.dense")}, "attention_1": "replicate"}
    assert split_saved_share(unit, mlp_only, False) == pytest.approx(by_ops[("intermediate.dense",)] / total)
    assert split_saved_share(unit, megatron, True) == pytest.approx(1.0)  # under SP the stream is sequence-sharded too
