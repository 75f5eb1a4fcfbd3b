"""Price one engine layout exactly, and set it beside the best plan.

`price` pins every dimension and fixes the stage cuts, then runs the search's own pricing
(planner/solver/search.py `evaluate_config` with `fixed_bounds`) and plan writer
(planner/solver/plan_builder.py): the result is a plan file like a solved one, whose
prediction is what that configuration costs by the same model. Memory is not a constraint
here (a user's configuration may not fit; the report says so instead of refusing).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from planner.cluster import Cluster
from planner.engines.common import (
    EngineLayout,
    differences,
    layer_modes,
    plan_layout,
    prediction,
    seconds,
    stage_bounds,
    summary,
)
from planner.errors import PlannerError
from planner.plan import RECOMPUTE, Plan
from planner.profile_schema import Profile

# evaluate_config may use any amount of memory: a priced configuration is reported, not refused.
UNBOUNDED_MEMORY_FRACTION = 1e6


def resolve(layout: EngineLayout, cluster: Cluster, global_batch_size: int | None) -> tuple[EngineLayout, int]:
    """Fill what the engine derives from the world size: dp, the global batch, the micro-batch, the
    hybrid-sharding group stated by its replicas. dp counts the context-parallel ranks
    (planner/plan.py), and a CP group's ranks share their samples: dp / cp take different ones."""

    world = cluster.world_size
    if world % (layout.pp_degree * layout.tp_degree):
        raise PlannerError(f"pp x tp = {layout.pp_degree} x {layout.tp_degree} does not divide the cluster's {world} GPUs.",
                           "Pass the cluster the configuration runs on (--gpus N or --cluster FILE).")
    dp = world // (layout.pp_degree * layout.tp_degree)
    if layout.dp_degree is not None and layout.dp_degree != dp:
        raise PlannerError(f"The configuration's data-parallel degree {layout.dp_degree} x pp {layout.pp_degree} x tp "
                           f"{layout.tp_degree} != the cluster's {world} GPUs.", "Pass the cluster the configuration runs on.")
    for name, degree in (("context-parallel", layout.cp_degree), ("expert-parallel", layout.ep_degree),
                         ("hybrid-sharding replica", layout.replicate_degree or 1)):
        if dp % degree:
            raise PlannerError(f"The configuration's {name} degree {degree} does not divide the {dp} data-parallel ranks "
                               f"({world} GPUs / pp {layout.pp_degree} / tp {layout.tp_degree}).",
                               "Pass the cluster the configuration runs on, or a degree that divides dp.")
    shard = layout.shard_degree or (dp // layout.replicate_degree if layout.replicate_degree else None)
    shard = None if shard == dp else shard  # one group of all dp ranks is plain ZeRO
    replicas = dp // layout.cp_degree
    batch = layout.global_batch_size or global_batch_size or (layout.local_batch_size or 0) * replicas or None
    if batch is None:
        raise PlannerError("The configuration does not say its global batch.", "Pass --global-batch B.")
    if global_batch_size is not None and layout.global_batch_size is not None and global_batch_size != layout.global_batch_size:
        raise PlannerError(f"--global-batch {global_batch_size} differs from the configuration's {layout.global_batch_size}.",
                           "Drop --global-batch, or change the configuration.")
    mbs = layout.micro_batch_size or batch // replicas
    if batch % (replicas * mbs):
        raise PlannerError(f"Global batch {batch} is not a whole number of micro-batches of {mbs} over dp {dp}"
                           + (f" / cp {layout.cp_degree}" if layout.cp_degree > 1 else "") + ".",
                           "Make the global batch a multiple of micro-batch x dp.")
    return replace(layout, dp_degree=dp, micro_batch_size=mbs, global_batch_size=batch, shard_degree=shard,
                   replicate_degree=None), batch


def price(profile: Profile, cluster: Cluster, layout: EngineLayout, global_batch_size: int | None = None,
          profile_path: str | None = None) -> Plan:
    """The plan that runs exactly `layout` (cuts from its engine's rule), priced by the cost model.

    The cost model is assembled as planner/solver/solve.py `search` and `price_config` assemble it
    (EP all-to-all, FP8 linears, the profile's unsplittable unit runs), with the configuration's
    expert-parallel degree, hybrid-sharding group and CPU offload pinned."""
    from planner.cost.collectives import CollectiveModel, group_placement
    from planner.cost.compute import ComputeModel
    from planner.solver.costs import UnitCosts
    from planner.solver.plan_builder import build_plan
    from planner.solver.search import Config, evaluate_config
    from planner.solver.solve import (
        PIPELINE_ZERO,
        PIPELINE_ZERO_WHY,
        Pins,
        SearchResult,
        _cut_allowed,
        _environment,
        check_float8,
        check_model_pins,
        check_pins,
        cp_collectives,
        ep_all_to_all,
    )

    layout, batch = resolve(layout, cluster, global_batch_size)
    deferred = layout.pp_degree > 1 and layout.zero_stage > PIPELINE_ZERO
    if deferred:  # a pipeline's ZeRO 2-3 runs as ZeRO 1 (solve.py `PIPELINE_ZERO`): priced so, and noted
        layout = replace(layout, zero_stage=PIPELINE_ZERO)
    dtype = layout.dtype or profile.dtype
    if layout.recompute not in RECOMPUTE:
        raise PlannerError(f"Recompute {layout.recompute!r} is not one mode for all stages.", f"Give one of {', '.join(RECOMPUTE)}.")
    some_layers = layout.layer_recompute is not None
    if layout.float8:
        check_float8(cluster, dtype)
    pins = Pins(layout.pp_degree, layout.tp_degree, layout.dp_degree, layout.micro_batch_size, layout.schedule,
                layout.virtual_stages, None if some_layers else layout.recompute, layout.zero_stage, layout.sequence_parallel,
                recompute_modes=("none", layout.recompute) if some_layers else None,
                ep=layout.ep_degree, shard_degree=layout.shard_degree, offload=layout.offload, cp=layout.cp_degree,
                expert_tp=layout.expert_tp_degree, loss_kernel=layout.loss_kernel, fused_optimizer=layout.fused_optimizer,
                loss_parallel=layout.loss_parallel, float8_tp_gather=layout.float8_tp_gather,
                float8_shared_casts=layout.float8_shared_casts,
                pipeline_buffers=layout.pipeline_buffers, dp_collectives=layout.dp_collectives,
                gather_copy_out=layout.gather_copy_out, param_dtype=layout.param_dtype or dtype,
                grad_dtype=layout.grad_dtype, reduce_dtype=layout.reduce_dtype, overlap=layout.overlap,
                zero3_live=layout.zero3_live, grad_accumulation=layout.grad_accumulation)
    check_pins(pins, cluster, batch, len(profile.units))
    check_model_pins(pins, profile)
    bounds = stage_bounds(layout, profile)
    compute = ComputeModel(profile, cluster.gpu, dtype, slowdown=cluster.compute_slowdown)
    coll = CollectiveModel(cluster)
    costs = UnitCosts(profile, compute, lambda t: coll.for_group(group_placement(cluster, t, 1)), dtype,
                      ep_all_to_all_s=ep_all_to_all(cluster, coll),
                      float8=layout.float8, cp_collectives=cp_collectives(cluster, coll), expert_tp=layout.expert_tp_degree,
                      float8_tp_gather=layout.float8_tp_gather, float8_shared_casts=layout.float8_shared_casts)
    env = replace(_environment(cluster, compute, dtype, pins, UNBOUNDED_MEMORY_FRACTION), cut_allowed=_cut_allowed(profile))
    m = batch * layout.cp_degree // (layout.dp * layout.micro_batch)  # a CP group shares its samples
    cfg = Config(layout.tp_degree, layout.sequence_parallel, layout.pp_degree, layout.dp, layout.micro_batch, m,
                 layout.schedule, layout.virtual_stages, layout.zero_stage, ep=layout.ep_degree,
                 shard_degree=layout.shard_degree, offload=layout.offload, cp=layout.cp_degree, expert_tp=layout.expert_tp_degree,
                 cp_algorithm=layout.cp_algorithm if layout.cp_degree > 1 else "all-gather")
    table = costs.table(cfg.tp, cfg.sequence_parallel, cfg.micro_batch_size, cfg.ep, cfg.cp, cfg.cp_algorithm)
    # Some layers recomputed (torchtitan's every N-th, Megatron-LM's first k per stage): those units' modes, fixed.
    modes = layer_modes(layout, [u.name for u in profile.units], bounds) if some_layers else None
    evaluation = evaluate_config(table, cfg, env, bounds, fixed_modes=modes)
    if not evaluation.feasible:
        raise PlannerError(f"The configuration cannot be priced: {evaluation.reason}.", "Check its stages and degrees.")
    result = SearchResult([evaluation], 1, 0, math.inf, 0.0, costs)
    plan = build_plan(profile, cluster, batch, result, 1, dtype, profile_path)
    plan.training.grad_clip = layout.grad_clip
    if deferred and plan.search is not None:
        plan.search.notes.append(f"ZeRO 2-3 with pp {layout.pp_degree} priced as ZeRO 1: {PIPELINE_ZERO_WHY}")
    return plan


@dataclass
class Comparison:
    """A user's configuration priced beside the best plan for the same model and cluster."""

    theirs: Plan
    best: Plan | None
    """None when no plan fits."""
    changes: list[str]
    usable_bytes: float

    def lines(self) -> list[str]:
        out = [f"your configuration: {summary(self.theirs, self.usable_bytes)}"]
        if self.best is None:
            return out + ["best plan: no configuration fits this cluster"]
        out.append(f"best plan:          {summary(self.best, self.usable_bytes)}")
        t0, t1 = prediction(self.theirs).iteration_time_s, prediction(self.best).iteration_time_s
        if self.changes:
            out.append(f"change: {', '.join(self.changes)}: {seconds(t0)} -> {seconds(t1)} ({t1 / t0 - 1:+.1%})")
        else:
            out.append("change: nothing, it is the best plan the model knows")
        return out


def compare(profile: Profile, cluster: Cluster, layout: EngineLayout, global_batch_size: int | None = None,
            profile_path: str | None = None) -> Comparison:
    from planner.solver.solve import MEMORY_FRACTION, Pins, solve

    theirs = price(profile, cluster, layout, global_batch_size, profile_path)
    usable = cluster.gpu.memory_bytes * MEMORY_FRACTION
    try:
        # The same numerics (FP8 is the user's choice, not searched); offload offered where theirs uses it.
        # Recomputation as the engine runs it (Megatron-LM has no op-level mode, DeepSpeed no selective one),
        # and the communication it overlaps as the configuration asks.
        best = solve(profile, cluster, theirs.batch.global_batch_size,
                     Pins(recompute_modes=layout.recompute_modes, overlap=layout.overlap,
                          grad_accumulation=layout.grad_accumulation),
                     dtype=theirs.training.dtype, profile_path=profile_path,
                     float8=theirs.training.float8, allow_offload=theirs.training.offload == "cpu")
    except PlannerError:
        return Comparison(theirs, None, [], usable)
    mine, ours = prediction(theirs), prediction(best)
    if ours.iteration_time_s > mine.iteration_time_s and max(mine.peak_memory_bytes) <= usable:
        best = theirs  # the search's own pruning never beats an exact price of a fitting layout
    a, b = plan_layout(theirs), plan_layout(best)
    bounds = lambda p: tuple((sum(len(s.units) for s in p.stages[:k]), sum(len(s.units) for s in p.stages[:k + 1]))  # noqa: E731
                             for k in range(len(p.stages)))
    return Comparison(theirs, best, differences(a, b, bounds(theirs), bounds(best)), usable)


def reprice_warning(what: str, plan: Plan, mapped: EngineLayout, profile: Profile | None, cluster: Cluster | None) -> str:
    """`<what>; by the cost model 12.1 ms -> 13.0 ms (+7.4%), peak memory 30.1 -> 33.0 GiB`, and
    `, which does not fit (72.0 GiB usable per h100-80gb)` when the engine's layout overflows a GPU."""
    from planner.solver.solve import MEMORY_FRACTION

    if profile is None or cluster is None or plan.prediction is None:
        return f"{what} (not re-priced: the plan's profile is not available)"
    try:
        priced = price(profile, cluster, mapped, plan.batch.global_batch_size)
    except PlannerError as exc:
        return f"{what} (not re-priced: {exc.message})"
    before, after = prediction(plan), prediction(priced)
    t0, t1 = before.iteration_time_s, after.iteration_time_s
    m0, m1 = max(before.peak_memory_bytes) / 2**30, max(after.peak_memory_bytes) / 2**30
    usable = cluster.gpu.memory_bytes * MEMORY_FRACTION
    overflow = f", which does not fit ({usable / 2**30:.1f} GiB usable per {cluster.gpu.name})" if m1 * 2**30 > usable else ""
    return (f"{what}; by the cost model {seconds(t0)} -> {seconds(t1)} ({t1 / t0 - 1:+.1%}), "
            f"peak memory {m0:.2f} -> {m1:.2f} GiB{overflow}")
