"""Inter-op: where to cut the pipeline. A dynamic program over contiguous unit ranges.

Problem. Units 0..U-1 (execution order) go to S pipeline stages, each a contiguous range;
stage k (k = 0 first) holding units [i, j) costs `cost[k, i, j]` seconds per micro-batch
(forward + backward + its tensor-parallel collectives + sending what crosses cut j), or
+inf where the range does not fit in stage k's memory (stage position matters: under 1F1B
stage k keeps p - k micro-batches in flight). With m micro-batches the pipeline takes

    T(cuts) = sum_k t_k + (m - 1) * max_k t_k                      (Alpa, Zheng et al. 2022, eq. 2)

(the first micro-batch crosses every stage, the other m-1 are paced by the slowest).

Method (Alpa's stage-construction DP, section 5.2). For each candidate bottleneck t_max
(the distinct finite values of `cost`, ascending, from the smallest feasible one found by
bisection) solve

    best[k][j] = min_i  best[k-1][i] + cost[k-1, i, j]  over ranges with cost <= t_max

where the table axes are `best[number of stages placed][units placed]` (seconds), and keep
best[S][U] + (m - 1) * t_max. Since T >= m * t_max for the optimum's own bottleneck, the
scan stops once m * t_max exceeds the best T seen. The minimum over candidates is the
optimum of T: the optimal cuts appear when t_max equals their own bottleneck. Each
candidate costs O(S U^2) (vectorised over i and j with numpy).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from planner.errors import PlannerError


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


def _feasible(cost: np.ndarray, t_max: float) -> bool:
    """Can all units be covered by S stages each costing <= t_max? (reachability DP)"""
    num_stages, size, _ = cost.shape
    reach = np.zeros(size, dtype=bool)
    reach[0] = True
    for k in range(num_stages):
        ok = cost[k] <= t_max
        reach = (reach[:, None] & ok).any(axis=0)
    return bool(reach[size - 1])


def solve_cuts(cost: np.ndarray, num_microbatches: int) -> StageCuts:
    """Optimal contiguous cuts for `cost[stage, start, end]` (shape S x (U+1) x (U+1))."""
    num_stages, size, _ = cost.shape
    num_units = size - 1
    if num_stages > num_units:
        raise PlannerError(f"{num_stages} pipeline stages need at least as many units; the model has {num_units}.", "Use fewer stages.")
    candidates = np.unique(cost[np.isfinite(cost)])
    if candidates.size == 0 or not _feasible(cost, candidates[-1]):
        raise PlannerError("No way to cut the model into stages that each fit in memory.", "Add GPUs, recomputation or ZeRO.")
    lo, hi = 0, candidates.size - 1  # bisection for the smallest feasible bottleneck
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if _feasible(cost, candidates[mid]) else (mid + 1, hi)
    best_total, best_cuts = np.inf, None
    for t_max in candidates[lo:]:
        if num_microbatches * t_max >= best_total:
            break
        cuts = _min_sum_cuts(np.where(cost <= t_max, cost, np.inf))
        if cuts is None:
            continue
        total = pipeline_time([cost[k, i, j] for k, (i, j) in enumerate(cuts)], num_microbatches)
        if total < best_total - 1e-15:
            best_total, best_cuts = total, cuts
    assert best_cuts is not None  # the bisection found a feasible t_max
    times = tuple(float(cost[k, i, j]) for k, (i, j) in enumerate(best_cuts))
    return StageCuts(tuple(best_cuts), times, float(best_total))


def _min_sum_cuts(masked: np.ndarray) -> list[tuple[int, int]] | None:
    """Cuts minimising the sum of stage costs (inf entries forbidden)."""
    num_stages, size, _ = masked.shape
    # best[k][j]: least summed cost of placing units [0, j) in the first k stages.
    best = np.full((num_stages + 1, size), np.inf)
    best[0, 0] = 0.0
    # start[k][j]: the first unit of stage k-1 in that optimum.
    start = np.zeros((num_stages + 1, size), dtype=int)
    for k in range(1, num_stages + 1):
        totals = best[k - 1][:, None] + masked[k - 1]  # [start i, end j]
        start[k] = np.argmin(totals, axis=0)
        best[k] = totals[start[k], np.arange(size)]
    if not np.isfinite(best[num_stages, size - 1]):
        return None
    cuts, end = [], size - 1
    for k in range(num_stages, 0, -1):
        begin = int(start[k, end])
        cuts.append((begin, end))
        end = begin
    return cuts[::-1]


def brute_force_cuts(cost: np.ndarray, num_microbatches: int) -> StageCuts:
    """Every placement of S-1 cuts among U-1 positions; for tests on small instances."""
    from itertools import combinations

    num_stages, size, _ = cost.shape
    best: StageCuts | None = None
    for inner in combinations(range(1, size - 1), num_stages - 1):
        edges = (0, *inner, size - 1)
        bounds = tuple(zip(edges[:-1], edges[1:]))
        times = tuple(float(cost[k, i, j]) for k, (i, j) in enumerate(bounds))
        if not all(np.isfinite(times)):
            continue
        total = pipeline_time(times, num_microbatches)
        if best is None or total < best.pipeline_time_s - 1e-15:
            best = StageCuts(bounds, times, total)
    if best is None:
        raise PlannerError("No way to cut the model into stages that each fit in memory.", "Add GPUs.")
    return best
