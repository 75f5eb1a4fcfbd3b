"""Out-of-sample check: torchtitan's published FSDP2 runs on 64 A100-80GB, priced as `planner price` prices them.

Source: pytorch/torchtitan docs/performance.md (commit 04133643): Llama 3 8B and 70B (sequence
8192) and Llama 2 13B and 70B (sequence 4096) trained with FSDP2 alone (1D) on 64 A100 80GB
GPUs, local batch 1 or 2, with activation checkpointing none, "selective layer" (full AC on
every second layer: `selective_ac_option = "2"`, torchtitan's default), "selective op" (per-op
SAC) or full; published as tokens per second per GPU (WPS) and MFU. The cluster's network is
not stated: the a100-80gb preset (8 x 200 Gb/s per node). Shapes: Llama 3 8B 32 layers x 4096,
32 heads / 8 KV heads, FFN 14336, vocabulary 128256; 70B 80 x 8192, 64 / 8, 28672; Llama 2
13B 40 x 5120, 40 heads (no GQA), 13824, vocabulary 32000; 70B as Llama 3's with vocabulary
32000 (the models' published configurations).

Each row becomes the torchtitan job file it ran (planner/engines/torchtitan.py reads it as
`planner price` does) and is priced on examples/llama.py profiled analytically in pure bf16.
Published iteration time: local batch x sequence / WPS. Nothing is fitted to these rows; they
are not in shared/reference/.

    python benchmarks/torchtitan_a100.py

Writes benchmarks/results/torchtitan_a100.csv.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from cost_model_vs_reference import write_out_of_sample  # noqa: E402

from planner.cluster import make_cluster  # noqa: E402
from planner.engines import torchtitan  # noqa: E402
from planner.engines.pricing import price  # noqa: E402
from planner.errors import PlannerError  # noqa: E402
from planner.profiler import profile_model  # noqa: E402

SHAPES = {  # layers, d_model, heads, kv heads, FFN, vocabulary, sequence
    "Llama 3 8B": (32, 4096, 32, 8, 14336, 128256, 8192),
    "Llama 3 70B": (80, 8192, 64, 8, 28672, 128256, 8192),
    "Llama 2 13B": (40, 5120, 40, 40, 13824, 32000, 4096),
    "Llama 2 70B": (80, 8192, 64, 8, 28672, 32000, 4096),
}
AC = {  # docs/performance.md's column -> torchtitan's [activation_checkpoint] section
    "no": 'mode = "none"',
    "selective layer": 'mode = "selective"\nselective_ac_option = "2"',
    "selective op": 'mode = "selective"\nselective_ac_option = "op"',
    "full": 'mode = "full"',
}
ROWS = [  # model, local batch, activation checkpointing, WPS (tokens/s per GPU), MFU %
    ("Llama 3 8B", 1, "selective layer", 2904, 56.8), ("Llama 3 8B", 1, "selective op", 2973, 58.2),
    ("Llama 3 70B", 1, "full", 331, 51.7),
    ("Llama 2 13B", 2, "no", 2162, 61.1), ("Llama 2 13B", 2, "selective layer", 1914, 54.1),
    ("Llama 2 13B", 2, "selective op", 1904, 53.8),
    ("Llama 2 70B", 1, "selective op", 355, 50.8), ("Llama 2 70B", 2, "full", 353, 50.5),
]
GPUS = 64


def job_file(local_batch: int, seq_len: int, ac: str) -> str:
    return (f'[parallelism]\ndata_parallel_shard_degree = {GPUS}\n\n[activation_checkpoint]\n{AC[ac]}\n\n'
            f'[training]\nlocal_batch_size = {local_batch}\nseq_len = {seq_len}\nmixed_precision_param = "bfloat16"\n')


def main() -> pd.DataFrame:
    cluster = make_cluster(GPUS, 8, "a100-80gb")
    out, profiles = [], {}
    for model, batch, ac, wps, mfu in ROWS:
        layers, d, heads, kv, ffn, vocab, seq = SHAPES[model]
        key = (model, batch)
        if key not in profiles:
            args = dict(n_layers=layers, d_model=d, n_heads=heads, n_kv_heads=kv, d_ff=ffn, vocab_size=vocab, seq_len=seq)
            profiles[key] = profile_model("examples/llama.py", args, [batch], device="meta", gpu="a100-80gb",
                                          dtype="bfloat16", fusion="elementwise", precision="pure")
        layout = torchtitan.parse(job_file(batch, seq, ac))
        published = batch * seq / wps
        row = dict(model=model, gpus=GPUS, local_batch=batch, activation_checkpointing=ac, published_wps=wps,
                   published_mfu=mfu, published_iteration_s=published, notes="; ".join(layout.notes))
        try:
            plan = price(profiles[key], cluster, layout)
        except PlannerError as error:
            row.update(predicted_iteration_s=float("nan"), error=float("nan"), notes=str(error))
        else:
            pred = plan.prediction
            peak = max(pred.peak_memory_bytes)
            row.update(predicted_iteration_s=pred.iteration_time_s, error=pred.iteration_time_s / published - 1,
                       predicted_peak_gib=peak / 2**30, fits_80gb=peak <= cluster.gpu.memory_bytes,
                       recompute="/".join(sorted({s.recompute for s in plan.stages})),
                       **{f"{k}_s": v for k, v in pred.breakdown_s.items()})
        out.append(row)
        print(f"{model:>12} b{batch} {ac:>15}  published {published:6.2f} s  predicted {row['predicted_iteration_s']:6.2f} s"
              f"  error {row['error']:+.1%}  peak {row.get('predicted_peak_gib', float('nan')):5.1f} GiB  {row['notes']}",
              flush=True)
    return write_out_of_sample(out, "torchtitan_a100")


if __name__ == "__main__":
    main()
