"""Pricing one configuration: its stage cost table, the inter-op DP over it, and the price.

The outer search over configurations is planner/solver/solve.py `search`. For each (tp,
sequence parallel, pp, ep, micro-batch size, schedule, virtual stages, ZeRO stage, hybrid
shard degree, offload) it enumerates, `evaluate_config` builds the stage cost table

    cost[k, i, j] = min over per-unit recompute r_u (allowed; the range fitting in stage k's memory) of
                    sum_{u in [i, j)} (fwd_u + bwd_u + recompute_{r_u},u + tp_comm_u + zero_{r_u},u)
                    + first_{r_i},i                      (ZeRO 2/3: the range's exposed first
                                                          gather and last reduce-scatter)
                    + 2 * p2p(bytes crossing cut j)      (only without `pipeline_p2p` overlap;
                                                          as 1/tp slices + a TP all-gather
                                                          across nodes without SP: `scatter_gather`)
                    + the cluster's pipeline_overhead_s  (pp > 1: the schedule's bookkeeping)

The minimum over per-unit modes is a multiple-choice knapsack per range and in-flight level
(planner/solver/unit_recompute.py: exact Pareto frontiers of (time, activation bytes), thinned
conservatively past 64 points); with one allowed mode (`--recompute` pinned) every unit runs
it (`_uniform_range_costs`). Where zero_u is what ZeRO 2/3 communication adds per micro-batch: with the `param_gather` /
`grad_reduce` overlaps (planner/cost/overlap.py) each unit's all-gather hides behind the
previous unit's forward and its reduce-scatter (with the next gather) behind the next unit's
backward, so zero_u is only their excess; without, their sum (planner/solver/comm_pricing.py
prices every overlapped piece).

(stage memory = planner/cost/memory.py `stage_memory`'s larger phase, for every range at
once: model states under ZeRO, a copy of every tied weight the range uses but whose first
unit it lacks included (`UnitCostTable.copy_parameters`), plus in the forward/backward phase
in-flight micro-batches x stored activations + the largest recomputation transient (as soon
as one unit recomputes fully) + the loss on the last stage + `stage_buffers`' communication
(the pipeline's receive buffers and kept outputs, FSDP2's gathered parameters), and in the
optimizer step's phase AdamW's temporaries or ZeRO 0's bucket + the receive buffers; the
gradients count in the forward/backward phase unless every forward of the peak precedes the
rank's first backward, planner/cost/schedules.py `forwards_first`), lets the DP
(planner/solver/inter_op.py) pick the cuts and each unit's recomputation (a pipedream-2bw the runtime runs
without a flush by its own objective, m x the slowest stage), and prices the result (`_price`) with the
schedule's closed form (a pipedream-2bw the runtime runs flushed with 1F1B's: `flush_blocker`;
planner/cost/schedules.py; the first micro-batch's p2p hops through the fill and drain as
its latency when p2p is overlapped) plus, once per step, the part of the data-parallel
gradient reduction the backward does not hide (`dp_tail_s`), the all-reduce of each tied
weight's gradient over the pipeline ranks holding a copy (Megatron-LM's embedding group:
`_tie_all_reduce_s`) and the optimizer step. Configurations whose model states alone cannot
fit (a lower bound: the whole model's states over pp x tp, ZeRO applied) are pruned before
the DP.

Data-parallel communication per ZeRO stage (the runtime runs 1-3 as FSDP2):
- 0: gradients accumulate over the micro-batches and are all-reduced once per step, in
  buckets under the last micro-batch's backward (DDP, Megatron's DDP).
- 1: as 0 with a reduce-scatter (Megatron-LM's distributed optimizer), then the updated
  parameters are all-gathered once per step, prefetched under the first forward
  (`--overlap-param-gather`). The runtime's FSDP2 (reshard_after_forward=False) syncs the
  gradients on the last micro-batch only (`set_requires_gradient_sync`, runtime/train.py).
- 2: gradients are sharded, so reduce-scattered every micro-batch (in the stage times);
  parameters gathered once per step as in 1.
- 3: parameters all-gathered before each unit's forward and again before its backward,
  gradients reduce-scattered after it, every micro-batch (in the stage times).
A pipeline runs ZeRO 0-1 only (planner/solver/solve.py `PIPELINE_ZERO`: torch's schedules
reduce once a step whatever the stage).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from planner.cost.memory import (
    LiveParameters,
    ModelStateBytes,
    Precision,
    accumulation_bytes,
    accumulation_pass_bytes,
    batch_bytes,
    gathered_bytes,
    gradient_bucket_bytes,
    kept_output_bytes,
    loss_bytes,
    loss_in_flight,
    model_state_bytes,
    optimizer_transient_bytes,
    p2p_buffer_bytes,
    pipeline_keeps_outputs,
)
from planner.cost.moe import expert_dp_degree
from planner.cost.overlap import Overlap
from planner.cost.schedules import BACKWARD_WEIGHT_FRACTION, PeakState, iteration_time_s, peak_states
from planner.cost.sharding import fsdp_collective_counts, offload_step_cost, offloaded_state_bytes
from planner.errors import PlannerError
from planner.plan import RECOMPUTE
from planner.solver.comm_pricing import ReductionStream, dp_tail, range_sums, tp_comm_s, zero_unit_s
from planner.solver.costs import UnitCostTable
from planner.solver.inter_op import SharedRows, least_bottleneck, least_total, level_ranks, range_allowed, solve_cuts
from planner.solver.unit_recompute import UnitChoices, fastest_fitting, pareto


@dataclass(frozen=True)
class Config:
    tp: int
    sequence_parallel: bool
    pp: int
    dp: int
    micro_batch_size: int
    num_microbatches: int
    schedule: str
    virtual_stages: int
    zero_stage: int
    ep: int = 1
    """Expert-parallel degree (planner/cost/moe.py); folded onto the data-parallel ranks."""
    shard_degree: int | None = None
    """Hybrid sharding: ZeRO shards over groups of this many dp ranks, replicated across the
    dp / shard_degree groups (planner/cost/sharding.py); None: over all dp ranks."""
    offload: bool = False
    """Model states in host memory and the optimizer step on the CPU (ZeRO-Offload, FSDP2's
    CPUOffloadPolicy; planner/cost/sharding.py)."""
    cp: int = 1
    """Context-parallel degree (planner/cost/cp.py): folded onto the dp ranks, each group of cp
    shares its samples and splits their sequences; the table is priced at micro-batch b / cp."""
    expert_tp: int = 1
    """Expert tensor-parallel degree: 1, or tp when pinned (`Pins.expert_tp`; planner/cost/moe.py)."""
    cp_algorithm: str = "all-gather"
    """How CP's attention reaches the other ranks' K/V (planner/cost/cp.py `CP_METHODS`): both are
    tried for each cp > 1 and priced in the table (`UnitCosts.table`); "all-gather" when cp is 1."""

    @property
    def zero_dp(self) -> int:
        """Ranks the dense parameters' ZeRO states are sharded over."""
        return self.shard_degree or self.dp

    @property
    def replicas(self) -> int:
        """Copies of the sharded states (HSDP's replica groups; 1 without HSDP)."""
        return self.dp // self.zero_dp

    @property
    def ep_folded(self) -> bool:
        """EP groups span TP ranks too (sequence parallelism gives each TP rank its own tokens:
        Megatron-Core's parallel folding); else they are ep data-parallel ranks, tp apart."""
        return self.ep > 1 and self.sequence_parallel and self.tp > 1

    @property
    def expert_dp(self) -> int:
        """Ranks holding the same experts: ZeRO shards and the gradient reduction run over them."""
        return expert_dp_degree(self.dp, self.tp, self.ep, self.ep_folded)

    @property
    def expert_dp_stride(self) -> int:
        """Rank distance between neighbours of an expert-dp group (ep is innermost)."""
        return self.ep if self.ep_folded else self.tp * self.ep

    def describe(self) -> str:
        sched = self.schedule + (f" v={self.virtual_stages}" if self.virtual_stages > 1 else "")
        return (f"pp{self.pp} x dp{self.dp} x tp{self.tp}{' +sp' if self.sequence_parallel else ''}"
                f"{f' ep{self.ep}' if self.ep > 1 else ''}{f' cp{self.cp}' + (' ring' if self.cp_algorithm == 'ring' else '') if self.cp > 1 else ''}{f' hsdp{self.shard_degree}' if self.shard_degree else ''}"
                f"{' offload' if self.offload else ''}, "
                f"mbs {self.micro_batch_size} x {self.num_microbatches}, {sched}, zero {self.zero_stage}")


@dataclass
class Evaluation:
    config: Config
    feasible: bool
    reason: str = ""
    iteration_time_s: float = math.inf
    bounds: tuple = ()
    stage_recompute: tuple = ()
    """Per stage: the mode most of its units run (`majority_mode`), all of them when uniform."""
    unit_recompute: tuple = ()
    """Per stage: the mode of each of its units, in order."""
    stage_forward_s: tuple = ()
    stage_backward_s: tuple = ()
    stage_weight_fraction: tuple = ()
    """Zero bubble: per stage, the share of its backward deferred as W (`zero_bubble_split`);
    empty: other schedules, or BACKWARD_WEIGHT_FRACTION everywhere."""
    peak_memory_bytes: tuple = ()
    rank_memory_bytes: tuple = ()
    """Per pipeline rank, the peak of the chunks it holds together (`rank_memory`); with one chunk a
    rank, `peak_memory_bytes`."""
    breakdown_s: dict = field(default_factory=dict)
    bubble_fraction: float = 0.0
    model_flops: float = 0.0
    hardware_flops: float = 0.0
    min_memory_bytes: float = math.inf
    """Least per-GPU memory any stage arrangement needs (for infeasibility messages)."""
    p2p_scatter_gather: bool = False
    """Activations cross the cuts as TP slices (`scatter_gather`)."""
    overlap: tuple[str, ...] = ()
    """Communication the price assumes hidden behind compute (planner/cost/overlap.py names)."""
    precision: Precision | None = None
    """How the price holds and moves weights and gradients (`Environment.precision`)."""
    memory_terms: Sequence[dict[str, float]] = ()
    """Per stage, `peak_memory_bytes` by term ({name: bytes}, `memory_terms`): they sum to it."""
    flushed_by: str | None = None
    """pipedream-2bw only: why the runtime runs it flushed, so it was priced with 1F1B's time
    (`flush_blocker`); None when it runs flush-free, and for synchronous schedules."""
    reduction_stream: ReductionStream | None = None
    """The overlapped gradient reduction per pipeline rank as its communication stream runs it
    (planner/solver/comm_pricing.py `dp_tail`); None where none is overlapped."""


@dataclass(frozen=True)
class Environment:
    """What a configuration is priced with: cluster-dependent callables and limits."""

    usable_memory_bytes: float
    dtype: str
    dtype_bytes: int
    allowed_recompute: tuple[str, ...]
    dp_all_reduce_s: Callable[[float, int, int], float]  # (nbytes, dp, tp) -> s
    dp_reduce_scatter_s: Callable[[float, int, int], float]
    dp_all_gather_s: Callable[[float, int, int], float]
    p2p_s: Callable[[float, bool], float]  # (nbytes, same_node) -> s
    tp_all_gather_s: Callable[[float, int], float]  # (nbytes, tp) -> s, in a tensor-parallel group
    gpus_per_node: int
    optimizer_s_per_param: float
    """Seconds of the optimizer step per parameter a rank updates (planner/cost/compute.py)."""
    pipeline_overhead_s: float = 0.0
    """Per micro-batch and pipeline chunk, beyond compute and bytes (planner/cluster.py)."""
    tie_all_reduce_s: Callable[[float, tuple, int], float] | None = None
    """(nbytes, pp ranks holding a copy, ranks per pipeline rank = dp x tp) -> s: the all-reduce of a
    tied weight's gradient among its copies (None: free)."""
    overlap: Overlap = Overlap()
    """Which communication hides behind compute (planner/cost/overlap.py)."""
    device: str = "gpu"
    """"cpu" where the cluster's devices are CPUs: AdamW steps tensor by tensor there
    (planner/cost/memory.py `optimizer_transient_bytes`)."""
    fused_optimizer: bool = False
    """The stack's AdamW steps in place (torch's fused=True, apex's, Megatron-LM's and DeepSpeed's
    FusedAdam): no temporaries in the optimizer step's phase. False: the planner's runtime, whose
    torch.optim.AdamW steps with foreach kernels on GPUs."""
    dp_collectives: str = "per-unit"
    """How the stack's ZeRO 1-2 gathers and reduces once per step: "per-unit", one all-gather and
    one reduce-scatter per unit, as FSDP2 runs a `fully_shard` group (the planner's runtime,
    torchtitan); "bucketed", its flat buffer in buckets (Megatron-LM's distributed optimizer,
    DeepSpeed's ZeRO 1-2; planner/solver/comm_pricing.py `bucket_parameters`)."""
    pipeline_buffers: str = "per-microbatch"
    """How the stack's pipeline holds the activations and gradients crossing a cut: "per-microbatch": torch.distributed.pipelining's, as the planner's
    runtime runs it (a receive buffer per micro-batch, kept; planner/cost/memory.py
    `p2p_buffer_bytes`); "in-flight": one micro-batch's sends and receives at a time (Megatron-LM's
    `p2p_communication`, DeepSpeed's pipeline engine): the outgoing activation and its gradient."""
    loss_kernel: str = "eager"
    """How the stack computes the cross-entropy, for its memory (planner/cost/memory.py
    `loss_bytes`: "eager" as the planner's runtime, "fused" or "compiled"; `Pins.loss_kernel`)."""
    loss_parallel: bool = False
    """The stack computes the loss on the logits' 1/tp vocabulary shard (`Pins.loss_parallel`); the
    planner's runtime on the whole logits (False)."""
    gather_copy_out: bool = True
    """ZeRO 3: each unit's all-gather is copied out of its flat buffer into the parameters on the
    compute stream (FSDP2's `foreach_all_gather_copy_out`: the planner's runtime, torchtitan);
    False where parameters are views of the gathered buffer (FSDP1's flat parameters, DeepSpeed)."""
    grad_accumulation: str = "autograd"
    """How the stack adds each micro-batch's gradients to the step's (planner/cost/memory.py
    `accumulation_pass_bytes`): "autograd" as the planner's runtime, "buffer", or "fused"."""
    zero3_live: LiveParameters | None = None
    """ZeRO 3 as DeepSpeed runs it, gathering each submodule's parameters and reducing in a bucket
    (planner/cost/memory.py `LiveParameters`); None: FSDP's units, two gathered at a time."""
    copy_s_per_byte: float = 0.0
    """Seconds per byte a device-memory copy reads or writes (planner/cost/compute.py: the GPU's
    achievable bandwidth, with the node's contention)."""
    stack_precision: Precision | None = None
    """How the stack holds and moves weights and gradients (planner/cost/memory.py `Precision`):
    the model states' split, the bytes ZeRO gathers and the data-parallel reduction moves. None:
    `dtype`'s default (16-bit weights, gradients and reduction, or fp32 throughout); read it as
    `precision`."""
    cut_allowed: tuple[bool, ...] | None = None
    """Whether a stage may end after unit c (planner/solver/inter_op.py `allowed_cuts`: runs of
    units the profile says no cut may split); None: anywhere."""
    memo: dict = field(default_factory=dict, init=False, compare=False, repr=False)
    """Results a search asks for again and again under this environment (`stage_arrays` per
    table and data-parallel setting, `_range_max_at`'s tables per table), each key led by its kind. Not an init field, so `dataclasses.replace` starts a new one: the answers depend on
    the environment."""

    @property
    def precision(self) -> Precision:
        """`stack_precision`, or the dtype's default."""
        return self.stack_precision or Precision.of(self.dtype)


def stage_arrays(table: UnitCostTable, cfg: Config, env: Environment):
    """Per recompute mode: time per unit per micro-batch (prefix-summable) and the start term of
    a range (`zero_unit_s`); model states per unit; and the ZeRO part of both (for the breakdown).
    Memoised in `env.memo` (read-only arrays) by what it reads of cfg: tp, sp, ep, the ZeRO
    stage, dp, the hybrid shard degree and offload."""
    key = ("stage_arrays", id(table), cfg.tp, cfg.sequence_parallel, cfg.ep, cfg.zero_stage, cfg.dp, cfg.shard_degree,
           cfg.offload, cfg.schedule == "pipedream-2bw")
    held = env.memo.get(key)
    if held is None:
        times, first, states, zero = _stage_arrays(table, cfg, env)
        if cfg.schedule == "pipedream-2bw":  # + the second weight version (planner/cost/memory.py `stashed_weight_bytes`)
            from planner.cost.memory import stashed_weight_bytes

            trained = table.trained_dense_parameters()
            experts = 0.0 if table.expert_parameters is None else \
                stashed_weight_bytes(table.expert_parameters, env.precision, cfg.zero_stage, cfg.expert_dp)
            states = states + stashed_weight_bytes(trained, env.precision, cfg.zero_stage, cfg.zero_dp) + experts
        held = env.memo[key] = (table, (times, first, states, zero))  # the table held: its id stays its own
    return held[1]


def accumulation_s(table: UnitCostTable, cfg: Config, env: Environment) -> np.ndarray:
    """Per unit, seconds per micro-batch of adding its gradients into the step's on the compute
    stream (planner/cost/memory.py `accumulation_pass_bytes`, by `Environment.grad_accumulation`)
    at the GPU's copy bandwidth: every trained parameter it holds, its gradients whole under ZeRO
    0-1, the shards under ZeRO 2-3 (reduce-scattered each micro-batch, the shards accumulate).
    `_price` charges a rank m times its units' sum once per step, as it does the optimizer step:
    in a pipeline the passes lengthen each micro-batch's backward, which over m >> p micro-batches
    costs the bottleneck rank about as much."""
    per_param = accumulation_pass_bytes(env.grad_accumulation, env.precision, cfg.num_microbatches)
    if per_param == 0.0:
        return np.zeros(len(table.parameters))
    return accumulated_parameters(table, cfg) * per_param * env.copy_s_per_byte


def accumulated_parameters(table: UnitCostTable, cfg: Config) -> np.ndarray:
    """Per unit, the parameters whose gradients a rank adds into the step's each micro-batch
    (`accumulation_s`): every trained one it holds under ZeRO 0-1, its shard under ZeRO 2-3
    (dense over ZeRO's dp, experts over the experts' dp)."""
    held = table.trained_dense_parameters() / (1 if cfg.zero_stage <= 1 else cfg.zero_dp)
    if table.expert_parameters is not None:
        held = held + table.expert_parameters / (1 if cfg.zero_stage <= 1 else cfg.expert_dp)
    return held


def _stage_arrays(table: UnitCostTable, cfg: Config, env: Environment):
    base = table.forward_s + table.backward_s + tp_comm_s(table, cfg, env)
    for comm, _replayed in table.sequence_comm().values():
        base = base + comm
    zero = zero_unit_s(table, cfg, env)
    times = {r: base + table.recompute_s[r] + zero[r][0] for r in env.allowed_recompute}
    first = {r: zero[r][1] for r in env.allowed_recompute}
    return times, first, state_bytes(table, cfg, env), zero


def state_bytes(table: UnitCostTable, cfg: Config, env: Environment) -> np.ndarray:
    """Model states per unit and GPU: dense parameters under ZeRO over dp, experts' over
    expert-dp (`model_state_bytes` is linear in the parameters, so this is vectorised)."""
    return state_parts(table, cfg, env).total


def state_parts(table: UnitCostTable, cfg: Config, env: Environment) -> ModelStateBytes:
    """`state_bytes` by kind (weights, gradients, optimizer state), per unit."""
    states = gpu_state_parts(table.dense_parameters(), cfg, env, table.frozen_parameters)
    if table.expert_parameters is None:
        return states
    return _add(states, model_state_bytes(table.expert_parameters, env.precision, cfg.zero_stage, cfg.expert_dp))


def gpu_state_bytes(num_parameters, cfg: Config, env: Environment, frozen=None):
    """Dense model states on the GPU: ZeRO over `zero_dp`, less what offload keeps on the host;
    `frozen` of the parameters hold weights only (no gradient, no optimizer state)."""
    return gpu_state_parts(num_parameters, cfg, env, frozen).total


def gpu_state_parts(num_parameters, cfg: Config, env: Environment, frozen=None) -> ModelStateBytes:
    """`gpu_state_bytes` by kind (weights, gradients, optimizer state)."""
    trained = num_parameters if frozen is None else num_parameters - frozen
    states = model_state_bytes(trained, env.precision, cfg.zero_stage, cfg.zero_dp)
    if frozen is not None:
        states = _add(states, _weights_only(model_state_bytes(frozen, env.precision, cfg.zero_stage, cfg.zero_dp)))
    if not cfg.offload:
        return states
    accumulating = cfg.num_microbatches > 1 or cfg.pp > 1
    states = _add(states, offloaded_state_bytes(trained, env.precision, cfg.zero_stage, cfg.zero_dp, accumulating), -1.0)
    if frozen is not None:
        states = _add(states, _weights_only(offloaded_state_bytes(frozen, env.precision, cfg.zero_stage, cfg.zero_dp)), -1.0)
    return states


def _weights_only(states: ModelStateBytes) -> ModelStateBytes:
    """Frozen parameters' states: their weights, no gradient, no optimizer state."""
    return ModelStateBytes(weights=states.weights, gradients=0.0 * states.weights, optimizer=0.0 * states.weights)


def _add(a: ModelStateBytes, b: ModelStateBytes, sign: float = 1.0) -> ModelStateBytes:
    return ModelStateBytes(weights=a.weights + sign * b.weights, gradients=a.gradients + sign * b.gradients,
                           optimizer=a.optimizer + sign * b.optimizer)


def updated_parameters(table: UnitCostTable, cfg: Config, start: int, end: int) -> float:
    """Parameters a rank's optimizer updates for units [start, end): its shard under ZeRO >= 1
    (dense over dp, experts over expert-dp), all it holds under ZeRO 0."""
    return updated_share(*held_parameters(table, start, end), cfg.zero_stage, cfg.zero_dp, cfg.expert_dp)


def held_parameters(table: UnitCostTable, start: int, end: int) -> tuple[float, float]:
    """(trained parameters of units [start, end), tied copies in; the experts' among them)."""
    held = float(table.parameters[start:end].sum() + table.copy_parameters(start, end)[0])
    if table.frozen_parameters is not None:
        held -= float(table.frozen_parameters[start:end].sum())
    experts = 0.0 if table.expert_parameters is None else float(table.expert_parameters[start:end].sum())
    return held, experts


def updated_share(held: float, experts: float, zero_stage: int, zero_dp: int, expert_dp: int) -> float:
    """`updated_parameters` from `held_parameters` and the configuration's ZeRO stage and degrees
    (`Config.zero_dp`, `Config.expert_dp`)."""
    if zero_stage == 0:
        return held
    return (held - experts) / zero_dp + experts / expert_dp


def _updated_per_stage(table: UnitCostTable, cfg: Config, starts: np.ndarray, ends: np.ndarray, copies: np.ndarray) -> list[float]:
    """`updated_parameters` of every stage [starts[k], ends[k]) at once; `copies`: their
    `copy_parameters`."""
    zeros = np.zeros(len(starts), dtype=int)
    held = range_sums(table.parameters[None], zeros, starts, ends) + copies
    if table.frozen_parameters is not None:
        held = held - range_sums(table.frozen_parameters[None], zeros, starts, ends)
    if cfg.zero_stage == 0:
        return held.tolist()
    experts = 0.0 if table.expert_parameters is None else range_sums(table.expert_parameters[None], zeros, starts, ends)
    return ((held - experts) / cfg.zero_dp + experts / cfg.expert_dp).tolist()


def evaluate_config(table: UnitCostTable, cfg: Config, env: Environment, fixed_bounds: tuple | None = None,
                    time_cap_s: float = math.inf, fixed_modes: list[tuple[str, ...]] | None = None) -> Evaluation:
    """Price one configuration; the DP chooses the cuts unless `fixed_bounds` gives them (baselines).

    `fixed_modes` (with `fixed_bounds`): per stage, each unit's recomputation, among
    `env.allowed_recompute`, priced as given (an engine's rule: planner/engines/common.py
    `layer_modes`), memory not checked: a configuration priced, not chosen.

    `time_cap_s` is the search's k-th best iteration time so far: every schedule takes at least
    m x its slowest stage, so stage ranges slower than time_cap_s / m cannot be part of a plan
    that enters the top k and are left out of the DP (exact pruning, not a heuristic).
    """
    num_units = len(table.parameters)
    num_chunks = cfg.pp * cfg.virtual_stages
    if num_chunks > num_units:
        return Evaluation(cfg, False, f"{num_chunks} stages but only {num_units} units")
    times, first, states, zero = stage_arrays(table, cfg, env)
    size = num_units + 1
    prefix = lambda a: np.concatenate([[0.0], np.cumsum(a)])  # noqa: E731
    start, end = np.triu_indices(size, k=1)
    if fixed_bounds is None and math.isfinite(time_cap_s):
        # A lower bound on every range's time: each unit at its fastest mode, the fastest start term.
        unit_fastest = np.min(np.stack([times[r] for r in env.allowed_recompute]), axis=0)
        start_fastest = np.min(np.stack([first[r] for r in env.allowed_recompute]), axis=0)
        fastest = prefix(unit_fastest)[end] - prefix(unit_fastest)[start] + start_fastest[start]
        keep = fastest <= time_cap_s / cfg.num_microbatches
        start, end = start[keep], end[keep]
        if start.size == 0:
            return Evaluation(cfg, False, "dominated: every stage range is slower than the best plans allow")
    p_states = prefix(states)
    # Copies of tied weights a range holds (linear in parameters, like `states`).
    copy_states = gpu_state_bytes(table.copy_parameters(start, end), cfg, env)
    hops, p2p, sliced = p2p_arrays(table, cfg, env)
    blocker = flush_blocker(cfg, sliced)  # pipedream-2bw: flushed (priced as 1F1B) or not (cut by m max)
    if fixed_modes is not None:
        assert fixed_bounds is not None, "fixed recomputation modes need fixed cuts"
        index = {r: k for k, r in enumerate(env.allowed_recompute)}
        return _price(table, cfg, env, tuple(fixed_bounds), [tuple(index[r] for r in stage) for stage in fixed_modes],
                      times, first, states, zero, p2p, hops, flushed=blocker is not None)
    # What each stage position's rank may hold at its activations' peak (planner/cost/schedules.py
    # `peak_states`: the micro-batches in flight, 1F1B's earlier stages holding more, and under
    # zero bubble the weight passes waiting, the gradients and the loss). Stage positions whose
    # ranks hold alike share one row of the cost table.
    whole = whole_backward_ranges(table, cfg, start, end)
    stage_rows = stage_state_rows(cfg, num_chunks, whole is not None)
    groups = list(dict.fromkeys(stage_rows))
    row_of_stage = np.array([groups.index(g) for g in stage_rows])
    buffers = stage_buffers(table, cfg, env, start, end)
    states_held = p_states[end] - p_states[start] + copy_states
    fixed = states_held + buffers.forward_backward + buffers.loss_or_working  # the loss, on the last stage
    floor = states_held + buffers.step  # the optimizer step's phase, which no recomputation shrinks
    transient = _range_max_at(table, env, "transient", table.transient["full"], start, end)
    width, refit = 0, None  # per-unit modes: K, the frontier columns per set in the table's choices
    offset = range_offset_s(table, cfg, start, end, p2p, whole)
    if len(env.allowed_recompute) == 1:
        range_costs, least_bytes = _uniform_range_costs(table, env, times[env.allowed_recompute[0]],
                                                       first[env.allowed_recompute[0]], start, end, fixed, floor,
                                                       transient, offset, groups, buffers, cfg.num_microbatches, whole)
    else:
        range_costs, least_bytes, width, refit = _per_unit_range_costs(unit_choices(table, cfg, env), start, end, fixed,
                                                                      floor, transient, offset, groups, buffers,
                                                                      cfg.num_microbatches, whole)
    min_needed = float(least_bytes.min())  # the least any one range holds: each of a rank's other chunks holds that

    def least_stage_bytes(bounds: tuple | None = None) -> float:
        """The least bytes the fullest rank holds, on `bounds` or under any cuts (a min-max DP
        over each range's least bytes): what this configuration needs per GPU, for the message
        when nothing fits (the least of any one range understates it: with one stage, that
        stage holds the whole model). A rank holds its v chunks together: on `bounds` their sum;
        under any cuts at least the fullest chunk and at least the least total over p ranks
        (`least_total`: each chunk's own buffers count v times a rank)."""
        nbytes = np.full((len(groups), size, size), np.inf)
        nbytes[:, start, end] = least_bytes
        if bounds is not None:
            chunk = [float(nbytes[row_of_stage[k], i, j]) for k, (i, j) in enumerate(bounds)]
            return max(sum(chunk[rank::cfg.pp]) for rank in range(cfg.pp))
        rows = SharedRows(nbytes, row_of_stage)
        fullest = least_bottleneck(rows)
        return fullest if cfg.virtual_stages == 1 else max(fullest, least_total(rows) / cfg.pp)

    def stage_costs(limit: float):
        """cost[k, i, j] (inf where the range does not fit `limit`), the recompute choice's
        column (per in-flight level, `row_of_stage` maps stage k to its level; `stage_modes`
        reads it), the bytes the range holds at that choice (with v > 1 only), and the distinct
        finite costs ascending (the DP's bottleneck candidates)."""
        level_cost, level_choice, level_bytes = range_costs(limit, cfg.virtual_stages > 1)
        if env.cut_allowed is not None:
            level_cost[:, ~range_allowed(start, end, np.array(env.cut_allowed))] = np.inf
        cost = np.full((len(groups), size, size), np.inf)
        choice = np.full((len(groups), size, size), -1)
        cost[:, start, end], choice[:, start, end] = level_cost, level_choice
        values = np.unique(level_cost[np.isfinite(level_cost)])
        held: SharedRows | None = None  # read only where a rank holds several chunks
        if cfg.virtual_stages > 1:
            nbytes = np.full((len(groups), size, size), np.inf)
            nbytes[:, start, end] = level_bytes
            held = SharedRows(nbytes, row_of_stage)
        return SharedRows(cost, row_of_stage), choice, held, values

    def stage_modes(choice: np.ndarray, bounds) -> list[tuple[int, ...]]:
        """Per stage, the mode index (into env.allowed_recompute) of each of its units."""
        if len(env.allowed_recompute) == 1:
            return [(0,) * (j - i) for i, j in bounds]
        choices = unit_choices(table, cfg, env)
        return [choices.modes(i, j, int(choice[row_of_stage[k], i, j]), width) for k, (i, j) in enumerate(bounds)]

    # A rank's v chunks share its memory, a constraint that couples stages the DP places
    # independently. First each chunk may use what the other v - 1 leave at the least (a
    # relaxation: it loses no feasible plan); if the chosen chunks then overflow a rank
    # together, they are repaired (the cuts leveled, the rank's modes chosen together) and the
    # DP runs again with each chunk held to 1/v of the memory (always safe): the fastest wins.
    # A DP that sees the ranks' shared memory would do better still where the repairs fall
    # short (a per-chunk limit between the two finds faster plans at several DPs each).
    limits = [env.usable_memory_bytes] if cfg.virtual_stages == 1 else \
        [env.usable_memory_bytes - (cfg.virtual_stages - 1) * min_needed, env.usable_memory_bytes / cfg.virtual_stages]

    def price(cuts, modes: list[tuple[int, ...]]) -> Evaluation:
        return _price(table, cfg, env, cuts, modes, times, first, states, zero, p2p, hops, flushed=blocker is not None)

    best: Evaluation | None = None
    for attempt, limit in enumerate(limits):
        cost, choice, held_bytes, candidates = stage_costs(limit)
        if fixed_bounds is not None:
            if len(fixed_bounds) != num_chunks or not all(np.isfinite(cost[k, i, j]) for k, (i, j) in enumerate(fixed_bounds)):
                if attempt + 1 < len(limits):
                    continue
                if best is not None:  # repaired at the first limit
                    break
                return Evaluation(cfg, False, "the given cuts do not fit in memory",
                                  min_memory_bytes=least_stage_bytes(tuple(fixed_bounds)))
            bounds = tuple(fixed_bounds)
        else:
            least = least_bottleneck(cost)
            if attempt == 0 and limit >= max(limits) and _bottleneck_bound_s(table, cfg, env, least, hops) >= time_cap_s:
                return Evaluation(cfg, False, "dominated: its least bottleneck stage is too slow for the best plans")
            try:
                bounds = solve_cuts(cost, cfg.num_microbatches, candidates=candidates, bottleneck_floor=least,
                                    flush_free=cfg.schedule == "pipedream-2bw" and blocker is None).bounds
            except PlannerError:
                if best is not None:  # repaired at the first limit; the stricter one has no cuts
                    break
                dominated = math.isfinite(time_cap_s)
                return Evaluation(cfg, False, "dominated or no stage cuts fit in memory",
                                  min_memory_bytes=math.inf if dominated else least_stage_bytes())
        evaluation = price(bounds, stage_modes(choice, bounds))
        overflowed = not evaluation.feasible
        tried, to_refit = [evaluation], [bounds]
        if fixed_bounds is None and cfg.virtual_stages > 1 and cfg.schedule in LEVELED_SCHEDULES:
            # Cuts leveled across the pipeline ranks (`level_ranks`, which also moves units off a
            # rank whose chunks together overflow its memory), priced where the DP's overflowed or
            # where they save time by the leveling's own measure. Not gated by the cap: a
            # configuration is priced alike whenever the search reaches it (a pinned one too).
            leveled, gain = level_ranks(cost, bounds, cfg.pp, cfg.num_microbatches, held_bytes, env.usable_memory_bytes)
            if leveled != bounds and (overflowed or gain > 0):
                tried.append(price(leveled, stage_modes(choice, leveled)))
            if overflowed:  # leveled for time alone, to fit by recomputing below
                by_time, _ = level_ranks(cost, bounds, cfg.pp, cfg.num_microbatches)
                to_refit += [by_time] if by_time != bounds else []
        if refit is not None and cfg.virtual_stages > 1 and overflowed:
            # Each chunk fits alone but a rank's chunks together do not: the units' modes of that
            # rank's chunks are chosen again together, sharing the rank's memory (`refit`), on the
            # same cuts. (Choosing every rank's modes so at the 1/v limit below, where each chunk
            # recomputes to fit 1/v, changed no plan of benchmarks/virtual_stage_cuts.py or of the
            # solve_scaling rows once the cuts were leveled, and cost a refit per rank.)
            for cuts in to_refit:
                chosen = stage_modes(choice, cuts)
                modes = _refit_ranks(cuts, chosen, held_bytes, stage_rows, cfg.pp, env.usable_memory_bytes,
                                     refit, unit_choices(table, cfg, env), width)
                if modes is not None and modes != chosen:
                    tried.append(price(cuts, modes))
        for other in tried:
            if other.feasible and (best is None or other.iteration_time_s < best.iteration_time_s):
                best = other
        # Where the DP's cuts overflowed a rank, the next (stricter) limit's plan may be faster
        # than the repaired ones: it is priced too.
        if not overflowed or attempt + 1 == len(limits):
            break
    evaluation = best if best is not None else evaluation
    evaluation.p2p_scatter_gather = sliced
    evaluation.flushed_by = blocker
    evaluation.overlap = tuple(env.overlap.names())
    evaluation.precision = env.precision
    return evaluation


StateRow = tuple[tuple[PeakState, ...], tuple[PeakState, ...]]
"""A stage position's peak states (planner/cost/schedules.py `peak_states`): as its stage runs
under the schedule, and if its stage runs its whole backward at once (`whole_backward_ranges`)."""


def stage_state_rows(cfg: Config, num_chunks: int, with_whole: bool) -> list[StateRow]:
    """Per stage position, its rank's peak states and, where `with_whole`, those of its stage
    running its whole backward at B (zero bubble's `whole_chunks`; the first stage's own rule applies
    to position 0 either way)."""
    rows = []
    for k in range(num_chunks):
        split = peak_states(cfg.schedule, cfg.pp, cfg.num_microbatches, k % cfg.pp, cfg.virtual_stages)
        whole = peak_states(cfg.schedule, cfg.pp, cfg.num_microbatches, k % cfg.pp, cfg.virtual_stages,
                            whole_chunks=frozenset({k})) if with_whole and k > 0 else split
        rows.append((split, whole))
    return rows


def whole_backward_ranges(table: UnitCostTable, cfg: Config, start: np.ndarray, end: np.ndarray) -> np.ndarray | None:
    """Per stage range [start, end), whether zero bubble's runtime runs its whole backward at its
    input-gradient pass (runtime/pp_split.py `needs_full_backward`): a range after the first
    holding a trained unit fed no floating-point tensor (`UnitCostTable.whole_backward`), or with
    no trained unit before it (its inputs carry no gradient). None where no range does."""
    if cfg.schedule != "zero-bubble" or cfg.pp * cfg.virtual_stages == 1:
        return None
    trained = table.parameters if table.frozen_parameters is None else table.parameters - table.frozen_parameters
    before = np.concatenate([[0], np.cumsum(trained > 0)])
    flagged = np.concatenate([[0], np.cumsum(table.whole_backward if table.whole_backward is not None
                                             else np.zeros(len(trained), dtype=bool))])
    whole = (np.asarray(start) > 0) & ((before[start] == 0) | (flagged[end] > flagged[start]))
    return whole if whole.any() else None


def range_offset_s(table: UnitCostTable, cfg: Config, start: np.ndarray, end: np.ndarray, p2p: np.ndarray,
                   whole: np.ndarray | None) -> np.ndarray:
    """Per unit range [start, end): seconds per micro-batch its time adds beyond its units' and
    its start's, the hop out of its last unit (`p2p`) and, under zero bubble, what running its
    backward as B then W costs more (`UnitCostTable.split_backward_extra_s`). Not for a range
    torch runs whole: the first (its backward runs at W, planner/cost/schedules.py) and those
    `whole` marks (runtime/pp_split.py `needs_full_backward`)."""
    offset = p2p[end - 1]
    extra = table.split_backward_extra_s
    if cfg.schedule != "zero-bubble" or cfg.pp * cfg.virtual_stages == 1 or extra is None:
        return offset
    split = np.asarray(start) > 0
    if whole is not None:
        split &= ~whole
    return offset + np.where(split, range_sums(extra[None], np.zeros(len(start), dtype=int), start, end), 0.0)


def zero_bubble_split(table: UnitCostTable, cfg: Config, start: np.ndarray, end: np.ndarray, backward_s: list[float],
                      whole: np.ndarray | None) -> list[float]:
    """Zero bubble: per stage, the share of its backward (`backward_s`) run as the deferred W,
    its units' weight GEMMs (`UnitCostTable.weight_gradient_share`); 0 for a stage the runtime
    runs whole at B (`whole_backward_ranges`), 1 for the first, whose whole backward torch runs
    at W (its B has no input gradient to make; planner/cost/schedules.py: its split moves no
    makespan, and the closed form's hop for it is then its forward, as it runs). Empty for other
    schedules, or where the table does not know the shares and no stage is whole."""
    if cfg.schedule != "zero-bubble" or (table.weight_gradient_share is None and whole is None):
        return []
    if table.weight_gradient_share is None:
        split = np.full(len(start), BACKWARD_WEIGHT_FRACTION)
    else:
        split_s = table.backward_s if table.split_backward_extra_s is None else table.backward_s + table.split_backward_extra_s
        weights_s = range_sums((table.weight_gradient_share * split_s)[None], np.zeros(len(start), dtype=int),
                               np.asarray(start), np.asarray(end))
        split = np.divide(weights_s, backward_s, out=np.zeros(len(start)), where=np.asarray(backward_s) > 0)
    if whole is not None:
        split = np.where(whole, 0.0, split)
    split = np.clip(split, 0.0, BACKWARD_WEIGHT_FRACTION)
    split[np.asarray(start) == 0] = 1.0
    return split.tolist()


def _by_range(row: StateRow, whole: np.ndarray | None, of) -> np.ndarray:
    """`of(group)` of a row's states per range (axis 0): its whole-backward states where `whole`."""
    split = of(row[0])
    if whole is None or row[1] == row[0]:
        return split
    return np.where(whole.reshape(-1, *([1] * (split.ndim - 1))), of(row[1]), split)


def _refit_ranks(bounds, modes: list[tuple[int, ...]], held_bytes: SharedRows, stage_rows: list[StateRow], pp: int,
                 limit: float, refit, choices: UnitChoices, width: int) -> list[tuple[int, ...]] | None:
    """`modes` (per chunk of `bounds`, each unit's mode index) with the chunks of every pipeline
    rank whose bytes (`held_bytes`, as the cost table chose them) overflow `limit` together
    chosen again by `refit` (`_per_unit_range_costs`); None where some rank's chunks cannot fit."""
    out = list(modes)
    for rank in range(pp):
        chunks = list(range(rank, len(bounds), pp))
        if sum(float(held_bytes[k, bounds[k][0], bounds[k][1]]) for k in chunks) <= limit:
            continue
        columns = refit([bounds[k] for k in chunks], [stage_rows[k] for k in chunks], limit)
        if columns is None:
            return None
        for k, column in zip(chunks, columns, strict=True):
            out[k] = choices.modes(bounds[k][0], bounds[k][1], column, width)
    return out


def _uniform_range_costs(table: UnitCostTable, env: Environment, unit_time: np.ndarray, start_time: np.ndarray,
                         start: np.ndarray, end: np.ndarray, fixed: np.ndarray, floor: np.ndarray, transient: np.ndarray,
                         offset: np.ndarray, groups: list[StateRow], buffers: StageBuffers,
                         num_microbatches: int, whole: np.ndarray | None = None):
    """One allowed mode (`--recompute` pinned): every unit of every range runs it. A range holds
    the larger of its forward/backward bytes (`fixed`, the transient, and at the largest of its
    row's peak states the activations in flight and what the state holds besides:
    `StageBuffers.state_bytes`; a row's whole-backward states where `whole`, `stage_state_rows`)
    and its optimizer step's (`floor`); each range's time adds its `offset` (`range_offset_s`). Returns ((limit, with_bytes)
    -> (cost [group, range], choice [group, range]: 0 or -1, and with_bytes the bytes [group,
    range] at that choice, inf where none fits), and the least bytes [group, range] each range
    can hold)."""
    prefix = np.concatenate([[0.0], np.cumsum(unit_time)])
    p_act = np.concatenate([[0.0], np.cumsum(table.activations[env.allowed_recompute[0]])])
    time_s = prefix[end] - prefix[start] + start_time[start] + offset
    held = fixed + (transient if env.allowed_recompute[0] in REBUILDING else 0.0)
    stored = p_act[end] - p_act[start]
    def at_peak(group: tuple[PeakState, ...]) -> np.ndarray:
        return np.max([held + buffers.state_bytes(state, num_microbatches) + state.in_flight * stored for state in group],
                      axis=0)

    memory = np.maximum(np.stack([_by_range(row, whole, at_peak) for row in groups]), floor[None, :])

    def costs(limit: float, with_bytes: bool = True):
        fits = memory <= limit
        return (np.where(fits, time_s[None, :], np.inf), np.where(fits, 0, -1),
                np.where(fits, memory, np.inf) if with_bytes else None)
    return costs, memory


def _per_unit_range_costs(choices: UnitChoices, start: np.ndarray, end: np.ndarray, fixed: np.ndarray,
                          floor: np.ndarray, transient: np.ndarray, offset: np.ndarray,
                          groups: list[StateRow], buffers: StageBuffers | None = None,
                          num_microbatches: int = 0, whole: np.ndarray | None = None):
    """Modes per unit (planner/solver/unit_recompute.py): per range and row of peak states
    (planner/cost/schedules.py `peak_states`; the row's whole-backward states where `whole`,
    `stage_state_rows`) the fastest frontier point that fits at every state, a range whose
    optimizer step's bytes (`floor`) exceed the limit fitting none;
    what a state holds besides its activations (`buffers`, `StageBuffers.state_bytes`; None:
    nothing) changes its room; each range's time adds its `offset`. Returns as
    `_uniform_range_costs`, the choice a `padded` column,
    and the padded width K (`UnitChoices.modes` reads the column with it)."""
    rows = choices.rows(start, end)
    _, act_all, lasts_all = choices.padded
    held = np.stack([fixed, fixed + transient], axis=1)  # [range, set]: the transient only with a full unit

    def at_state(state: PeakState) -> np.ndarray:
        return np.zeros(len(rows)) if buffers is None else buffers.state_bytes(state, num_microbatches)

    # Per group of states, per state: what a range holds besides its activations [range, set], and its level.
    bases = {group: [(held + at_state(state)[:, None], state.in_flight) for state in group]
             for row in groups for group in row}
    least_act = act_all[rows[:, None], lasts_all[rows]]

    def least_of(group: tuple[PeakState, ...]) -> np.ndarray:
        return np.maximum(np.max([base + level * least_act for base, level in bases[group]], axis=0),
                          floor[:, None]).min(axis=1)

    least = np.stack([_by_range(row, whole, least_of) for row in groups])  # [row, range]
    offset = offset[None, :]
    # One state: its room and level as they are. Several: a frontier point fits them all where its
    # activations fit the least of their rooms per micro-batch in flight (level 1 on that room).
    single = [row[0] == row[1] and len(row[0]) == 1 for row in groups]
    levels = np.array([row[0][0].in_flight if one else 1.0 for row, one in zip(groups, single, strict=True)])

    def rooms(limit: float) -> np.ndarray:
        def normalised(group: tuple[PeakState, ...]) -> np.ndarray:
            return np.min([np.where(limit - base >= 0, np.inf, -np.inf) if level <= 0 else (limit - base) / level
                           for base, level in bases[group]], axis=0)

        return np.stack([limit - bases[row[0]][0][0] if one else _by_range(row, whole, normalised)
                         for row, one in zip(groups, single, strict=True)])  # [row, range, set]

    def held_at(column: np.ndarray) -> np.ndarray:
        """Bytes [row, range] at each row's chosen column (any column where none fits)."""
        sets = (column >= choices.width).astype(int)
        act = choices.padded[1][rows[None, :], column]
        out = []
        for k, row in enumerate(groups):
            def at_column(group: tuple[PeakState, ...], k: int = k) -> np.ndarray:
                return np.max([np.take_along_axis(base, sets[k][:, None], axis=1)[:, 0] + level * act[k]
                               for base, level in bases[group]], axis=0)
            out.append(_by_range(row, whole, at_column))
        return np.stack(out)

    def costs(limit: float, with_bytes: bool = True):
        cost, choice = fastest_fitting(choices, rows, rooms(limit), levels)
        stepping = floor > limit
        if stepping.any():
            cost, choice = np.where(stepping[None, :], np.inf, cost), np.where(stepping[None, :], -1, choice)
        if not with_bytes:
            return cost + offset, choice, None
        fits = choice >= 0
        memory = held_at(np.where(fits, choice, 0))
        return cost + offset, choice, np.where(fits, np.maximum(memory, floor[None, :]), np.inf)

    position = np.full((choices.num_units + 1, choices.num_units + 1), -1)
    position[start, end] = np.arange(start.size)

    def refit(ranges: list[tuple[int, int]], chunk_rows: list[StateRow], limit: float) -> list[int] | None:
        """One pipeline rank's chunks `ranges` together in `limit` bytes, each at the largest of its
        row's peak states (`chunk_rows`): the `padded` column of each (its units' modes) of least summed time whose
        summed bytes fit, or None. The chunks' frontiers are merged one by one into the Pareto
        frontier of (summed time, summed bytes) over their combinations, fastest first, thinned
        as a unit range's frontier is (planner/solver/unit_recompute.py `pareto`: every kept
        point real, never better than the truth, and the least-bytes combination always kept)."""
        time_all, act_all, _ = choices.padded
        width = time_all.shape[1] // 2
        sets = (np.arange(2 * width) >= width).astype(int)
        merged_t, merged_b = np.zeros(1), np.zeros(1)
        trail: list[tuple[np.ndarray, np.ndarray]] = []  # per chunk: (parent point, its column) of each point
        for (i, j), states in zip(ranges, chunk_rows, strict=True):
            n = int(position[i, j])
            if n < 0:
                return None
            row = rows[n]
            option_t = time_all[row]
            group = states[1] if whole is not None and whole[n] else states[0]
            option_b = np.maximum(np.max([held[n, sets] + at_state(state)[n] + state.in_flight * act_all[row]
                                          for state in group], axis=0), floor[n])
            total_t = (merged_t[:, None] + option_t[None, :]).ravel()
            total_b = (merged_b[:, None] + option_b[None, :]).ravel()
            fit = np.flatnonzero(np.isfinite(total_t) & (total_b <= limit))
            if fit.size == 0:
                return None
            keep = fit[pareto(total_t[fit], total_b[fit], np.zeros(fit.size, dtype=bool), MERGE_CAP)[0]]
            trail.append((keep // option_t.size, keep % option_t.size))
            merged_t, merged_b = total_t[keep], total_b[keep]
        point, columns = 0, []  # the fastest point comes first
        for parent, column in reversed(trail):
            columns.append(int(column[point]))
            point = int(parent[point])
        return columns[::-1]
    return costs, least, choices.width, refit


def unit_choices(table: UnitCostTable, cfg: Config, env: Environment) -> UnitChoices:
    """The per-unit recomputation frontiers of every range (planner/solver/unit_recompute.py),
    memoised in `env.memo` as `stage_arrays` is (they read only its times, its start terms and
    the table's activations)."""
    times, first, _, _ = stage_arrays(table, cfg, env)
    key = ("unit_choices", id(times))
    held = env.memo.get(key)
    if held is None:
        modes = env.allowed_recompute
        inputs = (np.stack([times[r] for r in modes]), np.stack([first[r] for r in modes]),
                  np.stack([table.activations[r] for r in modes]))
        # Configurations that differ only where the frontiers do not look (dp under ZeRO 0/1,
        # say) share them: keyed by content as well.
        content = ("unit_choices_of",) + tuple(a.tobytes() for a in inputs)
        if content not in env.memo:
            env.memo[content] = UnitChoices(*inputs, full=[modes.index(r) for r in REBUILDING if r in modes])
        held = env.memo[key] = (times, env.memo[content])  # the times held: their id stays their own
    return held[1]


def _bottleneck_bound_s(table: UnitCostTable, cfg: Config, env: Environment, least_bottleneck_s: float,
                        hops: np.ndarray) -> float:
    """Seconds per iteration no cuts of this stage cost table can beat, from its least
    bottleneck t* (`least_bottleneck`, planner/solver/inter_op.py; inf: no cuts fit, which the
    DP reports). Proof: `_price` gives chunk k work_k = fwd_k + bwd_k >= its range's cost (bwd
    is clipped at 0 from below), and the cuts' slowest chunk costs at least t*, the rank
    holding it works at least t*. So the
    closed forms (planner/cost/schedules.py) take at least: GPipe, 1F1B, sum + (m - 1) max >=
    m t*; interleaved 1F1B, m max_rank + (p - 1) max_chunk >= (m + p - 1) t*; zero bubble,
    m max_rank (v > 1) or m work_slowest (v = 1) plus hops >= 0, so m t*. Zero bubble with
    m < p is played in the simulator: only its m t* holds unproven, so it gets 0 here. The
    overlapped p2p's fill (S - 1 cuts, each at least the cheapest hop) and, without offload,
    the optimizer step of the mean rank (`TimeBound`, planner/solver/bounds.py) add. Applied only to the first,
    most permissive memory limit's table: a later one with less memory costs at least as much."""
    m, p, v = cfg.num_microbatches, cfg.pp, cfg.virtual_stages
    if not math.isfinite(least_bottleneck_s) or (cfg.schedule == "zero-bubble" and m < p):
        return 0.0
    pipeline = (m + p - 1 if cfg.schedule == "interleaved-1f1b" and v > 1 else m) * least_bottleneck_s
    fill = (p * v - 1) * float(hops[:-1].min()) if env.overlap.pipeline_p2p and len(hops) > 1 else 0.0
    optimizer = 0.0 if cfg.offload else \
        updated_parameters(table, cfg, 0, len(table.parameters)) / p * env.optimizer_s_per_param
    # The table's sums are prefix-sum differences, `_price`'s are not: 1e-12 covers their rounding.
    return (pipeline + fill + optimizer) * (1 - 1e-12)


def p2p_arrays(table: UnitCostTable, cfg: Config, env: Environment) -> tuple[np.ndarray, np.ndarray, bool]:
    """Per cut position u (after unit u): `hops[u]`, seconds to send the activations across it and
    receive their gradients back (0 after the last unit); `p2p[u]`, what a stage ending there
    pays per micro-batch inside its time (the hops unless overlapped, plus the schedule's
    bookkeeping when pp > 1); and whether activations travel as TP slices (`scatter_gather`)."""
    same_node = cfg.dp * cfg.tp < env.gpus_per_node
    sliced = scatter_gather(cfg, same_node)
    distinct, inverse = np.unique(table.cut_bytes, return_inverse=True)  # identical blocks cut alike
    hops = np.array([2 * _p2p_s(float(b), cfg.tp, same_node, sliced, env) if b > 0 else 0.0 for b in distinct])[inverse.ravel()]
    hops[-1] = 0.0
    # Overlapped p2p leaves the stage times; the fill and drain pay it in `_price`.
    p2p = np.zeros_like(hops) if env.overlap.pipeline_p2p else hops.copy()
    if cfg.pp > 1:  # every chunk, the last included, pays the schedule's per-micro-batch bookkeeping
        p2p += env.pipeline_overhead_s
    return hops, p2p, sliced


def flush_blocker(cfg: Config, sliced: bool) -> str | None:
    """Why the runtime runs this pipedream-2bw configuration flushed (planner/plan.py
    `flush_free_blocker` on its layout; `sliced`: `scatter_gather`), None where it runs it without
    a flush (runtime/pp_async.py `train_flush_free`) and for synchronous schedules. A flushed 2BW
    step is priced as it runs: 1F1B's time, bubble included, plus the stashed weights' memory
    (planner/cost/schedules.py `timed_schedule`)."""
    if cfg.schedule != "pipedream-2bw":
        return None
    from planner.plan import Layout, Training, flush_free_blocker

    layout = Layout.model_validate(dict(
        pp_degree=cfg.pp, dp_degree=cfg.dp, tp_degree=cfg.tp, zero_stage=cfg.zero_stage,
        sequence_parallel=cfg.sequence_parallel, schedule=cfg.schedule, virtual_stages=cfg.virtual_stages,
        p2p_scatter_gather=sliced, ep_degree=cfg.ep, shard_degree=cfg.shard_degree, cp_degree=cfg.cp,
        expert_tp_degree=cfg.expert_tp))
    return flush_free_blocker(layout, Training(offload="cpu" if cfg.offload else "none"))


def scatter_gather(cfg: Config, same_node: bool) -> bool:
    """Whether pipeline activations travel as 1/tp slices (runtime/pp_scatter.py).

    Only where it pays: between nodes, without sequence parallelism (whose activations are
    already 1/tp), each TP rank then sends b/tp over its own NIC and the receiving group
    all-gathers over NVLink (Narayanan et al. 2021, section 4.1). Inside a node the
    all-gather moves as many bytes as the p2p it saves.
    """
    return cfg.pp > 1 and cfg.tp > 1 and not cfg.sequence_parallel and not same_node


def _p2p_s(nbytes: float, tp: int, same_node: bool, sliced: bool, env: Environment) -> float:
    """One direction of one cut: the whole tensor, or a 1/tp slice then an all-gather in the TP group."""
    if not sliced:
        return env.p2p_s(nbytes, same_node)
    return env.p2p_s(nbytes / tp, same_node) + env.tp_all_gather_s(nbytes, tp)


MERGE_CAP = 256
"""Most points `_per_unit_range_costs`' refit keeps of a rank's merged frontier (thinned as a
unit range's frontier is: planner/solver/unit_recompute.py `FRONTIER_CAP`)."""
LEVELED_SCHEDULES = ("interleaved-1f1b", "zero-bubble")
"""Schedules whose v > 1 closed form pays the busiest rank's chunks together (m max_rank), which the
stage DP's objective does not see: their cuts are leveled across ranks after it
(planner/solver/inter_op.py `level_ranks`)."""
REBUILDING = ("full", "op")
"""Modes whose backward rebuilds a unit's activations for a while: a range with such a unit holds
its largest full-recomputation transient (conservative for `op`, which rebuilds only what it
did not save: planner/solver/costs.py)."""


@dataclass(frozen=True)
class StageBuffers:
    """What stage ranges hold beyond their model states, activations, transient and loss, one
    entry per range (planner/cost/memory.py `stage_memory`'s terms, `stage_buffers`)."""

    receive: np.ndarray
    """The pipeline's receive buffers (`p2p_buffer_bytes`) and, on the last stage, the kept
    outputs (`kept_output_bytes`): held in both phases."""
    gathered: np.ndarray
    """FSDP2's gathered parameters and unsharded gradients (`gathered_bytes`), forward/backward only."""
    step_transient: np.ndarray
    """AdamW's temporaries (`optimizer_transient_bytes`; none with offload: the host steps)."""
    bucket: np.ndarray
    """ZeRO 0's all-reduce bucket (`gradient_bucket_bytes`), the optimizer step's phase."""
    batch: np.ndarray
    """The rank's share of the step's batch (`batch_bytes`): held in both phases."""
    accumulation: np.ndarray
    """The largest gradient a backward makes before adding it to the one held
    (`accumulation_bytes`): in the forward/backward phase, given back as the gradients are."""
    weight_gradient_inputs: np.ndarray
    """Per micro-batch whose weight pass waits, the output gradients its weight ops keep
    (`UnitCostTable.weight_gradient_inputs` over the range): zero bubble's (`state_bytes`)."""
    boundary_back: np.ndarray
    """The range's last unit's kept output (`UnitCostTable.boundary_saved`), which the table counts
    with the next unit: another stage's, so each micro-batch in flight holds it here (`state_bytes`);
    and, where the range starts a stage after the first, what its first unit keeps more as a
    stage's first unit (`UnitCostTable.stage_start_saved`), also per micro-batch in flight."""
    batch_saved: np.ndarray
    """Of one micro-batch's stored activations, the bytes that are views of the batch (the first
    stage's `UnitCostTable.batch_saved`): counted in `batch`, so each micro-batch in flight gives
    them back (`state_bytes`)."""
    gradients: np.ndarray
    """The gradients the stage holds (its units' and its tied copies', ZeRO applied): in the
    optimizer step's phase always, in the forward/backward phase at the peak states that hold
    them (planner/cost/schedules.py `PeakState.gradients`; planner/cost/memory.py `stage_memory`).
    They are counted in `held`, so `state_bytes` gives them back where a state holds none."""
    loss: np.ndarray
    """The loss's bytes on the stage holding the last unit (`stage_loss_bytes`), 0 elsewhere:
    counted in the forward/backward phase's fixed bytes, given back at a state that holds none."""
    gathered_with_loss: np.ndarray
    """FSDP's gathered bytes while the loss is held (ZeRO 3: the last unit's, with the group it
    prefetches), at most `gathered`: the two peak at different moments of the backward."""
    working: np.ndarray | float = 0.0
    """The largest backward working set of the range's units, one micro-batch, with no gradient
    held before (`UnitCostTable.backward_working`): held on top of the in-flight activations
    while that unit's backward runs, a moment apart from the loss's (the loss is freed by then;
    the last unit's, which starts from the loss, competes with it)."""
    working_held: np.ndarray | float = 0.0
    """The same at a state that holds the gradients (`UnitCostTable.backward_working_held`: the
    new gradients add into the held ones; accumulation's temporary is `accumulation`)."""

    @property
    def loss_or_working(self) -> np.ndarray:
        """What the forward/backward phase's fixed bytes hold for the two moments: the larger of the
        loss and the working set; `state_bytes` takes back what a state does not hold."""
        return np.maximum(self.loss, self.working)

    def working_at(self, gradients) -> np.ndarray:
        """The working set at a state that holds the gradients or not (a bool, or one per range)."""
        return np.where(gradients, self.working_held, self.working)

    def loss_apart(self, gradients: bool = True) -> np.ndarray:
        """What holding the loss or the working set together with `gathered` overstates, for a
        state that holds the loss: their larger one + gathered, less the larger of the moments
        (the loss with `gathered_with_loss`; the state's working set with `gathered`, FSDP's
        largest pair at a unit's backward)."""
        return self.loss_or_working + self.gathered \
            - np.maximum(self.gathered + self.working_at(gradients), self.loss + self.gathered_with_loss)

    def loss_moment(self, gradients=True) -> np.ndarray:
        """Whether a state holding the loss peaks while it is held (else: at a unit's backward, the
        loss freed, with FSDP's largest pair and the working set)."""
        return self.loss + self.gathered_with_loss >= self.gathered + self.working_at(gradients)

    def state_bytes(self, state: PeakState, num_microbatches: int) -> np.ndarray:
        """What the forward/backward phase holds beyond its states, buffers, loss and in-flight
        activations at peak state `state` (planner/cost/schedules.py `peak_states`): the pending
        weight passes' inputs (`weight_gradient_inputs`) and the last unit's kept outputs
        (`boundary_back`), less the gradients and their accumulation where the state has made none,
        the loss where it holds none, and the activations that are views of the batch (`batch_views`)."""
        out = (state.pending * self.weight_gradient_inputs + state.in_flight * self.boundary_back
               - self.batch_views(state.in_flight, num_microbatches))
        if not state.gradients:
            out = out - self.gradients - self.accumulation
        if state.loss:
            return out - self.loss_apart(state.gradients)
        return out - self.loss_or_working + self.working_at(state.gradients)

    def batch_views(self, in_flight, num_microbatches: int) -> np.ndarray:
        """The in-flight activations that are views of the batch (`batch_saved`)."""
        return np.minimum(in_flight, num_microbatches) * self.batch_saved

    @property
    def communication(self) -> np.ndarray:
        """The forward/backward phase's communication buffers."""
        return self.receive + self.gathered

    @property
    def forward_backward(self) -> np.ndarray:
        """The forward/backward phase beyond the model states, activations, recomputation's
        transient and loss: the communication buffers, the gradient accumulation's transient and
        the batch."""
        return self.communication + self.accumulation + self.batch

    @property
    def step(self) -> np.ndarray:
        """The optimizer step's phase beyond the model states: the larger of the temporaries and
        the bucket (freed before the step), the receive buffers and the batch."""
        return np.maximum(self.step_transient, self.bucket) + self.receive + self.batch


def rank_memory(forward_backward: np.ndarray, transient: np.ndarray, stepping: np.ndarray, pp: int) -> list[float]:
    """Per pipeline rank, the peak of the chunks it holds (stage k on rank k mod pp: interleaving puts
    v on one rank), each chunk's two phases given (`forward_backward`, of which `transient` is
    full recomputation rebuilding one unit, and `stepping`). In the forward/backward phase the
    chunks hold their states, buffers and activations together, but rebuild one unit at a time: the
    largest transient, not their sum. In the optimizer step's phase every chunk steps. One chunk a
    rank: its own peak."""
    out = []
    for rank in range(pp):
        chunks = slice(rank, len(forward_backward), pp)
        held = float((forward_backward[chunks] - transient[chunks]).sum() + transient[chunks].max())
        out.append(max(held, float(stepping[chunks].sum())))
    return out


def stage_buffers(table: UnitCostTable, cfg: Config, env: Environment, start: np.ndarray, end: np.ndarray) -> StageBuffers:
    """`StageBuffers` of the stage ranges [start[k], end[k]) (planner/cost/memory.py
    `stage_memory`, whose arguments are computed here for every range at once)."""
    n, m = len(table.parameters), cfg.num_microbatches
    start, end = np.asarray(start), np.asarray(end)
    zeros = np.zeros(len(start))
    receive = zeros
    if cfg.pp > 1 and env.pipeline_buffers == "in-flight":
        receive = 2 * table.cut_bytes[end - 1]
    elif cfg.pp > 1:
        incoming = np.where(start > 0, table.cut_bytes[np.maximum(start - 1, 0)], 0.0)
        receive = p2p_buffer_bytes(m, incoming, table.cut_bytes[end - 1])
        if pipeline_keeps_outputs():
            receive = receive + np.where(end == n, kept_output_bytes(m, table.output_bytes, cfg.pp), 0.0)
    params = table.parameters
    prefix = lambda a: np.concatenate([[0.0], np.cumsum(a)])  # noqa: E731
    # A tied weight's copy, which a stage holding another of its units keeps (`copy_parameters`),
    # counts with the stage's parameters, and under ZeRO 3 with whichever unit FSDP gathers it in.
    copies = np.asarray(table.copy_parameters(start, end), dtype=float) * np.ones(len(start))
    gathered = gathered_with_loss = largest_tensor = zeros
    if cfg.zero_stage >= 1 and cfg.zero_dp > 1:
        tied_held = zeros
        if cfg.zero_stage >= 3:
            # FSDP groups: a unit, its experts apart (runtime/apply_dp.py shards each experts module
            # on its own), and the units of a stage sharing a weight together (a tied embedding and
            # output head in one stage: one group, gathered from the backward of the last of them to
            # that of the first, its gradients with it: `tied_held`, through the whole backward; a
            # tie split over stages leaves each unit, with its copy, a group of its own). A unit's
            # backward holds its groups and the next group FSDP prefetches, the unit before's own
            # (`outer`), and one group's gradients (planner/cost/memory.py `gathered_bytes`).
            experts = np.zeros(n) if table.expert_parameters is None else table.expert_parameters
            grouped, tied = np.zeros(len(start), dtype=bool), np.zeros(n, dtype=bool)
            for tie in table.tied:
                units = np.array(tie.units)
                inside = (units[:, None] >= start) & (units[:, None] < end)
                joined = inside.sum(axis=0) >= 2  # the runtime groups a tie's units a stage holds together
                grouped |= joined
                tied[units] = True
                tied_held = tied_held + np.where(joined, (params[units][:, None] * inside).sum(axis=0), 0.0)
            tied_held = tied_held + np.where(grouped, copies, 0.0)
            apart = np.where(grouped, 0.0, copies)  # a copy counts with whichever unit FSDP gathers it in
            untied = lambda values, units=tied: np.where(units, 0.0, values)  # noqa: E731

            def range_max(name: str, values: np.ndarray, without_ties: np.ndarray, i, j) -> np.ndarray:
                """Each range's max of `values`, of `without_ties` where the range holds a tie's group."""
                return np.where(grouped, _range_max_at(table, env, name + "_untied", without_ties, i, j),
                                _range_max_at(table, env, name, values, i, j))

            outer = params - experts
            groups = np.maximum(outer, experts)
            largest_unit = range_max("fsdp_groups", groups, untied(groups), start, end) + apart
            largest_pair = range_max("prefetched_pairs", outer[:-1] + params[1:],
                                     untied(outer[:-1], tied[:-1]) + untied(params[1:], tied[1:]), start, end - 1) + apart
            # While the loss is held the backward has reached the last unit only: FSDP holds that
            # one and the group it prefetches, not the stage's largest pair.
            held_alone = ~(grouped & tied[n - 1])  # the last unit, outside a tie's group
            last = np.where(held_alone, groups[n - 1], 0.0)
            before = np.where(grouped & tied[n - 2], 0.0, outer[n - 2]) if n > 1 else 0.0
            last_pair = np.where(end - start > 1, before + np.where(held_alone, params[n - 1], 0.0), 0.0) + apart
            # DeepSpeed gathers submodule by submodule (`Environment.zero3_live`): the range's largest tensor bounds it.
            if env.zero3_live is not None and table.largest_parameter is not None:
                largest_tensor = _range_max_at(table, env, "largest_parameter", table.largest_parameter, start, end)
            at_loss = gathered_bytes(prefix(params)[end] - prefix(params)[start] + copies, last + apart, last_pair,
                                     env.precision, cfg.zero_stage, cfg.zero_dp, cfg.offload, tied_held,
                                     env.gather_copy_out, env.zero3_live, largest_tensor)
        else:
            largest_unit = largest_pair = zeros
        gathered = gathered_bytes(prefix(params)[end] - prefix(params)[start] + copies, largest_unit, largest_pair,
                                  env.precision, cfg.zero_stage, cfg.zero_dp, cfg.offload, tied_held,
                                  env.gather_copy_out, env.zero3_live, largest_tensor)
        gathered_with_loss = np.where(end == n, np.minimum(at_loss, gathered), gathered) if cfg.zero_stage >= 3 \
            else gathered
    per_unit = prefix(state_parts(table, cfg, env).gradients * np.ones(n))
    gradients = per_unit[end] - per_unit[start] + gpu_state_parts(copies, cfg, env).gradients
    bucket = gradient_bucket_bytes(gradients, cfg.zero_stage, cfg.dp)
    trained = params if table.frozen_parameters is None else params - table.frozen_parameters
    step_transient = zeros
    if not (cfg.offload or env.fused_optimizer):
        shards = cfg.zero_dp if cfg.zero_stage >= 1 else 1
        updated = trained / shards
        if table.expert_parameters is not None and cfg.zero_stage >= 1:  # experts shard over expert dp
            updated = updated + table.expert_parameters * (1 / cfg.expert_dp - 1 / shards)
        largest = zeros
        if env.device == "cpu" and table.largest_parameter is not None:
            largest = _range_max_at(table, env, "largest_parameter", table.largest_parameter, start, end) / shards
        step_transient = optimizer_transient_bytes(prefix(updated)[end] - prefix(updated)[start] + copies / shards,
                                                   largest, env.device)
    accumulation = zeros
    if table.largest_parameter is not None and cfg.zero_stage <= 1:
        largest = _range_max_at(table, env, "largest_trained", np.minimum(table.largest_parameter, trained), start, end)
        accumulation = accumulation_bytes(largest, env.precision)
    batch = batch_bytes(m, table.input_bytes, table.target_bytes, start == 0, end == n)
    wgrad = zeros
    if cfg.schedule == "zero-bubble" and table.weight_gradient_inputs is not None:
        # The model's first stage has no input gradient to make: torch skips its B and runs its
        # whole backward as the W (PipelineStage.backward_one_chunk), keeping nothing between.
        wgrad = np.where(start > 0, prefix(table.weight_gradient_inputs)[end] - prefix(table.weight_gradient_inputs)[start],
                         0.0)
    working = working_held = zeros
    if table.backward_working is not None and table.backward_working_held is not None:
        working_held = _range_max_at(table, env, "backward_working_held", table.backward_working_held, start, end)
        # ZeRO 3: a unit's new, unsharded gradients are `gathered`'s (FSDP2 reduce-scatters them
        # at the unit's end), whether or not the sharded ones are held.
        working = working_held if cfg.zero_stage >= 3 and cfg.zero_dp > 1 else \
            _range_max_at(table, env, "backward_working", table.backward_working, start, end)
    return StageBuffers(receive=receive, gathered=gathered, step_transient=step_transient, bucket=bucket, batch=batch,
                        accumulation=accumulation, weight_gradient_inputs=wgrad,
                        boundary_back=(zeros if table.boundary_saved is None else table.boundary_saved[end - 1])
                        + (zeros if table.stage_start_saved is None else
                           np.where(start > 0, table.stage_start_saved[start], 0.0)),
                        batch_saved=np.where(start == 0, table.batch_saved, 0.0),
                        gradients=np.broadcast_to(np.asarray(gradients, dtype=float), (len(start),)),
                        loss=np.where(end == n, stage_loss_bytes(table, env, cfg), 0.0),
                        gathered_with_loss=gathered_with_loss,
                        working=working, working_held=working_held)


def _range_max_at(table: UnitCostTable, env: Environment, name: str, values: np.ndarray, start: np.ndarray,
                  end: np.ndarray) -> np.ndarray:
    """max(values[start[k]:end[k]]) per k, 0 where the range is empty: a sparse table (row j holds
    the maxima of the windows of 2^j), built once per table and `name` (`env.memo`), read twice per range."""
    key = ("range_max", id(table), name)
    held = env.memo.get(key)
    if held is None:
        values = np.asarray(values, dtype=float)
        rows, width = [values], 1
        while 2 * width <= len(values):
            rows.append(np.maximum(rows[-1][:-width], rows[-1][width:]))
            width *= 2
        sparse = np.zeros((len(rows), max(len(values), 1)))
        for j, row in enumerate(rows):
            sparse[j, :len(row)] = row
        held = env.memo[key] = (table, sparse)
    sparse = held[1]
    length = end - start
    level = np.zeros(len(length), dtype=int)
    positive = length > 0
    level[positive] = np.floor(np.log2(length[positive])).astype(int)
    first = sparse[level, np.where(positive, start, 0)]
    last = sparse[level, np.where(positive, end - (1 << level), 0)]
    return np.where(positive, np.maximum(first, last), 0.0)


def stage_loss_bytes(table: UnitCostTable, env: Environment, cfg: Config) -> float:
    """The loss's bytes on the stage holding the last unit (planner/cost/memory.py `loss_bytes`),
    with `loss_in_flight` micro-batches' losses waiting for their backward; on a 1/tp shard of the
    logits where the stack computes the loss in parallel (`Environment.loss_parallel`)."""
    output = table.output_bytes / (cfg.tp if env.loss_parallel else 1)
    return loss_bytes(output, table.output_element_bytes, loss_in_flight(cfg.schedule, cfg.pp, cfg.num_microbatches),
                      kernel=env.loss_kernel)


def memory_terms(table: UnitCostTable, cfg: Config, env: Environment, starts: np.ndarray, ends: np.ndarray,
                 held: np.ndarray, copies: np.ndarray, activations: np.ndarray, transient: np.ndarray,
                 buffers: StageBuffers, loss: np.ndarray, stepping: np.ndarray, peak: list[PeakState]) -> StageTerms:
    """Per stage [starts[k], ends[k]), the terms of `_price`'s memory by name (planner/cost/memory.py
    `StageMemory.terms`): the model states split into parameters, gradients and optimizer state
    (the stage's units and its tied copies, ZeRO and offload applied), PipeDream-2BW's stashed
    weights (what `held` holds beyond them, `stage_arrays`), then the phase at the peak: in the
    forward/backward phase the activations of the micro-batches in flight (less the batch's views,
    plus the output gradients of the `pending` weight passes), full recomputation's and
    accumulation's transients, the communication buffers (`StageBuffers.communication`) and the
    loss's bytes on the last stage, at each stage's peak state (`peak`, planner/cost/schedules.py
    `PeakState`: the gradients and the loss where it holds them); where the optimizer step's phase is larger (`stepping`),
    AdamW's temporaries as the transient or else ZeRO 0's bucket with the receive buffers as
    communication; the batch in both, as `stage_memory` names them. They sum to the stage's
    memory exactly."""
    key = ("state_parts", id(table), cfg.tp, cfg.sequence_parallel, cfg.ep, cfg.zero_stage, cfg.dp, cfg.shard_degree,
           cfg.offload)
    held_parts = env.memo.get(key)
    if held_parts is None:
        parts = state_parts(table, cfg, env)
        held_parts = env.memo[key] = (table, [np.broadcast_to(np.asarray(a, dtype=float), table.parameters.shape)
                                              for a in (parts.weights, parts.gradients, parts.optimizer)])
    zeros = np.zeros(len(starts), dtype=int)
    weights, gradients, optimizer = (range_sums(a[None], zeros, starts, ends) for a in held_parts[1])
    copy = gpu_state_parts(copies, cfg, env)
    temporaries = buffers.step_transient >= buffers.bucket
    step_transient = np.where(temporaries, buffers.step_transient, 0.0)
    step_communication = np.where(temporaries, 0.0, buffers.bucket) + buffers.receive
    in_flight = np.array([state.in_flight for state in peak])
    pending = np.array([state.pending for state in peak])
    made = np.array([state.gradients for state in peak])
    unheld = np.where(stepping | made, 0.0, buffers.gradients)
    columns = {"parameters": weights + copy.weights, "gradients": gradients + copy.gradients - unheld,
               "optimizer_state": optimizer + copy.optimizer,
               "activations": np.where(stepping, 0.0, activations - buffers.batch_views(in_flight, cfg.num_microbatches)
                                       + pending * buffers.weight_gradient_inputs + in_flight * buffers.boundary_back),
               "transient": np.where(stepping, step_transient, transient + np.where(made, buffers.accumulation, 0.0)
                                     + buffers.working_at(made)),
               "communication": np.where(stepping, step_communication, buffers.communication),
               "loss": np.where(stepping | ~np.array([state.loss for state in peak]), 0.0, loss), "batch": buffers.batch}
    # A state holding the loss: at the loss's moment FSDP holds `gathered_with_loss`; else the loss is gone.
    with_loss = ~stepping & np.array([state.loss for state in peak])
    at_loss = with_loss & buffers.loss_moment(made)
    columns["communication"] = np.where(at_loss, buffers.receive + buffers.gathered_with_loss, columns["communication"])
    columns["loss"] = np.where(with_loss & ~at_loss, 0.0, columns["loss"])
    # At the loss's moment no unit's backward working set is held.
    columns["transient"] = np.where(at_loss, columns["transient"] - buffers.working_at(made), columns["transient"])
    if cfg.schedule == "pipedream-2bw":
        columns["stashed_weights"] = held - (weights + gradients + optimizer)
    return StageTerms(tuple(columns), np.stack([np.broadcast_to(np.asarray(c, dtype=float), (len(starts),))
                                                for c in columns.values()], axis=1))


class StageTerms(Sequence):
    """Per stage, {term name: bytes} (`memory_terms`), held as one [stage, term] array and made
    into dicts only when read: the search prices hundreds of configurations and the plan reads
    the terms of one."""

    def __init__(self, names: tuple[str, ...], values: np.ndarray):
        self.names, self.values = names, values

    def __len__(self) -> int:
        return len(self.values)

    def __getitem__(self, stage):
        if isinstance(stage, slice):
            return [self[k] for k in range(len(self))[stage]]
        return dict(zip(self.names, self.values[stage].tolist(), strict=True))


def _price(table, cfg: Config, env: Environment, bounds, stage_modes, times, first, states, zero, p2p, hops,
           flushed: bool = False) -> Evaluation:
    """The iteration time and its breakdown for cuts `bounds` with `stage_modes[k][u]`, the mode
    index (into env.allowed_recompute) of stage k's u-th unit. Sums per unit as the cost table
    does (a range's start term at its first unit's mode; the full-recomputation transient, the
    range's largest, as soon as one unit is full). `flushed`: a pipedream-2bw step the runtime
    runs flushed, timed as 1F1B (`flush_blocker`)."""
    all_modes = env.allowed_recompute
    unit_mode = np.array([r for modes in stage_modes for r in modes])
    units = np.arange(unit_mode.size)
    recompute = tuple(tuple(all_modes[r] for r in modes) for modes in stage_modes)
    full_units = np.array([r == "full" for r in all_modes])[unit_mode]
    rebuilding = np.array([r in REBUILDING for r in all_modes])[unit_mode]
    starts, ends = np.array(bounds).T
    zeros = np.zeros(len(bounds), dtype=int)

    def per_unit(per_mode: dict) -> np.ndarray:
        return np.stack([per_mode[r] for r in all_modes])[unit_mode, units]

    def sums(values: np.ndarray) -> np.ndarray:
        return range_sums(values[None], zeros, starts, ends)

    unit_recompute_s = per_unit(table.recompute_s)
    # Per stage, all stages at once: forward (with recomputation), time, stored activations.
    forward = sums(table.forward_s + unit_recompute_s)
    start_s = np.stack([first[r] for r in all_modes])[unit_mode[starts], starts]
    whole = whole_backward_ranges(table, cfg, starts, ends)
    total = sums(per_unit(times)) + start_s + range_offset_s(table, cfg, starts, ends, p2p, whole)
    stored = sums(per_unit(table.activations))
    held = sums(states)
    stage_groups = [row[1] if whole is not None and whole[k] else row[0]
                    for k, row in enumerate(stage_state_rows(cfg, len(bounds), whole is not None))]
    # The stages cut the units in order, so their ranges are the segments reduceat takes from `starts`.
    transient = np.where(np.logical_or.reduceat(rebuilding, starts), np.maximum.reduceat(table.transient["full"], starts), 0.0)
    copies = table.copy_parameters(starts, ends)
    copy_states = gpu_state_bytes(copies, cfg, env)
    loss = np.where(ends == len(table.parameters), stage_loss_bytes(table, env, cfg), 0.0)
    buffers = stage_buffers(table, cfg, env, starts, ends)
    # Each stage at the largest of its rank's peak states (planner/cost/schedules.py `peak_states`).
    at_states = [[state.in_flight * stored[k] + buffers.state_bytes(state, cfg.num_microbatches)[k]
                  for state in stage_groups[k]] for k in range(len(bounds))]
    peak = [stage_groups[k][int(np.argmax(values))] for k, values in enumerate(at_states)]
    in_flight = np.array([state.in_flight for state in peak])
    forward_backward = held + copy_states + transient + buffers.forward_backward + buffers.loss_or_working \
        + np.array([max(values) for values in at_states])
    stepping = held + copy_states + buffers.step
    memory = np.maximum(forward_backward, stepping)
    half_p2p = p2p[ends - 1] / 2
    fwd = (forward + half_p2p).tolist()
    bwd = np.maximum(total - forward - half_p2p, 0.0).tolist()  # a unit without backward (rotary) can round below 0
    mem = memory.tolist()
    rank_mem = rank_memory(forward_backward, transient, stepping, cfg.pp)
    if max(rank_mem) > env.usable_memory_bytes:
        return Evaluation(cfg, False, "interleaved chunks together exceed memory", min_memory_bytes=max(rank_mem))
    terms = memory_terms(table, cfg, env, starts, ends, held, copies, in_flight * stored, transient, buffers, loss,
                         stepping > forward_backward, peak)
    split = zero_bubble_split(table, cfg, starts, ends, bwd, whole)
    pipeline_s = iteration_time_s(cfg.schedule, fwd, bwd, cfg.num_microbatches, cfg.virtual_stages,
                                  backward_weight_fraction=split or BACKWARD_WEIGHT_FRACTION, flushed=flushed)
    # Overlapped p2p: only the first micro-batch's hops through every cut, there and back.
    fill_s = sum(float(hops[j - 1]) for i, j in bounds[:-1]) if env.overlap.pipeline_p2p else 0.0
    pipeline_s += fill_s
    m = cfg.num_microbatches
    rank_work = [sum(fwd[k] + bwd[k] for k in range(rank, len(fwd), cfg.pp)) for rank in range(cfg.pp)]
    # Once per step: the gradient reduction the backward does not hide, the tied weights'
    # all-reduce and the optimizer step, per pipeline rank.
    grad_s, gather_s, stream = dp_tail(table, cfg, env, bounds, unit_recompute_s)
    tie_s = _tie_all_reduce_s(table, cfg, env, bounds)
    opt_s, pcie_s = [], []
    updated = _updated_per_stage(table, cfg, starts, ends, copies)
    for rank in range(cfg.pp):
        if cfg.offload:  # the AdamW step on the host CPU, and the shards' copies over PCIe
            chunks = bounds[rank::cfg.pp]
            rank_held = sum(float(table.parameters[i:j].sum() + table.copy_parameters(i, j)[0]) for i, j in chunks)
            rank_trained = sum(updated_parameters(table, cfg, i, j) for i, j in chunks) * cfg.zero_dp  # before ZeRO
            cost = offload_step_cost(rank_held, cfg.zero_dp, *fsdp_collective_counts(cfg.zero_stage, m), gpus_per_host=env.gpus_per_node)
            share = rank_trained / rank_held if rank_held else 0.0  # frozen weights are copied in, never stepped or reduced
            opt_s.append(cost.cpu_optimizer_s * share)
            pcie_s.append(cost.host_to_device_s + cost.device_to_host_s * share)
        else:
            opt_s.append(sum(updated[rank::cfg.pp]) * env.optimizer_s_per_param)
            pcie_s.append(0.0)
    stage_acc = sums(accumulation_s(table, cfg, env))
    acc_s = [m * float(stage_acc[rank::cfg.pp].sum()) for rank in range(cfg.pp)]
    tails = [float(d + g + t + o + c + a) for d, g, t, o, c, a in zip(grad_s, gather_s, tie_s, opt_s, pcie_s, acc_s, strict=True)]
    tail = max(tails)
    slowest = int(np.argmax(tails))
    busiest = int(np.argmax(rank_work))
    on_busiest = [(i, j) for k, (i, j) in enumerate(bounds) if k % cfg.pp == busiest]
    busy = np.zeros(unit_mode.size, dtype=bool)  # the busiest rank's units
    for i, j in on_busiest:
        busy[i:j] = True
    busy_full = busy & full_units
    compute = m * float((table.forward_s + table.backward_s + unit_recompute_s)[busy].sum())
    # Full recomputation replays the forward's TP collectives: communication, not compute.
    replayed = m * float(table.recompute_tp_comm_s[busy_full].sum())
    compute -= replayed
    # EP's all-to-alls and CP's K/V gathers, and their replay under full recomputation.
    token_comm = {}
    for label, (comm, in_recompute) in table.sequence_comm().items():
        again = m * float(in_recompute[busy_full].sum())
        compute -= again
        token_comm[label] = again + m * float(comm[busy].sum())
    tp_exposed = tp_comm_s(table, cfg, env)
    tp_comm = replayed + m * float(tp_exposed[busy].sum())
    p2p_total = m * sum(float(p2p[j - 1]) for i, j in on_busiest) + fill_s
    zero_total = m * (float(per_unit({r: zero[r][0] for r in all_modes})[busy].sum())
                      + sum(float(zero[all_modes[unit_mode[i]]][1][i]) for i, j in on_busiest))
    bubble = max(pipeline_s - fill_s - m * rank_work[busiest], 0.0)
    model_flops = m * cfg.dp * float(table.model_flops.sum())
    hw_flops = model_flops + m * cfg.dp * float(per_unit(table.recompute_flops).sum())
    return Evaluation(
        cfg, True,
        iteration_time_s=float(pipeline_s + tail),
        bounds=tuple(bounds),
        stage_recompute=_majority_modes(unit_mode, starts, all_modes),
        unit_recompute=recompute,
        stage_forward_s=tuple(fwd),
        stage_backward_s=tuple(bwd),
        stage_weight_fraction=tuple(split),
        peak_memory_bytes=tuple(mem),
        rank_memory_bytes=tuple(rank_mem),
        memory_terms=terms,
        reduction_stream=stream,
        breakdown_s={
            "compute": compute,
            "tp_comm": tp_comm,
            **token_comm,
            "p2p": p2p_total,
            "bubble": bubble,
            "grad_accumulation": acc_s[slowest],
            "dp_comm": grad_s[slowest] + gather_s[slowest] + zero_total,
            "tie_comm": tie_s[slowest],
            "optimizer": opt_s[slowest],
            **({"offload_pcie": pcie_s[slowest]} if cfg.offload else {}),
        },
        bubble_fraction=bubble / (pipeline_s + tail) if pipeline_s + tail > 0 else 0.0,
        model_flops=model_flops,
        hardware_flops=hw_flops,
    )


def _majority_modes(unit_mode: np.ndarray, starts: np.ndarray, modes: tuple[str, ...]) -> tuple[str, ...]:
    """`majority_mode` of every stage at once: `unit_mode` the mode index (into `modes`) of each
    unit, the stages the consecutive segments beginning at `starts`."""
    counts = np.add.reduceat(np.eye(len(modes), dtype=np.int64)[unit_mode], starts, axis=0)  # [stage, mode]
    # Most units first, then the mode that recomputes least (earliest in RECOMPUTE).
    score = counts * (len(RECOMPUTE) + 1) - np.array([RECOMPUTE.index(r) for r in modes])
    return tuple(modes[k] for k in score.argmax(axis=1).tolist())


def majority_mode(modes: tuple[str, ...]) -> str:
    """The mode most units run (ties: the one that recomputes least), a stage's `recompute` in
    the plan; the others are listed per unit (planner/plan.py `Stage.unit_recompute`)."""
    order = RECOMPUTE
    return max(order, key=lambda r: (modes.count(r), -order.index(r)))


def _tie_all_reduce_s(table, cfg: Config, env: Environment, bounds) -> list[float]:
    """Per pipeline rank: its all-reduces of tied weights' gradients, one per tied weight whose
    copies sit on several pipeline ranks (Megatron-LM's embedding all-reduce), once per step.
    The gradient is summed as this rank holds it: whole under ZeRO 0 (after the dp all-reduce),
    its 1/dp shard under FSDP2 (ZeRO >= 1). Copies on one rank are summed locally (free)."""
    out = [0.0] * cfg.pp
    if env.tie_all_reduce_s is None:
        return out
    grad_bytes = env.precision.reduce_bytes
    starts = [i for i, _ in bounds]  # the stages cut the units in order: unit u is in the last stage starting at or before it
    for tie in table.tied:
        ranks = sorted({(bisect.bisect_right(starts, u) - 1) % cfg.pp for u in tie.units})
        if len(ranks) > 1:
            nbytes = tie.num_parameters * grad_bytes / (cfg.zero_dp if cfg.zero_stage >= 1 else 1)
            seconds = env.tie_all_reduce_s(nbytes, tuple(ranks), cfg.dp * cfg.tp)
            for rank in ranks:
                out[rank] += seconds
    return out
