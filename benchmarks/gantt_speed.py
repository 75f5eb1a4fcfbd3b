"""How long `planner show PLAN --gantt` takes, from a small plan to a 1024-GPU one (issue #17).

Profiles GPT-2 medium and GPT-3 175B (Brown et al. 2020, table 2.1) on the meta device with
A100 rooflines, solves a plan per row of PLANS (some layouts pinned), then times the whole
command (interpreter start, plan load, simulation, drawing) as a user runs it, best of
--repeats. Writes
benchmarks/results/gantt_speed.csv and each chart as benchmarks/results/gantt_speed_<name>.png.

    python benchmarks/gantt_speed.py
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
MODELS = {
    "gpt2-medium": {"n_layers": 24, "d_model": 1024, "n_heads": 16, "d_ff": 4096, "vocab_size": 50257, "seq_len": 1024},
    "gpt3-175b": {"n_layers": 96, "d_model": 12288, "n_heads": 96, "d_ff": 49152, "vocab_size": 51200, "seq_len": 2048},
}
PIN_ISSUE_17 = ("--pp", "16", "--micro-batch", "1", "--schedule", "zero-bubble")
"""The plan of issue #17 (pp 16 x 512 micro-batches), pinned so solver changes keep it."""
PLANS = [  # (name, model, GPUs, global batch, pins passed to `planner solve`)
    ("small", "gpt2-medium", 8, 64, ("--pp", "2")),
    # Issue #17's plan ran on 64 GPUs; since the receive buffers torch's pipelining keeps per
    # micro-batch are priced (planner/cost/memory.py `p2p_buffer_bytes`: 512 of them, 12-24 GiB a
    # rank at tp 4) it fits on 128 (tp 8), with the same 16 rows x 512 micro-batches.
    ("gpt3-128gpu", "gpt3-175b", 128, 512, PIN_ISSUE_17),
    ("gpt3-1024gpu", "gpt3-175b", 1024, 1536, ()),
    # Stress: 32 rows x 2048 micro-batches x 3 kinds = 196608 actions.
    ("gpt3-1024gpu-pp32-m2048", "gpt3-175b", 1024, 8192,
     ("--pp", "32", "--tp", "8", "--micro-batch", "1", "--schedule", "zero-bubble")),
]
GPU = "a100-80gb"


def planner(*args: str) -> None:
    cmd = [sys.executable, "-m", "planner.cli", *args]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    if done.returncode:
        raise RuntimeError(f"{' '.join(args)} failed:\n{done.stdout}\n{done.stderr}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "gantt_speed",
                        help="Where profiles and plans are kept between runs.")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    rows = []
    for name, model, gpus, batch, pins in PLANS:
        profile = args.work / f"{model}.json"
        if not profile.exists():
            planner("profile", "examples/gpt.py", "--device", "meta", "--gpu", GPU, "--dtype", "bfloat16",
                    *[x for k, v in MODELS[model].items() for x in ("-a", f"{k}={v}")], "-o", str(profile))
        plan_path = args.work / f"{name}.json"
        if not plan_path.exists():
            planner("solve", "--profile", str(profile), "--gpus", str(gpus), "--gpu", GPU, "--global-batch", str(batch),
                    *pins, "-o", str(plan_path))
        png = RESULTS / f"gantt_speed_{name}.png"
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            planner("show", str(plan_path), "--gantt", str(png))
            times.append(time.perf_counter() - start)
        plan = json.loads(plan_path.read_text())
        lay, m = plan["layout"], plan["batch"]["num_microbatches"]
        actions_per_chunk = 3 if lay["schedule"] == "zero-bubble" else 2  # F, B, W or F, BW
        rows.append({"plan": name, "model": model, "gpus": gpus, "global_batch": batch, "pp": lay["pp_degree"],
                     "dp": lay["dp_degree"], "tp": lay["tp_degree"], "schedule": lay["schedule"],
                     "virtual_stages": lay["virtual_stages"], "microbatches": m,
                     "actions": actions_per_chunk * m * lay["pp_degree"] * lay["virtual_stages"],
                     "show_gantt_s": min(times), "png_bytes": png.stat().st_size})
        print(rows[-1], flush=True)
    pd.DataFrame(rows).to_csv(RESULTS / "gantt_speed.csv", index=False)
    print(f"wrote {RESULTS / 'gantt_speed.csv'}")


if __name__ == "__main__":
    main()
