"""Human views of profile files (a per-unit table and a CSV export) and of a plan's memory terms."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console
from rich.table import Table

from planner.cost.memory import TERMS
from planner.plan import rank_peak_bytes
from planner.profile_schema import Profile

if TYPE_CHECKING:  # pandas costs half a second to import: only the profile table needs it
    import pandas as pd


def _si(value: float, unit: str) -> str:
    for factor, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= factor:
            return f"{value / factor:.2f} {prefix}{unit}"
    return f"{value:.0f} {unit}"


def format_time(seconds: float) -> str:
    """Seconds for a table: s, ms or us with 3-4 significant digits."""
    if seconds >= 1:
        return f"{seconds:.3f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.3f} ms"
    return f"{seconds * 1e6:.1f} us"


def format_bytes(n: float) -> str:
    """Bytes for a table, in binary units (KiB = 2**10 B ... TiB)."""
    for factor, unit in ((2**40, "TiB"), (2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if abs(n) >= factor:
            return f"{n / factor:.2f} {unit}"
    return f"{n:.0f} B"


def profile_frame(profile: Profile, micro_batch_size: int | None = None) -> pd.DataFrame:
    """One row per unit at one micro-batch size (the smallest by default)."""
    b = micro_batch_size or profile.micro_batch_sizes[0]
    if b not in profile.micro_batch_sizes:
        from planner.errors import PlannerError

        raise PlannerError(f"Micro-batch size {b} was not profiled.", f"Profiled sizes: {profile.micro_batch_sizes}.")
    rows = []
    for unit in profile.units:
        c = unit.costs[b]
        rows.append(
            dict(
                index=unit.index,
                unit=unit.name,
                kind=unit.kind,
                params=unit.num_parameters,
                param_bytes=unit.parameter_bytes,
                forward_s=c.forward_time_s,
                backward_s=c.backward_time_s,
                forward_flops=c.forward_flops,
                backward_flops=c.backward_flops,
                output_bytes=c.output_bytes,
                saved_bytes=c.saved_bytes,
                cut_bytes=profile.cuts[unit.index].bytes[b] if unit.index < len(profile.cuts) else 0,
                peak_memory_bytes=c.peak_memory_bytes,
            )
        )
    import pandas as pd

    frame = pd.DataFrame(rows)
    total = frame.forward_s + frame.backward_s
    frame["time_share"] = total / total.sum() if total.sum() else 0.0
    return frame


def print_profile(profile: Profile, micro_batch_size: int | None = None, console: Console | None = None) -> None:
    console = console or Console()
    b = micro_batch_size or profile.micro_batch_sizes[0]
    frame = profile_frame(profile, b)
    where = profile.device_name if profile.mode == "measured" else f"roofline of {profile.target_gpu}"
    if profile.cpu_threads:
        where += f" ({profile.cpu_threads} thread{'s' if profile.cpu_threads > 1 else ''})"
    table = Table(
        title=f"{Path(profile.model.file).name} {profile.model.args or ''}: {profile.mode} on {where}, "
        f"{profile.dtype}{f' ({precision})' if (precision := profile.computes_as()) else ''}, micro-batch {b}",
        title_justify="left",
    )
    for col in ("#", "unit", "kind", "params", "fwd", "bwd", "fwd FLOPs", "saved", "out", "cut", "share"):
        table.add_column(col, justify="left" if col in ("unit", "kind") else "right")
    for r in frame.itertuples():
        table.add_row(
            str(r.index), r.unit, r.kind, _si(r.params, ""), format_time(r.forward_s), format_time(r.backward_s),
            _si(r.forward_flops, ""), format_bytes(r.saved_bytes), format_bytes(r.output_bytes),
            format_bytes(r.cut_bytes) if r.index < len(profile.cuts) else "", f"{r.time_share:.1%}",
        )
    table.add_section()
    table.add_row(
        "", "total", "", _si(profile.model.num_parameters, ""), format_time(frame.forward_s.sum()),
        format_time(frame.backward_s.sum()), _si(frame.forward_flops.sum(), ""), format_bytes(frame.saved_bytes.sum()),
        "", "", "100%",
    )
    console.print(table)
    whole = profile.whole_model.get(b)
    if whole:
        console.print(
            f"whole model forward+backward: {format_time(whole.forward_backward_time_s)}; sum of units "
            f"{format_time(whole.sum_of_units_time_s)}; ratio {whole.ratio:.2f}"
        )
    _print_moe(profile, b, console)
    for note in profile.notes:
        console.print(f"note: {note}")


def _print_moe(profile: Profile, b: int, console: Console) -> None:
    """One line per kind of MoE unit (same unit kind and layer shape): where its experts are,
    how many, top-k, widths, and their share of the unit's forward at micro-batch `b`."""
    kinds: dict[tuple, list[str]] = {}
    for unit in profile.units:
        for layer in unit.moe:
            kinds.setdefault((unit.kind, layer.experts, layer.num_experts, layer.top_k, layer.model_dim,
                              layer.expert_hidden_dim, bool(layer.shared_experts)), []).append(unit.name)
    for (kind, experts, e, k, d, f, shared), names in kinds.items():
        unit = next(u for u in profile.units if u.name == names[0])
        layer = next(m for m in unit.moe if m.experts == experts)
        costs = layer.costs.get(b)
        share = f", {costs.expert_forward_time_s / unit.costs[b].forward_time_s:.0%} of its forward" if (
            costs and unit.costs[b].forward_time_s) else ""
        spread = f", routing spread {layer.routing_spread:.2f}" if layer.routing_spread is not None else ""
        console.print(
            f"MoE {kind} x{len(names)}: {experts}: {e} experts, top-{k}, model dim {d}, expert width {f}"
            f"{', shared expert' if shared else ''}, router {layer.router or 'not found'}{share}{spread}"
        )


MEMORY_TERMS = TERMS[:-1] + ("stashed_weights", TERMS[-1])
"""planner/cost/memory.py `StageMemory.terms`, in the order `memory_terms_table` shows them (a
term no stage has, PipeDream-2BW's stashed weights elsewhere, is left out)."""


def memory_terms_table(plan, all_stages: bool = False) -> Table | None:
    """Per stage, the predicted peak memory term by term (`Prediction.memory_terms_bytes`), or
    None when the plan does not carry the terms (a hand-written or older plan). Long lists are
    elided as the stage table's (planner/plan_report.py `shown_stages`) unless `all_stages`."""
    from planner.plan_report import elide, shown_stages

    pred = plan.prediction
    terms = pred.memory_terms_bytes if pred else None
    if not terms:
        return None
    table = Table(title="Predicted peak memory per GPU, by term (planner/cost/memory.py)", title_justify="left")
    names = [name for name in MEMORY_TERMS if name in TERMS or any(name in stage for stage in terms)]
    table.add_column("stage", justify="right")
    for name in names:
        table.add_column(name.replace("_", " "), justify="right")
    table.add_column("tensors", justify="right")
    for k in shown_stages(len(terms), all_stages):
        if k is None:
            elide(table, len(terms), len(names) + 2)
            continue
        stage = terms[k]
        tensors = sum(v for name, v in stage.items() if name != "fragmentation")
        table.add_row(str(k), *(format_bytes(stage[name]) if name in stage else "-" for name in names), format_bytes(tensors))
    lay = plan.layout
    captions = []
    if lay.virtual_stages > 1:  # what a GPU holds is its chunks together
        captions.append(f"A pipeline rank holds {lay.virtual_stages} of these stages (stage k on rank k mod {lay.pp_degree}), "
                        f"so their sum: {format_bytes(max(rank_peak_bytes(plan)))} on the busiest rank.")
    if pred.state_bytes:
        b = pred.state_bytes
        captions.append(f"Bytes per parameter: weights {b['weights']}, gradients {b['gradients']} (reduced as "
                        f"{b['reduction']}), optimizer {b['optimizer']}.")
    if captions:
        table.caption = " ".join(captions)
        table.caption_justify = "left"
    return table
