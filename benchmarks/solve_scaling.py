"""How long `planner solve` takes: GPT-3 175B on 8 to 1024 A100-80GB GPUs, and 24 to 192 layers.

Profiles are analytic (meta device, A100-80GB roofline, bf16, micro-batch sizes 1, 2, 4);
the solve time excludes profiling (a profile is made once and solved many times). Goal on
the project's 2-core machine: under 1 s for 8 GPUs, under 10 s for 1024 GPUs.
Writes benchmarks/results/solve_scaling.{csv,png}.

    python benchmarks/solve_scaling.py
"""

from __future__ import annotations

import time
from pathlib import Path

import pandas as pd

from planner.cluster import make_cluster
from planner.errors import PlannerError
from planner.profiler import profile_model
from planner.solver.solve import solve

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
GPT3 = dict(d_model=12288, n_heads=96, d_ff=49152, vocab_size=51200, seq_len=2048)
GLOBAL_BATCH = 1536


def run(n_layers: int, gpus: int, profiles: dict) -> dict:
    if n_layers not in profiles:
        started = time.perf_counter()
        profiles[n_layers] = (profile_model("examples/gpt.py", dict(GPT3, n_layers=n_layers), [1, 2, 4], device="meta",
                                            gpu="a100-80gb", dtype="bfloat16"), time.perf_counter() - started)
    prof, profile_s = profiles[n_layers]
    started = time.perf_counter()
    try:
        plan = solve(prof, make_cluster(gpus, 8, "a100-80gb"), GLOBAL_BATCH, top_k=3)
    except PlannerError as exc:  # a cluster too small for the model is an answer too, and timed
        return {"n_layers": n_layers, "gpus": gpus, "solve_s": time.perf_counter() - started, "profile_s": profile_s,
                "layout": f"no plan: {exc.message}"}
    solve_s = time.perf_counter() - started
    lay = plan.layout
    return {
        "n_layers": n_layers, "gpus": gpus, "solve_s": solve_s, "profile_s": profile_s,
        "candidates_evaluated": plan.search["candidates_evaluated"],
        "layout": f"pp{lay.pp_degree} dp{lay.dp_degree} tp{lay.tp_degree}{' sp' if lay.sequence_parallel else ''} "
                  f"zero{lay.zero_stage} {lay.schedule} v{lay.virtual_stages} mbs{plan.batch.micro_batch_size}",
        "recompute": ",".join(sorted({s.recompute for s in plan.stages})),
        "iteration_s": plan.prediction.iteration_time_s, "mfu": plan.prediction.mfu,
    }


def main() -> None:
    profiles: dict = {}
    cases = [(96, g) for g in (8, 64, 512, 1024)] + [(24, 512), (192, 512)]
    rows = []
    for n_layers, gpus in cases:
        rows.append(run(n_layers, gpus, profiles))
        print(rows[-1], flush=True)
    frame = pd.DataFrame(rows)
    RESULTS.mkdir(parents=True, exist_ok=True)
    frame.to_csv(RESULTS / "solve_scaling.csv", index=False)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sweep = frame[frame.n_layers == 96].dropna(subset=["solve_s"])
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(sweep["gpus"], sweep["solve_s"], "o-")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("A100-80GB GPUs (8 per node)")
    ax.set_ylabel("solve time (s)")
    ax.set_title("planner solve, GPT-3 175B, global batch 1536")
    fig.tight_layout()
    fig.savefig(RESULTS / "solve_scaling.png", dpi=120)


if __name__ == "__main__":
    main()
