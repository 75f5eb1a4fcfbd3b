"""Pipeline schedules: closed forms (planner.cost.schedules) against the event simulator.

Tolerances are 1e-9 relative: on uniform stages both sides are sums of the same few
floating-point numbers, so any real disagreement is a modelling difference, not rounding.
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from planner.cost.schedules import SCHEDULES, bubble_fraction, in_flight_microbatches, iteration_time_s
from planner.cost.simulator import action_name, draw_gantt, schedule_actions, simulate

F_S, B_S = 1.0, 2.0  # backward twice the forward per micro-batch (Narayanan et al. 2021b)


def uniform(p: int, v: int = 1) -> tuple[list[float], list[float]]:
    """Per-chunk times of a model split evenly into p * v chunks."""
    return [F_S / v] * (p * v), [B_S / v] * (p * v)


PLAIN = [(p, m) for p in (1, 2, 3, 4, 8) for m in (1, 2, 3, p, 2 * p + 1, 4 * p)]
INTERLEAVED = [(p, m, v) for p in (2, 3, 4) for m in (p, 2 * p, 4 * p) for v in (2, 3)]
ZERO_BUBBLE = [(p, m, v) for p in (2, 3, 4, 8) for m in (p, p + 1, 2 * p, 3 * p) for v in (1, 2, 3)
               if v == 1 or m % max(1, m // p) == 0]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize(("p", "m"), PLAIN)
def test_gpipe_1f1b_uniform_closed_form_matches_simulator(schedule, p, m):
    f, b = uniform(p)
    timeline = simulate(schedule, f, b, m)
    assert timeline.makespan_s == pytest.approx(iteration_time_s(schedule, f, b, m), rel=1e-9)
    assert timeline.makespan_s == pytest.approx((m + p - 1) * (F_S + B_S), rel=1e-9)
    assert timeline.bubble_fraction() == pytest.approx(bubble_fraction(schedule, p, m), abs=1e-9)
    assert bubble_fraction(schedule, p, m) == pytest.approx((p - 1) / (m + p - 1))


@pytest.mark.parametrize(("p", "m", "v"), INTERLEAVED)
def test_interleaved_uniform_closed_form_matches_simulator(p, m, v):
    f, b = uniform(p, v)
    timeline = simulate("interleaved-1f1b", f, b, m, v)
    assert timeline.makespan_s == pytest.approx(iteration_time_s("interleaved-1f1b", f, b, m, v), rel=1e-9)
    assert timeline.bubble_fraction() == pytest.approx(bubble_fraction("interleaved-1f1b", p, m, v), abs=1e-9)
    # Narayanan et al. 2021b section 2.2: the bubble time shrinks by v against 1F1B.
    assert timeline.makespan_s - m * (F_S + B_S) == pytest.approx((p - 1) * (F_S + B_S) / v, rel=1e-9)
    assert bubble_fraction("interleaved-1f1b", p, m, v) == pytest.approx(((p - 1) / v) / (m + (p - 1) / v))


@pytest.mark.parametrize(("p", "m", "v"), ZERO_BUBBLE)
@pytest.mark.parametrize("weight_fraction", [0.0, 0.3, 0.5, 0.8])
def test_zero_bubble_uniform_closed_form_matches_simulator(p, m, v, weight_fraction):
    f, b = uniform(p, v)
    timeline = simulate("zero-bubble", f, b, m, v, backward_weight_fraction=weight_fraction)
    closed = iteration_time_s("zero-bubble", f, b, m, v, backward_weight_fraction=weight_fraction)
    assert timeline.makespan_s == pytest.approx(closed, rel=1e-9)
    one_f_one_b = (m * v + p - 1) * (F_S + B_S) / v  # interleaved 1F1B's time, 1F1B's for v = 1
    if weight_fraction > 0:
        assert timeline.makespan_s < one_f_one_b
    if weight_fraction == 0.5 and v == 1:  # W = B = F: ZB-H1's bubble (p-1)(F + B - W) = (p-1) F (Qi et al. 2023)
        assert timeline.makespan_s - m * (F_S + B_S) == pytest.approx((p - 1) * F_S)
    assert timeline.bubble_fraction() == pytest.approx(
        bubble_fraction("zero-bubble", p, m, v, backward_weight_fraction=weight_fraction), abs=1e-9)


@pytest.mark.parametrize(("p", "m"), [(1, 1), (4, 1), (4, 3), (8, 5)])
def test_zero_bubble_few_microbatches_is_simulated(p, m):
    f, b = uniform(p)
    assert iteration_time_s("zero-bubble", f, b, m) == simulate("zero-bubble", f, b, m).makespan_s


@pytest.mark.parametrize(("p", "m"), [(2, 4), (4, 8), (8, 16), (4, 5)])
def test_zero_bubble_has_smaller_bubble_than_1f1b(p, m):
    assert bubble_fraction("zero-bubble", p, m) < bubble_fraction("1f1b", p, m)
    f, b = uniform(p)
    assert simulate("zero-bubble", f, b, m).bubble_fraction() < simulate("1f1b", f, b, m).bubble_fraction()


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize(("p", "m"), [(1, 1), (2, 2), (4, 4), (4, 8), (3, 9), (4, 2), (8, 16)])
def test_peak_in_flight_matches_simulator(schedule, p, m):
    for v in ((1, 2, 3) if schedule in ("interleaved-1f1b", "zero-bubble") else (1,)):
        if (schedule == "interleaved-1f1b" and v > 1 and m % p) or (schedule == "zero-bubble" and m % max(1, m // p)):
            continue
        f, b = uniform(p, v)
        peaks = simulate(schedule, f, b, m, v).peak_in_flight
        for i in range(p):
            assert peaks[i] / v == in_flight_microbatches(schedule, p, m, i, v), (schedule, v, i)
            if schedule == "gpipe":
                assert peaks[i] == m
            if schedule == "1f1b":
                assert peaks[i] == min(m, p - i)


def test_interleaved_rank0_holds_megatrons_count():
    # Korthikanti et al. 2022 section 4.2.3: rank 0 holds p (1 + (p-1)/(p v)) micro-batches.
    p, v = 4, 2
    assert in_flight_microbatches("interleaved-1f1b", p, 4 * p, 0, v) == pytest.approx(p * (1 + (p - 1) / (p * v)))


def test_zero_bubble_v1_peak_is_1f1b_rank0_peak():
    # Qi et al. 2023: ZB-H1 keeps 1F1B's peak memory (p micro-batches on the busiest rank).
    assert [in_flight_microbatches("zero-bubble", 4, 8, i) for i in range(4)] == [4.0] * 4


stage_times = st.lists(st.floats(0.05, 3.0), min_size=1, max_size=6)


@settings(max_examples=60, deadline=None)
@given(forward=stage_times, ratio=st.lists(st.floats(0.5, 3.0), min_size=6, max_size=6), m=st.integers(1, 12))
def test_non_uniform_bounds(forward, ratio, m):
    backward = [f * r for f, r in zip(forward, ratio)]
    work = [f + b for f, b in zip(forward, backward)]
    # Rank k cannot start before micro-batch 0 reaches it; with a full backward its last
    # action is a backward, which must still reach rank 0 (zero-bubble may end on a W instead).
    lower = max(sum(work[:k]) + m * work[k] for k in range(len(work)))
    lower_zb = max(sum(forward[:k]) + m * work[k] for k in range(len(work)))
    for schedule, bound in (("gpipe", lower), ("1f1b", lower), ("zero-bubble", lower_zb)):
        t = simulate(schedule, forward, backward, m).makespan_s
        assert t >= bound * (1 - 1e-9) and t >= m * max(work) * (1 - 1e-9)
    # GPipe: two flow shops, exact.
    assert simulate("gpipe", forward, backward, m).makespan_s == pytest.approx(
        iteration_time_s("gpipe", forward, backward, m), rel=1e-9)
    # 1F1B on non-uniform stages has no exact closed form: Alpa's sum + (m-1) max is neither an
    # upper nor a lower bound (hypothesis found forward [1, 2, 3, .25], backward [1, 4, 3, .25],
    # m = 2: simulated 21.0 against 20.5), so only the lower bounds above are asserted.


def test_proportional_stages_match_alpa_form_exactly():
    # b proportional to f: one stage is slowest in f, b and f + b, so GPipe meets Alpa's form.
    forward = [0.3, 1.1, 0.7, 0.9]
    backward = [2 * f for f in forward]
    work = [3 * f for f in forward]
    for m in (1, 4, 9):
        alpa = sum(work) + (m - 1) * max(work)
        assert simulate("gpipe", forward, backward, m).makespan_s == pytest.approx(alpa, rel=1e-9)
        assert iteration_time_s("1f1b", forward, backward, m) == pytest.approx(alpa, rel=1e-9)


@pytest.mark.parametrize(("schedule", "v"), [("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2), ("zero-bubble", 1)])
def test_p2p_latency(schedule, v):
    p, m, p2p_s = 4, 8, 0.1
    f, b = uniform(p, v)
    t = simulate(schedule, f, b, m, v, p2p_s=p2p_s).makespan_s
    closed = iteration_time_s(schedule, f, b, m, v, p2p_s=p2p_s)
    assert closed == pytest.approx(iteration_time_s(schedule, f, b, m, v) + 2 * (p * v - 1) * p2p_s)
    if schedule in ("gpipe", "interleaved-1f1b"):
        assert t == pytest.approx(closed, rel=1e-9)
    else:  # only p micro-batches in flight: every round trip's latency stretches the steady state
        assert closed <= t <= closed + m * 2 * (p - 1) * p2p_s / p


def test_actions_are_data_with_torch_string_form():
    actions = schedule_actions("1f1b", 2, 3)
    assert [" ".join(action_name(a) for a in rank) for rank in actions] == [
        "0F0 0F1 0BW0 0F2 0BW1 0BW2", "1F0 1BW0 1F1 1BW1 1F2 1BW2"]
    for rank_actions in schedule_actions("zero-bubble", 3, 4):  # one F, one B, one W per micro-batch
        assert sorted(k for k, _, _ in rank_actions) == sorted(["F", "B", "W"] * 4)
    for rank, rank_actions in enumerate(schedule_actions("interleaved-1f1b", 2, 4, 2)):
        assert {c % 2 for _, c, _ in rank_actions} == {rank}  # looping placement


def test_every_schedule_completes_every_action():
    for schedule, (p, m, v) in itertools.product(SCHEDULES, [(1, 1, 1), (2, 4, 2), (4, 8, 2), (3, 6, 3)]):
        v = v if schedule in ("interleaved-1f1b", "zero-bubble") else 1
        f, b = uniform(p, v)
        timeline = simulate(schedule, f, b, m, v)
        assert len(timeline.events) == sum(len(a) for a in schedule_actions(schedule, p, m, v))
        assert 0 <= timeline.bubble_fraction() < 1


def test_deadlock_reports_the_grid(monkeypatch):
    import planner.cost.simulator as simulator

    bad = [[("F", 0, 0), ("BW", 0, 0)], [("BW", 1, 0), ("F", 1, 0)]]  # rank 1 backs up before its forward
    monkeypatch.setattr(simulator, "schedule_actions", lambda *args: bad)
    with pytest.raises(ValueError, match=r"deadlocks[\s\S]*rank 1: \[1BW0\] 1F0"):
        simulator.simulate("1f1b", [1.0, 1.0], [2.0, 2.0], 1)


def test_gantt_png_is_written(tmp_path):
    f, b = uniform(4, 2)
    for schedule, v in (("interleaved-1f1b", 2), ("zero-bubble", 2)):
        path = draw_gantt(simulate(schedule, f, b, 8, v), tmp_path / f"{schedule}.png")
        assert path.exists() and path.stat().st_size > 1000
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(("call", "message"), [
    (lambda: iteration_time_s("interleaved-1f1b", *uniform(4, 2), 6, 2), "multiple of the pipeline ranks"),
    (lambda: simulate("interleaved-1f1b", *uniform(4, 2), 6, 2), "multiple of the pipeline ranks"),
    (lambda: bubble_fraction("pipedream", 4, 8), "unknown schedule 'pipedream'"),
    (lambda: simulate("1F1B", *uniform(2), 4), "unknown schedule"),
    (lambda: iteration_time_s("1f1b", [1.0, 1.0], [2.0], 4), "2 forward times but 1 backward"),
    (lambda: simulate("interleaved-1f1b", [1.0] * 5, [2.0] * 5, 4, 2), "do not split"),
    (lambda: iteration_time_s("gpipe", *uniform(2, 2), 4, 2), "one chunk per rank"),
    (lambda: in_flight_microbatches("1f1b", 4, 8, 4), "not a pipeline rank"),
    (lambda: simulate("1f1b", *uniform(2), 0), "positive"),
    (lambda: simulate("zero-bubble", *uniform(2), 4, backward_weight_fraction=1.5), "backward_weight_fraction"),
])
def test_invalid_input_raises_clear_error(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_forwards_first_only_where_every_forward_of_the_peak_precedes_the_first_backward():
    from planner.cost.schedules import forwards_first

    assert forwards_first("1f1b", 1, 1, 1.0) and not forwards_first("1f1b", 1, 2, 1.0)  # no pipeline: F0 B0 F1 B1
    assert forwards_first("gpipe", 4, 8, 8.0)
    # 1F1B: rank r warms up with min(m, p - r) forwards; all of them when m <= p - r.
    assert list(forwards_first("1f1b", 4, 3, [3.0, 3.0, 2.0, 1.0])) == [True, True, False, False]
    # Zero bubble runs input gradients between forwards (measured: examples/demo.py's plan).
    assert not forwards_first("zero-bubble", 2, 2, 2.0) and not forwards_first("interleaved-1f1b", 2, 2, 2.0)


def test_zero_bubble_peak_states():
    from planner.cost.schedules import PeakState as S
    from planner.cost.schedules import peak_states

    # torch's ZB1P on 2 ranks, 4 micro-batches (schedule_actions):
    #   rank 0: F0 F1 B0 W0 F2 B1 W1 ...   the first stage's whole backward is its W: nothing waits
    #   rank 1: F0 B0 F1 B1 W0 F2 B2 ...   after B2, two held, both B's without their W's, W0's gradients
    assert peak_states("zero-bubble", 2, 4, 0) == (S(2.0, 0.0, True),)
    assert peak_states("zero-bubble", 2, 4, 1) == (S(2.0, 2.0, True),)
    # Rank r runs its W's r steps late: r + 1 waiting at its peak of p in flight.
    assert [peak_states("zero-bubble", 4, 8, r) for r in range(4)] == [(S(4.0, p, True),) for p in (0.0, 2.0, 3.0, 4.0)]
    # Interleaved, in micro-batches through all of a rank's chunks: rank 0's later chunk splits.
    assert [peak_states("zero-bubble", 4, 16, r, 2)[0].pending for r in range(4)] == [0.5, 1, 1.5, 2]
    # m = p: the peak comes before any W made a gradient; a W holds them, but not the loss its B
    # freed. The first rank: both forwards first, then one held with the gradients.
    assert peak_states("zero-bubble", 2, 2, 1) == (S(2.0, 2.0, False), S(2.0, 2.0, True, loss=False))
    assert peak_states("zero-bubble", 2, 2, 0) == (S(2.0, 0.0, False), S(1.0, 0.0, True))
    # The other schedules: one state, the gradients held unless every forward comes first.
    # Forwards first: the peak of micro-batches, and right after the first backward one fewer with
    # the gradients it made.
    assert peak_states("1f1b", 4, 3, 0) == (S(3.0, 0.0, False), S(2.0, 0.0, True))
    assert peak_states("1f1b", 4, 8, 0) == (S(4.0, 0.0, True),)
    assert peak_states("gpipe", 4, 8, 2) == (S(8.0, 0.0, False), S(7.0, 0.0, True))
    assert peak_states("interleaved-1f1b", 4, 8, 0, 2) == (S(5.5, 0.0, True),)


def test_zero_bubble_stage_run_with_its_whole_backward():
    # A later stage holding a trained unit fed no floating-point tensor (a decoder's token
    # embedding) runs its whole backward at B (runtime/pp_split.py needs_full_backward): its
    # micro-batch is freed there and nothing waits for a W, as on 1F1B's last rank.
    from planner.cost.schedules import PeakState as S
    from planner.cost.schedules import peak_states

    assert peak_states("zero-bubble", 2, 2, 1, whole_chunks=frozenset({1})) == (S(1.0, 0.0, True),)
    assert peak_states("zero-bubble", 2, 4, 1, whole_chunks=frozenset({1})) == (S(1.0, 0.0, True),)
    assert peak_states("zero-bubble", 2, 4, 1) == (S(2.0, 2.0, True),)  # split: two held, both waiting
    assert peak_states("zero-bubble", 2, 4, 0, whole_chunks=frozenset({1})) == peak_states("zero-bubble", 2, 4, 0)  # another rank's


@settings(max_examples=200)
@given(st.lists(st.tuples(st.integers(0, 6), st.integers(0, 6), st.booleans(), st.booleans()), max_size=40, unique=True))
def test_uncovered_moments_match_every_pair_compared(moments):
    """The zero-bubble peak states keep the moments no other covers; the sorted sweep
    (`_uncovered`) keeps what comparing every pair keeps, in the same order."""
    from planner.cost.schedules import PeakState, _uncovered

    states = [PeakState(h, q, g, loss=loss) for h, q, g, loss in moments]
    expected = [m for m, s in zip(moments, states, strict=True) if not any(o != s and o.covers(s) for o in states)]
    assert _uncovered(moments) == expected


@pytest.mark.parametrize("p, m, v, whole", [(2, 4, 1, ()), (4, 8, 2, (5,)), (4, 32, 3, ()), (8, 64, 2, (9, 12))])
def test_zero_bubble_peak_states_are_the_uncovered_moments_of_its_actions(p, m, v, whole):
    """The peak states are the moments of torch's zero-bubble order, played action by action as
    `peak_states` documents, that no other moment covers: checked against every moment compared
    with every other."""
    from planner.cost.schedules import PeakState, peak_states

    for rank, actions in enumerate(schedule_actions("zero-bubble", p, m, v)):
        held = pending = 0
        made = False
        states = []
        for kind, chunk, _ in actions:
            first, whole_chunk = chunk == 0, chunk in whole and chunk != 0
            if kind == "F":
                held += 1
                states.append(PeakState(held / v, pending / v, made))
            elif (kind == "B" and whole_chunk) or (kind == "W" and first):
                states.append(PeakState(held / v, pending / v, made))
                held, made = held - 1, True
            elif kind == "B" and not first:
                pending += 1
                states.append(PeakState(held / v, pending / v, made))
            elif kind == "W" and not whole_chunk and not first:
                states.append(PeakState(held / v, pending / v, True, loss=False))
                held, pending, made = held - 1, pending - 1, True
        unique = list(dict.fromkeys(states))
        expected = tuple(s for s in unique if not any(o != s and o.covers(s) for o in unique))
        assert peak_states("zero-bubble", p, m, rank, v, frozenset(whole)) == expected


@pytest.mark.parametrize("p", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("v", [1, 2, 3])
def test_zero_bubble_least_in_flight_is_the_played_schedules(p, v):
    """The memory bounds' closed form for zero bubble with every later stage's backward whole
    (`zero_bubble_least_in_flight`) is the most `peak_states` finds, playing the schedule, at
    every micro-batch count torch accepts."""
    from planner.cost.schedules import peak_states, zero_bubble_least_in_flight
    from planner.cost.simulator import check_schedule

    every = frozenset(range(1, p * v))
    for m in range(1, 41):
        try:
            check_schedule("zero-bubble", p, m, v)
        except Exception:  # noqa: BLE001 - a count the schedule refuses
            continue
        for rank in range(p):
            played = max(s.in_flight for s in peak_states("zero-bubble", p, m, rank, v, every))
            assert zero_bubble_least_in_flight(p, m, rank, v) == played, (m, rank)


@pytest.mark.parametrize("p", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("v", [1, 2, 3])
def test_zero_bubble_held_with_gradients_is_below_every_placement(p, v):
    """`zero_bubble_least_held_with_gradients` (the memory bounds' count beside the gradients) is at
    most the most micro-batches a played rank holds at a moment its gradients exist, whichever
    later stages run their whole backward at B (none, every one, the last), and with more
    micro-batches than ranks it is the peak itself."""
    from planner.cost.schedules import peak_states, zero_bubble_least_held_with_gradients, zero_bubble_least_in_flight
    from planner.cost.simulator import check_schedule

    placements = {frozenset(), frozenset(range(1, p * v)), frozenset({p * v - 1}) - {0}}
    for m in range(1, 3 * p + 3):
        try:
            check_schedule("zero-bubble", p, m, v)
        except Exception:  # noqa: BLE001 - a count the schedule refuses
            continue
        for rank in range(p):
            least = zero_bubble_least_held_with_gradients(p, m, rank, v)
            for whole in placements:
                held = max((s.in_flight for s in peak_states("zero-bubble", p, m, rank, v, whole) if s.gradients), default=0.0)
                assert least <= held + 1e-12, (m, rank, sorted(whole))
            if m > p:
                assert least == zero_bubble_least_in_flight(p, m, rank, v)
