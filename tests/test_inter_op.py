"""Inter-op DP: optimal against brute force over all cut positions."""

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from planner.errors import PlannerError
from planner.solver.inter_op import SharedRows, brute_force_cuts, least_bottleneck, least_total, level_ranks, solve_cuts


def _cost_table(unit_times, num_stages, p2p, memory, stage_limit):
    """cost[k, i, j] from per-unit times and memory: sum of times + p2p at the cut, inf if over the limit."""
    size = len(unit_times) + 1
    prefix_t = np.concatenate([[0.0], np.cumsum(unit_times)])
    prefix_m = np.concatenate([[0.0], np.cumsum(memory)])
    cost = np.full((num_stages, size, size), np.inf)
    for k in range(num_stages):
        for i in range(size):
            for j in range(i + 1, size):
                # Earlier stages keep more micro-batches in flight (1F1B): memory grows with p - k.
                mem = (prefix_m[j] - prefix_m[i]) * (num_stages - k)
                if mem <= stage_limit:
                    cost[k, i, j] = prefix_t[j] - prefix_t[i] + (p2p[j - 1] if j < size - 1 else 0.0)
    return cost


@settings(max_examples=60, deadline=None)
@given(
    data=st.data(),
    num_units=st.integers(2, 12),
    num_stages=st.integers(1, 4),
    num_microbatches=st.integers(1, 16),
    memory_bound=st.booleans(),
)
def test_dp_equals_brute_force(data, num_units, num_stages, num_microbatches, memory_bound):
    num_stages = min(num_stages, num_units)
    times = data.draw(st.lists(st.floats(0.1, 10.0), min_size=num_units, max_size=num_units))
    p2p = data.draw(st.lists(st.floats(0.0, 2.0), min_size=num_units, max_size=num_units))
    memory = data.draw(st.lists(st.floats(1.0, 10.0), min_size=num_units, max_size=num_units))
    # Memory-bound instances: a limit that forbids many ranges; compute-bound: no limit.
    limit = (sum(memory) * 1.5 if memory_bound else np.inf)
    cost = _cost_table(times, num_stages, p2p, memory, limit)
    _matches_brute_force(cost, cost, num_microbatches, num_units)


@settings(max_examples=60, deadline=None)
@given(data=st.data(), num_units=st.integers(2, 9), num_stages=st.integers(1, 4), memory_bound=st.booleans())
def test_least_bottleneck_and_least_total_equal_brute_force(data, num_units, num_stages, memory_bound):
    # The min-max and min-sum over every way to cut the units into num_stages contiguous ranges
    # (inf where a range does not fit): the bounds the "does not fit" message reports.
    num_stages = min(num_stages, num_units)
    times = data.draw(st.lists(st.floats(0.1, 10.0), min_size=num_units, max_size=num_units))
    memory = data.draw(st.lists(st.floats(1.0, 10.0), min_size=num_units, max_size=num_units))
    cost = _cost_table(times, num_stages, [0.0] * num_units, memory, sum(memory) * 1.5 if memory_bound else np.inf)
    worst, total = np.inf, np.inf
    for inner in itertools.combinations(range(1, num_units), num_stages - 1):
        edges = (0, *inner, num_units)
        values = [cost[k, edges[k], edges[k + 1]] for k in range(num_stages)]
        worst, total = min(worst, max(values)), min(total, sum(values))
    assert least_bottleneck(cost) == pytest.approx(worst)
    assert least_total(cost) == pytest.approx(total)


def test_heavy_layer_gives_non_uniform_cuts():
    times = [1.0] * 8
    times[1] = 6.0  # one heavy layer early on
    cost = _cost_table(times, 2, [0.0] * 8, [1.0] * 8, np.inf)
    cuts = solve_cuts(cost, 8)
    sizes = [j - i for i, j in cuts.bounds]
    assert sizes[0] < sizes[1], sizes  # the heavy layer's stage holds fewer units
    assert cuts.stage_times_s[0] == pytest.approx(7.0) and cuts.stage_times_s[1] == pytest.approx(6.0)


def test_too_many_stages_is_an_error():
    with pytest.raises(PlannerError, match="stages"):
        solve_cuts(np.zeros((3, 3, 3)), 4)


def test_nothing_fits_is_an_error():
    cost = np.full((2, 5, 5), np.inf)
    with pytest.raises(PlannerError, match="fit"):
        solve_cuts(cost, 4)


@settings(max_examples=60, deadline=None)
@given(
    data=st.data(),
    num_units=st.integers(2, 14),
    num_microbatches=st.integers(1, 16),
    num_rows=st.integers(1, 3),
)
def test_shared_rows_dp_equals_brute_force(data, num_units, num_microbatches, num_rows):
    """Stages sharing cost rows (`SharedRows`, as zero bubble and interleaving build them), with as
    many stages as units allow and memory limits per row that cut long ranges (what the DP's scan
    by range length, `_by_length`, skips): the same optimum as brute force over the dense table.
    Exact up to float rounding (1e-12): both sum the same stage costs."""
    shared = draw_shared_rows(data, num_units, num_rows, num_units)
    _matches_brute_force(shared, shared.dense(), num_microbatches, num_units)


def draw_shared_rows(data, num_units: int, num_rows: int, most_stages: int) -> SharedRows:
    """A stage cost table as the search builds it: stages sharing `num_rows` cost rows (one per
    in-flight level), each row the cost table of random unit times, p2p and memory under a limit."""
    num_stages = data.draw(st.integers(1, min(num_units, most_stages)))
    times = data.draw(st.lists(st.floats(0.1, 10.0), min_size=num_units, max_size=num_units))
    p2p = data.draw(st.lists(st.floats(0.0, 2.0), min_size=num_units, max_size=num_units))
    memory = data.draw(st.lists(st.floats(1.0, 10.0), min_size=num_units, max_size=num_units))
    limits = data.draw(st.lists(st.floats(sum(memory) / num_stages, sum(memory) * 1.5), min_size=num_rows,
                                max_size=num_rows))
    rows = np.stack([_cost_table(times, 1, p2p, memory, limit)[0] for limit in limits])
    row_of_stage = np.array(data.draw(st.lists(st.integers(0, num_rows - 1), min_size=num_stages, max_size=num_stages)))
    return SharedRows(rows, row_of_stage)


def _matches_brute_force(cost, dense, num_microbatches: int, num_units: int) -> None:
    """The DP on `cost` finds the brute force's pipeline time on `dense` (the same table), or
    both refuse; its cuts are contiguous and cover every unit."""
    try:
        expected = brute_force_cuts(dense, num_microbatches)
    except PlannerError:
        with pytest.raises(PlannerError):
            solve_cuts(cost, num_microbatches)
        return
    got = solve_cuts(cost, num_microbatches)
    assert got.pipeline_time_s == pytest.approx(expected.pipeline_time_s, rel=1e-12)
    assert got.bounds[0][0] == 0 and got.bounds[-1][1] == num_units
    assert all(a[1] == b[0] for a, b in zip(got.bounds, got.bounds[1:], strict=False))


def _rank_time(cost, bounds, num_ranks, num_microbatches) -> float:
    """The v > 1 schedules' pipeline time at these cuts: m x the busiest rank's chunks + (p - 1) x the slowest chunk."""
    times = [cost[k, i, j] for k, (i, j) in enumerate(bounds)]
    return num_microbatches * max(sum(times[r::num_ranks]) for r in range(num_ranks)) + (num_ranks - 1) * max(times)


@pytest.mark.parametrize("times, num_microbatches, dp_time, best_time", [
    # A heavy first and last unit: the DP's per-chunk objective ties on many cuts and takes
    # ones that put chunks 0 and 3 (3 + 3 units of time) on rank 0; leveled, every rank does 5 or 6.
    ([3.0] + [1.0] * 9 + [2.0], 12, 78.0, 66.0),
    # The DP's cuts leave rank 0 (chunks 0 and 3: 8 s against 5 and 7) the busiest, and no
    # single unit moved to a chunk beside one of its chunks lowers the busiest rank's work or
    # spreads it; a chain of cuts (the chunk between passes a unit on) does.
    ([1.0, 3.0, 1.0, 1.0, 1.0, 3.0, 1.0, 3.0, 1.0, 2.0, 3.0], 8, 72.0, 64.0),
])
def test_leveling_reaches_the_ranks_optimum(times, num_microbatches, dp_time, best_time):
    # 11 units in 6 chunks on 3 ranks: leveled, the DP's cuts reach the optimum of the ranks'
    # objective over all cuts.
    cost = _cost_table(times, 6, [0.0] * 11, [1.0] * 11, np.inf)
    dp = solve_cuts(cost, num_microbatches).bounds
    leveled, gain = level_ranks(cost, dp, 3, num_microbatches)
    best = min(_rank_time(cost, tuple(zip((0, *inner), (*inner, 11), strict=True)), 3, num_microbatches)
               for inner in itertools.combinations(range(1, 11), 5))
    assert _rank_time(cost, dp, 3, num_microbatches) == dp_time
    assert _rank_time(cost, leveled, 3, num_microbatches) == best == best_time
    assert gain == dp_time - best_time


@settings(max_examples=100, deadline=None)
@given(data=st.data(), num_ranks=st.integers(2, 3), virtual=st.integers(2, 3), num_microbatches=st.integers(1, 16))
def test_leveling_never_worsens_the_cuts(data, num_ranks, virtual, num_microbatches):
    # Whatever the instance: the leveled cuts still cover the units in non-empty contiguous
    # chunks, each within its own memory; the bytes by which the ranks overflow their limit do
    # not grow (none where none did), and where they stay the ranks' time does not grow either.
    num_chunks = num_ranks * virtual
    num_units = data.draw(st.integers(num_chunks, 12))
    times = data.draw(st.lists(st.floats(0.1, 10.0), min_size=num_units, max_size=num_units))
    memory = data.draw(st.lists(st.floats(1.0, 10.0), min_size=num_units, max_size=num_units))
    cost = _cost_table(times, num_chunks, [0.0] * num_units, memory, np.inf)
    size = num_units + 1
    prefix = np.concatenate([[0.0], np.cumsum(memory)])
    nbytes = np.where(np.isfinite(cost), prefix[None, None, :] - prefix[None, :, None], np.inf)
    dp = solve_cuts(cost, num_microbatches).bounds
    held = lambda cuts: [sum(nbytes[k, i, j] for k, (i, j) in enumerate(cuts) if k % num_ranks == r)  # noqa: E731
                         for r in range(num_ranks)]
    limit = max(held(dp)) * data.draw(st.sampled_from([0.8, 0.95, 1.0]))
    leveled, gain = level_ranks(cost, dp, num_ranks, num_microbatches, nbytes, limit)
    assert leveled[0][0] == 0 and leveled[-1][1] == size - 1
    assert all(i < j for i, j in leveled) and all(a[1] == b[0] for a, b in zip(leveled, leveled[1:], strict=False))
    assert all(np.isfinite(cost[k, i, j]) for k, (i, j) in enumerate(leveled))
    over = lambda cuts: sum(max(b - limit, 0.0) for b in held(cuts))  # noqa: E731
    assert over(leveled) <= over(dp) * (1 + 1e-12) + 1e-9 * limit and (over(dp) > 0 or over(leveled) <= 1e-9 * limit)
    if over(leveled) >= over(dp) * (1 - 1e-12):
        assert _rank_time(cost, leveled, num_ranks, num_microbatches) <= _rank_time(cost, dp, num_ranks, num_microbatches) * (1 + 1e-12)
        assert gain >= 0
