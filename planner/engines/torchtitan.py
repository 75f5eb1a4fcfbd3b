"""torchtitan: a plan as the TOML job file of `torchtitan/train.py`, and back.

Option names and meanings are torchtitan's `torchtitan/config/job_config.py` (commit 6404b93,
2025-08, the last release read from TOML files; later versions build the same fields in Python):

    [parallelism] data_parallel_replicate_degree   DDP degree (ZeRO 0)
                  data_parallel_shard_degree       FSDP2 degree; -1 = the ranks left over
                  fsdp_reshard_after_forward       "always" = ZeRO-3, "never" = FSDP2 keeping the
                                                   gathered parameters = the planner's ZeRO 2, ZeRO 1
                                                   under PP (its schedules reduce once a step)
                  tensor_parallel_degree           TP; torchtitan's llama TP plans always shard norms
                                                   along the sequence (sequence parallelism)
                  pipeline_parallel_degree, pipeline_parallel_schedule (torch's class names),
                  pipeline_parallel_microbatch_size, module_fqns_per_model_part (modules per stage,
                  exact cuts), pipeline_parallel_layers_per_stage
                  context_parallel_degree          CP; world = replicate x shard x cp x tp x pp
                                                   (torchtitan/distributed/parallel_dims.py), so the
                                                   plan's dp (which counts cp) is replicate x shard x cp
                                                   and FSDP shards over shard x cp ("dp_shard_cp")
                  expert_parallel_degree           EP "dp2ep": borrows cp and dp_shard ranks, innermost
                                                   (parallel_dims.py `_build_mesh_with_ep`:
                                                   ep % cp == 0, (shard x cp) % ep == 0), so EP needs
                                                   FSDP: a ZeRO 0 plan with EP becomes ZeRO 2
                  expert_tensor_parallel_degree    expert TP, 1 or tp; written with EP only ("no effect
                                                   ... when ep = 1", ParallelismConfig)
                  replicate > 1 with shard > 1     HSDP: FSDP over shard (x cp) consecutive dp ranks,
                                                   replicated across `replicate` groups = the plan's
                                                   shard_degree
    [activation_checkpoint] mode = "none" | "selective" | "full"; selective_ac_option = "op"
                  (per-op SAC) or an integer k (full AC on every k-th layer)
    [training]    local_batch_size (per DP rank and step), global_batch_size, seq_len, max_norm,
                  mixed_precision_param ("bfloat16" | "float32"), mixed_precision_reduce (FSDP's
                  reduce_dtype, "float32" by default: the gradients' bytes on the wire), enable_cpu_offload ("CPU offloading of
                  parameters, gradients, and optimizer states in FSDP": FSDP2's CPUOffloadPolicy, the
                  plan's training.offload = "cpu")
    [model]       converters = ["float8"]: torchao Float8Linear swap (the plan's training.float8)
    [float8]      recipe_name "tensorwise" (torchao's dynamic tensorwise scaling, the planner's; "rowwise"
                  is read and priced as tensorwise), enable_fsdp_float8_all_gather (the plan's runtime
                  gathers FP8 weights under FSDP: runtime/apply_fp8.py), filter_fqns (modules left in bf16)

Pipeline micro-batches are local_batch_size / pipeline_parallel_microbatch_size and gradient
accumulation steps global_batch_size / (local_batch_size x dp) (torchtitan/train.py).
"""

from __future__ import annotations

from dataclasses import replace

import tomllib

from planner.cost.overlap import Overlap
from planner.engines.common import EngineLayout, Split, one_recompute_mode
from planner.errors import PlannerError
from planner.plan import Plan

# Plan schedule -> torch.distributed.pipelining class name, as runtime/apply_pp.py runs them.
SCHEDULES = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved-1f1b": "Interleaved1F1B", "zero-bubble": "InterleavedZeroBubble"}


def mapped_layout(plan: Plan, names: list[str]) -> tuple[EngineLayout, list[str]]:
    """What torchtitan will run, and each change from the plan."""
    from planner.engines.common import plan_layout

    lay, mapped = plan.layout, plan_layout(plan)
    changes: list[str] = []
    mapped = _unit_recompute(plan, names, mapped, changes)
    mapped = one_recompute_mode(plan, mapped, changes, "[activation_checkpoint] mode is one setting")
    if mapped.recompute == "selective":  # no attention-core mode: op-level keeps less, so it stays within memory
        changes.append("recompute selective (attention core) -> op (torchtitan's selective_ac_option = \"op\": the "
                       "outputs of attention and every other matmul saved, the rest recomputed)")
        mapped = replace(mapped, recompute="op")
    if lay.tp_degree > 1 and not lay.sequence_parallel:
        changes.append("sequence parallelism off -> on (torchtitan's TP plans shard norms along the sequence)")
        mapped = replace(mapped, sequence_parallel=True)
    # FSDP2 without resharding: ZeRO 2, but ZeRO 1 in a pipeline, whose schedules reduce the
    # gradients once, at the step's end (planner/solver/solve.py `PIPELINE_ZERO`).
    unresharded = 2 if lay.pp_degree == 1 else 1
    if lay.zero_stage == 1 and lay.dp_degree > 1 and unresharded == 2:
        changes.append("ZeRO 1 -> 2 (FSDP2 without resharding shards gradients too)")
        mapped = replace(mapped, zero_stage=2)
    if mapped.dp == 1 and mapped.zero_stage >= 1:
        # parallel_dims.py: FSDP (and its CPU offload) only where data_parallel_shard_degree or cp > 1
        changes.append(f"ZeRO {mapped.zero_stage} -> 0 on one data-parallel rank"
                       + (", CPU offload -> none (torchtitan offloads through FSDP, which one rank does not apply)"
                          if mapped.offload else ""))
        mapped = replace(mapped, zero_stage=0, offload=False)
    if mapped.cp_degree > 1 and mapped.zero_stage == 0:
        # parallel_dims.py `fsdp_enabled`: with cp > 1 FSDP shards over the CP ranks at least
        changes.append(f"ZeRO 0 -> {unresharded} over the {mapped.cp_degree} context-parallel ranks (torchtitan applies FSDP "
                       "over data_parallel_shard_degree x context_parallel_degree whenever cp > 1)")
        mapped = replace(mapped, zero_stage=unresharded,
                         shard_degree=mapped.cp_degree if mapped.dp > mapped.cp_degree else None)
    if mapped.ep_degree > 1 and not (mapped.zero_stage >= 1 and mapped.dp > 1):
        changes.append(f"ZeRO 0 -> {unresharded} (torchtitan's expert parallelism borrows FSDP's data_parallel_shard_degree)")
        mapped = replace(mapped, zero_stage=unresharded)
    if mapped.schedule == "pipedream-2bw":
        changes.append("schedule pipedream-2bw -> 1f1b (torchtitan has no asynchronous schedule: synchronous updates, "
                       "with the 1F1B bubble the asynchronous one avoids)")
        mapped = replace(mapped, schedule="1f1b")
    if plan.training.dtype == "float16":
        changes.append("float16 -> bfloat16 (mixed_precision_param has no float16)")
        mapped = replace(mapped, dtype="bfloat16")
    return mapped, changes


def every_nth_layer(plan: Plan, names: list[str]) -> int | None:
    """N >= 2 when each pipeline rank fully recomputes exactly its N-th, 2N-th, ... transformer
    layers (counted over its chunks in order) and nothing else: torchtitan's layer-level
    selective AC, `selective_ac_option = "N"`, whose counter runs over the layers a process
    wraps (torchtitan/distributed/activation_checkpoint.py); else None."""
    from planner.engines.common import model_parts

    _, blocks, _ = model_parts(names)
    block_set = set(blocks)
    pp = plan.layout.pp_degree
    per_rank: list[list[str]] = [[] for _ in range(pp)]
    for k, stage in enumerate(plan.stages):
        for unit, mode in stage.unit_modes().items():
            if unit not in block_set and mode != "none":
                return None
            if unit in block_set:
                per_rank[k % pp].append(mode)
    firsts = [modes.index("full") + 1 for modes in per_rank if "full" in modes]
    if not firsts or min(firsts) < 2:
        return None
    n = min(firsts)
    exact = all(mode == ("full" if (c + 1) % n == 0 else "none") for modes in per_rank for c, mode in enumerate(modes))
    return n if exact else None


def _unit_recompute(plan: Plan, names: list[str], mapped: EngineLayout, changes: list[str]) -> EngineLayout:
    """Per-unit recomputation as torchtitan runs it: every N-th layer fully (`every_nth_layer`,
    written by `render`), else the nearest one mode (common.py)."""
    from planner.engines.common import nearest_unit_recompute

    nth = every_nth_layer(plan, names)
    mapped = nearest_unit_recompute(plan, mapped, changes, nth is not None,
                                    "torchtitan recomputes one mode, or fully every N-th layer")
    return replace(mapped, layer_recompute=("every", nth)) if nth is not None else mapped


def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return repr(value)


def _float8(mapped: EngineLayout, names: list[str]) -> dict | None:
    """[float8] for a plan with FP8 linears: torchao tensorwise, FP8 all-gather where FSDP shards
    (as runtime/apply_fp8.py runs it), the last unit left in bf16 as the cost model leaves the
    output head (planner/cost/fp8.py `output_head`; torchtitan's configs write ["output"])."""
    if not mapped.float8:
        return None
    return {"recipe_name": "tensorwise", "enable_fsdp_float8_all_gather": mapped.zero_stage >= 1 and mapped.dp > 1,
            "precompute_float8_dynamic_scale_for_fsdp": False, "filter_fqns": names[-1:]}


ROTATE_METHOD = {"ring": "alltoall", "all-gather": "allgather"}
"""The plan's `Layout.cp_algorithm` -> torchtitan's parallelism.context_parallel_rotate_method
(torch.distributed.tensor.experimental context_parallel: "'allgather' means to all-gather all kv
shards on ranks after the first sub-SDPA computation, 'alltoall' means to all-to-all shuffle the
kv shards"; default allgather)."""


def render(mapped: EngineLayout, plan: Plan, names: list[str], seq_len: int | None) -> str:
    dp, cp = mapped.dp, mapped.cp_degree
    sharded = mapped.zero_stage >= 1 and dp > 1
    group = mapped.shard_degree or dp  # FSDP's ranks: shard x cp
    m = mapped.num_microbatches
    parallelism: dict[str, object] = {
        "data_parallel_replicate_degree": dp // group if sharded else dp // cp,
        "data_parallel_shard_degree": group // cp if sharded else 1,
        "fsdp_reshard_after_forward": "always" if mapped.zero_stage == 3 else "never",
        "tensor_parallel_degree": mapped.tp_degree,
        "pipeline_parallel_degree": mapped.pp_degree,
        "context_parallel_degree": cp,
        # torch's context_parallel: "alltoall" rotates K/V shards around the ring, "allgather" gathers them all
        "context_parallel_rotate_method": ROTATE_METHOD[mapped.cp_algorithm],
        "expert_parallel_degree": mapped.ep_degree,
    }
    if mapped.ep_degree > 1:  # "1 means disabled ... no effect when ep = 1" (ParallelismConfig); else 1 or tp
        parallelism["expert_tensor_parallel_degree"] = mapped.expert_tp_degree
    if mapped.pp_degree > 1:
        parallelism["pipeline_parallel_schedule"] = SCHEDULES[mapped.schedule]
        parallelism["pipeline_parallel_microbatch_size"] = mapped.micro_batch_size
        parallelism["module_fqns_per_model_part"] = [list(s) for s in mapped.split.units]
    # With pp the step's micro-batches are one pipeline flush; without, they are gradient accumulation.
    local = mapped.micro_batch * (m if mapped.pp_degree > 1 else 1)
    training: dict[str, object] = {"local_batch_size": local, "global_batch_size": mapped.global_batch_size,
                "mixed_precision_param": "float32" if mapped.dtype == "float32" else "bfloat16"}
    if seq_len:
        training["seq_len"] = seq_len
    if mapped.grad_clip is not None:
        training["max_norm"] = mapped.grad_clip
    if mapped.offload:
        training["enable_cpu_offload"] = True
    ac: dict[str, object] = {"mode": "selective" if mapped.recompute == "op" else mapped.recompute}
    nth = every_nth_layer(plan, names) if mapped.recompute == "full" else None
    if nth is not None:  # layer-level selective AC: full recomputation of every nth layer
        ac = {"mode": "selective", "selective_ac_option": str(nth)}
    elif mapped.recompute == "op":
        ac["selective_ac_option"] = "op"  # op-level SAC (runtime/recompute.py `op_policy` runs the same policy)
    sections: dict[str, dict] = {"training": training, "parallelism": parallelism, "activation_checkpoint": ac}
    float8 = _float8(mapped, names)
    if float8:
        sections = {"model": {"converters": ["float8"]}, **sections, "float8": float8}
    lines = [f"# torchtitan job file written by `planner export` from a plan for {plan.world_size} GPUs",
             "# (torchtitan/config/job_config.py names; launch with NGPU=" + str(plan.world_size) + ")"]
    for name, body in sections.items():
        lines += ["", f"[{name}]"] + [f"{k} = {_toml_value(v)}" for k, v in body.items()]
    return "\n".join(lines) + "\n"


def parse(text: str, source: str = "torchtitan.toml") -> EngineLayout:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise PlannerError(f"{source} is not valid TOML ({exc}).", "Pass a torchtitan job file.") from None
    par, train, ac = data.get("parallelism", {}), data.get("training", {}), data.get("activation_checkpoint", {})
    notes: list[str] = []
    replicate, shard = int(par.get("data_parallel_replicate_degree", 1)), int(par.get("data_parallel_shard_degree", -1))
    cp = int(par.get("context_parallel_degree", 1))
    # parallel_dims.py `fsdp_enabled`: FSDP wherever data_parallel_shard_degree > 1 or cp > 1, over the
    # "dp_shard_cp" ranks; with replicate > 1 besides, hybrid (HSDP).
    hsdp = replicate > 1 and (shard != 1 or cp > 1)
    float8 = _parse_float8(data, notes)
    reshard = par.get("fsdp_reshard_after_forward", "default")
    pp = int(par.get("pipeline_parallel_degree", 1))
    # "default" reshards after forward except under pipeline parallelism (torchtitan's parallelize_llama);
    # unresharded FSDP is ZeRO 2, and ZeRO 1 in a pipeline (planner/solver/solve.py `PIPELINE_ZERO`).
    zero = 0 if shard == 1 and cp == 1 else (3 if reshard == "always" or (reshard == "default" and pp == 1) else 2 if pp == 1 else 1)
    dp = None if shard == -1 else replicate * shard * cp
    names = {v: k for k, v in SCHEDULES.items()}
    sched = par.get("pipeline_parallel_schedule", "1F1B")
    if sched not in names:
        raise PlannerError(f"{source}: pipeline_parallel_schedule {sched!r} has no planner counterpart.",
                           f"Use one of {sorted(names)}.")
    parts = par.get("module_fqns_per_model_part")
    v = len(parts) // pp if parts else 1
    if not parts and par.get("pipeline_parallel_layers_per_stage"):
        raise PlannerError(f"{source}: pipeline_parallel_layers_per_stage without module_fqns_per_model_part.",
                           "List the modules per stage (module_fqns_per_model_part) so the cuts are known.")
    split = Split("units", tuple(tuple(p) for p in parts)) if parts else Split("weighted")
    mode = ac.get("mode", "selective")
    option = str(ac.get("selective_ac_option", "2"))
    layers = None
    if mode == "selective" and option != "op":  # full AC on every N-th layer a process holds
        if not option.isdigit():
            raise PlannerError(f"{source}: selective_ac_option {option!r} is neither \"op\" nor a layer count.",
                               'Give "op" or an integer N (full AC on every N-th layer).')
        mode = "full" if option != "0" else "none"
        layers = ("every", int(option)) if int(option) > 1 else None
    elif mode == "selective":
        mode = "op"  # op-level selective checkpointing, priced as such (planner/solver/costs.py)
    dtype = "float32" if train.get("mixed_precision_param") == "float32" else "bfloat16"
    local = int(train.get("local_batch_size", 8))
    mbs = int(par.get("pipeline_parallel_microbatch_size", 1)) if pp > 1 else local
    glob = train.get("global_batch_size", -1)
    # Async TP ("currently only effective when compile is enabled": job_config.py), the one overlap
    # torchtitan asks for; FSDP2's prefetch and reduce-scatter, DDP's buckets and the pipelining
    # schedules' sends are the planner runtime's own.
    compiled = bool(data.get("compile", {}).get("enable", train.get("compile", False)))
    # What compile covers ([compile] components, default ["model", "loss"]; the older [training]
    # compile, both): the model (its blocks, which async TP and the shared Float8 casts need) and the loss.
    components = data.get("compile", {}).get("components", ["model", "loss"])
    model_compiled, loss_compiled = compiled and "model" in components, compiled and "loss" in components
    async_tp = bool(par.get("enable_async_tensor_parallel", False))
    if async_tp and not model_compiled:
        notes.append("enable_async_tensor_parallel without the model compiled: priced with TP collectives in series")
    reduce = str(train.get("mixed_precision_reduce", "float32"))
    return EngineLayout(
        recompute_modes=("none", "op", "full"),  # what it can run (planner price's best plan uses only these)
        pp_degree=pp, tp_degree=int(par.get("tensor_parallel_degree", 1)), dp_degree=dp, zero_stage=zero,
        sequence_parallel=int(par.get("tensor_parallel_degree", 1)) > 1, schedule=names[sched] if pp > 1 else "1f1b",
        virtual_stages=v, micro_batch_size=mbs, global_batch_size=None if glob in (-1, None) else int(glob), local_batch_size=local,
        recompute=mode, layer_recompute=layers, split=split, dtype=dtype,
        # FSDP2's MixedPrecisionPolicy(param_dtype=mixed_precision_param, reduce_dtype=mixed_precision_reduce,
        # "float32" by default); without FSDP torchtitan trains fp32 parameters (under autocast where
        # it can: maybe_enable_amp), so its DDP all-reduces fp32 gradients.
        param_dtype="float32" if zero == 0 else dtype, reduce_dtype=reduce,
        # Gradients held in reduce_dtype: under a pipeline FSDP2 syncs on the last micro-batch only
        # and until then keeps them unsharded in it (FSDPParam.to_accumulated_grad_if_needed
        # upcasts them); without resharding (ZeRO 2) the reduce-scatter's shards land on the fp32
        # sharded parameters' .grad. (ZeRO 3 holds those too, but no 16-bit weight shard: priced
        # at 2 + 2 bytes where it holds 0 + 4, the same total.)
        grad_dtype=reduce if zero > 0 and (pp > 1 or zero == 2) else None,
        grad_clip=train.get("max_norm"), notes=tuple(notes), ep_degree=int(par.get("expert_parallel_degree", 1)),
        expert_tp_degree=int(par.get("expert_tensor_parallel_degree", 1)) if int(par.get("expert_parallel_degree", 1)) > 1 else 1,
        cp_degree=cp, shard_degree=shard * cp if hsdp and shard != -1 else None,
        cp_algorithm={v: k for k, v in ROTATE_METHOD.items()}.get(str(par.get("context_parallel_rotate_method", "allgather")),
                                                                   "all-gather"),
        replicate_degree=replicate if hsdp and shard == -1 else None, offload=bool(train.get("enable_cpu_offload", False)),
        float8=float8, overlap=Overlap(tp_comm=True) if async_tp and model_compiled else None,
        # torchtitan's loss parallelism: on under TP unless [parallelism] disable_loss_parallel
        # (job_config.py `disable_loss_parallel`; the trainer enters `loss_parallel()` when TP is on and it is not set)
        loss_parallel=int(par.get("tensor_parallel_degree", 1)) > 1 and not par.get("disable_loss_parallel", False),
        # Float8 under TP: torchao's Float8ColwiseParallel / PrepareFloat8ModuleInput (parallelize_llama.py `apply_tp`)
        # cast the sequence-sharded inputs to FP8 before gathering them
        float8_tp_gather=float8 and int(par.get("tensor_parallel_degree", 1)) > 1,
        # torch.compile of each TransformerBlock (parallelize_llama.py `apply_compile`): the Float8
        # casts of an input several linears read are one (planner/cost/fp8.py, Casts)
        float8_shared_casts=float8 and model_compiled,
        # torchtitan compiles its cross-entropy with the model (components/loss.py
        # `build_cross_entropy_loss`; [compile] components, default ["model", "loss"])
        loss_kernel="compiled" if loss_compiled else "eager",
        # torchtitan/config/job_config.py: Optimizer.implementation, "fused" unless the file says otherwise
        fused_optimizer=data.get("optimizer", {}).get("implementation", "fused") == "fused")


def _parse_float8(data: dict, notes: list[str]) -> bool:
    """FP8 linears: `float8` among [model] converters (or the older [float8] enable_float8_linear)."""
    f8 = data.get("float8", {})
    on = "float8" in data.get("model", {}).get("converters", []) or bool(f8.get("enable_float8_linear"))
    recipe = f8.get("recipe_name") or "tensorwise"  # None: torchao's default Float8LinearConfig, tensorwise
    if on and recipe != "tensorwise":
        notes.append(f"float8 recipe_name {recipe!r} priced as tensorwise dynamic scaling")
    return on
