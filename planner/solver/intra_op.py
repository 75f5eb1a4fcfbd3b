"""Intra-op (tensor-parallel) layouts of one unit: an integer linear program.

Per distinct unit structure (fingerprint), TP degree and boundary layout the solver picks
one strategy per matmul-like op of the unit's op graph (`Unit.ops`); identical blocks share
the answer (planner/solver/costs.py caches solutions per (fingerprint, tp, sequence parallel)). The graph is extended with *merge* nodes (an op fed by more than
one producer consumes their elementwise combination, e.g. the residual stream `x + wo(.)`
or SwiGLU's `silu(w1) * w3`), a fixed `input` node (the unit's input, in the boundary
layout B) and a fixed `output` node (the unit's sinks, required back in B).

Tensor layouts, a in A = {R replicate, F shard features/heads, S shard batch/sequence,
P partial sum}. Strategy s of a node fixes in(s) (layout it reads), out(s) (layout it
writes) and grad(s) (layout its input gradient comes back in):

    linear     replicate R->R (grad R) | colwise R->F (grad P) | rowwise F->P (grad F)
               | sequence S->S (grad S, parameters replicated: weight-gradient all-reduce)
    embedding  replicate R->R | rowwise (vocab-parallel) R->P | colwise R->F
    attention / batched matmul   heads F->F (grad F) | replicate R->R
    conv       replicate (DTensor has no conv TP style the runtime can apply)
    merge      R, F or S (in = out = grad)

B = S when sequence parallel is on, else R.

Variables
    x[v,s]      in {0,1}  node v uses strategy s                                      (1)
    eF[p,c,a,t] >= 0      share of edge p -> c with producer layout a, consumer reading t (1)
    eB[p,c,a,g] >= 0      share of edge p -> c with producer layout a, gradient back in g (1)
    yF[p,a,t]   in [0,1]  producer p writes a and some consumer reads t (forward)     (1)
    yB[p,a,g]   in [0,1]  producer p writes a and some consumer returns gradient g    (1)
    out[p,a] = sum_{s: out(s)=a} x[p,s]  (a constant for `input`);  want[c,t] likewise

Objective (seconds per micro-batch, forward + backward)
    min  sum_{v,s} x[v,s] (compute_s(v,s) + wgrad_s(v,s))
       + sum yF[p,a,t] conv_s(a -> t, bytes_p) + sum yB[p,a,g] conv_s(g -> h(a), bytes_p)
    compute_s = 3 x forward FLOPs x seconds_per_flop / (tp if sharded), h(P) = R, h(a) = a
    conv_s: same 0; R->F, R->S 0 (slice); P->R all-reduce; P->F, P->S reduce-scatter;
            F->R, S->R all-gather; F<->S all-to-all.  One yF per (p, a, t): a producer
            read in the same layout by several consumers pays once (q, k, v share x).

Constraints                                                   (function that adds them)
    one_strategy[v]:        sum_s x[v,s] = 1                           `_add_one_strategy`
    edge_out / edge_in:     sum_t e[p,c,a,t] = out[p,a],  sum_a e[p,c,a,t] = want[c,t]
                            (a transportation plan between the two marginals: tighter than the
                            AND linearisation y >= out + x - 1, so CBC closes the gap at the root)
                                                                       `_add_conversions`
    forward_conversion:     yF[p,a,t] >= eF[p,c,a,t] for every consumer c
    backward_conversion:    yB[p,a,g] >= eB[p,c,a,g] for every consumer c
    parameter_memory:       sum x[v,s] param_bytes(v,s) <= limit       `_add_parameter_memory`
    pinned_tp (TP pinned):  sum_{weighted v, s in colwise/rowwise} x[v,s] >= 1   `_add_pinned_tp`

Colwise on a linear feeding attention must split whole heads (`_heads_of`): the runtime
leaves its output sharded and the model's code splits it into its local heads. Where a TP
degree does not divide an attention's heads (`tp_obstacles`: multi-query attention's single
key/value head at any degree, two key/value heads at tp 4), that projection is offered no column
shard and the attention none, so they stay replicated (the ILP keeps a replicated attention's
other projections replicated too: `_unrunnable`) while the rest of the unit shards; under
sequence parallelism the whole unit stays replicated (`_sequence_parallel_blocked`).

A linear's features come from its weight as stored (`_linear_features`): [out, in] for
nn.Linear, [in, out] where the profile says `weight_in_out` (Hugging Face's Conv1D). A fused
q|k|v projection (`fused_attention_input`, GPT-2's `c_attn`) is never colwise: a contiguous
column shard gives a rank a mix of q, k and v, not whole heads, and the runtime does not
re-layout the columns per head as Megatron-LM does. Nor is a linear whose output the unit cuts
along its features (`output_split_on_features`: a fused gate|up projection chunked in two), for
the same reason, nor one whose features it reduces over (`output_reduced_on_features`: a norm
over all of q's features), which each rank would do over its own shard, nor one it splits into a
written-out number of heads (`output_heads_fixed`), whose view would fold a rank's share of the
features into the sequence. Its attention then runs replicated (the
runtime has no way to slice it), and under sequence parallelism such a unit stays wholly
replicated (`_sequence_parallel_blocked`): Megatron's layout needs every linear sharded, and a
replicated attention in the sequence-sharded region would see only its rank's tokens. So does a
unit whose linears are its own children (the pair's owner would be the unit itself).

First, a node whose strategy dominates (its worst case costs no more than any other's best) is
fixed to it (`_presolved`, exact); a unit that sequence parallelism keeps replicated is then
decided almost whole. Units with at most `TABLE_UP_TO` assignments of their free nodes left (a
transformer block has about 13,000) are solved exactly by pricing them all in one numpy array
(`_by_table`); larger ones by CBC with a time limit (`ILP_TIME_LIMIT_S`), the answer kept on disk. The same cost is
computed in closed form by `evaluate` for any assignment, which the tests compare with brute
force and with the ILP, and the search uses to re-price a cached plan at other micro-batch
sizes.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import os
from collections.abc import Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from pathlib import Path
from typing import NoReturn, Protocol

import numpy as np

from planner.cost.fp8 import FP8_ALL_GATHER_BYTES_FACTOR
from planner.errors import PlannerError
from planner.profile_schema import OpNode, Unit

ILP_TIME_LIMIT_S = 10.0
INPUT, OUTPUT = "input", "output"
STYLE = {"replicate": "replicate", "colwise": "colwise", "rowwise": "rowwise", "sequence": "sequence_parallel"}
# strategy -> (in, out, grad) layouts
LINEAR = {"replicate": ("R", "R", "R"), "colwise": ("R", "F", "P"), "rowwise": ("F", "P", "F"), "sequence": ("S", "S", "S")}
EMBEDDING = {"replicate": ("R", "R", None), "rowwise": ("R", "P", None), "colwise": ("R", "F", None)}
HEADS = {"heads": ("F", "F", "F"), "replicate": ("R", "R", "R")}
MERGE = {"R": ("R", "R", "R"), "F": ("F", "F", "F"), "S": ("S", "S", "S")}
SHARDED = {"colwise", "rowwise", "sequence", "heads", "F", "S"}


class TPCollectives(Protocol):
    """Times of the TP group's collectives on a tensor of `nbytes` (its full, unsharded size)."""

    def all_reduce_s(self, nbytes: float) -> float: ...
    def all_gather_s(self, nbytes: float) -> float: ...
    def reduce_scatter_s(self, nbytes: float) -> float: ...
    def all_to_all_s(self, nbytes: float) -> float: ...


@dataclass(frozen=True)
class IntraOpProblem:
    """One unit's op graph priced for one TP degree and micro-batch size."""

    ops: tuple[OpNode, ...]
    """The unit's matmul-like ops (profile `Unit.ops`)."""
    tp_degree: int
    """Ranks in the tensor-parallel group."""
    dtype_bytes: int
    """Bytes per activation and parameter element."""
    seconds_per_flop: float
    """Time of one matmul FLOP on the target GPU (1 / achievable FLOP/s)."""
    collectives: TPCollectives
    """Collective times within the TP group."""
    activation_scale: float = 1.0
    """Micro-batch size / the micro-batch size the op shapes were recorded at."""
    sequence_parallel: bool = False
    """Boundary layout B is sequence-sharded (S) instead of replicated (R)."""
    parameter_bytes_limit: float | None = None
    """Upper bound on this unit's parameter bytes per GPU (None: unbounded)."""
    require_sharding: bool = False
    """The TP degree is given: shard the unit's largest weight where it can be (constraint
    `pinned_tp`: one of the shardable ops of the most elements), rather than replicate it when
    collectives cost more than the compute they split. The TP runtimes shard every large weight
    whatever that costs (Megatron-LM's `VocabParallelEmbedding`, torchtitan's rowwise
    `tok_embeddings`): a token embedding the ILP kept whole for the all-reduce it saves would
    hold its full vocabulary on every rank of the group."""
    replicated_ops: frozenset[str] = frozenset()
    """Ops kept replicated whatever the cost (a MoE layer's router and experts: planner/solver/costs.py)."""
    pinned_ops: tuple[tuple[str, str], ...] = ()
    """(op, strategy) pairs held to that strategy where it is offered: the holders of a weight tied
    to another unit's, which every holder must shard alike (planner/solver/costs.py `tie_pins`)."""
    moe_blocks: frozenset[str] = frozenset()
    """Module paths (relative to the unit) of its MoE blocks, the parents of its experts modules,
    which the runtime runs on each rank's own tokens under SP (`_sequence_parallel_blocked`)."""
    mixes_tokens: bool = False
    """The unit moves information between tokens outside fused attention (profile
    `Unit.mixes_tokens`): SP keeps it whole (`_sequence_parallel_blocked`)."""
    fp8_gathered_ops: frozenset[str] = frozenset()
    """Linears whose input the stack casts to FP8 before gathering it (torchao's
    `Float8ColwiseParallel` / `PrepareFloat8ModuleInput`, as torchtitan applies them under Float8
    with TP): a forward all-gather all of whose readers are these moves 1 byte per element
    (`_Graph.fp8_sources`, planner/cost/fp8.py `FP8_ALL_GATHER_BYTES_FACTOR`). Empty: bf16, as the
    planner's runtime gathers (plain `ColwiseParallel` around torchao's `Float8Linear`)."""


@dataclass(frozen=True)
class IntraOpSolution:
    """A strategy per node and what it costs per micro-batch (forward + backward)."""

    strategies: dict[str, str]
    """Node (op name or `merge:<sources>`) -> strategy."""
    tp_plan: dict[str, str]
    """Module path relative to the unit -> DTensor style (ops that are modules only)."""
    compute_time_s: float
    """Matmul-like ops' time per GPU."""
    comm_time_s: float
    """TP collectives (resharding and weight-gradient all-reduce)."""
    parameter_bytes: float
    """Parameter bytes per GPU of the matmul-like ops."""
    collectives: list[str] = field(default_factory=list)
    """Human-readable list of the collectives paid, e.g. `fwd all-reduce attn.wo->merge`."""
    forward_comm_time_s: float = 0.0
    """The forward pass's share of `comm_time_s` (what full recomputation runs again)."""
    feeds: dict[str, list[str]] = field(default_factory=dict)
    """Each row-parallel op reading column-sharded features -> the column-parallel ops they come
    from (`sharded_feeds`); the plan's `Stage.tp_feeds` by module FQN."""
    async_comm_time_s: float = 0.0
    """`comm_time_s` as async TP leaves it exposed (`async_exposed_s`): each resharding collective
    overlapped only with the GEMMs it feeds or follows, chunk by chunk."""


@dataclass(frozen=True)
class _Graph:
    nodes: dict[str, dict[str, tuple]]  # node -> strategy -> (in, out, grad)
    sources: dict[str, str]  # consumer -> the single node it reads (an op, merge, or input)
    nbytes: dict[str, float]  # producer -> bytes of its output at this micro-batch size
    fp8_sources: frozenset[str] = frozenset()  # producers whose forward all-gathers move FP8 (`forward_conversion_s`)


OpGraph = _Graph
"""The op graph `evaluate` and `unit_scale_graph` share with callers that keep one per structure."""


def _numel(shape: list[int]) -> int:
    return math.prod(shape) if shape else 1


def _linear_features(op: OpNode) -> tuple[int, int]:
    """(in, out) features of a `linear` op, whichever way its weight is stored."""
    assert op.weight_shape is not None, "a linear op has a weight"
    in_f, out_f = op.weight_shape if op.weight_in_out else reversed(op.weight_shape)
    return in_f, out_f


def _fused_attention(ops) -> set[str]:
    """Attention ops (fused, or either matmul of a materialised one) fed by a fused q|k|v linear,
    and those that project inside (`OpNode.projections_inside`: torch's nn.MultiheadAttention)."""
    fused = {op.name for op in ops if op.kind == "linear" and op.fused_attention_input}
    return {op.name for op in ops if (_is_attention(op) and fused & set(op.inputs)) or op.projections_inside}


def _sequence_parallel_blocked(ops, moe_blocks: AbstractSet[str] = frozenset(), mixes_tokens: bool = False,
                               tp: int = 1) -> bool:
    """Whether sequence parallelism must leave this unit replicated: its attention cannot be
    sharded (a fused q|k|v projection, module docstring; a q or k projection whose features a
    norm reduces over, OLMo 2's), a fused projection is cut in pieces, or a linear is a direct
    child of the unit (torch's nn.TransformerEncoderLayer holds linear1 and linear2 beside its norms
    and attention). A pair's owner all-gathers its first input under SP (runtime/apply_tp.py);
    were the owner the unit, that would be the residual stream, which the unit then adds to the
    rowwise module's sequence-sharded output. Nor can attention computed by hand on any rank of
    tensor (`_mixes_tokens`: BLOOM's (batch x heads, s, s) scores) that reads such a linear, which
    would stay replicated and mix the tokens of this rank's share of the sequence alone. Nor
    attention that makes its projections inside (torch's nn.MultiheadAttention: ViT's blocks),
    which stays replicated for the same reason.

    Nor a linear fed flattened tokens [T, D] outside the unit's MoE blocks (`moe_blocks`, module
    paths: the parents of the experts the profile found, which the runtime runs on each rank's
    own tokens): SP wraps the modules of its region as sequence-sharded along dim 1, which there
    is the features. Llama 4's MoE block flattens its tokens for its router, shared expert and
    experts, whose forward takes tokens already routed and weighted (not an experts module
    `planner/moe.py` recognises): its SP plan failed at the router's first forward.

    Nor a unit where an op whose output the unit reduces over its features (so never sharded on
    them) feeds a linear or an attention directly, not through the residual stream (which carries
    the unit's input) and outside an MoE block (whose router's softmax feeds its experts): that
    would be the column half of a Megatron pair (BitNet norms its MLP's act(gate) *
    up and its attention's output before the projection after them; under SP its plan then
    trained to other parameters with no error). Gemma's norm of o_proj's output reaches the MLP
    through the residual stream and does not count.

    Nor a unit that moves information between tokens outside fused attention (`mixes_tokens`, the
    profile's `Unit.mixes_tokens`): RWKV's token shift and RecurrentGemma's recurrence would run on
    one rank's share of the sequence. Their tp2 plans with SP failed at the first forward (a DTensor
    met the time-mix weights; torch's SequenceParallel dropped the RG-LRU's second argument), and
    where nothing failed they would have trained on a cut sequence.

    Nor a unit whose attention `tp` cannot split into whole heads (`tp_obstacles`: a key/value
    projection of fewer heads than tp, as multi-query attention's single one), which stays
    replicated beside sharded neighbours: Megatron's layout has no place for it."""
    if mixes_tokens or tp_obstacles(ops, tp):
        return True
    if any(op.projections_inside for op in ops):  # torch's nn.MultiheadAttention (`OpNode.projections_inside`)
        return True
    heads = _heads_of(ops)
    unshardable = {op.name for op in ops if op.kind == "linear" and _column_shard_breaks(op)}
    reduced = {op.name for op in ops if op.output_reduced_on_features}

    def in_moe_block(op: OpNode) -> bool:
        return op.module is not None and any(not block or op.module.startswith(block + ".") for block in moe_blocks)
    if any(op.kind in ("linear", "attention") and INPUT not in op.inputs and reduced & set(op.inputs)
           and not in_moe_block(op) for op in ops):
        return True

    def flattened(op: OpNode) -> bool:
        return len(op.input_shape) == 2 and not in_moe_block(op)
    return any(op.kind == "linear" and (op.fused_attention_input or op.output_split_on_features
                                        or ((op.output_reduced_on_features or op.output_heads_fixed) and op.name in heads)
                                        or (op.module and "." not in op.module) or flattened(op)) for op in ops) \
        or any(_mixes_tokens(op) and unshardable & set(op.inputs) for op in ops)


def moe_blocks(unit: Unit) -> frozenset[str]:
    """`IntraOpProblem.moe_blocks` of a profiled unit: the parent of each experts module ("" when
    the unit is the block itself)."""
    return frozenset(layer.experts.rpartition(".")[0] for layer in unit.moe)


def _mixes_tokens(op: OpNode) -> bool:
    """Attention's core whatever its rank: fused, a product into square (s, s) scores (q @ k^T),
    or one of square scores (scores @ v). Not a mixture of experts' batched matmuls, which read
    the router's softmax over the experts but keep each token to itself."""
    if op.kind == "attention":
        return True
    return op.kind == "matmul" and len(op.input_shape) >= 3 and (
        op.output_shape[-1] == op.output_shape[-2] or op.input_shape[-1] == op.input_shape[-2])


def _column_shard_breaks(op: OpNode) -> bool:
    """Whether the unit's code would misuse a contiguous column shard of this linear's output
    (module docstring: fused q|k|v, cut in pieces, reduced over its features, written-out heads)."""
    return op.fused_attention_input or op.output_split_on_features or op.output_reduced_on_features or op.output_heads_fixed


def _whole_heads(heads: int, tp: int) -> bool:
    """Whether `heads` split `tp` ways leave whole heads on every rank (none narrower than a head:
    a projection with fewer features than a head, as a rotary part every head shares, has 0)."""
    return heads > 0 and heads % tp == 0


def _op_strategies(op: OpNode, tp: int, heads_of: dict[str, int], sequence_parallel: bool = False,
                   replicated: frozenset = frozenset()) -> dict[str, tuple]:
    if tp == 1 or op.name in replicated:
        return {"replicate": (EMBEDDING if op.kind == "embedding" else LINEAR)["replicate"]}
    if op.kind == "linear":
        in_f, out_f = _linear_features(op)
        # `sequence` (replicated weight, sequence-sharded tokens) is data parallelism inside the
        # TP group: the outer search prices that as dp, with gradients reduced once per step
        # rather than per micro-batch and without the replicated weights' memory, so it is
        # not offered here (the ILP's objective sees neither advantage of real TP).
        ok = {"replicate": True, "sequence": False, "rowwise": in_f % tp == 0}
        ok["colwise"] = out_f % tp == 0 and _whole_heads(heads_of.get(op.name, tp), tp) and not _column_shard_breaks(op)
        # Under sequence parallelism the runtime runs Megatron's layout (runtime/apply_tp.py): every
        # linear of a block sharded, activations between the sandwiches sequence-sharded. A
        # replicated linear there (or the attention it feeds) would need the whole sequence,
        # which the runtime does not gather for it.
        ok["replicate"] = not (sequence_parallel and (ok["colwise"] or ok["rowwise"]))
        return {s: v for s, v in LINEAR.items() if ok[s]}
    if op.kind == "embedding":
        assert op.weight_shape is not None, "an embedding op has a weight"
        num, dim = op.weight_shape
        ok = {"replicate": True, "rowwise": num % tp == 0, "colwise": dim % tp == 0}
        return {s: v for s, v in EMBEDDING.items() if ok[s]}
    if _is_attention(op) and op.input_shape[-3] % tp == 0 and not op.output_reduced_on_features:
        return dict(HEADS)
    return {"replicate": HEADS["replicate"]}


WEIGHT_KINDS = ("linear", "embedding", "conv")
"""Ops whose weight tensor parallelism may split (norms' weights stay whole, as in Megatron)."""


def whole_weights(ops, tp: int, tp_plan: dict[str, str], routers: AbstractSet[str] = frozenset(),
                  sequence_parallel: bool = False, moe_blocks: AbstractSet[str] = frozenset(),
                  mixes_tokens: bool = False) -> list[tuple[OpNode, str]]:
    """The weights of a unit's ops (`WEIGHT_KINDS`) that its tensor-parallel plan `tp_plan` (module
    -> style, `IntraOpSolution.tp_plan`) leaves whole on every TP rank, each with why in words for
    the plan's notes: what keeps `_op_strategies` from offering the column shard Megatron gives a
    projection (`_whole_reason`), a mixture-of-experts router (`routers`: module paths, kept
    replicated by design), sequence parallelism keeping the whole unit replicated
    (`_sequence_parallel_blocked`), else the intra-op solver's choice (cheaper, or `_unrunnable`)."""
    heads_of = _heads_of(ops)
    if sequence_parallel and _sequence_parallel_blocked(ops, moe_blocks, mixes_tokens, tp):
        otherwise = "sequence parallelism keeps its unit whole, as Megatron's layout shards every linear of a block or none"
    elif obstacles := tp_obstacles(ops, tp):
        otherwise = f"kept whole beside an attention tp {tp} does not split into whole heads ({obstacles[0]})"
    else:
        otherwise = "kept whole by the intra-op solver: cheaper, or not runnable sharded beside its neighbours"
    out = []
    for op in ops:
        if op.kind not in WEIGHT_KINDS or not op.weight_shape or op.module is None:
            continue
        if tp_plan.get(op.module, "replicate") != "replicate":
            continue
        why = "a mixture-of-experts router" if op.module in routers else _whole_reason(op, tp, heads_of)
        out.append((op, why or otherwise))
    return out


def _whole_reason(op: OpNode, tp: int, heads_of: dict[str, int]) -> str | None:
    """Why `_op_strategies` offers no column shard of this weight `tp` ways, or None where it
    offers one."""
    if op.kind == "conv":
        return "a convolution (DTensor has no TP style for it)"
    if op.kind == "embedding":
        assert op.weight_shape is not None, "an embedding op has a weight"
        num, dim = op.weight_shape
        return None if num % tp == 0 or dim % tp == 0 else f"neither its {num} rows nor its {dim} features split {tp} ways"
    flags = [(op.fused_attention_input, "its output holds q, k and v together"),
             (op.output_split_on_features, "the model cuts its output into pieces"),
             (op.output_reduced_on_features, "a norm reduces over all its output features"),
             (op.output_heads_fixed, "the model's code writes out its number of heads")]
    found = [text for flagged, text in flags if flagged]
    if found:
        return "; ".join(found)
    heads, out_f = heads_of.get(op.name, tp), _linear_features(op)[1]
    if heads % tp:
        return f"its {_count(heads, 'head')} {'does' if heads == 1 else 'do'} not split {tp} ways"
    return f"its {out_f} output features do not split {tp} ways" if out_f % tp else None


def _is_attention(op: OpNode) -> bool:
    """Attention's core (fused, or the two batched matmuls of a materialised one) on (b, heads, s, d) tensors."""
    return op.kind in ("attention", "matmul") and len(op.input_shape) >= 4


def _heads_of(ops) -> dict[str, int]:
    """Heads of the linears feeding an attention op (query and key/value heads apart, as grouped-query
    attention has fewer of the latter).

    The runtime leaves a colwise q/k/v projection's output sharded and the model's own code splits
    it into heads (`view(b, s, -1, head_dim)`, runtime/apply_tp.py), so colwise must split whole
    heads. A linear's count is the one its output was viewed into (`OpNode.output_heads`), else
    its features over the head dim: the last dim of q (fused attention and `q @ k^T`, whose output
    is the square score matrix) or of the output (`scores @ v`)."""
    by_name = {op.name: op for op in ops}
    heads: dict[str, int] = {}
    for op in ops:
        if not _is_attention(op):
            continue
        scores = op.kind == "matmul" and op.output_shape[-1] == op.output_shape[-2]
        head_dim = op.input_shape[-1] if op.kind == "attention" or scores else op.output_shape[-1]
        for src in op.inputs:
            linear = by_name.get(src)
            if linear is not None and linear.weight_shape and linear.kind == "linear" and not (
                    linear.fused_attention_input or linear.output_split_on_features):  # never colwise: no heads to split
                heads[src] = linear.output_heads or _linear_features(linear)[1] // head_dim
    return heads


def tp_obstacles(ops, tp: int) -> list[str]:
    """Why the runtime cannot shard this unit's attention `tp` ways (empty if it can or there is none):
    Megatron-style tensor parallelism splits whole heads, query and key/value heads alike. Such an
    attention stays replicated (module docstring)."""
    if tp == 1:
        return []
    problems = []
    replicated = _fused_attention(ops)
    for op in ops:
        if _is_attention(op) and op.name not in replicated and op.input_shape[-3] % tp:
            problems.append(f"{op.name} has {_count(op.input_shape[-3], 'head')}")
    for name, heads in sorted(_heads_of(ops).items()):
        if heads % tp:
            problems.append(f"{name} projects {_count(heads, 'head')}")
    return problems


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}{'' if number == 1 else 's'}"


def shardable_ops(ops, tp: int) -> list[str]:
    """Ops with a weight the runtime can shard `tp` ways (colwise or rowwise offered to the ILP)."""
    heads_of, replicated = _heads_of(ops), frozenset(_fused_attention(ops))
    return [op.name for op in ops if op.weight_shape and {"colwise", "rowwise"} & set(_op_strategies(op, tp, heads_of, replicated=replicated))]


def unit_scale_graph(problem: IntraOpProblem) -> _Graph:
    """`problem`'s graph at activation scale 1, for `evaluate` to scale: its nodes and edges do not
    depend on the scale, and its bytes are the scale times these (`_build_graph`: products of
    shapes, dtype bytes and the scale, and maxima of them)."""
    return _build_graph(dataclasses.replace(problem, activation_scale=1.0))


def _build_graph(problem: IntraOpProblem) -> _Graph:
    ops, tp, scale = problem.ops, problem.tp_degree, problem.activation_scale
    boundary = "S" if problem.sequence_parallel else "R"
    heads_of = _heads_of(ops)
    replicated = frozenset(_fused_attention(ops)) | problem.replicated_ops
    if problem.sequence_parallel and _sequence_parallel_blocked(ops, problem.moe_blocks, problem.mixes_tokens,
                                                                problem.tp_degree):
        replicated = frozenset(op.name for op in ops)
    nodes: dict[str, dict[str, tuple]] = {INPUT: {"fixed": (None, boundary, boundary)}}
    nbytes: dict[str, float] = {INPUT: 0.0}
    sources: dict[str, str] = {}
    pinned = dict(problem.pinned_ops)
    for op in ops:
        nodes[op.name] = _op_strategies(op, tp, heads_of, problem.sequence_parallel, replicated)
        if pinned.get(op.name) in nodes[op.name]:
            nodes[op.name] = {pinned[op.name]: nodes[op.name][pinned[op.name]]}
        nbytes[op.name] = _numel(op.output_shape) * problem.dtype_bytes * scale
        act_bytes = _numel(op.input_shape) * problem.dtype_bytes * scale
        if op.kind == "embedding":
            continue  # token ids: every rank has them, they carry no gradient
        if INPUT in op.inputs:
            nbytes[INPUT] = max(nbytes[INPUT], act_bytes)
        sources.update(_attach(op.name, sorted(op.inputs), nodes, nbytes, act_bytes, tp))
    consumed = set(sources.values())
    sinks = sorted(op.name for op in ops if op.name not in consumed)
    if sinks:
        out_bytes = max(nbytes[s] for s in sinks)
        nodes[OUTPUT] = {"fixed": (boundary, None, boundary)}
        sources.update(_attach(OUTPUT, sinks, nodes, nbytes, out_bytes, tp))
    return _Graph(nodes, sources, nbytes, _fp8_sources(sources, problem.fp8_gathered_ops, {op.name for op in ops}))


def _fp8_sources(sources: dict[str, str], fp8_ops: AbstractSet[str], op_names: AbstractSet[str]) -> frozenset[str]:
    """Producers every op reading them casts to FP8 before a gather (`IntraOpProblem.fp8_gathered_ops`);
    merge and output nodes are the residual's plumbing, which reads the tensor as it is."""
    if not fp8_ops:
        return frozenset()
    readers: dict[str, set[str]] = {}
    for key, src in sources.items():
        consumer = _consumer_of(key)
        if consumer in op_names:
            readers.setdefault(src, set()).add(consumer)
    return frozenset(src for src, ops in readers.items() if ops <= fp8_ops)


def forward_conversion_s(src: str, out: str, need: str, graph: _Graph, coll: TPCollectives) -> float:
    """`conversion_s` of producer `src`'s output in the forward: its all-gathers at FP8's bytes where
    its readers gather it in FP8 (`_Graph.fp8_sources`)."""
    nbytes = graph.nbytes[src]
    if src in graph.fp8_sources and need == "R" and out not in ("R", "P"):
        nbytes *= FP8_ALL_GATHER_BYTES_FACTOR
    return conversion_s(out, need, nbytes, coll)


def _attach(consumer: str, inputs: list[str], nodes, nbytes, act_bytes: float, tp: int) -> dict[str, str]:
    """Wire `consumer` to its producers, through a merge node when there are several."""
    if not inputs:
        return {}
    if len(inputs) == 1:
        return {consumer: inputs[0]}
    merge = _merge_name(inputs)
    if merge not in nodes:
        nodes[merge] = dict(MERGE) if tp > 1 else {"R": MERGE["R"]}
        nbytes[merge] = act_bytes
    return {consumer: merge, **{f"{merge}<-{src}": src for src in inputs}}


def _merge_name(inputs: list[str]) -> str:
    """The merge node of `inputs` (sorted): their names joined, or, past a few, the first three,
    how many more, and a hash of all. A scan written as a Python loop combines every earlier
    step's product (Jamba's Mamba at 4096 tokens: merges of thousands of ops), and names that
    long, repeated in every edge key, made building and reading the graph quadratic."""
    joined = "+".join(inputs)
    if len(inputs) <= 4:
        return "merge:" + joined
    digest = hashlib.sha1(joined.encode()).hexdigest()[:12]
    return f"merge:{'+'.join(inputs[:3])}+{len(inputs) - 3} more:{digest}"


def _consumer_of(key: str) -> str:
    return key.split("<-")[0] if "<-" in key else key


def conversion_s(src: str, dst: str, nbytes: float, coll: TPCollectives) -> float:
    """Time to turn a tensor in layout `src` into layout `dst` (module docstring's conv_s)."""
    if src == dst or (src == "R" and dst in ("F", "S")):
        return 0.0
    if src == "P":
        return coll.all_reduce_s(nbytes) if dst == "R" else coll.reduce_scatter_s(nbytes)
    if dst == "R":
        return coll.all_gather_s(nbytes)
    return coll.all_to_all_s(nbytes)


def _grad_target(layout: str) -> str:
    return "R" if layout == "P" else layout


def _node_cost(problem: IntraOpProblem, op: OpNode | None, strategy: str) -> tuple[float, float, float]:
    """(compute_s, weight-gradient all-reduce_s, parameter bytes per GPU) of one node."""
    if op is None:
        return 0.0, 0.0, 0.0
    compute = 3 * _forward_gemm_s(problem, op, strategy)  # forward, input and weight gradients
    bias = (_linear_features(op)[1] if op.kind == "linear" else op.weight_shape[0]) if op.weight_shape and op.has_bias else 0
    weight_bytes = (_numel(op.weight_shape) + bias) * problem.dtype_bytes if op.weight_shape else 0
    sharded_weight = strategy in ("colwise", "rowwise")
    wgrad = problem.collectives.all_reduce_s(weight_bytes) if strategy == "sequence" else 0.0
    return compute, wgrad, weight_bytes / problem.tp_degree if sharded_weight else weight_bytes


def _forward_gemm_s(problem: IntraOpProblem, op: OpNode | None, strategy: str) -> float:
    """One node's forward matmul seconds per GPU (a third of `_node_cost`'s compute; the backward's
    input-gradient GEMM takes as long); 0 for merges and inputs."""
    if op is None:
        return 0.0
    split = problem.tp_degree if strategy in SHARDED else 1
    return op.forward_flops * problem.activation_scale * problem.seconds_per_flop / split


def async_exposed_s(comm_s: float, gemm_s: float, tp: int) -> float:
    """What async TP leaves exposed of a collective of `comm_s` decomposed with the `gemm_s` it
    feeds or follows into tp chunks (Megatron-LM's --tp-comm-overlap, torch's micro-pipelined TP;
    Wang et al. 2023, "Overlap Communication with Dependent Computation via Decomposition",
    ASPLOS): chunk i's transfer runs under chunk i-1's GEMM, so one chunk's transfer is always
    exposed, and where the transfers outlast the GEMMs, the difference: max(c/tp, c - g (tp-1)/tp).
    A collective beside small GEMMs (the attention projections of a narrow model at a large TP
    degree) stays mostly exposed; one beside a wide MLP GEMM hides."""
    return max(comm_s / tp, comm_s - gemm_s * (tp - 1) / tp) if comm_s > 0 else 0.0


def evaluate(problem: IntraOpProblem, strategies: dict[str, str], unit_graph: _Graph | None = None) -> IntraOpSolution:
    """Price an assignment exactly as the ILP's objective does. `unit_graph`: the problem's graph
    built at activation scale 1 (`unit_scale_graph`), scaled here instead of built again: a unit
    is priced at every profiled micro-batch with the strategies chosen at the first, and a scan's
    graph (Jamba's Mamba: hundreds of thousands of edges) took most of that."""
    if unit_graph is None:
        graph = _build_graph(problem)
    else:
        scale = problem.activation_scale
        graph = dataclasses.replace(unit_graph, nbytes={k: v * scale for k, v in unit_graph.nbytes.items()})
    by_name = {op.name: op for op in problem.ops}
    coll = problem.collectives
    compute = comm = params = 0.0
    paid: list[str] = []
    for node in graph.nodes:
        c, w, p = _node_cost(problem, by_name.get(node), strategies.get(node, "fixed"))
        compute, comm, params = compute + c, comm + w, params + p
    wgrad = comm  # the weight-gradient all-reduces: not paired with a GEMM, in series under async TP too
    fwd: set[tuple] = set()
    bwd: set[tuple] = set()
    readers: dict[str, list[str]] = {}
    for key, src in graph.sources.items():
        consumer = _consumer_of(key)
        readers.setdefault(src, []).append(consumer)
        need, _, grad = graph.nodes[consumer][strategies.get(consumer, "fixed")]
        out = graph.nodes[src][strategies.get(src, "fixed")][1]
        fwd.add((src, out, need))
        if grad is not None:
            bwd.add((src, out, grad))
    gemm = lambda node: _forward_gemm_s(problem, by_name.get(node), strategies.get(node, "fixed"))  # noqa: E731
    # The GEMMs a collective can hide behind under async TP: the producer's, for the reduction of
    # its partial sums (and, in the backward, the gather of their gradient); the readers', for a
    # gather of their input (and, in the backward, the reduction of its gradient).
    paired = lambda src, out: gemm(src) if out == "P" else sum(gemm(r) for r in readers.get(src, ()))  # noqa: E731
    forward_comm = exposed = 0.0
    for src, out, need in sorted(fwd):
        t = forward_conversion_s(src, out, need, graph, coll)
        if t > 0:
            forward_comm += t
            exposed += async_exposed_s(t, paired(src, out), problem.tp_degree)
            paid.append(f"fwd {out}->{need} {src}")
    comm += forward_comm
    for src, out, grad in sorted(bwd):
        t = conversion_s(grad, _grad_target(out), graph.nbytes[src], coll)
        if t > 0:
            comm += t
            exposed += async_exposed_s(t, paired(src, out), problem.tp_degree)
            paid.append(f"bwd {grad}->{_grad_target(out)} {src}")
    plan = {}
    for n, s in strategies.items():
        module = by_name[n].module if n in by_name else None
        if module is not None and s in STYLE:
            plan[module] = STYLE[s]
    return IntraOpSolution(dict(strategies), plan, compute, comm, params, paid, forward_comm,
                           sharded_feeds(problem.ops, strategies), exposed + wgrad)


def solve_intra_op(problem: IntraOpProblem) -> IntraOpSolution:
    """The ILP's answer (`_solve`) that the runtime can run as priced: where it cannot
    (`_unrunnable`), some of the ops to blame are kept replicated and the unit solved again, until
    none is left (each round replicates at least one more op, so it ends). The column-parallel
    ones go first (they make the pairs and the sharded outputs), then sharded attention, then the
    rest: replicating all at once would leave less sharded than needed (a row-parallel q, k and v
    run once their colwise sibling is gone)."""
    for _ in range(len(problem.ops) + 1):
        graph = _build_graph(problem)
        solution = _solve(problem, graph)
        blamed = _unrunnable(problem, solution.strategies, graph) - problem.replicated_ops
        if not blamed:
            return solution
        for kind in ("colwise", "heads", None):
            first = {n for n in blamed if kind is None or solution.strategies.get(n) == kind}
            if first:
                break
        problem = dataclasses.replace(problem, replicated_ops=problem.replicated_ops | first)
    return solution


def sharded_feeds(ops: Sequence[OpNode], strategies: dict[str, str]) -> dict[str, list[str]]:
    """Each row-parallel linear that reads column-sharded features, with the column-parallel
    linears they come from: by data flow (`OpNode.inputs`, through the per-feature ops between,
    and through attention sharded by heads), not by module parents. Megatron's pairs share a
    parent (`attn`, `mlp`), but Hugging Face's BERT and ViT put the MLP's two linears in two
    modules (`intermediate.dense`, `output.dense`) and the attention's output projection in
    another than q, k and v. The runtime (runtime/apply_tp.py) keeps such a column-parallel
    output sharded and has the row-parallel module read it so, as priced; keyed and listed by
    op name (the plan's `Stage.tp_feeds` by module FQN)."""
    by_name = {op.name: op for op in ops}

    def columns(name: str, seen: set[str]) -> set[str]:
        if name in seen or name not in by_name:
            return set()
        seen.add(name)
        op, chosen = by_name[name], strategies.get(name)
        if op.kind == "linear" and op.module and chosen == "colwise":
            return {name}
        if op.kind in ("attention", "matmul") and chosen in ("heads", "F"):  # features still sharded past it
            return set().union(*(columns(src, seen) for src in op.inputs))
        return set()

    feeds = {}
    for op in ops:
        if op.kind == "linear" and op.module and strategies.get(op.name) == "rowwise":
            found = set().union(*(columns(src, set()) for src in op.inputs))
            if found:
                feeds[op.name] = sorted(found)
    return feeds


def _unrunnable(problem: IntraOpProblem, strategies: dict[str, str], graph: _Graph | None = None) -> frozenset[str]:
    """Ops whose strategy the runtime cannot realise as the ILP priced it, to keep replicated.

    The ILP converts a tensor's layout on any edge, a replicated one to a feature shard for free
    (a slice). The runtime (runtime/apply_tp.py) converts only where a module's style does: a
    column-parallel module's output stays sharded when a row-parallel one reads it (a pair by
    data flow, `sharded_feeds`) and is gathered otherwise; a row-parallel module reads a
    sharded input when paired and slices a replicated one otherwise; its output is all-reduced.
    Between modules nothing converts, so what a node hands on must be what its consumer reads,
    and the tensors an elementwise merge combines must agree (the unit's input excepted: Llama's
    rotary cos and sin, replicated, broadcast over the heads of a sharded q). Qwen3.5's gated
    delta net got `in_proj_qkv` rowwise beside a colwise `in_proj_z` (paired by their parent, as
    the runtime then paired, reading its replicated input as if sharded) and a norm gating the
    replicated attention output with the sharded z: the plan failed at the first forward.
    Blamed: a paired row-parallel module fed a replicated tensor, a column-parallel module or
    sharded attention whose sharded output meets a replicated reader or merge, attention reading
    a replicated tensor. Sequence parallelism runs its own layout (Megatron's, units whose
    linears all shard or none), whose gather and reduce-scatter sit at a pair's parent module: a
    pair whose modules have no parent in common (BERT's MLP, `intermediate.dense` and
    `output.dense`) cannot run so, and is blamed whole."""
    if problem.sequence_parallel:
        parent = {op.name: (op.module or "").rpartition(".")[0] for op in problem.ops}
        return frozenset(n for row, columns in sharded_feeds(problem.ops, strategies).items()
                         if any(parent[c] != parent[row] for c in columns) for n in (row, *columns))
    if not SHARDED & set(strategies.values()):
        return frozenset()
    graph = graph or _build_graph(problem)
    by_name = {op.name: op for op in problem.ops}
    feeds = sharded_feeds(problem.ops, strategies)
    pairs = set(feeds) | {column for columns in feeds.values() for column in columns}

    def paired(name: str) -> bool:
        return name in pairs

    def strategy(node: str) -> str:
        return strategies.get(node, "fixed")

    def hands_on(node: str) -> str:
        if node == INPUT:
            return "R"
        if node.startswith("merge:"):
            return merged[node]
        s = strategy(node)
        if s == "colwise":
            return "F" if paired(node) else "R"
        return "R" if s == "rowwise" else graph.nodes[node][s][1]

    def reads(node: str) -> str:
        s = strategy(node)
        if s == "rowwise":
            return "F" if paired(node) else "R"
        return "R" if s == "colwise" or node == OUTPUT else graph.nodes[node][s][0]

    blamed: set[str] = set()
    merged: dict[str, str] = {}
    feeding = _merge_sources(graph)
    for merge in (n for n in graph.nodes if n.startswith("merge:")):
        sources = [src for src in feeding.get(merge, ()) if src != INPUT]
        layouts = {hands_on(src) for src in sources}
        if len(layouts) > 1:
            blamed |= {src for src in sources if hands_on(src) != "R"}
        merged[merge] = layouts.pop() if len(layouts) == 1 else "R"
    for key, src in graph.sources.items():
        consumer = _consumer_of(key)
        if consumer.startswith("merge:") or hands_on(src) == reads(consumer):
            continue
        if reads(consumer) == "F":  # a paired row-parallel module or sharded attention fed a whole tensor
            blamed.add(consumer)
        else:  # a sharded output where a whole one is read
            blamed |= {n for n in feeding.get(src, [src]) if hands_on(n) == "F"}
    return frozenset(n for n in blamed if n in by_name)


def _merge_sources(graph: _Graph) -> dict[str, list[str]]:
    """Each merge node's sources."""
    feeding: dict[str, list[str]] = {}
    for key, src in graph.sources.items():
        if key.startswith("merge:") and "<-" in key:
            feeding.setdefault(_consumer_of(key), []).append(src)
    return feeding


def _solve(problem: IntraOpProblem, graph: _Graph | None = None) -> IntraOpSolution:
    """The optimum of the module docstring's ILP; raise if the memory bound cannot be met. Up to
    `TABLE_UP_TO` assignments it is found by pricing them all (`_by_table`); beyond, by CBC, and
    the answer is kept on disk (`_cached`): a later solve of the same problem (the next "what if"
    on the same model and GPU) reads it instead of building and solving the ILP."""
    graph = _presolved(problem, graph or _build_graph(problem))
    free = {v: s for v, s in graph.nodes.items() if "fixed" not in s}
    if all(len(s) == 1 for s in free.values()):
        return evaluate(problem, {v: next(iter(s)) for v, s in free.items()})
    if math.prod(len(s) for s in free.values()) <= TABLE_UP_TO:
        return _by_table(problem, graph, free)
    cache = _cache_path(problem, graph)
    chosen = _cached(cache, free)
    if chosen is None:
        chosen = _solve_ilp(problem, graph, free)
        _store(cache, chosen)
    return evaluate(problem, chosen)


def _presolved(problem: IntraOpProblem, graph: _Graph) -> _Graph:
    """`graph` with each free node that has a dominant strategy left with that one alone.

    Strategy s of node v dominates when even its worst case costs no more than any other's best:
    node(v, s) plus every conversion on v's edges at the dearest layout its neighbours can still
    take (but those on an input another reader is decided to want too: paid anyway) <= the least
    v's terms can cost under s' for every other s' (`least`: node(v, s'), at
    least the dearest of the cheapest conversions its readers force on its output, one per layout
    wanted, each paid once whoever else wants it; and the cheapest conversion on an input only v
    reads; inputs other readers share may be paid by them, so count 0). Moving v to s from any s'
    then never raises the objective (the conversions v shares with a producer's other readers can
    only be paid less often), so some optimum has v = s, and fixing it is exact. Fixed nodes narrow
    their neighbours' worst cases, so it repeats until nothing changes. Nodes under a constraint
    are left alone: those whose parameter bytes differ by strategy when `parameter_memory` binds,
    and `pinned_tp`'s.

    What this buys: a unit that sequence parallelism keeps replicated (`_sequence_parallel_blocked`,
    a Mamba or gated-delta-rule layer) has every op fixed and only its merge nodes free, each R at
    no cost. Qwen3-Next's linear attention, whose chunk loop gives 259 merges and 5,300 edges, went
    to CBC for 12 s per solve; all but two merges are fixed here, and the rest is a table."""
    by_name = {op.name: op for op in problem.ops}
    coll = problem.collectives
    nodes = dict(graph.nodes)
    readers: dict[str, list[str]] = {}
    feeds: dict[str, list[str]] = {}
    for key, src in graph.sources.items():
        consumer = _consumer_of(key)
        readers.setdefault(src, []).append(consumer)
        feeds.setdefault(consumer, []).append(src)
    must = set(_largest_shardable(nodes, by_name)) if problem.require_sharding else set()

    def constrained(node: str, strategies: dict) -> bool:
        if node in must:
            return True
        bytes_by_strategy = {_node_cost(problem, by_name.get(node), s)[2] for s in strategies}
        return problem.parameter_bytes_limit is not None and len(bytes_by_strategy) > 1

    @functools.lru_cache(maxsize=None)
    def convert(have: str, want: str, nbytes: float) -> float:
        return conversion_s(have, want, nbytes, coll)

    @functools.lru_cache(maxsize=None)
    def convert_forward(src: str, have: str, want: str) -> float:
        return forward_conversion_s(src, have, want, graph, coll)

    # Per producer, the layouts its decided readers read and hand back gradients in: conversions
    # to those are paid whatever a free reader does (updated as nodes are fixed).
    paid_reads: dict[str, set] = {src: set() for src in readers}
    paid_grads: dict[str, set] = {src: set() for src in readers}

    def decide(node: str) -> None:
        ((read, _, grad),) = nodes[node].values()
        for src in feeds.get(node, ()):
            paid_reads[src].add(read)
            paid_grads[src].add(grad)

    for node, strategies in nodes.items():
        if len(strategies) == 1:
            decide(node)

    def worst(node: str, strategy: str) -> float:
        read, out, grad = nodes[node][strategy]
        cost = sum(_node_cost(problem, by_name.get(node), strategy)[:2])
        for src in feeds.get(node, ()):
            written = {layouts[1] for layouts in nodes[src].values()}
            nbytes = graph.nbytes[src]
            if read not in paid_reads[src]:
                cost += max(convert_forward(src, a, read) for a in written)
            if grad is not None and grad not in paid_grads[src]:
                cost += max(convert(grad, _grad_target(a), nbytes) for a in written)
        nbytes = graph.nbytes[node]
        for consumer in readers.get(node, ()):
            cost += max(convert_forward(node, out, layouts[0]) for layouts in nodes[consumer].values())
            grads = {layouts[2] for layouts in nodes[consumer].values()} - {None}
            cost += max((convert(g, _grad_target(out), nbytes) for g in grads), default=0.0)
        return cost

    def least(node: str, strategy: str) -> float:
        """What v's terms cost at the least under `strategy`: its node cost, the conversions it
        makes as a producer (each layout its readers want is converted to once, so at least the
        dearest of the cheapest each reader can take), and those on inputs it alone reads."""
        read, out, grad = nodes[node][strategy]
        cost = sum(_node_cost(problem, by_name.get(node), strategy)[:2])
        for src in feeds.get(node, ()):
            if len(readers[src]) > 1:
                continue  # shared with the producer's other readers: may be paid by them
            written = {layouts[1] for layouts in nodes[src].values()}
            cost += min(convert_forward(src, a, read) for a in written)
            if grad is not None:
                cost += min(convert(grad, _grad_target(a), graph.nbytes[src]) for a in written)
        forward = backward = 0.0
        nbytes = graph.nbytes[node]
        for consumer in readers.get(node, ()):
            forward = max(forward, min(convert_forward(node, out, layouts[0]) for layouts in nodes[consumer].values()))
            grads = {layouts[2] for layouts in nodes[consumer].values()}
            if None not in grads:
                backward = max(backward, min(convert(g, _grad_target(out), nbytes) for g in grads))
        return cost + forward + backward

    def dominant(node: str, strategies: dict) -> str | None:
        """A strategy of `node` that dominates the others, if one does (`least` only where the
        node cost alone does not settle it)."""
        alone = {s: sum(_node_cost(problem, by_name.get(node), s)[:2]) for s in strategies}
        least_of: dict[str, float] = {}

        def below(cost: float, other: str) -> bool:
            if cost <= alone[other]:
                return True
            if other not in least_of:
                least_of[other] = least(node, other)
            return cost <= least_of[other]

        for s in strategies:
            cost = worst(node, s)
            if all(below(cost, other) for other in strategies if other != s):
                return s
        return None

    changed = True
    while changed:
        changed = False
        for node, strategies in nodes.items():
            if "fixed" in strategies or len(strategies) == 1 or constrained(node, strategies):
                continue
            chosen = dominant(node, strategies)
            if chosen is not None:
                nodes[node] = {chosen: strategies[chosen]}
                decide(node)
                changed = True
    return dataclasses.replace(graph, nodes=nodes)


TABLE_UP_TO = 1 << 20
"""Problems with at most this many assignments of the free nodes (a transformer block's nine
nodes have at most 3^8 x 2) are solved by pricing every assignment at once (`_by_table`): exact,
and tens of times faster than starting the ILP solver (CBC runs as a subprocess, ~50 ms a unit).
Larger ones (a block with many linears, each with three or four strategies) go to the ILP."""


def _by_table(problem: IntraOpProblem, graph: _Graph, free: dict) -> IntraOpSolution:
    """The ILP's optimum by pricing every assignment of the free nodes in one numpy array, one axis
    per node: the objective is a sum of terms that each read few nodes (a node's compute and
    weight-gradient time; a producer's conversions, which read it and its consumers), so each term
    is a small array broadcast over the others. The ILP's constraints (`parameter_memory`,
    `pinned_tp`) mask it. Of equal costs the first in the order of the strategies is kept, as
    pricing them one by one would; `evaluate` prices the answer. Raises as the ILP does when no
    assignment meets the constraints."""
    by_name = {op.name: op for op in problem.ops}
    nodes = [v for v in free if len(free[v]) > 1]  # a node left one strategy is a constant, not an axis
    axis = {v: i for i, v in enumerate(nodes)}
    shape = tuple(len(free[v]) for v in nodes)

    def along(node: str, values) -> np.ndarray | float:
        """`values` (one per strategy of `node`) shaped to broadcast over the table; a number for a fixed node."""
        if node not in axis:
            (value,) = values
            return value
        out = np.asarray(values, dtype=float)
        return out.reshape([len(out) if i == axis[node] else 1 for i in range(len(nodes))])

    def strategies(node: str) -> list:
        return list(free[node]) if node in free else ["fixed"]

    total: np.ndarray | float = 0.0
    params: np.ndarray | float = 0.0
    for node in graph.nodes:
        costs = [_node_cost(problem, by_name.get(node), s) for s in strategies(node)]
        total = total + along(node, [c + w for c, w, _ in costs])
        params = params + along(node, [p for _, _, p in costs])
    coll = problem.collectives
    readers: dict[str, list[str]] = {}
    for key, src in graph.sources.items():
        readers.setdefault(src, []).append(_consumer_of(key))
    for src, consumers in readers.items():
        outs = [graph.nodes[src][s][1] for s in strategies(src)]
        for position in (0, 2):  # what a consumer reads (forward), the gradient it returns (backward)
            wanted: dict[str, np.ndarray | float] = {}  # layout -> whether some consumer wants it
            for consumer in consumers:
                layouts = [graph.nodes[consumer][s][position] for s in strategies(consumer)]
                for layout in set(layouts):
                    if position == 2 and layout is None:
                        continue  # no gradient comes back
                    hit = along(consumer, [float(x == layout) for x in layouts])
                    wanted[layout] = np.maximum(wanted.get(layout, 0.0), hit)
            for layout, hit in wanted.items():
                if position == 0:
                    seconds = [forward_conversion_s(src, out, layout, graph, coll) for out in outs]
                else:
                    seconds = [conversion_s(layout, _grad_target(out), graph.nbytes[src], coll) for out in outs]
                if any(seconds):  # one payment per (producer, its layout, the layout wanted), as the ILP's y
                    total = total + hit * along(src, seconds)
    total = np.broadcast_to(total, shape)
    allowed = np.ones(shape, dtype=bool)
    if problem.parameter_bytes_limit is not None:
        allowed &= np.broadcast_to(params, shape) <= problem.parameter_bytes_limit
    must = _largest_shardable(free, by_name) if problem.require_sharding else []
    if must:
        sharded = np.zeros(shape, dtype=bool)
        for v in must:
            sharded = sharded | (along(v, [s in ("colwise", "rowwise") for s in free[v]]) > 0)
        allowed &= sharded
    if not allowed.any():
        _raise_infeasible(problem)
    priced = np.where(allowed, total, np.inf)
    least = priced.min()
    first = int(np.flatnonzero(priced <= least + abs(least) * 1e-12)[0])
    picks = np.unravel_index(first, shape)
    chosen = {v: next(iter(free[v])) for v in free}
    chosen.update({v: list(free[v])[int(i)] for v, i in zip(nodes, picks, strict=True)})
    return evaluate(problem, chosen)


CACHE_ENV = "PLANNER_CACHE_DIR"
"""Where solved ILPs are kept: this variable's folder, else $XDG_CACHE_HOME/torch-planner
(~/.cache/torch-planner); an empty value turns the cache off."""


def _cache_path(problem: IntraOpProblem, graph: _Graph) -> Path | None:
    """The file of this problem's answer: named by a hash of the problem (its ops, shapes, TP
    degree, GPU speed, memory limit) with the collectives as the times they give (at the sizes
    of the graph's tensors and at powers of 4 from 1 B to 1 TiB: a collective model is a
    function, and its object has no stable text), and of this file's source and pulp's version
    (a changed formulation or solver is a different answer)."""
    import pulp
    folder = os.environ.get(CACHE_ENV)
    if folder == "":
        return None
    root = Path(folder) if folder else Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "torch-planner"
    coll = problem.collectives
    sizes = sorted({*graph.nbytes.values(), *(4.0 ** k for k in range(21))})
    times = [(f(n) for f in (coll.all_reduce_s, coll.all_gather_s, coll.reduce_scatter_s, coll.all_to_all_s))
             for n in sizes]
    fields = [(f.name, getattr(problem, f.name)) for f in dataclasses.fields(problem) if f.name != "collectives"]
    text = repr(fields) + repr([tuple(t) for t in times])
    key = hashlib.sha256(text.encode() + _SOURCE_DIGEST + pulp.__version__.encode()).hexdigest()
    return root / "intra_op" / f"{key}.json"


_SOURCE_DIGEST = hashlib.sha256(Path(__file__).read_bytes()).digest()


def _cached(path: Path | None, free: dict) -> dict[str, str] | None:
    """The stored strategies, if present and still a choice for every free node (else None: solve)."""
    if path is None or not path.is_file():
        return None
    try:
        chosen = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(chosen, dict) or set(chosen) != set(free) or any(chosen[v] not in free[v] for v in free):
        return None
    return chosen


def _store(path: Path | None, chosen: dict[str, str]) -> None:
    """Write the answer atomically (rename); a cache that cannot be written is skipped silently:
    it saves time, it is never needed."""
    if path is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(chosen, sort_keys=True))
        tmp.replace(path)
    except OSError:
        pass


def _solve_ilp(problem: IntraOpProblem, graph: _Graph, free: dict) -> dict[str, str]:
    """The ILP of the module docstring, solved by CBC: the chosen strategy per free node."""
    import pulp  # only here: most units never reach the ILP (`_by_table`), and the import costs ~80 ms
    by_name = {op.name: op for op in problem.ops}
    model = pulp.LpProblem("intra_op", pulp.LpMinimize)
    # x[v, s]: node v uses strategy s (1) or not (0).
    x = {(v, s): pulp.LpVariable(f"x_{i}_{j}", cat="Binary") for i, v in enumerate(free) for j, s in enumerate(free[v])}
    node_costs = {(v, s): _node_cost(problem, by_name.get(v), s) for (v, s) in x}
    objective = [x[k] * (c + w) for k, (c, w, _) in node_costs.items()]
    _add_one_strategy(model, x, free)
    objective += _add_conversions(model, x, graph, problem.collectives)
    _add_parameter_memory(model, x, node_costs, problem.parameter_bytes_limit)
    if problem.require_sharding:
        _add_pinned_tp(model, x, _largest_shardable(free, by_name))
    # Objective in microseconds: CBC's absolute tolerances (1e-6..1e-9) are too coarse for seconds.
    model += 1e6 * pulp.lpSum(objective)
    status = model.solve(pulp.PULP_CBC_CMD(msg=0, timeLimit=ILP_TIME_LIMIT_S))
    if pulp.LpStatus[status] != "Optimal":
        if pulp.LpStatus[status] != "Infeasible":  # a time limit or a solver failure, not the model's constraints
            raise PlannerError(f"The tensor-parallel ILP ended {pulp.LpStatus[status].lower()} at tp={problem.tp_degree} "
                               f"(time limit {ILP_TIME_LIMIT_S} s).", "Re-run; if it persists, pin --tp.")
        _raise_infeasible(problem)
    return {v: s for (v, s), var in x.items() if var.value() > 0.5}


def _raise_infeasible(problem: IntraOpProblem) -> NoReturn:
    limit = problem.parameter_bytes_limit
    named = ([f"`parameter_memory` (<= {limit:.3g} bytes)"] if limit is not None else []) + \
        (["`pinned_tp`"] if problem.require_sharding else [])
    raise PlannerError(
        f"The tensor-parallel ILP is infeasible at tp={problem.tp_degree}: "
        f"constraint {' and '.join(named) or 'one_strategy'} cannot be met.",
        "Raise the memory available per GPU or the TP degree.",
    )


def _add_one_strategy(model, x, free) -> None:
    import pulp

    # [Constraint] one_strategy[v]: every free node picks exactly one strategy.
    for i, (v, strategies) in enumerate(free.items()):
        model += pulp.lpSum(x[v, s] for s in strategies) == 1, f"one_strategy_{i}"


def _layout_expr(x, graph: _Graph, node: str, position: int, layout: str):
    """sum of x[node, s] over strategies whose layout at `position` (0 in, 1 out, 2 grad) is `layout`."""
    import pulp
    strategies = graph.nodes[node]
    if len(strategies) == 1:  # fixed, or left one strategy: a constant
        (layouts,) = strategies.values()
        return 1 if layouts[position] == layout else 0
    return pulp.lpSum(x[node, s] for s, layouts in strategies.items() if layouts[position] == layout)


def _add_conversions(model, x, graph: _Graph, coll: TPCollectives) -> list:
    """Forward and backward resharding; returns the objective terms.

    Per edge p -> c and direction, e[a, t] is a transportation plan between the producer's
    layout marginal out[p, a] and the consumer's marginal (what it reads, or the gradient it
    returns); y[dir, p, a, t] >= e[a, t] then charges each (producer, layout pair) once.
    This is tighter than the plain AND linearisation, so CBC closes the gap at the root.
    """
    import pulp
    terms: list = []
    y: dict = {}
    layouts = ("R", "F", "S", "P")
    # An edge whose two ends are decided (fixed, or left one strategy by `_presolved`) is a
    # constant cost, left to `evaluate`; its conversions are then paid, so another reader of the
    # same producer wanting the same layout adds nothing.
    decided = {key for key, src in graph.sources.items()
               if len(graph.nodes[src]) == 1 and len(graph.nodes[_consumer_of(key)]) == 1}
    paid = set()
    for key in decided:
        src, consumer = graph.sources[key], _consumer_of(key)
        ((_, out, _),) = graph.nodes[src].values()
        ((read, _, grad),) = graph.nodes[consumer].values()
        paid |= {("F", src, out, read), ("B", src, out, grad)}
    for key, src in graph.sources.items():
        if key in decided:
            continue
        consumer = _consumer_of(key)
        for direction, position in (("F", 0), ("B", 2)):
            if all(layout[position] is None for layout in graph.nodes[consumer].values()):
                continue
            out = {a: _layout_expr(x, graph, src, 1, a) for a in layouts}
            want = {t: _layout_expr(x, graph, consumer, position, t) for t in layouts}
            pairs = [(a, t) for a in layouts for t in layouts if not _is_zero(out[a]) and not _is_zero(want[t])]
            # e[a, t]: share of edge src -> consumer with producer layout a and consumer layout t.
            e = {pair: pulp.LpVariable(f"e{direction}_{len(model.constraints)}_{pair[0]}{pair[1]}", lowBound=0) for pair in pairs}
            for a in layouts:
                if not _is_zero(out[a]):
                    # [Constraint] edge_marginals: the plan's rows sum to the producer's layout choice.
                    model += pulp.lpSum(v for (a2, _), v in e.items() if a2 == a) == out[a], f"edge_out_{len(model.constraints)}"
            for t in layouts:
                if not _is_zero(want[t]):
                    # [Constraint] edge_marginals: the plan's columns sum to the consumer's layout choice.
                    model += pulp.lpSum(v for (_, t2), v in e.items() if t2 == t) == want[t], f"edge_in_{len(model.constraints)}"
            for (a, t), var in e.items():
                nbytes = graph.nbytes[src]
                cost = forward_conversion_s(src, a, t, graph, coll) if direction == "F" \
                    else conversion_s(t, _grad_target(a), nbytes, coll)
                if cost <= 0:
                    continue
                k = (direction, src, a, t)
                if k in paid:
                    continue
                if k not in y:
                    # y[dir, p, a, t]: p writes a and a consumer reads t (dir F) or returns gradient t (dir B).
                    y[k] = pulp.LpVariable(f"y{direction}_{len(y)}", lowBound=0, upBound=1)
                    terms.append(cost * y[k])
                # [Constraint] forward_conversion / backward_conversion: one payment per (producer, a, t).
                name = "forward_conversion" if direction == "F" else "backward_conversion"
                model += y[k] >= var, f"{name}_{len(model.constraints)}"
    return terms


def _is_zero(expr) -> bool:
    return isinstance(expr, int) and expr == 0


def _largest_shardable(free: dict, by_name: dict) -> list[str]:
    """The free ops with a weight the ILP may shard (colwise or rowwise offered) and, of those,
    the most elements (ties all listed): `pinned_tp` shards one of them."""
    shardable = {v: math.prod(by_name[v].weight_shape) for v in free if v in by_name and by_name[v].weight_shape
                 and any(s in ("colwise", "rowwise") for s in free[v])}
    most = max(shardable.values(), default=0)
    return [v for v, numel in shardable.items() if numel == most]


def _add_pinned_tp(model, x, must: list[str]) -> None:
    import pulp
    # [Constraint] pinned_tp: one of the unit's largest shardable weights is sharded (where any can be).
    sharded = [var for (v, s), var in x.items() if v in must and s in ("colwise", "rowwise")]
    if sharded:
        model += pulp.lpSum(sharded) >= 1, "pinned_tp"


def _add_parameter_memory(model, x, node_costs, limit: float | None) -> None:
    import pulp
    # [Constraint] parameter_memory: parameter bytes per GPU of the unit's ops stay under the limit.
    if limit is not None:
        model += pulp.lpSum(x[k] * p for k, (_, _, p) in node_costs.items()) <= limit, "parameter_memory"
