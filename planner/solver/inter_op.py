"""Inter-op: where to cut the pipeline. A dynamic program over contiguous unit ranges.

Problem. Units 0..U-1 (execution order) go to S pipeline stages, each a contiguous range;
stage k (k = 0 first) holding units [i, j) costs `cost[k, i, j]` seconds per micro-batch
(forward + backward + its tensor-parallel collectives + sending what crosses cut j), or
+inf where the range does not fit in stage k's memory (stage position matters: under 1F1B
stage k keeps p - k micro-batches in flight). With m micro-batches the pipeline takes

    T(cuts) = sum_k t_k + (m - 1) * max_k t_k                      (Alpa, Zheng et al. 2022, eq. 2)

(the first micro-batch crosses every stage, the other m-1 are paced by the slowest).

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
candidate costs O(S (U - S + 1)^2): stage k can only start in [k, U - S + k] (`_band`),
vectorised over i and j with numpy. Stages with equal costs share one row (`SharedRows`).

Forbidden cuts. `solve_cuts` can be told where no stage may end (`allowed_cuts`, e.g. inside
a group of units that must share a stage): ranges starting or ending at a forbidden cut cost
+inf (`forbid_cuts`). The search no longer needs it for tied weights: the runtime holds a copy
per stage (runtime/pp_split.py), and a range's cost includes the copy it holds
(planner/solver/costs.py `UnitCostTable.copy_parameters`), which depends on the range alone.
"""

from __future__ import annotations

from dataclasses import dataclass

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
    """sum + (m - 1) * max of the stage times."""


def pipeline_time(stage_times: list[float] | tuple[float, ...], num_microbatches: int) -> float:
    return float(sum(stage_times) + (num_microbatches - 1) * max(stage_times))


class SharedRows:
    """A stage cost table whose stages share rows: cost[k, i, j] = rows[row_of_stage[k], i, j].
    Stages with the same memory limit see the same costs (zero bubble: all of them), so the
    table is held once per distinct row instead of once per stage."""

    def __init__(self, rows: np.ndarray, row_of_stage: np.ndarray):
        self.rows, self.row_of_stage = rows, row_of_stage
        self.shape = (len(row_of_stage), *rows.shape[1:])

    def __getitem__(self, key):
        stage, *rest = key if isinstance(key, tuple) else (key,)
        return self.rows[(self.row_of_stage[stage], *rest)]

    def dense(self) -> np.ndarray:
        return self.rows[self.row_of_stage]


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


def _least_bottleneck(cost: np.ndarray | SharedRows) -> float:
    """The smallest t_max any cuts achieve (inf if none fit): a min-max DP,
    `worst[k + 1, j] = min_i max(worst[k, i], cost[k, i, j])` over stages k (inside `_band`)."""
    num_stages, size, _ = cost.shape
    worst = np.full((num_stages + 1, size), np.inf)  # worst[k, j]: units [0, j) in k stages
    worst[0, 0] = 0.0
    for k in range(num_stages):
        starts, ends = _band(k, num_stages, size - 1)
        worst[k + 1, ends] = np.maximum(worst[k, starts, None], cost[k, starts, ends]).min(axis=0)
    return float(worst[num_stages, size - 1])


def solve_cuts(cost: np.ndarray | SharedRows, num_microbatches: int, cut_allowed: np.ndarray | None = None,
               candidates: np.ndarray | None = None) -> StageCuts:
    """Optimal contiguous cuts for `cost[stage, start, end]` (shape S x (U+1) x (U+1)), cutting only
    where `cut_allowed` (`allowed_cuts`; None: anywhere) permits. `candidates`: the distinct finite
    values of `cost`, ascending, where the caller has them cheaper (stages sharing cost rows)."""
    num_stages, size, _ = cost.shape
    num_units = size - 1
    if num_stages > num_units:
        raise PlannerError(f"{num_stages} pipeline stages need at least as many units; the model has {num_units}.", "Use fewer stages.")
    if cut_allowed is not None and num_stages > max_stages(cut_allowed):
        raise PlannerError(f"{num_stages} pipeline stages need {num_stages - 1} cuts; units sharing a parameter leave "
                           f"{max_stages(cut_allowed) - 1}.", "Use fewer stages.")
    if not (cut_allowed is None or cut_allowed.all()):
        cost, candidates = forbid_cuts(cost.dense() if isinstance(cost, SharedRows) else cost, cut_allowed), None
    if candidates is None:
        values = cost.rows if isinstance(cost, SharedRows) else cost
        candidates = np.unique(values[np.isfinite(values)])
    least = _least_bottleneck(cost)
    if not np.isfinite(least):
        raise PlannerError("No way to cut the model into stages that each fit in memory.", "Add GPUs, recomputation or ZeRO.")
    lo = int(np.searchsorted(candidates, least))  # the smallest feasible bottleneck is a candidate
    # Any cuts whose bottleneck is t take at least least_sum + (m - 1) t, where least_sum is the
    # smallest summed cost of any feasible cuts: once that bound (or m t) passes the best T
    # found, no later (larger) candidate can win. Exact, and much tighter than m t alone
    # when there are many stages.
    # The min-sum cuts over every feasible range are also a solution: they start the incumbent.
    best_cuts = _min_sum_cuts(cost, candidates[-1:])[0]
    stage_costs = [float(cost[k, i, j]) for k, (i, j) in enumerate(best_cuts)]
    least_sum, best_total = sum(stage_costs), pipeline_time(stage_costs, num_microbatches)
    pending, first, batch_size = candidates[lo:], 0, 1
    while first < pending.size:
        batch = pending[first:first + batch_size]
        first, batch_size = first + batch_size, min(2 * batch_size, BATCH)  # 1, 2, 4, ...: most scans stop early
        batch = batch[(least_sum + (num_microbatches - 1) * batch < best_total) & (num_microbatches * batch < best_total)]
        if batch.size == 0:
            break
        for cuts in _min_sum_cuts(cost, batch):
            if cuts is None:
                continue
            total = pipeline_time([cost[k, i, j] for k, (i, j) in enumerate(cuts)], num_microbatches)
            if total < best_total - 1e-15:
                best_total, best_cuts = total, cuts
    times = tuple(float(cost[k, i, j]) for k, (i, j) in enumerate(best_cuts))
    return StageCuts(tuple(best_cuts), times, float(best_total))


def _min_sum_cuts(cost: np.ndarray | SharedRows, t_max: np.ndarray) -> list[list[tuple[int, int]] | None]:
    """Per bottleneck t in `t_max`: cuts minimising the sum of stage costs over ranges costing
    at most t (None where none fit). Vectorised over the bottlenecks (axis c below)."""
    num_stages, size, _ = cost.shape
    count = t_max.size
    rows, ends_in_band = np.arange(count)[:, None], np.arange(size - num_stages)[None, :]
    # best[c, k, j]: least summed cost of placing units [0, j) in the first k stages.
    best = np.full((count, num_stages + 1, size), np.inf)
    best[:, 0, 0] = 0.0
    # start[c, k, j]: the first unit of stage k-1 in that optimum.
    start = np.zeros((count, num_stages + 1, size), dtype=int)
    for k in range(1, num_stages + 1):
        starts, ends = _band(k - 1, num_stages, size - 1)
        stage = cost[k - 1, starts, ends]  # [start i, end j]; ranges above the bottleneck c cost inf
        masked = np.where(stage[None] <= t_max[:, None, None], stage[None], np.inf)
        totals = best[:, k - 1, starts, None] + masked  # [c, start i, end j]
        chosen = np.argmin(totals, axis=1)
        start[:, k, ends] = chosen + starts.start
        best[:, k, ends] = totals[rows, chosen, ends_in_band]
    out: list[list[tuple[int, int]] | None] = []
    for c in range(count):
        if not np.isfinite(best[c, num_stages, size - 1]):
            out.append(None)
            continue
        cuts, end = [], size - 1
        for k in range(num_stages, 0, -1):
            begin = int(start[c, k, end])
            cuts.append((begin, end))
            end = begin
        out.append(cuts[::-1])
    return out


def brute_force_cuts(cost: np.ndarray, num_microbatches: int, cut_allowed: np.ndarray | None = None) -> StageCuts:
    """Every placement of S-1 cuts among the U-1 positions (the allowed ones); for tests on small instances."""
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
        total = pipeline_time(times, num_microbatches)
        if best is None or total < best.pipeline_time_s - 1e-15:
            best = StageCuts(bounds, times, total)
    if best is None:
        raise PlannerError("No way to cut the model into stages that each fit in memory.", "Add GPUs.")
    return best
