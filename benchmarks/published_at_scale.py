"""Out-of-sample check: published runs of GPT-3-class models on hundreds to thousands of A100s,
3D-parallel and ZeRO-3, none of them in shared/reference/.

Sources:
- Narayanan et al. 2021 (SC21, arXiv 2104.04473), section 5.3 "Comparison to ZeRO-3" (its
  Table 2): GPT 174.6B (96 layers x 12288, 96 heads, batch 1536) and 529.6B (105 x 20480, 128
  heads, batch 2560 on 640 GPUs, 2240 otherwise) on DGX A100-80GB nodes (Selene, 8 x 200 Gb/s
  HDR per node), sequence 2048, fp16, full recomputation, teraFLOP/s per GPU published with the
  paper's eq. 3. ZeRO-3 without model parallelism (DeepSpeed, micro-batch = batch / GPUs: 4, 2,
  1) against PTD-P (Megatron-LM: TP 8 x PP 12 for 174.6B, TP 8 x PP 35 for 529.6B, micro-batch
  and interleaving not in the table: the solver's, within Megatron-LM's schedules).
- Smith et al. 2022 ("Using DeepSpeed and Megatron to Train Megatron-Turing NLG 530B", arXiv
  2201.11990, section 2.4): MT-NLG 530B (105 x 20480, 128 heads) with DeepSpeed's pipeline (PP 35)
  and Megatron's TP 8 on 280, 350 and 420 DGX A100 nodes of Selene, batch 1920, sequence 2048:
  60.1, 50.2 and 44.4 s per iteration (126, 121, 113 TFLOP/s per GPU). Micro-batch not stated.
- BigScience's BLOOM 176B (bigscience-workshop/bigscience train/tr11-176B-ml/README.md: 70 layers
  x 14336, 112 heads, vocabulary 250880, sequence 2048; 384 A100-80GB in 48 nodes, TP 4 x PP 12 x
  DP 8, micro-batch 2, global batch 2048, bf16, ZeRO 1, full recomputation; "training throughput:
  about 150 TFLOPs", BigScience's model page, counted by Megatron-DeepSpeed with the recomputed
  forward, i.e. eq. 3) on Jean Zay, whose nodes have four 100 Gb/s Omni-Path links (the BLOOM
  paper, arXiv 2211.05100, section 3.4): priced with 50 GB/s per node shared by its 8 GPUs, at
  the presets' share of a line rate (planner/cluster.py `NETWORK_EFFICIENCY`). Its stage cuts
  are Megatron-DeepSpeed's (`partition_method type:transformer|embedding`, tr11's launch
  script): DeepSpeed's `partition_balanced` over layers weighing 1 where their class matches,
  the 70 transformer layers and the two embedding layers (input, and the tied output), 0
  otherwise (the final norm): 72 over 12 is 6 a stage, the embedding and 5 layers on the first,
  5 layers and the output on the last (`bloom_cuts`).

Each row is priced as its stack runs, with the overlaps each stack's source shows
(planner/engines/megatron.py and deepspeed.py `overlap`), never a per-row constant:
- Megatron-LM 2021: every collective in series (as Table 1, benchmarks/cost_model_vs_reference.py).
- DeepSpeed ZeRO-3: bucketed reduction under the backward and prefetched gathers (`overlap_comm`
  and `stage3_prefetch_bucket_size` on by default for stage 3), fp16 weights gathered into the
  parameters' own storage submodule by submodule within its default bounds (planner/cost/memory.py
  `LiveParameters`), its pipeline absent.
- DeepSpeed's pipeline engine (MT-NLG, BLOOM): sends block and the gradients are reduced after
  the last micro-batch; ZeRO 1 (the pipeline engine takes 0 or 1), bf16 with its BF16_Optimizer's
  fp32 gradients, added into after every micro-batch.
- Megatron-LM 2021 accumulated in autograd's .grad (fp16, no contiguous buffers); every stack's
  accumulation pass is priced (planner/cost/memory.py `accumulation_pass_bytes`).
Published iteration time: the paper's FLOPs (eq. 3, vocabulary 51200) over TFLOP/s x GPUs, or
the published seconds (MT-NLG).

    python benchmarks/published_at_scale.py

Writes benchmarks/results/published_at_scale.csv.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from cost_model_vs_reference import StackPins, predict, print_row, write_out_of_sample  # noqa: E402

from planner.cluster import NETWORK_EFFICIENCY, NETWORK_LATENCY_S, Link  # noqa: E402
from planner.cost.memory import LiveParameters  # noqa: E402
from planner.cost.overlap import SERIAL  # noqa: E402
from planner.engines import deepspeed  # noqa: E402
from planner.engines.megatron import MEMORY_HABITS as MEGATRON_MEMORY  # noqa: E402

SHAPES = {"GPT 174.6B": (96, 12288, 96), "GPT 529.6B": (105, 20480, 128), "MT-NLG 530B": (105, 20480, 128)}
VOCAB, SEQ = 51200, 2048
# scheme, model, global batch, GPUs, micro-batch (None: not published), tp, pp, TFLOP/s per GPU or seconds
TABLE2 = [
    ("ZeRO-3", "GPT 174.6B", 1536, 384, 4, 1, 1, 144), ("ZeRO-3", "GPT 174.6B", 1536, 768, 2, 1, 1, 88),
    ("ZeRO-3", "GPT 174.6B", 1536, 1536, 1, 1, 1, 44),
    ("ZeRO-3", "GPT 529.6B", 2560, 640, 4, 1, 1, 138), ("ZeRO-3", "GPT 529.6B", 2240, 1120, 2, 1, 1, 98),
    ("ZeRO-3", "GPT 529.6B", 2240, 2240, 1, 1, 1, 48),
    ("PTD-P", "GPT 174.6B", 1536, 384, None, 8, 12, 153), ("PTD-P", "GPT 174.6B", 1536, 768, None, 8, 12, 149),
    ("PTD-P", "GPT 174.6B", 1536, 1536, None, 8, 12, 141),
    ("PTD-P", "GPT 529.6B", 2240, 560, None, 8, 35, 171), ("PTD-P", "GPT 529.6B", 2240, 1120, None, 8, 35, 167),
    ("PTD-P", "GPT 529.6B", 2240, 2240, None, 8, 35, 159),
]
MTNLG = [(2240, 60.1), (2800, 50.2), (3360, 44.4)]  # GPUs, seconds per iteration (batch 1920)
BLOOM = dict(layers=70, hidden=14336, heads=112, vocab=250880, gpus=384, tp=4, pp=12, mbs=2, batch=2048, tflops=150.0)
OMNI_PATH = Link(4 * 100e9 / 8 / 8 * NETWORK_EFFICIENCY, NETWORK_LATENCY_S)
"""Jean Zay's network per GPU: four 100 Gb/s links per node of 8 GPUs, as the presets take a NIC (planner/cluster.py)."""
DEEPSPEED_HABITS = dict(pipeline_buffers="in-flight", dp_collectives="bucketed", gather_copy_out=False)
"""How DeepSpeed holds and moves what planner/engines/deepspeed.py `parse` says it does."""
BF16_OPTIMIZER = dict(grad_dtype="float32", reduce_dtype="bfloat16", grad_accumulation="buffer")
"""DeepSpeed's bf16 at ZeRO 0-1 with its pipeline (BF16_Optimizer, "PP+BF16 work for ZeRO Stage 1":
pipe/engine.py): fp32 gradients added into after each micro-batch (`update_hp_grads`), reduced in
bf16 (engine.py `communication_data_type`)."""


def eq3_flops(batch: int, layers: int, hidden: int) -> float:
    """SC21's eq. 3: the FLOPs of one iteration with full recomputation."""
    return 96 * batch * SEQ * layers * hidden**2 * (1 + SEQ / (6 * hidden) + VOCAB / (16 * layers * hidden))


def _args(model: str) -> dict:
    layers, hidden, heads = SHAPES[model]
    # Megatron-LM's GPT as both stacks ran it: materialised attention, dropout 0.1, fused elementwise kernels.
    return dict(n_layers=layers, d_model=hidden, n_heads=heads, d_ff=4 * hidden, vocab_size=VOCAB, seq_len=SEQ,
                attention="math", dropout=0.1)


def table2_case(scheme: str, model: str, batch: int, gpus: int, mbs: int | None, tp: int, pp: int, tflops: float) -> dict:
    layers, hidden, _ = SHAPES[model]
    common = dict(model=f"{model} {scheme} x{gpus}", gpu="a100-80gb", dtype="float16", args=_args(model), gpus=gpus,
                  gpus_per_node=8, global_batch=batch, published_s=eq3_flops(batch, layers, hidden) / (tflops * 1e12 * gpus),
                  derived_from="SC21 eq. 3 / TFLOP/s", published_tflops=tflops)
    if scheme == "ZeRO-3":
        return dict(**common, source="SC21 Table 2 (ZeRO-3)", stack="DeepSpeed ZeRO-3", profile_mbs=[mbs],
                    pins=StackPins(pp=1, tp=1, dp=gpus, cp=1, micro_batch_size=mbs, recompute="full", zero_stage=3,
                                   sequence_parallel=False, overlap=deepspeed.overlap(3, 1), loss_kernel="eager",
                                   param_dtype="float16", zero3_live=LiveParameters(), **DEEPSPEED_HABITS))
    return dict(**common, source="SC21 Table 2 (PTD-P)", stack="Megatron-LM 2021", profile_mbs=[1, 2],
                schedules=["1f1b", "interleaved-1f1b"],
                pins=StackPins(pp=pp, tp=tp, dp=gpus // (tp * pp), cp=1, recompute="full", zero_stage=0,
                               sequence_parallel=False, overlap=SERIAL, **MEGATRON_MEMORY))


def mtnlg_case(gpus: int, seconds: float) -> dict:
    tp, pp = 8, 35
    return dict(source="MT-NLG (Smith et al. 2022)", stack="Megatron-DeepSpeed", model=f"MT-NLG 530B x{gpus}",
                gpu="a100-80gb", dtype="bfloat16", args=_args("MT-NLG 530B"), gpus=gpus, gpus_per_node=8,
                global_batch=1920, published_s=seconds, derived_from="published s/iteration", published_tflops=float("nan"),
                profile_mbs=[1, 2], schedules=["1f1b"],  # DeepSpeed's TrainSchedule
                pins=StackPins(pp=pp, tp=tp, dp=gpus // (tp * pp), cp=1, recompute="full", zero_stage=1,
                               sequence_parallel=False, overlap=deepspeed.overlap(1, pp), loss_kernel="eager",
                               param_dtype="bfloat16", **BF16_OPTIMIZER, **DEEPSPEED_HABITS))


def bloom_cuts(profile):
    """Megatron-DeepSpeed's `type:transformer|embedding` partition (module docstring) as the
    solver's `cuts`: the units before the blocks (the embedding) and the last unit (the output
    layer) weigh one layer, each block one, the rest (the final norm) nothing."""
    from planner.engines.common import balanced, model_parts

    names = profile.unit_names()
    before, blocks, _ = model_parts(names)
    weights = [1.0 if name in before or name in blocks or i == len(names) - 1 else 0.0 for i, name in enumerate(names)]

    def cuts(chunks: int):
        edges = balanced(weights, chunks)
        return tuple(zip(edges[:-1], edges[1:], strict=True))
    return cuts


def bloom_case() -> dict:
    b = BLOOM
    flops = 96 * b["batch"] * SEQ * b["layers"] * b["hidden"] ** 2 * (
        1 + SEQ / (6 * b["hidden"]) + b["vocab"] / (16 * b["layers"] * b["hidden"]))
    return dict(source="BLOOM (BigScience 2022)", stack="DeepSpeed pipeline", model="BLOOM 176B x384", gpu="a100-80gb",
                dtype="bfloat16", args=dict(n_layers=b["layers"], d_model=b["hidden"], n_heads=b["heads"], d_ff=4 * b["hidden"],
                                            vocab_size=b["vocab"], seq_len=SEQ, attention="math", dropout=0.0),
                gpus=b["gpus"], gpus_per_node=8, global_batch=b["batch"], inter_node=OMNI_PATH,
                published_s=flops / (b["tflops"] * 1e12 * b["gpus"]), derived_from="eq. 3 / TFLOP/s (about 150)",
                published_tflops=b["tflops"], profile_mbs=[b["mbs"]], schedules=["1f1b"], cuts=bloom_cuts,
                pins=StackPins(pp=b["pp"], tp=b["tp"], dp=b["gpus"] // (b["tp"] * b["pp"]), cp=1, micro_batch_size=b["mbs"],
                               recompute="full", zero_stage=1, sequence_parallel=False, overlap=deepspeed.overlap(1, b["pp"]),
                               loss_kernel="eager", param_dtype="bfloat16", **BF16_OPTIMIZER, **DEEPSPEED_HABITS))


def main() -> pd.DataFrame:
    out = []
    for case in [table2_case(*row) for row in TABLE2] + [mtnlg_case(*row) for row in MTNLG] + [bloom_case()]:
        result = predict(case)
        out.append(result)
        print_row(result, f"{result['model']:>28}")
    return write_out_of_sample(out, "published_at_scale")


if __name__ == "__main__":
    main()
