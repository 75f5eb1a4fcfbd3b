"""Gantt chart of a simulated pipeline timeline (matplotlib, Agg backend, imported lazily)."""

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
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    interleaved = any(e.chunk >= timeline.num_ranks for e in timeline.events)
    width = min(40.0, max(8.0, len(timeline.events) / (2.5 * max(1, timeline.num_ranks)) * 1.2))
    fig, ax = plt.subplots(figsize=(width, 0.6 * timeline.num_ranks + 1.4))
    for e in timeline.events:
        ax.barh(e.rank, e.end_s - e.start_s, left=e.start_s, color=COLORS[e.kind], edgecolor="black", linewidth=0.4)
        if timeline.makespan_s > 0 and (e.end_s - e.start_s) / timeline.makespan_s > 0.008:
            label = f"c{e.chunk // timeline.num_ranks}:{e.microbatch}" if interleaved else str(e.microbatch)
            ax.text((e.start_s + e.end_s) / 2, e.rank, label, ha="center", va="center", fontsize=6, color="white")
    ax.set_yticks(range(timeline.num_ranks), [f"rank {r}" for r in range(timeline.num_ranks)])
    ax.invert_yaxis()
    ax.set_xlabel("time (s)")
    ax.set_xlim(0, timeline.makespan_s or 1.0)
    ax.set_title(title or f"{timeline.schedule}: makespan {timeline.makespan_s:.4g} s, bubble {timeline.bubble_fraction():.1%}")
    kinds = [k for k in COLORS if any(e.kind == k for e in timeline.events)]
    ax.legend([plt.Rectangle((0, 0), 1, 1, color=COLORS[k]) for k in kinds], [LABELS[k] for k in kinds],
              loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=len(kinds), fontsize=7, frameon=False)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
