"""Hugging Face Accelerate: a plan as an `accelerate launch --config_file` YAML with FSDP2, and back.

Key names are Accelerate's (docs/source/usage_guides/fsdp.md and src/accelerate/commands/config/
cluster.py, main 2026-07): `distributed_type: FSDP` (or `MULTI_GPU` for DDP), `num_machines`,
`num_processes`, `mixed_precision: no|bf16|fp16`, and under `fsdp_config`: `fsdp_version: 2`,
`fsdp_reshard_after_forward` (true: ZeRO-3; false: parameters kept after forward, the planner's
ZeRO 1/2 as FSDP2 runs them), `fsdp_activation_checkpointing` (whole transformer layers),
`fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP`. FSDP1's `fsdp_sharding_strategy`
(FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, HYBRID_SHARD[_ZERO2]) is read too. `mixed_precision` under
FSDP is the plugin's mixed precision policy, weights gathered and gradients reduced in that type
(utils/dataclasses.py `FullyShardedDataParallelPlugin.set_mixed_precision`); under DDP it is
native autocast over fp32 parameters, whose fp32 gradients DDP all-reduces.

The newer dimensions (same sources; `parallelism_config` and `fp8_config` are what `accelerate
config` writes, src/accelerate/commands/config/cluster.py):
    parallelism_config: parallelism_config_dp_replicate_size R, parallelism_config_dp_shard_size S
                            FSDP2 over S consecutive ranks, replicated R times (Accelerate's
                            ParallelismConfig builds the device mesh) = the plan's shard_degree S;
                            parallelism_config_cp_size C: context parallelism (the plan's cp_degree,
                            counted inside its dp as here, world = R x S x C)
    fsdp_config.fsdp_offload_params: true
                            "offload parameters and gradients to CPU": FSDP2's CPUOffloadPolicy, the
                            optimizer step on the host = the plan's training.offload = "cpu"
    mixed_precision: fp8 with fp8_config.backend: AO
                            torchao Float8 linears (Float8LinearConfig's default: tensorwise dynamic
                            scaling, the plan's), enable_fsdp_float8_all_gather where FSDP shards (as the
                            plan's runtime does), pad_inner_dim false (the cost model converts only
                            linears whose dims are multiples of 16: planner/cost/fp8.py)
    fsdp_sharding_strategy: HYBRID_SHARD (FSDP1)
                            sharding inside a node, replicas across: shard_degree = num_processes /
                            num_machines
Accelerate has no expert parallelism (ParallelismConfig: dp_replicate, dp_shard, tp, cp), so a plan
with EP runs with every rank holding all experts.

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
    if mapped.ep_degree > 1:
        changes.append(f"expert parallelism {mapped.ep_degree} -> 1 (Accelerate has none: every rank holds all experts)")
        mapped = replace(mapped, ep_degree=1)
    if mapped.zero_stage == 1 and mapped.dp > 1:
        changes.append("ZeRO 1 -> 2 (FSDP2 without resharding shards gradients too)")
        mapped = replace(mapped, zero_stage=2)
    mode = mapped.recompute if mapped.recompute != "mixed" else strongest_recompute(plan)
    mode = "full" if mode in ("selective", "op") else mode
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
        "mixed_precision": "fp8" if mapped.float8 else {"bfloat16": "bf16", "float16": "fp16"}.get(mapped.dtype or "", "no"),
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
            "fsdp_offload_params": mapped.offload,
        }
    if mapped.float8:
        config["fp8_config"] = {"backend": "AO", "enable_fsdp_float8_all_gather": mapped.zero_stage >= 1 and mapped.dp > 1,
                                "pad_inner_dim": False}
    if mapped.shard_degree is not None or mapped.cp_degree > 1:
        group = mapped.shard_degree or mapped.dp  # FSDP's ranks, cp included
        config["parallelism_config"] = {"parallelism_config_dp_replicate_size": mapped.dp // group,
                                        "parallelism_config_dp_shard_size": group // mapped.cp_degree,
                                        "parallelism_config_tp_size": 1, "parallelism_config_cp_size": mapped.cp_degree}
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
    num_processes, shard = int(config.get("num_processes", 1)), None
    par = config.get("parallelism_config") or {}
    cp = int(par.get("parallelism_config_cp_size", 1))
    if kind == "FSDP":
        if int(fsdp.get("fsdp_version", 1)) == 2:
            zero = 3 if fsdp.get("fsdp_reshard_after_forward", True) else 2
        else:
            strategy = str(fsdp.get("fsdp_sharding_strategy", "FULL_SHARD"))
            zero = STRATEGIES.get(strategy, 3)
            if strategy.startswith("HYBRID_SHARD"):  # shard inside a node, replicate across nodes
                shard = num_processes // int(config.get("num_machines", 1))
        if int(par.get("parallelism_config_dp_replicate_size", 1)) > 1:
            shard = int(par.get("parallelism_config_dp_shard_size", 1)) * cp
        if int(par.get("parallelism_config_tp_size", 1)) > 1:
            raise PlannerError(f"{source}: parallelism_config_tp_size {par['parallelism_config_tp_size']}: the planner reads "
                               "Accelerate's FSDP data parallelism only.", "Price it with parallelism_config_tp_size 1.")
    elif kind in ("MULTI_GPU", "MULTI_CPU", "NO"):
        zero = 0
    else:
        raise PlannerError(f"{source}: distributed_type {kind} is not FSDP or MULTI_GPU.", "Export a DeepSpeed config instead.")
    batch = re.search(r"#\s*planner:\s*micro_batch_size=(\d+)\s+gradient_accumulation_steps=(\d+)", text)
    mbs, m = (int(batch.group(1)), int(batch.group(2))) if batch else (None, 1)
    if batch is None:
        notes.append("no batch in the config: one micro-batch of the global batch per GPU")
    precision = config.get("mixed_precision", "no")
    float8 = precision == "fp8"
    backend = str((config.get("fp8_config") or {}).get("backend", "AO")).upper()
    if float8 and backend != "AO":
        notes.append(f"FP8 backend {backend} priced as torchao tensorwise dynamic scaling")
    return EngineLayout(
        recompute_modes=("none", "full"),  # what it can run (planner price's best plan uses only these)
        dp_degree=num_processes, zero_stage=zero, shard_degree=shard if shard and shard < num_processes else None,
        cp_degree=cp, offload=bool(fsdp.get("fsdp_offload_params", False)) and kind == "FSDP", float8=float8, micro_batch_size=mbs,
        local_batch_size=mbs * m if mbs else None,
        recompute="full" if fsdp.get("fsdp_activation_checkpointing") else "none", split=Split("even"),
        dtype={"bf16": "bfloat16", "fp16": "float16", "fp8": "bfloat16"}.get(precision, "float32"), notes=tuple(notes),
        # FSDP: the plugin's MixedPrecision(Policy)(param_dtype=dtype, reduce_dtype=dtype), all 16-bit; DDP:
        # native AMP, autocast over fp32 parameters, so fp32 gradients are all-reduced.
        param_dtype="float32" if kind != "FSDP" else None,
        gather_copy_out=kind != "FSDP" or int(fsdp.get("fsdp_version", 1)) == 2)  # FSDP1: flat parameters, no copy-out
