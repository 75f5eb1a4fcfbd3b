"""Gantt charts of pipeline timelines (matplotlib, Agg backend, imported lazily).

One panel per timeline, stacked on a shared time axis, so a simulated schedule and a
measured one (planner/validate.py) can be read against each other.

Scale (issue #17). A 175B plan has 16 rows x 512 micro-batches x 3 actions; one patch and
one text per action took over a minute and drew a smear. So:
  - boxes are one `broken_barh` collection per row and kind (artists grow with rows, not
    with actions), with edges only where a box is wide enough for an edge to show;
  - text goes only into boxes wide enough to hold it (at most ~1/MIN_LABEL_SHARE per row);
  - a row with more than MAX_ACTIONS_PER_ROW actions draws only the first and last
    EDGE_MICROBATCHES micro-batches action by action; the actions of the micro-batches in
    between become grey bars, one per run of them that no drawn action and no idle gap
    wider than a pixel interrupts, labelled with their count. The time axis stays linear,
    so idle time stays visible; the legend says what was merged.

A timeline with communication streams (`Timeline.comm_events`: the data-parallel gradient
reduction, planner/cost/simulator.py) draws them as a thin lane at the foot of each rank's row,
under its compute boxes, so what the backward hides and what runs past it can be read off.

A panel can carry `after`: once-per-step terms of a prediction (gradient reduction,
optimizer step) drawn as labelled segments across its rows, ending at `end_s` (the
predicted iteration time), so the axis covers the whole step.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from planner.cost.simulator import Event, Timeline

COLORS = {"F": "#4C72B0", "BW": "#DD8452", "B": "#C44E52", "W": "#55A868"}
"""Box colour per action kind."""
LABELS = {"F": "forward", "BW": "backward", "B": "backward (input grad)", "W": "backward (weight grad)"}
"""Legend text per action kind."""
COMM_COLOR = "#17BECF"
"""Colour of the communication lane's reduction buckets."""
COMM_LABEL = "gradient reduction (communication stream)"
"""Legend text of the communication lane."""
MERGED_COLOR = "#8C8C8C"
"""Colour of a bar standing for a run of merged actions."""
AFTER_COLORS = ("#8172B3", "#937860", "#DA8BC3", "#CCB974", "#64B5CD")
"""Colours of the once-per-step segments, in the order given."""
MAX_ACTIONS_PER_ROW = 240
"""Rows with more actions than this merge the middle micro-batches: past it a box is under
~4 px of the 1100 px axis and a row reads as a smear (1F1B with m = 120 still fits)."""
EDGE_MICROBATCHES = 4
"""Micro-batches drawn action by action at each end of a merged row (warm-up, cool-down)."""
MIN_LABEL_SHARE = 0.012
"""A box gets text only if it spans this share of the time axis (about 13 px of 1100)."""
PIXEL_SHARE = 1 / 1500
"""An idle gap narrower than this share of the axis cannot be seen; a merged run spans it."""


@dataclass(frozen=True)
class Panel:
    """One timeline to draw and what to write around it."""

    timeline: Timeline
    title: str = ""
    """Panel title; empty: schedule, makespan and bubble."""
    row_labels: tuple[str, ...] = ()
    """Per pipeline rank, its y-axis label; empty: `rank r`."""
    after: tuple[tuple[str, float], ...] = ()
    """(term, seconds) segments run once per step after the schedule, in time order."""
    end_s: float = 0.0
    """Where the step ends (the after segments end here); 0: the timeline's makespan."""


@dataclass(frozen=True)
class _Row:
    """What one row draws: per kind, the (start, width) boxes; merged runs; texts."""

    boxes: dict[str, list[tuple[float, float]]]
    merged: list[tuple[float, float, str]]
    """(start, width, label) per merged run."""
    texts: list[tuple[float, str]]
    """(x centre, text) inside boxes wide enough."""
    busy_s: float
    """Sum of the row's action durations."""


def draw_gantt(timeline: Timeline, path: str | Path, title: str = "", row_labels: tuple[str, ...] = (),
               after: tuple[tuple[str, float], ...] = (), end_s: float = 0.0) -> Path:
    """One row per pipeline rank, boxes coloured by kind, the micro-batch number inside if it fits.

    With interleaving the chunk is shown too (`c1:3` = micro-batch 3 on chunk 1).
    """
    return draw_gantts([Panel(timeline, title, tuple(row_labels), tuple(after), end_s)], path)


def draw_gantts(panels: list[Panel | tuple[Timeline, str]], path: str | Path) -> Path:
    """Several timelines, one panel each, on one time axis (the latest end of any panel)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    shown = [p if isinstance(p, Panel) else Panel(*p) for p in panels]
    end = max(max(p.end_s, p.timeline.step_s) for p in shown) or 1.0
    rows = [_layout_rows(p.timeline, end) for p in shown]
    # Rows, then room for the axis and a title of several lines (a one-row plan must still fit them).
    heights = [0.32 * p.timeline.num_ranks + 1.1 + 0.2 * ((p.title or " ").count("\n") + 1) for p in shown]
    legend_in = 0.7
    fig, axes = plt.subplots(len(shown), 1, figsize=(14.0, sum(heights) + legend_in), squeeze=False, sharex=True,
                             gridspec_kw={"height_ratios": heights})
    for ax, panel, panel_rows in zip(axes[:, 0], shown, rows, strict=False):
        _draw_panel(ax, panel, panel_rows, end)
    axes[-1, 0].set_xlabel("time (s)")

    kinds = [k for k in COLORS if any(k in row.boxes for panel_rows in rows for row in panel_rows)]
    handles = [Patch(color=COLORS[k], label=LABELS[k]) for k in kinds]
    if any(p.timeline.comm_events for p in shown):
        handles.append(Patch(color=COMM_COLOR, label=COMM_LABEL))
    if any(row.merged for panel_rows in rows for row in panel_rows):
        handles.append(Patch(color=MERGED_COLOR, label=f"micro-batches after the first and before the last {EDGE_MICROBATCHES} "
                                                       "aggregated: one bar per run without visible idle time"))
    for panel in shown:
        for (term, seconds), color in zip(panel.after, AFTER_COLORS, strict=False):
            handles.append(Patch(color=color, label=f"{term} {_seconds(seconds)} (once per step)"))
    fig.legend(handles=handles, loc="lower center", ncol=min(3, len(handles)), fontsize=7, frameon=False)
    fig.tight_layout(rect=(0, legend_in / (sum(heights) + legend_in), 1, 1))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _layout_rows(timeline: Timeline, end_s: float) -> list[_Row]:
    """Per rank, its boxes, merged runs and texts: bounded whatever the number of micro-batches."""
    per_rank: list[list[Event]] = [[] for _ in range(timeline.num_ranks)]
    for e in timeline.events:  # one pass: a 1024-GPU timeline has ~10^5 events
        per_rank[e.rank].append(e)
    microbatches = max((e.microbatch for e in timeline.events), default=-1) + 1
    interleaved = any(e.chunk >= timeline.num_ranks for e in timeline.events)
    return [_layout_row(sorted(events, key=lambda e: e.start_s), timeline.num_ranks, microbatches, interleaved, end_s)
            for events in per_rank]


def _layout_row(events: list[Event], num_ranks: int, microbatches: int, interleaved: bool, end_s: float) -> _Row:
    merge = len(events) > MAX_ACTIONS_PER_ROW and microbatches > 2 * EDGE_MICROBATCHES
    row = _Row({}, [], [], sum(e.end_s - e.start_s for e in events))
    run: list[Event] = []

    def close_run() -> None:
        if run:
            first, last = min(e.microbatch for e in run), max(e.microbatch for e in run)
            label = f"micro-batches {first}-{last}: {len(run)} actions"
            row.merged.append((run[0].start_s, run[-1].end_s - run[0].start_s, label))
            run.clear()

    for e in events:
        if merge and EDGE_MICROBATCHES <= e.microbatch < microbatches - EDGE_MICROBATCHES:
            if run and e.start_s - run[-1].end_s > PIXEL_SHARE * end_s:
                close_run()
            run.append(e)
            continue
        close_run()
        row.boxes.setdefault(e.kind, []).append((e.start_s, e.end_s - e.start_s))
        if (e.end_s - e.start_s) >= MIN_LABEL_SHARE * end_s:
            label = f"c{e.chunk // num_ranks}:{e.microbatch}" if interleaved else str(e.microbatch)
            row.texts.append(((e.start_s + e.end_s) / 2, label))
    close_run()
    for start, width, label in row.merged:
        if width >= 12 * MIN_LABEL_SHARE * end_s:
            row.texts.append((start + width / 2, label))
    return row


def _draw_panel(ax, panel: Panel, rows: list[_Row], end_s: float) -> None:
    timeline = panel.timeline
    narrow = PIXEL_SHARE * 4 * end_s  # boxes narrower than ~4 px get no edge: edges alone would fill them
    lane = 0.2 if timeline.comm_events else 0.0  # the foot of each row: the communication stream
    comm: list[list[tuple[float, float]]] = [[] for _ in rows]
    for e in timeline.comm_events:
        comm[e.rank].append((e.start_s, e.end_s - e.start_s))
    for r, row in enumerate(rows):
        for kind, boxes in row.boxes.items():
            wide = min(w for _, w in boxes) > narrow
            ax.broken_barh(boxes, (r - 0.4, 0.8 - lane), facecolors=COLORS[kind],
                           edgecolors="black" if wide else "none", linewidth=0.4)
        if row.merged:
            ax.broken_barh([(s, w) for s, w, _ in row.merged], (r - 0.4, 0.8 - lane), facecolors=MERGED_COLOR,
                           edgecolors="none")
        if comm[r]:
            ax.broken_barh(comm[r], (r + 0.4 - lane, lane), facecolors=COMM_COLOR,
                           edgecolors="black" if min(w for _, w in comm[r]) > narrow else "none", linewidth=0.3)
        for x, text in row.texts:
            ax.text(x, r - lane / 2, text, ha="center", va="center", fontsize=6, color="white")
    start = timeline.step_s if not panel.end_s else panel.end_s - sum(s for _, s in panel.after)
    for (term, seconds), color in zip(panel.after, AFTER_COLORS, strict=False):
        if seconds > 0:
            ax.broken_barh([(start, seconds)], (-0.5, timeline.num_ranks), facecolors=color, edgecolors="none", alpha=0.8)
            if seconds >= MIN_LABEL_SHARE * end_s:
                # Upright across several rows; a single row is too short for it: the legend names it.
                if timeline.num_ranks >= 3:
                    ax.text(start + seconds / 2, (timeline.num_ranks - 1) / 2, term, rotation=90, ha="center",
                            va="center", fontsize=7)
        start += seconds
    labels = panel.row_labels or tuple(f"rank {r}" for r in range(timeline.num_ranks))
    ax.set_yticks(range(timeline.num_ranks), labels, fontsize=7 if timeline.num_ranks <= 32 else 5)
    ax.set_ylim(timeline.num_ranks - 0.5, -0.5)
    ax.set_xlim(0, end_s)
    # Timeline.bubble_fraction scans all events once per rank; the rows already hold busy time.
    bubble = 1 - sum(row.busy_s for row in rows) / len(rows) / timeline.makespan_s if timeline.makespan_s > 0 else 0.0
    ax.set_title(panel.title or f"{timeline.schedule}: makespan {timeline.makespan_s:.4g} s, bubble {bubble:.1%}", fontsize=9)


def _seconds(value: float) -> str:
    return f"{value * 1e3:.3g} ms" if abs(value) < 1 else f"{value:.4g} s"
