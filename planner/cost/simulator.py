"""Event simulator: pipeline schedules as data, played action by action on per-chunk times.

A schedule is, per pipeline rank, the ordered list of actions `(kind, chunk, microbatch)`
(`schedule_actions`), written like torch.distributed.pipelining's actions: `0F3` is the
forward of micro-batch 3 on chunk 0. Kinds: F (forward), BW (full backward), B (input
gradient only) and W (weight gradient only); B/W appear in zero-bubble, BW elsewhere.
With v virtual stages there are p*v chunks and chunk c lives on rank c % p.

`simulate` plays the lists: a rank runs its actions strictly in order, each as soon as the
rank is free and the action's inputs have arrived:

    F(c, j)  needs F(c-1, j) + p2p                     (c > 0)
    BW/B(c, j) needs F(c, j) and BW/B(c+1, j) + p2p      (the last chunk: only F(c, j))
    W(c, j)  needs B(c, j)

p2p is a pure latency on every chunk boundary, also between two chunks of one rank (no
special case for a local hand-off); sends are asynchronous: they occupy no compute time and
links have no contention. A list that can never finish (an action waits on one that is
behind it somewhere) raises ValueError with the rank grid, the stuck action in brackets.

Communication streams (`grad_sync_s`): each rank also has a communication stream, which
runs its data-parallel gradient reduction while the compute stream goes on (PyTorch DDP,
FSDP2, Megatron-LM's --overlap-grad-reduce; planner/cost/overlap.py). A chunk's gradients
are complete after its last weight-gradient action (BW, or W in zero bubble, of the last
micro-batch); they are cut into `num_buckets` buckets per rank, bucket i of a chunk ready
i/k of the way through that action (k: the chunk's share of the buckets), and the stream
reduces ready buckets one at a time in the order they become ready. The step ends when both
streams of every rank are done (`Timeline.step_s`). When the buckets are ready
(`grad_ready`, as planner/solver/comm_pricing.py `dp_tail_s` prices the same runtimes):
"backward", during that last action, as gradient hooks fire (DDP, Megatron-LM); "chunk", all
of a chunk's at the end of its last backward (FSDP2 in a pipeline: torch's schedules reduce a
stage's gradients after its last backward); "step", all of a rank's at the end of its last
action (zero bubble's ZeRO 0: the weight pass sets gradients by hand, no hook sees them, and
the runtime reduces after the step's last one).

PipeDream-2BW: `simulate` plays one batch alone, 1F1B's timeline, which is what the runtime
runs where it flushes between steps (planner/plan.py `flush_free_blocker` gives a reason):
the flushed 2BW step, priced as 1F1B (planner/cost/schedules.py `timed_schedule`). Where the
runtime runs without a flush (runtime/pp_async.py `flush_free_actions`: the whole run one
1F1B over the global micro-batches g = t m + j, batch t's update after its last backward),
`flush_free_step_s` plays that run and measures one step in its steady state.

Activations held: a chunk-micro-batch is counted from its F until its BW (or, in
zero-bubble, its W: the weight gradient still needs the layer inputs, Qi et al. 2023
section 2). Because a rank's count changes only at its own actions, the peak follows from
the action order alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from planner.cost.schedules import BACKWARD_WEIGHT_FRACTION, check_schedule, check_stage_lists, chunk_weight_fractions

Action = tuple[str, int, int]
"""(kind, global chunk, micro-batch); kind is F, BW, B or W."""


@dataclass(frozen=True)
class Event:
    """One action as it ran."""

    rank: int
    """Pipeline rank that ran it."""
    chunk: int
    """Global chunk (stage) index; lives on rank chunk % num_ranks."""
    microbatch: int
    """Micro-batch index, 0-based."""
    kind: str
    """F, BW (full backward), B (input gradient) or W (weight gradient)."""
    start_s: float
    """Start time from the beginning of the iteration."""
    end_s: float
    """End time from the beginning of the iteration."""


@dataclass(frozen=True)
class Timeline:
    """The result of playing a schedule."""

    schedule: str
    """Schedule name (one of planner.cost.schedules.SCHEDULES)."""
    num_ranks: int
    """Pipeline ranks p."""
    events: tuple[Event, ...]
    """Every action that ran, in the order the simulator committed them."""
    makespan_s: float
    """End of the last action: the pipeline part of one iteration."""
    peak_in_flight: tuple[int, ...]
    """Per rank: most chunk-micro-batches whose activations it held at once."""
    comm_events: tuple[Event, ...] = ()
    """Gradient-reduction buckets on the ranks' communication streams (kind "R"; `simulate`'s
    `grad_sync_s`), in the order they ran."""

    @property
    def step_s(self) -> float:
        """End of the step: the pipeline and every rank's gradient reduction."""
        return max([self.makespan_s] + [e.end_s for e in self.comm_events])

    def busy_s(self, rank: int) -> float:
        """Compute time of `rank` (sum of its action durations)."""
        return sum(e.end_s - e.start_s for e in self.events if e.rank == rank)

    def bubble_fraction(self) -> float:
        """Idle share of the iteration: 1 - mean busy time / makespan."""
        if self.makespan_s <= 0:
            return 0.0
        mean_busy = sum(self.busy_s(r) for r in range(self.num_ranks)) / self.num_ranks
        return 1.0 - mean_busy / self.makespan_s


def action_name(action: Action) -> str:
    """torch.distributed.pipelining's string form: chunk, kind, micro-batch (`1F0`, `0BW3`)."""
    kind, chunk, microbatch = action
    return f"{chunk}{kind}{microbatch}"


def format_actions(actions: list[list[Action]], mark: dict[int, int] | None = None) -> str:
    """One line per rank; the action at index mark[rank] is shown in brackets."""
    mark = mark or {}
    lines = []
    for r, acts in enumerate(actions):
        names = [f"[{action_name(a)}]" if mark.get(r) == i else action_name(a) for i, a in enumerate(acts)]
        lines.append(f"rank {r}: " + " ".join(names))
    return "\n".join(lines)


def schedule_actions(schedule: str, num_ranks: int, num_microbatches: int, virtual_stages: int = 1) -> list[list[Action]]:
    """Per rank, its ordered actions (kind, global chunk, micro-batch): the schedule as data."""
    check_schedule(schedule, num_ranks, num_microbatches, virtual_stages)
    p, m, v = num_ranks, num_microbatches, virtual_stages
    if schedule == "gpipe":
        # GPipe (Huang et al. 2019): all forwards, then all backwards.
        return [[("F", r, j) for j in range(m)] + [("BW", r, j) for j in range(m)] for r in range(p)]
    if schedule in ("1f1b", "pipedream-2bw") or (schedule == "interleaved-1f1b" and v == 1):
        # PipeDream-2BW orders a batch as 1F1B does; played alone (one batch, as our runtime
        # flushes between steps), its timeline is 1F1B's (planner/cost/schedules.py).
        # PipeDream-Flush (Narayanan et al. 2021a): p - r - 1 warm-up forwards, then one
        # forward / one backward, then the remaining backwards.
        return [_looped(r, p, m, 1, min(p - r - 1, m), zero_bubble=False) for r in range(p)]
    if schedule == "interleaved-1f1b":
        # Megatron-LM (Narayanan et al. 2021b, section 2.2) as torch's ScheduleInterleaved1F1B:
        # warm-up (v - 1) p + 2 (p - r - 1) forwards so the first backward of the last chunk
        # can come back before the rank runs dry.
        return [_looped(r, p, m, v, min((v - 1) * p + 2 * (p - r - 1), m * v), zero_bubble=False) for r in range(p)]
    # Zero bubble as torch's ScheduleInterleavedZeroBubble ("ZB1P"; ZB-H1 of Qi et al. 2023 for
    # v = 1): warm-up (v - 1) * per_round + p - r - 1 forwards, then F, B and, after the first
    # r steps, the W of the oldest B; the last W's run at the end.
    per_round = m // max(1, m // p)
    return [_looped(r, p, m, v, min((v - 1) * per_round + p - r - 1, m * v), zero_bubble=True) for r in range(p)]


def _looped(rank: int, p: int, m: int, v: int, warmup: int, zero_bubble: bool) -> list[Action]:
    """torch's `_get_1f1b_rank_ops` without its no-op padding (the simulator waits instead).

    Forwards visit the rank's chunks in rounds of `per_round` micro-batches (chunk 0 of the
    rank, then chunk 1, ...); backwards visit them in reverse chunk order.
    """
    per_round = m // max(1, m // p)
    total = m * v
    fwd, bwd, next_f, next_b = [], [], [0] * v, [0] * v
    for k in range(total):
        local = (k // per_round) % v
        fwd.append((local * p + rank, next_f[local]))
        next_f[local] += 1
        local = v - 1 - (k // per_round) % v
        bwd.append((local * p + rank, next_b[local]))
        next_b[local] += 1
    actions: list[Action] = [("F", c, j) for c, j in fwd[:warmup]]
    backward = "B" if zero_bubble else "BW"
    weights_done = 0
    for k in range(total):
        if warmup + k < total:
            actions.append(("F", *fwd[warmup + k]))
        actions.append((backward, *bwd[k]))
        if zero_bubble and k >= rank:  # rank r delays its W's by r steps to fill the cool-down
            actions.append(("W", *bwd[weights_done]))
            weights_done += 1
    if zero_bubble:
        actions.extend(("W", c, j) for c, j in bwd[weights_done:])
    return actions


def simulate(schedule: str, stage_forward_s: list[float], stage_backward_s: list[float], num_microbatches: int,
             virtual_stages: int = 1, p2p_s: float = 0.0,
             backward_weight_fraction: float | Sequence[float] = BACKWARD_WEIGHT_FRACTION,
             grad_sync_s: list[float] | None = None, num_buckets: int | Sequence[int] = 1,
             grad_ready: str = "backward") -> Timeline:
    """Play `schedule_actions` on per-chunk forward / backward times (lists in chunk order).

    In zero-bubble the backward b of chunk c splits into B = (1 - w_c) b and W = w_c b with
    w = backward_weight_fraction, one for all chunks or one per chunk (planner/cost/schedules.py
    module docstring). `grad_sync_s` (per rank, seconds) adds each rank's gradient reduction on
    its communication stream, in `num_buckets` buckets (one count, or one per rank), ready as
    `grad_ready` says (module docstring).
    """
    num_chunks = check_stage_lists(stage_forward_s, stage_backward_s, virtual_stages)
    w = chunk_weight_fractions(backward_weight_fraction, num_chunks)
    p = num_chunks // virtual_stages
    plans = schedule_actions(schedule, p, num_microbatches, virtual_stages)

    def duration(kind: str, c: int) -> float:
        return {"F": stage_forward_s[c], "BW": stage_backward_s[c],
                "B": (1 - w[c]) * stage_backward_s[c], "W": w[c] * stage_backward_s[c]}[kind]

    def ready_s(kind: str, c: int, j: int) -> float | None:
        """When the inputs of an action have arrived, or None if they are not produced yet."""
        if kind == "W":
            return done.get(("B", c, j))
        if kind == "F":
            return 0.0 if c == 0 else _plus(done.get(("F", c - 1, j)), p2p_s)
        own = done.get(("F", c, j))
        if own is None or c == num_chunks - 1:
            return own
        later = _plus(done.get((kind, c + 1, j)), p2p_s)
        return None if later is None else max(own, later)

    done: dict[Action, float] = {}
    free_s, pointer = [0.0] * p, [0] * p
    events: list[Event] = []
    progress = True
    while progress:
        progress = False
        for r in range(p):
            while pointer[r] < len(plans[r]):
                kind, c, j = plans[r][pointer[r]]
                ready = ready_s(kind, c, j)
                if ready is None:
                    break
                start = max(ready, free_s[r])
                free_s[r] = start + duration(kind, c)
                done[(kind, c, j)] = free_s[r]
                events.append(Event(r, c, j, kind, start, free_s[r]))
                pointer[r] += 1
                progress = True
    if any(pointer[r] < len(plans[r]) for r in range(p)):
        stuck = {r: pointer[r] for r in range(p) if pointer[r] < len(plans[r])}
        raise ValueError(f"schedule {schedule!r} deadlocks: no rank can run its next action [bracketed]\n"
                         + format_actions(plans, stuck))
    comm = _gradient_buckets(events, p, num_microbatches, grad_sync_s, num_buckets, grad_ready) if grad_sync_s else ()
    return Timeline(schedule, p, tuple(events), max(free_s), tuple(peak_in_flight(a) for a in plans), comm)


FLUSH_FREE_WARM_STEPS = 4
"""Batches per pipeline rank `flush_free_step_s` plays first, before it measures (past the fill)."""
FLUSH_FREE_MAX_WARM_STEPS = 256
"""The most it plays: stages whose work differs by a hair take long to settle (module docstring)."""


def flush_free_step_s(stage_forward_s: list[float], stage_backward_s: list[float], num_microbatches: int,
                      p2p_s: float = 0.0) -> float:
    """PipeDream-2BW's step without a flush, played (module docstring): batches run back to back
    as one 1F1B (runtime/pp_async.py `flush_free_actions` orders each rank so: p - r warm-up
    forwards, then a backward before each forward); the makespan of K + p batches less that of
    K, over p (p batches, as the steady state may repeat only every p micro-batches). K starts at
    FLUSH_FREE_WARM_STEPS x p batches and doubles until two windows agree (1e-10 relative; the makespans' own rounding is ~1e-13 of a step): the
    run settles into its steady state after a transient that grows as the two slowest stages'
    works draw together (a few p batches when they differ by a tenth; capped at
    FLUSH_FREE_MAX_WARM_STEPS x p, where the window is within about that difference of the
    steady step). Without p2p latency the slowest stage works
    without pause, so the step is m max_k (f_k + b_k), planner/cost/schedules.py's closed form,
    on uniform and non-uniform stages alike (tests/test_pipedream_2bw_cost.py). With it, each
    round trip stretches the steady state as in 1F1B (schedules.py: by m 2 (p - 1) p2p_s / p on
    uniform stages), which the closed form leaves out. The optimizer step between batches is a
    per-step term priced apart (planner/solver/search.py), as for 1F1B."""
    p = len(stage_forward_s)
    check_schedule("pipedream-2bw", p, num_microbatches)

    def window_s(warm_steps: int) -> float:
        run = [simulate("1f1b", stage_forward_s, stage_backward_s, (warm_steps + extra) * p * num_microbatches,
                        p2p_s=p2p_s).makespan_s for extra in (0, 1)]
        return (run[1] - run[0]) / p

    warm, step = FLUSH_FREE_WARM_STEPS, window_s(FLUSH_FREE_WARM_STEPS)
    while warm < FLUSH_FREE_MAX_WARM_STEPS:
        warm, previous = 2 * warm, step
        step = window_s(warm)
        if abs(step - previous) <= 1e-10 * step:
            break
    return step


GRAD_READY = ("backward", "chunk", "step")
"""When a rank's gradient buckets are ready for its communication stream (module docstring)."""


def _gradient_buckets(events: list[Event], num_ranks: int, num_microbatches: int, grad_sync_s: list[float],
                      num_buckets: int | Sequence[int], grad_ready: str) -> tuple[Event, ...]:
    """Each rank's reduction buckets, ready during (or after) its chunks' last weight-gradient
    actions as `grad_ready` says, played one at a time on its communication stream (module docstring)."""
    if len(grad_sync_s) != num_ranks or min(grad_sync_s) < 0:
        raise ValueError(f"grad_sync_s needs one non-negative time per pipeline rank ({num_ranks}), got {grad_sync_s}")
    counts = [num_buckets] * num_ranks if isinstance(num_buckets, int) else list(num_buckets)
    if len(counts) != num_ranks or min(counts) < 1:
        raise ValueError(f"num_buckets must be at least 1, one count or one per pipeline rank ({num_ranks}), got {num_buckets}")
    if grad_ready not in GRAD_READY:
        raise ValueError(f"grad_ready must be one of {GRAD_READY}, got {grad_ready!r}")
    out: list[Event] = []
    for rank in range(num_ranks):
        last = [e for e in events if e.rank == rank and e.kind in ("BW", "W") and e.microbatch == num_microbatches - 1]
        work = sum(e.end_s - e.start_s for e in last)
        rank_end = max((e.end_s for e in events if e.rank == rank), default=0.0)
        ready = []  # (ready time, chunk) per bucket; a chunk gets buckets in proportion to its work
        for e in last:
            share = (e.end_s - e.start_s) / work if work > 0 else 1 / len(last)
            count = max(1, round(counts[rank] * share))
            if grad_ready == "backward":
                ready += [(e.start_s + (i + 1) / count * (e.end_s - e.start_s), e.chunk) for i in range(count)]
            else:
                ready += [(e.end_s if grad_ready == "chunk" else rank_end, e.chunk)] * count
        seconds = grad_sync_s[rank] / len(ready)
        free = 0.0
        for when, chunk in sorted(ready):
            start = max(free, when)
            free = start + seconds
            out.append(Event(rank, chunk, num_microbatches - 1, "R", start, free))
    return tuple(out)


def _plus(t: float | None, dt: float) -> float | None:
    return None if t is None else t + dt


def peak_in_flight(actions: list[Action]) -> int:
    """One rank's `Timeline.peak_in_flight` from its actions in order (module docstring: a
    chunk-micro-batch is held from its F until its BW, or its W when the schedule splits them)."""
    held = peak = 0
    releases = "W" if any(k == "W" for k, _, _ in actions) else "BW"
    for kind, _, _ in actions:
        held += (kind == "F") - (kind == releases)
        peak = max(peak, held)
    return peak


def draw_gantt(timeline: Timeline, path: str | Path, title: str = "", row_labels: tuple[str, ...] = (),
               after: tuple[tuple[str, float], ...] = (), end_s: float = 0.0) -> Path:
    """PNG Gantt chart of a timeline; row labels, once-per-step segments: see planner.cost.gantt."""
    from planner.cost.gantt import draw_gantt as draw

    return draw(timeline, path, title, row_labels, after, end_s)
