"""Predicted vs measured peak tensor memory per example and layout on CPU (float32, gloo).

For each case of tests/test_memory_measured.py: solve the pinned layout on an analytic
profile, take the plan's own predicted peak and terms per stage (the solver's, which
tests/test_memory_measured.py also holds to planner/cost/memory.py `stage_memory`), run the
plan for a few steps and read the tensor peak each rank measured (runtime/metrics.py
`TensorPeakMeter`).
Also records what the measurement costs: the measured step's time over the median of the
later, unmeasured steps (the profiler runs only in the measured step).

    OMP_NUM_THREADS=1 python benchmarks/memory_cpu.py [CASE ...]

Writes benchmarks/results/memory_cpu.csv and .png. Timings on a shared machine are noisy;
the memory figures are not.
"""

from __future__ import annotations

import csv
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from planner.plan import rank_peak_bytes  # noqa: E402
from tests.test_memory_measured import CASES, predict  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
STEPS = 4  # warm-up, measured, two timed steps to hold the measured one against


def run(plan, directory: Path) -> dict:
    path, out = directory / "plan.json", directory / "metrics.json"
    plan.save(path)
    ran = subprocess.run([sys.executable, "-m", "planner.cli", "run", str(path), "--steps", str(STEPS), "--output", str(out)],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    if ran.returncode:
        raise RuntimeError(ran.stderr[-2000:])
    return json.loads(out.read_text())


def main(names: list[str]) -> None:
    rows = []
    for name in names or list(CASES):
        model, args, world, pins = CASES[name]
        plan, _ = predict(model, args, world, pins)
        with tempfile.TemporaryDirectory() as tmp:
            metrics = run(plan, Path(tmp))
        predicted = rank_peak_bytes(plan)
        times = metrics["step_times_s"]
        overhead = times[1] / statistics.median(times[2:]) - 1
        for rank, (p, m) in enumerate(zip(predicted, metrics["peak_tensor_bytes"], strict=True)):
            stage = next(k for k, s in enumerate(plan.stages) if rank in s.ranks)
            terms = plan.prediction.memory_terms_bytes[stage]
            rows.append(dict(case=name, rank=rank, predicted_bytes=int(p), measured_bytes=m, error=round(p / m - 1, 4),
                             rss_bytes=metrics["peak_memory_bytes"][rank], profiler_step_overhead=round(overhead, 3), **terms))
            print(f"{name:16s} rank {rank}: predicted {p / 2**20:7.3f} MiB, measured {m / 2**20:7.3f} MiB "
                  f"({p / m - 1:+.1%}); profiled step {overhead:+.0%}", flush=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    with open(RESULTS / "memory_cpu.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    _plot(rows, RESULTS / "memory_cpu.png")


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['case']}\nrank {r['rank']}" for r in rows]
    x = range(len(rows))
    fig, ax = plt.subplots(figsize=(max(6, len(rows) * 0.9), 4))
    ax.bar([i - 0.2 for i in x], [r["predicted_bytes"] / 2**20 for r in rows], width=0.4, label="predicted")
    ax.bar([i + 0.2 for i in x], [r["measured_bytes"] / 2**20 for r in rows], width=0.4, label="measured (tensor peak)")
    ax.set_xticks(list(x), labels, rotation=60, fontsize=7)
    ax.set_ylabel("MiB per rank")
    ax.set_title("Peak tensor memory on CPU, float32: predicted vs measured")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main(sys.argv[1:])
