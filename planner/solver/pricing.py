"""Pricing the configurations in order of their time bound, on one core or several.

The search (planner/solver/solve.py `search`) prices configurations in ascending order of
their lower bound (planner/solver/bounds.py) and stops at the first whose bound reaches the
k-th best time priced so far (`cap`): no configuration after it can enter the top k. Each
pricing (planner/solver/search.py `evaluate_config`: the inter-op DP and the price of its
cuts) is independent of the others but for the cap, which only lets the DP skip stage ranges
that cannot be in a plan faster than the k-th best. So configurations can be priced on
several processes at once (issue #17: the machine has two cores): `workers` forked processes
take them in bound order, at most `2 x workers` in flight; the cap is updated as results come
back, and no new one is started once the next bound reaches it. A worker prices with the cap
known when its configuration was sent, a larger one than the sequential loop would pass: that
prunes less and never changes a price. The top k is therefore the sequential loop's; the
search may price a few configurations more (those in flight when the cap fell below them).

Processes are forked (the tables, bounds and environment are inherited, not copied through
pipes); only the results travel back. Fork needs a POSIX system and a process without
threads that hold locks: the CLI's solve imports no torch and uses it; `search()` called from
Python defaults to one worker.
"""

from __future__ import annotations

import heapq
import math
import multiprocessing
import os
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait

from planner.solver.search import Evaluation

WORKERS_ENV = "PLANNER_SOLVE_WORKERS"
"""Processes `planner solve` prices with (default: the CPUs this process may use)."""
MIN_PARALLEL = 24
"""Fewer configurations to price than this are priced in the calling process: forking costs
more than it saves."""

_PRICE: Callable[[int, float], Evaluation] | None = None
"""The pricing function of the current parallel search, inherited by the forked workers."""


def default_workers() -> int:
    """`WORKERS_ENV`, else the CPUs this process may run on."""
    value = os.environ.get(WORKERS_ENV)
    if value:
        return max(int(value), 1)
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _price_in_worker(index: int, cap: float) -> Evaluation:
    assert _PRICE is not None, "forked without a pricing function"
    return _PRICE(index, cap)


class TopK:
    """The k fastest feasible times so far; `cap` is the k-th (inf until k are known)."""

    def __init__(self, keep: int):
        self.keep, self.cap = keep, math.inf
        self._times: list[float] = []

    def add(self, seconds: float) -> None:
        heapq.heappush(self._times, -seconds)  # slowest on top
        if len(self._times) > self.keep:
            heapq.heappop(self._times)
        if len(self._times) == self.keep:
            self.cap = -self._times[0]


def price_in_order(price: Callable[[int, float], Evaluation], order: Sequence[int], bounds: Sequence[float], keep: int,
                   workers: int = 1) -> tuple[list[Evaluation], int, float]:
    """Price configurations `order[0], order[1], ...` (ascending `bounds[i]`) by `price(i, cap)`
    until the next bound reaches the k-th best time (module docstring). Returns the feasible
    evaluations in bound order, how
    many were priced (`Evaluation.priced`), and the least memory an infeasible one needed."""
    if workers <= 1 or len(order) < MIN_PARALLEL or "fork" not in multiprocessing.get_all_start_methods():
        return _sequential(price, order, bounds, keep)
    return _parallel(price, order, bounds, keep, workers)


def _sequential(price, order, bounds, keep) -> tuple[list[Evaluation], int, float]:
    top, ranked, evaluated, least = TopK(keep), [], 0, math.inf
    for index in order:
        if bounds[index] >= top.cap:
            break
        result = price(index, top.cap)
        evaluated += result.priced
        if result.feasible:
            ranked.append(result)
            top.add(result.iteration_time_s)
        else:
            least = min(least, result.min_memory_bytes)
    return ranked, evaluated, least


def _parallel(price, order, bounds, keep, workers) -> tuple[list[Evaluation], int, float]:
    global _PRICE
    _PRICE = price
    top, results, least = TopK(keep), {}, math.inf
    pending: dict[Future, int] = {}
    position = 0
    try:
        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork")) as pool:
            while True:
                while position < len(order) and len(pending) < 2 * workers and bounds[order[position]] < top.cap:
                    index = order[position]
                    pending[pool.submit(_price_in_worker, index, top.cap)] = index
                    position += 1
                if not pending:
                    break
                done, _ = wait(pending, return_when=FIRST_COMPLETED)
                for future in done:
                    index = pending.pop(future)
                    result = results[index] = future.result()
                    if result.feasible:
                        top.add(result.iteration_time_s)
                    else:
                        least = min(least, result.min_memory_bytes)
    finally:
        _PRICE = None
    ranked = [results[i] for i in order if i in results and results[i].feasible]  # as the sequential loop lists them
    return ranked, sum(result.priced for result in results.values()), least
