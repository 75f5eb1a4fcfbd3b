"""Turn the search's best evaluation into a plan file, with alternatives and why they lost."""

from __future__ import annotations

import math
import re

from planner.cluster import Cluster
from planner.cost.fp8 import fp8_coverage_note, mfu_conventions
from planner.plan import (
    Alternative,
    Batch,
    ClusterRef,
    Layout,
    ModelRef,
    Plan,
    Prediction,
    SearchReport,
    Stage,
    Training,
    stage_ranks,
)
from planner.profile_schema import Profile
from planner.solver.comm_pricing import ReductionStream
from planner.solver.search import Evaluation


def _layout(e: Evaluation) -> Layout:
    c = e.config
    # Validated from a dict: the search carries the schedule and ZeRO stage as plain str and int.
    return Layout.model_validate(dict(
        pp_degree=c.pp, dp_degree=c.dp, tp_degree=c.tp, zero_stage=c.zero_stage,
        sequence_parallel=c.sequence_parallel, schedule=c.schedule, virtual_stages=c.virtual_stages,
        p2p_scatter_gather=e.p2p_scatter_gather, ep_degree=c.ep, shard_degree=c.shard_degree, cp_degree=c.cp, cp_algorithm=c.cp_algorithm,
        expert_tp_degree=c.expert_tp,
    ))


def module_fqn(unit: str, module: str) -> str:
    """A module's name from the model root, given its path relative to its unit ("" is the unit itself,
    as when the unit is a Linear such as GPT's `head`)."""
    return f"{unit}.{module}" if module else unit


def why_lost(loser: Evaluation, winner: Evaluation) -> str:
    """The breakdown terms that grew the most, in words."""
    slower = loser.iteration_time_s / winner.iteration_time_s - 1
    deltas = sorted(((loser.breakdown_s[k] - winner.breakdown_s.get(k, 0.0), k) for k in loser.breakdown_s), reverse=True)
    grew = [f"{k} +{d * 1e3:.3g} ms" for d, k in deltas[:2] if d > 0]
    return f"{slower:+.1%} slower" + (f": {', '.join(grew)}" if grew else "")


def profile_times_device(profile: Profile) -> str:
    """Whose times a profile holds: `cpu`, an analytic GPU preset, or a measured GPU's name."""
    if profile.device == "meta":
        return profile.target_gpu or "h100-80gb"
    return "cpu" if profile.device == "cpu" else profile.device_name


def device_mismatch(profile: Profile, cluster: Cluster) -> str | None:
    """A sentence when the profile's times were not taken on (or for) the cluster's GPU, else None.

    A measured GPU's name is matched to a preset as `planner profile-cluster` does it; a
    cluster GPU given a name of its own in a cluster file matches only a profile of that name.
    """
    times, gpu = profile_times_device(profile), cluster.gpu.name
    if profile.device == "cuda" and gpu != "cpu":
        from planner.cluster_probe import GPU_NAMES

        name = times.lower()
        same = next((preset for key, preset in GPU_NAMES if key in name), None) == gpu or gpu.lower() in name
    else:
        same = times == gpu
    if same and profile.device == "meta":
        from planner.cost.compute import profile_matches

        if not profile_matches(profile, cluster.gpu, profile.dtype):
            return (f"the profile's analytic times are for {times} at other rates than the cluster's (a cluster file's "
                    "overrides): the prediction prices each unit's totals by roofline at the cluster's rates; profile "
                    "with --gpu <the cluster file> for per-op times")
    if same:
        return None
    return (f"the profile's times are {'measured on' if profile.device != 'meta' else 'analytic for'} {times}, "
            f"the cluster's GPU is {gpu}: the prediction uses {times}'s times")


def tp_coverage_note(profile: Profile, tp_plans: list[dict[str, str]], tp: int, sequence_parallel: bool = False,
                     shown: int = 4) -> str:
    """The plan's note on what tensor parallelism splits: the share of the weights of linears,
    embeddings and convolutions (planner/solver/intra_op.py `WEIGHT_KINDS`; a weight tied across
    units counted once) sharded `tp` ways, and those every TP rank holds whole, grouped by name
    with block numbers as `*` (`transformer.h.*.attn.c_attn`), largest first, with why
    (`whole_weights`). A model whose attention stays whole shards far less than its tp degree
    suggests (GPT-2's fused q|k|v, for one); the prediction prices that, and this says it."""
    from planner.solver.costs import tied_groups
    from planner.solver.intra_op import WEIGHT_KINDS, moe_blocks, whole_weights

    names = profile.unit_names()
    tied: dict[int, set[int]] = {}  # a later unit of a tied group -> weight sizes its first unit holds
    partners: dict[int, str] = {}  # a unit of a tied group -> the others, named
    for members in tied_groups(profile):
        for u in members:
            partners[u] = ", ".join(names[w] for w in members if w != u)
        for u in members[1:]:
            tied[u] = {math.prod(op.weight_shape) for op in profile.units[members[0]].ops if op.weight_shape}
    total = whole = 0
    groups: dict[tuple[str, str], list[int]] = {}  # (pattern, why) -> [count, parameters]
    for u, unit in enumerate(profile.units):
        # The weightless ops stay: whole_weights reads the attention ops for their heads.
        ops = [op for op in unit.ops if not (op.weight_shape and math.prod(op.weight_shape) in tied.get(u, ()))]
        routers = {layer.router for layer in unit.moe if layer.router}
        kept = {id(op): why if u not in partners or tp_plans[u] else
                f"tied to {partners[u]}: a tied weight is sharded only where every holder can split its first dim {tp} ways"
                for op, why in whole_weights(ops, tp, tp_plans[u], routers, sequence_parallel, moe_blocks(unit),
                                             bool(unit.mixes_tokens))}
        for op in ops:
            if op.kind not in WEIGHT_KINDS or op.module is None or not op.weight_shape:
                continue
            size = math.prod(op.weight_shape)
            total += size
            if id(op) in kept:
                whole += size
                pattern = re.sub(r"(?<=\.)\d+(?=\.|$)", "*", module_fqn(names[u], op.module))
                entry = groups.setdefault((pattern, kept[id(op)]), [0, 0])
                entry[0], entry[1] = entry[0] + 1, entry[1] + size
    if total == 0:
        return f"tensor parallelism (tp {tp}): the model has no linear, embedding or convolution weights to split"
    share = 1 - whole / total
    text = (f"tensor parallelism (tp {tp}) splits {'over 99%' if whole and share >= 0.995 else f'{share:.0%}'} of the "
            "weights of linears, embeddings and convolutions")
    if not groups:
        return text
    ranked = sorted(groups.items(), key=lambda item: -item[1][1])
    listed = "; ".join(f"{pattern}{f' x{count}' if count > 1 else ''} ({why})" for (pattern, why), (count, _) in ranked[:shown])
    more = f"; and {len(ranked) - shown} more" if len(ranked) > shown else ""
    return f"{text}; every TP rank holds whole: {listed}{more}"


def reduction_lane(stream: ReductionStream | None) -> dict:
    """The plan's record of its overlapped gradient reduction (`SearchReport.rank_grad_reduce_s`,
    `grad_reduce_buckets`, `grad_reduce_ready`), which its Gantt chart plays on a communication lane."""
    if stream is None:
        return {}
    return dict(rank_grad_reduce_s=list(stream.seconds), grad_reduce_buckets=list(stream.buckets),
                grad_reduce_ready=stream.ready)


def _alternative(e: Evaluation, winner: Evaluation) -> Alternative:
    return Alternative(
        layout=_layout(e),
        micro_batch_size=e.config.micro_batch_size,
        num_microbatches=e.config.num_microbatches,
        stage_units=[j - i for i, j in e.bounds],
        recompute=list(e.stage_recompute),
        unit_recompute=[list(modes) for modes in e.unit_recompute] if _mixed(e) else [],
        iteration_time_s=e.iteration_time_s,
        peak_memory_bytes=[int(m) for m in e.peak_memory_bytes],
        why_lost=why_lost(e, winner) if e is not winner else "best",
    )


def _memory_terms_bytes(best: Evaluation, cluster: Cluster, memory_fraction: float) -> list[dict[str, int]] | None:
    """The plan's `Prediction.memory_terms_bytes`: the search's terms per stage (planner/solver/
    search.py `memory_terms`), rounded so that all but fragmentation sum to the stage's peak, and
    the fragmentation allowance: the share of the GPU the search keeps free (`memory_fraction`),
    none on CPU, where a run's measured peak counts tensors only (planner/cost/memory.py)."""
    if not best.memory_terms:
        return None
    allowance = 0 if cluster.gpu.name == "cpu" else int(cluster.gpu.memory_bytes * (1 - memory_fraction))
    out = []
    for terms, peak in zip(best.memory_terms, best.peak_memory_bytes, strict=True):
        rounded = {name: int(round(v)) for name, v in terms.items()}
        rounded["activations"] += int(peak) - sum(rounded.values())  # rounding only: the terms sum to the peak
        out.append({**rounded, "fragmentation": allowance})
    return out


def _mixed(e: Evaluation) -> bool:
    """Whether some stage of `e` runs more than one recomputation mode."""
    return any(len(set(modes)) > 1 for modes in e.unit_recompute)


def _mfu_fp8(best: Evaluation, table, cluster: Cluster, iteration_s: float) -> float:
    """The FP8 convention's MFU (planner/cost/fp8.py `mfu_conventions`), per GPU."""
    cfg, n = best.config, cluster.world_size
    fp8_flops = cfg.num_microbatches * cfg.dp * float(table.fp8_flops.sum())
    return mfu_conventions(best.model_flops / n, min(fp8_flops, best.model_flops) / n, iteration_s, cluster.gpu).fp8


def build_plan(profile: Profile, cluster: Cluster, global_batch_size: int, result, top_k: int, dtype: str,
               profile_path: str | None) -> Plan:
    best = result.ranked[0]
    cfg = best.config
    layout = _layout(best)
    table = result.costs.table(cfg.tp, cfg.sequence_parallel, cfg.micro_batch_size, cfg.ep, cfg.cp, cfg.cp_algorithm)
    names = profile.unit_names()
    stages = []
    for k, ((i, j), recompute, unit_modes) in enumerate(zip(best.bounds, best.stage_recompute, best.unit_recompute,
                                                             strict=True)):
        tp_plan, copies, feeds = {}, [], {}
        if cfg.tp > 1:
            for u in range(i, j):
                tp_plan.update({module_fqn(names[u], module): style for module, style in table.tp_plans[u].items()})
                modules = {op.name: op.module for op in profile.units[u].ops if op.module}
                feeds.update({module_fqn(names[u], modules[r]): [module_fqn(names[u], modules[c]) for c in cs]
                              for r, cs in table.tp_feeds[u].items()})
                written = [module_fqn(names[u], op.module) for op in profile.units[u].ops
                           if op.output_written_in_place and op.module is not None]
                copies += [name for name in written if tp_plan.get(name) in ("colwise", "rowwise")]
        experts = {module_fqn(names[u], layer.experts): layer.num_experts // cfg.ep
                   for u in range(i, j) for layer in profile.units[u].moe} if cfg.ep > 1 else {}
        unit_recompute = {names[u]: r for u, r in zip(range(i, j), unit_modes, strict=True) if r != recompute}
        stages.append(Stage(units=names[i:j], ranks=stage_ranks(layout, k), recompute=recompute,
                            unit_recompute=unit_recompute, tp_plan=tp_plan, tp_feeds=feeds if cfg.tp > 1 else None,
                            tp_copy_outputs=copies, experts=experts))
    n = cluster.world_size
    t = best.iteration_time_s
    samples = global_batch_size / t
    seq = profile.model.sequence_length
    peak = cluster.gpu.peak_flops.get(dtype, 0.0)
    tflops = best.model_flops / t / n / 1e12
    prediction = Prediction(
        iteration_time_s=t,
        samples_per_s=samples,
        tokens_per_s=samples * seq if seq else None,
        tflops_per_gpu=tflops,
        hw_tflops_per_gpu=best.hardware_flops / t / n / 1e12,
        mfu=tflops * 1e12 / peak if peak else 0.0,
        mfu_fp8=_mfu_fp8(best, table, cluster, t) if result.costs.float8 else None,
        bubble_fraction=best.bubble_fraction,
        peak_memory_bytes=[int(m) for m in best.peak_memory_bytes],
        pipeline_rank_peak_bytes=[int(m) for m in best.rank_memory_bytes] or None,
        memory_terms_bytes=_memory_terms_bytes(best, cluster, result.memory_fraction),
        stage_time_s=[f + b for f, b in zip(best.stage_forward_s, best.stage_backward_s, strict=False)],
        breakdown_s=best.breakdown_s,
        overlap=list(best.overlap),
        state_bytes=None if best.precision is None else {
            "weights": best.precision.param_bytes, "gradients": best.precision.grad_bytes,
            "reduction": best.precision.reduce_bytes, "optimizer": best.precision.optimizer_bytes},
    )
    alternatives = [_alternative(e, best) for e in result.ranked[1:top_k]]
    return Plan(
        model=ModelRef(file=profile.model.file, args=profile.model.args, fingerprint=profile.model.fingerprint,
                       source_sha256=profile.model.source_sha256),
        profile=profile_path,
        cluster=ClusterRef(**cluster.to_ref()),
        training=Training.model_validate(dict(dtype=dtype, cpu_threads=profile.cpu_threads, float8=result.costs.float8,
                                              offload="cpu" if cfg.offload else "none")),
        batch=Batch(global_batch_size=global_batch_size, micro_batch_size=cfg.micro_batch_size, num_microbatches=cfg.num_microbatches),
        layout=layout,
        stages=stages,
        prediction=prediction,
        search=SearchReport(
            solve_time_s=result.solve_time_s,
            candidates=result.candidates,
            candidates_evaluated=result.evaluated,
            pruned_by_memory_bound=result.pruned,
            pruned_by_time_bound=result.pruned_by_time,
            phase_times_s=dict(result.phase_times_s),
            processes=result.processes,
            stage_forward_s=list(best.stage_forward_s),
            stage_backward_s=list(best.stage_backward_s),
            stage_weight_fraction=list(best.stage_weight_fraction) or None,
            **reduction_lane(best.reduction_stream),
            alternatives=alternatives,
            notes=([tp_coverage_note(profile, table.tp_plans, cfg.tp, cfg.sequence_parallel)] if cfg.tp > 1 else [])
            + ([fp8_coverage_note(profile, cluster.gpu, cfg.micro_batch_size / cfg.cp, cfg.tp, table.tp_plans,
                                  result.costs.float8_shared_casts)]
               if result.costs.float8 else []),
        ),
        device_mismatch=device_mismatch(profile, cluster),
    )
