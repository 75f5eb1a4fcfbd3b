"""Megatron-LM: a plan as `pretrain_gpt.py` command-line arguments, and back.

Argument names and meanings are Megatron-LM's `megatron/training/arguments.py` (commit 84cf979,
2025-07-31, where each is an explicit `add_argument`; later versions generate the same flags from
their config dataclasses):

    --tensor-model-parallel-size, --pipeline-model-parallel-size, --context-parallel-size,
    --expert-model-parallel-size        degrees (data parallel is what the world size leaves)
    --sequence-parallel                 Korthikanti et al. 2022's sequence parallelism
    --num-layers-per-virtual-pipeline-stage / --num-virtual-stages-per-pipeline-rank
                                        interleaved 1F1B (the older --virtual-pipeline-model-parallel-size
                                        is read too); without them Megatron runs 1F1B
    --decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers
                                        layers of the first/last stage, the rest split evenly
    --pipeline-model-parallel-layout    any cuts: stages split by "|", E embedding, t layer, L loss
    --recompute-granularity full|selective (selective: core attention), --recompute-method
                                        uniform|block, --recompute-num-layers; --recompute-activations
                                        is the older spelling of selective
    --use-distributed-optimizer         ZeRO-1 (with --overlap-grad-reduce, --overlap-param-gather)
    --use-torch-fsdp2 [--torch-fsdp2-no-reshard-after-forward]
                                        ZeRO-3 [ZeRO-2: "Set to enable FSDP ZeRO-2"]
    --micro-batch-size, --global-batch-size, --seq-length, --num-layers, --bf16/--fp16, --clip-grad
    --grad-reduce-in-bf16, --accumulate-allreduce-grads-in-fp32
                                        the gradient buffer's dtype, which the data-parallel reduction
                                        moves: fp32 in a bf16 run unless the first is given
                                        (`gradient_dtype`)
    --overlap-grad-reduce, --overlap-param-gather, --tp-comm-overlap, --no-overlap-p2p-communication
                                        the communication hidden behind compute (`overlap`): all off
                                        by default but p2p, which only the interleaved schedule overlaps
    --no-gradient-accumulation-fusion   each micro-batch's gradients added to the fp32 buffer in a pass
                                        of their own; by default the weight-gradient GEMM accumulates
                                        (planner/cost/memory.py `accumulation_pass_bytes`)

The newer dimensions (same file and commit unless named):
    --expert-model-parallel-size        EP; Megatron-Core's rank order tp-cp-ep-dp-pp puts the ep ranks
                                        next to TP, consecutive data-parallel indices as the plan's.
                                        "--use-torch-fsdp2 is not supported with expert parallelism"
                                        (validate_args), so EP with ZeRO 2/3 becomes ZeRO 1.
    --expert-tensor-parallel-size       expert TP ("Degree of expert model parallelism"; unset, it
                                        takes the TP size), written whenever EP or expert TP is on so
                                        that the experts stay whole as the plan keeps them.
    --context-parallel-size             CP; Megatron's data-parallel size excludes the CP ranks, the
                                        plan's dp_degree counts them (world = tp x pp x dp here).
    --num-distributed-optimizer-instances N
                                        "Number of Distributed Optimizer copies across Data Parallel
                                        domain": the distributed optimizer shards over dp / N consecutive
                                        dp ranks and N copies (megatron/core/parallel_state.py, the
                                        intra-partial data-parallel groups) = hybrid sharding for ZeRO 1.
                                        The FSDP2 path has no replica groups: ZeRO 2/3 with a shard group
                                        becomes sharding over all dp ranks.
    --optimizer-cpu-offload             "Offload optimizer state to CPU"; validate_args requires
                                        --use-precision-aware-optimizer; the hybrid device optimizer
                                        copies gradients to the host, steps there and copies the
                                        parameters back (--overlap-cpu-optimizer-d2h-h2d): the plan's
                                        ZeRO 1 offload (weights stay on the GPU). Not with FSDP2, so
                                        ZeRO 2/3 offload becomes none.
    --fp8-format e4m3|hybrid, --fp8-recipe tensorwise|delayed|mxfp8|blockwise (default delayed)
                                        Transformer Engine FP8. The plan's FP8 is torchao's tensorwise
                                        dynamic scaling, e4m3 forward and e5m2 gradients
                                        (torchao/float8/config.py): --fp8-format hybrid --fp8-recipe
                                        tensorwise ("per tensor current scaling"). Other recipes are
                                        read and priced as that, with a note.

Megatron-LM puts the embedding on the first stage and the final norm, output layer and loss on
the last; a plan that cuts elsewhere around them is moved there (with a warning and its price).
"""

from __future__ import annotations

import re
import shlex
from dataclasses import replace
from typing import Any

from planner.cost.overlap import Overlap
from planner.engines.common import (
    EngineLayout,
    Split,
    blocks_per_stage,
    lost_overlaps,
    model_parts,
    one_recompute_mode,
    plan_layout,
)
from planner.errors import PlannerError
from planner.hardware import END_TO_END_ATTENTION_FRACTION, GPUS, GPUSpec
from planner.plan import Plan

FLAGS = {"--sequence-parallel", "--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather",
         "--use-torch-fsdp2", "--torch-fsdp2-no-reshard-after-forward", "--recompute-activations", "--bf16", "--fp16",
         "--use-custom-fsdp", "--use-megatron-fsdp", "--optimizer-cpu-offload", "--use-precision-aware-optimizer",
         "--overlap-cpu-optimizer-d2h-h2d", "--fp8-param-gather", "--first-last-layers-bf16", "--grad-reduce-in-bf16",
         "--accumulate-allreduce-grads-in-fp32", "--tp-comm-overlap", "--no-overlap-p2p-communication",
         "--no-gradient-accumulation-fusion"}


def _new_dimensions(mapped: EngineLayout, changes: list[str]) -> EngineLayout:
    """EP, hybrid sharding and offload as Megatron-LM can run them (module docstring), changes noted."""
    if mapped.ep_degree > 1 and mapped.zero_stage >= 2:
        changes.append(f"ZeRO {mapped.zero_stage} -> 1 (--use-torch-fsdp2 is not supported with expert parallelism; "
                       "the distributed optimizer is)")
        mapped = replace(mapped, zero_stage=1)
    if mapped.shard_degree is not None and mapped.zero_stage >= 2:
        changes.append(f"hybrid sharding over groups of {mapped.shard_degree} -> ZeRO {mapped.zero_stage} over all "
                       f"{mapped.dp} data-parallel ranks (Megatron's FSDP2 path has no replica groups)")
        mapped = replace(mapped, shard_degree=None)
    if mapped.offload and mapped.zero_stage >= 2 and mapped.dp == 1:
        changes.append(f"ZeRO {mapped.zero_stage} -> 1 (one data-parallel rank: the same single shard, run by the "
                       "distributed optimizer that --optimizer-cpu-offload needs; the weights stay on the GPU)")
        mapped = replace(mapped, zero_stage=1)
    if mapped.offload and mapped.zero_stage >= 2:
        changes.append("CPU offload -> none (--optimizer-cpu-offload needs the distributed optimizer, which "
                       "--use-torch-fsdp2 excludes)")
        mapped = replace(mapped, offload=False)
    return mapped


def mapped_layout(plan: Plan, names: list[str]) -> tuple[EngineLayout, list[str]]:
    """What Megatron-LM will run, and each change from the plan."""
    lay, mapped = plan.layout, plan_layout(plan)
    changes: list[str] = []
    mapped = _unit_recompute(plan, names, mapped, changes)
    mapped = one_recompute_mode(plan, mapped, changes, "--recompute-granularity is one setting")
    if mapped.recompute == "op":  # no op-level policy: full recomputation keeps within the plan's memory
        changes.append("recompute op (op-level selective checkpointing) -> full (Megatron-LM's selective recomputes "
                       "the attention core only, which keeps more than op does)")
        mapped = replace(mapped, recompute="full")
    if lay.pp_degree > 1:
        megatron = "interleaved-1f1b" if lay.virtual_stages > 1 else "1f1b"
        if lay.schedule != megatron:
            changes.append(f"schedule {lay.schedule} -> {megatron} (Megatron-LM runs 1F1B, interleaved with virtual stages)")
            mapped = replace(mapped, schedule=megatron)
    else:
        mapped = replace(mapped, schedule="1f1b")
    bounds = [(sum(len(s.units) for s in plan.stages[:k]), sum(len(s.units) for s in plan.stages[:k + 1]))
              for k in range(len(plan.stages))]
    counts, moved = blocks_per_stage(names, bounds)
    if moved:
        changes.append(f"{moved} moved to the first/last stage (Megatron-LM places the embedding with the first stage, "
                       "the final norm and output layer with the last)")
    mapped = replace(mapped, split=Split("blocks", blocks=tuple(counts)))
    mapped = _new_dimensions(mapped, changes)
    # `render` asks for every overlap Megatron-LM has but async TP; p2p overlaps only when interleaved.
    mapped = replace(mapped, overlap=overlap(mapped.virtual_stages > 1, fsdp=mapped.zero_stage >= 2),
                     grad_accumulation="fused")  # Megatron-Core's default, which `render` keeps
    lost_overlaps(plan, mapped, changes, {"pipeline_p2p": "Megatron-LM's non-interleaved 1F1B waits for each send and receive",
                                          "tp_comm": "the planner writes no --tp-comm-overlap"})
    return mapped, changes


def tp_layout_changes(plan: Plan) -> list[str]:
    """What changes when Megatron-LM runs the plan's own TP degree: it shards every attention and
    MLP linear, where the plan may have left some replicated. Asked only while the exported degree
    is the plan's (planner/engines/__init__.py `export_plan`): at another degree the plan's
    replicated modules say nothing."""
    replicated = sorted({name for s in plan.stages for name, style in s.tp_plan.items() if style == "replicate"})
    if not replicated:
        return []
    return [f"TP layout: Megatron-LM shards every attention and MLP linear, the plan leaves {replicated[:4]} "
            "replicated (priced with the solver's own TP layout for the pinned degree)"]


def block_recompute_layers(plan: Plan, names: list[str]) -> int | None:
    """k when every stage fully recomputes its first min(k, its layers) transformer layers and no
    other unit, and some stage mixes modes: Megatron-LM's `--recompute-method block
    --recompute-num-layers k`, which checkpoints the first k layers of each pipeline stage (each
    virtual chunk's TransformerBlock); else None."""
    _, blocks, _ = model_parts(names)
    block_set = set(blocks)
    stages = [[r for u, r in s.unit_modes().items() if u in block_set] for s in plan.stages]
    others = [r for s in plan.stages for u, r in s.unit_modes().items() if u not in block_set]
    leading = [next((n for n, r in enumerate(modes) if r != "full"), len(modes)) for modes in stages]
    k = max(leading, default=0)
    exact = all(modes == ["full"] * min(k, len(modes)) + ["none"] * (len(modes) - min(k, len(modes))) for modes in stages)
    mixed = any(0 < lead < len(modes) for lead, modes in zip(leading, stages, strict=True))
    return k if exact and mixed and all(r == "none" for r in others) else None


def _unit_recompute(plan: Plan, names: list[str], mapped: EngineLayout, changes: list[str]) -> EngineLayout:
    """Per-unit recomputation as Megatron-LM runs it: the first k layers of each stage
    (`block_recompute_layers`, written by `render`), else the nearest one mode (common.py)."""
    from planner.engines.common import nearest_unit_recompute

    k = block_recompute_layers(plan, names)
    mapped = nearest_unit_recompute(plan, mapped, changes, k is not None,
                                    "Megatron-LM recomputes one mode, or fully the first k layers of each stage")
    return replace(mapped, layer_recompute=("first", k)) if k is not None else mapped


def _split_args(counts: list[int], pp: int, v: int) -> list[str]:
    if len(set(counts)) == 1:
        return [f"--num-layers-per-virtual-pipeline-stage {counts[0]}"] if v > 1 else []
    if v == 1 and pp > 2 and len(set(counts[1:-1])) == 1:
        middle = counts[1]
        return ([f"--decoder-first-pipeline-num-layers {counts[0]}"] if counts[0] != middle else []) + \
               ([f"--decoder-last-pipeline-num-layers {counts[-1]}"] if counts[-1] != middle else [])
    if v == 1 and pp == 2:
        return [f"--decoder-first-pipeline-num-layers {counts[0]}"]
    stages = [("E" if k == 0 else "") + (f"t*{c}" if c > 1 else "t" * c) + ("L" if k == len(counts) - 1 else "")
              for k, c in enumerate(counts)]
    return [f"--pipeline-model-parallel-layout {shlex.quote('|'.join(stages))}"]


def render(mapped: EngineLayout, plan: Plan, names: list[str], seq_len: int | None) -> str:
    _, blocks, _ = model_parts(names)
    args = [f"--tensor-model-parallel-size {mapped.tp_degree}", f"--pipeline-model-parallel-size {mapped.pp_degree}",
            f"--context-parallel-size {mapped.cp_degree}", f"--expert-model-parallel-size {mapped.ep_degree}",
            f"--num-layers {len(blocks)}"]
    if mapped.cp_degree > 1:  # p2p: the ring (Megatron-Core's default), allgather: Llama 3's all-gather of K/V
        args.append(f"--cp-comm-type {CP_COMM_TYPE[mapped.cp_algorithm]}")
    if mapped.ep_degree > 1 or mapped.expert_tp_degree > 1:  # unset, Megatron-Core splits experts over the whole TP group
        args.append(f"--expert-tensor-parallel-size {mapped.expert_tp_degree}")
    if mapped.pp_degree > 1:
        args += _split_args(list(mapped.split.blocks), mapped.pp_degree, mapped.virtual_stages)
    if mapped.sequence_parallel:
        args.append("--sequence-parallel")
    block_layers = block_recompute_layers(plan, names) if mapped.recompute == "full" else None
    if block_layers is not None:  # the plan's first k layers of each stage, fully
        args += ["--recompute-granularity full", "--recompute-method block", f"--recompute-num-layers {block_layers}"]
    elif mapped.recompute == "full":  # every layer checkpointed on its own: the planner's per-unit full recomputation
        args += ["--recompute-granularity full", "--recompute-method uniform", "--recompute-num-layers 1"]
    elif mapped.recompute == "selective":
        args.append("--recompute-granularity selective")
    if mapped.dp > 1 or mapped.zero_stage == 1:
        args += {0: ["--overlap-grad-reduce"],
                 1: ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"],
                 2: ["--use-torch-fsdp2", "--torch-fsdp2-no-reshard-after-forward"],
                 3: ["--use-torch-fsdp2"]}[mapped.zero_stage]
    if mapped.shard_degree is not None:  # ZeRO 1 here (_new_dimensions): copies of the distributed optimizer
        args.append(f"--num-distributed-optimizer-instances {mapped.dp // mapped.shard_degree}")
    if mapped.offload:
        args += ["--optimizer-cpu-offload", "--use-precision-aware-optimizer", "--overlap-cpu-optimizer-d2h-h2d"]
    if mapped.float8:
        args += ["--fp8-format hybrid", "--fp8-recipe tensorwise"]
    args += [f"--micro-batch-size {mapped.micro_batch_size}", f"--global-batch-size {mapped.global_batch_size}"]
    if seq_len:
        args.append(f"--seq-length {seq_len}")
    args += {"bfloat16": ["--bf16"], "float16": ["--fp16"]}.get(mapped.dtype or "", [])
    args.append(f"--clip-grad {mapped.grad_clip if mapped.grad_clip is not None else 0.0}")
    return "\n".join(args) + "\n"


def tokens(text: str) -> dict[str, str | bool]:
    """`--name value` / `--name=value` / flags from a file with one argument per line or a shell
    command line (backslash continuations, comments and a leading `torchrun ... pretrain_gpt.py`)."""
    words = shlex.split(text.replace("\\\n", " "), comments=True)
    out: dict[str, str | bool] = {}
    i = 0
    while i < len(words):
        word = words[i]
        if word.startswith("--"):
            name, eq, value = word.partition("=")
            if eq:
                out[name] = value
            elif name in FLAGS or i + 1 == len(words) or words[i + 1].startswith("--"):
                out[name] = True
            else:
                out[name] = words[i + 1]
                i += 1
        i += 1
    return out


def layout_counts(layout: str, source: str) -> list[int]:
    """Layers per stage of a --pipeline-model-parallel-layout, unrolled as Megatron-LM's
    `PipelineParallelLayerLayout.parse_str_to_list` does ((...)*n, then x*n; commas are cosmetic)."""
    text = layout.replace(",", "")
    for pattern in (r"\(([^)]+)\)\*(\d+)", r"(.)\*(\d+)"):
        text = re.sub(pattern, lambda m: m.group(1) * int(m.group(2)), text)
    stages = text.split("|")
    bad = set(text) - set("EtL|")
    if bad or not stages[0].startswith("E") or not stages[-1].endswith("L") or text.count("E") != 1 or text.count("L") != 1:
        raise PlannerError(f"{source}: pipeline layout {layout!r} is not E (first stage), t layers, L (last stage).",
                           "The planner prices decoder layers (t) with the embedding first and the loss last.")
    return [stage.count("t") for stage in stages]


def _int(args: dict, name: str, default: int, source: str) -> int:
    value = _optional_int(args, name, source)
    return default if value is None else value


def _optional_int(args: dict, name: str, source: str) -> int | None:
    value = args.get(name)
    if value is None or isinstance(value, int):
        return value
    try:
        return int(value)
    except (TypeError, ValueError):
        raise PlannerError(f"{source}: {name} {value!r} is not a number.",
                           "Replace shell variables by their values (the planner does not run the script).") from None


CP_COMM_TYPE = {"ring": "p2p", "all-gather": "allgather"}
"""The plan's `Layout.cp_algorithm` -> Megatron-LM's --cp-comm-type (arguments.py: "p2p, a2a, allgather
or a2a+p2p", default p2p; p2p passes K/V blocks around the ring, overlapped with attention)."""


def _cp_algorithm(comm_type: str, notes: list[str]) -> str:
    """--cp-comm-type's (first) value as the plan's algorithm; the all-to-all kinds, which the
    planner does not model, priced as the ring with a note."""
    for algorithm, name in CP_COMM_TYPE.items():
        if comm_type == name:
            return algorithm
    notes.append(f"--cp-comm-type {comm_type} (all-to-all over heads) priced as the ring (p2p)")
    return "ring"


def gradient_dtype(dtype: str, grad_reduce_in_bf16: bool = False, accumulate_in_fp32: bool = False) -> str | None:
    """The dtype of Megatron-LM's gradient buffer, which its data-parallel reduction moves
    (planner/cost/memory.py `Precision`): float32 in a bf16 run (megatron/training/arguments.py
    sets `accumulate_allreduce_grads_in_fp32` for bf16 unless `--grad-reduce-in-bf16`, and
    param_and_grad_buffer.py then makes the buffer fp32) or where
    `--accumulate-allreduce-grads-in-fp32` is given; else None, the parameters' dtype (an fp16
    run's 16-bit gradients, as SC21's runs reduced them)."""
    if dtype == "bfloat16" and not grad_reduce_in_bf16 or accumulate_in_fp32 and dtype != "float32":
        return "float32"
    return None


def overlap(interleaved: bool, grad_reduce: bool = True, param_gather: bool = True, p2p: bool = True,
            tp_comm: bool = False, fsdp: bool = False) -> Overlap:
    """The communication Megatron-LM hides behind compute (planner/cost/overlap.py), from its flags
    (megatron/training/arguments.py, commit d98e8a6): the data-parallel gradient reduction under
    the backward with `--overlap-grad-reduce` (default off: `finalize_model_grads` reduces after
    the last micro-batch's backward); the distributed optimizer's parameter all-gather under the
    next forward with `--overlap-param-gather` (default off: gathered after the step); pipeline
    sends beside compute only in the interleaved schedule, unless `--no-overlap-p2p-communication`
    ("non-interleaved schedule does not support overlapping p2p communication", validate_args);
    TP collectives with `--tp-comm-overlap` (Transformer Engine's userbuffers). Under torch FSDP2
    (`fsdp`: --use-torch-fsdp2) the reduction and the gathers are FSDP2's own, overlapped per
    unit."""
    return Overlap(grad_reduce=grad_reduce or fsdp, param_gather=param_gather or fsdp,
                   pipeline_p2p=interleaved and p2p, tp_comm=tp_comm)


MEMORY_HABITS: dict[str, Any] = dict(fused_optimizer=True, pipeline_buffers="in-flight", dp_collectives="bucketed")
"""How Megatron-LM holds memory where the planner's runtime holds more (planner/solver/search.py
`Environment`): its optimizer (megatron/core/optimizer: apex's or Transformer Engine's FusedAdam)
steps in place, and its pipeline (megatron/core/pipeline_parallel/p2p_communication.py) sends and
receives one micro-batch at a time; and how its distributed optimizer communicates: its flat
gradient and parameter buffers in buckets (megatron/core/distributed/param_and_grad_buffer.py),
not a collective per layer as FSDP2. Pins and EngineLayout fields."""


def stack_gpu(gpu: GPUSpec) -> GPUSpec:
    """The GPU as Megatron-LM's runs price: on a GPU whose preset prices fused attention at a kernel's
    benchmarked rates (Hopper), Transformer Engine's attention as Megatron-Core's published H100 runs
    show it end to end (shared/reference/): FlashAttention-2's 35% of the peak, sustained, on every
    score in both passes (planner/hardware.py `END_TO_END_ATTENTION_FRACTION`, module docstring).
    A GPU without such rates (A100, Blackwell: the GEMM rate) or with a cluster file's own is kept."""
    preset = GPUS.get(gpu.name)
    own = ("attention_efficiency", "attention_backward_ratio", "attention_causal_ratio")
    if gpu.attention_efficiency is None or preset is None or any(getattr(gpu, f) != getattr(preset, f) for f in own):
        return gpu
    return replace(gpu, attention_efficiency=END_TO_END_ATTENTION_FRACTION, attention_backward_ratio=1.0,
                   attention_causal_ratio=0.5)


def parse(text: str, source: str = "megatron-args.txt") -> EngineLayout:
    args = tokens(text)
    if not any(k.startswith("--") for k in args):
        raise PlannerError(f"{source} holds no --arguments.", "Pass Megatron-LM arguments, one per line or as a command line.")
    num = lambda name, default: _int(args, name, default, source)  # noqa: E731
    optional = lambda name: _optional_int(args, name, source)  # noqa: E731
    tp, pp, layers = num("--tensor-model-parallel-size", 1), num("--pipeline-model-parallel-size", 1), optional("--num-layers")
    v = optional("--num-virtual-stages-per-pipeline-rank") or optional("--virtual-pipeline-model-parallel-size") or 1
    per_vstage = optional("--num-layers-per-virtual-pipeline-stage")
    notes = []
    if per_vstage:
        if layers is None:
            raise PlannerError(f"{source}: --num-layers-per-virtual-pipeline-stage needs --num-layers.", "Add --num-layers.")
        v = layers // (pp * per_vstage)
    split = Split("even")
    if args.get("--pipeline-model-parallel-layout"):
        counts = layout_counts(str(args["--pipeline-model-parallel-layout"]), source)
        v = len(counts) // pp
        split = Split("blocks", blocks=tuple(counts))
    elif "--decoder-first-pipeline-num-layers" in args or "--decoder-last-pipeline-num-layers" in args:
        if layers is None or v > 1:
            raise PlannerError(f"{source}: first/last stage layers need --num-layers and no virtual stages here.",
                               "Add --num-layers, or give --pipeline-model-parallel-layout.")
        first, last = optional("--decoder-first-pipeline-num-layers"), optional("--decoder-last-pipeline-num-layers")
        rest = pp - (first is not None) - (last is not None)
        left = layers - (first or 0) - (last or 0)
        if rest < 0 or (rest and left % rest):
            raise PlannerError(f"{source}: {left} layers do not split evenly over the other {rest} stages.", "Fix the layer counts.")
        middle = [left // rest] * rest if rest else []
        split = Split("blocks", blocks=tuple(([first] if first is not None else []) + middle + ([last] if last is not None else [])))
    some_layers = None
    if args.get("--recompute-granularity") == "full":
        method, k = args.get("--recompute-method"), num("--recompute-num-layers", 1)
        if method == "block":  # the first k layers of each stage chunk, the rest kept
            some_layers = ("first", k) if k > 0 else None
        elif method == "uniform" and k != 1:
            notes.append(f"--recompute-method uniform --recompute-num-layers {k} priced as full recomputation of every layer "
                         "(it checkpoints groups of k layers: the same recomputation, fewer layer inputs kept)")
        recompute = "none" if method == "block" and k <= 0 else "full"
    else:
        recompute = "selective" if args.get("--recompute-granularity") == "selective" or args.get("--recompute-activations") else "none"
    zero = 0
    if args.get("--use-distributed-optimizer"):
        zero = 1
    if args.get("--use-torch-fsdp2"):
        zero = 2 if args.get("--torch-fsdp2-no-reshard-after-forward") else 3
    if args.get("--use-custom-fsdp") or args.get("--use-megatron-fsdp"):
        zero = {"no_shard": 0, "optim": 1, "optim_grads": 2}.get(str(args.get("--data-parallel-sharding-strategy", "")), 3)
    mbs, glob = num("--micro-batch-size", 1), optional("--global-batch-size")
    clip = float(args.get("--clip-grad", 1.0))
    instances = num("--num-distributed-optimizer-instances", 1)
    if instances > 1 and zero != 1:
        notes.append(f"--num-distributed-optimizer-instances {instances} without the distributed optimizer: not priced")
    offload = bool(args.get("--optimizer-cpu-offload"))
    fraction = float(args.get("--optimizer-offload-fraction", 1.0))
    if offload and fraction != 1.0:
        notes.append(f"--optimizer-offload-fraction {fraction} priced as the whole optimizer offloaded")
    if args.get("--num-experts") and tp > 1 and args.get("--expert-tensor-parallel-size") is None:
        notes.append("--expert-tensor-parallel-size not given (Megatron-Core then splits the experts over the TP group): "
                     "priced with whole experts, expert TP 1")
    cp_algorithm = _cp_algorithm(str(args.get("--cp-comm-type", "p2p")), notes) \
        if num("--context-parallel-size", 1) > 1 else "all-gather"
    float8 = args.get("--fp8-format") not in (None, True)
    recipe = str(args.get("--fp8-recipe", "delayed"))  # Megatron-LM's default recipe
    if float8 and (recipe, args["--fp8-format"]) != ("tensorwise", "hybrid"):
        notes.append(f"--fp8-format {args['--fp8-format']} --fp8-recipe {recipe} priced as torchao tensorwise dynamic "
                     "scaling (e4m3 forward, e5m2 gradients)")
    dtype = "bfloat16" if args.get("--bf16") else "float16" if args.get("--fp16") else "float32"
    return EngineLayout(
        recompute_modes=("none", "selective", "full"),  # what it can run (planner price's best plan uses only these)
        # megatron/core/tensor_parallel/cross_entropy.py: the saved softmax becomes the gradient in place
        loss_kernel="fused",
        **MEMORY_HABITS,
        pp_degree=pp, tp_degree=tp, zero_stage=zero, sequence_parallel=bool(args.get("--sequence-parallel")),
        schedule="interleaved-1f1b" if v > 1 else "1f1b", virtual_stages=v, micro_batch_size=mbs,
        global_batch_size=glob, local_batch_size=mbs, recompute=recompute, layer_recompute=some_layers, split=split,
        dtype=dtype, grad_dtype=gradient_dtype(dtype, bool(args.get("--grad-reduce-in-bf16")),
                                               bool(args.get("--accumulate-allreduce-grads-in-fp32"))),
        grad_clip=clip or None, notes=tuple(notes), ep_degree=num("--expert-model-parallel-size", 1),
        expert_tp_degree=num("--expert-tensor-parallel-size", 1),
        cp_degree=num("--context-parallel-size", 1), cp_algorithm=cp_algorithm, replicate_degree=instances if instances > 1 and zero == 1 else None,
        offload=offload, float8=float8,
        overlap=overlap(v > 1, bool(args.get("--overlap-grad-reduce")), bool(args.get("--overlap-param-gather")),
                        not args.get("--no-overlap-p2p-communication"), bool(args.get("--tp-comm-overlap")),
                        fsdp=bool(args.get("--use-torch-fsdp2"))),
        # Megatron-Core fuses the accumulation into the weight-gradient GEMM unless told not to
        # (arguments.py --no-gradient-accumulation-fusion), then main_grad.add_ per micro-batch.
        grad_accumulation="buffer" if args.get("--no-gradient-accumulation-fusion") else "fused")
