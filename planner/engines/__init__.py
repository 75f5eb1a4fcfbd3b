"""Plans for the engines people run: export a plan to an engine's configuration, read one back.

    export_plan(plan, "megatron")   -> Export(text, mapped layout, warnings)
    read_config(path)               -> EngineLayout (the engine guessed from the file)
    pricing.compare(profile, cluster, layout)   the configuration priced beside the best plan

One module per engine (torchtitan, megatron, deepspeed, accelerate), each with
`mapped_layout(plan, unit names)` (what the engine will run and what changed), `render` (the
file) and `parse` (a file back to a layout), and where the engine lays TP out its own way,
`tp_layout_changes(plan)` (what that changes, at the plan's own degree); planner/engines/common.py
holds what they share.
Where an engine cannot express the plan, the warning names the change and its price by the
cost model (planner/engines/pricing.py).
"""

from __future__ import annotations

from pathlib import Path

from planner.engines import accelerate, deepspeed, megatron, torchtitan
from planner.engines.common import EngineLayout, Export, cluster_of
from planner.errors import PlannerError
from planner.plan import Plan

ENGINES = {"torchtitan": torchtitan, "megatron": megatron, "deepspeed": deepspeed, "accelerate": accelerate}

SPLITS_EVERY_HEAD = {
    "megatron": "Megatron-LM divides the query groups by --tensor-model-parallel-size and refuses a degree that "
                "does not divide them (megatron/core/transformer/attention.py: num_query_groups_per_partition = "
                "divide(num_query_groups, world_size))",
    "torchtitan": "torchtitan's TP plan shards every wq, wk and wv colwise, each rank holding n_kv_heads // tp "
                  "whole key/value heads (PyTorch's TP tutorial, which its Llama plan follows)",
}
"""Engines whose tensor parallelism splits every attention's query and key/value heads, where the
planner's runtime keeps an attention whose heads a degree does not divide replicated instead
(planner/solver/intra_op.py `tp_obstacles`), and how each says so."""


def head_obstacles(profile, tp: int) -> list[str]:
    """Attentions of `profile` whose heads `tp` does not split whole, named by unit (each distinct unit once)."""
    from planner.solver.intra_op import tp_obstacles

    out: list[str] = []
    seen = set()
    for unit in profile.units:
        if unit.fingerprint not in seen:
            seen.add(unit.fingerprint)
            out += [f"{unit.name}: {why}" for why in tp_obstacles(unit.ops, tp)]
    return out


def engine_tp(engine: str, profile, tp: int) -> int:
    """The largest degree dividing `tp` that `engine` runs on `profile`'s attentions (`tp` itself
    where it splits every head, or the engine does not split heads)."""
    if engine not in SPLITS_EVERY_HEAD or tp == 1:
        return tp
    return next(t for t in range(tp, 0, -1) if tp % t == 0 and not head_obstacles(profile, t))


def check_engine_heads(engine: str, profile, tp: int) -> None:
    """Refuse a configuration `engine` itself would refuse: a TP degree that does not split its attention's heads."""
    if engine_tp(engine, profile, tp) != tp:
        found = head_obstacles(profile, tp)
        raise PlannerError(f"The configuration's tensor-parallel degree {tp} does not split the model's attention heads "
                           f"whole ({'; '.join(found[:2])}{' and more' if len(found) > 2 else ''}): "
                           f"{SPLITS_EVERY_HEAD[engine]}.",
                           f"Give it a degree that divides them ({engine_tp(engine, profile, tp)} does); "
                           "`planner solve --tp` plans the degree with those attentions replicated.")


def _whole_heads(engine: str, mapped: EngineLayout, profile, changes: list[str]) -> EngineLayout:
    """`mapped` with the largest TP degree `engine` runs on the model's attentions (`engine_tp`), the
    rest of the GPUs given to data parallelism and the micro-batch cut to a whole number of them."""
    from dataclasses import replace

    tp = mapped.tp_degree
    if profile is None or (t := engine_tp(engine, profile, tp)) == tp:
        return mapped
    dp = mapped.dp * (tp // t)
    replicas = dp // mapped.cp_degree
    per_replica = mapped.global_batch // replicas
    mbs = next(b for b in range(min(mapped.micro_batch, per_replica), 0, -1) if per_replica % b == 0)
    found = head_obstacles(profile, tp)
    changes.append(f"tp {tp} -> {t}, dp {mapped.dp} -> {dp}" + (f", micro-batch {mapped.micro_batch} -> {mbs}"
                   if mbs != mapped.micro_batch else "") + f" (the plan keeps attentions whose heads tp {tp} does not "
                   f"split replicated, {'; '.join(found[:2])}; {SPLITS_EVERY_HEAD[engine]})")
    return replace(mapped, tp_degree=t, dp_degree=dp, micro_batch_size=mbs)


def export_plan(plan: Plan, engine: str, profile=None, cluster=None) -> Export:
    """The plan in `engine`'s terms; `profile` (and `cluster`, default the plan's rebuilt) price the changes."""
    from planner.engines.pricing import reprice_warning

    if engine not in ENGINES:
        raise PlannerError(f"Unknown engine {engine!r}.", f"Use one of {', '.join(ENGINES)}.")
    module = ENGINES[engine]
    names = [u for s in plan.stages for u in s.units]
    mapped, changes = module.mapped_layout(plan, names)
    mapped = _whole_heads(engine, mapped, profile, changes)
    if mapped.tp_degree == plan.layout.tp_degree and hasattr(module, "tp_layout_changes"):
        changes += module.tp_layout_changes(plan)  # the plan's replicated modules are its own degree's
    seq_len = (profile.model.sequence_length if profile is not None else None) or plan.model.args.get("seq_len")
    text = module.render(mapped, plan, names, seq_len)
    warnings = []
    if changes:
        if profile is not None and cluster is None:
            cluster = cluster_of(plan)
        warnings.append(reprice_warning(f"{engine} cannot express the plan exactly: " + "; ".join(changes), plan, mapped,
                                        profile, cluster))
    warnings += list(mapped.notes)  # what the user sets outside the file (model code), not a change of layout
    return Export(text, mapped, warnings)


PURE_16_BIT = {
    "megatron": "--bf16/--fp16 run the model in 16 bits (Float16Module), fp32 main weights in the optimizer",
    "torchtitan": "FSDP2's MixedPrecisionPolicy gathers the weights in mixed_precision_param (bfloat16)",
    "deepspeed": "bf16/fp16 enabled converts the module to 16 bits, fp32 master weights in the optimizer",
}
"""Engines that compute a 16-bit plan on 16-bit weights, and how (each engine's documentation)."""


def precision_note(engine: str, profile) -> str | None:
    """A note when `profile` prices 16-bit activations the way `engine` does not compute them:
    an autocast profile (planner/profiler `mixed_precision`) priced for an engine of `PURE_16_BIT`."""
    if engine not in PURE_16_BIT or profile.computes_as() != "autocast":
        return None
    return (f"the profile computes under autocast (fp32 weights, as `planner run` trains), but {engine} computes in "
            f"pure 16 bits ({PURE_16_BIT[engine]}): its activations and casts are priced high. Profile with "
            "--precision pure to price what the engine runs.")


def as_the_engine_computes(profile, engine: str):
    """The profile to price `engine`'s configuration with, and a note (None: the profile as it is).

    An analytic profile computed under autocast (`planner run`'s way) priced for an engine of
    `PURE_16_BIT` is made again from its model file with --precision pure: analytic, so seconds
    and no device. Where that model cannot be loaded again as it was (moved, changed: another
    fingerprint), the profile is used as it is and `precision_note` says what that misprices."""
    note = precision_note(engine, profile)
    pure = _profiled_again(profile, precision="pure") if note is not None else None
    if pure is None:
        return profile, note
    return pure, (f"{engine} computes in pure 16 bits ({PURE_16_BIT[engine]}): priced from {profile.model.file} profiled again "
                  "analytically with --precision pure (the profile given computes under autocast, as `planner run` trains)")


def _profiled_again(profile, gpu=None, precision: str | None = None):
    """An analytic profile made again from its model file with another GPU spec or precision (the
    rest as it was); None for a measured profile, or where the model cannot be loaded again as it
    was (moved, changed: another fingerprint)."""
    if profile.mode != "analytic":
        return None
    from planner.profiler import profile_model

    model = profile.model
    try:
        again = profile_model(model.file, model.args, profile.micro_batch_sizes, device="meta",
                              gpu=gpu or profile.analytic_gpu() or profile.target_gpu, dtype=profile.dtype, fusion=profile.fusion,
                              precision=precision or profile.computes_as() or "autocast")
    except (PlannerError, OSError):
        return None
    return again if again.model.fingerprint == model.fingerprint else None


def as_the_engine_runs(profile, cluster, engine: str):
    """The profile and cluster to price `engine`'s configuration with, and notes: the profile as the
    engine computes (`as_the_engine_computes`); for Megatron-LM the GPU as its runs price
    (planner/engines/megatron.py `stack_gpu`), an analytic profile made again for that spec so that
    its per-op times are the spec's (planner/cost/compute.py `profile_matches`)."""
    profile, note = as_the_engine_computes(profile, engine)
    notes = [note] if note else []
    if engine != "megatron":
        return profile, cluster, notes
    from dataclasses import replace

    from planner.engines.megatron import stack_gpu

    gpu = stack_gpu(cluster.gpu)
    if gpu == cluster.gpu:
        return profile, cluster, notes
    cluster = replace(cluster, gpu=gpu)
    notes.append(f"Megatron-LM's attention (Transformer Engine) priced on {gpu.name} as Megatron-Core's published runs show it: "
                 "35% of the peak on every score, where the preset prices FlashAttention-2's benchmarked rates "
                 "(planner/hardware.py)")
    # Unless it cannot be made again (then priced by roofline at the spec's rates).
    return _profiled_again(profile, gpu=gpu) or profile, cluster, notes


def guess_engine(path: Path, text: str) -> str:
    """The engine a configuration file is for, from its suffix and content."""
    suffix = path.suffix.lower()
    if suffix == ".toml" or "[parallelism]" in text:
        return "torchtitan"
    if suffix == ".json":
        return "deepspeed"
    if suffix in (".yaml", ".yml") or "distributed_type" in text:
        return "accelerate"
    if "--" in text:
        return "megatron"
    raise PlannerError(f"Cannot tell which engine {path} is for.", "Pass Megatron-LM arguments (.txt/.sh), a torchtitan .toml, "
                       "a DeepSpeed .json or an Accelerate .yaml.")


def read_config(path: str | Path, engine: str | None = None, ep_degree: int | None = None,
                float8: bool | None = None) -> EngineLayout:
    """The layout a configuration file states. `ep_degree` and `float8` are what the model code sets
    where the engine's file cannot say it (DeepSpeed's `MoE(ep_size=)` and FP8 conversion, Accelerate's
    expert parallelism); given, they replace the file's."""
    from planner.engines.common import with_defaults

    path = Path(path)
    if not path.is_file():
        raise PlannerError(f"{path} does not exist.", "Pass the configuration file you train with.")
    text = path.read_text()
    engine = engine or guess_engine(path, text)
    if engine not in ENGINES:
        raise PlannerError(f"Unknown engine {engine!r}.", f"Use one of {', '.join(ENGINES)}.")
    return with_defaults(ENGINES[engine].parse(text, str(path)), ep_degree=ep_degree, float8=float8)
