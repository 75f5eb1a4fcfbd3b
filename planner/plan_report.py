"""Human views of plan files: layout, stages, breakdown, alternatives; Gantt of the schedule."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.table import Table

from planner.plan import Plan
from planner.report import _bytes, _time


def _units_summary(units: list[str]) -> str:
    """`blocks.0-5` style ranges for runs of numbered siblings."""
    parts: list[str] = []
    run: list[tuple[str, int]] = []

    def flush() -> None:
        if run:
            prefix, first, last = run[0][0], run[0][1], run[-1][1]
            parts.append(f"{prefix}.{first}" if first == last else f"{prefix}.{first}-{last}")
            run.clear()

    for name in units:
        prefix, _, tail = name.rpartition(".")
        if tail.isdigit() and run and run[-1][0] == prefix and run[-1][1] + 1 == int(tail):
            run.append((prefix, int(tail)))
        elif tail.isdigit() and prefix:
            flush()
            run.append((prefix, int(tail)))
        else:
            flush()
            parts.append(name)
    flush()
    return ", ".join(parts)


def print_plan(plan: Plan, console: Console | None = None) -> None:
    console = console or Console()
    lay, batch = plan.layout, plan.batch
    head = Table(title=f"Plan for {plan.model.file} on {plan.cluster.num_nodes} x {plan.cluster.gpus_per_node} {plan.cluster.gpu}")
    for col in ("pp", "dp", "tp", "SP", "ZeRO", "schedule", "v", "p2p", "micro-batch", "micro-batches", "global batch", "dtype"):
        head.add_column(col)
    p2p = "-" if lay.pp_degree == 1 else ("tp slices" if lay.p2p_scatter_gather else "whole")
    head.add_row(str(lay.pp_degree), str(lay.dp_degree), str(lay.tp_degree), "yes" if lay.sequence_parallel else "no",
                 str(lay.zero_stage), lay.schedule, str(lay.virtual_stages), p2p, str(batch.micro_batch_size),
                 str(batch.num_microbatches), str(batch.global_batch_size), plan.training.dtype)
    console.print(head)
    pred = plan.prediction
    stages = Table(title="Stages")
    for col in ("stage", "units", "ranks", "recompute", "TP modules", "time / micro-batch", "peak memory"):
        stages.add_column(col, justify="left" if col in ("units", "ranks") else "right")
    for k, s in enumerate(plan.stages):
        t = _time(pred.stage_time_s[k]) if pred and k < len(pred.stage_time_s) else "-"
        m = _bytes(pred.peak_memory_bytes[k]) if pred and k < len(pred.peak_memory_bytes) else "-"
        stages.add_row(str(k), _units_summary(s.units), ",".join(map(str, s.ranks)), s.recompute, str(len(s.tp_plan)), t, m)
    console.print(stages)
    if pred is None:
        console.print("no prediction (hand-written plan)")
        return
    summary = Table(title="Prediction")
    for col in ("iteration", "samples/s", "tokens/s", "TFLOP/s/GPU", "HW TFLOP/s/GPU", "MFU", "bubble"):
        summary.add_column(col, justify="right")
    summary.add_row(_time(pred.iteration_time_s), f"{pred.samples_per_s:.4g}",
                    f"{pred.tokens_per_s:.4g}" if pred.tokens_per_s else "-", f"{pred.tflops_per_gpu:.3g}",
                    f"{pred.hw_tflops_per_gpu:.3g}", f"{pred.mfu:.1%}", f"{pred.bubble_fraction:.1%}")
    console.print(summary)
    breakdown = Table(title="Breakdown of the busiest pipeline rank (per iteration)")
    breakdown.add_column("term")
    breakdown.add_column("time", justify="right")
    breakdown.add_column("share", justify="right")
    total = sum(pred.breakdown_s.values()) or 1.0
    for term, value in pred.breakdown_s.items():
        breakdown.add_row(term, _time(value), f"{value / total:.1%}")
    console.print(breakdown)
    alternatives = (plan.search or {}).get("alternatives", [])
    if alternatives:
        alt = Table(title=f"Alternatives (solved in {plan.search.get('solve_time_s', 0):.2f} s, "
                          f"{plan.search.get('candidates_evaluated', 0)} configurations priced)")
        for col in ("layout", "micro-batch", "iteration", "why it lost"):
            alt.add_column(col)
        for a in alternatives:
            lay_a = a["layout"]
            desc = (f"pp{lay_a['pp_degree']} dp{lay_a['dp_degree']} tp{lay_a['tp_degree']}"
                    f"{' +sp' if lay_a['sequence_parallel'] else ''} zero{lay_a['zero_stage']} {lay_a['schedule']}"
                    f"{' v' + str(lay_a['virtual_stages']) if lay_a['virtual_stages'] > 1 else ''}")
            alt.add_row(desc, f"{a['micro_batch_size']} x {a['num_microbatches']}", _time(a["iteration_time_s"]), a["why_lost"])
        console.print(alt)


def simulated_timeline(plan: Plan):
    """The plan's schedule played by the event simulator on its predicted stage times."""
    from planner.cost.simulator import simulate
    from planner.errors import PlannerError

    search = plan.search or {}
    fwd, bwd = search.get("stage_forward_s"), search.get("stage_backward_s")
    if not fwd or not bwd:
        raise PlannerError("This plan has no predicted stage times to simulate.", "Draw Gantt charts of plans written by `planner solve`.")
    lay = plan.layout
    return simulate(lay.schedule, fwd, bwd, plan.batch.num_microbatches, lay.virtual_stages)


def draw_plan_gantt(plan: Plan, path: str | Path) -> Path:
    """Simulate the plan's schedule on its predicted stage times and draw it."""
    from planner.cost.simulator import draw_gantt

    lay = plan.layout
    return draw_gantt(simulated_timeline(plan), path, title=f"{lay.schedule}, pp={lay.pp_degree}, m={plan.batch.num_microbatches}")
