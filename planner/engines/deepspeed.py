"""DeepSpeed: a plan as a `ds_config.json`, and back.

Key names are DeepSpeed's (deepspeed/runtime/config.py, zero/config.py, tensor_parallel/config.py,
activation_checkpointing/config.py and pipe/module.py, master 2026-08; the JSON reference is
https://www.deepspeed.ai/docs/config-json/):

    train_batch_size = train_micro_batch_size_per_gpu x gradient_accumulation_steps x data-parallel ranks
    zero_optimization.stage 0-3; offload_optimizer / offload_param (CPU/NVMe offload: not priced here)
    bf16.enabled / fp16.enabled; gradient_clipping
    tensor_parallel.autotp_size         AutoTP training (Linear layers column/row sharded; no sequence parallelism)
    pipeline.stages, pipeline.partition, pipeline.activation_checkpoint_interval
                                        what `PipelineModule(num_stages=, partition_method=,
                                        activation_checkpoint_interval=)` takes in code; DeepSpeed's
                                        pipeline runs one 1F1B schedule (TrainSchedule) and, per its
                                        docstring, "is not compatible with ZeRO-2 and ZeRO-3"
    activation_checkpointing            deepspeed.checkpointing's options (whole layers recomputed)

partition_method 'uniform' splits the layers as `partition_uniform` (deepspeed/runtime/utils.py),
'parameters' (the default) balances parameter counts; neither takes arbitrary cuts, so a plan's
own cuts become the nearest of the two.
"""

from __future__ import annotations

import json
from dataclasses import replace

from planner.engines.common import (
    EngineLayout,
    Split,
    ds_uniform,
    plan_layout,
    strongest_recompute,
)
from planner.errors import PlannerError
from planner.plan import Plan


def mapped_layout(plan: Plan, names: list[str]) -> tuple[EngineLayout, list[str]]:
    lay, mapped, changes = plan.layout, plan_layout(plan), []
    mode = mapped.recompute if mapped.recompute != "mixed" else strongest_recompute(plan)
    if mode == "selective":
        mode = "full"
    if mode != mapped.recompute:
        changes.append(f"recompute {[s.recompute for s in plan.stages]} -> full on every stage "
                       "(DeepSpeed checkpoints whole layers, one interval for all)")
        mapped = replace(mapped, recompute=mode)
    if lay.sequence_parallel:
        changes.append("sequence parallelism on -> off (AutoTP has none)")
        mapped = replace(mapped, sequence_parallel=False)
    if lay.pp_degree > 1:
        if lay.zero_stage >= 2:
            changes.append(f"ZeRO {lay.zero_stage} -> 1 (DeepSpeed's pipeline engine takes ZeRO 0 or 1)")
            mapped = replace(mapped, zero_stage=1)
        if lay.schedule != "1f1b" or lay.virtual_stages > 1:
            changes.append(f"schedule {lay.schedule} (virtual stages {lay.virtual_stages}) -> 1f1b (DeepSpeed's TrainSchedule)")
            mapped = replace(mapped, schedule="1f1b", virtual_stages=1)
        own = [len(s.units) for s in plan.stages]
        edges = ds_uniform(len(names), lay.pp_degree)
        uniform = [b - a for a, b in zip(edges[:-1], edges[1:], strict=False)]
        if own != uniform:
            changes.append(f"stage cuts {own} units per stage -> DeepSpeed's uniform partition {uniform}")
        mapped = replace(mapped, split=Split("uniform"))
    else:
        mapped = replace(mapped, schedule="1f1b")
    return mapped, changes


def render(mapped: EngineLayout, plan: Plan, names: list[str], seq_len: int | None) -> str:
    m = mapped.num_microbatches
    config: dict = {
        "train_batch_size": mapped.global_batch_size,
        "train_micro_batch_size_per_gpu": mapped.micro_batch_size,
        "gradient_accumulation_steps": m,
        "zero_optimization": {"stage": mapped.zero_stage, "overlap_comm": mapped.dp > 1, "contiguous_gradients": True},
    }
    if mapped.dtype == "bfloat16":
        config["bf16"] = {"enabled": True}
    elif mapped.dtype == "float16":
        config["fp16"] = {"enabled": True}
    if mapped.grad_clip is not None:
        config["gradient_clipping"] = mapped.grad_clip
    if mapped.tp_degree > 1:
        config["tensor_parallel"] = {"autotp_size": mapped.tp_degree}
    config["pipeline"] = {"stages": mapped.pp_degree, "partition": "uniform",
                          "activation_checkpoint_interval": 1 if mapped.recompute == "full" else 0}
    if mapped.recompute == "full":
        config["activation_checkpointing"] = {"partition_activations": False, "cpu_checkpointing": False,
                                              "contiguous_memory_optimization": False}
    return json.dumps(config, indent=2) + "\n"


def _enabled(section) -> bool | None:
    value = section.get("enabled") if isinstance(section, dict) else None
    return None if value == "auto" else bool(value)


def parse(text: str, source: str = "ds_config.json") -> EngineLayout:
    try:
        config = json.loads(text)
    except json.JSONDecodeError as exc:
        raise PlannerError(f"{source} is not valid JSON ({exc}).", "Pass a DeepSpeed config file.") from None
    auto = [k for k in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps") if config.get(k) == "auto"]
    if auto:
        raise PlannerError(f"{source}: {auto} are 'auto' (filled in by the Hugging Face Trainer).", "Write the numbers you run with.")
    zero = config.get("zero_optimization", {})
    notes = [f"{k} ({zero[k].get('device')}) not priced" for k in ("offload_optimizer", "offload_param")
             if isinstance(zero.get(k), dict) and zero[k].get("device", "none") != "none"]
    pipe = config.get("pipeline", {})
    pp = pipe.get("stages", 1)
    pp = pp if isinstance(pp, int) else 1
    partition = str(pipe.get("partition", "parameters"))
    if partition not in ("uniform", "parameters"):
        notes.append(f"pipeline partition {partition!r} priced as 'parameters'")
    mbs, gas, total = (config.get(k) for k in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size"))
    dp = total // (mbs * gas) if total and mbs and gas else None
    if mbs is None and total and gas:
        raise PlannerError(f"{source}: train_micro_batch_size_per_gpu missing.", "Add it (the planner prices micro-batches).")
    bf16, fp16 = _enabled(config.get("bf16")), _enabled(config.get("fp16"))
    auto_dtype = any(isinstance(config.get(k), dict) and config[k].get("enabled") == "auto" for k in ("bf16", "fp16"))
    return EngineLayout(
        pp_degree=pp, tp_degree=int(config.get("tensor_parallel", {}).get("autotp_size", 0) or 1), dp_degree=dp,
        zero_stage=int(zero.get("stage", 0)), schedule="1f1b", micro_batch_size=mbs, global_batch_size=total,
        local_batch_size=mbs * (gas or 1) if mbs else None,
        recompute="full" if pipe.get("activation_checkpoint_interval", 0) else "none",
        split=Split("uniform" if partition == "uniform" else "parameters"),
        dtype="bfloat16" if bf16 else "float16" if fp16 else None if auto_dtype else "float32",
        grad_clip=config.get("gradient_clipping") or None, notes=tuple(notes))
