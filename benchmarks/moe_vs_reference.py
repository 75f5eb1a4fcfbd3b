"""A published mixture-of-experts run beside the cost model: Qwen3-235B-A22B on 256 H100s.

The reference (shared/reference/moe_qwen3_235b.csv, read its README): Megatron-Core, 94
layers, d_model 4096, 64 query / 4 KV heads of dim 128, 128 experts of width 1536, top-8,
vocab 151936, sequence 4096, BF16; TP2 x EP8 x PP32 with 3 virtual stages, DP4, micro-batch 1,
global batch 2048, the plain all-to-all token dispatcher, balanced routing: 24.2 s per step.

The model is `examples/hf/qwen3-235b-a22b.json` (the public config's shape) profiled on the
meta device for an H100 (`planner profile --hf-config`), its experts recognised by structure
(planner/moe.py). Three rows:

1. **published layout**: exactly the reference's degrees (planner/solver/solve.py
   `price_config`), the stage cuts and recomputation chosen by the DP. EP 8 over DP 4 x TP 2 is
   Megatron-Core's parallel folding (EP groups span the TP ranks, which sequence parallelism
   gives different tokens): priced by planner/cost/moe.py, searched, and run by the runtime
   (runtime/apply_ep.py, runtime/mesh.py `build_ep_mesh(fold_tp=True)`).
2. **best with EP 8**: the search with EP pinned to the published degree and everything else
   free (the best layout that spreads the experts as the reference does).
3. **free choice**: the search with nothing pinned.

Megatron-Core's overlaps (gradient reduce and parameter gather bucketed, pipeline p2p) are the
GPU default of the search (planner/cost/overlap.py). Writes
benchmarks/results/moe_vs_reference.{csv,png}.

    python benchmarks/moe_vs_reference.py
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import pandas as pd

from planner.cluster import make_cluster
from planner.engines.megatron import MEMORY_HABITS as MEGATRON_MEMORY
from planner.engines.megatron import gradient_dtype, stack_gpu
from planner.errors import PlannerError
from planner.hardware import GPUS, get_gpu
from planner.profiler import profile_model
from planner.solver.plan_builder import why_lost
from planner.solver.search import Config, Evaluation
from planner.solver.solve import Pins, price_config, search

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = ROOT.parent / "shared" / "reference" / "moe_qwen3_235b.csv"
RESULTS = ROOT / "benchmarks" / "results"
CONFIG = ROOT / "examples" / "hf" / "qwen3-235b-a22b.json"


MEGATRON_H100 = stack_gpu(GPUS["h100-80gb"])
"""The H100 as Megatron-Core's runs price it (planner/engines/megatron.py `stack_gpu`: Transformer
Engine's attention as its published H100 runs show it)."""


def profile(seq_len: int):
    import planner.hf_config_model as hf

    return profile_model(hf.__file__, {"config": str(CONFIG), "seq_len": seq_len}, [1], device="meta", gpu=MEGATRON_H100,
                         dtype="bfloat16", precision="pure")


def published_config(row) -> Config:
    local = row.gbs // row.dp
    return Config(tp=row.tp, sequence_parallel=row.tp > 1, pp=row.pp, dp=row.dp, micro_batch_size=row.mbs,
                  num_microbatches=local // row.mbs, schedule="interleaved-1f1b" if row.vpp > 1 else "1f1b",
                  virtual_stages=row.vpp, zero_stage=1, ep=row.ep)


def record(name: str, e: Evaluation, published_s: float, solve_s: float, why: str) -> dict:
    c = e.config
    return {
        "case": name, "layout": c.describe(), "tp": c.tp, "pp": c.pp, "dp": c.dp, "ep": c.ep, "sp": c.sequence_parallel,
        "virtual_stages": c.virtual_stages, "zero": c.zero_stage, "micro_batch": c.micro_batch_size,
        "recompute": "/".join(sorted(set(e.stage_recompute))), "predicted_s": e.iteration_time_s,
        "published_s": published_s, "error_vs_published": e.iteration_time_s / published_s - 1,
        "peak_memory_gib": max(e.peak_memory_bytes) / 2**30, **{f"{k}_s": float(v) for k, v in e.breakdown_s.items()},
        "solve_s": solve_s, "why_it_differs": why,
    }


def plot(frame: pd.DataFrame, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    terms = [c for c in frame.columns if c.endswith("_s") and c not in ("predicted_s", "published_s", "solve_s")]
    fig, ax = plt.subplots(figsize=(10, 4))
    left = [0.0] * len(frame)
    for term in terms:
        values = frame[term].fillna(0.0).tolist()
        ax.barh(frame["case"], values, left=left, label=term[:-2])
        left = [a + b for a, b in zip(left, values, strict=True)]
    ax.axvline(frame["published_s"].iloc[0], color="k", ls="--", label="published (24.2 s)")
    ax.set_xlabel("seconds per step (busiest pipeline rank)")
    ax.set_title("Qwen3-235B-A22B on 256 H100s: published vs predicted")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> pd.DataFrame:
    row = next(pd.read_csv(REFERENCE).itertuples())
    started = time.perf_counter()
    prof = profile(int(row.seq))
    print(f"profiled in {time.perf_counter() - started:.1f} s")
    cluster = replace(make_cluster(int(row.num_gpus), 8, row.gpu), gpu=stack_gpu(get_gpu(row.gpu)))
    published = float(row.step_time_s)
    tick = time.perf_counter()
    # Megatron-Core's vocab-parallel cross-entropy is fused (planner/cost/memory.py `loss_bytes`), its
    # FusedAdam steps in place and its pipeline receives one micro-batch at a time (planner/solver/
    # search.py `Environment`); in bf16 it accumulates and reduces gradients in fp32 (`gradient_dtype`),
    # the accumulation fused into the weight-gradient GEMMs (--gradient-accumulation-fusion, its default).
    theirs = price_config(prof, cluster, published_config(row),
                          Pins(loss_kernel="fused", grad_dtype=gradient_dtype("bfloat16"), grad_accumulation="fused",
                               **MEGATRON_MEMORY))  # the row: bf16
    rows = [record("published layout", theirs, published, time.perf_counter() - tick, "")]
    for name, pins in ((f"best with EP {row.ep}", Pins(ep=int(row.ep))), ("free choice", Pins())):
        tick = time.perf_counter()
        try:
            result = search(prof, cluster, int(row.gbs), pins, keep=1)
        except PlannerError as error:
            print(f"{name}: {error}")
            continue
        if not result.ranked:
            print(f"{name}: nothing fits")
            continue
        best = result.ranked[0]
        faster = best.iteration_time_s <= theirs.iteration_time_s
        why = why_lost(theirs, best) if faster else why_lost(best, theirs)
        rows.append(record(name, best, published, time.perf_counter() - tick,
                           ("published layout " if faster else "this layout ") + why))
    frame = pd.DataFrame(rows)
    RESULTS.mkdir(parents=True, exist_ok=True)
    frame.to_csv(RESULTS / "moe_vs_reference.csv", index=False)
    plot(frame, RESULTS / "moe_vs_reference.png")
    for r in frame.itertuples():
        print(f"{r.case:>17}: {r.layout:<60} {r.predicted_s:6.2f} s ({r.error_vs_published:+.1%} vs published "
              f"{r.published_s} s), {r.peak_memory_gib:.1f} GiB, recompute {r.recompute}  {r.why_it_differs}")
    return frame


if __name__ == "__main__":
    main()
