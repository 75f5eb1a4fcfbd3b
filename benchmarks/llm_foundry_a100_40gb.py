"""Out-of-sample check: every FSDP run of llm-foundry's A100-40GB table at 2048 tokens, with
activation checkpointing (7B-70B) and without it (125M-3B), not only the five rows
shared/reference/modern_stacks.csv holds.

Source: mosaicml/llm-foundry scripts/train/benchmarking/README.md (commit 061f2c7c), section
"A100 40GB with 1600 Gbps node-node interconnect (RoCE)": MPT 7B-70B, bf16 PURE, FSDP
FULL_SHARD, sequence 2048; 7B-70B with full activation checkpointing, 125M-3B without it
(the table's "Activation Checkpointing" column). Shapes from llm-foundry's MPT yamls (layers,
d_model, heads; vocabulary 50368; 4x MLP); each reproduces the table's NumParams to 1%. Published iteration time from
tokens/s per GPU as benchmarks/cost_model_vs_reference.py derives it. Nothing is fitted to
these rows; they are priced exactly as that benchmark prices the MosaicML rows (`modern_case`).

As a control, the same README's two MPT-70B runs on A100-80GB with the same stated network
("A100 80GB with 1600 Gbps node-node interconnect (RoCE)", bf16 PURE, FULL_SHARD, checkpointed,
2048 tokens): 64 GPUs at micro-batch 8 x 4 accumulations, and 32 GPUs at micro-batch 2 x 16,
which does per micro-batch what the 40 GB card's 64-GPU run (-31%) does per step: the same
tokens per GPU and the same ZeRO 3 traffic.

A second control: the README's "H100 80GB BF16" runs at 2048 tokens (amp_bf16 with Composer's
DEFAULT FSDP mixed precision: bf16 gathers and compute, fp32 gradient reduction; the gathered
weights are bf16, so autocast adds no fp32 copies and the profile is the bf16 one; network
not stated, so the h100-80gb preset's 400 Gb/s per GPU), checkpointed (13B-70B) or not (760M-13B),
as the table's "Activation Checkpointing" column says.

The smaller models show how much one row of this table can move with nothing in the
configuration to explain it: MPT-1B on 8, 16, 64 and 128 GPUs runs at 54-56% MFU, and on 32
GPUs, with the same micro-batch, less communication than 64 and no accumulation, at 45%.

    python benchmarks/llm_foundry_a100_40gb.py

Writes benchmarks/results/llm_foundry_a100_40gb.csv.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from cost_model_vs_reference import predict, print_row, summary, write_out_of_sample  # noqa: E402
from llm_foundry_tables import llm_foundry_case  # noqa: E402

CHECKPOINTED = {"7b", "13b", "30b", "70b"}  # the README's "Activation Checkpointing" column at 2048 tokens
# model, GPUs, micro-batch, gradient accumulation, global batch, tokens/s per GPU (the README's rows)
ROWS = [
    ("70b", 128, 4, 1, 512, 376), ("70b", 64, 2, 1, 128, 276),
    ("30b", 128, 6, 1, 768, 865), ("30b", 32, 4, 1, 128, 857),
    ("13b", 128, 16, 1, 2048, 1972), ("13b", 64, 16, 1, 1024, 1976), ("13b", 32, 14, 1, 448, 1998),
    ("13b", 16, 10, 1, 160, 1993), ("13b", 8, 4, 16, 512, 1668),
    ("7b", 128, 18, 1, 2304, 3623), ("7b", 64, 18, 1, 1152, 3665), ("7b", 32, 18, 1, 576, 3725),
    ("7b", 16, 16, 1, 256, 3645), ("7b", 8, 12, 4, 384, 3679),
    ("3b", 128, 6, 1, 768, 9538), ("3b", 64, 6, 1, 384, 9736), ("3b", 32, 6, 1, 192, 9914),
    ("3b", 16, 5, 1, 80, 9750), ("3b", 8, 5, 8, 320, 10065),
    ("1b", 128, 10, 1, 1280, 18647), ("1b", 64, 10, 1, 640, 19001), ("1b", 32, 10, 1, 320, 15555),
    ("1b", 16, 8, 1, 128, 19085), ("1b", 8, 8, 8, 512, 19271),
    ("760m", 128, 12, 1, 1536, 28940), ("760m", 64, 12, 1, 768, 29344), ("760m", 32, 12, 1, 384, 29648),
    ("760m", 16, 12, 1, 192, 29607), ("760m", 8, 12, 4, 384, 30173),
    ("350m", 128, 18, 1, 2304, 51934), ("350m", 64, 18, 1, 1152, 52689), ("350m", 32, 18, 1, 576, 53811),
    ("350m", 16, 18, 1, 288, 55413), ("350m", 8, 16, 4, 512, 55995),
    ("125m", 128, 26, 1, 3328, 123936), ("125m", 64, 26, 1, 1664, 125234), ("125m", 32, 26, 1, 832, 127122),
    ("125m", 16, 26, 1, 416, 130535), ("125m", 8, 26, 3, 624, 136334),
]
ROWS_80GB = [("70b", 64, 8, 4, 2048, 410), ("70b", 32, 2, 16, 1024, 373)]  # the control (module docstring)
# The H100 table's rows at 2048 tokens: the same fields, then whether it checkpointed
ROWS_H100 = [
    ("70b", 64, 8, 4, 2048, 1039, True), ("70b", 32, 2, 16, 1024, 882, True), ("30b", 32, 14, 3, 1344, 2308, True),
    ("30b", 16, 10, 3, 480, 2263, True), ("30b", 8, 3, 21, 504, 2002, True),
    ("13b", 64, 2, 1, 128, 4800, False), ("13b", 32, 2, 1, 64, 4811, False), ("13b", 16, 2, 1, 32, 4767, False),
    ("13b", 8, 2, 1, 16, 4792, False), ("7b", 8, 6, 1, 48, 10643, False),
    ("3b", 64, 6, 3, 1152, 22525, False), ("3b", 32, 6, 3, 576, 23021, False), ("3b", 16, 10, 3, 480, 24142, False),
    ("1b", 64, 20, 1, 1280, 44402, False), ("1b", 32, 20, 1, 640, 45130, False), ("1b", 16, 20, 1, 320, 46037, False),
    ("1b", 8, 14, 1, 112, 45455, False),
    ("760m", 32, 24, 1, 768, 67971, False), ("760m", 16, 24, 1, 384, 68551, False), ("760m", 8, 24, 2, 384, 63147, False),
]


def main() -> pd.DataFrame:
    out = []
    runs = [(*r, "a100-40gb", model in CHECKPOINTED) for r in ROWS for model in [r[0]]] + \
        [(*r, "a100-80gb", True) for r in ROWS_80GB] + [(*r[:6], "h100-80gb", r[6]) for r in ROWS_H100]
    for model, gpus, mbs, accumulation, batch, tokens, gpu, checkpointed in runs:
        h100 = gpu.startswith("h100")  # amp_bf16 with Composer's DEFAULT FSDP mixed precision (module docstring)
        case = llm_foundry_case(model, 2048, gpus, mbs, batch, tokens, gpu, checkpointed, "DEFAULT" if h100 else "PURE")
        if h100:
            case.update(source="MosaicML FSDP H100")
        result = predict(case)
        result.update(gradient_accumulation=accumulation, checkpointed=checkpointed, in_modern_stacks=gpu == "a100-40gb"
                      and (model, gpus) in {("70b", 128), ("70b", 64), ("30b", 128), ("13b", 128), ("7b", 128)})
        out.append(result)
        print_row(result, f"{result['model']:>14} mbs {mbs:2d} x{accumulation:<2d}{' ckpt' if checkpointed else '     '}")
    frame = write_out_of_sample(out, "llm_foundry_a100_40gb")
    print(summary(frame))
    return frame


if __name__ == "__main__":
    main()
