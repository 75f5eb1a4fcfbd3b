"""`planner validate` compares like with like: the pipeline bubble as the idle share of the
pipeline's makespan on both sides, and peak memory as tensor bytes on both sides."""

from __future__ import annotations

import pytest
import torch

from planner.cost.simulator import simulate
from planner.plan import Prediction, SearchReport, load_plan
from planner.validate import compare, predicted_bubble
from runtime.metrics import build_metrics, timeline_of
from tests.conftest import ROOT

FORWARD_S, BACKWARD_S, MICROBATCHES = [1.0, 1.5], [2.0, 2.5], 4


def _plan(stage_times: bool = True, bubble_fraction: float = 0.05):
    """tests/plans/gpt_pp2.json with a prediction: per-stage times as the solver records them, and
    a whole-iteration bubble figure unlike the makespan share (as the solver's would be)."""
    plan = load_plan(ROOT / "tests" / "plans" / "gpt_pp2.json")
    plan = plan.model_copy(update={"batch": plan.batch.model_copy(update={
        "num_microbatches": MICROBATCHES, "global_batch_size": plan.batch.micro_batch_size * MICROBATCHES})})
    prediction = Prediction(iteration_time_s=20.0, samples_per_s=1.0, tflops_per_gpu=1.0, hw_tflops_per_gpu=1.0, mfu=0.1,
                            bubble_fraction=bubble_fraction, peak_memory_bytes=[3_000_000, 2_000_000],
                            stage_time_s=[f + b for f, b in zip(FORWARD_S, BACKWARD_S, strict=True)], breakdown_s={})
    search = SearchReport(stage_forward_s=FORWARD_S, stage_backward_s=BACKWARD_S) if stage_times else None
    return plan.model_copy(update={"prediction": prediction, "search": search})


def _metrics_file(plan, path, peak_tensor_bytes=None, shift_s: float = 0.0):
    """A run whose last step went exactly as the simulator plays the plan (its stage times), with
    rank 1's actions `shift_s` later (a slower measured pipeline)."""
    sim = simulate(plan.layout.schedule, FORWARD_S, BACKWARD_S, MICROBATCHES)
    wall = 1.7e9
    events = [[(e.kind, e.chunk, e.microbatch, wall + e.start_s + shift_s * r, wall + e.end_s + shift_s * r)
               for e in sim.events if e.rank == r] for r in range(2)]
    run = build_metrics(plan, [1.0, 0.9], [0.5, 0.4], [400_000_000, 400_000_000], {}, {}, world_size=2,
                        timeline=timeline_of(events, plan.layout.schedule, 2), peak_tensor_bytes=peak_tensor_bytes)
    return run.metrics.save(path), sim


def _row(rows, prefix: str):
    return next(r for r in rows if r[0].startswith(prefix))


def test_bubble_is_the_idle_share_of_the_makespan_on_both_sides(tmp_path):
    plan = _plan()
    path, sim = _metrics_file(plan, tmp_path / "m.json")
    _, predicted, measured, kind = _row(compare(plan, path), "pipeline bubble")
    # The run went exactly as simulated, so the two figures are one number computed twice (exact).
    assert predicted == pytest.approx(measured, abs=1e-12) == sim.bubble_fraction()
    assert kind == "share" and predicted != pytest.approx(plan.prediction.bubble_fraction)
    # A slower run (rank 1 waits longer) shows a larger measured bubble against the same prediction.
    path, _ = _metrics_file(plan, tmp_path / "late.json", shift_s=3.0)
    _, predicted_again, later, _ = _row(compare(plan, path), "pipeline bubble")
    assert predicted_again == predicted and later > measured


def test_bubble_has_no_prediction_without_stage_times(tmp_path):
    plan = _plan(stage_times=False)
    assert predicted_bubble(plan) is None
    path, _ = _metrics_file(plan, tmp_path / "m.json")
    assert _row(compare(plan, path), "pipeline bubble")[1] is None


def test_peak_memory_compares_tensor_bytes_when_measured(tmp_path):
    plan = _plan()
    path, _ = _metrics_file(plan, tmp_path / "m.json", peak_tensor_bytes=[3_100_000, 1_900_000])
    term, predicted, measured, kind = _row(compare(plan, path), "peak tensor memory")
    assert (predicted, measured, kind) == (3_000_000, 3_100_000, "bytes")
    # Without a tensor peak the process peak is shown, named as such, never as the tensor figure.
    path, _ = _metrics_file(plan, tmp_path / "old.json")
    rows = compare(plan, path)
    assert not any(r[0].startswith("peak tensor memory") for r in rows)
    assert _row(rows, "process peak memory" if not torch.cuda.is_available() else "peak memory")[2] == 400_000_000


def test_an_interleaved_rank_is_held_to_its_stages_together(tmp_path):
    """With virtual stages a GPU holds v chunks: the predicted peak `planner validate` sets
    beside a rank's measured one is the sum of its chunks' (stage k on rank k mod pp), not the
    largest chunk's (BERT under interleaved zero bubble was shown -32% so, +7% summed)."""
    from planner.cluster import make_cluster
    from planner.plan import rank_peak_bytes
    from planner.profiler import profile_model
    from planner.solver.solve import Pins, solve

    args = dict(n_layers=4, d_model=64, n_heads=4, d_ff=256, vocab_size=128, seq_len=32)
    profile = profile_model(str(ROOT / "examples" / "gpt.py"), args, [2], device="meta", gpu="a100-80gb")
    plan = solve(profile, make_cluster(2, gpu="a100-80gb"), 8,
                 Pins(pp=2, dp=1, tp=1, micro_batch_size=2, schedule="interleaved-1f1b", virtual_stages=2, recompute="none"))
    chunks = plan.prediction.peak_memory_bytes
    assert len(chunks) == 4
    assert rank_peak_bytes(plan) == [chunks[0] + chunks[2], chunks[1] + chunks[3]]
    run = build_metrics(plan, [1.0, 0.9], [0.5, 0.4], [0, 0], {}, {}, world_size=2, peak_tensor_bytes=[100, 200])
    _, predicted, measured, _ = _row(compare(plan, run.metrics.save(tmp_path / "m.json")), "peak tensor memory")
    assert (predicted, measured) == (max(chunks[0] + chunks[2], chunks[1] + chunks[3]), 200)
    # Under full recomputation a rank's chunks rebuild one unit at a time: their states and
    # activations together, the larger of their transients, not the sum.
    full = solve(profile, make_cluster(2, gpu="a100-80gb"), 8,
                 Pins(pp=2, dp=1, tp=1, micro_batch_size=2, schedule="interleaved-1f1b", virtual_stages=2, recompute="full"))
    chunks, terms = full.prediction.peak_memory_bytes, full.prediction.memory_terms_bytes
    for rank in (0, 1):
        mine = (rank, rank + 2)
        assert min(terms[k]["transient"] for k in mine) > 0
        assert max(chunks[k] for k in mine) < rank_peak_bytes(full)[rank] < sum(chunks[k] for k in mine)
    # A plan written before the rank peaks were recorded sums its chunks.
    old = full.model_copy(deep=True)
    old.prediction.pipeline_rank_peak_bytes = None
    assert rank_peak_bytes(old) == [chunks[0] + chunks[2], chunks[1] + chunks[3]]
