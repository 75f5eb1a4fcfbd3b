"""`planner solve`: the fastest plan that fits, from a profile and a cluster (no torch).

`solve` refuses pins the model cannot honour (`check_model_pins`: a TP degree that splits no
weight or not whole attention heads; weights tied across stages are no obstacle: the runtime
holds a copy per stage, which the search prices),
enumerates the configurations the pins allow (`candidate_configs`), prices each
with `planner.solver.search.evaluate_config`, keeps the best `top_k`, and writes the winner
as a plan file (planner/plan.py) whose `search` section lists the runners-up and why each
lost. When nothing fits it says what does not fit and by how much.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import time
from collections.abc import Callable
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np

from planner.cluster import Cluster
from planner.cost.collectives import CollectiveModel, Group, group_placement
from planner.cost.compute import ComputeModel
from planner.cost.cp import CP_METHODS, CP_PIPELINE_SCHEDULES, CpCollectives, cp_degrees, cp_refusal
from planner.cost.memory import LiveParameters, Precision, model_state_bytes
from planner.cost.overlap import SERIAL, Overlap
from planner.errors import PlannerError
from planner.plan import (
    RECOMPUTE,
    SCHEDULES,
    Plan,
)
from planner.profile_schema import OP_CHECKS, Profile
from planner.solver.bounds import SCHEDULE_COLUMNS, GroupSettings, TimeBound, schedule_columns
from planner.solver.costs import DTYPE_BYTES, UnitCosts, UnitCostTable, tied_unit_indices
from planner.solver.inter_op import allowed_cuts
from planner.solver.intra_op import shardable_ops
from planner.solver.pricing import (
    Helpers,
    Scout,
    SharedTopK,
    Top,
    TopK,
    can_fork,
    price_in_order,
    refined_order,
    run_split,
)
from planner.solver.search import Config, Environment, Evaluation, evaluate_config, flush_blocker, scatter_gather

log = logging.getLogger(__name__)
GIB = 1024**3
# Share of device memory the plan may use: the rest is the CUDA context, NCCL buffers,
# cuBLAS workspaces and allocator fragmentation (PyTorch's caching allocator typically
# loses 5-10% to fragmentation on long runs).
MEMORY_FRACTION = 0.9
MAX_MICRO_BATCH = 32  # larger micro-batches only when pinned
SPLIT_MIN = 2048
"""Fewer configurations than this are searched in one process (`split_blocks`): a fork and the
tables each part builds again cost more than the halves save."""


@dataclass(frozen=True)
class Pins:
    """Dimensions the user fixed; None leaves the dimension to the search."""

    pp: int | None = None
    tp: int | None = None
    dp: int | None = None
    micro_batch_size: int | None = None
    schedule: str | None = None
    virtual_stages: int | None = None
    recompute: str | None = None
    zero_stage: int | None = None
    sequence_parallel: bool | None = None
    ep: int | None = None
    """Expert-parallel degree (MoE models only)."""
    shard_degree: int | None = None
    """Hybrid sharding's shard group size (ZeRO >= 1); None: searched (planner/cost/sharding.py)."""
    offload: bool | None = None
    """CPU offload: True pins it, False forbids it, None (default) forbids it unless the search is
    allowed it (`allow_offload`): it trades speed for memory, so it is offered, not assumed."""
    cp: int | None = None
    """Context-parallel degree: sequences split over cp of the dp ranks (planner/cost/cp.py)."""
    expert_tp: int | None = None
    """Expert tensor-parallel degree (MoE models only): 1 or the pinned --tp; never searched
    (issue #14: expert TP off unless pinned; planner/cost/moe.py, runtime/apply_ep.py)."""
    cp_algorithm: str | None = None
    """How CP attention reaches the other ranks' K/V ("all-gather" or "ring"); None: the cheaper
    for each cp > 1 (planner/cost/cp.py)."""
    recompute_modes: tuple[str, ...] | None = None
    """The recomputation modes the search may give units when `recompute` is not pinned; None:
    all of planner/plan.py `RECOMPUTE` (an engine's own, e.g. Megatron-LM's none, selective and
    full, which has no op-level mode)."""
    loss_kernel: str = "eager"
    """Price the loss's memory as the stack's cross-entropy holds it (planner/cost/memory.py
    `loss_bytes`): "fused" for an engine that fuses it (Megatron-LM: the logits only), "compiled"
    for one that compiles it (torchtitan). "eager": as the planner's runtime runs it."""
    loss_parallel: bool = False
    """Price the loss's memory on the logits' 1/tp vocabulary shard (planner/cost/memory.py
    `loss_bytes`): for an engine that keeps the output layer's logits sharded under TP and computes
    the cross-entropy on the shards (torchtitan's default `loss_parallel`, torch's
    `torch.distributed.tensor.parallel.loss_parallel`). False: as the planner's runtime runs it,
    on the whole logits."""
    fused_optimizer: bool = False
    """Price the optimizer step without AdamW's temporaries, as an engine stepping in place runs
    it (planner/solver/search.py `Environment.fused_optimizer`). False: as the planner's runtime runs it."""
    float8_tp_gather: bool = False
    """With FP8 linears under TP: the stack casts a sequence-sharded input to FP8 before gathering it
    (torchao's `Float8ColwiseParallel` / `PrepareFloat8ModuleInput`, torchtitan's Float8 TP), so those
    all-gathers move 1 byte per element (planner/cost/fp8.py). False: bf16, as the planner's runtime runs it."""
    float8_shared_casts: bool = False
    """With FP8 linears compiled a block at a time, linears reading one input cast it once
    (planner/cost/fp8.py, Casts: torchtitan compiles each TransformerBlock). False: one cast per
    linear, as the planner's runtime compiles each Float8Linear alone."""
    pipeline_buffers: str = "per-microbatch"
    """How the engine's pipeline holds what crosses a cut (planner/solver/search.py
    `Environment.pipeline_buffers`): "per-microbatch" as the planner's runtime, or "in-flight"."""
    dp_collectives: str = "per-unit"
    """How the engine's ZeRO 1-2 collectives go once per step (planner/solver/search.py
    `Environment.dp_collectives`): "per-unit" as the planner's runtime (FSDP2), or "bucketed"."""
    gather_copy_out: bool = True
    """ZeRO 3's gathers copied out of their flat buffers on the compute stream (planner/solver/search.py
    `Environment.gather_copy_out`): FSDP2, as the planner's runtime; False for FSDP1 and DeepSpeed."""
    param_dtype: str | None = None
    """The dtype of the weights the forward reads and ZeRO gathers (planner/cost/memory.py
    `Precision`). None: as the planner's runtime holds them (`stack_precision`): float32 (fp32
    parameters under autocast, runtime/train.py `_autocast`) unless the profile computes pure."""
    grad_dtype: str | None = None
    """The dtype gradients are held in before their reduction; None: `param_dtype`'s."""
    reduce_dtype: str | None = None
    """The dtype the data-parallel reduction moves; None: `grad_dtype`'s."""
    grad_accumulation: str = "autograd"
    """How the stack adds each micro-batch's gradients to the step's (planner/cost/memory.py
    `accumulation_pass_bytes`: "autograd", as the planner's runtime, "buffer" or "fused")."""
    zero3_live: LiveParameters | None = None
    """ZeRO 3 as DeepSpeed runs it (planner/cost/memory.py `LiveParameters`: submodule by submodule,
    gradients through a reduce bucket); None: as FSDP runs it, unit by unit."""
    overlap: Overlap | None = None
    """The communication the stack hides behind compute (planner/cost/overlap.py): an engine's,
    as its file asks for it (`EngineLayout.overlap`). None: the planner's runtime's, every overlap
    but async TP on GPUs (NCCL runs on streams of its own), none on CPUs (gloo's collectives run
    on the cores that compute)."""


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_pins(pins: Pins, cluster: Cluster, global_batch_size: int, num_units: int) -> None:
    n, gpn = cluster.world_size, cluster.gpus_per_node
    problems = []
    for name in ("pp", "tp", "dp", "micro_batch_size", "virtual_stages", "ep", "shard_degree", "cp", "expert_tp"):
        value = getattr(pins, name)
        if value is not None and value < 1:
            problems.append(f"--{name.replace('_', '-')} must be positive (got {value})")
    if pins.schedule is not None and pins.schedule not in SCHEDULES:
        problems.append(f"--schedule {pins.schedule!r} is not one of {', '.join(SCHEDULES)}")
    if pins.recompute is not None and pins.recompute not in RECOMPUTE:
        problems.append(f"--recompute {pins.recompute!r} is not one of {', '.join(RECOMPUTE)}")
    if pins.zero_stage is not None and pins.zero_stage not in (0, 1, 2, 3):
        problems.append(f"--zero must be 0, 1, 2 or 3 (got {pins.zero_stage})")
    fixed = [d for d in (pins.pp, pins.tp, pins.dp) if d]
    if fixed and n % math.prod(fixed):
        problems.append(f"pp x tp x dp pins ({pins.pp}, {pins.tp}, {pins.dp}) do not divide the {n} GPUs")
    if pins.pp and pins.tp and pins.dp and pins.pp * pins.tp * pins.dp != n:
        problems.append(f"pp x tp x dp = {pins.pp * pins.tp * pins.dp} but the cluster has {n} GPUs")
    if pins.tp and pins.tp > gpn:
        problems.append(f"--tp {pins.tp} exceeds the {gpn} GPUs of a node (tensor parallelism stays inside a node)")
    if pins.pp and pins.pp * (pins.virtual_stages or 1) > num_units:
        problems.append(f"--pp {pins.pp} x --virtual-stages {pins.virtual_stages or 1} exceeds the model's {num_units} units")
    if pins.virtual_stages and pins.virtual_stages > 1 and pins.schedule not in (None, "interleaved-1f1b", "zero-bubble"):
        problems.append(f"--virtual-stages {pins.virtual_stages} needs --schedule interleaved-1f1b or zero-bubble")
    if pins.sequence_parallel and pins.tp == 1:
        problems.append("--sequence-parallel needs --tp > 1")
    # A CP group's ranks share their samples (planner/plan.py `cp_degree`): the batch splits over dp / cp.
    replicas = pins.dp // pins.cp if pins.dp and pins.cp and pins.dp % pins.cp == 0 else pins.dp
    if replicas and global_batch_size % replicas:
        over_cp = f" / --cp {pins.cp}" if replicas != pins.dp else ""
        problems.append(f"--global-batch {global_batch_size} is not divisible by --dp {pins.dp}{over_cp}")
    # EP folds onto dp, and onto dp x tp with sequence parallelism (runtime/mesh.py build_ep_mesh).
    if pins.ep and pins.dp and not pins.sequence_parallel and pins.dp % pins.ep:
        problems.append(f"--ep {pins.ep} does not divide --dp {pins.dp} (expert parallelism is folded onto the "
                        "data-parallel ranks; with --sequence-parallel onto the tensor-parallel ones too)")
    if pins.ep and pins.dp and pins.tp and pins.sequence_parallel and pins.dp * pins.tp % pins.ep:
        problems.append(f"--ep {pins.ep} does not divide --dp {pins.dp} x --tp {pins.tp} (with sequence parallelism "
                        "expert parallelism is folded onto the data- and tensor-parallel ranks)")
    if pins.shard_degree and pins.dp and (pins.dp % pins.shard_degree or pins.shard_degree < 2):
        problems.append(f"--shard-degree {pins.shard_degree} must be at least 2 and divide --dp {pins.dp}")
    if pins.shard_degree and pins.zero_stage == 0:
        problems.append("--shard-degree needs ZeRO >= 1 (hybrid sharding shards ZeRO states)")
    if pins.offload and pins.zero_stage == 0:
        problems.append("--offload needs ZeRO >= 1 (FSDP2's CPUOffloadPolicy)")
    if (pins.pp or 1) > 1 and (pins.zero_stage or 0) > PIPELINE_ZERO:
        problems.append(f"--zero {pins.zero_stage} with --pp {pins.pp}: {PIPELINE_ZERO_WHY}; pin --zero 1 (ZeRO 2 "
                        "runs exactly as it, ZeRO 3 with more memory and traffic)")
    if (pins.shard_degree or pins.offload) and pins.ep and pins.ep > 1:
        problems.append("--shard-degree/--offload with --ep: expert parallelism folds its own groups onto dp")
    if pins.cp and pins.cp > 1 and (pins.ep or 1) > 1:
        problems.append("--cp with --ep: both fold onto the data-parallel ranks; the runtime runs one of them")
    if pins.cp and pins.cp > 1 and (pins.pp or 1) > 1 and pins.schedule not in (None, *CP_PIPELINE_SCHEDULES):
        problems.append(f"--cp with --pp runs under the schedules {', '.join(CP_PIPELINE_SCHEDULES)} (got --schedule "
                        f"{pins.schedule})")
    if pins.cp_algorithm is not None and pins.cp_algorithm not in CP_METHODS:
        problems.append(f"--cp-algorithm {pins.cp_algorithm!r} is not one of {', '.join(CP_METHODS)}")
    if pins.cp_algorithm is not None and pins.cp == 1:
        problems.append("--cp-algorithm with --cp 1: there is no context parallelism to choose it for")
    if pins.cp and pins.dp and pins.dp % pins.cp:
        problems.append(f"--cp {pins.cp} does not divide --dp {pins.dp} (context parallelism is folded onto the "
                        "data-parallel ranks)")
    if pins.expert_tp and pins.expert_tp > 1 and (pins.tp != pins.expert_tp or pins.sequence_parallel):
        problems.append(f"--expert-tp {pins.expert_tp} needs --tp {pins.expert_tp} and no --sequence-parallel (experts "
                        "split over the whole TP group, whose ranks hold the same tokens)")
    if pins.expert_tp and pins.expert_tp > 1 and (pins.zero_stage or pins.shard_degree or pins.offload):
        problems.append(f"--expert-tp {pins.expert_tp} runs with ZeRO 0 only (FSDP2 would shard the experts' TP blocks again)")
    if problems:
        raise PlannerError("Invalid pins: " + "; ".join(problems) + ".", "Change the pinned values (see `planner solve --help`).")


PIPELINE_ZERO = 1
"""The highest ZeRO stage that runs as such in a pipeline. torch's pipeline schedules turn
FSDP's gradient reduction off for every micro-batch and keep each unit's parameters gathered
after its backward (`PipelineStage.backward_maybe_with_nosync`: set_requires_gradient_sync and
set_reshard_after_backward False), then reduce-scatter once, after the stage's last backward
(`perform_reduce_grad`). So ZeRO 2 holds whole gradients through the step, as ZeRO 1 does, and
ZeRO 3 holds them with every unit's parameters gathered again by the step's end: measured on
CPU (gpt, pp2 x dp2), ZeRO 2 peaked at ZeRO 1's bytes and ZeRO 3 above them, while priced
16-25% below. torchtitan keeps the parameters gathered under PP for the same reason
(`fsdp_reshard_after_forward` "default"); Megatron-LM's schedules defer the reduction alike
(`no_sync_func`). The search offers ZeRO 0-1 with pp > 1; an engine's ZeRO 2-3 pipeline is
priced as ZeRO 1 (planner/engines/pricing.py)."""
PIPELINE_ZERO_WHY = ("a pipeline defers FSDP's gradient reduction to the step's end and keeps parameters gathered after "
                     "each backward (torch's PipelineStage), so ZeRO 2-3 hold whole gradients, as ZeRO 1 does")


TP_KINDS = ("linear", "embedding")
"""The op kinds whose weights the runtime shards under tensor parallelism."""


def tp_refusal(profile: Profile, tp: int) -> str | None:
    """Why the runtime cannot honour tensor parallelism of degree `tp` on this model (None: it can).

    It must shard at least one weight: a degree that shards none would give tp ranks that
    repeat each other's work. An attention whose heads `tp` does not split whole (multi-query
    attention's single key/value head; Megatron-LM refuses the degree) stays replicated while
    the rest of its unit shards (planner/solver/intra_op.py `tp_obstacles`); the plan's notes
    name its weights and why."""
    if tp == 1:
        return None
    if profile.op_checks < OP_CHECKS and any(op.kind == "linear" for u in profile.units for op in u.ops):
        return ("the profile was written before the op graphs recorded how each projection's output is used "
                "(chunked into pieces, normalised over its features, viewed into a written-out number of heads), "
                "without which a column-sharded projection can train to other losses with no error; re-profile "
                "the model with this planner (`planner profile`) to allow tensor parallelism")
    shardable, seen = False, set()
    # Tied units are left out: they shard only where every holder can (planner/solver/costs.py
    # `tie_pins`), else stay whole, which neither blocks a degree nor makes one worth running.
    tied = tied_unit_indices(profile)
    for unit in profile.units:
        if unit.fingerprint in seen or unit.index in tied:
            continue
        seen.add(unit.fingerprint)
        shardable = shardable or bool(shardable_ops(unit.ops, tp))
    if not shardable:
        weighted = [op for u in profile.units for op in u.ops if op.weight_shape]
        kinds = sorted({op.kind for op in weighted if op.kind not in TP_KINDS})
        dims = sorted({d for op in weighted if op.kind in TP_KINDS for d in op.weight_shape or ()})
        if not dims:
            return ("tensor parallelism shards Linear and Embedding weights, and the model has none"
                    + (f" (its weighted layers are {', '.join(kinds)})" if kinds else "") + ", so nothing would be sharded")
        return (f"no Linear or Embedding weight of the model has a dimension that splits {tp} ways "
                f"(their dims {dims[:8]}"
                + (", tied weights not counted" if tied else "") + "), so nothing would be sharded")
    return None


def pp_refusal(profile: Profile) -> str | None:
    """Why the runtime cannot run this model in a pipeline (None: it can): parameters the model
    root holds itself, outside every unit, which no stage owns (runtime/pp_split.py
    `check_splittable`). Move them into a submodule to pipeline the model."""
    from planner.profile_schema import collapsed_names

    root = profile.model.root_parameters
    if not root:
        return None
    own = [name for name in root if "." not in name]
    if own:
        return (f"parameters {own[:4]} belong to the model root, not to a unit, so no pipeline stage owns them "
                "(move them into a submodule to pipeline the model)")
    uncalled = ", ".join(collapsed_names(root, profile.unit_names(), "parameters")[:4])
    return (f"the parameters of modules the forward never calls ({uncalled}) are in no unit, so no pipeline stage "
            "owns them (a vision-language model fed text leaves its vision tower so: profile the language model alone, "
            "e.g. --hf-config of its text_config as a config of its own, to pipeline it)")


def check_model_pins(pins: Pins, profile: Profile) -> None:
    """Refuse pinned dimensions this model cannot honour, saying why (the pins alone are checked by `check_pins`)."""
    problems = []
    if pins.pp and pins.pp > 1:
        why = pp_refusal(profile)
        if why:
            problems.append(f"--pp {pins.pp}: {why}")
    if pins.tp and pins.tp > 1:
        why = tp_refusal(profile, pins.tp)
        if why:
            problems.append(f"--tp {pins.tp}: {why}")
    if pins.cp and pins.cp > 1:
        why = cp_refusal(profile.model.sequence_length, pins.cp, profile.model.cp_obstacles, profile.model.attention_calls)
        if why:
            problems.append(f"--cp {pins.cp}: {why}")
    if pins.ep and pins.ep > 1:
        counts = expert_counts(profile)
        if not counts:
            problems.append(f"--ep {pins.ep}: the model has no mixture-of-experts layer (the profile records none)")
        elif any(c % pins.ep for c in counts):
            problems.append(f"--ep {pins.ep} does not divide the number of experts ({', '.join(map(str, sorted(counts)))}): "
                            f"each EP rank must hold a whole share of every layer's experts")
    if pins.expert_tp and pins.expert_tp > 1 and not expert_counts(profile):
        problems.append(f"--expert-tp {pins.expert_tp}: the model has no mixture-of-experts layer (the profile records none)")
    if problems:
        raise PlannerError("The model cannot honour the pins: " + "; ".join(problems) + ".",
                           "Pin a degree the model allows, or leave that dimension to the search.")


def expert_counts(profile: Profile) -> set[int]:
    """Numbers of experts of the profile's MoE layers (empty for a dense model)."""
    return {layer.num_experts for u in profile.units for layer in u.moe}


def ep_degrees(pins: Pins, experts: AbstractSet[int], dp: int, sp: bool, tp: int = 1) -> list[int]:
    """EP degrees to try with dp data-parallel ranks: divisors of every layer's number of experts
    that divide dp, or dp x tp with sequence parallelism (each TP rank then routes its own
    tokens, so the runtime folds EP over the (dp, tp) ranks: runtime/mesh.py `build_ep_mesh`)."""
    if not experts:
        return [1]
    common = math.gcd(*experts)
    choices = [pins.ep] if pins.ep else _divisors(common)
    ranks = dp * tp if sp else dp
    return [e for e in choices if common % e == 0 and ranks % e == 0]


def _shard_degrees(pins: Pins, zero_stage: int, dp: int, tp: int, gpus_per_node: int, ep: int,
                   states_fit=None) -> list[int | None]:
    """Hybrid sharding's group sizes to try: a pinned one, else plain sharding and, when the dp
    group spans several nodes, the node (ZeRO states sharded over a node's ranks, replicated
    across nodes: FSDP's usual HSDP layout, ZeRO++'s hierarchical partitioning) and the
    smallest group of whole nodes (doubling) whose shard of the states fits a GPU
    (`states_fit(shard) -> bool`) and twice it: shard as narrowly as memory allows, replicate
    the rest."""
    if zero_stage == 0 or ep > 1:
        return [None]
    if pins.shard_degree:  # equal to dp: sharding over all dp ranks, as Layout.shard_degree reads it
        return [None] if pins.shard_degree == dp else [pins.shard_degree] if dp % pins.shard_degree == 0 else []
    node = gpus_per_node // tp
    if dp * tp <= gpus_per_node or node < 1 or dp % node:
        return [None]
    sizes = [node] if 1 < node < dp else []
    group = max(node, 2)
    while states_fit is not None and group < dp and dp % group == 0 and not states_fit(group):
        group *= 2
    # The narrowest fitting group leaves little room for activations: its double is offered too.
    for size in (group, 2 * group):
        if size < dp and dp % size == 0 and size not in sizes and (states_fit is None or states_fit(size)):
            sizes.append(size)
    return [None, *sizes]


def _offloads(pins: Pins, zero_stage: int, dp: int, ep: int, allow_offload: bool) -> list[bool]:
    """Offload choices: it needs FSDP (ZeRO >= 1) and no EP; on one data-parallel rank ZeRO
    exists only to offload."""
    can = zero_stage >= 1 and ep == 1
    if pins.offload is not None:
        return [pins.offload] if (can or not pins.offload) and (pins.offload or dp > 1 or zero_stage == 0) else []
    if dp == 1 and zero_stage >= 1:
        return [True] if allow_offload and can else []
    return [False, True] if allow_offload and can else [False]


@dataclass(frozen=True)
class ConfigBlock:
    """The configurations of one (tp, pp, dp, cp, micro-batch, sp): each of `rest` (what the
    schedule does not change: CP algorithm, ep, ZeRO stage, hybrid shard degree, offload) with
    each of `schedules`. The search prices its memory bound once per entry of `rest` and its
    weak time bound per entry and schedule without making a Config of each (`config` makes one)."""

    tp: int
    sequence_parallel: bool
    pp: int
    dp: int
    micro_batch_size: int
    num_microbatches: int
    cp: int
    expert_tp: int
    rest: tuple[tuple[str, int, int, int | None, bool], ...]
    """(cp_algorithm, ep, zero_stage, shard_degree, offload) of each group."""
    schedules: tuple[tuple[str, int], ...]
    """(schedule, virtual stages) of each configuration of a group."""

    def config(self, group: int, schedule: int) -> Config:
        alg, ep, zero, shard, offload = self.rest[group]
        name, v = self.schedules[schedule]
        return Config(self.tp, self.sequence_parallel, self.pp, self.dp, self.micro_batch_size, self.num_microbatches,
                      name, v, zero, ep, shard, offload, self.cp, self.expert_tp, cp_algorithm=alg)

    def settings(self, group: int) -> GroupSettings:
        """What a group's configurations share beyond their table (planner/solver/bounds.py)."""
        _, ep, zero, shard, offload = self.rest[group]
        return GroupSettings(zero, self.dp, shard, offload, self.pp, self.tp, ep, self.sequence_parallel)

    @property
    def key(self) -> tuple:
        """What tells the blocks of a search apart: (tp, sp, pp, dp, micro-batch, cp)."""
        return self.tp, self.sequence_parallel, self.pp, self.dp, self.micro_batch_size, self.cp

    def table_key(self, group: int) -> tuple:
        """`UnitCosts.table`'s arguments for a group: (tp, sp, micro-batch, ep, cp, CP algorithm)."""
        alg, ep = self.rest[group][:2]
        return self.tp, self.sequence_parallel, self.micro_batch_size, ep, self.cp, alg


def candidate_configs(pins: Pins, cluster: Cluster, global_batch_size: int, num_units: int, profiled_mbs: list[int],
                      tp_degrees: set[int] | None = None, experts: AbstractSet[int] = frozenset(), allow_offload: bool = False,
                      states_fit=None, sequence_length: int | None = None, allow_async: bool = False):
    """Configurations the pins allow, a list per block and schedule (`candidate_blocks`, whose
    arguments these are)."""
    for block in candidate_blocks(pins, cluster, global_batch_size, num_units, profiled_mbs, tp_degrees, experts,
                                  allow_offload, states_fit, sequence_length, allow_async):
        for schedule in range(len(block.schedules)):
            yield [block.config(group, schedule) for group in range(len(block.rest))]


def candidate_blocks(pins: Pins, cluster: Cluster, global_batch_size: int, num_units: int, profiled_mbs: list[int],
                     tp_degrees: set[int] | None = None, experts: AbstractSet[int] = frozenset(),
                     allow_offload: bool = False, states_fit=None, sequence_length: int | None = None,
                     allow_async: bool = False):
    """The configurations the pins allow, as `ConfigBlock`s (`allow_async`: the asynchronous pipedream-2bw schedule too); `num_units` bounds the pipeline chunks, `tp_degrees` are the
    TP degrees the model can honour (None: any), `experts` the MoE layers' numbers of experts,
    `states_fit(zero, pp, tp, shard) -> bool` whether the model states fit a GPU (hybrid sharding),
    `sequence_length` the tokens per sample (context parallelism splits them; None: no CP)."""
    n, gpn = cluster.world_size, cluster.gpus_per_node
    for tp in [pins.tp] if pins.tp else [t for t in _divisors(min(n, gpn)) if tp_degrees is None or t in tp_degrees]:
        for pp in [pins.pp] if pins.pp else [p for p in _divisors(n // tp) if p <= num_units]:
            dp = n // (tp * pp)
            if (n % (tp * pp)) or (pins.dp and pins.dp != dp):
                continue
            yield from _batch_variants(pins, global_batch_size, num_units, profiled_mbs, experts, allow_offload,
                                       states_fit, sequence_length, tp, pp, dp, gpn, allow_async)


def _cp_sequence_length(profile: Profile) -> int | None:
    """The tokens per sample context parallelism may split: None (no CP in the search) for a
    model with CP obstacles or attention without SDPA (`cp_refusal`)."""
    info = profile.model
    return None if info.cp_obstacles or info.attention_calls == 0 else info.sequence_length


def _cp_degrees(pins: Pins, sequence_length: int | None, dp: int, pp: int, experts: AbstractSet[int]) -> list[int]:
    """Context-parallel degrees to try: 1, and (not with experts, which fold onto dp too) the powers
    of two dividing dp that split the sequence (cp_refusal); with pipelines, under the schedules
    the runtime runs CP with (`_batch_variants`, planner/cost/cp.py `CP_PIPELINE_SCHEDULES`)
    where the schedule or the virtual stages are pinned, else under gpipe and 1F1B: searching
    interleaving and zero bubble with CP too grew GPT-3 175B on 1024 GPUs from 24K configurations
    to 287K and its solve from 1.7 to 2.5 s, for the same plan (2026-11-30)."""
    if pins.cp:
        return [pins.cp] if dp % pins.cp == 0 else []
    if experts or (pins.ep or 1) > 1:
        return [1]
    return cp_degrees(sequence_length, dp)


def _batch_variants(pins: Pins, global_batch_size: int, num_units: int, profiled_mbs: list[int], experts, allow_offload,
                    states_fit, sequence_length, tp: int, pp: int, dp: int, gpn: int, allow_async: bool = False):
    """The `ConfigBlock`s of one (tp, pp, dp): one per cp, micro-batch and sp."""
    for cp in _cp_degrees(pins, sequence_length, dp, pp, experts):
            replicas = dp // cp  # a CP group shares its samples
            if global_batch_size % replicas:
                continue
            local = global_batch_size // replicas
            sizes = [pins.micro_batch_size] if pins.micro_batch_size else [
                b for b in _divisors(local) if ((b & (b - 1)) == 0 or b in profiled_mbs) and b <= MAX_MICRO_BATCH
            ]
            for b in sizes:
                if local % b:
                    continue
                m = local // b
                for sp in [pins.sequence_parallel] if pins.sequence_parallel is not None else \
                        ([False, True] if tp > 1 and (pins.expert_tp or 1) == 1 else [False]):  # expert TP: no SP
                    if sp and tp == 1:
                        continue
                    # One data-parallel rank shards nothing: ZeRO only to offload (FSDP2 on one GPU).
                    offloading = allow_offload or bool(pins.offload)
                    zeros = [pins.zero_stage] if pins.zero_stage is not None else \
                        ([0] if (pins.expert_tp or 1) > 1 else  # the runtime runs expert TP with ZeRO 0 only
                         [0, 1, 2, 3] if dp > 1 else [0, 3] if offloading else [0])
                    zeros = [z for z in zeros if pp == 1 or z <= PIPELINE_ZERO]  # (`PIPELINE_ZERO`)
                    # What the schedule does not change, enumerated once for all of them.
                    rest = [(alg, ep, z, shard, offload)
                            for alg in (CP_METHODS[:1] if cp == 1 else [pins.cp_algorithm] if pins.cp_algorithm
                                        else CP_METHODS)  # searched: the cheaper wins
                            for ep in (ep_degrees(pins, experts, dp, sp, tp) if cp == 1 else [1]) for z in zeros
                            for shard in _shard_degrees(pins, z, dp, tp, gpn, ep, None if states_fit is None else
                                                        functools.partial(states_fit, z, pp, tp))
                            for offload in _offloads(pins, z, dp, ep, allow_offload)]
                    # runtime/apply_cp.py `check_cp`: CP with PP under the schedules it was checked with,
                    # searched with gpipe and 1F1B only unless the schedule is pinned (`_cp_degrees`)
                    pinned = pins.schedule is not None or pins.virtual_stages is not None
                    with_cp = CP_PIPELINE_SCHEDULES if pinned else ("gpipe", "1f1b")
                    schedules = tuple((schedule, v) for schedule, v in _schedules(pins, pp, m, num_units, allow_async)
                                      if not (cp > 1 and pp > 1 and schedule not in with_cp))
                    if schedules and rest:
                        yield ConfigBlock(tp, sp, pp, dp, b, m, cp, pins.expert_tp or 1, tuple(rest), schedules)


def _schedules(pins: Pins, pp: int, m: int, num_units: int, allow_async: bool = False):
    """(schedule, virtual stages) pairs for pp ranks and m micro-batches: every v with pp x v
    chunks of at least one unit each (interleaved 1F1B: v > 1 and m % pp == 0, Megatron's rule).
    The asynchronous pipedream-2bw only with `allow_async` (it changes the optimisation: planner/plan.py
    `Schedule`); without a pipeline it gains nothing, so it is tried there only when pinned.
    The bounds (planner/solver/bounds.py) discard the hopeless ones before the DP."""
    if pp == 1:
        if pins.schedule in (None, "1f1b", "gpipe", "pipedream-2bw"):
            yield (pins.schedule or "1f1b"), 1
        return
    # GPipe runs as fast as 1F1B in this model and holds more activations: searched only when pinned.
    names = [pins.schedule] if pins.schedule else ["1f1b", "interleaved-1f1b", "zero-bubble"] + \
        (["pipedream-2bw"] if allow_async else [])
    most = num_units // pp
    for name in names:
        if not torch_builds(name, pp, m):
            continue
        if name == "interleaved-1f1b":
            choices = [pins.virtual_stages] if pins.virtual_stages else range(2, most + 1)
            for v in choices:
                if v > 1 and pp * v <= num_units and m % pp == 0:
                    yield name, v
        elif name == "zero-bubble":
            for v in [pins.virtual_stages] if pins.virtual_stages else range(1, most + 1):
                if pp * v <= num_units:
                    yield name, v
        else:
            yield name, 1


def torch_builds(schedule: str, pp: int, num_microbatches: int) -> bool:
    """Whether torch.distributed.pipelining (which the runtime runs) accepts this many micro-batches:
    1F1B (and pipedream-2bw, run as 1F1B batches: runtime/pp_async.py) needs at least one per
    stage; the looped schedules split them into rounds of pp (`max(1, m // pp)` rounds, which must divide m)."""
    if schedule in ("1f1b", "pipedream-2bw"):
        return num_microbatches >= pp
    if schedule in ("interleaved-1f1b", "zero-bubble"):
        return num_microbatches % max(1, num_microbatches // pp) == 0
    return True


def _cut_allowed(profile: Profile) -> tuple[bool, ...] | None:
    """Where a stage may end, from the runs of units the profile says no cut may split."""
    index = {u.name: u.index for u in profile.units}
    runs = [[index[a], index[b]] for a, b in profile.model.unsplit_units if a in index and b in index]
    return tuple(allowed_cuts(len(profile.units), runs).tolist()) if runs else None


def stack_precision(profile: Profile, dtype: str, pins: Pins) -> Precision:
    """How the stack priced holds and moves the model (`Pins.param_dtype`, `grad_dtype`,
    `reduce_dtype`). Unpinned, as the planner's runtime: a 16-bit run under autocast keeps fp32
    parameters, so its gradients, their reduction and ZeRO's gathers are fp32 too (also for a
    float32 profile solved with a 16-bit --dtype, which the runtime trains so); a profile that
    computes in 16 bits end to end (precision pure) is priced as a converted model."""
    runtime_fp32 = dtype != "float32" and profile.computes_as() != "pure"
    param = pins.param_dtype or ("float32" if runtime_fp32 else dtype)
    return Precision.of(dtype, param, pins.grad_dtype, pins.reduce_dtype)


def _environment(cluster: Cluster, compute: ComputeModel, dtype: str, pins: Pins, memory_fraction: float) -> Environment:
    coll = CollectiveModel(cluster)
    place = lru_cache(maxsize=None)(lambda dp, tp: group_placement(cluster, dp, tp))  # DP ranks are tp apart
    # Identical units ask the same questions thousands of times in one search: memoise.
    cached = lambda fn: lru_cache(maxsize=None)(fn)  # noqa: E731
    return Environment(
        usable_memory_bytes=cluster.gpu.memory_bytes * memory_fraction,
        dtype=dtype,
        dtype_bytes=DTYPE_BYTES[dtype],
        allowed_recompute=(pins.recompute,) if pins.recompute else (pins.recompute_modes or RECOMPUTE),
        dp_all_reduce_s=cached(lambda nbytes, dp, tp: coll.all_reduce_s(nbytes, place(dp, tp))),
        dp_reduce_scatter_s=cached(lambda nbytes, dp, tp: coll.reduce_scatter_s(nbytes, place(dp, tp))),
        dp_all_gather_s=cached(lambda nbytes, dp, tp: coll.all_gather_s(nbytes, place(dp, tp))),
        p2p_s=cached(lambda nbytes, same_node: coll.p2p_s(nbytes, same_node)),
        tp_all_gather_s=cached(lambda nbytes, tp: coll.all_gather_s(nbytes, group_placement(cluster, tp, 1))),
        gpus_per_node=cluster.gpus_per_node,
        optimizer_s_per_param=compute.optimizer_s_per_param(),
        pipeline_overhead_s=cluster.pipeline_overhead_s,
        # A tied weight's copies: one rank per pipeline rank holding one, dp x tp ranks apart (pp is outermost).
        tie_all_reduce_s=cached(lambda nbytes, pp_ranks, stride: coll.all_reduce_s(
            nbytes, Group(len(pp_ranks), len({(r * stride) // cluster.gpus_per_node for r in pp_ranks})))),
        overlap=pins.overlap or (SERIAL if cluster.gpu.name == "cpu" else Overlap()),  # `Pins.overlap`
        loss_kernel=pins.loss_kernel,
        loss_parallel=pins.loss_parallel,
        fused_optimizer=pins.fused_optimizer,
        pipeline_buffers=pins.pipeline_buffers,
        dp_collectives=pins.dp_collectives,
        gather_copy_out=pins.gather_copy_out,
        zero3_live=pins.zero3_live,
        grad_accumulation=pins.grad_accumulation,
        stack_precision=stack_precision(compute.profile, dtype, pins),
        copy_s_per_byte=compute.slowdown / compute.gpu.achievable_bandwidth,
        device="cpu" if cluster.gpu.name == "cpu" else "gpu",
    )


@dataclass
class SearchResult:
    ranked: list[Evaluation]
    """Feasible evaluations, fastest first."""
    evaluated: int
    """Configurations priced (DP runs)."""
    pruned: int
    """Configurations rejected by the memory lower bound before the DP."""
    min_memory_bytes: float
    """Smallest per-GPU memory any configuration needed (when none fits)."""
    solve_time_s: float
    costs: UnitCosts
    """Per-unit cost tables (and TP plans) the evaluations were priced with."""
    candidates: int = 0
    """Configurations the pins allow."""
    pruned_by_time: int = 0
    """Configurations skipped because their time lower bound could not enter the top k."""
    phase_times_s: dict[str, float] = field(default_factory=dict)
    """Seconds per phase of the search: `intra_op` (TP ILPs and per-unit cost tables), `bounds`,
    `inter_op` (the DPs over stage cuts and the pricing of their cuts). A split search's parts
    run their phases side by side: each is the longest any part took."""
    memory_fraction: float = MEMORY_FRACTION
    """Share of each GPU's memory the tensors may fill; the rest is the fragmentation allowance."""
    refusals: list[str] = field(default_factory=list)
    """Why configurations the pins allow were left out before any bound (a layout the runtime cannot run)."""
    processes: int = 1
    """Processes the search ran on (`split_blocks`)."""


def _fold_refusal(table: UnitCostTable, block: ConfigBlock, entry: int, names: list[str],
                  unsharded: dict[int, int | None]) -> str | None:
    """Why EP folded over the TP ranks (planner/solver/search.py `Config.ep_folded`) cannot run on
    `table`: sequence parallelism gives each TP rank its own tokens only in the units whose tp plan
    shards something, and a unit holding experts that the intra-op solution leaves replicated
    (OLMoE's, whose q_norm over all of q's features keeps its attention, and so its unit,
    replicated under SP) would dispatch the same tokens from every TP rank; the runtime refuses it
    (runtime/apply_ep.py `apply_moe_sequence_parallel`). None: it can, or EP does not fold.
    `unsharded` keeps, per table (its id: the search holds the tables), the first such unit."""
    ep = block.rest[entry][1]
    if not (ep > 1 and block.sequence_parallel and block.tp > 1) or table.expert_parameters is None:
        return None
    if id(table) not in unsharded:
        experts = table.expert_parameters
        unsharded[id(table)] = next((u for u, plan in enumerate(table.tp_plans)
                                     if experts[u] > 0 and all(style == "replicate" for style in plan.values())), None)
    unit = unsharded[id(table)]
    if unit is None:
        return None
    return (f"expert parallelism over the TP ranks (ep {ep} with tp {block.tp} and sequence parallelism) needs every "
            f"unit holding experts tensor-parallel, and the intra-op solution keeps {names[unit]} replicated")


class _Fitting:
    """The configurations of `blocks` that pass the memory bound (`TimeBound.memory_bytes`, once
    per group: a block's entry of `rest`, whose schedules do not change it), in the order
    `candidate_configs` lists them (block by block, schedule by schedule, group by group). Each is
    held as (group, schedule) indices; a Config is made only for those the search refines or
    prices (`pairs`), not for the tens of thousands the weak bound orders (`weak_bounds`)."""

    def __init__(self, blocks: list[ConfigBlock], tables: dict, bound: TimeBound, usable_bytes: float,
                 unit_names: list[str]):
        self.bound = bound
        self.candidates = self.pruned = 0
        self.least_memory_bytes = math.inf
        self.refusals: dict[str, None] = {}  # why groups were left out before any bound (`_fold_refusal`), in order
        self._unsharded: dict[int, int | None] = {}  # `_fold_refusal`'s per table
        self.groups: list[tuple[ConfigBlock, int, UnitCostTable]] = []  # (block, its entry of `rest`, cost table)
        self._weak: list[tuple[UnitCostTable, GroupSettings, Callable[[], Config]]] = []  # per group: what `weak_many` reads
        group_ids: list = []
        schedule_ids: list = []
        variant_ids: list = []
        variants: list[tuple[float, ...]] = []
        for block in blocks:
            kept = []
            for entry in range(len(block.rest)):
                table = tables[block.table_key(entry)]
                refused = _fold_refusal(table, block, entry, unit_names, self._unsharded)
                if refused is not None:  # no plan of the group can run
                    self.refusals.setdefault(refused, None)
                    continue
                settings, config = block.settings(entry), functools.partial(block.config, entry, 0)
                memory = bound.states_bytes(table, settings, config) / block.pp
                if memory > usable_bytes:
                    self.pruned += len(block.schedules)
                    self.least_memory_bytes = min(self.least_memory_bytes, memory)
                else:
                    kept.append(len(self.groups))
                    self.groups.append((block, entry, table))
                    self._weak.append((table, settings, config))
            self.candidates += len(block.rest) * len(block.schedules)
            if kept:
                count = len(block.schedules)
                group_ids.append(np.tile(kept, count))
                schedule_ids.append(np.repeat(np.arange(count), len(kept)))
                variant_ids.append(np.repeat(np.arange(len(variants), len(variants) + count), len(kept)))
                variants += [schedule_columns(name, block.pp, block.num_microbatches, v) for name, v in block.schedules]

        def joined(parts: list) -> np.ndarray:
            return np.concatenate(parts) if parts else np.zeros(0, dtype=int)

        self.group, self.schedule, self.variant = joined(group_ids), joined(schedule_ids), joined(variant_ids)
        """Per configuration: its group, its schedule's index in the block, its row of `variants`."""
        self.variants = np.array(variants, dtype=float).reshape(-1, SCHEDULE_COLUMNS)
        """`schedule_columns` of each block's schedules."""

    def __len__(self) -> int:
        return len(self.group)

    def pairs(self, indices) -> list[tuple[UnitCostTable, Config]]:
        """(cost table, Config) of the configurations at `indices`."""
        out = []
        for index in indices:
            block, entry, table = self.groups[self.group[index]]
            out.append((table, block.config(entry, int(self.schedule[index]))))
        return out

    def request(self, index: int) -> tuple[tuple, Config]:
        """What another process prices configuration `index` from: its table's key and its Config."""
        block, entry, _ = self.groups[self.group[index]]
        return block.table_key(entry), block.config(entry, int(self.schedule[index]))

    def weak_bounds(self, gpus_per_node: int) -> np.ndarray:
        """`TimeBound.many(whole=False)` of every configuration, scaled for pipedream-2bw
        (`async_time_bounds`)."""
        weak = self.bound.weak_many(self._weak, self.group, self.variants[self.variant])
        asynchronous = [i for i, (block, entry, table) in enumerate(self.groups)
                        if any(name == "pipedream-2bw" for name, _ in block.schedules)]
        if asynchronous:
            indices = np.flatnonzero(np.isin(self.group, asynchronous))
            pairs = self.pairs(indices)
            weak[indices] = async_time_bounds(weak[indices], [cfg for _, cfg in pairs], gpus_per_node)
        return weak


def search(profile: Profile, cluster: Cluster, global_batch_size: int, pins: Pins = Pins(), dtype: str | None = None,
           memory_fraction: float = MEMORY_FRACTION, keep: int = 3, cuts: Cuts | None = None,
           moe_imbalance: float = 1.0, float8: bool = False, allow_offload: bool = False,
           allow_async: bool = False, workers: int = 1) -> SearchResult:
    """Price the configurations the pins allow; `cuts` replaces the DP by a stack's own split
    (`even_block_cuts`: baselines, and published runs priced as their stack ran them);
    `workers` processes search them: the blocks split among them (`split_blocks`, each part's
    bounds and pricing in its own forked process, one cap for all: planner/solver/pricing.py
    `run_split`), or, for a search too small to split, the pricing alone on that many
    (`price_in_order`); either way the same top k.

    Branch and bound: configurations whose model states alone overflow memory are pruned
    (`memory_lower_bound`, once per setting it reads: `TimeBound.memory_bytes`); the rest are
    priced in order of a lower bound on their iteration time (`TimeBound.many`,
    planner/solver/bounds.py: all configurations in one numpy pass) until that bound reaches
    the k-th best time found. Both bounds are exact, so the top k are those of pricing every
    configuration (up to the DP's own cap, `evaluate_config`'s `time_cap_s`, and its
    bottleneck bound, `_bottleneck_bound_s`). `moe_imbalance` is the MoE
    routing's busiest-rank load over the balanced one (planner/cost/moe.py); `float8` runs the
    linears in FP8 (planner/cost/fp8.py), a choice of numerics the user makes, not searched;
    `allow_offload` lets the search keep model states in host memory (`Pins.offload`);
    `allow_async` adds the asynchronous pipedream-2bw schedule (planner/plan.py `Schedule`), which
    a pin may name only with it (`check_async_pin`)."""
    if not moe_imbalance >= 1.0:
        raise PlannerError(f"--moe-imbalance must be at least 1.0 (got {moe_imbalance}): it is the busiest EP rank's "
                           "share of tokens over the balanced share.", "Pass 1.0 for balanced routing, or e.g. 1.2.")
    started = time.perf_counter()
    dtype = dtype or profile.dtype
    if float8:
        check_float8(cluster, dtype)
    check_async_pin(pins, allow_async)
    check_pins(pins, cluster, global_batch_size, len(profile.units))
    check_model_pins(pins, profile)
    compute = ComputeModel(profile, cluster.gpu, dtype, slowdown=cluster.compute_slowdown)
    coll = CollectiveModel(cluster)
    # Every TP degree shards: each unit shards a weight where it can, even where the collectives
    # cost more than the compute they split (then dp or pp wins), as `planner price` prices it.
    costs = UnitCosts(profile, compute, lambda t: coll.for_group(group_placement(cluster, t, 1)), dtype,
                      ep_all_to_all_s=ep_all_to_all(cluster, coll), cp_collectives=cp_collectives(cluster, coll),
                      imbalance=moe_imbalance, float8=float8, expert_tp=pins.expert_tp or 1,
                      float8_tp_gather=pins.float8_tp_gather, float8_shared_casts=pins.float8_shared_casts)
    tp_degrees = {t for t in _divisors(cluster.world_size) if tp_refusal(profile, t) is None}
    if pins.pp is None and pp_refusal(profile):  # the search offers such a model no pipeline
        pins = dataclasses.replace(pins, pp=1)
    env = dataclasses.replace(_environment(cluster, compute, dtype, pins, memory_fraction), cut_allowed=_cut_allowed(profile))
    blocks = list(candidate_blocks(pins, cluster, global_batch_size, len(profile.units), profile.micro_batch_sizes,
                                   tp_degrees, expert_counts(profile), allow_offload,
                                   _states_fit(profile, dtype, env.usable_memory_bytes), _cp_sequence_length(profile),
                                   allow_async))
    parts = split_blocks(blocks, workers) if workers > 1 and can_fork() else [blocks]
    if len(parts) > 1:
        top: Top = SharedTopK(keep)
        helpers = Helpers(len(parts))
        try:
            outcomes = run_split(lambda index: _search_blocks(parts[index], costs, env, top, cuts, 1, profile.unit_names(),
                                                              helpers, index), len(parts))
        finally:
            helpers.close()
    else:
        outcomes = [_search_blocks(blocks, costs, env, TopK(keep), cuts, workers, profile.unit_names())]
    ranked = [e for outcome in outcomes for e in outcome.ranked]
    evaluated = sum(outcome.evaluated for outcome in outcomes)
    phases = {name: max(outcome.phases[name] for outcome in outcomes) for name in outcomes[0].phases}
    log.debug("search: %d configurations in %d parts, %d pruned by memory, %d priced; phases %s",
              sum(o.candidates for o in outcomes), len(outcomes), sum(o.pruned for o in outcomes), evaluated,
              {k: round(v, 3) for k, v in phases.items()})
    # A flushed pipedream-2bw ties with 1F1B on the same layout (priced as it: `flush_blocker`) and
    # holds more memory and stale weights: the synchronous one goes first. Other exact ties go in
    # the order the configurations are enumerated (`candidate_blocks`: smaller tp, pp and cp
    # first), whichever part of a split search priced them.
    ranked.sort(key=functools.partial(_rank_key, {block.key: (n, block) for n, block in enumerate(blocks)}))
    return SearchResult(ranked, evaluated, sum(o.pruned for o in outcomes), min(o.least_memory_bytes for o in outcomes),
                        time.perf_counter() - started, costs, candidates=sum(o.candidates for o in outcomes),
                        pruned_by_time=sum(o.considered for o in outcomes) - evaluated, phase_times_s=phases,
                        memory_fraction=memory_fraction,
                        refusals=list(dict.fromkeys(r for o in outcomes for r in o.refusals)), processes=len(outcomes))


@dataclass
class _Outcome:
    """What `_search_blocks` found in its blocks (a part of a split search: `split_blocks`)."""

    ranked: list[Evaluation]
    """Feasible evaluations, in the order priced."""
    evaluated: int
    considered: int
    """Configurations past the memory bound (priced or pruned by time)."""
    candidates: int
    pruned: int
    least_memory_bytes: float
    """Least memory of the infeasible ones priced and of those the memory bound pruned."""
    refusals: list[str]
    phases: dict[str, float]


def _search_blocks(blocks: list[ConfigBlock], costs: UnitCosts, env: Environment, top: Top, cuts: Cuts | None,
                   workers: int, unit_names: list[str], helpers: Helpers | None = None, part: int = 0) -> _Outcome:
    """`search`'s branch and bound over `blocks`: their cost tables, the memory bound, the weak
    and whole time bounds, and the pricing in bound order until the cap `top` holds. In a split
    search (part `part` of several) the cap is shared, and the configurations priced are shared
    out with the parts done before this one (`helpers`); once done, this part serves the others."""
    phases = dict.fromkeys(("intra_op", "bounds", "inter_op"), 0.0)
    tick = time.perf_counter()
    tables = {}
    for block in blocks:
        for group in range(len(block.rest)):
            key = block.table_key(group)
            if key not in tables:
                tables[key] = costs.table(*key)
    phases["intra_op"] = time.perf_counter() - tick
    tick = time.perf_counter()
    bound = TimeBound(env)
    fitting = _Fitting(blocks, tables, bound, env.usable_memory_bytes, unit_names)
    weak = fitting.weak_bounds(env.gpus_per_node)

    def whole(indices: list[int]) -> np.ndarray:
        pairs = fitting.pairs(indices)
        # B* and z* only where the rest of the bound is below the k-th best time so far: elsewhere
        # the configuration is out whatever they add (the cap only falls).
        return async_time_bounds(bound.many(pairs, cap=top.cap), [cfg for _, cfg in pairs], env.gpus_per_node)

    phases["bounds"] = time.perf_counter() - tick
    tick = time.perf_counter()

    def price(index: int, cap: float) -> Evaluation:
        return _price_config(*fitting.pairs([index])[0], env, cuts, cap)

    def served(request: tuple[tuple, Config], cap: float) -> Evaluation:
        """Another part's configuration, its table from its key (built here if not yet)."""
        key, cfg = request
        return _price_config(costs.table(*key), cfg, env, cuts, cap)

    # Ordered by the weaker bound computed for all (once per cost table: bounds.py `many(whole=False)`),
    # refined to the whole bound for those the pricing reaches (`refined_order`), in ascending
    # order of that until the k-th best time is below the next (planner/solver/pricing.py). The
    # scout prices the best refined ones early, so the batches refined before their turn know a cap.
    if helpers is not None:
        helpers.part = part
    scout = Scout(price, top)
    ranked, evaluated, unfit = price_in_order(price, refined_order(weak, whole, scout=scout, cap=lambda: top.cap),
                                              len(fitting), top.keep, workers, top, scout, helpers, fitting.request)
    phases["inter_op"] = time.perf_counter() - tick
    if helpers is not None:
        helpers.serve(served, top)
    return _Outcome(ranked, evaluated, len(fitting), fitting.candidates, fitting.pruned,
                    min(unfit, fitting.least_memory_bytes), list(fitting.refusals), phases)


def _price_config(table: UnitCostTable, cfg: Config, env: Environment, cuts: Cuts | None, cap: float) -> Evaluation:
    """`evaluate_config` with the DP's cuts, or a stack's own (`cuts`) where it can split so."""
    bounds = None if cuts is None else cuts(cfg.pp * cfg.virtual_stages)
    if cuts is not None and bounds is None:
        return Evaluation(cfg, False, f"the stack cannot split the model into {cfg.pp * cfg.virtual_stages} stages")
    return evaluate_config(table, cfg, env, bounds, time_cap_s=cap)


def _rank_key(blocks: dict[tuple, tuple[int, ConfigBlock]], evaluation: Evaluation) -> tuple:
    """How `search` ranks an evaluation: its time, the synchronous schedule before a flushed
    pipedream-2bw, then the order of enumeration (`blocks`: each block's position and itself by
    its key; then its schedule, then its group)."""
    cfg = evaluation.config
    at, block = blocks[(cfg.tp, cfg.sequence_parallel, cfg.pp, cfg.dp, cfg.micro_batch_size, cfg.cp)]
    return (evaluation.iteration_time_s, evaluation.flushed_by is not None, at,
            block.schedules.index((cfg.schedule, cfg.virtual_stages)),
            block.rest.index((cfg.cp_algorithm, cfg.ep, cfg.zero_stage, cfg.shard_degree, cfg.offload)))


def split_blocks(blocks: list[ConfigBlock], parts: int) -> list[list[ConfigBlock]]:
    """`blocks` dealt to at most `parts` processes for a split search (issue #17: the machine has
    two cores; planner/solver/pricing.py `run_split`), or one part when there are too few
    configurations to pay for a fork (`SPLIT_MIN`). The blocks of one TP degree, sequence
    parallelism and micro-batch size go to the same part (they share cost tables: each part
    builds its own), those families largest first to the part with the fewest configurations
    so far. Deterministic: the same blocks give the same parts."""
    families: dict[tuple, list[ConfigBlock]] = {}
    for block in blocks:
        families.setdefault((block.tp, block.sequence_parallel, block.micro_batch_size), []).append(block)
    size = lambda family: sum(len(b.rest) * len(b.schedules) for b in family)  # noqa: E731
    if size(blocks) < SPLIT_MIN or len(families) < 2:
        return [blocks]
    dealt: list[list[ConfigBlock]] = [[] for _ in range(min(parts, len(families)))]
    for family in sorted(families.values(), key=size, reverse=True):
        min(dealt, key=size).extend(family)
    return dealt


def check_float8(cluster: Cluster, dtype: str) -> None:
    """Refuse FP8 where it cannot run: a GPU without FP8 tensor cores, or a dtype other than bf16."""
    if not cluster.gpu.supports_fp8:
        raise PlannerError(f"--fp8: {cluster.gpu.name} has no FP8 tensor cores (H100 and H200 do).",
                           "Drop --fp8, or plan for an FP8 GPU (--gpu h100-80gb or h200).")
    if dtype != "bfloat16":
        raise PlannerError(f"--fp8 needs bfloat16 training (FP8 linears run inside bf16 mixed precision); the dtype is {dtype}.",
                           "Pass --dtype bfloat16, or profile with --dtype bfloat16.")


def price_config(profile: Profile, cluster: Cluster, cfg: Config, pins: Pins = Pins(), dtype: str | None = None,
                 memory_fraction: float = MEMORY_FRACTION, moe_imbalance: float = 1.0, float8: bool = False) -> Evaluation:
    """One configuration priced exactly as the search prices it (the DP chooses its cuts), including
    layouts the search does not enumerate because the runtime does not run them: for benchmarks
    against published runs."""
    dtype = dtype or profile.dtype
    compute = ComputeModel(profile, cluster.gpu, dtype, slowdown=cluster.compute_slowdown)
    coll = CollectiveModel(cluster)
    costs = UnitCosts(profile, compute, lambda t: coll.for_group(group_placement(cluster, t, 1)), dtype,
                      ep_all_to_all_s=ep_all_to_all(cluster, coll), cp_collectives=cp_collectives(cluster, coll), imbalance=moe_imbalance,
                      float8=float8, expert_tp=cfg.expert_tp, float8_tp_gather=pins.float8_tp_gather,
                      float8_shared_casts=pins.float8_shared_casts)
    env = dataclasses.replace(_environment(cluster, compute, dtype, pins, memory_fraction), cut_allowed=_cut_allowed(profile))
    return evaluate_config(costs.table(cfg.tp, cfg.sequence_parallel, cfg.micro_batch_size, cfg.ep, cfg.cp, cfg.cp_algorithm),
                           cfg, env)


def _states_fit(profile: Profile, dtype: str, usable_bytes: float):
    """(zero, pp, tp, shard) -> whether the whole model's states over pp x tp, ZeRO-sharded over
    `shard` ranks, fit a GPU's usable memory (a necessary condition, as the memory bound's: the
    dtype's default `Precision` holds the least any stack's does, at every ZeRO stage)."""
    @lru_cache(maxsize=None)
    def fit(zero_stage: int, pp: int, tp: int, shard: int) -> bool:
        states = model_state_bytes(profile.model.num_parameters / (pp * tp), dtype, zero_stage, shard).total
        return states <= usable_bytes
    return fit


def cp_collectives(cluster: Cluster, coll: CollectiveModel):
    """(cp, tp) -> CpCollectives of a CP group: cp data-parallel ranks, tp apart; a ring step's
    slowest hop crosses nodes when the group does."""
    @lru_cache(maxsize=None)
    def of(cp: int, tp: int) -> CpCollectives:
        group = group_placement(cluster, cp, tp)
        return CpCollectives(lru_cache(maxsize=None)(lambda n: coll.all_gather_s(n, group)),
                             lru_cache(maxsize=None)(lambda n: coll.reduce_scatter_s(n, group)),
                             lru_cache(maxsize=None)(lambda n: coll.p2p_s(n, same_node=group.num_nodes == 1)))
    return of


def ep_all_to_all(cluster: Cluster, coll: CollectiveModel):
    """(bytes one rank sends, ep, tp, folded) -> seconds of one EP all-to-all. The group is ep
    data-parallel ranks tp apart, or ep consecutive ranks when folded over the TP ranks."""
    @lru_cache(maxsize=None)
    def seconds(nbytes: float, ep: int, tp: int, folded: bool) -> float:
        return coll.all_to_all_s(ep * nbytes, group_placement(cluster, ep, 1 if folded else tp))
    return seconds


Cuts = Callable[[int], tuple | None]
"""A stack's stage split: chunks -> ((start, end) unit range per chunk), None where it cannot split so."""


def even_block_cuts(profile: Profile) -> Cuts:
    """Megatron-LM's split: every chunk the same number of the repeated blocks (--num-layers
    divisible by pp x v, megatron/core/transformer/transformer_block.py), the units before them
    (the embedding) with the first chunk, those after (final norm, output layer) with the last
    (planner/engines/common.py `stage_bounds`, kind "even")."""
    from planner.engines.common import block_bounds, even_blocks, model_parts

    names = profile.unit_names()
    _, blocks, _ = model_parts(names)

    def cuts(chunks: int) -> tuple | None:
        counts = even_blocks(len(blocks), chunks)
        return None if counts is None or 0 in counts else block_bounds(names, counts)
    return cuts


def solve(profile: Profile, cluster: Cluster, global_batch_size: int, pins: Pins = Pins(), top_k: int = 3,
          dtype: str | None = None, profile_path: str | None = None, memory_fraction: float = MEMORY_FRACTION,
          cuts: Cuts | None = None, moe_imbalance: float = 1.0, float8: bool = False, allow_offload: bool = False,
          allow_async: bool = False, allow_replication: bool = False, workers: int = 1) -> Plan:
    """The best plan, or a PlannerError that says what does not fit and by how much. `workers`:
    processes that price configurations (planner/solver/pricing.py; the CLI uses every CPU). `allow_async`:
    the asynchronous pipedream-2bw schedule is one more candidate, and the plan's notes say so.
    `allow_replication`: PipeDream's per-stage replication is priced too and wins when faster
    (planner/solver/replication_search.py `consider_replication`; the notes say which won)."""
    if global_batch_size < 1:
        raise PlannerError(f"--global-batch must be positive (got {global_batch_size}).", "Pass the samples per optimizer step.")
    result = search(profile, cluster, global_batch_size, pins, dtype, memory_fraction, keep=max(top_k, 1),
                    cuts=cuts, moe_imbalance=moe_imbalance, float8=float8, allow_offload=allow_offload,
                    allow_async=allow_async, workers=workers)
    usable = cluster.gpu.memory_bytes * memory_fraction
    if not result.ranked:
        if result.refusals and result.evaluated == 0 and result.pruned == 0:
            raise PlannerError(f"No configuration of {cluster.world_size} GPUs that the pins allow can run: "
                               + "; ".join(result.refusals) + ".",
                               "Relax the pins (turn sequence parallelism off, or pin a smaller --ep or --tp).")
        if result.evaluated == 0 and result.pruned == 0:
            raise PlannerError(
                f"No configuration of {cluster.world_size} GPUs matches the pins and a global batch of {global_batch_size}.",
                "Relax the pins or choose a global batch divisible by the data-parallel degree.",
            )
        raise PlannerError(
            f"The model does not fit: the smallest per-GPU memory any configuration needs is "
            f"{result.min_memory_bytes / GIB:.2f} GiB, but {cluster.gpu.name} offers {usable / GIB:.2f} GiB usable "
            f"({memory_fraction:.0%} of {cluster.gpu.memory_bytes / GIB:.1f} GiB).",
            "Use more GPUs, a GPU with more memory, allow recomputation and ZeRO (unpin --recompute/--zero)"
            + (", or let model states live in host memory (--offload)." if not allow_offload else "."),
        )
    from planner.solver.plan_builder import build_plan

    plan = build_plan(profile, cluster, global_batch_size, result, top_k, dtype or profile.dtype, profile_path)
    if allow_async and plan.search is not None:
        plan.search.notes.append(ASYNC_NOTE)
        flushed = flushed_2bw_note(result.ranked)
        if flushed:
            plan.search.notes.append(flushed)
    if allow_replication and not (pins.tp and pins.tp > 1) and not (pins.dp and pins.dp > 1):
        from planner.solver.replication_search import consider_replication

        plan = consider_replication(plan, profile, cluster, global_batch_size, dtype or profile.dtype, result.costs, pins,
                                    memory_fraction)
    if plan.search is not None and profile.computes_as() == "pure" and (dtype or profile.dtype) != "float32" \
            and cluster.gpu.name != "cpu":
        plan.search.notes.append(AUTOCAST_NOTE)
    if plan.search is not None and profile.op_checks < OP_CHECKS and not (pins.tp and pins.tp > 1):
        why = tp_refusal(profile, 2)
        if why:
            plan.search.notes.append(f"tensor parallelism: not considered: {why}")
    return plan


AUTOCAST_NOTE = ("activations: priced from a profile that computes in 16 bits end to end (precision pure), as "
                 "Megatron-LM, DeepSpeed and FSDP2's mixed precision run; this planner's runtime trains under autocast "
                 "with fp32 weights, which kept 1.25x a GPT block's activations per sample plus a 16-bit copy of its "
                 "weights on an H200 (benchmarks/results/h200/README.md). Before running this plan with `planner run`, "
                 "profile with --precision autocast (the default) and solve again.")

ASYNC_NOTE = ("asynchronous: changes the optimisation, W(t+1) = W(t) - lr grad f(W(t-1)); pipedream-2bw was a "
              "candidate (--allow-async): a plan or alternative with that schedule trains on one-step-stale "
              "weights (planner/plan.py `Schedule`), the others are synchronous")
"""The plan's `search.notes` entry when the search was allowed the asynchronous schedule."""


def flushed_2bw_note(ranked: list[Evaluation]) -> str | None:
    """One `search.notes` entry when some pipedream-2bw candidate was priced as flushed (search.py
    `flush_blocker`), naming each distinct reason once; None when none was."""
    reasons = list(dict.fromkeys(e.flushed_by for e in ranked if e.flushed_by))
    if not reasons:
        return None
    return (f"pipedream-2bw runs flushed with {'; '.join(reasons)} (runtime/pp_async.py): priced there as 1F1B, "
            "bubble included, plus the stashed weights")


def check_async_pin(pins: Pins, allow_async: bool) -> None:
    """Refuse a pinned asynchronous schedule unless the user allowed asynchrony: it changes what is
    trained, not only how fast, so it is never chosen silently."""
    if pins.schedule == "pipedream-2bw" and not allow_async:
        raise PlannerError(
            "--schedule pipedream-2bw is asynchronous: it changes the optimisation (W(t+1) = W(t) - lr grad f(W(t-1)), "
            "gradients taken at one-step-stale weights), so it is not planned without consent.",
            "Add --allow-async to plan it, or pin a synchronous schedule (1f1b, interleaved-1f1b, zero-bubble, gpipe).")


def async_time_bounds(bounds: np.ndarray, configs: list, gpus_per_node: int | None = None) -> np.ndarray:
    """`TimeBound.many` prices pipedream-2bw with 1F1B's closed form (its default form), which is
    not below 2BW's m max_k work_k. Scaled by m / (m + S - 1) it is (S = pp x v chunks): 1F1B's
    pipeline bound W (1 + (m - 1) / S) becomes m W / S, which 2BW's m max_k work_k >= m W / S
    respects, and the fill and optimizer terms only shrink, so the bound stays a lower bound.
    A 2BW the runtime runs flushed is priced as 1F1B (search.py `flush_blocker`; whether its
    activations travel as TP slices is `scatter_gather`'s, asked as `p2p_arrays` asks it) and
    keeps 1F1B's bound unscaled; `gpus_per_node` None scales every 2BW (looser, still a bound)."""
    def flush_free(cfg) -> bool:
        if cfg.schedule != "pipedream-2bw" or gpus_per_node is None:
            return cfg.schedule == "pipedream-2bw"
        return flush_blocker(cfg, scatter_gather(cfg, cfg.dp * cfg.tp < gpus_per_node)) is None

    scale = np.array([cfg.num_microbatches / (cfg.num_microbatches + cfg.pp * cfg.virtual_stages - 1)
                      if flush_free(cfg) else 1.0 for cfg in configs])
    return bounds * scale if len(configs) else bounds
