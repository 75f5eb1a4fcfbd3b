"""DeepSpeed: a plan as a `ds_config.json`, and back.

Key names are DeepSpeed's (deepspeed/runtime/config.py, zero/config.py, tensor_parallel/config.py,
activation_checkpointing/config.py and pipe/module.py, master 2026-08; the JSON reference is
https://www.deepspeed.ai/docs/config-json/):

    train_batch_size = train_micro_batch_size_per_gpu x gradient_accumulation_steps x data-parallel ranks
    zero_optimization.stage 0-3
    zero_optimization.offload_optimizer.device = "cpu"
                                        ZeRO-Offload (Ren et al. 2021): gradients and optimizer state in
                                        host memory, the step on the CPU (stages 1-3) = the plan's ZeRO 1/2
                                        offload; with offload_param.device = "cpu" (stage 3 only) the
                                        parameters too = the plan's ZeRO 3 offload. "nvme" is read and
                                        priced as "cpu", with a note.
    zero_optimization.mics_shard_size   MiCS (Zhang et al. 2022; deepspeed/runtime/zero/mics.py, stage 3):
                                        parameters, gradients and optimizer state sharded over groups of
                                        mics_shard_size ranks and replicated across groups = the plan's
                                        hybrid sharding with ZeRO 3. ZeRO++'s zero_hpz_partition_size is
                                        not that (a secondary copy of the parameters per node, the primary
                                        partition still over all ranks) and is read as a note. Stages 1/2
                                        have no replica groups: hybrid sharding becomes sharding over all.
    bf16.enabled / fp16.enabled; gradient_clipping
    communication_data_type             the gradients' dtype on the wire (fp32, fp16, bf16); unset, the
                                        model's (engine.py `communication_data_type`)
    data_types.grad_accum_dtype = "fp32" with bf16 at ZeRO 0-1: BF16_Optimizer, fp32 gradients
                                        added into after every micro-batch
    tensor_parallel.autotp_size         AutoTP training (Linear layers column/row sharded; no sequence parallelism)
    zero_optimization.overlap_comm, stage3_prefetch_bucket_size, stage3_max_live_parameters,
    reduce_bucket_size                  what is overlapped (`overlap`; its pipeline engine overlaps
                                        nothing) and what ZeRO 3 holds gathered (`live_parameters`)
    pipeline.stages, pipeline.partition, pipeline.activation_checkpoint_interval
                                        what `PipelineModule(num_stages=, partition_method=,
                                        activation_checkpoint_interval=)` takes in code; DeepSpeed's
                                        pipeline runs one 1F1B schedule (TrainSchedule) and, per its
                                        docstring, "is not compatible with ZeRO-2 and ZeRO-3"
    activation_checkpointing            deepspeed.checkpointing's options (whole layers recomputed)

Expert parallelism and FP8 linears live in the model code, not the JSON: `deepspeed.moe.layer.MoE(
..., ep_size=N)` (deepspeed/moe/layer.py; "number of ranks in the expert parallel world or group")
and an FP8 conversion (torchao's `convert_to_float8_training`, or Transformer Engine modules) before
`deepspeed.initialize`. The export keeps them in the layout and says so in a note; reading a JSON,
`planner.engines.read_config(..., ep_degree=, float8=)` takes them from the caller. Context
parallelism has no counterpart here (DeepSpeed-Ulysses is all-to-all sequence parallelism set up
in code): a plan with it runs without.

partition_method 'uniform' splits the layers as `partition_uniform` (deepspeed/runtime/utils.py),
'parameters' (the default) balances parameter counts; neither takes arbitrary cuts, so a plan's
own cuts become the nearest of the two.
"""

from __future__ import annotations

import json
from dataclasses import replace

from planner.cost.memory import LiveParameters
from planner.cost.overlap import SERIAL, Overlap
from planner.engines.common import (
    EngineLayout,
    Split,
    ds_uniform,
    lost_overlaps,
    plan_layout,
    strongest_recompute,
)
from planner.errors import PlannerError
from planner.plan import Plan


def mapped_layout(plan: Plan, names: list[str]) -> tuple[EngineLayout, list[str]]:
    lay, mapped, changes = plan.layout, plan_layout(plan), []
    mode = mapped.recompute if mapped.recompute != "mixed" else strongest_recompute(plan)
    if mode in ("selective", "op"):
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
    # `render` turns overlap_comm on wherever there is more than one data-parallel rank.
    mapped = replace(mapped, overlap=overlap(mapped.zero_stage, mapped.pp_degree, mapped.dp > 1),
                     zero3_live=LiveParameters() if mapped.zero_stage == 3 else None)  # `render` keeps the defaults
    lost_overlaps(plan, mapped, changes, {
        "pipeline_p2p": "DeepSpeed's pipeline engine blocks on each send and receive",
        "grad_reduce": "DeepSpeed's pipeline engine reduces the gradients after the last micro-batch" if mapped.pp_degree > 1
        else "DeepSpeed without ZeRO all-reduces the gradients after the backward",
        "param_gather": f"DeepSpeed's ZeRO {mapped.zero_stage} gathers the updated parameters inside the optimizer step",
        "tp_comm": "AutoTP waits for each linear's collective"})
    return _new_dimensions(mapped, changes), changes


def _new_dimensions(mapped: EngineLayout, changes: list[str]) -> EngineLayout:
    """Hybrid sharding, CP, and the notes for what the model code sets (module docstring)."""
    if mapped.shard_degree is not None and mapped.zero_stage < 3:
        changes.append(f"hybrid sharding over groups of {mapped.shard_degree} -> ZeRO {mapped.zero_stage} over all "
                       f"{mapped.dp} data-parallel ranks (MiCS, DeepSpeed's replica groups, is ZeRO 3 only)")
        mapped = replace(mapped, shard_degree=None)
    if mapped.cp_degree > 1:
        changes.append(f"context parallelism {mapped.cp_degree} -> 1 (no DeepSpeed config key; Ulysses is set up in code)")
        mapped = replace(mapped, cp_degree=1)
    notes = []
    if mapped.ep_degree > 1:
        notes.append(f"expert parallelism: build the MoE layers with deepspeed.moe.layer.MoE(..., ep_size={mapped.ep_degree}) "
                     "(the JSON has no key for it)")
    if mapped.float8:
        notes.append("FP8 linears: convert the model with torchao.float8.convert_to_float8_training (tensorwise) before "
                     "deepspeed.initialize (the JSON has no key for it)")
    return replace(mapped, notes=tuple(notes))


def render(mapped: EngineLayout, plan: Plan, names: list[str], seq_len: int | None) -> str:
    m = mapped.num_microbatches
    config: dict = {
        "train_batch_size": mapped.global_batch_size,
        "train_micro_batch_size_per_gpu": mapped.micro_batch_size,
        "gradient_accumulation_steps": m,
        "zero_optimization": {"stage": mapped.zero_stage, "overlap_comm": mapped.dp > 1, "contiguous_gradients": True},
    }
    zero = config["zero_optimization"]
    if mapped.offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
        if mapped.zero_stage == 3:
            zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    if mapped.shard_degree is not None:  # ZeRO 3 here (_new_dimensions)
        zero["mics_shard_size"] = mapped.shard_degree
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


COMMUNICATION_DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16", "bfp16": "bfloat16"}
"""DeepSpeed's `communication_data_type` values (deepspeed/runtime/config.py) as dtype names."""


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
    stage = int(zero.get("stage", 0))
    devices = {k: zero[k].get("device", "none") for k in ("offload_optimizer", "offload_param") if isinstance(zero.get(k), dict)}
    offload = devices.get("offload_optimizer", "none") != "none" or devices.get("offload_param", "none") != "none"
    notes = [f"{k} device {d!r} priced as 'cpu'" for k, d in devices.items() if d not in ("none", "cpu")]
    if stage == 3 and offload and devices.get("offload_param", "none") == "none":
        notes.append("offload_optimizer without offload_param at ZeRO 3 priced as both offloaded")
    mics = int(zero.get("mics_shard_size", -1))
    if int(zero.get("zero_hpz_partition_size", 1)) > 1:
        notes.append(f"zero_hpz_partition_size {zero['zero_hpz_partition_size']} (ZeRO++ secondary partition) not priced")
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
    # bf16 weights with fp32 gradient accumulation at ZeRO 0-1 run BF16_Optimizer (engine.py
    # `_configure_optimizer`): fp32 gradients beside the bf16 ones, added into after every
    # micro-batch (bf16_optimizer.py `update_hp_grads`), reduced in communication_data_type.
    fp32_accumulation = bool(bf16) and stage <= 1 and \
        str(config.get("data_types", {}).get("grad_accum_dtype", "")).lower() in ("fp32", "float32")
    reduce_dtype = COMMUNICATION_DTYPES.get(str(config.get("communication_data_type")).lower())
    auto_dtype = any(isinstance(config.get(k), dict) and config[k].get("enabled") == "auto" for k in ("bf16", "fp16"))
    return EngineLayout(
        recompute_modes=("none", "full"),  # what it can run (planner price's best plan uses only these)
        pp_degree=pp, tp_degree=int(config.get("tensor_parallel", {}).get("autotp_size", 0) or 1), dp_degree=dp,
        zero_stage=stage, schedule="1f1b", micro_batch_size=mbs, global_batch_size=total,
        local_batch_size=mbs * (gas or 1) if mbs else None,
        recompute="full" if pipe.get("activation_checkpoint_interval", 0) else "none",
        split=Split("uniform" if partition == "uniform" else "parameters"),
        dtype="bfloat16" if bf16 else "float16" if fp16 else None if auto_dtype else "float32",
        # deepspeed/runtime/engine.py `communication_data_type`: the config's, else the model's dtype.
        reduce_dtype=reduce_dtype or ("bfloat16" if fp32_accumulation else None),
        grad_dtype="float32" if fp32_accumulation else None,
        grad_accumulation="buffer" if fp32_accumulation else "autograd",
        grad_clip=config.get("gradient_clipping") or None, notes=tuple(notes),
        shard_degree=mics if stage == 3 and mics > 0 else None, offload=offload,
        fused_optimizer=_fused_adam(config),
        pipeline_buffers="in-flight",  # deepspeed/runtime/pipe/engine.py: buffers per micro-batch in flight
        dp_collectives="bucketed",  # deepspeed/runtime/zero/stage_1_and_2.py: reduce_bucket_size, allgather_bucket_size
        gather_copy_out=False,  # ZeRO 3's parameters point into the gathered buffer (partition_parameters.py)
        overlap=overlap(stage, pp, zero.get("overlap_comm"), int(zero.get("stage3_prefetch_bucket_size", 1)) > 0),
        zero3_live=live_parameters(zero) if stage == 3 else None)


def live_parameters(zero: dict) -> LiveParameters:
    """ZeRO 3's bounds on what it holds gathered (planner/cost/memory.py `LiveParameters`), from
    the config's zero_optimization section, DeepSpeed's defaults where it is silent."""
    default = LiveParameters()
    return LiveParameters(max_live=float(zero.get("stage3_max_live_parameters", default.max_live)),
                          prefetch=float(zero.get("stage3_prefetch_bucket_size", default.prefetch)),
                          reduce_bucket=float(zero.get("reduce_bucket_size", default.reduce_bucket)))


def overlap(zero: int, pp: int, overlap_comm: bool | None = None, prefetch: bool = True) -> Overlap:
    """The communication DeepSpeed hides behind compute (planner/cost/overlap.py). Its pipeline
    engine (pp > 1) hides none: sends and receives block (deepspeed/runtime/pipe/p2p.py `send`,
    `recv`: "Doesn't support async_op true"), and its TrainSchedule reduces the gradients after the
    last micro-batch's backward (pipe/schedule.py `ReduceGrads`, engine.py `_exec_reduce_grads`).
    Without a pipeline, ZeRO 1-3 reduce in buckets under the backward with `overlap_comm`
    (zero/config.py: unset, on for stage 3 only); stage 0 all-reduces after the backward
    (engine.py `allreduce_gradients`). ZeRO 3 prefetches the next parameters
    (`stage3_prefetch_bucket_size`, default 5e7; 0 turns it off); ZeRO 1-2 gather the updated
    parameters inside the step. AutoTP's collectives wait for each linear."""
    if pp > 1:
        return SERIAL
    hidden = zero == 3 if overlap_comm is None else overlap_comm
    return Overlap(grad_reduce=zero > 0 and hidden, param_gather=zero == 3 and prefetch, pipeline_p2p=False, tp_comm=False)


def _fused_adam(config: dict) -> bool:
    """Whether the config's optimizer is DeepSpeed's FusedAdam: type Adam or AdamW without
    `torch_adam` (deepspeed/runtime/engine.py `_configure_basic_optimizer`). No optimizer in the
    file: the client's, taken to be torch's AdamW."""
    optimizer = config.get("optimizer")
    if not isinstance(optimizer, dict):
        return False
    params = optimizer.get("params", {}) if isinstance(optimizer.get("params"), dict) else {}
    return str(optimizer.get("type", "")).lower() in ("adam", "adamw") and not params.get("torch_adam", False)
