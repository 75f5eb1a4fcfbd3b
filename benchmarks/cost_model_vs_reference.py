"""Predicted iteration time of each Megatron-LM SC21 Table 1 configuration beside the published one.

For every row of shared/reference/megatron_sc21_table1.csv (Narayanan et al. 2021): an
analytic profile of examples/gpt.py at the row's shape (float16, A100-80GB roofline, the
row's micro-batch size, materialised attention and dropout 0.1 as Megatron ran them, and
its fused elementwise kernels: scale-mask-softmax, bias-GeLU, bias-dropout-add, so
`fusion="elementwise"`), a
cluster of the row's GPUs in DGX A100 nodes of 8, and `planner.solver.solve` with every
dimension pinned to the row (tp, pp, dp, micro-batch, interleaving, full recomputation,
no ZeRO, no sequence parallelism): the solver still chooses the stage cuts. No per-row
constant. Writes benchmarks/results/cost_model_vs_reference.{csv,png}.

    python benchmarks/cost_model_vs_reference.py
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import pandas as pd

from planner.cluster import make_cluster
from planner.profiler import profile_model
from planner.solver.solve import Pins, solve

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = ROOT.parent / "shared" / "reference" / "megatron_sc21_table1.csv"
RESULTS = ROOT / "benchmarks" / "results"


def _virtual_stages(text: str) -> int:
    found = re.match(r"(\d+) chunks", str(text))
    return int(found.group(1)) if found else 1


def predict(row) -> dict:
    args = dict(n_layers=int(row.num_layers), d_model=int(row.hidden_size), n_heads=int(row.num_heads),
                d_ff=int(row.ffn_hidden_size), vocab_size=int(row.vocab_size), seq_len=int(row.seq_length),
                attention="math", dropout=0.1)
    started = time.perf_counter()
    prof = profile_model("examples/gpt.py", args, [int(row.micro_batch_size)], device="meta", gpu="a100-80gb", dtype="float16",
                         fusion="elementwise")
    profiled = time.perf_counter() - started
    v = _virtual_stages(row.virtual_pipeline)
    pins = Pins(pp=int(row.pp), tp=int(row.tp), dp=int(row.dp), micro_batch_size=int(row.micro_batch_size),
                schedule="interleaved-1f1b" if v > 1 else "1f1b", virtual_stages=v, recompute="full", zero_stage=0,
                sequence_parallel=False)
    cluster = make_cluster(int(row.num_gpus), int(row.gpus_per_node), "a100-80gb")
    plan = solve(prof, cluster, int(row.global_batch_size_seqs), pins, top_k=1, dtype="float16")
    pred = plan.prediction
    published = float(str(row.iteration_time_s).split()[0])
    return {
        "model": row.model, "gpus": int(row.num_gpus), "tp": int(row.tp), "pp": int(row.pp), "dp": int(row.dp),
        "micro_batch": int(row.micro_batch_size), "virtual_stages": v,
        "published_iteration_s": published, "predicted_iteration_s": pred.iteration_time_s,
        "error": pred.iteration_time_s / published - 1,
        "published_tflops_per_gpu": float(row.throughput_tflops_per_gpu), "predicted_hw_tflops_per_gpu": pred.hw_tflops_per_gpu,
        **{f"{k}_s": v_ for k, v_ in pred.breakdown_s.items()},
        "profile_s": profiled, "solve_s": plan.search["solve_time_s"],
    }


def main() -> None:
    reference = pd.read_csv(REFERENCE)
    rows = []
    for row in reference.itertuples():
        rows.append(predict(row))
        r = rows[-1]
        print(f"{r['model']:>12}  published {r['published_iteration_s']:7.2f} s  predicted {r['predicted_iteration_s']:7.2f} s  "
              f"error {r['error']:+.1%}", flush=True)
    frame = pd.DataFrame(rows)
    RESULTS.mkdir(parents=True, exist_ok=True)
    frame.to_csv(RESULTS / "cost_model_vs_reference.csv", index=False)
    errors = frame["error"].abs()
    print(f"median |error| {errors.median():.1%}, max |error| {errors.max():.1%}, within 15%: {(errors <= 0.15).sum()}/{len(frame)}")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 6))
    ax.scatter(frame["published_iteration_s"], frame["predicted_iteration_s"])
    for r in frame.itertuples():
        ax.annotate(r.model, (r.published_iteration_s, r.predicted_iteration_s), fontsize=7)
    top = max(frame["published_iteration_s"].max(), frame["predicted_iteration_s"].max()) * 1.1
    ax.plot([0, top], [0, top], "k--", lw=0.8, label="exact")
    ax.fill_between([0, top], [0, top * 0.85], [0, top * 1.15], alpha=0.15, label="±15%")
    ax.set_xlabel("published iteration time (s), Megatron-LM SC21 Table 1")
    ax.set_ylabel("predicted iteration time (s)")
    ax.set_title("Cost model vs Megatron-LM on A100-80GB")
    ax.legend()
    fig.tight_layout()
    fig.savefig(RESULTS / "cost_model_vs_reference.png", dpi=120)


if __name__ == "__main__":
    main()
