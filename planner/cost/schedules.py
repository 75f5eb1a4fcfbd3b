"""Pipeline schedules in closed form: bubble, iteration time and activations in flight.

p pipeline ranks, m micro-batches, v chunks per rank (virtual stages; chunk c of the p*v
lives on rank c % p, the looping placement). f_k, b_k: forward and backward time of chunk
k for one micro-batch; R_r = sum of (f_k + b_k) over rank r's chunks. The event simulator
(planner/cost/simulator.py) plays the same schedules as per-rank action lists; on uniform
stages the two agree exactly (tests/test_schedules.py). Bubble fractions here are bubble
time / whole iteration time (Narayanan's (p-1)/m is bubble / ideal time instead).

GPipe (Huang et al. 2019) and 1F1B (PipeDream-Flush, Narayanan et al. 2021a, "Memory-
Efficient Pipeline-Parallel DNN Training"): the first micro-batch crosses every stage, the
other m - 1 are paced by the slowest one (Alpa's form, Zheng et al. 2022, eq. 2):

    T = sum_k (f_k + b_k) + (m - 1) max_k (f_k + b_k),   bubble (p-1)/(m+p-1) when uniform.

GPipe runs all forwards, then all backwards: two flow shops of identical jobs, so exactly
T = sum f + (m-1) max f + sum b + (m-1) max b, which is the form above when one stage is
slowest in both f and b (as when b is proportional to f) and larger otherwise. For 1F1B on
non-uniform stages the form is an estimate, not a bound (the simulator is usually faster, by
up to ~20% on random stages, but can be slower: forward [1, 2, 3, .25], backward
[1, 4, 3, .25], m = 2 simulates to 21.0 against 20.5); the simulator is never faster than
max_k [sum_{i<k}(f_i + b_i) + m (f_k + b_k)]: rank k cannot start before micro-batch 0
reaches it, and its last backward must still flow down to rank 0. GPipe holds m
micro-batches of activations, 1F1B min(m, p - i) on rank i.

Interleaved 1F1B (Narayanan et al. 2021b, SC21 "Efficient Large-Scale Language Model
Training on GPU Clusters Using Megatron-LM", section 2.2): the fill and drain are made of
chunks, 1/v of a rank's work each, so the bubble shrinks by v:

    T = m max_r R_r + (p - 1) max_k (f_k + b_k),   bubble ((p-1)/v) / (m + (p-1)/v) uniform,

valid for m % p == 0 (Megatron's rule, enforced). Exact on uniform chunks; on random
non-uniform chunks an estimate (the simulator was within -27%..+19% of it; simulate when
it matters). With v = 1 it is plain 1F1B. Rank i warms up with (v-1) p + 2 (p-1-i) forwards
(Megatron's and torch's ScheduleInterleaved1F1B count) and so holds (v-1) p + 2 (p-1-i) + 1
chunk-micro-batches at its peak (capped at m v); in micro-batches of the whole rank that is divided by v: p + (p-1)/v on rank 0, the
p (1 + (p-1)/(p v)) of Korthikanti et al. 2022, section 4.2.3.

Zero bubble (Qi et al. 2023, "Zero Bubble Pipeline Parallelism"): the backward splits into B
(input gradient, on the critical path) and W (weight gradient, deferrable), B = (1-w) b and
W = w b with w = backward_weight_fraction. Modelled: torch.distributed.pipelining's
ScheduleInterleavedZeroBubble ("ZB1P"; for v = 1 that is the paper's handcrafted ZB-H1):
1F1B order for F and B with warm-up (v-1) m_r + p-1-i forwards (m_r = m // max(1, m // p)),
and rank i runs the W of its oldest B from its (i+1)-th steady step on; the rest at the end.
For m >= p the simulator gives exactly (uniform chunks, checked over a grid of f, b, w, p, m)

    T = m v (f + b) + (p - 1) max(f + B - W, f, B)

i.e. the paper's ZB-H1 bubble (p-1)(F + B - W) when W <= f and W <= B, and the ramp of the
forwards or the drain of the B's when W is larger. Non-uniform, an estimate: m max_r R_r
plus, for v = 1, the hop max(f_k + B_k - W_k, f_k, B_k) of every chunk but the slowest
(Alpa's form with the hop in place of f_k + b_k; the simulator was within -11%..+0.4% of
it on random stages), for v > 1 (p - 1) times the largest hop (-11%..+38% at v = 2). For m < p the
W's cannot fill the drain regularly and there is no simple form: iteration_time_s plays the
schedule in the simulator.

The split w may differ per chunk (`backward_weight_fraction` as a list): the solver gives each
stage its weight GEMMs' share of its backward (planner/cost/compute.py `weight_gradient_share`:
0.42 for a GPT block of width 4096 on an H100 at 2048 tokens, 0.12 at 32768, where attention's
backward, which has no W, dominates), and 0 to a stage the runtime runs whole at B
(runtime/pp_split.py `needs_full_backward`: a later stage holding a trained unit fed no
floating-point tensor, or one with nothing trained before it, has no W to defer), which
takes ZB-H1's saving away at its hop (uniform stages, p = 4, m = 8, f = 1, b = 2: one such
stage of four plays 27 -> 30 of 1F1B's 33; the form, 29). The form takes each chunk's hop
with its own split (on random stages with splits in [0.3, 0.5], within -10%..+15% of the
simulator, mean |error| 2.6%, as with one split). The first stage's split moves nothing in
the simulator: nothing waits on its B, so the makespan is the same for any split of it
(tests/test_zero_bubble_whole_backward.py plays random stages); torch runs its whole backward
at its W (its inputs need no gradient), which the solver gives it (w = 1, so its hop is its
forward f: the form's mean |error| on those random stages 2.6% against 2.9% with its own
share). Activations are counted until W (W still needs the layer
inputs): rank i holds min(m v, (v-1) m_r + p) chunk-micro-batches, every rank alike; for
v = 1 that is min(m, p), 1F1B's peak on rank 0, as the paper states for ZB-H1.

PipeDream-2BW (Narayanan et al. 2021a, arXiv 2006.09503, section 3: the asynchronous
schedule of planner/plan.py `Schedule`): within a batch the order is 1F1B's, but consecutive
batches are not separated by a flush: the next batch's warm-up forwards fill the previous
one's drain, so in the steady state every rank is busy and one batch costs

    T = m max_k (f_k + b_k)                     bubble 0,

the fill and drain ((p - 1) max_k (f_k + b_k) on uniform stages) paid once per training run,
not per step: amortised over steps, left out (so is the first micro-batch's p2p latency, for
the same reason). Rank i holds 1F1B's min(m, p - i) micro-batches (the paper's "same as
PipeDream-Flush"), and each stage one more version of its weights (planner/cost/memory.py
`stashed_weight_bytes`). A plan needs m >= p (planner/plan.py refuses fewer: paper, section 3.1,
two weight versions do not suffice then; the forms here still evaluate).

That form holds only where the runtime runs 2BW without a flush (runtime/pp_async.py
`train_flush_free`: planner/plan.py `flush_free_blocker` returns None). Elsewhere (ZeRO > 0,
virtual stages, offload, ...: the blocker names why) each 2BW step runs as torch's
Schedule1F1B with the older weights swapped in, flushed between steps, so it is priced as it
runs: `flushed=True` gives 1F1B's time and bubble above (the stashed weights' memory stays,
planner/cost/memory.py). The event simulator plays one batch in isolation, which is the 1F1B
timeline: the flushed step exactly, and slower than the flush-free form by exactly the fill
and drain; its `flush_free_step_s` plays batches back to back as the flush-free executor
orders them and measures this form's m max_k (f_k + b_k) in the steady state (p2p_s = 0).

p2p: a pure latency per chunk boundary (sends are asynchronous and take no compute time);
the first micro-batch crosses 2 (p v - 1) boundaries there and back, each adding p2p_s.
Exact for GPipe, and for interleaved 1F1B while p2p_s is below a chunk's forward time (the
tests). 1F1B and zero bubble keep only about p micro-batches in flight, so each round trip's
2 (p - 1) p2p_s also stretches the steady state: the simulator is slower than this form by
up to m * 2 (p - 1) p2p_s / p. The solver (planner/solver/search.py) prices p2p by the
overlap it assumes (planner/cost/overlap.py): with `pipeline_p2p` (sends overlapped in the
steady state, as Megatron-LM's and torch's asynchronous sends run) only this latency term,
summed over the actual cuts; without, folded into the stage times (every micro-batch pays
its sends in series). Data-parallel gradient reduction after the pipeline: see
`planner.cost.overlap.grad_reduce_tail_s`, exact against the simulator's communication
streams for GPipe and 1F1B on uniform stages (tests/test_overlap.py).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from planner.plan import SCHEDULES, Plan

BACKWARD_WEIGHT_FRACTION = 0.5
"""Zero bubble's split of a chunk's backward b into B = (1 - w) b (input gradients) and W = w b
(weight gradients), unless a caller gives another w: the two GEMMs of a linear's backward
cost the same."""


def chunk_weight_fractions(backward_weight_fraction: float | Sequence[float], num_chunks: int) -> list[float]:
    """Zero bubble's W share per chunk: one value for every chunk, or one per chunk; each in [0, 1]."""
    if isinstance(backward_weight_fraction, (int, float)):
        split = [float(backward_weight_fraction)] * num_chunks
    else:
        split = [float(w) for w in backward_weight_fraction]
        if len(split) != num_chunks:
            raise ValueError(f"{len(split)} weight fractions for {num_chunks} chunks: give one, or one per chunk")
    if any(not 0.0 <= w <= 1.0 for w in split):
        raise ValueError(f"backward_weight_fraction must lie in [0, 1], got {backward_weight_fraction}")
    return split


def weight_split(plan: Plan) -> float | list[float]:
    """The W shares a plan's price assumed: per stage where it recorded them, else the default."""
    split = plan.search.stage_weight_fraction if plan.search else None
    return split if split else BACKWARD_WEIGHT_FRACTION


def check_schedule(schedule: str, num_ranks: int, num_microbatches: int, virtual_stages: int = 1) -> None:
    """Raise ValueError, saying what to change, if the schedule cannot run with these sizes."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; use one of {', '.join(SCHEDULES)}")
    if num_ranks < 1 or num_microbatches < 1 or virtual_stages < 1:
        raise ValueError(f"pipeline ranks ({num_ranks}), micro-batches ({num_microbatches}) and virtual stages "
                         f"({virtual_stages}) must all be positive (at least 1)")
    if virtual_stages > 1 and schedule in ("gpipe", "1f1b", "pipedream-2bw"):
        raise ValueError(f"{schedule} runs one chunk per rank; use interleaved-1f1b or zero-bubble for "
                         f"{virtual_stages} virtual stages")
    if schedule == "interleaved-1f1b" and virtual_stages > 1 and num_microbatches % num_ranks:
        raise ValueError(f"interleaved 1F1B needs the micro-batches ({num_microbatches}) to be a multiple of the "
                         f"pipeline ranks ({num_ranks}) (Megatron's rule); use a multiple of {num_ranks}")
    rounds = max(1, num_microbatches // num_ranks)
    if schedule == "zero-bubble" and virtual_stages > 1 and num_microbatches % rounds:
        raise ValueError(f"interleaved zero bubble needs the micro-batches ({num_microbatches}) to be a multiple of "
                         f"m // p = {rounds} (torch's ScheduleInterleavedZeroBubble rule)")


def check_stage_lists(stage_forward_s: list[float], stage_backward_s: list[float], virtual_stages: int) -> int:
    """Validate per-chunk time lists (p * v entries, chunk order); returns p * v."""
    num_chunks = len(stage_forward_s)
    if len(stage_backward_s) != num_chunks:
        raise ValueError(f"{num_chunks} forward times but {len(stage_backward_s)} backward times: give one of each per chunk")
    if virtual_stages < 1 or num_chunks == 0 or num_chunks % virtual_stages:
        raise ValueError(f"{num_chunks} chunk times do not split into pipeline ranks x {virtual_stages} virtual stages; "
                         "give p * v times in chunk order")
    if min(stage_forward_s) < 0 or min(stage_backward_s) < 0:
        raise ValueError("stage times must be non-negative")
    return num_chunks


def timed_schedule(schedule: str, flushed: bool) -> str:
    """The schedule whose closed form times a step: 1F1B's for a pipedream-2bw step the runtime
    runs flushed (`flushed`: planner/plan.py `flush_free_blocker` gave a reason; runtime/pp_async.py
    runs it as torch's Schedule1F1B), the schedule itself otherwise (module docstring)."""
    return "1f1b" if flushed and schedule == "pipedream-2bw" else schedule


def bubble_fraction(schedule: str, num_ranks: int, num_microbatches: int, virtual_stages: int = 1,
                    backward_weight_fraction: float = BACKWARD_WEIGHT_FRACTION, forward_fraction: float = 1 / 3,
                    flushed: bool = False) -> float:
    """Idle share of the iteration (bubble time / iteration time) on uniform stages.

    Only zero-bubble depends on the split of a micro-batch's work: forward_fraction f/(f+b)
    (1/3: backward twice the forward) and backward_weight_fraction W/b. `flushed`: a
    pipedream-2bw step run flushed has 1F1B's bubble (`timed_schedule`).
    """
    check_schedule(schedule, num_ranks, num_microbatches, virtual_stages)
    schedule = timed_schedule(schedule, flushed)
    p, m, v = num_ranks, num_microbatches, virtual_stages
    if schedule == "pipedream-2bw":  # no flush: the steady state has no bubble (module docstring)
        return 0.0
    if schedule in ("gpipe", "1f1b") or (schedule == "interleaved-1f1b" and v == 1):
        return (p - 1) / (m + p - 1)
    if schedule == "interleaved-1f1b":
        return ((p - 1) / v) / (m + (p - 1) / v)
    f = forward_fraction / v
    b = (1 - forward_fraction) / v
    t = iteration_time_s(schedule, [f] * (p * v), [b] * (p * v), m, v, backward_weight_fraction=backward_weight_fraction)
    return 1 - m / t


def iteration_time_s(schedule: str, stage_forward_s: list[float], stage_backward_s: list[float], num_microbatches: int,
                     virtual_stages: int = 1, p2p_s: float = 0.0,
                     backward_weight_fraction: float | Sequence[float] = BACKWARD_WEIGHT_FRACTION,
                     flushed: bool = False) -> float:
    """Closed-form time of the pipeline part of one iteration (module docstring); lists per chunk.
    `backward_weight_fraction`: zero bubble's W share, one for all chunks or one per chunk
    (module docstring). `flushed`: a pipedream-2bw step the runtime runs flushed takes 1F1B's
    time (`timed_schedule`)."""
    num_chunks = check_stage_lists(stage_forward_s, stage_backward_s, virtual_stages)
    p, m, v = num_chunks // virtual_stages, num_microbatches, virtual_stages
    check_schedule(schedule, p, m, v)
    schedule = timed_schedule(schedule, flushed)
    work = [f + b for f, b in zip(stage_forward_s, stage_backward_s, strict=False)]
    if schedule == "pipedream-2bw":  # steady state, fill/drain and first hops amortised (module docstring)
        return m * max(work)
    latency_s = 2 * (num_chunks - 1) * p2p_s  # the first micro-batch's hops there and back
    if schedule == "interleaved-1f1b" and v > 1:
        rank_work = [sum(work[k] for k in range(r, num_chunks, p)) for r in range(p)]
        return m * max(rank_work) + (p - 1) * max(work) + latency_s
    if schedule == "gpipe":  # two flow shops of identical jobs: all forwards, then all backwards
        forward_s = sum(stage_forward_s) + (m - 1) * max(stage_forward_s)
        return forward_s + sum(stage_backward_s) + (m - 1) * max(stage_backward_s) + latency_s
    if schedule != "zero-bubble":
        return sum(work) + (m - 1) * max(work) + latency_s
    split = chunk_weight_fractions(backward_weight_fraction, num_chunks)
    if m < p:  # no closed form (module docstring): play it
        from planner.cost.simulator import simulate

        return simulate(schedule, stage_forward_s, stage_backward_s, m, v, p2p_s, split).makespan_s
    # Qi et al. 2023: with the drain filled by deferred W's, a hop of the fill/drain costs
    # max(f + B - W, f, B) instead of f + b (module docstring).
    hop = [max(f + (1 - w) * b - w * b, f, (1 - w) * b)
           for f, b, w in zip(stage_forward_s, stage_backward_s, split, strict=True)]
    rank_work = [sum(work[k] for k in range(r, num_chunks, p)) for r in range(p)]
    if v == 1:
        slowest = max(range(num_chunks), key=lambda k: work[k])
        return m * work[slowest] + sum(h for k, h in enumerate(hop) if k != slowest) + latency_s
    return m * max(rank_work) + (p - 1) * max(hop) + latency_s


def forwards_first(schedule: str, num_ranks: int, num_microbatches: int, in_flight):
    """Whether a pipeline rank holding `in_flight` micro-batches at its activations' peak
    (`in_flight_microbatches`; elementwise over an array of them) ran every forward of that peak
    before its first backward, so it holds no gradient yet (zero_grad frees them at the step's
    start): one micro-batch a step without a pipeline (the runtime runs each micro-batch's forward
    and backward in turn), GPipe, and 1F1B where the rank's warm-up takes all m forwards (m <=
    in flight). Not zero bubble: its split backward runs input gradients between forwards, and on
    the demo's 2-stage plan (examples/demo.py, m = 2) the first stage measured its gradients
    held. Not interleaving or PipeDream-2BW either (not measured; counting the gradients is the
    safe side)."""
    held_back = (num_microbatches == 1) if num_ranks == 1 else schedule in ("gpipe", "1f1b")
    return np.logical_and(held_back, np.asarray(in_flight) >= num_microbatches)


@dataclass(frozen=True)
class PeakState:
    """What a pipeline rank holds at one moment of its step that may be its activations' peak:
    the memory there is in_flight x activations + pending x weight-pass inputs, the gradients if
    held, the loss if held (planner/solver/search.py `StageBuffers.state_bytes`)."""

    in_flight: float
    """Micro-batches whose activations are held (chunk-micro-batches / v, as `in_flight_microbatches`)."""
    pending: float
    """Of them, those whose weight pass waits (zero bubble's: the output gradients of their weight
    ops, which torch's `stage_backward_input` keeps for it; planner/solver/costs.py
    `UnitCostTable.weight_gradient_inputs`)."""
    gradients: bool
    """The rank's parameter gradients exist (zero_grad frees them at the step's start)."""
    loss: bool = True
    """The last stage's loss is held (not during a deferred weight pass: its input-gradient pass
    freed it)."""

    def covers(self, other: "PeakState") -> bool:
        """Holds at least what `other` holds, term by term."""
        return (self.in_flight >= other.in_flight and self.pending >= other.pending
                and self.gradients >= other.gradients and self.loss >= other.loss)


def peak_states(schedule: str, num_ranks: int, num_microbatches: int, rank: int,
                virtual_stages: int = 1, whole_chunks: frozenset[int] = frozenset()) -> tuple[PeakState, ...]:
    """The moments of pipeline rank `rank`'s step one of which is its activations' peak, whichever
    sizes its terms have: the memory model takes the largest (planner/solver/search.py).

    For every schedule but zero bubble: `in_flight_microbatches` held, with the gradients unless
    every forward of that peak precedes the rank's first backward (`forwards_first`), and then
    also the moment after that backward, one micro-batch fewer with the gradients.

    Zero bubble (torch's ScheduleInterleavedZeroBubble, `schedule_actions`), played action by
    action: a forward holds one more micro-batch; an input-gradient pass (B) makes its
    micro-batch's weight-pass inputs, kept until its weight pass (W), which makes the gradients
    and then frees the micro-batch; during a W the loss its B freed is not held. The first stage
    (rank 0's chunk 0) has no input gradient to make: torch skips its B and runs its whole
    backward as its W, which frees the micro-batch as it makes the gradients, as a 1F1B backward
    does (`stage_buffers` keeps no weight-pass inputs for it). Measured on GPT-NeoX's two stages at m = 2 (benchmarks/hf_architectures.py): the
    first rank's peak comes at its second F with no gradient yet, the last rank's during its
    second B, before any W made one, and its first W holds 27 KiB less (no loss, the gradients).
    `whole_chunks`: later stages (chunks) the runtime runs with their whole backward at B, as it
    does a stage holding a trained unit fed no floating-point tensor (runtime/pp_split.py
    `needs_full_backward`: a decoder's token embedding); their W's do nothing. Only the states no
    other covers (`PeakState.covers`) are kept."""
    if schedule != "zero-bubble":
        level = in_flight_microbatches(schedule, num_ranks, num_microbatches, rank, virtual_stages)
        if not forwards_first(schedule, num_ranks, num_microbatches, level):
            return (PeakState(level, 0.0, True),)
        # Every forward of the peak precedes the first backward, which then makes the gradients
        # as it frees its micro-batch: right after it, one micro-batch fewer and the gradients,
        # the larger moment where a stage's gradients outweigh a micro-batch's activations
        # (short sequences, large layers: GPipe at micro-batch 1 and 512 tokens).
        return (PeakState(level, 0.0, False), PeakState(max(level - 1, 0), 0.0, True))
    return _zero_bubble_states(num_ranks, num_microbatches, virtual_stages, whole_chunks)[rank]


@lru_cache(maxsize=256)
def _zero_bubble_states(num_ranks: int, num_microbatches: int, virtual_stages: int,
                        whole_chunks: frozenset[int]) -> tuple[tuple[PeakState, ...], ...]:
    from planner.cost.simulator import schedule_actions

    v = virtual_stages
    out = []
    for actions in schedule_actions("zero-bubble", num_ranks, num_microbatches, v):
        held = pending = 0
        made = False
        moments: dict[tuple[int, int, bool, bool], None] = {}  # (held, pending, gradients, loss), in order of first seen
        for kind, chunk, _ in actions:
            first = chunk == 0  # the first stage's whole backward runs as its W
            whole = chunk in whole_chunks and not first  # a later one's at its B
            if kind == "F":
                held += 1
                moments[held, pending, made, True] = None
            elif (kind == "B" and whole) or (kind == "W" and first):  # frees the micro-batch as it makes the gradients
                moments[held, pending, made, True] = None
                held, made = held - 1, True
            elif kind == "B" and not first:
                pending += 1
                moments[held, pending, made, True] = None
            elif kind == "W" and not whole and not first:
                moments[held, pending, True, False] = None
                held, pending, made = held - 1, pending - 1, True
        # Thousands of actions, fewer distinct moments: PeakStates only for those no other covers.
        out.append(tuple(PeakState(h / v, q / v, g, loss=loss) for h, q, g, loss in _uncovered(list(moments))))
    return tuple(out)


def _uncovered(moments: list[tuple[int, int, bool, bool]]) -> list[tuple[int, int, bool, bool]]:
    """The distinct (held, pending, gradients, loss) moments that no other covers (holds at least
    as much, term by term: `PeakState.covers`), in their order. A long zero-bubble step has
    thousands of distinct moments, and comparing every pair of them took most of a first solve
    of GPT-3 on 1024 GPUs; here, per pair of flags, the moments sorted by held (descending) give
    the most pending held by any moment holding at least as many, in O(n log n)."""
    by_flags: dict[tuple[bool, bool], list[tuple[int, int]]] = {}
    for held, pending, gradients, loss in moments:
        by_flags.setdefault((gradients, loss), []).append((held, pending))
    frontier = {}  # flags -> (helds descending, the most pending among moments holding at least that many)
    for flags, points in by_flags.items():
        points.sort(reverse=True)
        most, running = [], -1
        for _, pending in points:
            running = max(running, pending)
            most.append(running)
        frontier[flags] = ([-held for held, _ in points], most)

    def covered(held: int, pending: int, gradients: bool, loss: bool) -> bool:
        for (g, l), (negated, most) in frontier.items():
            if g < gradients or l < loss:
                continue
            if (g, l) == (gradients, loss):  # another moment of the same flags: more held, or as many and more pending
                i = bisect.bisect_left(negated, -held)  # the first with as many held as this one: itself or one with more pending
                if i > 0 and most[i - 1] >= pending:
                    return True
                # moments with as many held come in descending pending: this one is covered if it is not the first
                if i < len(negated) and negated[i] == -held and by_flags[g, l][i][1] > pending:
                    return True
            else:
                i = bisect.bisect_right(negated, -held)  # all holding at least as many
                if i > 0 and most[i - 1] >= pending:
                    return True
        return False

    return [moment for moment in moments if not covered(*moment)]


def zero_bubble_least_in_flight(num_ranks: int, num_microbatches: int, rank: int, virtual_stages: int = 1) -> float:
    """The most micro-batches rank `rank` holds in zero bubble when every stage but the first runs
    its whole backward at B (`peak_states` with every later chunk in `whole_chunks`, the fewest
    any stage placement holds): each F holds one more and each B (the first stage's W, right
    after its B) frees one, so the peak is torch's warm-up forwards plus one, or every forward
    when the warm-up is all of them. In chunk-micro-batches / v; the memory bounds
    (planner/solver/bounds.py) read it for every configuration, where playing the schedule took
    most of a first solve of GPT-3 on 64 GPUs (tests/test_schedules.py checks it against the
    played schedule)."""
    p, m, v = num_ranks, num_microbatches, virtual_stages
    per_round = m // max(1, m // p)
    warmup = min((v - 1) * per_round + p - rank - 1, m * v)
    return min(warmup + 1, m * v) / v


def zero_bubble_least_held_with_gradients(num_ranks: int, num_microbatches: int, rank: int,
                                          virtual_stages: int = 1) -> float:
    """The most micro-batches rank `rank` holds in zero bubble at some moment after its first
    weight pass, when its parameter gradients exist, at the least over stage placements: with
    every later stage running its whole backward at B (as `zero_bubble_least_in_flight`), which
    frees each micro-batch no later than any placement does, and once a rank has run a W its
    gradients exist whatever the placement (the W makes them, or a whole backward's B before it
    did). In chunk-micro-batches / v. With more micro-batches than ranks a forward follows the
    first W while the rank still holds its warm-up, so it is the peak itself; with as many, one
    chunk-micro-batch fewer; with fewer, 0 (the bound claims nothing). Checked against the played
    schedule in tests/test_schedules.py; the memory bounds (planner/solver/bounds.py) read it."""
    p, m, v = num_ranks, num_microbatches, virtual_stages
    if m > p:
        return zero_bubble_least_in_flight(p, m, rank, v)
    if m == p:
        return zero_bubble_least_in_flight(p, m, rank, v) - 1 / v
    return 0.0


def in_flight_microbatches(schedule: str, num_ranks: int, num_microbatches: int, rank: int,
                           virtual_stages: int = 1) -> float:
    """Peak micro-batches whose activations pipeline rank `rank` holds, in units of one
    micro-batch through all of that rank's chunks (chunk-micro-batches / v)."""
    check_schedule(schedule, num_ranks, num_microbatches, virtual_stages)
    p, m, v, i = num_ranks, num_microbatches, virtual_stages, rank
    if not 0 <= i < p:
        raise ValueError(f"rank {i} is not a pipeline rank of {p}")
    if schedule == "gpipe":
        return float(m)
    if schedule in ("1f1b", "pipedream-2bw") or (schedule == "interleaved-1f1b" and v == 1):
        return float(min(m, p - i))
    if schedule == "interleaved-1f1b":
        return min(m * v, (v - 1) * p + 2 * (p - 1 - i) + 1) / v
    per_round = m // max(1, m // p)
    return min(m * v, (v - 1) * per_round + p) / v
