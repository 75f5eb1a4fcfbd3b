"""PipeDream-2BW's predicted speed-up over the best 1F1B plan, and what it costs in memory.

For GPT-3-like models (the pipelined rows of shared/reference/megatron_sc21_table1.csv:
Narayanan et al. 2021's shapes, GPU counts, global batches, pp and tp), an analytic profile
of examples/gpt.py (float16 on A100-80GB, as benchmarks/plan_quality.py makes them), then two
solves with the published pp and tp pinned, everything else (micro-batch, cuts, ZeRO,
recomputation) left to the search:

- `one_f_one_b_s`: the best plan with the 1F1B schedule (PipeDream-Flush: a bubble of
  (p - 1) / (m + p - 1) of the step);
- `pipedream_2bw_s`: the best plan with pipedream-2bw (`--allow-async`), and `speedup` =
  one_f_one_b_s / pipedream_2bw_s. 2BW is priced as it runs (planner/cost/schedules.py): without
  a bubble only on the layouts runtime/pp_async.py `train_flush_free` runs, those planner/plan.py
  `flush_free_blocker` passes (one stage per rank, ZeRO 0, no offload, CP or stage replication,
  activations not sent as TP slices); elsewhere as the flushed 1F1B it runs as, plus its stashed
  weights, so it never beats 1F1B there. Here the search picks ZeRO 0 with sequence parallelism
  (tp 8 spans a node, and without SP the activations would cross nodes as TP slices, which the
  flush-free executor does not run); `pipedream_2bw_runs` says "flush-free" or why not;
- `extra_memory_bytes`: on the 2BW plan's configuration, its largest per-stage peak less the
  same configuration's under 1F1B (`price_config`): the stashed weight version
  (planner/cost/memory.py `stashed_weight_bytes`), the stage with the most weights.

All predicted by the cost model; none of it is measured. The asynchronous schedule changes
the optimisation (W(t+1) = W(t) - lr grad f(W(t-1)), planner/plan.py `Schedule`): a speed-up
here is not a like-for-like comparison of what is trained. `async_rows()` returns the table
(benchmarks/pipedream.py includes it); run as a script it writes
benchmarks/results/pipedream_async.{csv,png}.

    python benchmarks/pipedream_async.py
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pandas as pd

from planner.cluster import make_cluster
from planner.errors import PlannerError
from planner.plan import flush_free_blocker
from planner.profiler import profile_model
from planner.solver.search import Config
from planner.solver.solve import Pins, price_config, solve

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = ROOT.parent / "shared" / "reference" / "megatron_sc21_table1.csv"
RESULTS = ROOT / "benchmarks" / "results"
MODELS = ("GPT 39.1B", "GPT 76.1B", "GPT 145.6B")
"""The Megatron table's rows run: the smallest pipelined ones (pp 2, 4 and 8; the larger take minutes to solve)."""


def _config(plan) -> Config:
    """The search's configuration of a solved plan."""
    lay, batch = plan.layout, plan.batch
    return Config(tp=lay.tp_degree, sequence_parallel=lay.sequence_parallel, pp=lay.pp_degree, dp=lay.dp_degree,
                  micro_batch_size=batch.micro_batch_size, num_microbatches=batch.num_microbatches, schedule=lay.schedule,
                  virtual_stages=lay.virtual_stages, zero_stage=lay.zero_stage, shard_degree=lay.shard_degree,
                  offload=plan.training.offload != "none", cp=lay.cp_degree)


def _describe(plan) -> str:
    lay = plan.layout
    cp = f" cp{lay.cp_degree} (of the dp ranks)" if lay.cp_degree > 1 else ""
    return (f"pp{lay.pp_degree} dp{lay.dp_degree} tp{lay.tp_degree}{' sp' if lay.sequence_parallel else ''}{cp} "
            f"zero{lay.zero_stage} mbs{plan.batch.micro_batch_size}"
            f" x {plan.batch.num_microbatches} recompute={'/'.join(sorted({s.recompute for s in plan.stages}))}")


def async_row(row) -> dict:
    """One table row of `async_rows` for one row of the Megatron table."""
    args = dict(n_layers=int(row.num_layers), d_model=int(row.hidden_size), n_heads=int(row.num_heads),
                d_ff=int(row.ffn_hidden_size), vocab_size=int(row.vocab_size), seq_len=int(row.seq_length),
                attention="math", dropout=0.1)
    profile = profile_model("examples/gpt.py", args, [1, 2, 4, 8], device="meta", gpu="a100-80gb", dtype="float16",
                            fusion="elementwise", precision="pure")
    cluster = make_cluster(int(row.num_gpus), int(row.gpus_per_node), "a100-80gb")
    batch, pp, tp = int(row.global_batch_size_seqs), int(row.pp), int(row.tp)
    out = {"model": row.model, "gpus": int(row.num_gpus), "pp": pp, "tp": tp}
    try:
        sync = solve(profile, cluster, batch, Pins(pp=pp, tp=tp, schedule="1f1b"), top_k=1)
        bw = solve(profile, cluster, batch, Pins(pp=pp, tp=tp, schedule="pipedream-2bw"), top_k=1, allow_async=True)
    except PlannerError as exc:
        return {**out, "note": f"no plan: {exc.message[:100]}"}
    sync_pred, bw_pred = sync.prediction, bw.prediction
    assert sync_pred is not None and bw_pred is not None  # solved plans carry their prediction
    same_as_1f1b = price_config(profile, cluster, dataclasses.replace(_config(bw), schedule="1f1b"))
    blocker = flush_free_blocker(bw.layout, bw.training)
    extra = max(a - s for a, s in zip(bw_pred.peak_memory_bytes, same_as_1f1b.peak_memory_bytes, strict=True))
    return {**out,
            "one_f_one_b_s": sync_pred.iteration_time_s, "one_f_one_b_layout": _describe(sync),
            "one_f_one_b_bubble": sync_pred.bubble_fraction,
            "pipedream_2bw_s": bw_pred.iteration_time_s, "pipedream_2bw_layout": _describe(bw),
            "pipedream_2bw_runs": f"flushed: {blocker}" if blocker else "flush-free",
            "speedup": sync_pred.iteration_time_s / bw_pred.iteration_time_s,
            "extra_memory_bytes": int(extra), "pipedream_2bw_peak_bytes": int(max(bw_pred.peak_memory_bytes)),
            "note": ""}


def async_rows(models: tuple[str, ...] = MODELS) -> pd.DataFrame:
    """Per model: the best 1F1B and pipedream-2bw plans' predicted steps, the speed-up and 2BW's extra
    bytes per GPU (module docstring)."""
    reference = pd.read_csv(REFERENCE)
    return pd.DataFrame([async_row(row) for row in reference.itertuples() if row.model in models])


def main() -> None:
    frame = async_rows()
    RESULTS.mkdir(parents=True, exist_ok=True)
    frame.to_csv(RESULTS / "pipedream_async.csv", index=False)
    for r in frame.itertuples():
        print(f"{r.model:>11} on {r.gpus} GPUs: 1F1B {r.one_f_one_b_s:.3f} s, 2BW {r.pipedream_2bw_s:.3f} s "
              f"(x{r.speedup:.3f}, {r.pipedream_2bw_runs}), +{r.extra_memory_bytes / 2**30:.2f} GiB per GPU", flush=True)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (speed, memory) = plt.subplots(1, 2, figsize=(9, 3.5))
    labels = [f"{r.model}\n{r.gpus} GPUs, pp{r.pp}\n2BW {r.pipedream_2bw_runs[:20]}" for r in frame.itertuples()]
    speed.bar(labels, frame["speedup"])
    speed.axhline(1.0, color="grey", linewidth=0.8)
    speed.set_ylabel("1F1B step / 2BW step (predicted)")
    memory.bar(labels, frame["extra_memory_bytes"] / 2**30, color="tab:orange")
    memory.set_ylabel("2BW's extra GiB per GPU (stash)")
    for ax in (speed, memory):
        ax.tick_params(axis="x", labelsize=7)
    fig.suptitle("PipeDream-2BW against the best 1F1B plan (A100-80GB, Megatron's GPT shapes; asynchronous)", fontsize=9)
    fig.tight_layout()
    fig.savefig(RESULTS / "pipedream_async.png", dpi=120)


if __name__ == "__main__":
    main()
