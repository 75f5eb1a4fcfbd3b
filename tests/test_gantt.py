"""Gantt charts that scale (issue #17): bounded artists, stage/rank rows, the whole step on the axis.

The plans are written by hand (no solver) with uniform stage times, and their prediction is
built from the simulator's makespan so the once-per-step terms must end exactly at the
predicted iteration time. Figures are caught at savefig to inspect what was drawn; no
timings are asserted (benchmarks/gantt_speed.py measures those).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from matplotlib.figure import Figure

from planner.cost import gantt
from planner.cost.simulator import simulate
from planner.plan import (
    Batch,
    ClusterRef,
    Layout,
    ModelRef,
    Plan,
    Prediction,
    Stage,
    stage_ranks,
)
from planner.plan_report import draw_plan_gantt

DP_COMM_S, OPTIMIZER_S = 0.5, 0.25


def make_plan(pp: int, m: int, v: int = 1, dp: int = 2, tp: int = 2, schedule: str = "zero-bubble") -> Plan:
    """A pp*dp*tp-GPU plan with forward 0.01 s and backward 0.02 s per chunk and micro-batch."""
    lay = Layout(pp_degree=pp, dp_degree=dp, tp_degree=tp, schedule=schedule, virtual_stages=v)
    fwd, bwd = [0.01 / v] * (pp * v), [0.02 / v] * (pp * v)
    makespan = simulate(schedule, fwd, bwd, m, v).makespan_s
    iteration = makespan + DP_COMM_S + OPTIMIZER_S
    prediction = Prediction(
        iteration_time_s=iteration, samples_per_s=m / iteration, tflops_per_gpu=1.0, hw_tflops_per_gpu=1.0, mfu=0.5,
        bubble_fraction=0.1, peak_memory_bytes=[0] * (pp * v),
        breakdown_s={"compute": 0.03 * m, "tp_comm": 0.0, "p2p": 0.0, "bubble": makespan - 0.03 * m,
                     "dp_comm": DP_COMM_S, "tie_comm": 0.0, "optimizer": OPTIMIZER_S})
    return Plan(model=ModelRef(file="model.py"), cluster=ClusterRef(gpus_per_node=lay.world_size),
                batch=Batch(global_batch_size=m * dp, micro_batch_size=1, num_microbatches=m), layout=lay,
                stages=[Stage(units=[f"blocks.{k}"], ranks=stage_ranks(lay, k)) for k in range(pp * v)],
                prediction=prediction, search={"stage_forward_s": fwd, "stage_backward_s": bwd})


@pytest.fixture
def drawn(monkeypatch, tmp_path):
    """Draw a plan's Gantt chart and return the figure that was saved."""
    figures: list[Figure] = []
    save = Figure.savefig

    def keep(fig, *args, **kwargs):
        figures.append(fig)
        return save(fig, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", keep)

    def draw(plan: Plan) -> Figure:
        path = draw_plan_gantt(plan, tmp_path / "g.png")
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        return figures[-1]

    return draw


def artists(fig: Figure) -> int:
    """Everything drawn inside the axes: collections, patches, texts."""
    return sum(len(ax.collections) + len(ax.patches) + len(ax.texts) for ax in fig.axes)


def legend_text(fig: Figure) -> str:
    return " | ".join(t.get_text() for legend in fig.legends for t in legend.get_texts())


def test_artists_do_not_grow_with_microbatches(drawn):
    # 8 rows x 2048 micro-batches x 3 kinds is 49152 actions; one patch each was issue #17.
    counts = {m: artists(drawn(make_plan(pp=8, m=m))) for m in (128, 512, 2048)}
    assert max(counts.values()) - min(counts.values()) <= 8  # a label may fit in one more box per row, no more
    kinds = 3 + 1  # F, B, W and the merged bars: one collection per row and kind
    labels = 8  # at most the merged run's label plus a few wide edge boxes per row
    assert counts[2048] <= 8 * (kinds + labels) + 2 * 2  # + the two once-per-step segments and their labels


def test_small_plans_draw_every_action_and_say_nothing_was_aggregated(drawn):
    fig = drawn(make_plan(pp=4, m=8))
    assert "aggregated" not in legend_text(fig)
    boxes = sum(len(c.get_paths()) for c in fig.axes[0].collections)
    assert boxes == 4 * 8 * 3 + 2  # every F, B and W, then dp_comm and optimizer


def test_legend_says_when_microbatches_were_aggregated(drawn):
    text = legend_text(drawn(make_plan(pp=8, m=256)))
    assert f"first and before the last {gantt.EDGE_MICROBATCHES}" in text and "aggregated" in text


def test_rows_are_named_by_stage_and_ranks(drawn):
    ax = drawn(make_plan(pp=4, m=64, dp=2, tp=4)).axes[0]
    labels = [t.get_text() for t in ax.get_yticklabels()]
    assert labels == ["stage 0 (ranks 0-7)", "stage 1 (ranks 8-15)", "stage 2 (ranks 16-23)", "stage 3 (ranks 24-31)"]


def test_interleaved_rows_list_their_stages(drawn):
    ax = drawn(make_plan(pp=2, m=8, v=2, dp=1, tp=2, schedule="interleaved-1f1b")).axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["stages 0, 2 (ranks 0-1)", "stages 1, 3 (ranks 2-3)"]


def test_time_axis_ends_at_the_predicted_iteration_with_the_step_terms(drawn):
    plan = make_plan(pp=8, m=512)
    fig = drawn(plan)
    ax = fig.axes[0]
    end = plan.prediction.iteration_time_s
    assert ax.get_xlim()[1] == pytest.approx(end, rel=1e-12)
    # The last drawn box is the optimizer step, ending at the predicted iteration time.
    right = max(x0 + w for c in ax.collections for p in c.get_paths() for x0, w in [_span(p)])
    assert right == pytest.approx(end, rel=1e-12)
    text = legend_text(fig)
    assert "dp_comm 500 ms" in text and "optimizer 250 ms" in text and "tie_comm" in text


def test_measured_style_panels_still_draw(tmp_path):
    # planner/validate.py passes (timeline, title) pairs; predicted above measured.
    timeline = simulate("1f1b", [1.0] * 4, [2.0] * 4, 8)
    path = gantt.draw_gantts([(timeline, "predicted"), (timeline, "measured")], tmp_path / "v.png")
    assert path.stat().st_size > 1000


def _span(path) -> tuple[float, float]:
    xs = path.vertices[:, 0]
    return float(xs.min()), float(xs.max() - xs.min())


def test_long_stage_lists_are_elided_in_the_middle_unless_asked():
    """A plan with more stages (chunks) than `STAGE_ROWS` lists the first and last ones, one elided
    row between them and a caption saying how to see them all; `all_stages` lists every one."""
    import io

    from rich.console import Console

    from planner.plan_report import STAGE_ROWS, print_plan, shown_stages

    assert shown_stages(STAGE_ROWS) == list(range(STAGE_ROWS))
    shown = shown_stages(96)
    assert shown.count(None) == 1 and len(shown) == STAGE_ROWS + 1 and shown[0] == 0 and shown[-1] == 95
    plan = make_plan(pp=8, m=16, v=6, schedule="interleaved-1f1b")
    assert len(plan.stages) == 48

    def printed(**kwargs) -> str:
        out = io.StringIO()
        print_plan(plan, Console(file=out, width=250), **kwargs)
        return out.getvalue()

    short, full = printed(), printed(all_stages=True)
    assert "24 of 48 stages elided: planner show PLAN --all-stages" in short and "elided" not in full
    assert "│    47 │" in short and "│    30 │" not in short and "│    30 │" in full


def test_the_overlapped_reduction_runs_on_a_communication_lane(drawn):
    # Zero bubble's ZeRO 0 reduces after each rank's last weight pass (grad_ready "step"), all of
    # it exposed: the lane runs past the schedule by the reduction, and dp_comm has nothing left
    # to draw after it, so the optimizer still ends at the predicted iteration time.
    reduce_s = 0.05
    plan = make_plan(pp=2, m=4)
    makespan = plan.prediction.iteration_time_s - DP_COMM_S - OPTIMIZER_S
    plan.prediction.breakdown_s["dp_comm"] = reduce_s
    plan.prediction.iteration_time_s = makespan + reduce_s + OPTIMIZER_S
    plan.search.rank_grad_reduce_s, plan.search.grad_reduce_buckets = [reduce_s] * 2, [4, 4]
    plan.search.grad_reduce_ready = "step"
    fig = drawn(plan)
    ax = fig.axes[0]
    lane = [c for c in ax.collections if tuple(c.get_facecolor()[0][:3]) == _rgb(gantt.COMM_COLOR)]
    buckets = [_span(p) for c in lane for p in c.get_paths()]
    assert len(buckets) == 8  # 4 buckets on each rank's stream
    assert min(x0 for x0, _ in buckets) >= makespan - 0.03 - 1e-12  # none before a rank's last action
    assert max(x0 + w for x0, w in buckets) == pytest.approx(makespan + reduce_s, rel=1e-12)
    right = max(x0 + w for c in ax.collections for p in c.get_paths() for x0, w in [_span(p)])
    assert right == pytest.approx(plan.prediction.iteration_time_s, rel=1e-12)
    text = legend_text(fig)
    assert gantt.COMM_LABEL in text and "dp_comm (rest) 0 ms" in text


def test_a_solved_plan_records_its_reduction_stream_and_its_gantt_adds_up():
    # One stage, data parallel over two nodes: the bucketed reduction under the backward is what
    # the closed form prices (tests/test_overlap.py), so the lane's tail is the dp_comm term.
    from planner.cluster import make_cluster
    from planner.cost.overlap import SERIAL
    from planner.plan_report import after_schedule_terms, simulated_timeline
    from planner.profiler import profile_model
    from planner.solver.solve import Pins, solve

    prof = profile_model("examples/gpt.py", dict(n_layers=4, d_model=1024, n_heads=16, d_ff=4096, vocab_size=32000,
                                                 seq_len=1024), [2], device="meta", gpu="a100-80gb", dtype="bfloat16")
    pins = Pins(pp=1, tp=1, dp=16, micro_batch_size=2, zero_stage=0, recompute="none")
    plan = solve(prof, make_cluster(16, 8, "a100-80gb"), 32, pins, top_k=1, dtype="bfloat16")
    search = plan.search
    assert search.grad_reduce_ready == "backward" and search.grad_reduce_buckets[0] > 1
    timeline = simulated_timeline(plan)
    assert sum(e.end_s - e.start_s for e in timeline.comm_events) == pytest.approx(search.rank_grad_reduce_s[0])
    lane_s = timeline.step_s - timeline.makespan_s
    assert lane_s == pytest.approx(plan.prediction.breakdown_s["dp_comm"], rel=1e-9)
    after = dict(after_schedule_terms(plan, timeline.makespan_s, lane_s))
    assert after["dp_comm (rest)"] == 0.0
    serial = solve(prof, make_cluster(16, 8, "a100-80gb"), 32, replace(pins, overlap=SERIAL), top_k=1, dtype="bfloat16")
    assert serial.search.rank_grad_reduce_s is None and simulated_timeline(serial).comm_events == ()


@pytest.mark.parametrize("dimension", ["ep", "cp"])
def test_token_collectives_are_inside_the_schedule_and_the_terms_add_up(dimension):
    """EP's all-to-alls and CP's K/V gathers run in every micro-batch: they are in the stage times
    the schedule is simulated on, not once per step after it, and the schedule plus the terms after
    it make the predicted iteration."""
    from planner.cluster import make_cluster
    from planner.cost.overlap import SERIAL
    from planner.plan_report import after_schedule_terms, simulated_timeline
    from planner.profiler import profile_model
    from planner.solver.solve import Pins, solve

    if dimension == "ep":
        model, args = "examples/moe.py", dict(n_layers=4, d_model=256, n_heads=4, vocab_size=256, seq_len=128, num_experts=8,
                                               top_k=2, moe_d_ff=512)
        pins = Pins(pp=2, tp=1, dp=4, ep=4, micro_batch_size=1, zero_stage=1, recompute="none", schedule="1f1b",
                    overlap=SERIAL)
    else:
        model, args = "examples/llama.py", dict(n_layers=4, d_model=256, n_heads=4, n_kv_heads=2, d_ff=512, vocab_size=256,
                                                 seq_len=256)
        pins = Pins(pp=2, tp=1, dp=4, cp=2, cp_algorithm="all-gather", micro_batch_size=1, zero_stage=1, recompute="none",
                    schedule="1f1b", overlap=SERIAL)
    prof = profile_model(model, args, [1], device="meta", gpu="h100-80gb", dtype="bfloat16")
    plan = solve(prof, make_cluster(8, 4, "h100-80gb"), 16, pins, top_k=1, dtype="bfloat16")
    term = f"{dimension}_comm"
    assert plan.prediction.breakdown_s[term] > 0
    timeline = simulated_timeline(plan)
    after = dict(after_schedule_terms(plan, timeline.makespan_s))
    assert term not in after
    assert timeline.makespan_s + sum(after.values()) == pytest.approx(plan.prediction.iteration_time_s, rel=1e-6)


def _rgb(color: str) -> tuple[float, float, float]:
    from matplotlib.colors import to_rgb

    return to_rgb(color)
