"""Pricing in bound order on several processes (planner/solver/pricing.py) finds the sequential
loop's top k: the cap only prunes, and the configurations are the same."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

import planner.solver.pricing as pricing
from planner.solver.search import Evaluation


def _instance(seed: int, n: int = 60):
    rng = random.Random(seed)
    bounds = [rng.uniform(1, 10) for _ in range(n)]
    times = [b * rng.uniform(1, 1.6) for b in bounds]  # a bound never exceeds the price
    fits = [rng.random() > 0.1 for _ in range(n)]
    order = sorted(range(n), key=lambda i: bounds[i])
    seen: list[tuple[int, float]] = []

    def price(index: int, cap: float) -> Evaluation:
        seen.append((index, cap))
        cfg = SimpleNamespace(index=index)
        if not fits[index]:
            return Evaluation(cfg, False, "does not fit", min_memory_bytes=1e9 + index)
        return Evaluation(cfg, True, iteration_time_s=times[index])

    return price, order, bounds, times, fits, seen


@pytest.mark.timeout(120)
@pytest.mark.parametrize("seed,first", [(0, 0), (1, 0), (2, 3), (3, 3)])
def test_parallel_pricing_keeps_the_sequential_top_k(seed, first, monkeypatch):
    """`first` configurations priced in process before the workers take the rest."""
    monkeypatch.setattr(pricing, "MIN_PARALLEL", 0)
    monkeypatch.setattr(pricing, "SEQUENTIAL_FIRST", first)
    forked = []
    parallel = pricing._parallel
    monkeypatch.setattr(pricing, "_parallel", lambda *args: forked.append(True) or parallel(*args))
    price, order, bounds, times, fits, seen = _instance(seed)
    candidates = [(i, bounds[i]) for i in order]
    ranked, evaluated, _ = pricing.price_in_order(price, candidates, len(order), keep=3, workers=1)
    assert evaluated == len(seen) < len(order) and evaluated > first  # the bound stopped it early
    in_parallel, priced, _ = pricing.price_in_order(price, iter(candidates), len(order), keep=3, workers=2)
    assert forked
    best = sorted(times[i] for i in range(len(times)) if fits[i])[:3]
    for found in (ranked, in_parallel):
        assert sorted(e.iteration_time_s for e in found)[:3] == best
    assert evaluated <= priced <= evaluated + 4  # at most what was in flight when the cap fell
    positions = {i: k for k, i in enumerate(order)}
    assert [positions[e.config.index] for e in in_parallel] == sorted(positions[e.config.index] for e in in_parallel)


def test_few_configurations_are_priced_in_process(monkeypatch):
    price, order, bounds, *_ = _instance(0, n=5)
    monkeypatch.setattr(pricing, "_parallel", lambda *a: pytest.fail("forked for 5 configurations"))
    pricing.price_in_order(price, [(i, bounds[i]) for i in order], len(order), keep=3, workers=2)


def test_workers_from_the_environment(monkeypatch):
    monkeypatch.setenv(pricing.WORKERS_ENV, "1")
    assert pricing.default_workers() == 1
    monkeypatch.delenv(pricing.WORKERS_ENV)
    assert pricing.default_workers() >= 1


@pytest.mark.parametrize("seed", range(6))
def test_refined_order_is_the_stronger_bounds_order_and_refines_only_what_it_reaches(seed):
    import numpy as np

    rng = np.random.default_rng(seed)
    weak = rng.uniform(1, 10, 500)
    strong = weak * rng.uniform(1, 1.5, 500)  # never below the weak bound
    touched: set[int] = set()

    def refine(indices):
        touched.update(indices)
        return strong[indices]

    everything = list(pricing.refined_order(weak, refine, batch=16))
    assert sorted(i for i, _ in everything) == list(range(500))
    assert [b for _, b in everything] == sorted(strong.tolist())
    touched.clear()
    cap = float(np.quantile(strong, 0.2))
    below = []
    for index, bound in pricing.refined_order(weak, refine, batch=16):
        if bound >= cap:
            break
        below.append(index)
    assert set(below) == set(np.flatnonzero(strong < cap).tolist())
    assert len(touched) <= int((weak < cap).sum()) + 16  # what the weak bound admits, and one batch more


@pytest.mark.timeout(120)
@pytest.mark.parametrize("seed,workers", [(0, 1), (1, 1), (2, 2), (3, 2)])
def test_scouting_prices_nothing_twice_and_keeps_the_top_k(seed, workers, monkeypatch):
    """A scout prices the best refined configurations before more are refined: the same top k
    as without it, each configuration priced once, and the batches refined after it see the cap
    (`refined_order`'s `cap`), so the refinement stops where nothing left can enter the top k."""
    import numpy as np

    monkeypatch.setattr(pricing, "MIN_PARALLEL", 0)
    monkeypatch.setattr(pricing, "SEQUENTIAL_FIRST", 2)
    rng = np.random.default_rng(seed)
    n = 400
    weak = rng.uniform(1, 10, n)
    strong = weak * rng.uniform(1, 3, n)  # a weak bound far below the strong one: many batches before the first turn
    times = strong * rng.uniform(1, 1.2, n)
    fits = rng.random(n) > 0.2
    seen: list[int] = []
    caps: list[float] = []

    def price(index: int, cap: float) -> Evaluation:
        seen.append(index)
        if not fits[index]:
            return Evaluation(SimpleNamespace(index=index), False, "does not fit", min_memory_bytes=1e9 + index)
        return Evaluation(SimpleNamespace(index=index), True, iteration_time_s=float(times[index]))

    top = pricing.TopK(3)

    def refine(indices):
        caps.append(top.cap)
        return strong[indices]

    scout = pricing.Scout(price, top)
    order = pricing.refined_order(weak, refine, batch=16, scout=scout, cap=lambda: top.cap)
    ranked, evaluated, least = pricing.price_in_order(price, order, n, keep=3, workers=workers, top=top, scout=scout)
    if workers == 1:
        assert len(seen) == len(set(seen)) == evaluated  # nothing priced twice (workers price in their own process)
    assert 0 < scout.priced <= pricing.SCOUTS
    best = sorted(times[fits].tolist())[:3]
    assert sorted(e.iteration_time_s for e in ranked)[:3] == best
    assert len({e.config.index for e in ranked}) == len(ranked)
    if workers == 1:
        assert least == min((1e9 + i for i in set(seen) if not fits[i]), default=float("inf"))
    assert caps[0] == float("inf") and caps[-1] < float("inf")  # the scout gave the later batches a cap
    # No configuration whose strong bound is below the final k-th time was left out.
    priced = {e.config.index for e in ranked}
    assert all(i in priced for i in np.flatnonzero((strong < best[-1]) & fits).tolist())


def _serving_thread(helpers, serve, top):
    """Part 1 of a split search as a thread of this process, serving by `serve` into `top` (it
    stops once part 0, this thread's caller, serves too); returns once it serves."""
    import threading

    helpers.part = 1
    server = threading.Thread(target=helpers.serve, args=(serve, top))
    server.start()
    while not helpers.serving:
        pass
    helpers.part = 0
    return server


@pytest.mark.timeout(120)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_part_hands_configurations_to_a_serving_part_and_keeps_the_top_k(seed):
    """Two parts of a split search (`Helpers`), here as two threads: part 1 is done and serves,
    part 0 prices its candidates handing some to it. The same top k as the sequential loop, every
    configuration priced once, the served ones' times in the shared cap."""

    price, order, bounds, times, fits, seen = _instance(seed)
    candidates = [(i, bounds[i]) for i in order]
    ranked, evaluated, _ = pricing.price_in_order(price, candidates, len(order), keep=3)
    seen.clear()
    helpers, top = pricing.Helpers(2), pricing.SharedTopK(3)
    served = []

    def serve(index: int, cap: float) -> Evaluation:
        served.append(index)
        return price(index, cap)

    server = _serving_thread(helpers, serve, top)
    shared, priced, _ = pricing.price_in_order(price, candidates, len(order), keep=3, top=top, helpers=helpers,
                                               request=lambda index: index)
    helpers.serve(serve, top)  # part 0 done too: the server stops
    server.join(timeout=10)
    helpers.close()
    assert not server.is_alive() and served
    best = sorted(times[i] for i in range(len(times)) if fits[i])[:3]
    assert sorted(e.iteration_time_s for e in shared)[:3] == best == sorted(e.iteration_time_s for e in ranked)[:3]
    assert len(seen) == len({index for index, _ in seen}) == priced  # each priced once, here or there
    assert top.cap == best[-1]


@pytest.mark.timeout(60)
def test_a_split_part_that_fails_is_an_error_here_not_a_hang():
    """A forked part that raises: its error comes back and the serving parent stops waiting for
    it; one that dies without an answer: a PlannerError that says so."""
    import os
    import time

    from planner.errors import PlannerError

    helpers = pricing.Helpers(2)

    def raising(index: int):
        if index == 1:
            raise ValueError("part 1 broke")
        helpers.part = 0
        helpers.serve(lambda request, cap: pytest.fail("nothing was handed out"), pricing.SharedTopK(3))
        return "part 0"

    started = time.monotonic()
    with pytest.raises(ValueError, match="part 1 broke"):
        pricing.run_split(raising, 2)
    helpers.close()
    with pytest.raises(PlannerError, match="ended without an answer"):
        pricing.run_split(lambda index: os._exit(3) if index else "part 0", 2)
    assert time.monotonic() - started < 10
    assert pricing.run_split(lambda index: index * 10, 3) == [0, 10, 20]


@pytest.mark.timeout(60)
def test_with_three_parts_a_raising_part_ends_the_serving_ones():
    """Part 2 raises while parts 0 and 1 serve: they stop (the split's failure flag) and its
    error comes back within seconds."""
    import time

    helpers = pricing.Helpers(3)

    def part(index: int):
        if index == 2:
            time.sleep(0.2)
            raise ValueError("part 2 broke")
        helpers.part = index
        helpers.serve(lambda request, cap: pytest.fail("nothing was handed out"), pricing.SharedTopK(3))
        return index

    started = time.monotonic()
    with pytest.raises(ValueError, match="part 2 broke"):
        pricing.run_split(part, 3)
    helpers.close()
    assert time.monotonic() - started < 5


@pytest.mark.timeout(60)
def test_with_three_parts_a_server_that_dies_holding_a_request_is_an_error():
    """Part 1 hands its configurations out; part 2 dies with one in hand (part 0 serves slowly):
    part 1 stops waiting for the answer, and the search ends with an error, not a hang."""
    import os
    import time

    from planner.errors import PlannerError

    helpers, top = pricing.Helpers(3), pricing.SharedTopK(3)
    price, order, bounds, *_ = _instance(0)

    def part(index: int):
        helpers.part = index
        if index == 1:
            while helpers.serving < 2:
                time.sleep(0.001)
            return pricing.price_in_order(price, [(i, bounds[i]) for i in order], len(order), keep=3,
                                          top=top, helpers=helpers, request=lambda i: i)
        if index == 2:
            helpers.serve(lambda request, cap: os._exit(7), top)
        helpers.serve(lambda request, cap: time.sleep(0.3) or price(request, cap), top)
        return index

    started = time.monotonic()
    with pytest.raises(PlannerError):
        pricing.run_split(part, 3)
    helpers.close()
    assert time.monotonic() - started < 10


@pytest.mark.timeout(60)
def test_a_served_error_that_does_not_pickle_still_reaches_its_owner():
    """A server's pricing raises an error holding a lambda (the queue's thread would drop it and
    leave the owner waiting): the owner gets a RuntimeError with the traceback instead."""

    class Unpicklable(Exception):
        def __init__(self):
            super().__init__("broken")
            self.hook = lambda: None

    def broken(request, cap):
        raise Unpicklable()

    price, order, bounds, *_ = _instance(1)
    helpers = pricing.Helpers(2)
    top = pricing.SharedTopK(3)
    server = _serving_thread(helpers, broken, top)
    with pytest.raises(RuntimeError, match="Unpicklable"):
        pricing.price_in_order(price, [(i, bounds[i]) for i in order], len(order), keep=3, top=top,
                               helpers=helpers, request=lambda index: index)
    helpers.serve(broken, top)  # part 0 done: the server stops
    server.join(timeout=10)
    helpers.close()
    assert not server.is_alive()
