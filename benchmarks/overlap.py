"""How much of the data-parallel gradient reduction the runtime hides behind the backward,
measured on gloo CPU processes beside what the cost model's closed form predicts (issue #13).

For each layout, the same model and per-rank batch run three ways, alternating over rounds
so that drifting load hits them alike (median step time of each):
- `dp1`: one process, the per-rank batch alone: compute only;
- `serial`: dp 2, the plan as the solver writes it for CPUs (`Prediction.overlap` empty: gloo
  shares the cores, planner/solver/solve.py), so the runtime averages the gradients after
  the backward (runtime/apply_dp.py `average_gradients`);
- `overlapped`: the same plan assuming `grad_reduce` (what a GPU plan assumes), so the
  runtime launches DDP-style buckets from the backward (runtime/apply_dp.py `GradientReducer`).

Measured: the reduction's cost C = serial - dp1 and the hidden share (serial - overlapped) / C.
Predicted: 1 - exposed_s(C, W, n) / C (planner/cost/overlap.py), with the measured C, the
backward window W of the step's last micro-batch (the runtime's stage timer) and n the
number of 25 MiB buckets. The closed form assumes a communication stream that does not slow
the compute: on two cores shared by two compute processes and gloo's threads that does not
hold, which is why the solver assumes no overlap on CPUs; the table shows by how much.
Writes benchmarks/results/overlap.csv.

    python benchmarks/overlap.py [--rounds 3] [--steps 6]
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import pandas as pd

from planner.cost.overlap import exposed_s
from planner.metrics_schema import load_metrics
from planner.plan import load_plan
from runtime.apply_dp import BUCKET_BYTES

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
MODEL = ROOT / "examples" / "gpt.py"
# ~15M parameters (60 MB of fp32 gradients: 3 buckets) and a small batch, so that the
# reduction is a sizeable share of the step on one core.
ARGS = dict(n_layers=4, d_model=512, n_heads=8, d_ff=2048, vocab_size=4096, seq_len=32)
MICRO_BATCH = 1
LAYOUTS = {"dp2-m1": 1, "dp2-m2": 2}  # name -> micro-batches per step
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def _run(command: list[str]) -> None:
    done = subprocess.run(command, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=900)
    if done.returncode:
        sys.exit(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")


def _planner(*args: str) -> list[str]:
    return [sys.executable, "-m", "planner.cli", *args]


def _plans(folder: Path, profile: Path, m: int) -> dict[str, Path]:
    """The three plans of one layout (module docstring)."""
    plans = {}
    for name, gpus in (("dp1", 1), ("serial", 2)):
        path = folder / f"{name}-m{m}.json"
        _run(_planner("solve", "-p", str(profile), "--gpu", "cpu", "--gpus", str(gpus), "-b", str(gpus * m * MICRO_BATCH),
                      "--dp", str(gpus), "--tp", "1", "--pp", "1", "--zero", "0", "--micro-batch", str(MICRO_BATCH),
                      "--recompute", "none", "-o", str(path)))
        plans[name] = path
    plan = load_plan(plans["serial"])
    assert plan.prediction is not None and plan.prediction.overlap == [], "CPU plans assume no overlap"
    overlapped = plan.model_copy(update={"prediction": plan.prediction.model_copy(update={"overlap": ["grad_reduce"]})})
    plans["overlapped"] = folder / f"overlapped-m{m}.json"
    overlapped.save(plans["overlapped"])
    return plans


def _measure(plan: Path, steps: int, out: Path) -> tuple[float, float]:
    """(median step seconds, the last micro-batch's backward seconds on rank 0)."""
    _run(_planner("run", str(plan), "--steps", str(steps), "--output", str(out)))
    metrics = load_metrics(out)
    backward = [t.backward_s for t in metrics.stage_times_s.values()]
    return metrics.median_iteration_time_s, statistics.median(backward) if backward else math.nan


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        profile = folder / "profile.json"
        _run(_planner("profile", str(MODEL), *[x for k, v in ARGS.items() for x in ("-a", f"{k}={v}")],
                      "--micro-batch-sizes", str(MICRO_BATCH), "-o", str(profile)))
        for name, m in LAYOUTS.items():
            plans = _plans(folder, profile, m)
            times: dict[str, list[float]] = {k: [] for k in plans}
            windows: list[float] = []
            for r in range(args.rounds):
                for kind, path in plans.items():
                    step, backward = _measure(path, args.steps, folder / f"{kind}-{r}.metrics.json")
                    times[kind].append(step)
                    if kind == "overlapped":
                        windows.append(backward)
            t = {k: statistics.median(v) for k, v in times.items()}
            comm = t["serial"] - t["dp1"]
            window = statistics.median(windows)
            params = _parameter_bytes(profile)
            buckets = max(1, math.ceil(params / BUCKET_BYTES))
            predicted = 1 - exposed_s(comm, window, buckets) / comm if comm > 0 else math.nan
            measured = (t["serial"] - t["overlapped"]) / comm if comm > 0 else math.nan
            rows.append({"layout": name, "microbatches": m, "dp1_s": t["dp1"], "serial_s": t["serial"],
                         "overlapped_s": t["overlapped"], "reduction_s": comm, "last_backward_s": window,
                         "buckets": buckets, "hidden_predicted": predicted, "hidden_measured": measured,
                         "rounds": args.rounds, "steps": args.steps, "device": "cpu (gloo, 2 processes, 1 thread each)"})
            print(rows[-1])
    RESULTS.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(rows).to_csv(RESULTS / "overlap.csv", index=False)


def _parameter_bytes(profile: Path) -> float:
    """fp32 gradient bytes of the whole model (what ZeRO 0 all-reduces)."""
    from planner.profile_schema import load_profile

    return 4.0 * sum(u.num_parameters for u in load_profile(profile).units)


if __name__ == "__main__":
    main()
