"""Mixture-of-experts layers under expert parallelism: what the EP degree changes.

Per MoE layer (profile `Unit.moe`, planner/moe.py recognises them by structure), one
micro-batch, one GPU. T tokens enter the layer on a rank (T/tp with sequence parallelism),
each goes to k of E experts; d is the model dim, ep the EP degree, c >= 1 the routing
imbalance (the busiest rank receives c times the balanced share; `imbalance`, a solve-time
option, default 1.0).

- **Token copies on the wire** (GShard's dispatch and combine, Lepikhin et al. 2020, section
  2.2; Megatron-Core's `alltoall` token dispatcher). A rank sends its T k copies of d-vectors,
  D = c T k d x dtype bytes, to the ranks owning their experts (all-to-all with variable
  splits, balanced in expectation) and receives the outputs back: two all-to-alls in the
  forward, their reverse in the backward (`ALL_TO_ALLS_PER_STEP` = 4), and two more when full
  recomputation replays the forward. The variable splits are agreed first: each forward
  exchanges its per-expert copy counts, one all-to-all of E integers (`COUNT_BYTES` each),
  as runtime/apply_ep.py does and Megatron-Core's all-to-all dispatcher does before its
  permutation; its latency is what it costs. The group's placement picks the links
  (planner/cost/collectives.py: within a node over NVLink; across nodes each GPU's remote
  share leaves through its own NIC).
- **Expert GEMMs.** Under balanced routing a rank computes c T k token-expert products at
  any ep, but over E/ep local experts, each receiving m = c T k ep / E rows. Small-m GEMMs
  are bound by reading the expert's weights, so the profiled experts' time (ep 1, where each
  expert gets T k / E rows) is rescaled by the roofline ratio
      R(ep) / R(1),   R(ep) = (E / ep) max(m F / P, (W + m A) / B)
  with F the FLOPs per token copy, W one expert's weight bytes, A the activation bytes one
  copy moves (input, intermediate and output of an expert MLP: (2d + 4f) x dtype for a gated
  MLP of width f), P and B the GPU's achievable FLOP/s and bandwidth (planner/hardware.py).
  The ratio is 1 when every GEMM is compute-bound and falls below 1 as ep amortises the
  weights over more rows: an expert of width 768 at 8 tokens is not a 4k x 4k GEMM
  (grouped-GEMM efficiency; the roofline of Williams et al. 2009 per expert). The busiest
  rank's c enters only for ep > 1: on one rank every copy is computed whatever the routing.
- **Permutation** (ep > 1): copies are sorted by expert before the dispatch and put back in
  token order after the combine (Megatron-Core's permute/unpermute, runtime/apply_ep.py
  steps 1 and 4): each reads and writes D bytes, in the forward and again in the backward.
- **Memory.** Experts' parameters divided by ep; their gradients and optimizer state further
  by expert data parallelism under ZeRO (`expert_dp_degree`). Stored activations do not
  change with ep (a rank still holds its c T k copies; the profile's saved bytes count them).
- **Expert tensor parallelism** (pinned only: `Layout.expert_tp_degree` t, equal to the TP degree;
  Megatron-Core's ETP, `--expert-tensor-parallel-size`; runtime/apply_ep.py). Each expert's
  gate/up projections are split by columns and its down projection by rows over the t TP ranks
  (Shoeybi et al. 2019, "Megatron-LM", section 3, the MLP split), so one expert's GEMM has F / t
  FLOPs per copy and W / t weight bytes, and a copy moves (2d + 4f / t) x dtype bytes (the
  intermediate is split, the input and output are not):
      R(ep, t) = (E / ep) max(m F / (t P), (W / t + m A_t) / B),   A_t = (2d + 4f / t) x dtype,
  and the experts' time is rescaled by R(ep, t) / R(1, 1) (`expert_time_ratio`). The expert
  output is a partial sum on each TP rank: one all-reduce of the layer's T d x dtype bytes over
  the TP group in the forward, and one of the input's gradient in the backward (Megatron's g
  and f operators; `ETP_ALL_REDUCES_PER_STEP` = 2, plus the forward's again under full
  recomputation). Tokens are the same on the t ranks (no sequence parallelism: the plan
  refuses it with expert_tp_degree > 1), so no all-gather is needed. Memory: the experts'
  parameters, gradients and optimizer state / (ep t). The experts' saved activations are
  not divided (an upper bound: their intermediates shrink by t, their inputs do not).
"""

from __future__ import annotations

from dataclasses import dataclass

from planner.cost.compute import interpolate

ALL_TO_ALLS_PER_STEP = 4
"""Forward dispatch and combine, and their reverses in the backward."""
COUNT_BYTES = 8
"""Bytes of one expert's copy count in the counts exchange (int64, `torch.bincount`'s type)."""
ETP_ALL_REDUCES_PER_STEP = 2
"""Expert TP: the experts' output summed over TP in the forward, their input's gradient in the backward."""


@dataclass(frozen=True)
class MoEShape:
    """One MoE layer at one micro-batch size, per GPU at ep 1 (from the profile)."""

    tokens: float
    """Tokens entering the layer on one rank (T)."""
    top_k: int
    """Experts per token (k)."""
    num_experts: int
    """Experts in the layer (E)."""
    model_dim: int
    """Token width (d)."""
    flops_per_copy: float
    """Forward FLOPs of one token copy through one expert (F)."""
    expert_weight_bytes: float
    """One expert's parameter bytes (W)."""
    copy_activation_bytes: float
    """Bytes one token copy moves through an expert's GEMMs (A)."""
    dtype_bytes: int
    """Bytes per element of the dispatched tokens."""

    @property
    def dispatch_bytes(self) -> float:
        """Balanced bytes of the copies one rank sends in one all-to-all (T k d x dtype)."""
        return self.tokens * self.top_k * self.model_dim * self.dtype_bytes


def moe_shapes(unit, micro_batch_size: float, dtype_bytes: int, tokens_divisor: int = 1) -> list[MoEShape]:
    """The unit's MoE layers at `micro_batch_size`; tokens divided by `tokens_divisor` (the TP
    degree under sequence parallelism, where a rank holds its slice of the sequence)."""
    shapes = []
    for layer in getattr(unit, "moe", None) or ():
        tokens = interpolate({k: float(c.tokens) for k, c in layer.costs.items()}, micro_batch_size)
        flops = interpolate({k: float(c.expert_forward_flops) for k, c in layer.costs.items()}, micro_batch_size)
        copies = tokens * layer.top_k
        width = layer.expert_hidden_dim
        shapes.append(MoEShape(
            tokens=tokens / tokens_divisor,
            top_k=layer.top_k,
            num_experts=layer.num_experts,
            model_dim=layer.model_dim,
            flops_per_copy=flops / copies if copies else 0.0,
            expert_weight_bytes=layer.expert_parameter_bytes / layer.num_experts,
            copy_activation_bytes=(2 * layer.model_dim + 4 * width) * dtype_bytes,
            dtype_bytes=dtype_bytes,
        ))
    return shapes


def _roofline_s(shape: MoEShape, ep: int, flops_per_s: float, bytes_per_s: float, imbalance: float,
                expert_tp: int = 1) -> float:
    """R(ep, t): the local experts' GEMM time, each expert's rows from the whole EP group and
    its matrices split t ways (module docstring)."""
    rows = imbalance * shape.tokens * shape.top_k * ep / shape.num_experts
    edges = 2 * shape.model_dim * shape.dtype_bytes  # a copy's input and output, whole under expert TP
    copy_bytes = edges + (shape.copy_activation_bytes - edges) / expert_tp
    per_expert = max(rows * shape.flops_per_copy / (expert_tp * flops_per_s),
                     (shape.expert_weight_bytes / expert_tp + rows * copy_bytes) / bytes_per_s)
    return shape.num_experts / ep * per_expert


def expert_time_ratio(shape: MoEShape, ep: int, flops_per_s: float, bytes_per_s: float, imbalance: float = 1.0,
                      expert_tp: int = 1) -> float:
    """Experts' time at ep (and expert TP t) over their profiled time at ep 1, t 1 (module docstring)."""
    if (ep == 1 and expert_tp == 1) or shape.tokens <= 0:
        return 1.0
    base = _roofline_s(shape, 1, flops_per_s, bytes_per_s, 1.0)
    busiest = imbalance if ep > 1 else 1.0  # on one EP rank every copy is computed whatever the routing
    return _roofline_s(shape, ep, flops_per_s, bytes_per_s, busiest, expert_tp) / base if base > 0 else 1.0


def expert_tp_all_reduce_bytes(shape: MoEShape, expert_tp: int) -> float:
    """Bytes of one expert-TP all-reduce: the layer's T x d output (or its input's gradient),
    summed over the TP group (0 without expert TP)."""
    return 0.0 if expert_tp == 1 else shape.tokens * shape.model_dim * shape.dtype_bytes


def permutation_s(shape: MoEShape, ep: int, bytes_per_s: float, imbalance: float = 1.0) -> float:
    """Forward (and, alike, backward) seconds of sorting copies by expert and restoring their order."""
    if ep == 1:
        return 0.0
    return 2 * 2 * imbalance * shape.dispatch_bytes / bytes_per_s  # permute + unpermute, each read + write


def dispatch_bytes_per_rank(shape: MoEShape, ep: int, imbalance: float = 1.0) -> float:
    """Bytes of copies the busiest rank sends in one all-to-all (0 without EP)."""
    return 0.0 if ep == 1 else imbalance * shape.dispatch_bytes


def expert_dp_degree(dp: int, tp: int, ep: int, folded: bool) -> int:
    """Ranks holding the same experts: dp / ep, or dp x tp / ep when EP is folded over the
    tensor-parallel ranks too (Megatron-Core's parallel folding with sequence parallelism:
    each TP rank holds different tokens, so the expert layers see dp x tp data-parallel ranks)."""
    ranks = dp * tp if folded else dp
    assert ranks % ep == 0, "candidate configurations keep ep a divisor of the expert data-parallel ranks"
    return ranks // ep
