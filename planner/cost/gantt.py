"""Gantt charts of pipeline timelines (matplotlib, Agg backend, imported lazily).

One panel per timeline, stacked on a shared time axis, so a simulated schedule and a
measured one (planner/validate.py) can be read against each other.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from planner.cost.simulator import Timeline

COLORS = {"F": "#4C72B0", "BW": "#DD8452", "B": "#C44E52", "W": "#55A868"}
"""Box colour per action kind."""
LABELS = {"F": "forward", "BW": "backward", "B": "backward (input grad)", "W": "backward (weight grad)"}
"""Legend text per action kind."""


def draw_gantt(timeline: Timeline, path: str | Path, title: str = "") -> Path:
    """One row per rank, one box per action coloured by kind, the micro-batch number inside.

    With interleaving the chunk is shown too (`c1:3` = micro-batch 3 on chunk 1).
    """
    return draw_gantts([(timeline, title)], path)


def draw_gantts(panels: list[tuple[Timeline, str]], path: str | Path) -> Path:
    """Several timelines, one panel each, on one time axis (the longest makespan)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    most_events = max(len(t.events) / (2.5 * max(1, t.num_ranks)) for t, _ in panels)
    width = min(40.0, max(8.0, most_events * 1.2))
    heights = [0.6 * t.num_ranks + 1.0 for t, _ in panels]
    fig, axes = plt.subplots(len(panels), 1, figsize=(width, sum(heights) + 0.6), squeeze=False, sharex=True,
                             gridspec_kw={"height_ratios": heights})
    end = max(t.makespan_s for t, _ in panels) or 1.0
    for ax, (timeline, title) in zip(axes[:, 0], panels):
        _draw_panel(ax, timeline, title, end)
    axes[-1, 0].set_xlabel("time (s)")
    kinds = [k for k in COLORS if any(e.kind == k for t, _ in panels for e in t.events)]
    axes[-1, 0].legend([plt.Rectangle((0, 0), 1, 1, color=COLORS[k]) for k in kinds], [LABELS[k] for k in kinds],
                       loc="upper center", bbox_to_anchor=(0.5, -0.35), ncol=len(kinds), fontsize=7, frameon=False)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _draw_panel(ax, timeline: Timeline, title: str, end_s: float) -> None:
    interleaved = any(e.chunk >= timeline.num_ranks for e in timeline.events)
    for e in timeline.events:
        ax.barh(e.rank, e.end_s - e.start_s, left=e.start_s, color=COLORS[e.kind], edgecolor="black", linewidth=0.4)
        if (e.end_s - e.start_s) / end_s > 0.008:
            label = f"c{e.chunk // timeline.num_ranks}:{e.microbatch}" if interleaved else str(e.microbatch)
            ax.text((e.start_s + e.end_s) / 2, e.rank, label, ha="center", va="center", fontsize=6, color="white")
    ax.set_yticks(range(timeline.num_ranks), [f"rank {r}" for r in range(timeline.num_ranks)])
    ax.set_ylim(timeline.num_ranks - 0.5, -0.5)
    ax.set_xlim(0, end_s)
    ax.set_title(title or f"{timeline.schedule}: makespan {timeline.makespan_s:.4g} s, bubble {timeline.bubble_fraction():.1%}",
                 fontsize=9)
