"""PipeDream-2BW without a flush (runtime/pp_async.py `train_flush_free`): the schedule's order and
its two weight versions, and parity with the 2BW reference over the layouts it runs."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from planner.plan import Layout, Training, flush_free_blocker
from runtime.pp_async import flush_free_actions
from tests.runtime_plans import GPT_TP, make_2bw_plan
from tests.test_runtime_checkpoint import check_resume_matches_reference
from tests.test_runtime_parity import check_parity
from tests.test_tied_stages import TIED_GPT

# --- the schedule -------------------------------------------------------------------------------


def _run(pp: int, m: int, steps: int, synchronized: bool) -> list[list[tuple[str, int]]]:
    """Execute every stage's actions as the ranks would, blocking on what an action needs; returns
    the order in which actions completed per stage, or fails on a deadlock. Needs: forward (s, g)
    forward (s - 1, g); backward (s, g) backward (s + 1, g) and forward (s, g); an update is a
    collective of all stages when `synchronized` (else of the stage alone)."""
    lists = [[(a.kind, a.index) for a in flush_free_actions(s, pp, m, steps, synchronized)] for s in range(pp)]
    done: list[set] = [set() for _ in range(pp)]
    at = [0] * pp
    order: list[list[tuple[str, int]]] = [[] for _ in range(pp)]

    def ready(s: int, kind: str, i: int) -> bool:
        if kind == "F":
            return s == 0 or ("F", i) in done[s - 1]
        if kind == "B":
            return ("F", i) in done[s] and (s == pp - 1 or ("B", i) in done[s + 1])
        return not synchronized or all(at[r] < len(lists[r]) and lists[r][at[r]] == ("U", i) for r in range(pp))

    while any(at[s] < len(lists[s]) for s in range(pp)):
        moved = False
        for s in range(pp):
            if at[s] < len(lists[s]) and ready(s, *lists[s][at[s]]):
                kind, i = lists[s][at[s]]
                if kind == "U" and synchronized:  # every stage passes the collective together
                    for r in range(pp):
                        done[r].add(("U", i)); order[r].append(("U", i)); at[r] += 1  # noqa: E702
                else:
                    done[s].add((kind, i)); order[s].append((kind, i)); at[s] += 1  # noqa: E702
                moved = True
        assert moved, f"deadlock at {[lists[s][at[s]] if at[s] < len(lists[s]) else None for s in range(pp)]}"
    return order


@settings(max_examples=60, deadline=None)
@given(pp=st.integers(2, 6), extra=st.integers(0, 4), steps=st.integers(1, 4), synchronized=st.booleans())
def test_flush_free_schedule_runs_and_keeps_two_versions(pp, extra, steps, synchronized):
    m = pp + extra  # 2BW needs m >= pp
    order = _run(pp, m, steps, synchronized)
    for s in range(pp):
        position = {a: k for k, a in enumerate(order[s])}
        for t in range(steps):
            last_backward = position[("B", (t + 1) * m - 1)]
            assert position[("U", t)] > last_backward  # the update sees the whole batch's gradient
            if t + 2 < steps:  # batch t + 2 runs on the version U(t) writes: not before it
                assert position[("F", (t + 2) * m)] > position[("U", t)]
        in_flight = max(sum(1 for a in order[s][:k] if a[0] == "F") - sum(1 for a in order[s][:k] if a[0] == "B")
                        for k in range(len(order[s]) + 1))
        assert in_flight == min(pp - s, m * steps)  # 1F1B's activation memory, not more


def test_flush_free_schedule_has_no_flush():
    """Stage 0 starts batch t + 1 before batch t's last backward: the pipeline does not drain
    between steps (a flushed schedule would run every backward of batch 0 first)."""
    pp, m = 4, 4
    order = [(a.kind, a.index) for a in flush_free_actions(0, pp, m, 2, synchronized=False)]
    assert order.index(("F", m)) < order.index(("B", m - 1))


def test_flush_free_blocker_names_what_runs_flushed():
    sync = Layout(pp_degree=2, schedule="1f1b")
    assert flush_free_blocker(sync, Training()) is None
    assert flush_free_blocker(Layout(pp_degree=2, dp_degree=2, tp_degree=2, schedule="pipedream-2bw"), Training()) is None
    blocked = flush_free_blocker(Layout(pp_degree=2, dp_degree=2, zero_stage=3, schedule="pipedream-2bw"), Training())
    assert blocked is not None and "zero_stage" in blocked


# --- parity with the 2BW reference (runtime/train.py `--reference` applies the same rule) --------

@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("layout", [dict(pp=4, m=4), dict(pp=2, tp=2, m=4, tp_plan=GPT_TP),
                                    dict(pp=2, m=5, recompute="full")],
                         ids=["pp4-m4", "pp2xtp2", "pp2-m5-recompute"])
def test_flush_free_2bw_matches_its_reference(layout, tmp_path):
    plan = make_2bw_plan(**layout)
    assert flush_free_blocker(plan.layout, plan.training) is None  # the flush-free executor runs it
    check_parity(plan, tmp_path)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_flush_free_2bw_with_a_tied_head_and_clipping(write_model, tmp_path):
    """The tie's copies and the global norm make every stage update at one time (`synchronized`)."""
    plan = make_2bw_plan(pp=2, dp=2, m=4)
    plan.model.file = str(write_model(TIED_GPT, "tied_gpt.py"))
    plan.training.grad_clip = 0.05  # far below the gradient norm: every step clips
    check_parity(plan, tmp_path)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_flush_free_2bw_resumes_with_both_versions(tmp_path):
    """3 steps flush-free under pp2 saved, 3 resumed flushed under dp2 (ZeRO-3): the reference's 6."""
    check_resume_matches_reference(make_2bw_plan(pp=2), make_2bw_plan(dp=2, zero=3, m=2), tmp_path)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_solved_2bw_plan_with_sequence_parallelism_runs_flush_free(tmp_path):
    """A solver plan (pp2 x tp2 with SP, the unmodified llama example): the stages send sequence-
    sharded activations, whose shapes the first message's header carries (runtime/pp_p2p.py)."""
    from planner.cluster import make_cluster
    from planner.profiler import profile_model
    from planner.solver.solve import Pins, solve
    from tests.conftest import EXAMPLES
    from tests.runtime_plans import LLAMA_ARGS

    profile = profile_model(str(EXAMPLES / "llama.py"), LLAMA_ARGS, [2], device="cpu", repeats=1)
    pins = Pins(pp=2, tp=2, dp=1, sequence_parallel=True, schedule="pipedream-2bw", micro_batch_size=2)
    plan = solve(profile, make_cluster(4, gpu="cpu"), 8, pins, allow_async=True)
    assert plan.layout.sequence_parallel and flush_free_blocker(plan.layout, plan.training) is None
    check_parity(plan, tmp_path)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_flush_free_2bw_with_expert_parallelism(tmp_path):
    """Experts over ep2 inside each stage of pp2 x dp2: the all-to-alls run inside the actions,
    in the same order on every rank of a stage; the expert gradients reduce over expert-dp."""
    from tests.test_runtime_ep import moe_plan

    plan = moe_plan(ep=2, pp=2, dp=2, m=4, schedule="pipedream-2bw")
    assert flush_free_blocker(plan.layout, plan.training) is None
    check_parity(plan, tmp_path)


def test_validate_holds_a_flush_free_plan_to_its_steady_state_bubble():
    """`planner validate`'s predicted bubble of a flush-free 2BW plan is the steady state's idle
    share (stages paced by the slowest), not a single batch's fill and drain."""
    from planner.cluster import make_cluster
    from planner.cost.simulator import simulate
    from planner.profiler import profile_model
    from planner.solver.solve import Pins, solve
    from planner.validate import predicted_bubble
    from tests.conftest import EXAMPLES

    gpt = dict(n_layers=8, d_model=1024, n_heads=16, d_ff=4096, vocab_size=32000, seq_len=1024)
    profile = profile_model(str(EXAMPLES / "gpt.py"), gpt, [1, 2], device="meta", gpu="a100-80gb", dtype="bfloat16")
    plan = solve(profile, make_cluster(8, gpu="a100-80gb"), 32, Pins(pp=4, dp=2, zero_stage=0, schedule="pipedream-2bw"),
                 allow_async=True)
    assert flush_free_blocker(plan.layout, plan.training) is None
    work = [f + b for f, b in zip(plan.search.stage_forward_s, plan.search.stage_backward_s, strict=True)]
    assert predicted_bubble(plan) == pytest.approx(1 - sum(work) / (len(work) * max(work)))
    one_batch = simulate("1f1b", plan.search.stage_forward_s, plan.search.stage_backward_s,
                         plan.batch.num_microbatches).bubble_fraction()
    assert predicted_bubble(plan) < one_batch
