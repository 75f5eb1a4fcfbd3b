"""Runtime overhead: `planner run` against the same layout written directly against torch.

For each layout, on gloo CPU processes (one thread each): our runtime runs a hand-written
plan (`planner run PLAN`), and benchmarks/plain_torch.py runs the same model, batch,
micro-batching and optimizer as a user would write it (plain DDP; a plain
`torch.distributed.pipelining` Schedule1F1B over `nn.Sequential` stages with the plan's
cuts). The ratio of median step times is the price of the planner's runtime (stage
replay, per-stage timers, metrics). Goal: <= 1.05. Runs alternate (ours, plain, ours, ...)
so that drifting machine load hits both alike; the median over rounds is reported.

A second, in-process measurement isolates the one thing our pipeline does that the plain one
does not, replaying the model's forward per stage (runtime/pp_split.py): each pp2 stage
module's forward + backward on one micro-batch against `nn.Sequential` of the same units,
alternating, best of several repeats (single process, so far less noisy than the runs).

Writes benchmarks/results/runtime_overhead.{csv,png} and runtime_overhead_stages.csv.

    python benchmarks/runtime_overhead.py [--steps 12] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import pandas as pd

from planner.metrics_schema import load_metrics
from planner.plan import Batch, ClusterRef, Layout, ModelRef, Plan, Stage, stage_ranks

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
MODEL_FILE = ROOT / "examples" / "gpt.py"
ARGS = dict(n_layers=4, d_model=128, n_heads=4, d_ff=512, vocab_size=512, seq_len=64)
UNITS = ["embed"] + [f"blocks.{i}" for i in range(ARGS["n_layers"])] + ["norm", "head"]
GLOBAL_BATCH, MICRO_BATCH = 16, 2
# name -> (layout, stage boundaries as unit indices)
CASES = {
    "dp2": (Layout(dp_degree=2), [0, len(UNITS)]),
    "pp2-1f1b": (Layout(pp_degree=2, schedule="1f1b"), [0, 3, len(UNITS)]),
}
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def make_plan(layout: Layout, cuts: list[int]) -> Plan:
    stages = [Stage(units=UNITS[lo:hi], ranks=stage_ranks(layout, k)) for k, (lo, hi) in enumerate(zip(cuts[:-1], cuts[1:]))]
    m = GLOBAL_BATCH // (layout.dp_degree * MICRO_BATCH)
    return Plan(model=ModelRef(file=str(MODEL_FILE), args=ARGS),
                cluster=ClusterRef(name="cpu", gpus_per_node=layout.world_size, gpu="cpu"),
                batch=Batch(global_batch_size=GLOBAL_BATCH, micro_batch_size=MICRO_BATCH, num_microbatches=m),
                layout=layout, stages=stages)


def _run(command: list[str]) -> None:
    done = subprocess.run(command, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    if done.returncode:
        sys.exit(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")


def ours(plan_path: Path, steps: int, out: Path) -> float:
    metrics = out / "ours.json"
    _run([sys.executable, "-m", "planner.cli", "run", str(plan_path), "--steps", str(steps), "--output", str(metrics)])
    return load_metrics(metrics).median_iteration_time_s


def plain(layout: Layout, cuts: list[int], steps: int, out: Path) -> float:
    result = out / "plain.json"
    kind = "pp" if layout.pp_degree > 1 else "dp"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(layout.world_size),
               str(ROOT / "benchmarks" / "plain_torch.py"), kind, "--model-file", str(MODEL_FILE),
               *[x for k, v in ARGS.items() for x in ("-a", f"{k}={v}")],
               "--global-batch", str(GLOBAL_BATCH), "--micro-batch", str(MICRO_BATCH),
               "--units", ",".join(UNITS), "--cuts", ",".join(map(str, cuts)), "--steps", str(steps), "--output", str(result)]
    _run(command)
    return json.loads(result.read_text())["median_iteration_time_s"]  # plain_torch.py's own two-field file


def stage_replay_overhead(repeats: int = 7, calls: int = 30) -> list[dict]:
    """Per pp2 stage: best-of-`repeats` mean fwd+bwd seconds of our stage module and of nn.Sequential."""
    import time

    import torch
    from torch import nn

    from planner.model_file import load_model_file
    from runtime.apply_pp import build_stage_modules
    from runtime.build import init_mode, materialize
    from runtime.pp_split import set_example_microbatch

    torch.set_num_threads(1)
    mf = load_model_file(str(MODEL_FILE), ARGS)
    layout, cuts = CASES["pp2-1f1b"]
    plan = make_plan(layout, cuts)
    with torch.device("meta"):
        meta = mf.build_model()
    inputs, _ = mf.make_batch(MICRO_BATCH)
    torch.manual_seed(0)
    whole = mf.build_model()
    rows, x = [], inputs
    for rank in range(layout.pp_degree):
        [(_, ours_module)] = build_stage_modules(meta, plan, rank, (inputs,))
        materialize(ours_module, 0, torch.device("cpu"), init_mode(meta), mf)
        set_example_microbatch(ours_module, (inputs,))
        plain_module = nn.Sequential(*(whole.get_submodule(u) for u in UNITS[cuts[rank]:cuts[rank + 1]]))
        x = x.detach().requires_grad_() if x.is_floating_point() else x

        def step(module, x=x):
            out = module(x)
            (out[0] if isinstance(out, tuple) else out).sum().backward()

        best = {"ours": float("inf"), "plain": float("inf")}
        for _ in range(repeats):
            for name, module in (("ours", ours_module), ("plain", plain_module)):
                start = time.perf_counter()
                for _ in range(calls):
                    step(module)
                best[name] = min(best[name], (time.perf_counter() - start) / calls)
        rows.append({"stage": rank, "units": ",".join(UNITS[cuts[rank]:cuts[rank + 1]]), "ours_fwd_bwd_s": best["ours"],
                     "plain_fwd_bwd_s": best["plain"], "ratio": best["ours"] / best["plain"]})
        x = plain_module(x)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        for name, (layout, cuts) in CASES.items():
            plan_path = make_plan(layout, cuts).save(out / f"{name}.json")
            ours_s, plain_s = [], []
            for _ in range(args.rounds):
                ours_s.append(ours(plan_path, args.steps, out))
                plain_s.append(plain(layout, cuts, args.steps, out))
            row = {"layout": name, "world_size": layout.world_size, "micro_batches": GLOBAL_BATCH // (layout.dp_degree * MICRO_BATCH),
                   "ours_step_s": statistics.median(ours_s), "plain_step_s": statistics.median(plain_s),
                   "ours_rounds_s": ";".join(f"{x:.5f}" for x in ours_s), "plain_rounds_s": ";".join(f"{x:.5f}" for x in plain_s)}
            row["ratio"] = row["ours_step_s"] / row["plain_step_s"]
            row["ratio_of_best"] = min(ours_s) / min(plain_s)  # less sensitive to load from elsewhere
            rows.append(row)
            print(f"{name:>10}: ours {row['ours_step_s'] * 1e3:.1f} ms, plain torch {row['plain_step_s'] * 1e3:.1f} ms, "
                  f"ratio {row['ratio']:.3f} (best rounds: {row['ratio_of_best']:.3f})", flush=True)
    stages = pd.DataFrame(stage_replay_overhead())
    print(stages.to_string(index=False))
    frame = pd.DataFrame(rows)
    RESULTS.mkdir(parents=True, exist_ok=True)
    stages.to_csv(RESULTS / "runtime_overhead_stages.csv", index=False)
    frame.to_csv(RESULTS / "runtime_overhead.csv", index=False)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.bar(frame["layout"], frame["ratio"], color="#4C72B0")
    ax.axhline(1.0, color="black", lw=0.8)
    ax.axhline(1.05, color="#C44E52", ls="--", lw=0.8, label="goal 1.05")
    ax.set_ylabel("step time, ours / plain torch")
    ax.set_title(f"Runtime overhead (gloo CPU, GPT {ARGS['n_layers']}x{ARGS['d_model']})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(RESULTS / "runtime_overhead.png", dpi=120)


if __name__ == "__main__":
    main()
