"""The other dimensions on stock Hugging Face architectures: does each pinned layout train like one
process?

benchmarks/hf_tp_parity.py does this for tensor parallelism; this file for tensor parallelism with
sequence parallelism, context parallelism, the pipeline schedules with several stages per rank,
ZeRO 3 and the recomputation modes. Each
model type's default transformers config is shrunk as there (`SMALL`, with four layers so that a
pipeline of two ranks holds two chunks each), profiled on CPU, solved with the layout pinned on
two CPU processes, and run for three steps beside the one-process reference
(tests/test_runtime_parity.py `run`). A row per (model, layout): the layout the solver wrote, the
largest relative loss difference and the largest parameter difference after three steps, or the
error (a refusal by the solver is an answer: it names why the model cannot take the layout). The
suite's parity tolerances are 1e-5 (losses) and 1e-4 (parameters). Writes
benchmarks/results/hf_layout_parity.csv, keeping the rows of the models and layouts not run.

    python benchmarks/hf_layout_parity.py [--layouts cp2,pp2-zb] [MODEL_TYPE ...]
"""

from __future__ import annotations

import argparse
import csv
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from hf_tp_parity import MODEL_TYPES, parity, small_args  # noqa: E402

LAYOUTS = {
    "tp2-sp": dict(tp=2, sequence_parallel=True),
    "cp2": dict(cp=2, dp=2),
    "pp2-zero-bubble": dict(pp=2, schedule="zero-bubble"),
    "pp2-interleaved-v2": dict(pp=2, schedule="interleaved-1f1b", virtual_stages=2),
    "zero3-selective": dict(dp=2, zero_stage=3, recompute="selective"),
    "zero1-op": dict(dp=2, zero_stage=1, recompute="op"),
    "zero2-full": dict(dp=2, zero_stage=2, recompute="full"),
}
"""Pinned dimensions per layout, all on two ranks."""


def _profile(model_type: str, folder: Path):
    import planner.hf_config_model as hf
    from planner.profiler import profile_model

    return profile_model(hf.__file__, small_args(model_type, folder, layers=4), [1, 2], device="cpu", repeats=1, warmup=0)


def check(profile, model_type: str, layout: str, folder: Path) -> dict:
    from planner.cluster import make_cluster
    from planner.solver.solve import Pins, solve

    plan = solve(profile, make_cluster(2, gpu="cpu"), 4, Pins(**LAYOUTS[layout]))
    lay = plan.layout
    loss, worst = parity(plan, folder / f"{model_type}-{layout}")
    modes = sorted({s.recompute for s in plan.stages} | {m for s in plan.stages for m in s.unit_recompute.values()})
    return dict(plan=f"pp{lay.pp_degree} dp{lay.dp_degree} cp{lay.cp_degree} {lay.schedule} v{lay.virtual_stages} "
                     f"zero{lay.zero_stage} recompute={'/'.join(modes)}",
                loss_rel_diff=loss, param_max_diff=worst)


def _error(exc: Exception) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {' | '.join(lines[-2:])[:300] if lines else ''}"


def _commit() -> str:
    """The checkout's commit, with "+" when it has uncommitted changes: rows of several runs may share the file."""
    import subprocess

    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True,
                           text=True).stdout.strip()
    return head + ("+" if dirty else "")


def main() -> None:
    import transformers

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    parser.add_argument("model_types", nargs="*")
    options = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for model_type in options.model_types or MODEL_TYPES:
            try:
                profile, failed = _profile(model_type, Path(tmp)), ""
            except Exception as exc:  # noqa: BLE001 - a row says what failed
                profile, failed = None, _error(exc)
            for layout in options.layouts.split(","):
                started = time.perf_counter()
                row = dict(model_type=model_type, layout=layout, plan="", loss_rel_diff="", param_max_diff="", error=failed)
                if profile is not None:
                    try:
                        row.update(check(profile, model_type, layout, Path(tmp)))
                    except Exception as exc:  # noqa: BLE001
                        row["error"] = _error(exc)
                row.update(seconds=round(time.perf_counter() - started, 1), transformers=transformers.__version__,
                           commit=_commit())
                rows.append(row)
                print(row, flush=True)
    results = ROOT / "benchmarks" / "results"
    results.mkdir(parents=True, exist_ok=True)
    path = results / "hf_layout_parity.csv"
    # Rows of other (model, layout) pairs already in the file are kept: a rerun of some models updates theirs.
    fresh = {(r["model_type"], r["layout"]) for r in rows}
    kept = [r for r in csv.DictReader(open(path))] if path.exists() else []
    rows = [r for r in kept if (r["model_type"], r["layout"]) not in fresh] + rows
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[-1]))
        writer.writeheader()
        writer.writerows(rows)


if __name__ == "__main__":
    main()
