"""Inter-op: where to cut the pipeline. A dynamic program over contiguous unit ranges.

Problem. Units 0..U-1 (execution order) go to S pipeline stages, each a contiguous range;
stage k (k = 0 first) holding units [i, j) costs `cost[k, i, j]` seconds per micro-batch
(forward + backward + its tensor-parallel collectives + sending what crosses cut j), or
+inf where the range does not fit in stage k's memory (stage position matters: under 1F1B
stage k keeps p - k micro-batches in flight). With m micro-batches the pipeline takes

    T(cuts) = sum_k t_k + (m - 1) * max_k t_k                      (Alpa, Zheng et al. 2022, eq. 2)

(the first micro-batch crosses every stage, the other m-1 are paced by the slowest).

PipeDream-2BW without a flush (`flush_free=True`: the layouts planner/plan.py
`flush_free_blocker` passes, run by runtime/pp_async.py `train_flush_free`) has no fill or
drain in its steady state: a step costs

    T_2bw(cuts) = m * max_k t_k                  (Narayanan et al. 2021a, section 3; planner/cost/schedules.py)

so the sum no longer counts and the best cuts are those of the least bottleneck t*
(`least_bottleneck`). Among them (usually many: every cut away from the slowest stage is
free) the DP keeps the ones of least sum, the synchronous objective's tie-break: least total
work, which is also what a flushed step or a run's first step pays for. A 2BW layout the
runtime runs flushed is 1F1B and takes the synchronous objective.

Method (Alpa's stage-construction DP, section 5.2). For each candidate bottleneck t_max
(the distinct finite values of `cost`, ascending, from the smallest feasible one, found by
a min-max DP) solve

    best[k][j] = min_i  best[k-1][i] + cost[k-1, i, j]  over ranges with cost <= t_max

where the table axes are `best[number of stages placed][units placed]` (seconds), and keep
best[S][U] + (m - 1) * t_max. Cuts with bottleneck t take at least max(m t, least_sum +
(m - 1) t) (least_sum: the smallest summed cost of any feasible cuts), so the scan stops
once that bound passes the best T seen. The min-sum cuts over all ranges are the first
incumbent; candidates are solved in growing batches (1, 2, 4, up to `BATCH`). The minimum over candidates is the
optimum of T: the optimal cuts appear when t_max equals their own bottleneck. Each
candidate costs O(S (U - S + 1) L): stage k can only end in [k + 1, U - S + k + 1] (`_band`),
and a range costing at most t_max holds at most L units (`_by_length`: costs grow with a
range's units, so L is usually a few times U / S), vectorised over ends and lengths with numpy.
Stages with equal costs share one row (`SharedRows`).

Forbidden cuts. `solve_cuts` can be told where no stage may end (`allowed_cuts`, e.g. inside
a group of units that must share a stage): ranges starting or ending at a forbidden cut cost
+inf (`forbid_cuts`). The search no longer needs it for tied weights: the runtime holds a copy
per stage (runtime/pp_split.py), and a range's cost includes the copy it holds
(planner/solver/costs.py `UnitCostTable.copy_parameters`), which depends on the range alone.

Virtual stages. With v > 1 chunks per pipeline rank the schedules pay the busiest rank's chunks
together, and a rank's chunks share its memory; the DP above sees chunks one by one. Its cuts
are then leveled across the ranks (`level_ranks`, a local search) and priced beside the DP's
(planner/solver/search.py `evaluate_config`, which also chooses a rank's recomputation modes
together where its chunks overflow it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from planner.errors import PlannerError

BATCH = 8
"""Bottleneck candidates solved together (numpy over a batch axis instead of Python calls)."""


@dataclass(frozen=True)
class StageCuts:
    bounds: tuple[tuple[int, int], ...]
    """Per stage the unit range [start, end)."""
    stage_times_s: tuple[float, ...]
    """cost of each stage per micro-batch."""
    pipeline_time_s: float
    """The objective at these cuts (`pipeline_time`): sum + (m - 1) * max of the stage times, or
    m * max without a flush."""


def pipeline_time(stage_times: list[float] | tuple[float, ...], num_microbatches: int, flush_free: bool = False) -> float:
    """The DP's objective (module docstring): Alpa's sum + (m - 1) max, or PipeDream-2BW's m max
    without a flush (`flush_free`)."""
    if flush_free:
        return float(num_microbatches * max(stage_times))
    return float(sum(stage_times) + (num_microbatches - 1) * max(stage_times))


class SharedRows:
    """A stage cost table whose stages share rows: cost[k, i, j] = rows[row_of_stage[k], i, j].
    Stages with the same memory limit see the same costs (zero bubble: all of them), so the
    table is held once per distinct row instead of once per stage."""

    def __init__(self, rows: np.ndarray, row_of_stage: np.ndarray):
        self.rows, self.row_of_stage = rows, row_of_stage
        self._lengths: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # row -> `_lengths`
        self.shape = (len(row_of_stage), *rows.shape[1:])

    def __getitem__(self, key):
        stage, *rest = key if isinstance(key, tuple) else (key,)
        return self.rows[(self.row_of_stage[stage], *rest)]

    def dense(self) -> np.ndarray:
        return self.rows[self.row_of_stage]

    def lengths(self, row: int) -> tuple[np.ndarray, np.ndarray]:
        """`_lengths` of a row, computed once (the DP asks again for every batch of bottlenecks)."""
        if row not in self._lengths:
            self._lengths[row] = _lengths(self.rows[row])
        return self._lengths[row]


def allowed_cuts(num_units: int, tied_groups: list[list[int]]) -> np.ndarray:
    """allowed[c]: whether a stage may end after unit c (c = 0 .. U-2). False from the first to
    just before the last unit of every group of units sharing a parameter."""
    allowed = np.ones(max(num_units - 1, 0), dtype=bool)
    for group in tied_groups:
        allowed[min(group):max(group)] = False
    return allowed


def max_stages(allowed: np.ndarray) -> int:
    """The most contiguous stages the allowed cuts permit."""
    return int(allowed.sum()) + 1


def range_allowed(start: np.ndarray, end: np.ndarray, allowed: np.ndarray | None) -> np.ndarray:
    """Whether unit ranges [start, end) begin and end at allowed cuts (the model's ends always are)."""
    if allowed is None:
        return np.ones(np.shape(start), dtype=bool)
    edges = np.concatenate([[True], allowed, [True]])  # edges[i]: a stage may begin (or end) before unit i
    return edges[start] & edges[end]


def forbid_cuts(cost: np.ndarray, allowed: np.ndarray | None) -> np.ndarray:
    """`cost` with +inf for every range that begins or ends at a forbidden cut."""
    if allowed is None or allowed.all():
        return cost
    size = cost.shape[-1]
    start, end = np.meshgrid(np.arange(size), np.arange(size), indexing="ij")
    return np.where(range_allowed(start, end, allowed)[None], cost, np.inf)


def _band(stage: int, num_stages: int, num_units: int) -> tuple[slice, slice]:
    """Where stage `stage` (0 = first) of `num_stages` non-empty contiguous stages can start and
    end: after at least `stage` units and leaving at least one unit per later stage, so
    start i in [stage, U - S + stage] and end j in [stage + 1, U - S + stage + 1]. The DPs
    below fill only this band of width U - S + 1 (ranges outside it belong to no cuts)."""
    width = num_units - num_stages + 1
    return slice(stage, stage + width), slice(stage + 1, stage + 1 + width)


def _stage_row(cost: np.ndarray | SharedRows, stage: int) -> np.ndarray:
    """cost[stage] as a (U+1) x (U+1) array (a shared row is not copied)."""
    return cost.rows[cost.row_of_stage[stage]] if isinstance(cost, SharedRows) else cost[stage]


def least_bottleneck(cost: np.ndarray | SharedRows) -> float:
    """The smallest t_max any cuts achieve (inf if none fit): a min-max DP,
    `worst[k + 1, j] = min_i max(worst[k, i], cost[k, i, j])` over stages k (`_least_over_cuts`)."""
    return _least_over_cuts(cost, np.maximum)


def least_total(cost: np.ndarray | SharedRows) -> float:
    """The smallest sum over stages any cuts achieve (inf if none fit): `least_bottleneck`'s DP
    with + for max. Over a rank's v chunks' bytes it bounds what the fullest of p ranks holds
    from below: at least the total over p."""
    return _least_over_cuts(cost, np.add)


def _least_over_cuts(cost: np.ndarray | SharedRows, combine) -> float:
    """min over cuts of the stages' costs folded by `combine` (max or +), held along the band only
    (`_band`: stage k's starts are stage k-1's ends, so one vector of width U - S + 1 carries it)."""
    num_stages, size, _ = cost.shape
    width = size - num_stages  # U - S + 1
    best = np.full(width, np.inf)  # best[j - k]: units [0, j) in k stages
    best[0] = 0.0
    for k in range(num_stages):
        best = combine(best[:, None], _stage_row(cost, k)[k:k + width, k + 1:k + 1 + width]).min(axis=0)
    return float(best[-1])


def solve_cuts(cost: np.ndarray | SharedRows, num_microbatches: int, cut_allowed: np.ndarray | None = None,
               candidates: np.ndarray | None = None, bottleneck_floor: float | None = None,
               flush_free: bool = False) -> StageCuts:
    """Optimal contiguous cuts for `cost[stage, start, end]` (shape S x (U+1) x (U+1)), cutting only
    where `cut_allowed` (`allowed_cuts`; None: anywhere) permits. `candidates`: the distinct finite
    values of `cost`, ascending, where the caller has them cheaper (stages sharing cost rows);
    `bottleneck_floor`: `least_bottleneck(cost)` where the caller computed it already.
    `flush_free`: PipeDream-2BW's objective without a flush, m * max (module docstring)."""
    num_stages, size, _ = cost.shape
    num_units = size - 1
    if num_stages > num_units:
        raise PlannerError(f"{num_stages} pipeline stages need at least as many units; the model has {num_units}.", "Use fewer stages.")
    if cut_allowed is not None and num_stages > max_stages(cut_allowed):
        raise PlannerError(f"{num_stages} pipeline stages need {num_stages - 1} cuts; units sharing a parameter leave "
                           f"{max_stages(cut_allowed) - 1}.", "Use fewer stages.")
    if not (cut_allowed is None or cut_allowed.all()):
        cost, candidates = forbid_cuts(cost.dense() if isinstance(cost, SharedRows) else cost, cut_allowed), None
        bottleneck_floor = None  # of another table
    if candidates is None:
        values = cost.rows if isinstance(cost, SharedRows) else cost
        candidates = np.unique(values[np.isfinite(values)])
    least = least_bottleneck(cost) if bottleneck_floor is None else bottleneck_floor
    if not np.isfinite(least):
        raise PlannerError("No way to cut the model into stages that each fit in memory.", "Add GPUs, recomputation or ZeRO.")
    if flush_free:
        return _flush_free_cuts(cost, num_microbatches, least)
    lo = int(np.searchsorted(candidates, least))  # the smallest feasible bottleneck is a candidate
    # Any cuts whose bottleneck is t take at least least_sum + (m - 1) t, where least_sum is the
    # smallest summed cost of any feasible cuts: once that bound (or m t) passes the best T
    # found, no later (larger) candidate can win. Exact, and much tighter than m t alone
    # when there are many stages.
    # The min-sum cuts over every feasible range are also a solution: they start the incumbent.
    # They are solved together with the first candidate (one DP pass for both; the candidate is
    # kept only if it passes the test below, as if solved after).
    pending = candidates[lo:]
    first_cuts = _min_sum_cuts(cost, np.concatenate([candidates[-1:], pending[:1]]))
    best_cuts = first_cuts[0]
    if best_cuts is None:
        raise PlannerError("No stage cuts fit in memory.", "Use more GPUs or allow recomputation/ZeRO.")
    stage_costs = _stage_times(cost, best_cuts)
    least_sum, best_total = float(sum(stage_costs)), pipeline_time(stage_costs, num_microbatches)
    first, batch_size, solved = 0, 1, first_cuts[1:]
    while first < pending.size:
        batch = pending[first:first + batch_size]
        first, batch_size = first + batch_size, min(2 * batch_size, BATCH)  # 1, 2, 4, ...: most scans stop early
        keep = (least_sum + (num_microbatches - 1) * batch < best_total) & (num_microbatches * batch < best_total)
        if not keep.any():
            break
        found = [c for c, k in zip(solved, keep, strict=True) if k] if solved else _min_sum_cuts(cost, batch[keep])
        solved = []
        for cuts in found:
            if cuts is None:
                continue
            total = pipeline_time(_stage_times(cost, cuts), num_microbatches)
            if total < best_total - 1e-15:
                best_total, best_cuts = total, cuts
    times = tuple(_stage_times(cost, best_cuts))
    return StageCuts(tuple(best_cuts), times, float(best_total))


def _flush_free_cuts(cost: np.ndarray | SharedRows, num_microbatches: int, least: float) -> StageCuts:
    """PipeDream-2BW's optimum without a flush: m * t* is reached exactly by the cuts whose every
    stage costs at most t* (`least`, a value of the table, so the comparison is exact); of those,
    the ones of least sum (module docstring)."""
    cuts = _min_sum_cuts(cost, np.array([least]))[0]
    assert cuts is not None  # the min-max DP found cuts with bottleneck `least`
    times = tuple(_stage_times(cost, cuts))
    return StageCuts(tuple(cuts), times, pipeline_time(times, num_microbatches, flush_free=True))


def _stage_times(cost: np.ndarray | SharedRows, cuts: list[tuple[int, int]]) -> list[float]:
    """cost[k, i, j] of every stage k = (i, j) of `cuts`, in one lookup."""
    starts, ends = np.array(cuts).T
    if isinstance(cost, SharedRows):
        return cost.rows[cost.row_of_stage[:len(cuts)], starts, ends].tolist()
    return cost[np.arange(len(cuts)), starts, ends].tolist()


def _lengths(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A stage's costs by range length: out[n - 1, j] = values[j - n, j] (inf where j < n), and
    per length its cheapest range (what decides the longest range a bottleneck admits)."""
    flat, before_zero = _length_index(values.shape[0])
    out = values.ravel()[flat]
    out[before_zero] = np.inf
    return out, out.min(axis=1)


@lru_cache(maxsize=8)
def _length_index(size: int) -> tuple[np.ndarray, np.ndarray]:
    """Flat indices into a size x size table of range [j - n, j) at [n - 1, j], and where j < n."""
    begin = np.arange(size)[None, :] - np.arange(1, size)[:, None]
    return np.maximum(begin, 0) * size + np.arange(size)[None, :], begin < 0


def _by_length(lengths: tuple[np.ndarray, np.ndarray], t_max: np.ndarray) -> np.ndarray:
    """A stage's costs re-indexed by range length, longest first: out[c, l, j] = values[j - L + l, j]
    (L - l units ending before j), inf where that range starts before unit 0 or costs more than
    the bottleneck t_max[c]. L is the longest range any bottleneck admits: costs grow with a
    range's units, so most long ranges are out, and the DP below scans L lengths, not U - S + 1
    starts. `lengths`: `_lengths` of the stage's costs."""
    by_length, cheapest = lengths
    admitted = np.flatnonzero(cheapest <= t_max.max())
    longest = int(admitted[-1]) + 1 if admitted.size else 1
    ranged = by_length[longest - 1::-1]
    return np.where(ranged[None] <= t_max[:, None, None], ranged[None], np.inf)


def _min_sum_cuts(cost: np.ndarray | SharedRows, t_max: np.ndarray) -> list[list[tuple[int, int]] | None]:
    """Per bottleneck t in `t_max`: cuts minimising the sum of stage costs over ranges costing
    at most t (None where none fit). Vectorised over the bottlenecks (axis c below). Along the
    band (`_band`) stage k's starts are stage k-1's ends, so the table is carried as one
    [c, U - S + 1] slice; each stage's ranges are scanned by length (`_by_length`, once per row a
    `SharedRows` table shares), longest first, so ties go to the earliest start as over starts."""
    num_stages, size, _ = cost.shape
    count, width = t_max.size, size - num_stages
    # length[c, k, j - k - 1]: the units of stage k (ending at j) in that optimum.
    length = np.zeros((count, num_stages, width), dtype=int)
    by_length: dict[int, np.ndarray] = {}  # row -> [c, l, end j] (`_by_length`)
    for k in range(num_stages):
        row = int(cost.row_of_stage[k]) if isinstance(cost, SharedRows) else k
        if row not in by_length:
            by_length[row] = _by_length(cost.lengths(row) if isinstance(cost, SharedRows) else _lengths(cost[k]), t_max)
    longest = max(ranged.shape[1] for ranged in by_length.values())
    # padded[c, L + j - k]: best[c, j - k], with L infs before it (ranges starting before the band).
    padded = np.full((count, longest + width), np.inf)
    padded[:, longest] = 0.0
    # gather[L_row][l, jj]: where in `padded` the stage ending at k + 1 + jj with L_row - l units starts.
    gather = {n: np.arange(width)[None, :] + 1 + np.arange(longest - n, longest)[:, None]
              for n in {ranged.shape[1] for ranged in by_length.values()}}
    for k in range(num_stages):
        ranged = by_length[int(cost.row_of_stage[k]) if isinstance(cost, SharedRows) else k]
        rows_longest = ranged.shape[1]
        totals = padded[:, gather[rows_longest]] + ranged[:, :, k + 1:k + 1 + width]  # [c, l, end j]
        length[:, k] = rows_longest - np.argmin(totals, axis=1)
        padded[:, longest:] = totals.min(axis=1)
    best = padded[:, longest:]
    out: list[list[tuple[int, int]] | None] = []
    for c in range(count):
        if not np.isfinite(best[c, -1]):
            out.append(None)
            continue
        cuts, end = [], size - 1
        for k in range(num_stages - 1, -1, -1):
            begin = end - int(length[c, k, end - k - 1])
            cuts.append((begin, end))
            end = begin
        out.append(cuts[::-1])
    return out


def brute_force_cuts(cost: np.ndarray, num_microbatches: int, cut_allowed: np.ndarray | None = None,
                     flush_free: bool = False) -> StageCuts:
    """Every placement of S-1 cuts among the U-1 positions (the allowed ones); for tests on small
    instances. `flush_free`: PipeDream-2BW's objective, ties broken by the least sum (module docstring)."""
    from itertools import combinations

    num_stages, size, _ = cost.shape
    best: StageCuts | None = None
    positions = [c for c in range(1, size - 1) if cut_allowed is None or cut_allowed[c - 1]]
    for inner in combinations(positions, num_stages - 1):
        edges = (0, *inner, size - 1)
        bounds = tuple(zip(edges[:-1], edges[1:], strict=False))
        times = tuple(float(cost[k, i, j]) for k, (i, j) in enumerate(bounds))
        if not all(np.isfinite(times)):
            continue
        total = pipeline_time(times, num_microbatches, flush_free)
        # Without a flush many cuts tie on m * max: the least sum wins among them (1e-15 s: float
        # noise of equal sums taken in another order, far below any stage time).
        tied_less_work = flush_free and best is not None and total <= best.pipeline_time_s + 1e-15 \
            and sum(times) < sum(best.stage_times_s) - 1e-15
        if best is None or total < best.pipeline_time_s - 1e-15 or tied_less_work:
            best = StageCuts(bounds, times, total)
    if best is None:
        raise PlannerError("No way to cut the model into stages that each fit in memory.", "Add GPUs.")
    return best



def level_ranks(cost: np.ndarray | SharedRows, bounds: tuple[tuple[int, int], ...] | list[tuple[int, int]],
                num_ranks: int, num_microbatches: int, range_bytes: np.ndarray | SharedRows | None = None,
                memory_limit: float = math.inf, max_moves: int | None = None) -> tuple[tuple[tuple[int, int], ...], float]:
    """Cuts of `bounds` leveled across the pipeline ranks. With v > 1 chunks per rank (chunk k on
    rank k mod p) the schedules' closed forms pay m x the busiest rank's chunks together plus
    (p - 1) x a chunk (planner/cost/schedules.py: interleaved 1F1B, zero bubble), and a rank's
    chunks share its memory; the DP's per-chunk objective (sum + (m - 1) max, Alpa's) sees
    neither. Of its many tied optima it may stack the longer chunks on one rank (98 units in 96
    chunks: two chunks of two units, both on rank 0), or chunks that each fit but together
    overflow their rank.

    A local search moves one unit at a time out of one rank's chunk, to the chunk before or after
    it (on the next rank) or, through a chain of up to p - 1 cuts each moved by one unit, to a
    chunk on any other rank (the chunks between keep their sizes: three ranks of 13 blocks and
    one of 12 beside them level only so; the shortest chain to a rank less busy by more than the
    unit), while that lowers, in this order, the bytes by which the ranks overflow
    `memory_limit` (summed; `range_bytes` gives each range's bytes as the cost table chose them,
    same shape as `cost`; None: not checked), the schedules' time

        m max_r sum_{k = r mod p} cost[k] + (p - 1) max_k cost[k]

    and the sum of squares of the ranks' work (spreading it where the time ties). It moves from
    the rank that overflows most, else the busiest. Every chunk stays within its own memory
    (finite `cost`). Each move lowers that triple, so the search ends; `max_moves` (default 4 S)
    bounds it. Returns the cuts and how much they lower the time above (seconds). A heuristic on
    top of the exact DP: the caller prices both cuts and keeps the faster."""
    edges = [int(start) for start, _ in bounds] + [int(bounds[-1][1])]
    num_chunks, p, m = len(bounds), num_ranks, num_microbatches
    if num_chunks <= p:
        return tuple((int(i), int(j)) for i, j in bounds), 0.0
    cost_rows = [_stage_row(cost, k) for k in range(num_chunks)]
    byte_rows = [_stage_row(range_bytes, k) for k in range(num_chunks)] if range_bytes is not None else None

    def chunk(k: int, i: int, j: int) -> tuple[float, float]:
        return float(cost_rows[k][i, j]), float(byte_rows[k][i, j]) if byte_rows is not None else 0.0

    parts = [chunk(k, edges[k], edges[k + 1]) for k in range(num_chunks)]
    times, sizes = [t for t, _ in parts], [b for _, b in parts]
    loads, held = [sum(times[r::p]) for r in range(p)], [sum(sizes[r::p]) for r in range(p)]

    def key(loads: list[float], held: list[float], slowest: float) -> tuple[float, float, float]:
        return (sum(max(b - memory_limit, 0.0) for b in held), m * max(loads) + (p - 1) * slowest,
                sum(x * x for x in loads))

    def lower(a: tuple, b: tuple) -> bool:
        """a below b, lexicographically, by more than float noise (1e-12 relative)."""
        for x, y in zip(a, b, strict=True):
            if x < y - 1e-12 * abs(y):
                return True
            if x > y + 1e-12 * abs(y):
                return False
        return False

    def slowest_but(touched: dict) -> float:
        """The slowest chunk outside `touched` (`order`: chunks slowest first; usually its first)."""
        return next((times[c] for c in order if c not in touched), 0.0)

    def chains(source: int, by_bytes: bool):
        """Each move out of a chunk of rank `source`, by the shortest chain of cuts that reaches a
        rank less busy (`by_bytes`: holding fewer bytes) by more than the unit it takes (any other
        would leave the pair less spread): (the cuts moved and their new positions, the chunks
        whose ranges change)."""
        busy, per_chunk, part = (held, sizes, 1) if by_bytes else (loads, times, 0)
        for k in range(source, num_chunks, p):
            if edges[k + 1] - edges[k] < 2:  # chunk k keeps a unit
                continue
            for step in (1, -1):  # its last unit on (1), or its first back (-1)
                rest = chunk(k, edges[k], edges[k + 1] - 1) if step == 1 else chunk(k, edges[k] + 1, edges[k + 1])
                unit = per_chunk[k] - rest[part]  # what chunk k sheds, about what the receiving rank takes
                length = next((n for n in range(1, p) if busy[(k + step * n) % p] + unit < busy[source]), None)
                if length is None:
                    continue
                moved = range(k + 1, k + 1 + length) if step == 1 else range(k, k - length, -1)
                if moved[-1] < 1 or moved[-1] > num_chunks - 1:
                    continue
                yield ({e: edges[e] - step for e in moved},
                       range(k, k + length + 1) if step == 1 else range(k - length, k + 1))

    current = initial = key(loads, held, max(times))
    order = sorted(range(num_chunks), key=times.__getitem__, reverse=True)
    for _ in range(4 * num_chunks if max_moves is None else max_moves):
        overflowing = max(held) > memory_limit
        source = max(range(p), key=(held if overflowing else loads).__getitem__)
        best = None
        for shifted, touched in chains(source, overflowing):
            trial = {c: chunk(c, shifted.get(c, edges[c]), shifted.get(c + 1, edges[c + 1])) for c in touched}
            if not all(math.isfinite(t) for t, _ in trial.values()):
                continue
            new_loads, new_held = list(loads), list(held)
            for c, (t, b) in trial.items():
                new_loads[c % p] += t - times[c]
                new_held[c % p] += b - sizes[c]
            value = key(new_loads, new_held, max(slowest_but(trial), *(t for t, _ in trial.values())))
            if lower(value, current) and (best is None or lower(value, best[0])):
                best = (value, shifted, trial, new_loads, new_held)
        if best is None:
            break
        current, shifted, trial, loads, held = best
        for e, position in shifted.items():
            edges[e] = position
        for c, (t, b) in trial.items():
            times[c], sizes[c] = t, b
        order = sorted(range(num_chunks), key=times.__getitem__, reverse=True)
    return tuple(zip(edges[:-1], edges[1:], strict=True)), initial[1] - current[1]
