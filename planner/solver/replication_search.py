"""Replicated pipelines in the search: PipeDream's partitioner (planner/solver/replication.py)
on the profile's unit costs, and the plan it wins with.

The partitioner runs on tp = 1 tables only (replication is the data parallelism, and the
runtime, runtime/pp_replicated.py, runs dp = tp = 1, ZeRO 0, no recomputation, no weight
tied across stages), for each profiled micro-batch size b dividing the global batch
(M = global / b micro-batches). Its terms, per unit, from the search's own cost table
(planner/solver/costs.py) and environment (planner/solver/search.py `Environment`):

    compute_s        forward_s + backward_s                       (tp = 1: no TP collectives)
    grad_bytes       trained parameters x gradient bytes (4 in float32, else 2; as comm_pricing.py)
    state_bytes      `gpu_state_bytes` at ZeRO 0 (weights, gradients, AdamW state)
    activation_bytes activations["none"]
    all_reduce_s     the search's dp all-reduce over r consecutive ranks (`dp_all_reduce_s(b, r, 1)`;
                     its placement counts them from a node's first rank, a stage may start mid-node)
    p2p_s            the search's p2p, within a node when all G GPUs are in one; overlapped
                     with compute where the search assumes so (`Overlap.pipeline_p2p`)
    optimizer_s      updated parameters x the cluster's optimizer seconds per parameter

`consider_replication` prices the best replicated pipeline against the search's plan and
keeps the faster, recording the comparison in the plan's `search.notes` either way.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from planner.cluster import Cluster
from planner.cost.memory import optimizer_transient_bytes
from planner.plan import Layout, Plan, Prediction, Stage, stage_ranks
from planner.profile_schema import Profile
from planner.solver.costs import UnitCostTable
from planner.solver.replication import (
    ReplicatedStages,
    ReplicationProblem,
    partition,
    replica_memory_bytes,
    step_time_s,
)
from planner.solver.search import Config, Environment, accumulation_s, gpu_state_bytes

MAX_DP_WORK = 2_000_000
"""Largest U^2 G^2 (units squared x GPUs squared, the DP's Python steps) the search tries: above
it the partitioner would take seconds to minutes and the search says it skipped replication."""


@dataclass(frozen=True)
class ReplicatedChoice:
    """The best replicated pipeline for one cluster and global batch."""

    micro_batch_size: int
    """Samples per micro-batch."""
    num_microbatches: int
    """M = global batch / micro_batch_size."""
    stages: ReplicatedStages
    """Cuts and replica counts (the partitioner's answer)."""
    step_time_s: float
    """Synchronous 1F1B-RR step time (planner/solver/replication.py `step_time_s`)."""
    stage_time_s: tuple[float, ...]
    """One micro-batch's forward + backward (and its cut's p2p) per stage, on one replica."""
    memory_bytes: tuple[float, ...]
    """Peak bytes per replica of each stage."""
    model_flops: float
    """FLOPs of one step (all micro-batches, forward + backward)."""


def micro_batch_sizes(global_batch_size: int, profiled: list[int], pinned: int | None = None) -> list[int]:
    """The search's micro-batch sizes (planner/solver/solve.py `_batch_variants`): divisors of the
    global batch that are powers of two or profiled, up to its MAX_MICRO_BATCH; or the pin."""
    from planner.solver.solve import MAX_MICRO_BATCH

    if pinned:
        return [pinned]
    return [b for b in range(1, min(global_batch_size, MAX_MICRO_BATCH) + 1)
            if global_batch_size % b == 0 and ((b & (b - 1)) == 0 or b in profiled)]


def replication_problem(table: UnitCostTable, env: Environment, num_gpus: int, num_microbatches: int,
                        micro_batch_size: int) -> ReplicationProblem:
    """The partitioner's terms from a tp = 1 cost table (module docstring)."""
    cfg = Config(tp=1, sequence_parallel=False, pp=1, dp=1, micro_batch_size=micro_batch_size,
                 num_microbatches=num_microbatches, schedule="1f1b", virtual_stages=1, zero_stage=0)
    frozen = table.frozen_parameters
    trained = np.asarray(table.parameters - (frozen if frozen is not None else 0.0), dtype=float)
    grad_bytes = env.precision.reduce_bytes
    same_node = num_gpus <= env.gpus_per_node
    return ReplicationProblem(
        compute_s=np.asarray(table.forward_s + table.backward_s, dtype=float),
        grad_bytes=np.asarray(trained * grad_bytes, dtype=float),
        state_bytes=np.asarray(gpu_state_bytes(table.parameters, cfg, env, frozen), dtype=float),
        activation_bytes=np.asarray(table.activations["none"], dtype=float),
        cut_bytes=np.asarray(table.cut_bytes, dtype=float),
        num_gpus=num_gpus, num_microbatches=num_microbatches,
        all_reduce_s=lambda nbytes, r: env.dp_all_reduce_s(nbytes, r, 1) if r > 1 and nbytes > 0 else 0.0,
        p2p_s=lambda nbytes: env.p2p_s(nbytes, same_node) if nbytes > 0 else 0.0,
        memory_limit_bytes=env.usable_memory_bytes,
        optimizer_s=np.asarray(trained * env.optimizer_s_per_param, dtype=float),
        accumulation_s=num_microbatches * accumulation_s(table, cfg, env),
        # AdamW's temporaries (planner/cost/memory.py `optimizer_transient_bytes`): the runtime's
        # make_optimizer, foreach on GPUs (per parameter, summed), tensor by tensor on CPUs (its
        # largest parameter's, the stage's largest); none for a fused one.
        step_bytes=None if env.fused_optimizer or env.device == "cpu"
        else optimizer_transient_bytes(trained, np.zeros_like(trained), "gpu"),
        step_peak_bytes=None if env.fused_optimizer or env.device != "cpu" or table.largest_parameter is None
        else optimizer_transient_bytes(np.zeros_like(trained), np.asarray(table.largest_parameter, dtype=float), "cpu"),
        overlap_p2p=env.overlap.pipeline_p2p,
    )


def search_replicated(tables: dict[int, UnitCostTable], env: Environment, num_gpus: int,
                      global_batch_size: int) -> ReplicatedChoice | None:
    """The fastest replicated pipeline over the micro-batch sizes of `tables` (b -> tp = 1 table);
    None when none fits. Weights tied across units (`tie_terms`) are priced on the partition the
    partitioner chose without them, which is kept only if it still fits: a valid, honestly priced
    plan, not always the best replicated one for a tied model."""
    best: ReplicatedChoice | None = None
    for b, table in sorted(tables.items()):
        if global_batch_size % b:
            continue
        m = global_batch_size // b
        problem = replication_problem(table, env, num_gpus, m, b)
        try:
            stages = partition(problem)
        except Exception:  # noqa: BLE001  (PlannerError: nothing fits at this micro-batch size)
            continue
        if max(stages.replicas) > m:  # a replica would get no micro-batch (planner/plan.py refuses it)
            continue
        copies, tie_s = tie_terms(table, env, stages, b, m)
        memory = tuple(held + copy for held, copy in zip(replica_memory_bytes(problem, stages), copies, strict=True))
        if max(memory) > env.usable_memory_bytes:
            continue
        seconds = step_time_s(problem, stages.bounds, stages.replicas) + tie_s
        if best is None or seconds < best.step_time_s:
            times = tuple(float(problem.compute_s[i:j].sum()) + (2 * problem.p2p_s(float(problem.cut_bytes[j - 1]))
                          if j < problem.num_units else 0.0) for i, j in stages.bounds)
            best = ReplicatedChoice(b, m, stages, seconds, times, memory, m * float(table.model_flops.sum()))
    return best


def tie_terms(table: UnitCostTable, env: Environment, stages: ReplicatedStages, micro_batch_size: int,
              num_microbatches: int) -> tuple[list[float], float]:
    """Per stage, the bytes of the tied-weight copies it holds (a stage with a unit of a tie but
    not its first keeps a copy: weights, gradients and AdamW state, `UnitCostTable.copy_parameters`),
    and the step's seconds for the ties' gradient all-reduces, one per tie over every replica of
    the stages holding it, after the replicas' own (runtime/pp_replicated.py `sum_replica_gradients`)."""
    cfg = Config(tp=1, sequence_parallel=False, pp=1, dp=1, micro_batch_size=micro_batch_size,
                 num_microbatches=num_microbatches, schedule="1f1b", virtual_stages=1, zero_stage=0)
    starts, ends = np.array(stages.bounds).T
    copies = [float(x) for x in gpu_state_bytes(table.copy_parameters(starts, ends), cfg, env)]
    grad_bytes = env.precision.reduce_bytes
    seconds = 0.0
    for tie in table.tied:
        holding = [k for k, (i, j) in enumerate(stages.bounds) if any(i <= u < j for u in tie.units)]
        ranks = sum(stages.replicas[k] for k in holding)
        if len(holding) > 1 or ranks > 1:
            seconds += env.dp_all_reduce_s(tie.num_parameters * grad_bytes, ranks, 1)
    return copies, seconds


def replicated_plan(base: Plan, choice: ReplicatedChoice, units: list[str], cluster: Cluster, dtype: str,
                    sequence_length: int | None) -> Plan:
    """`base` (the search's plan: model, cluster, training) re-laid as the replicated pipeline."""
    replicas = list(choice.stages.replicas)
    layout = Layout.model_validate(dict(pp_degree=len(replicas), stage_replicas=replicas, schedule="1f1b"))
    stages = [Stage(units=units[i:j], ranks=stage_ranks(layout, k)) for k, (i, j) in enumerate(choice.stages.bounds)]
    t, n = choice.step_time_s, sum(replicas)
    samples = base.batch.global_batch_size / t
    peak = cluster.gpu.peak_flops.get(dtype, 0.0)
    tflops = choice.model_flops / t / n / 1e12
    busy = max(math.ceil(choice.num_microbatches / r) * s for r, s in zip(replicas, choice.stage_time_s, strict=True))
    prediction = Prediction(
        iteration_time_s=t, samples_per_s=samples, tokens_per_s=samples * sequence_length if sequence_length else None,
        tflops_per_gpu=tflops, hw_tflops_per_gpu=tflops, mfu=tflops * 1e12 / peak if peak else 0.0,
        bubble_fraction=max(t - busy, 0.0) / t if t > 0 else 0.0,
        peak_memory_bytes=[int(b) for b in choice.memory_bytes], stage_time_s=list(choice.stage_time_s),
        breakdown_s={"compute": busy, "bubble": max(t - busy, 0.0)},
    )
    data = base.model_dump()
    data["batch"].update(micro_batch_size=choice.micro_batch_size, num_microbatches=choice.num_microbatches)
    if data.get("search"):  # the per-stage times and alternatives were the search's plan's
        data["search"].update(stage_forward_s=None, stage_backward_s=None)
    data.update(layout=layout.model_dump(), stages=[s.model_dump() for s in stages], prediction=prediction.model_dump())
    return Plan.model_validate(data)  # validated: the replicas must add up to the cluster


def consider_replication(plan: Plan, profile: Profile, cluster: Cluster, global_batch_size: int, dtype: str,
                         costs, pins, memory_fraction: float) -> Plan:
    """The replicated pipeline instead of `plan` when it is predicted faster; a note either way.
    `costs`: the search's `UnitCosts`; `pins`, `memory_fraction`: the search's."""
    from planner.cost.compute import ComputeModel
    from planner.solver.solve import _environment

    units = [u.name for u in profile.units]
    gpus = cluster.world_size
    if len(units) ** 2 * gpus ** 2 > MAX_DP_WORK:
        return _noted(plan, f"replicated pipelines (PipeDream) not searched: {len(units)} units on {gpus} GPUs is "
                            f"past the partitioner's size limit (U^2 G^2 <= {MAX_DP_WORK})")
    env = _environment(cluster, ComputeModel(profile, cluster.gpu, dtype, slowdown=cluster.compute_slowdown), dtype,
                       pins, memory_fraction)
    tables = {b: costs.table(1, False, b) for b in micro_batch_sizes(global_batch_size, profile.micro_batch_sizes,
                                                                    pins.micro_batch_size)}
    choice = search_replicated(tables, env, gpus, global_batch_size)
    if choice is None:
        return _noted(plan, "replicated pipelines (PipeDream) searched: none fits")
    current = plan.prediction.iteration_time_s if plan.prediction else math.inf
    described = (f"stages x{list(choice.stages.replicas)} at micro-batch {choice.micro_batch_size}: "
                 f"{choice.step_time_s * 1e3:.4g} ms against {current * 1e3:.4g} ms")
    if choice.step_time_s >= current:
        return _noted(plan, f"replicated pipelines (PipeDream) searched, not chosen: best {described}")
    chosen = replicated_plan(plan, choice, units, cluster, dtype, profile.model.sequence_length)
    return _noted(chosen, f"replicated pipeline (PipeDream, stage_replicas) chosen: {described} for the search's "
                          f"best synchronous plan")


def _noted(plan: Plan, note: str) -> Plan:
    if plan.search is not None:
        plan.search.notes.append(note)
    return plan
