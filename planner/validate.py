"""Predicted (the plan) against measured (a run's metrics JSON), term by term.

Each row compares one quantity computed the same way on both sides:
- peak memory: the plan's per-stage tensor peak (planner/cost/memory.py `StageMemory.tensor_bytes`)
  against the run's tensor peak (`Metrics.peak_tensor_bytes`, runtime/metrics.py
  `TensorPeakMeter`), both the maximum over ranks; a run without it (older, or measured
  with the profiler off) shows its process peak instead (RSS on CPU), marked as not comparable.
- pipeline bubble: the idle share of the pipeline's makespan, 1 - mean busy time of the
  pipeline ranks / makespan (planner/cost/simulator.py `Timeline.bubble_fraction`), for the
  prediction the plan's schedule simulated on its predicted stage times (`predicted_bubble`),
  for the run its measured last step (`timeline_from_metrics`). `Prediction.bubble_fraction`
  is another quantity (bubble seconds over the whole iteration, optimizer and gradient
  reduction included) and is not compared.
"""

from __future__ import annotations

import hashlib
import math
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console
from rich.table import Table

from planner.errors import PlannerError
from planner.metrics_schema import Metrics, load_metrics
from planner.plan import Plan, rank_peak_bytes
from planner.report import format_bytes, format_time

if TYPE_CHECKING:
    from planner.cost.gantt import Panel
    from planner.cost.simulator import Timeline

Row = tuple[str, float | None, float | None, str]
"""A row of `compare`: (term, predicted, measured, kind of quantity)."""


def plan_digest(plan: Plan) -> str:
    """SHA-256 of what a run executes and what it is held against (the plan less the solver's
    statistics): the same plan file always gives the same digest, another plan another one.
    Fields left at their defaults are not hashed, so a field a later version adds with a default
    does not change the digest of the plans written before it."""
    return hashlib.sha256(plan.model_dump_json(exclude={"search"}, exclude_defaults=True).encode()).hexdigest()


def check_metrics_match(plan: Plan, metrics: Metrics, metrics_path: str | Path, plan_path: str | Path = "the plan") -> None:
    """Refuse metrics recorded by another plan: their comparison would be meaningless."""
    if metrics.plan_sha256 is not None:
        same = metrics.plan_sha256 == plan_digest(plan)
    else:  # metrics of an older run: the prediction and world size it recorded must agree
        same = metrics.world_size == plan.world_size and (
            metrics.prediction is None or plan.prediction is None
            or _same_numbers(metrics.prediction.model_dump(), plan.prediction.model_dump()))
    if not same:
        ran = f" (it ran {metrics.plan})" if metrics.plan else ""
        raise PlannerError(f"{metrics_path} was recorded by another plan than {plan_path}{ran}: its plan fingerprint "
                           f"differs, so a comparison would be meaningless.",
                           "Pass the plan file the run executed, or run this plan with `planner run PLAN --output FILE`.")


def _same_numbers(a, b) -> bool:
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same_numbers(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same_numbers(x, y) for x, y in zip(a, b, strict=False))
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return math.isclose(a, b, rel_tol=1e-9, abs_tol=0.0) or a == b
    return a == b


def compare(plan: Plan, metrics_path: str | Path, plan_path: str | Path = "the plan") -> list[Row]:
    """Rows (term, predicted, measured, kind) for what both sides have; another plan's metrics are refused."""
    metrics = load_metrics(metrics_path)
    check_metrics_match(plan, metrics, metrics_path, plan_path)
    pred = plan.prediction
    rows: list[Row] = [("iteration time", pred.iteration_time_s if pred else None, metrics.median_iteration_time_s, "time"),
            ("samples/s", pred.samples_per_s if pred else None, metrics.samples_per_s, "rate")]
    predicted_peak = max(rank_peak_bytes(plan), default=None)
    if metrics.peak_tensor_bytes:
        rows.append(("peak tensor memory (max over ranks)", predicted_peak, max(metrics.peak_tensor_bytes), "bytes"))
    elif peaks := [p for p in metrics.peak_memory_bytes if p]:
        what = "process peak memory (RSS)" if metrics.cpu_threads is not None else "peak memory (max allocated)"
        rows.append((f"{what}, max over ranks", predicted_peak, max(peaks), "bytes"))
    measured_timeline = timeline_from_metrics(metrics)
    if measured_timeline is not None:
        rows.append(("pipeline bubble (idle share of makespan)", predicted_bubble(plan), measured_timeline.bubble_fraction(), "share"))
    measured_stages = metrics.stage_times_s
    predicted_stages = pred.stage_time_s if pred else []
    for k in range(max(len(predicted_stages), len(measured_stages))):
        t = measured_stages.get(k)
        if t is not None or k < len(predicted_stages):
            rows.append((f"stage {k} fwd+bwd per micro-batch", predicted_stages[k] if k < len(predicted_stages) else None,
                         t.forward_s + t.backward_s if t else None, "time"))
    return rows


def print_comparison(rows, console: Console | None = None) -> None:
    console = console or Console()
    table = Table(title="Predicted vs measured")
    for col in ("term", "predicted", "measured", "error"):
        table.add_column(col, justify="left" if col == "term" else "right")
    fmt = {"time": format_time, "bytes": format_bytes, "rate": lambda x: f"{x:.4g}", "share": lambda x: f"{x:.1%}"}
    for term, predicted, measured, kind in rows:
        if kind == "share":  # a share's error is the difference in points, not a ratio
            error = f"{(predicted - measured) * 100:+.1f} pt" if predicted is not None and measured is not None else "-"
        else:
            error = f"{predicted / measured - 1:+.1%}" if predicted and measured else "-"
        table.add_row(term, fmt[kind](predicted) if predicted is not None else "-",
                      fmt[kind](measured) if measured is not None else "-", error)
    console.print(table)
    if any(term.startswith("stage 1 ") for term, *_ in rows):
        console.print("A predicted stage time includes the stage's p2p and the pipeline's per-micro-batch overhead "
                      "(the cluster's pipeline_overhead_s); a run shows those as gaps between its actions, in the bubble.")
    if any(term.startswith("process peak memory") for term, *_ in rows):
        console.print("This run recorded no tensor peak: its peak memory on CPU is the process's resident set "
                      "(interpreter and torch included), not comparable with the prediction's tensors-only figure.")


def predicted_bubble(plan: Plan) -> float | None:
    """The plan's pipeline bubble as `planner validate` measures a run's: the idle share of the
    pipeline's makespan (`Timeline.bubble_fraction`), from the plan's schedule simulated on its
    predicted per-stage times (which hold the stage's p2p and per-micro-batch overhead, so they
    are not idle time here; a run shows those as gaps). None without predicted stage times
    (a hand-written plan, or one solved before they were recorded). A pipedream-2bw plan the
    runtime runs without a flush: the steady state's idle share."""
    from planner.cost.schedules import weight_split
    from planner.cost.simulator import simulate
    from planner.plan import flush_free_blocker

    search = plan.search
    forward, backward = (search.stage_forward_s, search.stage_backward_s) if search else (None, None)
    if plan.prediction is None or not forward or not backward:
        return None
    lay = plan.layout
    if lay.schedule == "pipedream-2bw" and flush_free_blocker(lay, plan.training) is None:
        # Without a flush the steady state is paced by the slowest stage (planner/cost/schedules.py):
        # the others idle for the difference, and no fill or drain is left to count.
        work = [f + b for f, b in zip(forward, backward, strict=True)]
        return 1 - sum(work) / (len(work) * max(work)) if max(work) > 0 else 0.0
    return simulate(lay.schedule, forward, backward, plan.batch.num_microbatches, lay.virtual_stages,
                    backward_weight_fraction=weight_split(plan)).bubble_fraction()


def timeline_from_metrics(metrics: Metrics):
    """The measured pipeline timeline a pipelined run recorded (runtime/metrics.py), or None."""
    from planner.cost.simulator import Event, Timeline, peak_in_flight

    measured = metrics.timeline
    if measured is None or not measured.events:
        return None
    events = tuple(sorted((Event(e.rank, e.chunk, e.microbatch, e.kind, e.start_s, e.end_s) for e in measured.events),
                          key=lambda e: e.start_s))
    per_rank = [[(e.kind, e.chunk, e.microbatch) for e in events if e.rank == r] for r in range(measured.num_ranks)]
    return Timeline(measured.schedule, measured.num_ranks, events, max(e.end_s for e in events), tuple(peak_in_flight(a) for a in per_rank))


def draw_validation_gantt(plan: Plan, metrics_path: str | Path, path: str | Path) -> Path:
    """The plan's simulated schedule above the run's measured last step, on one time axis."""
    from planner.cost.gantt import draw_gantts
    from planner.plan_report import simulated_timeline

    measured = timeline_from_metrics(load_metrics(metrics_path))
    if measured is None:
        raise PlannerError(f"{metrics_path} has no pipeline timeline (the plan was not pipelined, or the run is older).",
                           "Draw a measured Gantt chart of a plan with pp_degree > 1, run by this version.")
    lay = plan.layout
    what = f"{lay.schedule}, pp={lay.pp_degree}, m={plan.batch.num_microbatches}"
    panels: list[Panel | tuple[Timeline, str]] = [(measured, f"measured, last step ({what}): makespan {measured.makespan_s:.4g} s, bubble {measured.bubble_fraction():.1%}")]
    if plan.search is not None and plan.search.stage_forward_s:  # a hand-written plan has no predicted stage times
        simulated = simulated_timeline(plan)
        panels.insert(0, (simulated, f"predicted: makespan {simulated.makespan_s:.4g} s, bubble {simulated.bubble_fraction():.1%}"))
    return draw_gantts(panels, path)
