"""Communication overlapped with compute: how much of a collective a rank still waits for.

Each rank is one compute stream and communication streams (NCCL kernels run on CUDA streams
of their own, so a collective proceeds while the compute stream runs other kernels). A
collective costs the step only the part that finds no compute to hide behind. Three
overlaps of today's stacks are modelled; which ones a prediction assumes is recorded in
the plan (`Prediction.overlap`, names in `OVERLAP_NAMES`):

- `grad_reduce` (PyTorch DDP's bucketed all-reduce, Li et al. 2020, "PyTorch Distributed",
  VLDB, section 3.2; FSDP2's per-unit reduce-scatter; Megatron-LM's
  `--overlap-grad-reduce`): the gradients are split into n buckets that become ready one
  after another while the backward runs; bucket i is reduced on the communication stream as
  soon as it is ready and the stream is free. With n equal buckets of a collective of C
  seconds in all, ready evenly over a backward window of W seconds, the last bucket ends

      exposed_s(C, W, n) = max(C / n, C - W (n - 1) / n)

  after the window: the last bucket (ready only when the backward ends) is always exposed;
  when C <= W the stream keeps up and nothing else is; when C > W the stream is the
  bottleneck and the step waits C - W plus the last bucket's share of W (the stream was
  idle until the first bucket was ready). Derivation: bucket k (1-based) is ready at k W / n
  and the stream finishes it at max_k (k W / n + (n - k + 1) C / n), the maximum being at
  k = n (C <= W) or k = 1 (C > W). Gradients are reduced once per step (DDP's `no_sync`,
  Megatron's gradient buffer accumulate micro-batches) under the last micro-batch's
  backward, except where the gradients are sharded (ZeRO 2, 3: FSDP2 reduce-scatters every
  backward).
- `param_gather` (FSDP2's and DeepSpeed ZeRO-3's prefetch, Zhao et al. 2023, "PyTorch FSDP",
  VLDB, section 3.3; Megatron-LM's `--overlap-param-gather`): unit u's parameters are
  all-gathered while unit u - 1 computes, so with gathers g_u and compute c_u

      prefetch_exposed_s(g, c) = g_0 + sum_{u >= 1} max(0, g_u - c_{u-1})

  (the first gather has nothing to hide behind, the others only their excess). In backward
  the gather of unit u - 1 and the reduce-scatter of unit u share the stream under the
  backward of unit u - 1; the last reduce-scatter is exposed.
- `pipeline_p2p`: activations and their gradients are sent asynchronously (Megatron-LM's
  batched isend/irecv; torch.distributed.pipelining's async sends): in the steady state a
  send overlaps the next micro-batch's compute, so only the first micro-batch's hops through
  the fill and drain are on the critical path (planner/cost/schedules.py, `p2p_s`).

Not overlapped: tensor-parallel collectives (each GEMM waits for its input; async TP, e.g.
Megatron's `--tp-comm-overlap` or torch's `_micro_pipeline_tp`, would be `tp_comm`, not
assumed), the optimizer step, and the all-reduce of weights tied across pipeline stages.
"""

from __future__ import annotations

from dataclasses import dataclass

OVERLAP_NAMES = ("grad_reduce", "param_gather", "pipeline_p2p", "tp_comm")
"""Overlaps a prediction may assume (module docstring)."""


@dataclass(frozen=True)
class Overlap:
    """Which communication the cost model hides behind compute (module docstring)."""

    grad_reduce: bool = True
    """Data-parallel gradient reduction bucketed under the backward."""
    param_gather: bool = True
    """ZeRO parameter all-gathers prefetched under the previous unit's compute."""
    pipeline_p2p: bool = True
    """Pipeline sends overlapped in the steady state (only the fill and drain hops exposed)."""
    tp_comm: bool = False
    """Tensor-parallel collectives overlapped with the GEMMs (async TP); off: exposed."""

    def names(self) -> list[str]:
        return [name for name in OVERLAP_NAMES if getattr(self, name)]


SERIAL = Overlap(False, False, False, False)
"""Every collective in series with compute (the cost model before overlap)."""


def exposed_s(comm_s: float, window_s: float, num_buckets: int = 1) -> float:
    """Seconds of a bucketed collective left after its compute window (module docstring)."""
    if comm_s <= 0:
        return 0.0
    n = max(int(num_buckets), 1)
    return max(comm_s / n, comm_s - max(window_s, 0.0) * (n - 1) / n)


def prefetch_exposed_s(gather_s, compute_s) -> float:
    """Seconds of per-unit gathers, each prefetched under the previous unit's compute."""
    gather_s, compute_s = list(gather_s), list(compute_s)
    if not gather_s:
        return 0.0
    return gather_s[0] + sum(max(0.0, g - c) for g, c in zip(gather_s[1:], compute_s[:-1], strict=False))


def drain_slack_s(schedule: str, stage_backward_s, num_ranks: int) -> list[float]:
    """Per pipeline rank: how long the pipeline still runs after the rank's last backward.

    The last micro-batch's backward leaves rank r, then runs on chunks r-1 .. 0 (ranks r-1
    .. 0): sum_{k < r} b_k in GPipe, 1F1B and interleaved 1F1B (exact on uniform stages with
    no p2p latency). Zero bubble fills that drain with deferred weight gradients: no slack.
    """
    if schedule == "zero-bubble":
        return [0.0] * num_ranks
    backward = list(stage_backward_s)
    return [sum(backward[:min(r, len(backward))]) for r in range(num_ranks)]


def grad_reduce_tail_s(comm_s, window_s, slack_s, num_buckets: int = 1) -> float:
    """What a step waits for after its pipeline: over ranks, the bucketed gradient reduction
    the last backward (`window_s`) and the drain after it (`slack_s`) do not hide."""
    return max([max(exposed_s(c, w, num_buckets) - s, 0.0) for c, w, s in zip(comm_s, window_s, slack_s, strict=False)], default=0.0)
