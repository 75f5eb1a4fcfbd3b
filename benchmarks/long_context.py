"""Long sequences: what the solver chooses for Llama 3 8B and 70B at 8k to 128k tokens on H100s.

For each (model, sequence length, GPUs) an analytic profile of the public config
(examples/hf/, `max_position_embeddings` raised to the sequence) on an H100 roofline, bf16,
then a free solve with a global batch of one sequence per GPU (so nothing forces CP but memory): the
context-parallel degree, TP, recomputation and the predicted step time and memory per
sequence length. Context parallelism (planner/cost/cp.py) is the dimension that divides one
sequence's activations; the runtime runs it with dp, tp, and pp under gpipe or 1f1b, with
all-gather or ring attention (`Layout.cp_algorithm`), and the search offers all of these. Writes benchmarks/results/long_context.{csv,png}.

    python benchmarks/long_context.py
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
CASES = [("llama3-8b", 8), ("llama3-70b", 64)]
SEQUENCES = [8192, 32768, 65536, 131072]


def main() -> pd.DataFrame:
    import planner.hf_config_model as hf

    rows = []
    for model, gpus in CASES:
        for seq in SEQUENCES:
            started = time.perf_counter()
            prof = profile_model(hf.__file__, {"config": str(ROOT / "examples" / "hf" / f"{model}.json"), "seq_len": seq,
                                               "max_position_embeddings": seq}, [1], device="meta", gpu="h100-80gb",
                                 dtype="bfloat16", precision="pure")
            batch = gpus
            row = {"model": model, "gpus": gpus, "seq_len": seq, "global_batch": batch}
            try:
                plan = solve(prof, make_cluster(gpus, 8, "h100-80gb"), batch, top_k=1)
            except PlannerError as error:
                rows.append({**row, "layout": f"no plan: {error.message[:100]}"})
                print(rows[-1], flush=True)
                continue
            lay = plan.layout
            rows.append({**row, "cp": lay.cp_degree, "cp_algorithm": lay.cp_algorithm, "tp": lay.tp_degree, "pp": lay.pp_degree, "dp": lay.dp_degree,
                         "sequence_parallel": lay.sequence_parallel, "zero": lay.zero_stage,
                         "recompute": "/".join(sorted({s.recompute for s in plan.stages})),
                         "iteration_s": plan.prediction.iteration_time_s, "mfu": plan.prediction.mfu,
                         "peak_memory_gib": max(plan.prediction.peak_memory_bytes) / 2**30,
                         "cp_comm_s": plan.prediction.breakdown_s.get("cp_comm", 0.0),
                         "seconds_to_plan": time.perf_counter() - started})
            print({k: rows[-1][k] for k in ("model", "seq_len", "cp", "cp_algorithm", "tp", "pp", "recompute", "iteration_s", "peak_memory_gib")},
                  flush=True)
    frame = pd.DataFrame(rows)
    RESULTS.mkdir(parents=True, exist_ok=True)
    frame.to_csv(RESULTS / "long_context.csv", index=False)
    plot(frame, RESULTS / "long_context.png")
    return frame


def plot(frame: pd.DataFrame, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for (model, gpus), part in frame.dropna(subset=["iteration_s"]).groupby(["model", "gpus"]):
        ax.plot(part["seq_len"], part["iteration_s"], "o-", label=f"{model} on {gpus} H100s")
        for r in part.itertuples():
            ax.annotate(f"cp{int(r.cp)} tp{int(r.tp)} {r.recompute}", (r.seq_len, r.iteration_s), fontsize=6)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("tokens per sequence")
    ax.set_ylabel("predicted step time (s)")
    ax.set_title("Long sequences: the solver's layout (annotated) and step time")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
