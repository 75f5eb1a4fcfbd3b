"""Context parallelism: one sequence split over cp ranks, attention computed across the split.

A sample's T tokens are split over the cp ranks of a group, each rank holding two mirrored
chunks of T / (2 cp) (causal load balancing: rank i holds chunks i and 2 cp - 1 - i, so every
rank's queries see about as many keys as every other's; Llama 3 paper, Dubey et al. 2024,
section 3.3.2; torch.distributed.tensor.experimental.context_parallel's `_load_balance`). The
sequence must therefore divide into 2 cp chunks (`cp_refusal`).

**Compute and stored activations** are what the profile says of b / cp samples: token-wise ops
(linears, norms, activations) scale with the tokens a rank holds, causal attention with the
query-key pairs it computes, b T^2 / 2 / cp under balancing. So a unit's per-rank cost under CP
is its cost at micro-batch b / cp (planner/solver/costs.py builds the table there; weights'
memory traffic is the only term that does not shrink, and the profile's constant part keeps it).

**Communication** per attention op and micro-batch. Every query needs the keys and values of
the whole sequence, KV = 2 b T d_kv x dtype bytes (d_kv the key/value projection width, small
under grouped-query attention; `kv_bytes`). Two ways to bring them:
- all-gather (Llama 3's choice, `all_gather_cp_s`): the forward all-gathers K and V before
  attention (output KV), the backward reduce-scatters their gradients (input KV). Attention
  waits for the whole K/V, so both are exposed; full recomputation gathers again.
- ring (Liu et al. 2023, "Ring Attention with Blockwise Transformers"; torch's
  `_RotateMethod.ALL_TO_ALL`/ring, `ring_cp_s`): cp - 1 steps, each sending the K/V block at
  hand (KV / cp) to the next rank while attention runs on it: per step the exposed part is
  max(0, send - compute), and the first block's compute has nothing to hide behind. The
  backward passes K/V blocks and their gradient accumulators (2 KV / cp per step) under the
  attention backward's blocks.
The group is cp data-parallel ranks, tp apart (CP folds onto the dp ranks, as EP does:
planner/cost/moe.py); its gradient reduction is the data-parallel one, since every rank of
the group trains the same weights on different tokens.

The search prices both for each CP configuration and keeps the cheaper (`cp_unit_s`; the plan's
`Layout.cp_algorithm` records it, runtime/apply_cp.py and runtime/cp_ring.py run it). The ring
wins where a block's send hides behind its attention (long sequences: attention grows as T^2,
K/V as T); the all-gather where little attention is left to hide behind (short sequences), the
ring then exposing cp - 1 steps and sending twice the reduce-scatter's bytes in the backward.

**Memory**: stored activations / cp (above), plus the other ranks' K/V that attention keeps for
its backward (`saved_kv_bytes`: the gathered KV (cp - 1) / cp for all-gather; none for the ring,
whose backward passes the blocks around again), and the K/V in flight during one attention
(`gathered_kv_bytes`: two blocks for the ring, the one at hand and the next).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

CP_METHODS = ("all-gather", "ring")
"""How K/V travel (module docstring)."""
CP_PIPELINE_SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zero-bubble")
"""Pipeline schedules the runtime runs under context parallelism, virtual stages included: each
stage chunk of a rank gets the attention mode (runtime/train.py), and CP2 x PP2 trains to the
one-process result under each (tests/test_runtime_cp.py `test_cp2_x_pp2_parity`). Not the
asynchronous pipedream-2bw, whose executor has not been run under CP."""


@dataclass(frozen=True)
class AttentionShape:
    """One attention op of a unit at one micro-batch size, whole sequence."""

    tokens: float
    """b x T: the query positions of one micro-batch."""
    kv_features: int
    """Width of the key (and the value) projection, d_kv."""


def attention_shapes(unit, micro_batch_size: float) -> list[AttentionShape]:
    """The unit's attention ops (profile `Unit.ops` of kind `attention`, or the score matmuls of a
    materialised one) with their key/value width, read from the projection feeding the key."""
    ops = {op.name: op for op in unit.ops}
    scale = micro_batch_size / min(unit.costs)  # op shapes are at the smallest profiled size
    shapes = []
    for op in unit.ops:
        if op.kind != "attention":
            continue
        producers = [ops[name] for name in op.inputs if name in ops and ops[name].kind == "linear"]
        if not producers:
            continue
        # Query, key and value projections feed it; grouped-query attention's K/V are the narrow ones.
        kv = min(p.output_shape[-1] for p in producers)
        batch, seq = op.input_shape[0], op.input_shape[-2]
        shapes.append(AttentionShape(tokens=batch * seq * scale, kv_features=kv))
    return shapes


@dataclass(frozen=True)
class CpCollectives:
    """Seconds of the messages CP sends in one CP group (cp data-parallel ranks, tp apart)."""

    all_gather_s: Callable[[float], float]
    """One all-gather of this many gathered (output) bytes."""
    reduce_scatter_s: Callable[[float], float]
    """One reduce-scatter of this many input bytes."""
    p2p_s: Callable[[float], float]
    """One ring step: every rank sends this many bytes to the next (the slowest hop: across nodes
    when the group spans several)."""


def attention_share(unit) -> float:
    """Share of the unit's forward FLOPs in its attention ops (profile `Unit.ops` of kind
    `attention`, at the smallest profiled micro-batch; the share does not change with it): the
    part of the unit's time the ring's sends can hide behind."""
    total = unit.costs[min(unit.costs)].forward_flops
    attention = sum(op.forward_flops for op in unit.ops if op.kind == "attention")
    return min(attention / total, 1.0) if total > 0 else 0.0


def kv_bytes(unit, micro_batch_size: float, dtype_bytes: int) -> float:
    """Bytes of K and V of the whole sequence over the unit's attention ops (one micro-batch)."""
    return sum(2 * a.tokens * a.kv_features * dtype_bytes for a in attention_shapes(unit, micro_batch_size))


def all_gather_cp_s(kv: float, cp: int, all_gather_s, reduce_scatter_s) -> tuple[float, float]:
    """(forward, backward) exposed seconds of all-gather CP for `kv` bytes of K/V: the gather
    before attention, the reduce-scatter of dK/dV after its backward. `all_gather_s(nbytes)` and
    `reduce_scatter_s(nbytes)` price one collective of the gathered size in the CP group."""
    if cp == 1 or kv <= 0:
        return 0.0, 0.0
    return all_gather_s(kv), reduce_scatter_s(kv)


def ring_cp_s(kv: float, cp: int, p2p_s, attention_forward_s: float, attention_backward_s: float) -> tuple[float, float]:
    """(forward, backward) exposed seconds of ring CP: cp - 1 sends of a K/V block (KV / cp), each
    under the attention on one block (the rank's attention time / cp); the backward sends K/V
    and their gradient accumulators (2 KV / cp) under the backward's blocks. `p2p_s(nbytes)` is
    one send to the next rank of the group."""
    if cp == 1 or kv <= 0:
        return 0.0, 0.0
    steps = cp - 1
    forward = steps * max(0.0, p2p_s(kv / cp) - attention_forward_s / cp)
    backward = steps * max(0.0, p2p_s(2 * kv / cp) - attention_backward_s / cp)
    return forward, backward


def cp_unit_s(method: str, kv: float, cp: int, collectives: CpCollectives, attention_forward_s: float,
              attention_backward_s: float) -> tuple[float, float]:
    """(forward, backward) exposed CP seconds of one unit by `method` (one of `CP_METHODS`), for
    `kv` bytes of K/V and a rank's attention time (forward, backward) in the unit."""
    if method == "ring":
        return ring_cp_s(kv, cp, collectives.p2p_s, attention_forward_s, attention_backward_s)
    assert method == "all-gather", method  # the plan schema admits only CP_METHODS
    return all_gather_cp_s(kv, cp, collectives.all_gather_s, collectives.reduce_scatter_s)


def saved_kv_bytes(kv: float, cp: int, method: str) -> float:
    """Bytes of other ranks' K/V attention keeps for its backward (module docstring, Memory)."""
    return gathered_kv_bytes(kv, cp, method) if method == "all-gather" else 0.0


def gathered_kv_bytes(kv: float, cp: int, method: str) -> float:
    """Bytes of other ranks' K/V a rank holds during one attention (forward or backward)."""
    if cp == 1:
        return 0.0
    return kv * (cp - 1) / cp if method == "all-gather" else 2 * kv / cp


def cp_refusal(sequence_length: int | None, cp: int, obstacles: Sequence[str] = (), attention_calls: int | None = None
               ) -> str | None:
    """Why a CP degree cannot split this sequence (None: it can). Balancing needs 2 cp chunks;
    the profile's `cp_obstacles` would each see one rank's tokens alone, and so would attention
    not computed by SDPA (`attention_calls` 0)."""
    if cp == 1:
        return None
    if attention_calls == 0:
        return ("the model's forward calls no F.scaled_dot_product_attention (attention computed as materialised "
                "scores, or none), so each rank's queries would see only its own keys")
    if obstacles:
        return (f"the model's forward does what a split sequence cannot follow ({'; '.join(obstacles[:2])}): each rank "
                "would run it over its own tokens alone (positions counted from an attention mask would restart at 0 "
                "on every rank; a sliding window's mask cannot be translated to the other ranks' keys)")
    if sequence_length is None:
        return "the profile records no sequence length (the input is not a (batch, sequence) token tensor)"
    if sequence_length % (2 * cp):
        return (f"the sequence of {sequence_length} tokens does not split into 2 x {cp} = {2 * cp} equal chunks "
                f"(causal load balancing gives each rank two mirrored chunks)")
    return None


def cp_degrees(sequence_length: int | None, dp: int, most: int = 64) -> list[int]:
    """CP degrees to try with dp data-parallel ranks: powers of two dividing dp that split the sequence."""
    return [c for c in (2 ** k for k in range(int(math.log2(max(dp, 1))) + 1))
            if c <= most and dp % c == 0 and cp_refusal(sequence_length, c) is None]
