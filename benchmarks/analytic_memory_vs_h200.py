"""Analytic (meta-device) profiles against what one H200 measured: predicted peak memory and the
bytes each unit saves for backward.

The H200 runs (benchmarks/results/h200/README.md, run 2) trained GPT-2-medium and GPT 1.3B
(examples/gpt.py) with `planner run` on one GPU: fp32 master weights, each forward under torch's
CUDA autocast to bf16, and recorded `torch.cuda.max_memory_allocated` and a measured profile.
Here, on any machine, each model is profiled analytically for an H200 twice, `--precision pure`
(the model converted to bf16, how analytic profiles priced 16 bits before autocast was
emulated) and `--precision autocast` (CUDA autocast's policy applied on meta tensors,
planner/profiler/autocast.py), and the plan that ran (its layout and micro-batch pinned) is
priced from each. Columns: the predicted peak of tensors (fragmentation allowance excluded, as
in the H200 README) against the measured peak, and the sum over units of the bytes saved for
backward at the plan's micro-batch against the measured profile's.

The FP8 run (`gpt-1.3b-fp8`: GPT 1.3B with torchao's Float8Linear, compiled, 16 x 1) is priced
with `float8=True` from the autocast profile, whose units also record what they save with
their linears in FP8 (`UnitCosts.fp8_saved_bytes`: FP8 inputs, no 16-bit copies; planner/profiler/
measure.py `Float8Saves`). Its `saved` columns compare that FP8 figure with the measured bf16
profile's (the H200 recorded no per-unit FP8 profile), so they show the difference FP8 makes,
not an error. Before `fp8_saved_bytes` the FP8 plan was priced from the bf16 figure: 105.5 GiB
predicted against 87.6 measured (+20%, the README).

Writes benchmarks/results/analytic_memory_vs_h200.csv.
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from planner.cluster import make_cluster
from planner.cost.fp8 import output_head
from planner.profiler import profile_model
from planner.solver.solve import Pins, solve

ROOT = Path(__file__).resolve().parents[1]
RUNS = ROOT / "benchmarks" / "results" / "h200" / "run2"
OUT = ROOT / "benchmarks" / "results" / "analytic_memory_vs_h200.csv"


def row(model: str, precision: str) -> dict:
    float8 = model.endswith("-fp8")
    measured_profile = json.loads((RUNS / f"pvm-cuda-h200-bfloat16-1-{model}-chain0-profile.json").read_text())
    plan = json.loads((RUNS / f"pvm-cuda-h200-bfloat16-1-{model}-chain0-plan.json").read_text())
    measured = pd.read_csv(RUNS / f"predicted_vs_measured_cuda-h200-bfloat16-1-{model}.csv").iloc[0]
    batch = plan["batch"]
    b = batch["micro_batch_size"]
    prof = profile_model(str(ROOT / "examples" / "gpt.py"), measured_profile["model"]["args"],
                         measured_profile["micro_batch_sizes"], device="meta", gpu="h200", dtype="bfloat16",
                         precision=precision)
    priced = solve(prof, make_cluster(1, 1, "h200"), batch["global_batch_size"],
                   Pins(pp=1, tp=1, dp=1, micro_batch_size=b, schedule="1f1b", recompute="none", zero_stage=0),
                   float8=float8)
    terms = priced.prediction.memory_terms_bytes[0]
    predicted = sum(v for k, v in terms.items() if k != "fragmentation")
    # The plan's micro-batch may lie past the profiled sizes (16 for the FP8 run): the sums below
    # are then taken at the largest profiled size and scaled, as the cost tables extrapolate.
    at = b if b in prof.micro_batch_sizes else max(prof.micro_batch_sizes)
    head = output_head(prof)
    saved = sum((c.fp8_saved_bytes if float8 and c.fp8_saved_bytes is not None and u.name != head else c.saved_bytes)
                for u in prof.units for c in [u.costs[at]]) * b / at
    saved_gpu = sum(u["costs"][str(at)]["saved_bytes"] for u in measured_profile["units"]) * b / at
    return dict(model=model, precision=precision, micro_batch=b, num_microbatches=batch["num_microbatches"],
                predicted_peak_bytes=predicted, measured_peak_bytes=int(measured.measured_peak_memory_bytes),
                peak_error=predicted / measured.measured_peak_memory_bytes - 1,
                predicted_activations_bytes=terms["activations"], saved_bytes_per_microbatch=saved,
                measured_saved_bytes_per_microbatch=saved_gpu, saved_error=saved / saved_gpu - 1)


def main() -> None:
    frame = pd.DataFrame([row(m, p) for m in ("gpt2-medium", "gpt-1.3b") for p in ("pure", "autocast")]
                         + [row("gpt-1.3b-fp8", "autocast")])
    OUT.write_text(frame.to_csv(index=False))
    with pd.option_context("display.width", 200, "display.max_columns", 20):
        print(frame[["model", "precision", "predicted_peak_bytes", "measured_peak_bytes", "peak_error", "saved_error"]])
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
