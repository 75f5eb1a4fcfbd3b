"""Hugging Face Accelerate: a plan as an `accelerate launch --config_file` YAML with FSDP2, and back.

Key names are Accelerate's (docs/source/usage_guides/fsdp.md and src/accelerate/commands/config/
cluster.py, main 2026-07): `distributed_type: FSDP` (or `MULTI_GPU` for DDP), `num_machines`,
`num_processes`, `mixed_precision: no|bf16|fp16`, and under `fsdp_config`: `fsdp_version: 2`,
`fsdp_reshard_after_forward` (true: ZeRO-3; false: parameters kept after forward, the planner's
ZeRO 1/2 as FSDP2 runs them), `fsdp_activation_checkpointing` (whole transformer layers),
`fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP`. FSDP1's `fsdp_sharding_strategy`
(FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, HYBRID_SHARD[_ZERO2]) is read too.

The config has no batch sizes (the training script sets them); the export writes them as a
comment `# planner: micro_batch_size=B gradient_accumulation_steps=M`, which `parse` reads back.
Accelerate's FSDP path has no pipeline stages; tensor parallelism needs its separate
`parallelism_config`, so a plan with pp or tp > 1 becomes data parallelism over every GPU.
"""

from __future__ import annotations

import re
from dataclasses import replace

from planner.engines.common import EngineLayout, Split, plan_layout, strongest_recompute
from planner.errors import PlannerError
from planner.plan import Plan


def mapped_layout(plan: Plan, names: list[str]) -> tuple[EngineLayout, list[str]]:
    lay, mapped, changes = plan.layout, plan_layout(plan), []
    if lay.pp_degree > 1 or lay.tp_degree > 1:
        world = plan.world_size
        mbs = plan.batch.micro_batch_size
        if plan.batch.global_batch_size % (world * mbs):
            mbs = max(d for d in range(1, mbs + 1) if plan.batch.global_batch_size % (world * d) == 0)
        changes.append(f"pp {lay.pp_degree} x tp {lay.tp_degree} x dp {lay.dp_degree} -> dp {world} (FSDP only)"
                       + (f", micro-batch {plan.batch.micro_batch_size} -> {mbs}" if mbs != plan.batch.micro_batch_size else ""))
        mapped = replace(mapped, pp_degree=1, tp_degree=1, dp_degree=world, sequence_parallel=False, schedule="1f1b",
                         virtual_stages=1, micro_batch_size=mbs, split=Split("even"))
    if mapped.zero_stage == 1 and mapped.dp > 1:
        changes.append("ZeRO 1 -> 2 (FSDP2 without resharding shards gradients too)")
        mapped = replace(mapped, zero_stage=2)
    mode = mapped.recompute if mapped.recompute != "mixed" else strongest_recompute(plan)
    mode = "full" if mode == "selective" else mode
    if mode != mapped.recompute:
        changes.append(f"recompute {[s.recompute for s in plan.stages]} -> full (fsdp_activation_checkpointing wraps whole layers)")
        mapped = replace(mapped, recompute=mode)
    return mapped, changes


def render(mapped: EngineLayout, plan: Plan, names: list[str], seq_len: int | None) -> str:
    import yaml

    m = mapped.num_microbatches
    config: dict[str, object] = {
        "compute_environment": "LOCAL_MACHINE",
        "distributed_type": "FSDP" if mapped.zero_stage >= 1 else "MULTI_GPU",
        "mixed_precision": {"bfloat16": "bf16", "float16": "fp16"}.get(mapped.dtype or "", "no"),
        "num_machines": plan.cluster.num_nodes,
        "num_processes": mapped.dp_degree,
        "machine_rank": 0,
    }
    if mapped.zero_stage >= 1:
        config["fsdp_config"] = {
            "fsdp_version": 2,
            "fsdp_reshard_after_forward": mapped.zero_stage == 3,
            "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
            "fsdp_activation_checkpointing": mapped.recompute == "full",
            "fsdp_state_dict_type": "SHARDED_STATE_DICT",
        }
    head = (f"# Accelerate config written by `planner export`; the training script sets the batch:\n"
            f"# planner: micro_batch_size={mapped.micro_batch_size} gradient_accumulation_steps={m}\n")
    if mapped.recompute == "full" and mapped.zero_stage == 0:
        head += "# recompute: call model.gradient_checkpointing_enable() (DDP has no config key for it)\n"
    return head + yaml.safe_dump(config, sort_keys=False)


STRATEGIES = {"FULL_SHARD": 3, "SHARD_GRAD_OP": 2, "NO_SHARD": 0, "HYBRID_SHARD": 3, "HYBRID_SHARD_ZERO2": 2}


def parse(text: str, source: str = "accelerate.yaml") -> EngineLayout:
    import yaml

    try:
        config = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        raise PlannerError(f"{source} is not valid YAML ({exc}).", "Pass an Accelerate config file.") from None
    if not isinstance(config, dict) or "distributed_type" not in config:
        raise PlannerError(f"{source} has no distributed_type.", "Pass an Accelerate config (accelerate config).")
    kind, fsdp, notes = config["distributed_type"], config.get("fsdp_config") or {}, []
    if kind == "FSDP":
        if int(fsdp.get("fsdp_version", 1)) == 2:
            zero = 3 if fsdp.get("fsdp_reshard_after_forward", True) else 2
        else:
            zero = STRATEGIES.get(str(fsdp.get("fsdp_sharding_strategy", "FULL_SHARD")), 3)
    elif kind in ("MULTI_GPU", "MULTI_CPU", "NO"):
        zero = 0
    else:
        raise PlannerError(f"{source}: distributed_type {kind} is not FSDP or MULTI_GPU.", "Export a DeepSpeed config instead.")
    batch = re.search(r"#\s*planner:\s*micro_batch_size=(\d+)\s+gradient_accumulation_steps=(\d+)", text)
    mbs, m = (int(batch.group(1)), int(batch.group(2))) if batch else (None, 1)
    if batch is None:
        notes.append("no batch in the config: one micro-batch of the global batch per GPU")
    precision = config.get("mixed_precision", "no")
    return EngineLayout(
        dp_degree=int(config.get("num_processes", 1)), zero_stage=zero, micro_batch_size=mbs,
        local_batch_size=mbs * m if mbs else None,
        recompute="full" if fsdp.get("fsdp_activation_checkpointing") else "none", split=Split("even"),
        dtype={"bf16": "bfloat16", "fp16": "float16"}.get(precision, "float32"), notes=tuple(notes))
