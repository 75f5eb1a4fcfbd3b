"""Event simulator: play a pipeline schedule action by action on per-stage times.

A schedule is data: per rank, the ordered list of actions `(kind, chunk, microbatch)` with
kind F (forward), B (backward; for zero-bubble only the input-gradient part) or W (weight
gradient, zero-bubble only), written like torch.distributed.pipelining's actions: `0F3` is
the forward of micro-batch 3 on chunk 0. Each rank runs its list in order and waits when
an action's inputs are not ready:

    F(c, j) needs F(c-1, j) (+ p2p)       B(c, j) needs F(c, j) and B(c+1, j) (+ p2p)
    W(c, j) needs B(c, j)

The result is a per-rank timeline (its Gantt chart is `draw_gantt`), the makespan and the
peak number of chunk-micro-batches whose activations each rank held (F done, B not yet).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from planner.cost.schedules import check_schedule


@dataclass(frozen=True)
class Event:
    rank: int
    chunk: int
    """Global stage index (chunk c lives on rank c % p)."""
    microbatch: int
    kind: str
    """F, B or W."""
    start_s: float
    end_s: float


@dataclass(frozen=True)
class Timeline:
    schedule: str
    num_ranks: int
    events: tuple[Event, ...]
    makespan_s: float
    peak_in_flight: tuple[int, ...]
    """Per rank: most chunk-micro-batches held at once."""

    def busy_s(self, rank: int) -> float:
        return sum(e.end_s - e.start_s for e in self.events if e.rank == rank)

    def bubble_fraction(self) -> float:
        mean_busy = sum(self.busy_s(r) for r in range(self.num_ranks)) / self.num_ranks
        return 1 - mean_busy / self.makespan_s if self.makespan_s else 0.0


def action_name(action: tuple[str, int, int]) -> str:
    kind, chunk, microbatch = action
    return f"{chunk}{kind}{microbatch}"


def schedule_actions(schedule: str, num_ranks: int, num_microbatches: int, virtual_stages: int = 1) -> list[list[tuple[str, int, int]]]:
    """Per rank, its ordered actions (kind, global chunk, micro-batch)."""
    check_schedule(schedule, num_ranks, num_microbatches, virtual_stages)
    p, m, v = num_ranks, num_microbatches, virtual_stages
    ranks = []
    for r in range(p):
        if schedule == "gpipe":
            ranks.append([("F", r, j) for j in range(m)] + [("B", r, j) for j in range(m)])
        elif schedule == "1f1b":
            ranks.append(_one_f_one_b([(r, j) for j in range(m)], [(r, j) for j in range(m)], min(p - r - 1, m)))
        elif schedule == "interleaved-1f1b":
            # Megatron's order: groups of p micro-batches go through chunk 0, then chunk 1, ...
            total = m * v
            fwd = [(((k // p) % v) * p + r, (k // (p * v)) * p + k % p) for k in range(total)]
            bwd = [((v - 1 - (k // p) % v) * p + r, (k // (p * v)) * p + k % p) for k in range(total)]
            warmup = min((p - r - 1) * 2 + (v - 1) * p, total)
            ranks.append(_one_f_one_b(fwd, bwd, warmup))
        else:  # zero-bubble: 1F1B order of F and B; the simulator fills idle time with deferred W's
            ranks.append(_one_f_one_b([(r, j) for j in range(m)], [(r, j) for j in range(m)], min(p - r - 1, m)))
    return ranks


def _one_f_one_b(fwd: list, bwd: list, warmup: int) -> list[tuple[str, int, int]]:
    """Warm-up forwards, then one forward / one backward, then the remaining backwards."""
    actions = [("F", c, j) for c, j in fwd[:warmup]]
    f_next, b_next = warmup, 0
    while b_next < len(bwd):
        if f_next < len(fwd):
            actions.append(("F", *fwd[f_next]))
            f_next += 1
        actions.append(("B", *bwd[b_next]))
        b_next += 1
    return actions


def simulate(schedule: str, stage_forward_s: list[float], stage_backward_s: list[float], num_microbatches: int,
             virtual_stages: int = 1, p2p_s: float = 0.0, backward_weight_fraction: float = 0.5) -> Timeline:
    num_chunks = len(stage_forward_s)
    if len(stage_backward_s) != num_chunks or num_chunks % virtual_stages:
        raise ValueError(f"{num_chunks} forward and {len(stage_backward_s)} backward times for {virtual_stages} virtual stages")
    p = num_chunks // virtual_stages
    plans = schedule_actions(schedule, p, num_microbatches, virtual_stages)
    split = schedule == "zero-bubble"
    w = backward_weight_fraction if split else 0.0

    def duration(kind: str, c: int) -> float:
        return stage_forward_s[c] if kind == "F" else stage_backward_s[c] * ((1 - w) if kind == "B" else w)

    done: dict[tuple[str, int, int], float] = {}
    free = [0.0] * p
    pointer = [0] * p
    held, peak = [0] * p, [0] * p
    events = []
    remaining = sum(len(a) for a in plans)
    pending: list[list[tuple[str, int, int]]] = [[] for _ in range(p)]  # zero-bubble: W's not yet run
    while remaining or any(pending):
        best = None
        for r in range(p):
            start = None
            if pointer[r] < len(plans[r]):
                kind, c, j = plans[r][pointer[r]]
                ready = _ready(kind, c, j, num_chunks, done, p2p_s)
                start = None if ready is None else max(ready, free[r])
                if start is not None and (best is None or start < best[0]):
                    best = (start, r, plans[r][pointer[r]])
            # Zero bubble (Qi et al. 2023): a deferred W runs in any gap it fits, and in the cool-down.
            if pending[r]:
                w_end = free[r] + duration("W", pending[r][0][1])
                if (start is None or start >= w_end) and (best is None or free[r] < best[0]):
                    best = (free[r], r, pending[r][0])
        if best is None:
            stuck = {r: action_name(plans[r][pointer[r]]) for r in range(p) if pointer[r] < len(plans[r])}
            grid = "\n".join(f"rank {r}: " + " ".join(("[" + action_name(a) + "]") if i == pointer[r] else action_name(a)
                                                       for i, a in enumerate(plans[r])) for r in range(p))
            raise ValueError(f"schedule {schedule} deadlocks; waiting actions {stuck}\n{grid}")
        start, r, action = best
        kind, c, j = action
        end = start + duration(kind, c)
        done[action] = end
        free[r] = end
        if kind == "W":
            pending[r].pop(0)
            held[r] -= 1  # a zero-bubble micro-batch's activations live until its W
        else:
            pointer[r], remaining = pointer[r] + 1, remaining - 1
            if kind == "F":
                held[r] += 1
            elif split:
                pending[r].append(("W", c, j))
            else:
                held[r] -= 1
        peak[r] = max(peak[r], held[r])
        events.append(Event(r, c, j, kind, start, end))
    return Timeline(schedule, p, tuple(events), max(free), tuple(peak))


def _ready(kind: str, c: int, j: int, num_chunks: int, done: dict, p2p_s: float) -> float | None:
    if kind == "F":
        if c == 0:
            return 0.0
        prev = done.get(("F", c - 1, j))
        return None if prev is None else prev + p2p_s
    if kind == "B":
        own = done.get(("F", c, j))
        if own is None:
            return None
        if c == num_chunks - 1:
            return own
        after = done.get(("B", c + 1, j))
        return None if after is None else max(own, after + p2p_s)
    return done.get(("B", c, j))


def draw_gantt(timeline: Timeline, path: str | Path, title: str = "") -> Path:
    """One row per rank; forward, backward and weight-gradient boxes with the micro-batch number."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"F": "#4C72B0", "B": "#DD8452", "W": "#55A868"}
    fig, ax = plt.subplots(figsize=(max(8, len(timeline.events) / 6), 0.6 * timeline.num_ranks + 1.2))
    for e in timeline.events:
        ax.barh(e.rank, e.end_s - e.start_s, left=e.start_s, color=colors[e.kind], edgecolor="black", linewidth=0.4)
        if timeline.makespan_s and (e.end_s - e.start_s) / timeline.makespan_s > 0.012:
            ax.text((e.start_s + e.end_s) / 2, e.rank, str(e.microbatch), ha="center", va="center", fontsize=6, color="white")
    ax.set_yticks(range(timeline.num_ranks), [f"rank {r}" for r in range(timeline.num_ranks)])
    ax.invert_yaxis()
    ax.set_xlabel("time (s)")
    ax.set_title(title or f"{timeline.schedule}: makespan {timeline.makespan_s:.4g} s, bubble {timeline.bubble_fraction():.1%}")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for k, c in colors.items() if any(e.kind == k for e in timeline.events)]
    ax.legend(handles, [k for k in colors if any(e.kind == k for e in timeline.events)], loc="upper right", fontsize=7)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
