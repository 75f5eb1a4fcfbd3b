"""PipeDream-2BW priced as it runs: flush-free layouts by m x the slowest stage (and cut for it),
the others (planner/plan.py `flush_free_blocker` gives a reason) as the flushed 1F1B they run as."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from planner.cluster import make_cluster
from planner.cost.schedules import bubble_fraction, iteration_time_s
from planner.cost.simulator import flush_free_step_s, simulate
from planner.errors import PlannerError
from planner.solver.inter_op import brute_force_cuts, solve_cuts
from planner.solver.search import Config
from planner.solver.solve import ASYNC_NOTE, Pins, async_time_bounds, price_config, search, solve
from tests.test_inter_op import _cost_table, draw_shared_rows

GPT = dict(n_layers=8, d_model=2048, n_heads=16, d_ff=8192, vocab_size=32000, seq_len=1024)
FLUSHED_NOTE = "pipedream-2bw runs flushed with"


# --- closed forms -----------------------------------------------------------------------------

def test_flushed_2bw_takes_1f1b_time_and_bubble():
    f, b, m = [1.0, 2.0, 0.5, 1.0], [2.0, 3.0, 1.0, 2.0], 8
    assert iteration_time_s("pipedream-2bw", f, b, m, flushed=True) == iteration_time_s("1f1b", f, b, m)
    assert iteration_time_s("pipedream-2bw", f, b, m) == m * 5.0  # flush-free: m x the slowest stage
    assert bubble_fraction("pipedream-2bw", 4, m, flushed=True) == bubble_fraction("1f1b", 4, m) > 0
    # `flushed` concerns 2BW only: a synchronous schedule is timed as itself.
    assert iteration_time_s("gpipe", f, b, m, flushed=True) == iteration_time_s("gpipe", f, b, m)


@settings(max_examples=40, deadline=None)
@given(data=st.data(), num_ranks=st.integers(1, 5), extra_microbatches=st.integers(0, 8))
def test_simulated_flush_free_step_is_the_closed_form(data, num_ranks, extra_microbatches):
    """Batches back to back without a flush, as runtime/pp_async.py orders them: in the steady
    state one batch takes m x the slowest stage, on non-uniform stages too. rel 1e-9: the two
    makespans are sums of thousands of stage times, rounded (~1e-14 relative); a wrong order or
    a bubble in the steady state would be off by whole stage times. Times in tenths of a second:
    stages whose works differ by a hair settle too slowly for a test (`flush_free_step_s`)."""
    m = num_ranks + extra_microbatches
    tenths = lambda lo, hi: st.lists(st.integers(lo, hi).map(lambda t: t / 10), min_size=num_ranks,  # noqa: E731
                                     max_size=num_ranks)
    f, b = data.draw(tenths(1, 30)), data.draw(tenths(1, 60))
    assert flush_free_step_s(f, b, m) == pytest.approx(iteration_time_s("pipedream-2bw", f, b, m), rel=1e-9)
    # The flushed step is one batch alone: 1F1B's timeline, which `flushed=True` prices by 1F1B's form.
    assert simulate("pipedream-2bw", f, b, m).makespan_s == simulate("1f1b", f, b, m).makespan_s


@pytest.mark.parametrize(("p", "m", "p2p_s"), [(2, 3, 0.5), (4, 8, 0.1), (6, 9, 1.5), (8, 11, 0.2)])
def test_p2p_latency_stretches_the_flush_free_step_as_1f1b(p, m, p2p_s):
    """Uniform stages (f 1 s, b 2 s): each round trip adds 2 (p - 1) p2p_s / p per micro-batch, as
    in 1F1B's steady state (planner/cost/schedules.py); exact to float rounding (1e-9 s)."""
    assert flush_free_step_s([1.0] * p, [2.0] * p, m, p2p_s) == pytest.approx(m * (3.0 + 2 * (p - 1) * p2p_s / p),
                                                                              abs=1e-9)


# --- the inter-op DP's 2BW objective ------------------------------------------------------------

def _flush_free_matches_brute_force(cost, dense, num_microbatches: int) -> None:
    """The DP under 2BW's objective (m max, ties to the least sum) reaches brute force's objective
    and sum, or both refuse. rel 1e-12: the same stage costs, summed in another order."""
    try:
        expected = brute_force_cuts(dense, num_microbatches, flush_free=True)
    except PlannerError:
        with pytest.raises(PlannerError):
            solve_cuts(cost, num_microbatches, flush_free=True)
        return
    got = solve_cuts(cost, num_microbatches, flush_free=True)
    assert got.pipeline_time_s == pytest.approx(expected.pipeline_time_s, rel=1e-12)
    assert got.pipeline_time_s == pytest.approx(num_microbatches * max(got.stage_times_s), rel=1e-12)
    assert sum(got.stage_times_s) == pytest.approx(sum(expected.stage_times_s), rel=1e-12)
    assert got.bounds[0][0] == 0 and got.bounds[-1][1] == dense.shape[-1] - 1
    assert all(a[1] == b[0] for a, b in zip(got.bounds, got.bounds[1:], strict=False))
    # The synchronous cuts are never better under 2BW's objective.
    sync = solve_cuts(cost, num_microbatches)
    assert got.pipeline_time_s <= num_microbatches * max(sync.stage_times_s) * (1 + 1e-12)


@settings(max_examples=80, deadline=None)
@given(data=st.data(), num_units=st.integers(2, 12), num_stages=st.integers(1, 4), num_microbatches=st.integers(1, 16),
       memory_bound=st.booleans())
def test_flush_free_dp_equals_brute_force(data, num_units, num_stages, num_microbatches, memory_bound):
    num_stages = min(num_stages, num_units)
    times = data.draw(st.lists(st.floats(0.1, 10.0), min_size=num_units, max_size=num_units))
    p2p = data.draw(st.lists(st.floats(0.0, 2.0), min_size=num_units, max_size=num_units))
    memory = data.draw(st.lists(st.floats(1.0, 10.0), min_size=num_units, max_size=num_units))
    cost = _cost_table(times, num_stages, p2p, memory, sum(memory) * 1.5 if memory_bound else np.inf)
    _flush_free_matches_brute_force(cost, cost, num_microbatches)


@settings(max_examples=40, deadline=None)
@given(data=st.data(), num_units=st.integers(2, 12), num_microbatches=st.integers(1, 16), num_rows=st.integers(1, 3))
def test_flush_free_dp_on_shared_rows_equals_brute_force(data, num_units, num_microbatches, num_rows):
    """As the search builds it: stages sharing cost rows by in-flight level (`SharedRows`)."""
    shared = draw_shared_rows(data, num_units, num_rows, 5)
    _flush_free_matches_brute_force(shared, shared.dense(), num_microbatches)


def test_2bw_cuts_differ_from_1f1b_where_a_cut_is_expensive():
    """Units of 2, 1, 1, 2 s; cutting in the middle costs 0.9 s more (a wide activation crossing).
    1F1B (sum + 3 max) keeps the cheap cut after unit 0: 6 + 3 x 4 = 18 against 6.9 + 3 x 3.9 = 18.6.
    2BW (4 max) takes the balanced but dearer middle cut: 4 x 3.9 = 15.6 against 16."""
    cost = _cost_table([2.0, 1.0, 1.0, 2.0], 2, [0.0, 0.9, 0.0, 0.0], [1.0] * 4, np.inf)
    sync, bw = solve_cuts(cost, 4), solve_cuts(cost, 4, flush_free=True)
    assert sync.bounds == ((0, 1), (1, 4)) == brute_force_cuts(cost, 4).bounds
    assert bw.bounds == ((0, 2), (2, 4)) == brute_force_cuts(cost, 4, flush_free=True).bounds
    assert sync.pipeline_time_s == pytest.approx(18.0) and bw.pipeline_time_s == pytest.approx(15.6)


def test_ties_on_the_bottleneck_go_to_the_least_work():
    """Three stages, a 5 s unit first: the first stage is that unit alone, and every split of the
    four 1 s units behind it leaves the bottleneck at 5 s. Cutting after unit 1, 2 or 3 adds 1, 0
    or 0.5 s of p2p: the free cut after unit 2 wins (sum 9 against 10 and 9.5)."""
    cost = _cost_table([5.0, 1.0, 1.0, 1.0, 1.0], 3, [0.0, 1.0, 0.0, 0.5, 0.0], [1.0] * 5, np.inf)
    got = solve_cuts(cost, 4, flush_free=True)
    assert got.bounds == ((0, 1), (1, 3), (3, 5)) == brute_force_cuts(cost, 4, flush_free=True).bounds
    assert got.pipeline_time_s == 4 * 5.0 and sum(got.stage_times_s) == pytest.approx(9.0)


# --- the search prices what runs ----------------------------------------------------------------

@pytest.fixture(scope="module")
def gpt_profile():
    from planner.profiler import profile_model

    return profile_model("examples/gpt.py", GPT, [1, 2, 4], device="meta", gpu="a100-80gb", dtype="bfloat16")


def _config(schedule: str, zero_stage: int) -> Config:
    return Config(tp=1, sequence_parallel=False, pp=4, dp=2, micro_batch_size=1, num_microbatches=32,
                  schedule=schedule, virtual_stages=1, zero_stage=zero_stage)


def test_flushed_2bw_is_priced_as_1f1b_plus_its_stash(gpt_profile):
    cluster = make_cluster(8, 8, "a100-80gb")
    flushed = price_config(gpt_profile, cluster, _config("pipedream-2bw", 1))
    sync = price_config(gpt_profile, cluster, _config("1f1b", 1))
    assert flushed.flushed_by is not None and "zero_stage > 0" in flushed.flushed_by
    assert flushed.bounds == sync.bounds  # memory is roomy: the same cuts, by the same objective
    # Same stages, same closed form, same once-per-step tail: equal to the rounding of one sum.
    assert flushed.iteration_time_s == pytest.approx(sync.iteration_time_s, rel=1e-12)
    assert flushed.bubble_fraction == pytest.approx(sync.bubble_fraction, rel=1e-12) and flushed.bubble_fraction > 0
    assert all(a > s for a, s in zip(flushed.peak_memory_bytes, sync.peak_memory_bytes, strict=True))
    assert all(t["stashed_weights"] > 0 for t in flushed.memory_terms)


def test_flush_free_2bw_has_no_bubble(gpt_profile):
    cluster = make_cluster(8, 8, "a100-80gb")
    free = price_config(gpt_profile, cluster, _config("pipedream-2bw", 0))
    sync = price_config(gpt_profile, cluster, _config("1f1b", 0))
    assert free.flushed_by is None and free.bubble_fraction == 0.0
    assert free.iteration_time_s < sync.iteration_time_s


def test_search_never_prefers_a_flushed_2bw(gpt_profile):
    """With ZeRO pinned to 1 every 2BW candidate runs flushed: it ties 1F1B at best, and loses."""
    result = search(gpt_profile, make_cluster(8, 8, "a100-80gb"), 64, Pins(pp=4, zero_stage=1), keep=10**6,
                    allow_async=True)
    bw = [e for e in result.ranked if e.config.schedule == "pipedream-2bw"]
    assert bw and all(e.flushed_by for e in bw)
    assert result.ranked[0].config.schedule != "pipedream-2bw"
    for e in bw:  # its 1F1B twin is ranked before it
        twin = dataclasses.replace(e.config, schedule="1f1b")
        assert any(s.config == twin for s in result.ranked[:result.ranked.index(e)])


def test_plan_notes_say_once_why_2bw_ran_flushed(gpt_profile):
    cluster = make_cluster(8, 8, "a100-80gb")
    # Every configuration priced: the flushed candidates tie their 1F1B twins at best, so a
    # short list may prune them unpriced
    plan = solve(gpt_profile, cluster, 64, Pins(pp=4), top_k=10**6, allow_async=True)
    assert plan.search is not None and plan.search.notes[0] == ASYNC_NOTE
    flushed = [n for n in plan.search.notes if n.startswith(FLUSHED_NOTE)]
    assert len(flushed) == 1 and flushed[0].count("zero_stage > 0") == 1
    assert plan.layout.schedule == "pipedream-2bw" and plan.layout.zero_stage == 0  # the winner runs flush-free
    # No 2BW candidate runs flushed with ZeRO 0 on one node (no activation slicing): no such note.
    plain = solve(gpt_profile, cluster, 64, Pins(pp=4, zero_stage=0), top_k=3, allow_async=True)
    assert plain.search is not None and plain.search.notes == [ASYNC_NOTE]  # an autocast profile: no AUTOCAST_NOTE


def test_async_time_bound_is_scaled_only_where_2bw_runs_flush_free():
    bounds = np.ones(3)
    configs = [_config("1f1b", 0), _config("pipedream-2bw", 0), _config("pipedream-2bw", 1)]
    m, chunks = 32, 4
    assert async_time_bounds(bounds, configs, 8).tolist() == [1.0, m / (m + chunks - 1), 1.0]
    # Without the node size every 2BW is scaled: looser, still a lower bound.
    assert async_time_bounds(bounds, configs).tolist() == [1.0, m / (m + chunks - 1), m / (m + chunks - 1)]
