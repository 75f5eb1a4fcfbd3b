"""Is the solver's free choice at least as good as the experts' and the usual defaults?

For every row of shared/reference/megatron_sc21_table1.csv (Narayanan et al. 2021): an
analytic profile of examples/gpt.py at the row's shape (float16, A100-80GB, materialised
attention and dropout 0.1, Megatron's fused elementwise kernels as in
cost_model_vs_reference.py), then, all predicted by the same cost model:

- `published`: the row's own configuration, pinned (the solver still picks the cuts);
- `free`: the solver's free choice (same GPUs and global batch);
- `pure-dp`: pp = tp = 1, data parallel over every GPU, ZeRO stage left to the solver
  (ZeRO-3 when nothing else fits);
- `megatron-uniform`: tp = 8, 1F1B, full recomputation, the smallest pp that fits, with
  layers split evenly as Megatron-LM splits them (`even_block_cuts`: no DP over the cuts);
- `titan-fsdp-tp`: torchtitan's usual defaults: tp = 8 with sequence parallelism, FSDP
  (ZeRO-3) over the rest, no pipeline, selective recomputation.

All five are priced as Megatron-LM holds memory (planner/engines/megatron.py `MEMORY_HABITS`:
a fused AdamW, one micro-batch's pipeline buffers at a time), the software the published
configurations ran on: under the planner's own runtime (torch's pipeline keeps a receive buffer
per micro-batch), the published layouts of 310B, 530B and 1T, with 144-512 micro-batches, do not
fit. The free choice must never be predicted slower than the published configuration (it
searches a superset); where it is faster the CSV says how its layout differs.
Writes benchmarks/results/plan_quality.{csv,png}.

Seed rows (`seed_rows`, issue #16: cases where one of PipeDream's and ZeRO's ideas alone makes a
model fit or run fastest), each solved with and without that idea, the plan's first
alternative giving the reason (H100-80GB, bf16, analytic profiles of the public configs in
examples/hf/):
- LoRA: Llama 3 70B fine-tuned with peft adapters on 8 GPUs (examples/hf_lora.py) against
  the same model fully trained;
- offload: a 13B Llama-shaped model fully trained on one GPU, with and without `--offload`;
- HSDP: Llama 3 8B on 1024 GPUs with FSDP (pp = tp = 1, ZeRO-3), sharding over all ranks
  (`--shard-degree 1024`) against the search's choice, hybrid sharding over 16 ranks: its
  parameter all-gathers stay inside two nodes instead of a ring over 128. Priced with NCCL's own
  algorithms (planner/cost/nccl.py: a ring's latency grows with its 1024 ranks, and NCCL has no
  hierarchical all-gather), HSDP is 28% faster (0.299 s against 0.416 s a step, 2026-11-30); it
  was 1% while the model let a textbook hierarchical all-gather stand for NCCL's ring.
Written to benchmarks/results/plan_quality_seed_rows.csv.

    python benchmarks/plan_quality.py
"""

from __future__ import annotations

import re
from pathlib import Path

import pandas as pd

from planner.cluster import make_cluster
from planner.engines.megatron import MEMORY_HABITS as MEGATRON_MEMORY
from planner.errors import PlannerError
from planner.profiler import profile_model
from planner.solver.solve import Pins, even_block_cuts, solve

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = ROOT.parent / "shared" / "reference" / "megatron_sc21_table1.csv"
RESULTS = ROOT / "benchmarks" / "results"


def _describe(plan) -> str:
    lay = plan.layout
    return (f"pp{lay.pp_degree} dp{lay.dp_degree} tp{lay.tp_degree}{'+sp' if lay.sequence_parallel else ''} "
            f"zero{lay.zero_stage} {lay.schedule}{' v' + str(lay.virtual_stages) if lay.virtual_stages > 1 else ''} "
            f"mbs{plan.batch.micro_batch_size} recompute={'/'.join(sorted({s.recompute for s in plan.stages}))}")


def _try(label, fn):
    try:
        plan = fn()
        return {f"{label}_s": plan.prediction.iteration_time_s, f"{label}_layout": _describe(plan)}
    except PlannerError as exc:
        return {f"{label}_s": float("nan"), f"{label}_layout": f"no plan: {exc.message[:80]}"}


def _uniform_megatron(prof, cluster, batch):
    """tp 8, smallest pp that fits, layers split evenly: the hand-written Megatron recipe."""
    for pp in (1, 2, 4, 8, 16, 32, 64):
        if cluster.world_size % (8 * pp):
            continue
        try:
            return solve(prof, cluster, batch, Pins(tp=8, pp=pp, cp=1, schedule="1f1b", recompute="full", zero_stage=0,
                                                    sequence_parallel=False, **MEGATRON_MEMORY), cuts=even_block_cuts(prof))
        except PlannerError:
            continue
    raise PlannerError("no uniform Megatron split fits", "")


def main() -> None:
    reference = pd.read_csv(REFERENCE)
    rows = []
    for row in reference.itertuples():
        args = dict(n_layers=int(row.num_layers), d_model=int(row.hidden_size), n_heads=int(row.num_heads),
                    d_ff=int(row.ffn_hidden_size), vocab_size=int(row.vocab_size), seq_len=int(row.seq_length),
                    attention="math", dropout=0.1)
        prof = profile_model("examples/gpt.py", args, [1, 2, 4, 8], device="meta", gpu="a100-80gb", dtype="float16",
                             fusion="elementwise", precision="pure")
        cluster = make_cluster(int(row.num_gpus), int(row.gpus_per_node), "a100-80gb")
        batch = int(row.global_batch_size_seqs)
        found = re.match(r"(\d+) chunks", str(row.virtual_pipeline))
        v = int(found.group(1)) if found else 1
        published = Pins(pp=int(row.pp), tp=int(row.tp), dp=int(row.dp), cp=1, micro_batch_size=int(row.micro_batch_size),
                         schedule="interleaved-1f1b" if v > 1 else "1f1b", virtual_stages=v, recompute="full", zero_stage=0,
                         sequence_parallel=False, **MEGATRON_MEMORY)
        r = {"model": row.model, "gpus": int(row.num_gpus)}
        r.update(_try("published", lambda: solve(prof, cluster, batch, published, top_k=1)))
        r.update(_try("free", lambda: solve(prof, cluster, batch, Pins(**MEGATRON_MEMORY), top_k=1)))
        r.update(_try("pure_dp", lambda: solve(prof, cluster, batch, Pins(pp=1, tp=1, cp=1, **MEGATRON_MEMORY), top_k=1)))
        r.update(_try("megatron_uniform", lambda: _uniform_megatron(prof, cluster, batch)))
        r.update(_try("titan_fsdp_tp", lambda: solve(prof, cluster, batch, Pins(pp=1, tp=8, cp=1, zero_stage=3, sequence_parallel=True,
                                                                                 recompute="selective", **MEGATRON_MEMORY),
                                                     top_k=1)))
        r["free_vs_published"] = r["free_s"] / r["published_s"] - 1
        rows.append(r)
        print(f"{r['model']:>12}: published {r['published_s']:.2f} s ({r['published_layout']}) | free {r['free_s']:.2f} s "
              f"({r['free_layout']}) {r['free_vs_published']:+.1%}", flush=True)
    frame = pd.DataFrame(rows)
    RESULTS.mkdir(parents=True, exist_ok=True)
    frame.to_csv(RESULTS / "plan_quality.csv", index=False)
    worse = frame[frame["free_vs_published"] > 1e-9]
    print(f"free choice slower than published in {len(worse)} of {len(frame)} rows")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = ["published", "free", "pure_dp", "megatron_uniform", "titan_fsdp_tp"]
    fig, ax = plt.subplots(figsize=(9, 4))
    width = 0.16
    for n, label in enumerate(labels):
        rel = frame[f"{label}_s"] / frame["published_s"]
        ax.bar([i + n * width for i in range(len(frame))], rel, width, label=label)
    ax.set_xticks([i + 2 * width for i in range(len(frame))], frame["model"], rotation=30, fontsize=7)
    ax.set_ylabel("predicted iteration time / published config's")
    ax.set_title("Solver's free choice vs Megatron-LM's configurations and common defaults (A100-80GB)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(RESULTS / "plan_quality.png", dpi=120)


HF = ROOT / "examples" / "hf"
LLAMA_13B = dict(num_hidden_layers=40, hidden_size=5120, intermediate_size=13824, num_attention_heads=40,
                 num_key_value_heads=40)  # Llama 2 13B's shape on the Llama 3 8B config


def _hf_profile(model_file: str, config: Path, seq_len: int, **overrides):
    return profile_model(model_file, {"config": str(config), "seq_len": seq_len, **overrides}, [1], device="meta",
                         gpu="h100-80gb", dtype="bfloat16", precision="pure")


def seed_rows() -> pd.DataFrame:
    import planner.hf_config_model as hf

    lora_file = str(ROOT / "examples" / "hf_lora.py")
    cases = [
        ("LoRA: Llama 3 70B fine-tune, 8 GPUs", 8, 32,
         lambda: _hf_profile(hf.__file__, HF / "llama3-70b.json", 4096), {},
         lambda: _hf_profile(lora_file, HF / "llama3-70b.json", 4096), {}),
        ("offload: 13B full train, 1 GPU", 1, 8,
         lambda: _hf_profile(hf.__file__, HF / "llama3-8b.json", 2048, **LLAMA_13B), {},
         None, {"allow_offload": True}),
        ("HSDP: Llama 3 8B FSDP, 1024 GPUs", 1024, 1024,
         lambda: _hf_profile(hf.__file__, HF / "llama3-8b.json", 2048), {"pins": Pins(pp=1, tp=1, zero_stage=3, shard_degree=1024)},
         None, {"pins": Pins(pp=1, tp=1, zero_stage=3)}),
    ]
    rows = []
    for name, gpus, batch, base, base_kw, variant, variant_kw in cases:
        cluster = make_cluster(gpus, min(gpus, 8), "h100-80gb")
        prof = base()
        without = _seed_solve(prof, cluster, batch, **{**base_kw, **({"allow_offload": False} if "allow_offload" in variant_kw else {})})
        with_ = _seed_solve(variant() if variant else prof, cluster, batch, **variant_kw)
        rows.append({"case": name, "gpus": gpus, "global_batch": batch, **{f"without_{k}": v for k, v in without.items()},
                     **{f"with_{k}": v for k, v in with_.items()}})
        print(f"{name}: without {without['layout']} {without['s']} | with {with_['layout']} {with_['s']} ({with_['why']})", flush=True)
    frame = pd.DataFrame(rows)
    frame.to_csv(RESULTS / "plan_quality_seed_rows.csv", index=False)
    return frame


def _seed_solve(prof, cluster, batch, pins: Pins = Pins(), **kw) -> dict:
    """The best plan's time and layout, and why its runner-up lost (the plan's alternatives)."""
    try:
        plan = solve(prof, cluster, batch, pins, top_k=2, **kw)
    except PlannerError as exc:
        return {"s": float("nan"), "layout": f"no plan: {exc.message[:120]}", "why": ""}
    lay = plan.layout
    layout = (_describe(plan) + (f" hsdp{lay.shard_degree}" if lay.shard_degree else "")
              + (" offload" if plan.training.offload != "none" else ""))
    alts = plan.search.alternatives if plan.search else []
    why = f"runner-up {alts[0].why_lost}" if alts else "only configuration that fits"
    return {"s": plan.prediction.iteration_time_s, "layout": layout, "why": why,
            "peak_memory_gib": max(plan.prediction.peak_memory_bytes) / 2**30}


if __name__ == "__main__":
    import sys

    if sys.argv[1:] == ["--seed-rows"]:
        seed_rows()
    else:
        main()
        seed_rows()
