"""The whole product on the bundled GPT example, on this machine's CPU (README's `make demo`).

    profile (measured, CPU) -> measure gloo -> solve for 2 processes (one per core) -> run -> predicted vs measured

Each step is the same command a user would type; the files land under runs/demo/.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "runs" / "demo"
MODEL = ["examples/gpt.py", "-a", "n_layers=4", "-a", "d_model=64", "-a", "n_heads=4", "-a", "d_ff=256",
         "-a", "vocab_size=256", "-a", "seq_len=32"]


def planner(*args: str) -> None:
    command = [sys.executable, "-m", "planner.cli", *args]
    print("\n$ planner " + " ".join(args), flush=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, cwd=ROOT, env=env, timeout=900)
    if done.returncode != 0:
        sys.exit(f"demo step failed: planner {' '.join(args)}")


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    profile, plan, metrics = OUT / "gpt-cpu.json", OUT / "plan.json", OUT / "metrics.json"
    planner("profile", *MODEL, "--micro-batch-sizes", "1,2,4,8", "--device", "cpu", "--output", str(profile))
    cluster = OUT / "cluster.yaml"
    planner("profile-cluster", "--nproc", "2", "--max-bytes", str(4 * 2**20), "--time-budget", "10", "--output", str(cluster))
    planner("solve", "--profile", str(profile), "--cluster", str(cluster), "--global-batch", "16",
            "--output", str(plan), "--top", "5")
    planner("show", str(plan), "--gantt", str(OUT / "schedule.png"))
    planner("run", str(plan), "--steps", "8", "--output", str(metrics))
    planner("validate", str(plan), str(metrics))


if __name__ == "__main__":
    main()
