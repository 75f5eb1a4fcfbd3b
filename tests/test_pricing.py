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
