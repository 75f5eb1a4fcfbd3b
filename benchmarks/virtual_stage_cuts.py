"""Stage cuts with virtual stages: the DP alone against the DP with its cuts leveled across ranks.

With v > 1 chunks per pipeline rank the schedules pay the busiest rank's chunks together and a
rank's chunks share its memory; the stage DP (planner/solver/inter_op.py) sees chunks one by
one. planner/solver/search.py `evaluate_config` therefore levels the DP's cuts across the ranks
(`level_ranks`) and, where a rank's chunks overflow it together, chooses that rank's
recomputation modes together (`_refit_ranks`) before falling back to holding each chunk to 1/v
of the memory; every candidate is priced and the fastest kept. This script prices pinned
configurations both ways, all by the same cost model: `dp_only_s` with those two steps
switched off (patched out here, the search has no switch for them), `leveled_s` as the solver
prices them. GPT-3 175B (examples/gpt.py, 96 layers, analytic profile, bfloat16 computed end
to end, A100-80GB) on 64 GPUs, tp 4 with sequence parallelism, pp 8, dp 2, ZeRO 1, global
batch 1536, micro-batch 1: interleaved 1F1B and zero bubble at v = 2..12, at the solver's
memory fraction (90%) and at 95%. Writes benchmarks/results/virtual_stage_cuts.csv.

    python benchmarks/virtual_stage_cuts.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from planner.cluster import make_cluster  # noqa: E402
from planner.profiler import profile_model  # noqa: E402
from planner.solver import search  # noqa: E402
from planner.solver.solve import price_config  # noqa: E402

GPT3 = dict(n_layers=96, d_model=12288, n_heads=96, d_ff=49152, vocab_size=51200, seq_len=2048)


def _price(profile, cluster, cfg, fraction: float, dp_only: bool) -> float:
    keep = search.level_ranks, search._refit_ranks
    if dp_only:
        search.level_ranks = lambda cost, bounds, *args, **kwargs: (tuple(bounds), 0.0)
        search._refit_ranks = lambda *args, **kwargs: None
    try:
        evaluation = price_config(profile, cluster, cfg, memory_fraction=fraction)
    finally:
        search.level_ranks, search._refit_ranks = keep
    return evaluation.iteration_time_s if evaluation.feasible else float("inf")


def main() -> None:
    profile = profile_model(str(ROOT / "examples" / "gpt.py"), GPT3, [1], device="meta", gpu="a100-80gb",
                            dtype="bfloat16", precision="pure")
    cluster = make_cluster(64, None, "a100-80gb")
    rows = []
    for fraction in (0.9, 0.95):
        for schedule in ("interleaved-1f1b", "zero-bubble"):
            for v in range(2, 13):
                cfg = search.Config(tp=4, sequence_parallel=True, pp=8, dp=2, micro_batch_size=1, num_microbatches=768,
                                    schedule=schedule, virtual_stages=v, zero_stage=1)
                dp_only, leveled = (_price(profile, cluster, cfg, fraction, flag) for flag in (True, False))
                rows.append(dict(memory_fraction=fraction, schedule=schedule, virtual_stages=v, dp_only_s=dp_only,
                                 leveled_s=leveled, change=leveled / dp_only - 1 if dp_only < float("inf") else None))
                print(f"{fraction:.2f} {schedule:17s} v={v:2d}  DP alone {dp_only:9.3f} s  leveled {leveled:9.3f} s", flush=True)
    table = pd.DataFrame(rows)
    out = ROOT / "benchmarks" / "results" / "virtual_stage_cuts.csv"
    table.to_csv(out, index=False)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
