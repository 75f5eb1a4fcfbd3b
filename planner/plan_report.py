"""Human views of plan files: layout, stages, breakdown, alternatives; Gantt of the schedule."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.table import Table

from planner.cost.overlap import OVERLAP_NAMES
from planner.plan import RECOMPUTE, Plan, SearchReport, Stage, flush_free_blocker
from planner.report import format_bytes, format_time, memory_terms_table


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


def recompute_summary(stage: Stage) -> str:
    """A stage's recomputation in a few words: its mode, then each other mode's units
    ("none; full on 3 of 8 units: blocks.0-2")."""
    modes = stage.unit_modes()
    parts: list[str] = [stage.recompute]
    for mode in RECOMPUTE:
        units = [u for u, r in modes.items() if r == mode and r != stage.recompute]
        if units:
            parts.append(f"{mode} on {len(units)} of {len(modes)} units: {_units_summary(units)}")
    return "; ".join(parts)


def replication_note(replicas: list[int]) -> str:
    """What `Layout.stage_replicas` means, for `planner show`."""
    per_stage = ", ".join(f"stage {k} x{r}" for k, r in enumerate(replicas))
    return (f"PipeDream stage replication ({per_stage}; {sum(replicas)} ranks): micro-batch i runs on replica "
            "i mod r of each stage (1F1B-RR, Narayanan et al. 2019), and a stage's replicas sum their gradients "
            "once per step; the dp column is 1 because the replication is the data parallelism.")


STAGE_ROWS = 24
"""Stage rows `print_plan` shows before eliding the middle ones (`shown_stages`)."""


def shown_stages(count: int, all_stages: bool = False) -> list[int | None]:
    """The stage (chunk) indices a plan's tables list, None where rows are elided: all of them up to
    `STAGE_ROWS`, else the first two thirds of that and the last third (an interleaved plan of 8
    stages x 12 chunks has 96 rows, which no terminal shows)."""
    if all_stages or count <= STAGE_ROWS:
        return list(range(count))
    head, tail = 2 * STAGE_ROWS // 3, STAGE_ROWS // 3
    return [*range(head), None, *range(count - tail, count)]


def elide(table: Table, count: int, columns: int) -> None:
    """Add the row standing for `shown_stages`' elided ones, and say in the caption how to see them."""
    table.add_row(*["..."] * columns)
    table.caption = f"{count - STAGE_ROWS} of {count} stages elided: planner show PLAN --all-stages lists them"


def print_plan(plan: Plan, console: Console | None = None, all_stages: bool = False) -> None:
    """The plan's tables; `all_stages` lists every stage and chunk (`shown_stages` elides the
    middle of a long list)."""
    console = console or Console()
    lay, batch = plan.layout, plan.batch
    head = Table(title=f"Plan for {plan.model.file} on {plan.cluster.num_nodes} x {plan.cluster.gpus_per_node} {plan.cluster.gpu}")
    for col in ("pp", "dp", "tp", "ep", "cp", "SP", "ZeRO", "schedule", "v", "p2p", "micro-batch", "micro-batches", "global batch", "dtype"):
        head.add_column(col)
    p2p = "-" if lay.pp_degree == 1 else ("tp slices" if lay.p2p_scatter_gather else "whole")
    zero = (f"{lay.zero_stage}{f' hsdp {lay.shard_degree}' if lay.shard_degree else ''}"
            f"{' +offload' if plan.training.offload != 'none' else ''}")
    head.add_row(str(lay.pp_degree), str(lay.dp_degree), str(lay.tp_degree),
                 f"{lay.ep_degree}{f' etp{lay.expert_tp_degree}' if lay.expert_tp_degree > 1 else ''}", cp_text(lay), "yes" if lay.sequence_parallel else "no",
                 zero, lay.schedule, str(lay.virtual_stages), p2p, str(batch.micro_batch_size),
                 str(batch.num_microbatches), str(batch.global_batch_size), plan.training.dtype)
    console.print(head)
    if plan.device_mismatch:
        from rich.markup import escape

        console.print(f"[bold yellow]device mismatch:[/] {escape(plan.device_mismatch)} (solved with --allow-device-mismatch).")
    pred = plan.prediction
    stages = Table(title="Stages")
    for col in ("stage", "units", "ranks", "recompute", "TP-sharded modules", "time / micro-batch", "peak memory"):
        stages.add_column(col, justify="left" if col in ("units", "ranks") else "right")
    for k in shown_stages(len(plan.stages), all_stages):
        if k is None:
            elide(stages, len(plan.stages), 7)
            continue
        s = plan.stages[k]
        t = format_time(pred.stage_time_s[k]) if pred and k < len(pred.stage_time_s) else "-"
        m = format_bytes(pred.peak_memory_bytes[k]) if pred and k < len(pred.peak_memory_bytes) else "-"
        stages.add_row(str(k), _units_summary(s.units), ",".join(map(str, s.ranks)), recompute_summary(s), _tp_sharded(s), t, m)
    console.print(stages)
    if (memory := memory_terms_table(plan, all_stages)) is not None:
        console.print(memory)
    if plan.layout.schedule == "pipedream-2bw":
        console.print(ASYNC_SCHEDULE_NOTE)
    if plan.layout.stage_replicas is not None:
        console.print(replication_note(plan.layout.stage_replicas))
    if pred is None:
        console.print("no prediction (hand-written plan)")
        return
    summary = Table(title="Prediction" + (" (FP8 linears)" if plan.training.float8 else ""))
    fp8 = pred.mfu_fp8 is not None
    for col in ("iteration", "samples/s", "tokens/s", "TFLOP/s/GPU", "HW TFLOP/s/GPU", "MFU (bf16 peak)" if fp8 else "MFU",
                *(("MFU (FP8 peak)",) if fp8 else ()), "bubble"):
        summary.add_column(col, justify="right")
    summary.add_row(format_time(pred.iteration_time_s), f"{pred.samples_per_s:.4g}",
                    f"{pred.tokens_per_s:.4g}" if pred.tokens_per_s else "-", f"{pred.tflops_per_gpu:.3g}",
                    f"{pred.hw_tflops_per_gpu:.3g}", f"{pred.mfu:.1%}", *((f"{pred.mfu_fp8:.1%}",) if fp8 else ()),
                    f"{pred.bubble_fraction:.1%}")
    console.print(summary)
    breakdown = Table(title="Breakdown of the busiest pipeline rank (per iteration)")
    breakdown.add_column("term")
    breakdown.add_column("time", justify="right")
    breakdown.add_column("share", justify="right")
    total = sum(pred.breakdown_s.values()) or 1.0
    for term, value in pred.breakdown_s.items():
        breakdown.add_row(term, format_time(value), f"{value / total:.1%}")
    console.print(breakdown)
    if pred.overlap is not None:  # what the stack priced hides (planner/cost/overlap.py), the terms above being the rest
        serial = [name for name in OVERLAP_NAMES if name not in pred.overlap]
        console.print(f"communication overlapped with compute: {', '.join(pred.overlap) or 'none'}; "
                      f"in series: {', '.join(serial) or 'none'}")
    search = plan.search
    if search is not None and search.alternatives:
        alt = Table(title=f"Alternatives (solved in {search.solve_time_s:.2f} s, {search.candidates_evaluated} configurations priced)")
        for col in ("layout", "micro-batch", "iteration", "why it lost"):
            alt.add_column(col)
        for a in search.alternatives:
            lay_a = a.layout
            desc = (f"pp{lay_a.pp_degree} dp{lay_a.dp_degree} tp{lay_a.tp_degree}"
                    f"{' +sp' if lay_a.sequence_parallel else ''}{f' ep{lay_a.ep_degree}' if lay_a.ep_degree > 1 else ''}{f' cp{cp_text(lay_a)}' if lay_a.cp_degree > 1 else ''}"
                    f" zero{lay_a.zero_stage}{f' hsdp{lay_a.shard_degree}' if lay_a.shard_degree else ''} {lay_a.schedule}"
                    f"{' v' + str(lay_a.virtual_stages) if lay_a.virtual_stages > 1 else ''}")
            alt.add_row(desc, f"{a.micro_batch_size} x {a.num_microbatches}", format_time(a.iteration_time_s), a.why_lost)
        console.print(alt)
    if search is not None and search.phase_times_s:
        print_search(search, console)
    for note in search.notes if search is not None else []:
        console.print(f"note: {note}")


def _tp_sharded(stage) -> str:
    """`sharded of listed` modules of a stage's TP plan ("-" without one): the plan lists every module
    with a weight the ILP placed, kept whole ("replicate") or not."""
    if not stage.tp_plan:
        return "-"
    sharded = sum(style != "replicate" for style in stage.tp_plan.values())
    return f"{sharded} of {len(stage.tp_plan)}"


ASYNC_SCHEDULE_NOTE = ("asynchronous schedule pipedream-2bw (PipeDream-2BW): each stage keeps the previous weights; step t "
                       "takes its gradient at W(t-1) and updates W(t): W(t+1) = W(t) - lr grad f(W(t-1)), W(-1) = W(0). "
                       "No pipeline bubble in the steady state, one extra weight copy per stage; it trains to other "
                       "parameters than the synchronous schedules (planner/plan.py `Schedule`).")
"""What `planner show` says about a plan with the asynchronous schedule."""


def print_search(search: SearchReport, console: Console) -> None:
    """The search's counts (considered, pruned by each bound, priced) and its time per phase."""
    phases = search.phase_times_s or {}
    on = f", {search.processes} processes" if (search.processes or 1) > 1 else ""
    table = Table(title=f"Search ({search.solve_time_s:.3f} s{on})")
    for col in ("configurations", "pruned: memory", "pruned: time bound", "priced", *phases):
        table.add_column(col, justify="right")
    count = lambda n: "-" if n is None else str(n)  # noqa: E731
    table.add_row(count(search.candidates), count(search.pruned_by_memory_bound), count(search.pruned_by_time_bound),
                  count(search.candidates_evaluated), *(format_time(t) for t in phases.values()))
    console.print(table)


def simulated_timeline(plan: Plan):
    """The plan's schedule played by the event simulator on its predicted stage times."""
    from planner.cost.schedules import weight_split
    from planner.cost.simulator import simulate
    from planner.errors import PlannerError

    fwd, bwd = (plan.search.stage_forward_s, plan.search.stage_backward_s) if plan.search else (None, None)
    if not fwd or not bwd:
        raise PlannerError("This plan has no predicted stage times to simulate.", "Draw Gantt charts of plans written by `planner solve`.")
    lay, search = plan.layout, plan.search
    reduce_s = search.rank_grad_reduce_s if search else None
    if not reduce_s or len(reduce_s) != lay.pp_degree:
        reduce_s = None
    # The overlapped gradient reduction on each rank's communication stream, as it was priced.
    return simulate(lay.schedule, fwd, bwd, plan.batch.num_microbatches, lay.virtual_stages,
                    backward_weight_fraction=weight_split(plan), grad_sync_s=reduce_s,
                    num_buckets=(search.grad_reduce_buckets if search else None) or 1,
                    grad_ready=(search.grad_reduce_ready if search else None) or "backward")


SCHEDULE_TERMS = ("compute", "tp_comm", "ep_comm", "cp_comm", "p2p", "bubble")
"""Breakdown terms spent inside the pipeline schedule (planner/solver/search.py `_price`:
iteration = pipeline + the slowest rank's grad_accumulation + dp_comm + tie_comm + optimizer);
the others run once per step after a rank's last backward. EP's all-to-alls and CP's K/V
gathers run in every micro-batch, inside the stage times the schedule is simulated on."""


def _ranks_summary(ranks: list[int]) -> str:
    """`24-31` style ranges for runs of consecutive ranks."""
    runs: list[list[int]] = []
    for r in sorted(ranks):
        if runs and runs[-1][1] + 1 == r:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def gantt_row_labels(plan: Plan) -> tuple[str, ...]:
    """Per pipeline rank: its stages and the global ranks holding them (`stage 3 (ranks 24-31)`)."""
    pp = plan.layout.pp_degree
    labels = []
    for r in range(pp):
        stages = [k for k in range(len(plan.stages)) if k % pp == r]
        ranks = _ranks_summary(plan.stages[r].ranks) if r < len(plan.stages) else "?"
        labels.append(f"stage{'s' if len(stages) > 1 else ''} {', '.join(map(str, stages))} (ranks {ranks})")
    return tuple(labels)


def after_schedule_terms(plan: Plan, makespan_s: float, lane_s: float = 0.0) -> tuple[tuple[str, float], ...]:
    """The prediction's once-per-step terms, in breakdown order, drawn after the schedule.

    Under ZeRO >= 1 the breakdown's dp_comm also counts the per-micro-batch reduce-scatters
    and gathers that sit inside the stage times; only what the schedule leaves of the step is
    drawn after it, so the segments end at the predicted iteration time. `lane_s`: how far the
    communication lanes' gradient reduction runs past the schedule (`simulated_timeline`); that
    much of dp_comm is drawn there, not again after it.
    """
    pred = plan.prediction
    if pred is None:  # a hand-written plan predicts no terms
        return ()
    terms = [(t, v) for t, v in pred.breakdown_s.items() if t not in SCHEDULE_TERMS]
    if lane_s > 0:
        # What the lanes do not show; under a nanosecond is the two models' rounding, not time.
        terms = [(t, v - lane_s if v - lane_s > 1e-9 else 0.0) if t == "dp_comm" else (t, v) for t, v in terms]
        makespan_s += lane_s
    if plan.layout.zero_stage >= 1:
        others = sum(v for t, v in terms if t != "dp_comm")
        step_s = max(0.0, pred.iteration_time_s - makespan_s - others)
        terms = [("dp_comm (per step part)", step_s) if t == "dp_comm" and step_s < v else (t, v) for t, v in terms]
    if lane_s > 0:
        terms = [("dp_comm (rest)" if t == "dp_comm" else t, v) for t, v in terms]
    return tuple(terms)


def draw_plan_gantt(plan: Plan, path: str | Path) -> Path:
    """Simulate the plan's schedule on its predicted stage times and draw it, then the
    prediction's once-per-step terms, so the time axis ends at the predicted iteration time."""
    from planner.cost.simulator import draw_gantt

    lay, pred = plan.layout, plan.prediction
    timeline = simulated_timeline(plan)
    title = f"{lay.schedule}, pp={lay.pp_degree}, m={plan.batch.num_microbatches}"
    if lay.schedule == "pipedream-2bw":  # planner/cost/schedules.py: flush-free steady state, or 1F1B's when flushed
        blocker = flush_free_blocker(lay, plan.training)
        title += (" (one batch alone; the prediction is the steady state without fill and drain)" if blocker is None
                  else f" (runs flushed, as 1F1B: {blocker})")
    if pred is None:
        return draw_gantt(timeline, path, title=title, row_labels=gantt_row_labels(plan))
    lane_s = timeline.step_s - timeline.makespan_s
    after = after_schedule_terms(plan, timeline.makespan_s, lane_s)
    inside = ", ".join(f"{t} {format_time(pred.breakdown_s[t])}" for t in SCHEDULE_TERMS if t in pred.breakdown_s)
    once = ", ".join(f"{t} {format_time(v)}" for t, v in after)
    lane = f" + gradient reduction past it {format_time(lane_s)}" if timeline.comm_events else ""
    title += (f"\nsimulated schedule {format_time(timeline.makespan_s)}{lane} + once per step ({once})\n= predicted "
              f"iteration {format_time(pred.iteration_time_s)}; schedule terms on the busiest rank: {inside}")
    return draw_gantt(timeline, path, title=title, row_labels=gantt_row_labels(plan), after=after, end_s=pred.iteration_time_s)


def cp_text(layout) -> str:
    """The CP degree with its algorithm when it has one to say (planner/plan.py `Layout.cp_algorithm`)."""
    return f"{layout.cp_degree} {layout.cp_algorithm}" if layout.cp_degree > 1 else str(layout.cp_degree)
