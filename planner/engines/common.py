"""What every engine translation shares: a layout in an engine's terms, its stage cuts, and its price.

An engine states a layout with its own knobs; `EngineLayout` holds them in the planner's terms,
with the stage cuts left as the engine's rule (`Split`) until the model's units are known. Then
`stage_bounds` turns the rule into unit ranges and `price` prices exactly that layout with the
solver's cost model (planner/solver/search.py `evaluate_config` with the cuts fixed), so a plan
exported to an engine that cannot say everything, or a user's own configuration, gets the same
kind of prediction as a solved plan.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, replace

from planner.cluster import Cluster, make_cluster
from planner.cost.memory import LiveParameters
from planner.cost.overlap import Overlap
from planner.errors import PlannerError
from planner.plan import RECOMPUTE, Plan, Prediction
from planner.profile_schema import Profile

GIB = 1024**3


@dataclass(frozen=True)
class Split:
    """An engine's rule for the pipeline stage cuts; `kind` picks which fields apply."""

    kind: str = "even"
    """`units` (explicit unit names per stage), `blocks` (repeated blocks per stage, what comes before
    the first block on the first stage and after the last on the last: Megatron-LM), `even` (the
    blocks split evenly, the same placement), `uniform` (all units as evenly as possible: DeepSpeed's
    partition_method='uniform'), `parameters` (DeepSpeed's default: balanced parameter counts),
    `weighted` (torchtitan's generate_llm_fqn_per_model_part: embedding and output count one layer each)."""
    units: tuple[tuple[str, ...], ...] = ()
    """kind `units`: unit names per stage."""
    blocks: tuple[int, ...] = ()
    """kind `blocks`: repeated blocks per stage."""


@dataclass(frozen=True)
class EngineLayout:
    """A layout as an engine runs it, in the planner's terms (planner/plan.py names)."""

    pp_degree: int = 1
    tp_degree: int = 1
    dp_degree: int | None = None
    """None: what the world size leaves (world / (pp x tp))."""
    zero_stage: int = 0
    sequence_parallel: bool = False
    schedule: str = "1f1b"
    virtual_stages: int = 1
    micro_batch_size: int | None = None
    """Samples per micro-batch; None: the global batch over dp in one micro-batch."""
    global_batch_size: int | None = None
    """None: the caller's --global-batch, else local_batch_size x dp."""
    local_batch_size: int | None = None
    """Samples per data-parallel rank and step, where the engine derives the global batch from it."""
    recompute: str = "none"
    """One mode for every stage (none of the engines sets it per stage)."""
    split: Split = Split()
    dtype: str | None = None
    """None: the profile's."""
    grad_clip: float | None = None
    notes: tuple[str, ...] = ()
    """What the engine's file says that the planner does not model (prices leave it out); on an
    export, what the user must do outside the file (model code) for the engine to run the plan."""
    ep_degree: int = 1
    """Expert-parallel degree, folded onto the data-parallel ranks (planner/plan.py `Layout.ep_degree`)."""
    expert_tp_degree: int = 1
    """Experts split over the TP ranks (planner/plan.py `Layout.expert_tp_degree`): 1 or tp."""
    cp_degree: int = 1
    """Context-parallel degree, folded onto the data-parallel ranks: dp_degree counts the cp ranks
    (planner/plan.py `Layout.cp_degree`), where Megatron-LM and torchtitan count them apart."""
    recompute_modes: tuple[str, ...] = RECOMPUTE
    """The recomputation modes the engine runs (read from its file: its own); `planner price` sets
    the configuration beside the best plan with these only (planner/engines/pricing.py `compare`)."""
    loss_kernel: str = "eager"
    """How the engine computes the cross-entropy (planner/cost/memory.py `loss_bytes`): "fused"
    (Megatron-LM's vocab-parallel cross-entropy: the logits only), "compiled" (torchtitan with
    compile), "eager"."""
    loss_parallel: bool = False
    """The engine keeps the output layer's logits sharded over the TP ranks and computes the loss on
    the shards (torchtitan's default under TP; planner/solver/solve.py `Pins.loss_parallel`)."""
    float8_tp_gather: bool = False
    """With FP8 linears under TP, the engine gathers their sequence-sharded inputs in FP8
    (torchtitan's Float8 TP; planner/solver/solve.py `Pins.float8_tp_gather`)."""
    float8_shared_casts: bool = False
    """With FP8 linears, the engine compiles a block at a time, so linears reading one input cast it
    once (torchtitan with compile; planner/solver/solve.py `Pins.float8_shared_casts`)."""
    fused_optimizer: bool = False
    """The engine's AdamW steps in place, without temporaries (Megatron-LM's and DeepSpeed's
    FusedAdam, torchtitan's default implementation "fused"); False: torch's foreach AdamW."""
    pipeline_buffers: str = "per-microbatch"
    """How the engine's pipeline holds what crosses a cut (planner/solver/search.py
    `Environment.pipeline_buffers`): "per-microbatch" (torch.distributed.pipelining: torchtitan)
    or "in-flight" (Megatron-LM, DeepSpeed)."""
    dp_collectives: str = "per-unit"
    """How the engine's ZeRO 1-2 collectives go once per step (planner/solver/search.py
    `Environment.dp_collectives`): "per-unit" (FSDP2: torchtitan) or "bucketed" (Megatron-LM's
    distributed optimizer, DeepSpeed)."""
    gather_copy_out: bool = True
    """ZeRO 3's gathers copied out of their flat buffers on the compute stream: FSDP2 (torchtitan,
    Accelerate's fsdp_version 2); False where parameters are views of the gathered buffer (FSDP1's
    flat parameters, DeepSpeed's ZeRO 3). planner/solver/search.py `Environment.gather_copy_out`."""
    param_dtype: str | None = None
    """The weights' dtype as the forward reads them and ZeRO gathers them, read from the engine's
    file (planner/cost/memory.py `Precision`); None: `dtype`."""
    grad_dtype: str | None = None
    """The gradients' dtype as held before their reduction; None: `param_dtype`'s."""
    reduce_dtype: str | None = None
    """The dtype the data-parallel reduction moves; None: `grad_dtype`'s."""
    cp_algorithm: str = "all-gather"
    """How CP attention reaches the other ranks' K/V (planner/plan.py `Layout.cp_algorithm`):
    "all-gather" or "ring"; read only where cp_degree > 1."""
    shard_degree: int | None = None
    """Hybrid sharding: ZeRO states over groups of this many consecutive dp ranks; None: over all."""
    replicate_degree: int | None = None
    """Hybrid sharding stated by its replica groups where the engine leaves the shard size to the
    world size (torchtitan's data_parallel_shard_degree = -1, Megatron-LM's
    --num-distributed-optimizer-instances): pricing.resolve sets shard_degree = dp / this."""
    offload: bool = False
    """Sharded model states in host memory and the optimizer step on the CPU (planner/plan.py
    `Training.offload` = "cpu"; planner/cost/sharding.py)."""
    float8: bool = False
    """Linears in FP8, torchao tensorwise dynamic scaling (planner/plan.py `Training.float8`)."""
    layer_recompute: tuple[str, int] | None = None
    """Full recomputation of some transformer layers only, `recompute` being "full" (`layer_modes`):
    ("every", N), each pipeline rank's N-th, 2N-th, ... layer counted over its chunks in order
    (torchtitan's `selective_ac_option = "N"`); ("first", k), each stage chunk's first k layers
    (Megatron-LM's `--recompute-method block --recompute-num-layers k`). None: `recompute` on every unit."""
    grad_accumulation: str = "autograd"
    """How the engine adds each micro-batch's gradients to the step's (planner/cost/memory.py
    `accumulation_pass_bytes`); "autograd" as the planner's runtime."""
    zero3_live: LiveParameters | None = None
    """ZeRO 3 gathering submodule by submodule within DeepSpeed's bounds (planner/cost/memory.py
    `LiveParameters`, read from the config); None: FSDP's units."""
    overlap: Overlap | None = None
    """The communication the engine hides behind compute, as its file asks (planner/cost/overlap.py;
    Pins.overlap): Megatron-LM's --overlap-* flags, DeepSpeed's overlap_comm and its pipeline
    engine's blocking sends. None: the planner's runtime's (every overlap but async TP)."""

    # The sizes of a resolved layout (`plan_layout`, or pricing.py `resolve` for a read one),
    # where the engines' files are written and configurations priced.
    @property
    def dp(self) -> int:
        """`dp_degree`, resolved."""
        assert self.dp_degree is not None, "a layout read from a file is resolved first (pricing.resolve)"
        return self.dp_degree

    @property
    def micro_batch(self) -> int:
        """`micro_batch_size`, resolved."""
        assert self.micro_batch_size is not None, "a layout read from a file is resolved first (pricing.resolve)"
        return self.micro_batch_size

    @property
    def global_batch(self) -> int:
        """`global_batch_size`, resolved."""
        assert self.global_batch_size is not None, "a layout read from a file is resolved first (pricing.resolve)"
        return self.global_batch_size

    @property
    def replicas(self) -> int:
        """Data-parallel ranks that take different samples: dp / cp (a CP group shares its samples)."""
        return self.dp // self.cp_degree

    @property
    def num_microbatches(self) -> int:
        """Micro-batches per data-parallel rank and step: global batch / (dp / cp x micro-batch)."""
        return self.global_batch // (self.replicas * self.micro_batch)


def model_parts(names: list[str]) -> tuple[list[str], list[str], list[str]]:
    """(before, blocks, after): the longest run of units named `prefix.0`, `prefix.1`, ... is the
    repeated blocks; a model without one is all blocks."""
    best, start = (0, 0), 0
    for i in range(1, len(names) + 1):
        prev = re.fullmatch(r"(.*)\.(\d+)", names[i - 1])
        cur = re.fullmatch(r"(.*)\.(\d+)", names[i]) if i < len(names) else None
        if not (prev and cur and cur.group(1) == prev.group(1) and int(cur.group(2)) == int(prev.group(2)) + 1):
            if re.fullmatch(r"(.*)\.(\d+)", names[start]) and i - start > best[1] - best[0]:
                best = (start, i)
            start = i
    if best == (0, 0):
        return [], list(names), []
    return names[:best[0]], names[best[0]:best[1]], names[best[1]:]


def layer_modes(layout: EngineLayout, names: list[str], bounds) -> list[tuple[str, ...]]:
    """Per stage chunk (`bounds`, in chunk order over `names`), each unit's recomputation under
    `layout.layer_recompute`: "full" on the transformer layers (`model_parts`' blocks) the rule
    names, "none" on every other unit."""
    assert layout.layer_recompute is not None, "only a layout recomputing some layers has per-unit modes"
    rule, n = layout.layer_recompute
    blocks = set(model_parts(names)[1])
    counted = [0] * layout.pp_degree  # layers seen so far per pipeline rank ("every")
    modes = []
    for k, (i, j) in enumerate(bounds):
        stage, seen = [], 0
        for name in names[i:j]:
            full = False
            if name in blocks:
                seen += 1
                counted[k % layout.pp_degree] += 1
                full = counted[k % layout.pp_degree] % n == 0 if rule == "every" else seen <= n
            stage.append("full" if full else "none")
        modes.append(tuple(stage))
    return modes


def blocks_per_stage(names: list[str], bounds) -> tuple[list[int], list[str]]:
    """Repeated blocks in each stage, and where the units before/after the blocks sit elsewhere than
    the first/last stage (what an engine that places them itself would move)."""
    before, blocks, _ = model_parts(names)
    lo, hi = len(before), len(before) + len(blocks)
    counts = [max(0, min(j, hi) - max(i, lo)) for i, j in bounds]
    moved = [names[u] for k, (i, j) in enumerate(bounds) for u in range(i, j)
             if (u < lo and k != 0) or (u >= hi and k != len(bounds) - 1)]
    return counts, moved


def even_blocks(num_blocks: int, num_stages: int) -> list[int] | None:
    """Megatron-LM's default: every stage the same number of layers (None where it does not divide)."""
    return [num_blocks // num_stages] * num_stages if num_blocks % num_stages == 0 else None


def ds_uniform(num_items: int, num_parts: int) -> list[int]:
    """Part edges of DeepSpeed's `partition_uniform` (deepspeed/runtime/utils.py): chunks of
    num_items // num_parts, the first `residual` parts one larger."""
    if num_items <= num_parts:
        return [min(p, num_items) for p in range(num_parts + 1)]
    chunk, residual = divmod(num_items, num_parts)
    return [p * chunk + min(p, residual) for p in range(num_parts + 1)]


def balanced(weights: list[float], num_parts: int) -> list[int]:
    """Part edges minimising the heaviest part (the objective of DeepSpeed's `partition_balanced`)."""
    n, prefix = len(weights), [0.0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    best = [[math.inf] * (n + 1) for _ in range(num_parts + 1)]
    arg = [[0] * (n + 1) for _ in range(num_parts + 1)]
    best[0][0] = 0.0
    for p in range(1, num_parts + 1):
        for j in range(p, n + 1):
            for i in range(p - 1, j):
                cost = max(best[p - 1][i], prefix[j] - prefix[i])
                if cost < best[p][j]:
                    best[p][j], arg[p][j] = cost, i
    edges = [n]
    for p in range(num_parts, 0, -1):
        edges.append(arg[p][edges[-1]])
    return edges[::-1]


def weighted_split(names: list[str], num_stages: int, layers_per_stage: int | None = None) -> list[int]:
    """Blocks per stage as torchtitan's `generate_llm_fqn_per_model_part` (torchtitan/distributed/
    pipeline.py, 2025-08) splits them: input and output modules weigh one layer each, the
    remainder of the division goes to the first stages."""
    _, blocks, _ = model_parts(names)
    if layers_per_stage is not None:
        return [layers_per_stage] * num_stages
    effective = len(blocks) + 2
    base, extra = divmod(effective, num_stages)
    counts = [base + (k < extra) - (k == 0) - (k == num_stages - 1) for k in range(num_stages)]
    if num_stages == 1:
        counts = [len(blocks)]
    return counts


def stage_bounds(layout: EngineLayout, profile: Profile) -> tuple[tuple[int, int], ...]:
    """The engine's stage cuts as unit ranges of this profile."""
    names = profile.unit_names()
    num_stages = layout.pp_degree * layout.virtual_stages
    split = layout.split
    if split.kind == "units":
        index = {n: i for i, n in enumerate(names)}
        unknown = [u for stage in split.units for u in stage if u not in index]
        if unknown or len(split.units) != num_stages:
            raise PlannerError(f"The configuration's stages ({len(split.units)}, naming {unknown[:3] or 'known units'}) do not "
                               f"match the model's units or pp x virtual stages = {num_stages}.",
                               f"The model's units are {names[:6]}...; list each stage's modules by those names.")
        return tuple((index[s[0]], index[s[-1]] + 1) for s in split.units)
    if split.kind == "uniform":
        edges = ds_uniform(len(names), num_stages)
    elif split.kind == "parameters":
        edges = balanced([float(u.num_parameters) for u in profile.units], num_stages)
    else:
        _, blocks, _ = model_parts(names)
        counts = list(split.blocks) if split.kind == "blocks" else (
            weighted_split(names, num_stages) if split.kind == "weighted" else even_blocks(len(blocks), num_stages))
        if counts is None or len(counts) != num_stages or sum(counts) != len(blocks) or min(counts) < 0:
            raise PlannerError(f"The configuration's layers per stage ({counts or f'{len(blocks)} over {num_stages}'}) do not "
                               f"add up to the model's {len(blocks)} repeated blocks over {num_stages} stages.",
                               "Give layers per stage that add up to the model's layers (or a pp that divides them).")
        return _checked(block_bounds(names, counts))
    return _checked(tuple(zip(edges[:-1], edges[1:], strict=False)))


def block_bounds(names: list[str], counts: list[int]) -> tuple[tuple[int, int], ...]:
    """Unit ranges of stages holding `counts` repeated blocks each: the units before the blocks
    with the first stage, those after them with the last."""
    before, _, _ = model_parts(names)
    edges = [0] + [len(before) + sum(counts[:k + 1]) for k in range(len(counts))]
    edges[-1] = len(names)  # what follows the blocks goes with the last stage
    return tuple(zip(edges[:-1], edges[1:], strict=False))


def _checked(bounds: tuple[tuple[int, int], ...]) -> tuple[tuple[int, int], ...]:
    if any(i >= j for i, j in bounds):
        raise PlannerError(f"The configuration leaves a pipeline stage empty ({[j - i for i, j in bounds]} units per stage).",
                           "Use fewer pipeline stages.")
    return bounds


def cluster_of(plan: Plan) -> Cluster:
    """The plan's cluster rebuilt from its preset GPU (a measured cluster's links are not in the plan)."""
    ref = plan.cluster
    return make_cluster(ref.num_nodes * ref.gpus_per_node, ref.gpus_per_node, ref.gpu)


def plan_layout(plan: Plan) -> EngineLayout:
    """A plan as an EngineLayout (its exact cuts; its recompute if every unit of every stage agrees, else `mixed`)."""
    lay, modes = plan.layout, {r for s in plan.stages for r in s.unit_modes().values()}
    return EngineLayout(
        pp_degree=lay.pp_degree, tp_degree=lay.tp_degree, dp_degree=lay.dp_degree, zero_stage=lay.zero_stage,
        sequence_parallel=lay.sequence_parallel, schedule=lay.schedule, virtual_stages=lay.virtual_stages,
        micro_batch_size=plan.batch.micro_batch_size, global_batch_size=plan.batch.global_batch_size,
        recompute=modes.pop() if len(modes) == 1 else "mixed",
        split=Split("units", tuple(tuple(s.units) for s in plan.stages)), dtype=plan.training.dtype,
        grad_clip=plan.training.grad_clip, ep_degree=lay.ep_degree, expert_tp_degree=lay.expert_tp_degree, cp_degree=lay.cp_degree, shard_degree=lay.shard_degree,
        cp_algorithm=lay.cp_algorithm, offload=plan.training.offload == "cpu", float8=plan.training.float8)


def lost_overlaps(plan: Plan, mapped: EngineLayout, changes: list[str], why: dict[str, str]) -> None:
    """Notes in `changes` each overlap the plan's prediction assumes (planner/plan.py
    `Prediction.overlap`) that the engine, as `mapped` runs it (`EngineLayout.overlap`), keeps in
    series, where the layout has that communication at all; `why[name]` says the engine's rule."""
    if plan.prediction is None or plan.prediction.overlap is None or mapped.overlap is None:
        return
    present = {"grad_reduce": mapped.dp > 1, "param_gather": mapped.dp > 1 and mapped.zero_stage > 0,
               "pipeline_p2p": mapped.pp_degree > 1, "tp_comm": mapped.tp_degree > 1}
    for name in plan.prediction.overlap:
        if present.get(name) and name not in mapped.overlap.names():
            changes.append(f"{name} overlap -> in series ({why[name]})")


def strongest_recompute(plan: Plan) -> str:
    """One mode for all stages that keeps every stage within memory: the most recomputing one any unit uses."""
    order = RECOMPUTE
    return max((r for s in plan.stages for r in s.unit_modes().values()), key=order.index)


def nearest_unit_recompute(plan: Plan, mapped: EngineLayout, changes: list[str], expressible: bool, engine: str) -> EngineLayout:
    """A plan's per-unit recomputation (planner/plan.py `Stage.unit_recompute`) in an engine with one
    mode: priced as full recomputation of every layer (EngineLayout's one mode) when the engine can
    write the pattern itself (`expressible`: Megatron-LM's first k layers, torchtitan's every N-th
    layer), else the strongest mode used, on every layer: the nearest setting that stays within
    memory, noted in `changes` with what `engine` can say."""
    if not any(s.unit_recompute for s in plan.stages):
        return mapped
    if expressible:
        return replace(mapped, recompute="full")
    order = RECOMPUTE
    used = {r for s in plan.stages for r in s.unit_modes().values()}
    mode = max(used, key=order.index)
    changes.append(f"per-unit recompute ({', '.join(sorted(used))} by unit) -> {mode} on every layer ({engine})")
    return replace(mapped, recompute=mode)


def one_recompute_mode(plan: Plan, mapped: EngineLayout, changes: list[str], why: str) -> EngineLayout:
    """`mapped` with one recompute mode for every stage (engines have one setting; `why` names it),
    the change noted in `changes`."""
    if mapped.recompute != "mixed":
        return mapped
    mode = strongest_recompute(plan)
    from planner.plan_report import recompute_summary

    changes.append(f"per-stage recompute {[recompute_summary(s) for s in plan.stages]} -> {mode} on every stage ({why})")
    return replace(mapped, recompute=mode)


def differences(a: EngineLayout, b: EngineLayout, bounds_a=None, bounds_b=None) -> list[str]:
    """`pp 8 -> 4`-style differences from a to b."""
    out = []
    for label, name in (("pp", "pp_degree"), ("dp", "dp_degree"), ("tp", "tp_degree"), ("zero", "zero_stage"),
                        ("sequence parallel", "sequence_parallel"), ("schedule", "schedule"), ("virtual stages", "virtual_stages"),
                        ("micro-batch", "micro_batch_size"), ("recompute", "recompute"), ("dtype", "dtype"),
                        ("ep", "ep_degree"), ("expert tp", "expert_tp_degree"), ("cp", "cp_degree"), ("cp attention", "cp_algorithm"), ("offload", "offload"),
                        ("fp8", "float8"), ("recomputed layers", "layer_recompute")):
        x, y = getattr(a, name), getattr(b, name)
        if x is not None and y is not None and x != y:
            out.append(f"{label} {x} -> {y}")
    if (a.shard_degree or b.shard_degree) and (a.shard_degree or a.dp_degree) != (b.shard_degree or b.dp_degree):
        out.append(f"ZeRO shard group {a.shard_degree or a.dp_degree} -> {b.shard_degree or b.dp_degree} ranks")
    if bounds_a is not None and bounds_b is not None and bounds_a != bounds_b:
        out.append(f"units per stage {[j - i for i, j in bounds_a]} -> {[j - i for i, j in bounds_b]}")
    return out


def prediction(plan: Plan) -> Prediction:
    """A solved or priced plan's prediction (a hand-written plan may have none)."""
    if plan.prediction is None:
        raise PlannerError("The plan has no prediction (a hand-written plan?), so it cannot be compared.",
                           "Price it first: `planner solve` with every dimension pinned, or `planner price`.")
    return plan.prediction


def summary(plan: Plan, usable_bytes: float | None = None) -> str:
    """`12.3 ms, peak 41.2 GiB` (with `does not fit` when over the usable memory)."""
    pred = prediction(plan)
    peak = max(pred.peak_memory_bytes)
    fits = "" if usable_bytes is None or peak <= usable_bytes else f" (does not fit: {usable_bytes / GIB:.1f} GiB usable)"
    return f"{seconds(pred.iteration_time_s)}, peak {peak / GIB:.2f} GiB{fits}"


def seconds(value: float) -> str:
    return f"{value:.3g} s" if value >= 1 else f"{value * 1e3:.3g} ms"


def with_defaults(layout: EngineLayout, **fields) -> EngineLayout:
    return replace(layout, **{k: v for k, v in fields.items() if v is not None})


@dataclass
class Export:
    """An engine configuration written from a plan."""

    text: str
    """The file's content (TOML, arguments, JSON or YAML)."""
    mapped: EngineLayout
    """What the engine will run, in the planner's terms."""
    warnings: list[str] = field(default_factory=list)
    """Each thing the engine cannot express, what it became, and what that costs by the cost model."""
