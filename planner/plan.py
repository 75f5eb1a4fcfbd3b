"""The plan file: the contract between the solver and the runtime.

A plan says how to split one model over a cluster and what that is predicted to cost. The
solver writes it; a person may write one by hand; the runtime executes it without
importing the solver. `planner schema plan` prints its JSON schema.

Rank layout. Ranks form a (pp, dp, tp) grid with tp innermost, so a tensor-parallel group
is a run of consecutive ranks and stays inside one node (NVLink), then data parallel, then
pipeline (picotron's `arange(world).view(pp, dp, tp)`):

    rank = pp_index * dp_degree * tp_degree + dp_index * tp_degree + tp_index

With `virtual_stages` v > 1 there are pp * v stages and stage s lives on pipeline rank
s % pp (the interleaved 1F1B "looping" placement of Narayanan et al. 2021, section 2.2).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from planner.errors import PlannerError

PLAN_SCHEMA_VERSION = 1

Schedule = Literal["gpipe", "1f1b", "interleaved-1f1b", "zero-bubble", "pipedream-2bw"]
"""Pipeline schedules. All but `pipedream-2bw` are synchronous: a step's gradient is taken at
the weights it updates (the pipeline flushes between steps), so they train as one process does.

`pipedream-2bw` (PipeDream-2BW, Narayanan et al. 2021, "Memory-Efficient Pipeline-Parallel DNN
Training", ICML, arXiv 2006.09503, section 3.1) is asynchronous: each stage keeps two weight
versions, a step's m micro-batches run forward and backward on the older one, and the
gradient accumulated over them updates the newer one. With W(t) the weights before step t
(t = 0, 1, ...) and W(-1) = W(0) (the first step has no older version):

    W(t+1) = W(t) - lr * grad f(W(t-1))        (AdamW: AdamW's step applied to W(t) with the
                                                gradient taken at W(t-1); its moments as usual)

The loss reported for step t is f(W(t-1)). It changes the optimisation, not only the speed:
the solver picks it only with `planner solve --allow-async`. Needs m >= pp micro-batches
(with fewer, two weight versions do not suffice: paper, section 3.1) and one chunk per rank."""
Recompute = Literal["none", "selective", "op", "full"]
"""Activation recomputation of a unit, least to most recomputed: `none`; `selective`, the
attention core (Korthikanti et al. 2022, Megatron-LM's --recompute-granularity selective);
`op`, op-level selective checkpointing as torchtitan runs it (activation_checkpoint mode
"selective", selective_ac_option "op": the outputs of attention and of every other matmul are
saved, everything else recomputed: runtime/recompute.py); `full`, the whole unit from its input."""
TPStyle = Literal["colwise", "rowwise", "sequence_parallel", "replicate"]
SCHEDULES: tuple[str, ...] = get_args(Schedule)
"""Schedule names accepted everywhere (planner/cost/schedules.py prices them)."""
RECOMPUTE: tuple[str, ...] = get_args(Recompute)
"""Recomputation modes, least to most recomputed (the order `majority_mode` and the engines' nearest mode use)."""


class _Model(BaseModel):
    model_config = ConfigDict(use_attribute_docstrings=True, extra="forbid")


class ModelRef(_Model):
    file: str
    """Model file path (relative paths are resolved against the plan file's folder, then the cwd)."""
    args: dict[str, int | float | bool | str | list | None] = {}
    """Arguments for build_model / make_batch."""
    fingerprint: str | None = None
    """Structural fingerprint; the runtime refuses a model that does not match it."""
    source_sha256: str | None = None
    """SHA-256 of the model file the profile was made from; `planner run` warns when the file has
    changed since (an edit that keeps the structure may still change the times)."""


class ClusterRef(_Model):
    name: str = "custom"
    """Preset or cluster file the plan was solved for."""
    num_nodes: int = 1
    """Nodes."""
    gpus_per_node: int
    """Devices (processes) per node."""
    gpu: str = "cpu"
    """GPU spec name (`cpu` for gloo processes)."""


class Training(_Model):
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Parameter/compute dtype; bfloat16/float16 mean mixed precision with fp32 master weights."""
    optimizer: Literal["adamw"] = "adamw"
    """Optimizer."""
    lr: float = 1e-3
    """Learning rate."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    grad_clip: float | None = None
    """Clip the global gradient norm to this value, or None."""
    offload: Literal["none", "cpu"] = "none"
    """"cpu": ZeRO-Offload (Ren et al. 2021, "ZeRO-Offload", USENIX ATC): the sharded parameters,
    gradients and optimizer state live in host memory and the optimizer step runs on the CPU;
    parameters are copied to the device for each all-gather, gradients back after each
    reduce-scatter (FSDP2 `CPUOffloadPolicy`, runtime/apply_dp.py). Needs zero_stage >= 1 (the
    FSDP path), also with dp_degree 1."""
    cpu_threads: int | None = Field(default=None, gt=0)
    """On CPU, torch threads per process; solved plans take it from the profile, whose times were
    measured with as many. None: $OMP_NUM_THREADS (`planner run` sets 1 when it is unset)."""
    float8: bool = False
    """linears in FP8 via torchao Float8 training (dynamic scaling), only with dtype bfloat16"""


class Batch(_Model):
    global_batch_size: int = Field(gt=0)
    """Samples per optimizer step, over all data-parallel replicas."""
    micro_batch_size: int = Field(gt=0)
    """Samples per micro-batch on one pipeline."""
    num_microbatches: int = Field(gt=0)
    """Micro-batches per step per data-parallel replica."""


class Layout(_Model):
    pp_degree: int = Field(1, gt=0)
    """Pipeline-parallel degree (ranks along the pipeline)."""
    dp_degree: int = Field(1, gt=0)
    """Data-parallel degree."""
    tp_degree: int = Field(1, gt=0)
    """Tensor-parallel degree."""
    ep_degree: int = Field(1, gt=0)
    """Expert-parallel degree: each MoE experts module keeps 1/ep of its experts per rank and
    tokens travel to their experts' ranks by all-to-all (runtime/apply_ep.py). EP is folded onto
    the data-parallel ranks, as Megatron-Core's parallel folding and torchtitan do: along dp, the
    expert layers' ranks form an (expert_dp, ep) grid with ep innermost, so an EP group is a run
    of ep consecutive dp indices and expert_dp = dp_degree / ep_degree ranks hold the same experts.
    Adds no ranks (world size stays pp x dp x tp); ep_degree must divide dp_degree and the number
    of experts. With sequence_parallel (tp > 1) each TP rank routes its own tokens and EP is folded
    onto the dp x tp ranks of a stage instead (tp innermost, so an EP group spans tp ranks first):
    ep_degree must divide dp_degree x tp_degree, and expert_dp = dp x tp / ep (runtime/mesh.py
    `build_ep_mesh`)."""
    expert_tp_degree: int = Field(1, gt=0)
    """Expert tensor parallelism (Megatron-Core's ETP, `--expert-tensor-parallel-size`): each expert's
    gate/up projections split by columns and its down projection by rows over the TP group, the
    experts' output summed over it (runtime/apply_ep.py, planner/cost/moe.py). 1 (experts whole on
    every TP rank, the default and all the search picks) or tp_degree (pinned: `planner solve
    --expert-tp`); not with sequence_parallel (the TP ranks must hold the same tokens). Adds no ranks."""
    cp_degree: int = Field(1, gt=0)
    """Context-parallel degree: each sequence is split over cp ranks and attention gathers the
    keys and values of the whole sequence over them (all-gather CP, Llama 3 paper, Dubey et al.
    2024, section 3.3.2; planner/cost/cp.py, runtime/apply_cp.py). Folded onto the data-parallel
    ranks like ep_degree: dp is viewed as (dp_outer, cp) with cp innermost, the cp consecutive dp
    indices of a group take the same samples, and rank j of a group holds sequence chunks j and
    2 cp - 1 - j of 2 cp (causal load balancing). Adds no ranks; must divide dp_degree, so the
    global batch is micro_batch_size x num_microbatches x dp_degree / cp_degree samples. The
    sequence must split into 2 cp chunks (checked against the model before launch)."""
    cp_algorithm: Literal["all-gather", "ring"] = "all-gather"
    """How attention reaches the other CP ranks' keys and values (planner/cost/cp.py prices both,
    the search keeps the cheaper; runtime/apply_cp.py runs both): "all-gather" gathers the whole
    sequence's K/V before attention (Llama 3, section 3.3.2); "ring" passes K/V blocks around the
    CP group, each send overlapped with the attention on the block at hand (Liu et al. 2023, "Ring
    Attention with Blockwise Transformers", arXiv 2310.01889). Only meaningful with cp_degree > 1."""
    zero_stage: Literal[0, 1, 2, 3] = 0
    """ZeRO stage: 0 replicated, 1 optimizer state, 2 + gradients, 3 + parameters sharded (FSDP)."""
    shard_degree: int | None = Field(default=None, gt=0)
    """Hybrid sharding (HSDP: Zhao et al. 2023, "PyTorch FSDP", VLDB, hybrid sharding; the idea
    behind ZeRO++'s hierarchical partitioning hpZ, Wang et al. 2023, which keeps only a
    secondary weight copy per node): with zero_stage >= 1, shard the ZeRO states over groups of this many
    consecutive data-parallel ranks and replicate them across the dp_degree / shard_degree
    groups (FSDP2 `fully_shard` on a 2D (replicate, shard) mesh, runtime/mesh.py
    `build_hsdp_mesh`): gradients reduce-scatter inside a group and all-reduce their shard
    across groups. Must divide dp_degree and be at least 2; None, or equal to dp_degree, shards
    over all dp ranks (plain ZeRO/FSDP, accepted as such). Not combined with ep_degree > 1."""
    sequence_parallel: bool = False
    """Shard norms/dropout activations along the sequence inside TP groups (Korthikanti et al. 2022)."""
    schedule: Schedule = "1f1b"
    """Pipeline schedule."""
    virtual_stages: int = Field(1, gt=0)
    """Model chunks per pipeline rank (interleaved 1F1B)."""
    p2p_scatter_gather: bool = False
    """Send pipeline activations as 1/tp slices and all-gather them inside the receiving TP group
    (Narayanan et al. 2021, section 4.1): cross-node p2p bytes divided by tp. Needs tp > 1 and no
    sequence parallelism (whose activations are already sharded), and every tensor crossing a cut
    replicated across the TP group, as the solver's TP plans leave them."""

    stage_replicas: list[int] | None = None
    """PipeDream stage replication (Narayanan et al., SOSP 2019, section 3.1): per pipeline stage
    its number of replicas r_s (>= 1, one entry per stage, pp_degree of them); the world is
    their sum, stage s on the r_s consecutive ranks after the earlier stages' (`stage_ranks`).
    Micro-batch i runs on replica i mod r_s of stage s (1F1B-RR) and a stage's replicas sum
    their gradients (runtime/pp_replicated.py): replication IS the data parallelism, so
    dp_degree and tp_degree stay 1, with zero_stage 0 and one chunk per rank (gpipe or 1f1b
    order). None: every stage on dp_degree x tp_degree ranks."""

    @property
    def world_size(self) -> int:
        if self.stage_replicas is not None:
            return sum(self.stage_replicas)
        return self.pp_degree * self.dp_degree * self.tp_degree


class Stage(_Model):
    units: list[str]
    """Unit FQNs, contiguous, in execution order."""
    ranks: list[int]
    """Global ranks holding this stage (dp_degree * tp_degree of them)."""
    recompute: Recompute = "none"
    """Activation recomputation for this stage's units (those not in `unit_recompute`)."""
    unit_recompute: dict[str, Recompute] = {}
    """Unit FQN -> its recomputation where it differs from `recompute` (the solver chooses it per
    unit: "checkpoint just enough layers to fit"); each key one of `units`. A dict of
    exceptions rather than a list per unit keeps uniform stages, and older plans, as they were."""
    tp_plan: dict[str, TPStyle] = {}
    """Module FQN (from the model root) -> tensor-parallel style."""
    tp_feeds: dict[str, list[str]] | None = None
    """Each module of `tp_plan` styled rowwise that reads column-sharded features -> the colwise
    modules they come from, by data flow (planner/solver/intra_op.py `sharded_feeds`; FQNs from
    the model root): the runtime keeps those outputs sharded and has the rowwise module read them
    so, wherever the modules sit. None (plans written before 2026-11-28, or by hand): a colwise
    and a rowwise module are paired when they share a parent, as Megatron's `attn` and `mlp` do."""
    tp_copy_outputs: list[str] = []
    """Modules of `tp_plan` styled colwise or rowwise whose output the model then writes in place
    (the profile's `output_written_in_place`): the runtime returns a copy of their local output,
    since autograd forbids writing into the view DTensor's `to_local` makes."""
    experts: dict[str, int] = {}
    """With ep_degree > 1: each MoE experts module of the stage (FQN from the model root) -> the
    experts one EP rank holds, E / ep_degree: EP rank i of a group holds experts
    [i E/ep, (i+1) E/ep), in every expert-dp replica alike (runtime/apply_ep.py)."""

    @model_validator(mode="after")
    def _known_recompute_units(self) -> "Stage":
        unknown = sorted(set(self.unit_recompute) - set(self.units))
        if unknown:
            raise ValueError(f"unit_recompute names {unknown}, which are not units of this stage ({self.units}); "
                             "list only the stage's own units")
        feeds = self.tp_feeds or {}
        mislabelled = sorted({n for n in feeds if self.tp_plan.get(n) != "rowwise"}
                             | {c for cs in feeds.values() for c in cs if self.tp_plan.get(c) != "colwise"})
        if mislabelled:
            raise ValueError(f"tp_feeds names {mislabelled}, which the stage's tp_plan does not style as the pairing "
                             "needs; list rowwise modules, each with the colwise modules it reads")
        unsharded = sorted(n for n in self.tp_copy_outputs if self.tp_plan.get(n) not in ("colwise", "rowwise"))
        if unsharded:
            raise ValueError(f"tp_copy_outputs names {unsharded}, which the stage's tp_plan does not style colwise or "
                             "rowwise; list only sharded modules")
        return self

    def unit_modes(self) -> dict[str, Recompute]:
        """Each unit's recomputation, in order: `unit_recompute` over `recompute`."""
        return {u: self.unit_recompute.get(u, self.recompute) for u in self.units}


class Prediction(_Model):
    iteration_time_s: float
    samples_per_s: float
    tokens_per_s: float | None = None
    tflops_per_gpu: float
    """Model FLOPs (no recomputation) per second per GPU, in TFLOP/s."""
    hw_tflops_per_gpu: float
    """Hardware FLOPs (with recomputation) per second per GPU, in TFLOP/s."""
    mfu: float
    """Model FLOPs utilisation against the GPU's dense peak (of the training dtype: bf16 for FP8
    plans too, torchtitan's convention)."""
    mfu_fp8: float | None = None
    """FP8 plans: FLOPs credited at the peak of the dtype they run in (FP8 linears at the FP8
    peak, the rest at bf16's), the other convention in use (planner/cost/fp8.py)."""
    bubble_fraction: float
    """Bubble seconds of the busiest pipeline rank over the whole iteration (optimizer step and
    gradient reduction included). Not what `planner validate` compares: that is the idle share
    of the pipeline's makespan, simulated from the stage times (planner/validate.py `predicted_bubble`)."""
    peak_memory_bytes: list[int]
    """Per stage: peak bytes of tensors per GPU (planner/cost/memory.py `StageMemory.tensor_bytes`).
    A rank holding several stages (interleaving) holds them together: `rank_peak_bytes`."""
    pipeline_rank_peak_bytes: list[int] | None = None
    """Per pipeline rank: the peak of the stages it holds together, each rebuilding one unit at a time
    (planner/solver/search.py `rank_memory`); the same as `peak_memory_bytes` with one stage a rank.
    None: not recorded (plans written before 2026-11-30; `rank_peak_bytes` sums the stages')."""
    memory_terms_bytes: list[dict[str, int]] | None = None
    """Per stage, the peak's terms by name in bytes (planner/cost/memory.py `StageMemory.terms`:
    parameters, gradients, optimizer_state, activations, transient, communication, loss, batch
    (absent in plans written before 2026-11-28), fragmentation);
    all but fragmentation sum to `peak_memory_bytes`. None: not recorded (older plans)."""
    stage_time_s: list[float] = []
    """Forward+backward time of one micro-batch per stage."""
    breakdown_s: dict[str, float]
    """compute, p2p (with the cluster's pipeline_overhead_s per micro-batch and stage), tp_comm,
    dp_comm, tie_comm (summing the gradients of a weight tied across stages), optimizer, bubble."""
    overlap: list[str] | None = None
    """Communication the prediction assumes hidden behind compute, by name (planner/cost/overlap.py:
    grad_reduce, param_gather, pipeline_p2p, tp_comm); the breakdown's terms are then the exposed
    parts. None: not recorded (plans predicted before overlap was modelled)."""
    state_bytes: dict[str, int] | None = None
    """Bytes per parameter element the prediction assumes (planner/cost/memory.py `Precision`):
    weights (as the forward reads and ZeRO gathers them), gradients (as held before their
    reduction), reduction (as the data-parallel reduction moves them), optimizer (fp32 master and
    Adam moments). The planner's runtime trains a 16-bit plan under autocast over fp32 parameters:
    4, 4, 4, 8. None: not recorded (older plans)."""


class Alternative(BaseModel):
    """A runner-up configuration the search priced, and why it lost to the plan (unknown keys
    are ignored on load, as in `SearchReport`)."""

    model_config = ConfigDict(use_attribute_docstrings=True, extra="ignore")

    layout: Layout
    micro_batch_size: int
    num_microbatches: int
    stage_units: list[int]
    """Units per stage, in stage order."""
    recompute: list[Recompute]
    """Recomputation per stage (the mode most of its units run)."""
    unit_recompute: list[list[Recompute]] = []
    """Per stage, each unit's recomputation in order, where some stage mixes modes (empty: every
    stage runs its `recompute` on all its units)."""
    iteration_time_s: float
    peak_memory_bytes: list[int]
    """Predicted peak per stage."""
    why_lost: str
    """How much slower, and the breakdown terms that grew the most."""


class SearchReport(BaseModel):
    """What `planner solve` did to find the plan: how many configurations it considered, priced
    and pruned, where its time went, and the runners-up. Keys this version does not know (from
    other versions of the solver) are ignored on load: the section informs, nothing runs from it."""

    model_config = ConfigDict(use_attribute_docstrings=True, extra="ignore")

    solve_time_s: float = 0.0
    """Wall time of the search (the plan file's writing excluded)."""
    candidates: int | None = None
    """Configurations the pins allow (None: not recorded, plans from before it was)."""
    candidates_evaluated: int = 0
    """Configurations priced by the inter-op DP."""
    pruned_by_memory_bound: int = 0
    """Configurations whose model states alone overflow memory (never priced)."""
    pruned_by_time_bound: int | None = None
    """Configurations whose time lower bound could not enter the top k (never priced)."""
    phase_times_s: dict[str, float] | None = None
    """Seconds per phase of the search (planner/solver/solve.py `SearchResult.phase_times_s`)."""
    processes: int | None = None
    """Processes the search ran on (its blocks split among them: planner/solver/solve.py
    `split_blocks`); None: not recorded, plans from before it was."""
    stage_forward_s: list[float] | None = None
    """The plan's predicted forward time per stage and micro-batch (the Gantt chart's input)."""
    stage_backward_s: list[float] | None = None
    """The plan's predicted backward time per stage and micro-batch."""
    stage_weight_fraction: list[float] | None = None
    """Zero bubble: per stage, the share of its backward run as the deferred weight pass W: its
    weight GEMMs' share, or 0 where the runtime runs the stage's whole backward at B
    (planner/solver/search.py `zero_bubble_split`). None: other schedules, or plans from before
    it was recorded (planner/cost/schedules.py `BACKWARD_WEIGHT_FRACTION` for every stage)."""
    rank_grad_reduce_s: list[float] | None = None
    """Per pipeline rank, the seconds of its once-per-step gradient reduction where it overlaps
    compute on a communication stream (all of it, hidden or not; the Gantt chart's communication
    lane). None: no overlapped reduction, or plans from before it was recorded."""
    grad_reduce_buckets: list[int] | None = None
    """Per pipeline rank, how many pieces that reduction runs in."""
    grad_reduce_ready: Literal["backward", "chunk", "step"] | None = None
    """When its pieces are ready (planner/cost/simulator.py `GRAD_READY`): during the last
    backward, as gradient hooks fire; after each stage's last backward (FSDP2 in a pipeline);
    after the rank's last action (zero bubble's ZeRO 0)."""
    alternatives: list[Alternative] = []
    """The next best configurations, fastest first."""
    notes: list[str] = []
    """What the reader must know about the search beyond the numbers, e.g. that asynchronous
    schedules were allowed (`planner solve --allow-async`) and what that changes."""


class Plan(_Model):
    schema_version: int = PLAN_SCHEMA_VERSION
    model: ModelRef
    profile: str | None = None
    """Profile the plan was solved from."""
    cluster: ClusterRef
    training: Training = Training()
    batch: Batch
    layout: Layout
    stages: list[Stage]
    prediction: Prediction | None = None
    """Absent in hand-written plans."""
    search: SearchReport | None = None
    """Solver statistics and alternatives (absent in hand-written plans)."""
    device_mismatch: str | None = None
    """Set when the profile's times come from another device than the cluster's GPU (solved with
    --allow-device-mismatch): which device's times the prediction used. None: they agree."""

    @model_validator(mode="after")
    def _consistent(self) -> "Plan":
        check_plan_consistency(self)
        return self

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.model_dump_json(indent=1, exclude_none=False))
        return path


def rank_of(layout: Layout, pp_index: int, dp_index: int, tp_index: int) -> int:
    """Global rank of a (pp, dp, tp) coordinate; tp is innermost (see module docstring)."""
    return (pp_index * layout.dp_degree + dp_index) * layout.tp_degree + tp_index


def stage_ranks(layout: Layout, stage_index: int) -> list[int]:
    """Ranks that hold stage `stage_index` (looping placement for virtual stages; with
    `stage_replicas`, the stage's r_s consecutive ranks)."""
    if layout.stage_replicas is not None:
        first = sum(layout.stage_replicas[:stage_index])
        return list(range(first, first + layout.stage_replicas[stage_index]))
    pp_index = stage_index % layout.pp_degree
    return [
        rank_of(layout, pp_index, d, t) for d in range(layout.dp_degree) for t in range(layout.tp_degree)
    ]


def rank_peak_bytes(plan: Plan) -> list[float]:
    """The predicted tensor peak of every rank: the stages it holds together (interleaving puts v
    chunks on one pipeline rank; `Prediction.pipeline_rank_peak_bytes`, or their peaks summed in an
    older plan). Empty for a plan without a prediction."""
    if plan.prediction is None or not plan.prediction.peak_memory_bytes:
        return []
    peaks = [0.0] * plan.world_size
    by_rank = plan.prediction.pipeline_rank_peak_bytes
    pp = plan.layout.pp_degree
    for k, (stage, peak) in enumerate(zip(plan.stages, plan.prediction.peak_memory_bytes, strict=True)):
        for rank in stage.ranks:
            if by_rank is None:
                peaks[rank] += peak
            else:
                peaks[rank] = by_rank[k % pp]
    return peaks


def check_plan_consistency(plan: Plan) -> None:
    """Checks that need no model: degrees, batch arithmetic, stage count and ranks."""
    lay, batch = plan.layout, plan.batch
    problems = []
    replicas = lay.dp_degree // lay.cp_degree  # the ranks of a CP group take the same samples
    if batch.micro_batch_size * batch.num_microbatches * replicas != batch.global_batch_size:
        over_cp = f" / cp_degree {lay.cp_degree}" if lay.cp_degree > 1 else ""
        problems.append(
            f"micro_batch_size x num_microbatches x dp_degree{over_cp} = {batch.micro_batch_size} x "
            f"{batch.num_microbatches} x {replicas} != global_batch_size {batch.global_batch_size}"
        )
    if lay.world_size != plan.cluster.num_nodes * plan.cluster.gpus_per_node:
        problems.append(
            f"pp x dp x tp = {lay.pp_degree} x {lay.dp_degree} x {lay.tp_degree} = {lay.world_size} "
            f"!= cluster devices {plan.cluster.num_nodes} x {plan.cluster.gpus_per_node}"
        )
    if lay.sequence_parallel and lay.tp_degree > 1:
        if lay.dp_degree * lay.tp_degree % lay.ep_degree:
            problems.append(f"ep_degree {lay.ep_degree} does not divide dp_degree x tp_degree = {lay.dp_degree} x "
                            f"{lay.tp_degree} (with sequence parallelism expert parallelism is folded onto the data- "
                            "and tensor-parallel ranks)")
    elif lay.dp_degree % lay.ep_degree:
        problems.append(f"ep_degree {lay.ep_degree} does not divide dp_degree {lay.dp_degree} (expert parallelism is "
                        "folded onto the data-parallel ranks; with sequence_parallel onto the tensor-parallel ones too)")
    if lay.expert_tp_degree not in (1, lay.tp_degree):
        problems.append(f"expert_tp_degree {lay.expert_tp_degree} must be 1 or tp_degree ({lay.tp_degree}): experts are "
                        "split over the whole TP group or not at all")
    elif lay.expert_tp_degree > 1 and lay.sequence_parallel:
        problems.append(f"expert_tp_degree {lay.expert_tp_degree} with sequence_parallel is not supported: expert TP "
                        "needs the same tokens on every TP rank; turn sequence_parallel off or set expert_tp_degree 1")
    if lay.cp_algorithm != "all-gather" and lay.cp_degree == 1:
        problems.append(f"cp_algorithm {lay.cp_algorithm!r} needs cp_degree > 1 (it says how attention crosses the CP "
                        "ranks); set cp_degree or leave cp_algorithm at 'all-gather'")
    if lay.cp_degree > 1:
        if lay.dp_degree % lay.cp_degree:
            problems.append(f"cp_degree {lay.cp_degree} does not divide dp_degree {lay.dp_degree} (context parallelism "
                            "is folded onto the data-parallel ranks)")
        if lay.ep_degree > 1:
            problems.append(f"cp_degree {lay.cp_degree} with ep_degree {lay.ep_degree} is not supported: both fold their "
                            "own view onto the dp ranks, and a per-sequence router loss (the MoE example's) would see "
                            "only a rank's chunks of each sequence; drop one of them")
    if plan.training.float8 and plan.training.dtype != "bfloat16":
        problems.append(f"training.float8 needs dtype bfloat16 (got {plan.training.dtype}): FP8 linears run inside "
                        "bf16 mixed precision")
    if lay.p2p_scatter_gather and (lay.tp_degree == 1 or lay.sequence_parallel or lay.pp_degree == 1):
        problems.append("p2p_scatter_gather needs pp_degree > 1, tp_degree > 1 and no sequence parallelism")
    if lay.virtual_stages > 1 and lay.schedule not in ("interleaved-1f1b", "zero-bubble"):
        problems.append(f"virtual_stages = {lay.virtual_stages} needs schedule interleaved-1f1b or zero-bubble")
    if lay.schedule == "pipedream-2bw" and batch.num_microbatches < lay.pp_degree:
        problems.append(f"pipedream-2bw needs num_microbatches >= pp_degree (got {batch.num_microbatches} < "
                        f"{lay.pp_degree}): with fewer, two weight versions do not suffice (Narayanan et al. 2021, 3.1)")
    num_stages = lay.pp_degree * lay.virtual_stages
    if len(plan.stages) != num_stages:
        problems.append(f"{len(plan.stages)} stages listed, pp_degree x virtual_stages = {num_stages}")
    else:
        for i, stage in enumerate(plan.stages):
            if not stage.units:
                problems.append(f"stage {i} has no units")
            if sorted(stage.ranks) != stage_ranks(lay, i):
                problems.append(f"stage {i} ranks {stage.ranks} != expected {stage_ranks(lay, i)}")
    split = plan.search.stage_weight_fraction if plan.search else None
    if split is not None and (len(split) != num_stages or not all(0.0 <= w <= 1.0 for w in split)):
        problems.append(f"search.stage_weight_fraction {split} must give one share in [0, 1] per stage ({num_stages}); "
                        "remove it to use the default split")
    for name, least, what in (("rank_grad_reduce_s", 0, "time >= 0"), ("grad_reduce_buckets", 1, "count >= 1")):
        values = getattr(plan.search, name) if plan.search else None
        if values is not None and (len(values) != lay.pp_degree or any(v < least for v in values)):
            problems.append(f"search.{name} {values} must give one {what} per pipeline rank ({lay.pp_degree}); "
                            "remove it to draw no communication lane")
    seen: set[str] = set()
    for stage in plan.stages:
        for unit in stage.units:
            if unit in seen:
                problems.append(f"unit {unit} appears in more than one stage")
            seen.add(unit)
    if lay.tp_degree == 1 and any(s.tp_plan for s in plan.stages):
        problems.append("a stage has a tp_plan but tp_degree is 1")
    problems += _sharding_problems(lay, plan.training)
    problems += _replication_problems(lay, plan.training, batch)
    if problems:
        raise ValueError("; ".join(problems))


def _sharding_problems(lay: Layout, training: Training) -> list[str]:
    """Hybrid sharding (`Layout.shard_degree`) and offload (`Training.offload`) need FSDP."""
    problems = []
    if lay.shard_degree is not None:
        if lay.zero_stage == 0:
            problems.append(f"shard_degree {lay.shard_degree} needs zero_stage >= 1 (hybrid sharding shards ZeRO states)")
        if lay.shard_degree < 2 or lay.dp_degree % lay.shard_degree:
            problems.append(f"shard_degree {lay.shard_degree} must be at least 2 and divide dp_degree {lay.dp_degree} "
                            "(for replicas of whole states use zero_stage 0)")
        if lay.ep_degree > 1 and lay.shard_degree != lay.dp_degree:
            problems.append(f"shard_degree {lay.shard_degree} with ep_degree {lay.ep_degree} is not supported (expert "
                            "parallelism folds its own (expert_dp, ep) view onto dp); drop one of them")
    if training.offload != "none" and lay.zero_stage == 0:
        problems.append(f"offload {training.offload!r} needs zero_stage >= 1 (FSDP2's CPUOffloadPolicy)")
    return problems


def flush_free_blocker(lay: Layout, training: Training) -> str | None:
    """Why the runtime cannot run this pipedream-2bw layout without a flush between steps, or None
    when it can (runtime/pp_async.py `train_flush_free`: one stage module per rank, its parameters
    plain or TP/EP DTensors (with or without SP), so each weight version can be its own set of tensors). Elsewhere a 2BW
    step runs as torch's Schedule1F1B with the older weights swapped in, flushed between steps,
    and planner/cost/schedules.py prices it with 1F1B's bubble. None for a synchronous schedule."""
    if lay.schedule != "pipedream-2bw":
        return None
    reasons = {"zero_stage > 0 (FSDP2 owns the parameters)": lay.zero_stage > 0,
               "context parallelism": lay.cp_degree > 1,
               "stage replication": lay.stage_replicas is not None, "virtual stages": lay.virtual_stages > 1,
               "offload": training.offload != "none", "p2p_scatter_gather": lay.p2p_scatter_gather}
    found = [name for name, hit in reasons.items() if hit]
    return ", ".join(found) if found else None


def _replication_problems(lay: Layout, training: Training, batch: Batch) -> list[str]:
    """PipeDream stage replication (`Layout.stage_replicas`): what runtime/pp_replicated.py runs."""
    replicas = lay.stage_replicas
    if replicas is None:
        return []
    problems = []
    if len(replicas) != lay.pp_degree or min(replicas, default=0) < 1:
        problems.append(f"stage_replicas {replicas} must give each of the pp_degree = {lay.pp_degree} stages at least "
                        "one replica")
    others = {"dp_degree": lay.dp_degree, "tp_degree": lay.tp_degree, "ep_degree": lay.ep_degree,
              "cp_degree": lay.cp_degree, "virtual_stages": lay.virtual_stages}
    if any(v != 1 for v in others.values()) or lay.zero_stage != 0 or lay.shard_degree is not None:
        problems.append(f"stage_replicas needs dp/tp/ep/cp degrees, virtual_stages 1 and zero_stage 0 (replication is "
                        f"the data parallelism); got {others}, zero_stage {lay.zero_stage}")
    if lay.schedule not in ("gpipe", "1f1b") or training.offload != "none" or lay.p2p_scatter_gather:
        problems.append(f"stage_replicas runs schedule gpipe or 1f1b without offload or p2p_scatter_gather "
                        f"(got {lay.schedule!r})")
    if replicas and batch.num_microbatches < max(replicas):
        problems.append(f"num_microbatches {batch.num_microbatches} < the largest stage_replicas {max(replicas)}: "
                        "a replica would get no micro-batch (1F1B-RR routes micro-batch i to replica i mod r_s)")
    return problems


def load_plan(path: str | Path) -> Plan:
    """Read and validate a plan file; every problem is reported as a PlannerError."""
    path = Path(path)
    if not path.is_file():
        raise PlannerError(f"Plan {path} does not exist.", "Create one with `planner solve` or write it by hand.")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise PlannerError(f"Plan {path} is not valid JSON ({exc}).", "Fix the file or re-create it with `planner solve`.") from exc
    return parse_plan(data, source=str(path))


def parse_plan(data: object, source: str = "plan") -> Plan:
    if not isinstance(data, dict) or "layout" not in data or "stages" not in data:
        raise PlannerError(f"{source} is not a plan file (it needs `layout` and `stages`).", "Pass a file written by `planner solve`.")
    if data.get("schema_version", PLAN_SCHEMA_VERSION) != PLAN_SCHEMA_VERSION:
        raise PlannerError(
            f"{source} has schema version {data.get('schema_version')}; this planner reads {PLAN_SCHEMA_VERSION}.",
            "Re-create the plan with this version's `planner solve`.",
        )
    try:
        return Plan.model_validate(data)
    except ValidationError as exc:
        lines = [f"  {'.'.join(str(p) for p in err['loc']) or '(plan)'}: {err['msg']}" for err in exc.errors()]
        raise PlannerError(f"{source} is not a valid plan:\n" + "\n".join(lines), "Fix those fields (see `planner schema plan`).") from exc
