"""Out-of-sample check: every BF16 run of llm-foundry's MPT training benchmarks, all sequence
lengths and all four of its tables, priced as benchmarks/llm_foundry_a100_40gb.py prices the
A100-40GB ones at 2048 tokens (which it repeats, with its analysis).

Source: mosaicml/llm-foundry scripts/train/benchmarking/README.md (commit 4952183), vendored as
benchmarks/data/llm_foundry_bf16.txt: 209 runs in four sections, "H100 80GB BF16 (Large Scale,
>= 128 GPUs)", "H100 80GB BF16", "A100 80GB with 1600 Gbps node-node interconnect (RoCE)" and
"A100 40GB with ..." (the FP8 table is left out), MPT 125M to 70B at 512 to 65536 tokens on 8 to
512 GPUs. Each run: FSDP FULL_SHARD (ZeRO 3) or SHARD_GRAD_OP (ZeRO 2), Composer's PURE (bf16
gathers and reductions) or DEFAULT (bf16 gathers, fp32 gradient reduction) mixed precision,
activation checkpointing on or off as the table says; shapes from llm-foundry's MPT yamls
(`SHAPES`), its learned position embedding ignored (it changes nothing but the parameter
count). Published iteration time: global batch x sequence / (tokens/s per GPU x GPUs). The
networks are the presets' (the A100 tables state 1600 Gb/s RoCE per node, as the presets give;
the H100 tables state none). Nothing is fitted to these runs.

What it shows (2026-11-30): 78 of 209 within 10%, median |error| 11.9%. By table and
activation checkpointing, runs, median error (range), within 10%:
    A100 40GB  without  51  -13.3% (-27.4% .. -6.9%)    5
               with     27   -0.5% (-30.7% .. +3.1%)   21
    A100 80GB  without  39  -12.5% (-28.1% .. -3.2%)   11
               with     22   +3.2% (-23.6% .. +15.0%)  18
    H100 80GB  without  32  -15.7% (-29.1% .. -6.4%)    3
               with     20   -6.0% (-26.3% .. +10.8%)  11
    H100 >=128 without   9  -15.4% (-22.8% .. -10.4%)   0
               with      9   +3.6% (-0.3% .. +6.4%)     9
Runs without activation checkpointing are predicted fast in every table, the narrowest models (125M,
350M) the most; runs with it land close. The A100 and H100 tables agree since the H100 preset
prices FlashAttention-2's benchmarked rates (planner/hardware.py, module docstring); priced with
attention at 35% of the peak on every score, as before, 98 landed within 10% but the H100 tables
parted from the A100 ones (-4.2% without checkpointing, +14.9% with it), long sequences most.

A lead, not priced (2026-11-30): these runs used MPT's `attn_impl: triton` (the default of
scripts/train/benchmarking/submit_benchmarks.py; the FP8 runs excepted), a Triton FlashAttention of
FlashAttention-1's generation ("slightly faster than flash", llm-foundry's TUTORIAL.md, when `flash`
was flash-attn 1.x), and FlashAttention-2's paper (Dao 2023, abstract) puts FlashAttention-1 at
25-40% of an A100's peak against its own 50-73%. Pricing their attention at (25+40)/(50+73) = 0.53
of the presets' rates takes 108 of the 209 runs within 10% (median 9.7%) and centres the runs without
checkpointing (A100-40GB -1.5%, H100 -1.9%), but overshoots the checkpointed and long-sequence ones
(table medians +8% to +28%, up to +65%): one factor fits neither both nor a source, so the presets stay.

    python benchmarks/llm_foundry_tables.py

Writes benchmarks/results/llm_foundry_tables.csv.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from cost_model_vs_reference import RESULTS, modern_case, predict, print_row  # noqa: E402

DATA = ROOT / "benchmarks" / "data" / "llm_foundry_bf16.txt"
SHAPES = {"125m": (12, 768, 12), "350m": (24, 1024, 16), "760m": (24, 1536, 12), "1b": (24, 2048, 16),
          "3b": (32, 2560, 20), "7b": (32, 4096, 32), "13b": (40, 5120, 40), "30b": (48, 7168, 64),
          "70b": (80, 8192, 64)}
"""llm-foundry's MPT yamls: layers, d_model, heads (vocabulary 50368, 4x MLP)."""
GPU = {"a100-40gb": "a100-40gb", "a100-80gb": "a100-80gb", "h100-80gb": "h100-80gb", "h100-80gb-large": "h100-80gb"}
SECTION = {"a100-40gb": "A100 40GB", "a100-80gb": "A100 80GB", "h100-80gb": "H100 80GB", "h100-80gb-large": "H100 80GB >= 128 GPUs"}


def llm_foundry_case(model: str, seq_len: int, gpus: int, micro_batch: int, global_batch: int, tokens: float, gpu: str,
                     checkpointed: bool, mp_mode: str = "PURE", sharding: str = "FULL_SHARD") -> dict:
    """One llm-foundry run as benchmarks/cost_model_vs_reference.py `predict` takes it: the
    MosaicML case of `modern_case` at this shape, sequence, GPU and configuration."""
    layers, d, heads = SHAPES[model]
    row = pd.Series(dict(hidden_size=d, num_layers=layers, seq_length=seq_len, vocab_size=50368, ffn_hidden_size="",
                         num_gpus=gpus, global_batch_size_seqs=global_batch, num_heads=heads, tp=1, pp=1, dp=gpus,
                         gpu_type="A100", gpus_per_node=8, micro_batch_size=micro_batch, model=f"MPT-{model}",
                         tokens_per_sec_per_gpu=tokens))
    case = modern_case(row)
    pins = case["pins"]
    if not checkpointed:
        pins = replace(pins, recompute="none")
    if sharding == "SHARD_GRAD_OP":
        pins = replace(pins, zero_stage=2)
    if mp_mode == "DEFAULT":  # Composer's DEFAULT FSDP mixed precision: bf16 gathers, fp32 gradient reduction
        pins = replace(pins, param_dtype="bfloat16", reduce_dtype="float32")
    case["pins"] = pins
    if gpu != case["gpu"]:
        case.update(gpu=gpu, model=f"{case['model']} {gpu}")
    return case


def runs() -> list[dict]:
    out = []
    for line in DATA.read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        section, model, seq, gpus, mbs, accumulation, batch, tokens, mp, shard, ckpt = line.split()
        out.append(dict(section=section, model=model, seq_len=int(seq), gpus=int(gpus), micro_batch=int(mbs),
                        gradient_accumulation=int(accumulation), global_batch=int(batch), tokens=float(tokens),
                        mp_mode=mp, sharding=shard, checkpointed=ckpt == "ckpt"))
    return out


def main() -> pd.DataFrame:
    out = []
    for r in runs():
        case = llm_foundry_case(r["model"], r["seq_len"], r["gpus"], r["micro_batch"], r["global_batch"], r["tokens"],
                                GPU[r["section"]], r["checkpointed"], r["mp_mode"], r["sharding"])
        result = predict(case)
        result.update(table=SECTION[r["section"]], seq_len=r["seq_len"], gradient_accumulation=r["gradient_accumulation"],
                      checkpointed=r["checkpointed"], mp_mode=r["mp_mode"], sharding=r["sharding"])
        out.append(result)
        print_row(result, f"{SECTION[r['section']]:>22} {result['model']:>24} s{r['seq_len']:<6} mbs {r['micro_batch']:3d} "
                          f"x{r['gradient_accumulation']:<2d}{' ckpt' if r['checkpointed'] else '     '}")
    frame = pd.DataFrame(out)
    RESULTS.mkdir(parents=True, exist_ok=True)
    frame.to_csv(RESULTS / "llm_foundry_tables.csv", index=False)
    summary = frame.groupby(["table", "checkpointed"])["error"].agg(
        runs="count", median="median", low="min", high="max", within_10=lambda e: int((e.abs() <= 0.10).sum()))
    print(summary.to_string(float_format=lambda x: f"{x:+.1%}"))
    print(f"all {len(frame)} runs: median |error| {frame['error'].abs().median():.1%}, "
          f"within 10%: {(frame['error'].abs() <= 0.10).sum()}")
    return frame


if __name__ == "__main__":
    main()
