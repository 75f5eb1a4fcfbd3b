"""Per-unit costs under one intra-op setting: what the inter-op DP and the search add up.

For a tensor-parallel degree t, sequence parallelism on/off and a micro-batch size b, every
unit gets its forward/backward time per GPU, TP collectives, parameters per GPU, and
activation bytes per recomputation mode (planner/cost/compute.py, planner/cost/memory.py,
planner/solver/intra_op.py). Identical units (same fingerprint) share one ILP solve.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import numpy as np

from planner.cost.compute import (
    ComputeModel,
    interpolate,
    sharded_flop_fraction,
    tp_time_s,
)
from planner.cost.cp import attention_share, cp_unit_s, gathered_kv_bytes, kv_bytes, saved_kv_bytes
from planner.cost.fp8 import converted_ops, price_fp8_unit, skipped_units
from planner.cost.memory import DTYPE_SIZES, op_activation_bytes, unit_activation_bytes
from planner.cost.moe import (
    ALL_TO_ALLS_PER_STEP,
    COUNT_BYTES,
    ETP_ALL_REDUCES_PER_STEP,
    dispatch_bytes_per_rank,
    expert_time_ratio,
    expert_tp_all_reduce_bytes,
    moe_shapes,
    permutation_s,
)
from planner.plan import RECOMPUTE
from planner.profile_schema import Profile, Unit
from planner.solver.intra_op import (
    SHARDED,
    IntraOpProblem,
    IntraOpSolution,
    OpGraph,
    evaluate,
    moe_blocks,
    solve_intra_op,
    unit_scale_graph,
)

RECOMPUTE_MODES = RECOMPUTE
KEEPS_OUTPUT = ("none", "selective")
"""Modes in which a unit keeps what it saved of its own output: full recomputation keeps the
unit's input only, and op-level keeps the saved ops' outputs and the input (planner/cost/memory.py
`op_activation_bytes`)."""
DTYPE_BYTES = DTYPE_SIZES


@dataclass(frozen=True)
class TiedWeight:
    """A parameter that several units share (a tied input embedding and output head)."""

    units: tuple[int, ...]
    """Indices of the units using it, ascending; the first owns it in the profile."""
    num_parameters: float
    """Its size per GPU (elements): 1/t of it where TP shards it (`UnitCosts.tie_pins`)."""


@dataclass(frozen=True)
class UnitCostTable:
    """Arrays over units (index = unit position) for one (t, sp, b) setting."""

    forward_s: np.ndarray
    """Forward compute per GPU, one micro-batch."""
    backward_s: np.ndarray
    """Backward compute per GPU, one micro-batch."""
    tp_comm_s: np.ndarray
    """TP collectives per micro-batch (forward + backward)."""
    recompute_s: dict[str, np.ndarray]
    """Extra forward work per micro-batch for each recomputation mode (full recomputation
    replays the forward's TP collectives too, as activation checkpointing of a TP module does)."""
    recompute_tp_comm_s: np.ndarray
    """The TP collectives inside `recompute_s["full"]` (for the breakdown)."""
    parameters: np.ndarray
    """Parameters held per GPU (after TP sharding, before ZeRO)."""
    activations: dict[str, np.ndarray]
    """Stored activation bytes per micro-batch, per recomputation mode."""
    transient: dict[str, np.ndarray]
    """Transient bytes during backward, per recomputation mode."""
    cut_bytes: np.ndarray
    """Bytes crossing the cut after each unit (last entry 0)."""
    model_flops: np.ndarray
    """Forward + backward FLOPs of one micro-batch (whole unit, all TP ranks together)."""
    recompute_flops: dict[str, np.ndarray]
    """Extra forward FLOPs per recomputation mode."""
    tp_plans: list[dict[str, str]]
    """Per unit: module path relative to the unit -> DTensor style ("" is the unit itself)."""
    tp_feeds: list[dict[str, list[str]]] = field(default_factory=list)
    """Per unit: each row-parallel op -> the column-parallel ops it reads sharded
    (planner/solver/intra_op.py `sharded_feeds`, op names); empty without TP."""
    output_bytes: float = 0.0
    """The model output of one micro-batch (the last unit's output), the loss's input
    (planner/cost/memory.py `loss_bytes`)."""
    output_element_bytes: int = 2
    """Bytes per element of that output (the training dtype's)."""
    input_bytes: float = 0.0
    """The model's inputs of one micro-batch, held by the first stage's rank through the step
    (planner/profile_schema.py `ModelInfo.input_bytes_per_sample`)."""
    target_bytes: float = 0.0
    """The targets of one micro-batch, held by the last stage's rank."""
    weight_gradient_inputs: np.ndarray | None = None
    """Per unit, bytes of its weight ops' output gradients for one micro-batch (per GPU): what a
    weight gradient deferred past the input gradient's pass keeps (zero bubble's W: torch's
    `stage_backward_input` holds them for `stage_backward_weight`). None: not known (0)."""
    weight_gradient_share: np.ndarray | None = None
    """Per unit, the share of its backward its weight GEMMs take (planner/cost/compute.py
    `weight_gradient_share`): zero bubble's W. None: not known (the common split)."""
    split_backward_extra_s: np.ndarray | None = None
    """Per unit, what its backward costs more when zero bubble runs it as B then W on a stage after
    the first, one micro-batch (planner/cost/compute.py `split_backward`: measured on this
    device, never below 0). None: not measured (the split priced as free)."""
    backward_working: np.ndarray | None = None
    """Per unit, the bytes its backward holds at once beyond its saved activations, one
    micro-batch, per GPU, with no gradient held before (`UnitCosts.backward_working_bytes`, split
    over TP as its activations). 0 where the profile did not record it; None: not known."""
    backward_working_held: np.ndarray | None = None
    """The same where the gradients are held already (`UnitCosts.backward_working_held_bytes`)."""
    boundary_saved: np.ndarray | None = None
    """Per unit, the bytes of one micro-batch it keeps of its own output where the next unit keeps
    that tensor as its input (`UnitCosts.saved_output_bytes`, `saved_input_bytes`: an in-place
    ReLU and the convolution after it). `activations` counts them once, with the next unit, in
    the modes that keep a unit's output (none, selective); a stage range adds back its last
    unit's (planner/solver/search.py `StageBuffers.boundary_back`), whose next unit is another
    stage's, whatever that unit's mode (where it recomputes fully, counted twice: the safe side).
    None: none known."""
    stage_start_saved: np.ndarray | None = None
    """Per unit, what it keeps beyond `activations` of one micro-batch when it starts a pipeline
    stage, whose received floating inputs all require grad (`UnitCosts.stage_start_saved_bytes`
    less `saved_bytes`, split over TP as its activations are): a stage range beginning there
    adds it (planner/solver/search.py `StageBuffers.boundary_back`), whatever the unit's mode
    (the safe side under full recomputation). None: no unit keeps more."""
    batch_saved: float = 0.0
    """Of the first unit's stored activations of one micro-batch, the inputs it saves when it takes
    the batch as given (`UnitCosts.saved_input_bytes`): views of the batch, which `input_bytes`
    counts already."""
    tied: tuple[TiedWeight, ...] = ()
    """Parameters shared by several units (tied embeddings). `parameters` counts each in its
    first unit; a stage holding another of its units holds a copy too (`copy_parameters`)."""
    whole_backward: np.ndarray | None = None
    """Per unit, True where it holds a trained parameter yet consumes no floating-point tensor
    (`Unit.float_fed`: an embedding of token ids): a zero-bubble stage after the first holding
    one runs its whole backward at B (runtime/pp_split.py `needs_full_backward`). None: none do."""
    expert_parameters: np.ndarray | None = None
    """The part of `parameters` that are MoE experts' (after EP: 1/ep of them): their gradients
    and optimizer state are sharded and reduced over expert data parallelism, not dp
    (planner/cost/moe.py). None: a dense model."""
    expert_forward_s: np.ndarray | None = None
    """The part of `forward_s` spent in the experts' GEMMs (at this table's EP degree)."""
    expert_backward_s: np.ndarray | None = None
    """The part of `backward_s` spent in the experts' GEMMs."""
    ep_comm_s: np.ndarray | None = None
    """EP all-to-alls per micro-batch (dispatch and combine, forward and backward); None: no EP."""
    recompute_ep_comm_s: np.ndarray | None = None
    """The all-to-alls inside `recompute_s["full"]` (the replayed forward's dispatch and combine)."""
    ep_degree: int = 1
    """Expert-parallel degree the table is priced at."""
    cp_comm_s: np.ndarray | None = None
    """CP's K/V all-gathers and their gradients' reduce-scatters per micro-batch; None: no CP."""
    recompute_cp_comm_s: np.ndarray | None = None
    """The gathers inside `recompute_s["full"]` (the replayed forward gathers K/V again)."""
    tp_async_comm_s: np.ndarray | None = None
    """`tp_comm_s` as async TP leaves it exposed, each collective overlapped with the GEMMs it feeds
    or follows (planner/solver/intra_op.py `async_exposed_s`); set for every table with tp > 1."""
    fp8_weight_parameters: np.ndarray | None = None
    """Per unit (per TP rank), weights of the linears running in FP8: FSDP all-gathers them in
    FP8, 1 byte per element (planner/cost/fp8.py). None: no FP8."""
    fp8_flops: np.ndarray | None = None
    """Per unit, model FLOPs (forward + backward, one micro-batch, whole unit) done in FP8 linears."""

    largest_parameter: np.ndarray | None = None
    """Per unit, elements of its largest parameter tensor per GPU (after TP where the unit shards):
    what AdamW's temporaries hold on CPU, where it steps tensor by tensor
    (planner/cost/memory.py `optimizer_transient_bytes`). None: not known (0)."""

    frozen_parameters: np.ndarray | None = None
    """The part of `parameters` that does not train (requires_grad False: a LoRA model's base
    weights): held and gathered like any weight, but without gradients, optimizer state,
    gradient reduction or optimizer step. Their missing weight-gradient GEMMs are already
    absent from the profiled backward (the profiler runs the model as built). None: all train."""

    def sequence_comm(self) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """Label -> (communication per micro-batch, the part replayed by full recomputation) of
        the collectives that move tokens: EP's all-to-alls and CP's K/V gathers."""
        out = {}
        if self.ep_comm_s is not None and self.recompute_ep_comm_s is not None:
            out["ep_comm"] = (self.ep_comm_s, self.recompute_ep_comm_s)
        if self.cp_comm_s is not None and self.recompute_cp_comm_s is not None:
            out["cp_comm"] = (self.cp_comm_s, self.recompute_cp_comm_s)
        return out

    def dense_parameters(self) -> np.ndarray:
        """`parameters` less the experts': what ZeRO shards and dp gathers."""
        return self.parameters if self.expert_parameters is None else self.parameters - self.expert_parameters

    def trained_dense_parameters(self) -> np.ndarray:
        """`dense_parameters` less the frozen ones: what holds gradients and dp reduces."""
        dense = self.dense_parameters()
        return dense if self.frozen_parameters is None else dense - self.frozen_parameters

    def copy_parameters(self, start, end) -> np.ndarray:
        """Parameters of unit range(s) [start, end) beyond `parameters`: the copies of tied weights
        a stage holds because it has a unit of the tie but not the first one (Megatron-LM's
        embedding copy on the last stage). It depends on the range alone, so the DP stays exact."""
        start, end = np.atleast_1d(start), np.atleast_1d(end)
        total = np.zeros(start.shape)
        for tie in self.tied:
            units = np.array(tie.units)[:, None]
            holds = ((units >= start) & (units < end)).any(axis=0)
            owns = (tie.units[0] >= start) & (tie.units[0] < end)
            total += np.where(holds & ~owns, tie.num_parameters, 0.0)
        return total

    def without_ties(self) -> UnitCostTable:
        """The same table priced as if every shared weight were held once (for comparisons)."""
        return replace(self, tied=())


def _score_bytes(unit: Unit, scale: float, dtype_bytes: int) -> float:
    """Attention scores a materialised attention keeps (softmax out, dropout mask and out).

    Korthikanti's 5·a·s²·b bytes in 16-bit = 2.5 x the score tensor. A fused attention op
    (`attention`, scaled_dot_product_attention) keeps none.
    """
    total = 0.0
    for op in unit.ops:
        shape = op.output_shape
        if op.kind == "matmul" and len(shape) >= 4 and shape[-1] == shape[-2]:
            total += 2.5 * math.prod(shape) * dtype_bytes * scale
    return total


REPLAYING = ("full", "op")
"""Modes whose recomputed forward replays the unit's collectives (TP's, EP's all-to-alls, CP's
K/V gathers): `full` replays the whole forward; `op` saves matmul and attention outputs but
not the collectives' (torchtitan's save list keeps only reduce-scatters; counted as replayed)."""


SPLIT_OUTPUTS = {"colwise", "heads", "sequence", "F", "S"}
"""Strategies (planner/solver/intra_op.py) whose output each TP rank holds a slice of: a column
shard's features, an attention's heads, a sequence shard. A row shard's output is summed whole
(all-reduce), or sequence-sharded under SP (reduce-scatter); so is the unit's input."""


def split_saved_share(unit: Unit, strategies: dict[str, str], sequence_parallel: bool) -> float | None:
    """The share of `unit`'s saved bytes that its TP layout splits over the ranks, from what it
    saves by the ops it was computed from (`Unit.saved_regions`): a region is split when every
    op it comes from has a split output under `strategies` (`SPLIT_OUTPUTS`; a row shard's or
    the unit's input under sequence parallelism, whose activations between the sandwiches are
    sequence-sharded: Korthikanti et al. 2022, section 4.2.2). A unit whose attention stays
    replicated while its MLP is sharded (BERT on two CPU ranks) splits its MLP's share alone.
    None for a profile without regions (written before 2026-11-28)."""
    if not unit.saved_regions:
        return None

    def split(op: str) -> bool:
        if op == "input" or strategies.get(op) == "rowwise":
            return sequence_parallel
        return strategies.get(op) in SPLIT_OUTPUTS

    total = sum(r.bytes for r in unit.saved_regions)
    if total <= 0:
        return None
    return sum(r.bytes for r in unit.saved_regions if r.ops and all(split(op) for op in r.ops)) / total


def op_checkpoint_terms(unit: Unit, scale: float, dtype_bytes: int, t: int,
                        strategies: dict[str, str]) -> tuple[float, float]:
    """What torchtitan's op-level selective checkpointing keeps of a unit (its policy,
    torchtitan/distributed/activation_checkpoint.py `_apply_op_sac`: save the outputs of every
    op in the save list, attention and matmuls, except every second matmul, in forward order;
    recompute all else): (the saved ops' output bytes per micro-batch per GPU, their share of
    the unit's forward FLOPs). A saved output is divided by t where TP leaves it sharded
    (colwise, heads, sequence; a rowwise output is a full partial sum)."""
    linear = [op for op in unit.ops if op.kind == "linear"]
    kept = [op for k, op in enumerate(linear) if k % 2 == 0] + [op for op in unit.ops if op.kind == "attention"]
    out = sum(math.prod(op.output_shape) * dtype_bytes * scale / (t if strategies.get(op.name) in SAVED_SHARDED else 1)
              for op in kept)
    total = max(unit.costs[min(unit.costs)].forward_flops, sum(op.forward_flops for op in unit.ops), 1)
    return out, min(sum(op.forward_flops for op in kept) / total, 1.0)


SAVED_SHARDED = {"colwise", "heads", "sequence"}
"""TP strategies (planner/solver/intra_op.py) whose output each rank holds 1/t of."""


def _attention_flop_share(unit: Unit) -> float:
    flops = sum(op.forward_flops for op in unit.ops)
    core = sum(op.forward_flops for op in unit.ops if op.kind in ("attention", "matmul"))
    return core / flops if flops else 0.0


def _at(unit: Unit, field: str, b: float) -> float:
    """`field` of `unit`'s costs at micro-batch b, interpolated between the profiled sizes (None as 0)."""
    return interpolate({k: float(getattr(c, field) or 0) for k, c in unit.costs.items()}, b)


class UnitCosts:
    """Builds `UnitCostTable`s, caching ILP solutions per (fingerprint, t, sp)."""

    def __init__(self, profile: Profile, compute: ComputeModel, tp_collectives, dtype: str,
                 ep_all_to_all_s=None, imbalance: float = 1.0, float8: bool = False, cp_collectives=None,
                 expert_tp: int = 1, float8_tp_gather: bool = False, float8_shared_casts: bool = False):
        self.profile, self.compute, self.dtype = profile, compute, dtype
        self.dtype_bytes = DTYPE_BYTES[dtype]
        self.tp_collectives = tp_collectives  # t -> object with all_reduce_s(nbytes) etc.
        self.ep_all_to_all_s = ep_all_to_all_s  # (bytes one rank sends, ep, tp, folded) -> s
        self.cp_collectives = cp_collectives  # (cp, tp) -> planner/cost/cp.py CpCollectives of a CP group
        self.imbalance = imbalance  # MoE routing: busiest rank's load over the balanced one
        self.expert_tp = expert_tp  # experts split over the TP ranks (pinned only: Pins.expert_tp; planner/cost/moe.py)
        self.float8 = float8  # linears in FP8 (planner/cost/fp8.py); the runtime's filter skips the same units
        self.fp8_skip = skipped_units(profile) if float8 else ()
        self.float8_tp_gather = float8 and float8_tp_gather  # FP8 inputs gathered under TP (`Pins.float8_tp_gather`)
        self.float8_shared_casts = float8 and float8_shared_casts  # one cast per shared input (`Pins.float8_shared_casts`)
        self._ilp: dict[tuple, IntraOpSolution] = {}
        self._graphs: dict[tuple, OpGraph] = {}  # `tp_solution`'s unit-scale graphs
        self._tables: dict[tuple, UnitCostTable] = {}
        self._layer_seconds: dict[tuple, dict[int, list[tuple[float, float]]]] = {}  # per (t, sp, b), from `_build`
        self._built: dict[tuple[int, bool, float], UnitCostTable] = {}  # `_plain`
        self._groups: list[tuple[Unit, np.ndarray]] | None = None  # `_content_groups`
        self._tie_pins: dict[tuple[int, bool], dict[int, tuple[tuple[str, str], ...]]] = {}  # `tie_pins`
        self.base_mbs = min(profile.micro_batch_sizes)

    @staticmethod
    def moe_ops(unit: Unit) -> frozenset[str]:
        """The unit's ops the TP ILP keeps replicated for its MoE layers. Experts are not
        tensor-parallel (expert TP off, Megatron-Core's default ETP 1), and a router must see
        every expert's logit to pick the top k."""
        modules = tuple(m for layer in unit.moe for m in (layer.experts, layer.router) if m)
        return frozenset(op.name for op in unit.ops if op.module is not None and any(
            op.module == m or op.module.startswith(m + ".") for m in modules))

    def _problem(self, unit: Unit, t: int, sp: bool, b: float, pinned: tuple[tuple[str, str], ...] = ()) -> IntraOpProblem:
        return IntraOpProblem(
            ops=tuple(unit.ops),
            replicated_ops=self.moe_ops(unit),
            moe_blocks=moe_blocks(unit),
            mixes_tokens=bool(unit.mixes_tokens),
            fp8_gathered_ops=converted_ops(unit, self.fp8_skip) if self.float8_tp_gather else frozenset(),
            tp_degree=t,
            dtype_bytes=self.dtype_bytes,
            seconds_per_flop=1.0 / self.compute.gpu.achievable_flops(self.dtype),
            collectives=self.tp_collectives(t),
            activation_scale=b / self.base_mbs,
            sequence_parallel=sp,
            # Under TP every unit shards its largest weight where it can (constraint `pinned_tp`):
            # a TP group that replicates it runs or holds it t times over, which no runtime's TP does.
            require_sharding=t > 1,
            pinned_ops=pinned,
        )

    def tp_solution(self, unit: Unit, t: int, sp: bool, b: float,
                    pinned: tuple[tuple[str, str], ...] = ()) -> IntraOpSolution:
        """The ILP's answer at the smallest profiled micro-batch, re-priced at b (cached per structure)."""
        key = (unit.fingerprint, t, sp, pinned)
        if key not in self._ilp:
            self._ilp[key] = solve_intra_op(self._problem(unit, t, sp, self.base_mbs, pinned))
        if b == self.base_mbs:
            return self._ilp[key]
        if (*key, b) not in self._ilp:
            # The ops the solver kept replicated stay offered so (under SP they may not be otherwise).
            chosen = self._ilp[key].strategies
            kept = frozenset(n for n, s in chosen.items() if s == "replicate")
            problem = replace(self._problem(unit, t, sp, b, pinned), replicated_ops=kept)
            if ("graph", *key) not in self._graphs:  # one per structure, scaled to each micro-batch
                self._graphs[("graph", *key)] = unit_scale_graph(problem)
            self._ilp[(*key, b)] = evaluate(problem, chosen, self._graphs[("graph", *key)])
        return self._ilp[(*key, b)]

    def tie_pins(self, t: int, sp: bool) -> dict[int, tuple[tuple[str, str], ...]]:
        """Per unit of a weight tied across units that TP shards at (t, sp): its op holding the
        shared weight with the strategy that shards the weight along its first dimension, the
        vocabulary (an embedding's `rowwise`, a linear head's `colwise`), as Megatron-LM shards a
        tied input embedding and output layer (`VocabParallelEmbedding` and a column-parallel
        output reading its weight). DTensor gives each holder a copy of its own, which the runtime
        ties again (runtime/build.py `retie`), so every holder must place it alike.
        A tie stays replicated (its units absent here) where a unit holds it other than as one
        embedding or linear, or where a holder cannot shard it so: t does not divide the
        vocabulary, or the ILP's runnable answer (`solve_intra_op`) replicates it."""
        if (t, sp) not in self._tie_pins:
            pins: dict[int, tuple[tuple[str, str], ...]] = {}
            for tie in tied_weights(self.profile) if t > 1 else ():
                holders = {}
                for i in tie.units:
                    ops = [op for op in self.profile.units[i].ops
                           if op.weight_shape and math.prod(op.weight_shape) == tie.num_parameters]
                    if len(ops) != 1 or ops[0].kind not in ("embedding", "linear"):
                        break
                    vocab = "rowwise" if ops[0].kind == "embedding" or ops[0].weight_in_out else "colwise"
                    holders[i] = ((ops[0].name, vocab),)
                else:
                    solved = {i: self.tp_solution(self.profile.units[i], t, sp, self.base_mbs, pin).strategies
                              for i, pin in holders.items()}
                    if all(solved[i].get(name) == vocab for i, pin in holders.items() for name, vocab in pin):
                        pins.update(holders)
            self._tie_pins[(t, sp)] = pins
        return self._tie_pins[(t, sp)]

    def table(self, t: int, sp: bool, b: int, ep: int = 1, cp: int = 1, cp_algorithm: str = "all-gather") -> UnitCostTable:
        key = (t, sp, b, ep, cp) if cp == 1 else (t, sp, b, ep, cp, cp_algorithm)
        if key not in self._tables:
            if cp > 1:
                assert ep == 1, "the search never combines EP and CP (both fold onto dp)"
                self._tables[key] = self._with_cp(self._plain(t, sp, b / cp), t, b, cp, cp_algorithm)
            else:
                etp = self.expert_tp > 1  # priced from the plain table: `table(t, sp, b)` would carry it already
                self._tables[key] = self._plain(t, sp, b) if ep == 1 and not etp else \
                    self._with_ep(self._plain(t, sp, b) if etp else self.table(t, sp, b), t, sp, b, ep)
        return self._tables[key]

    def _plain(self, t: int, sp: bool, b: float) -> UnitCostTable:
        """`_build`, once per (t, sp, b): CP's tables at (b, cp) share the one at b / cp (b = 4 with
        cp 2 and b = 2 with cp 1, say); `_with_cp` copies what it changes."""
        key = (t, sp, float(b))
        if key not in self._built:
            self._built[key] = self._build(t, sp, b)
        return self._built[key]

    def _with_cp(self, part: UnitCostTable, t: int, b: int, cp: int, algorithm: str) -> UnitCostTable:
        """A rank's share under context parallelism (planner/cost/cp.py): `part` is the table at
        micro-batch b / cp (its tokens and its share of the balanced causal attention); to it,
        `algorithm`'s messages of the whole sequence's K/V (each TP rank its heads' 1/t; the ring's
        hidden behind the unit's attention time, `attention_share` of its compute), the other
        ranks' K/V that attention saves for backward (not under full recomputation), and the
        ring's blocks in flight (transient)."""
        if self.cp_collectives is None:
            raise ValueError("UnitCosts needs cp_collectives to price context parallelism")
        collectives = self.cp_collectives(cp, t)
        n = len(self.profile.units)
        comm, rec_comm = np.zeros(n), np.zeros(n)
        act = {m: v.copy() for m, v in part.activations.items()}
        rec = {m: v.copy() for m, v in part.recompute_s.items()}
        transient = {m: v.copy() for m, v in part.transient.items()}
        for u, indices in self._content_groups():  # one evaluation per distinct unit (`_content_groups`)
            kv, share = kv_bytes(u, b, self.dtype_bytes) / t, attention_share(u)
            forward, backward = cp_unit_s(algorithm, kv, cp, collectives, part.forward_s[u.index] * share,
                                          part.backward_s[u.index] * share)
            comm[indices] = forward + backward
            rec_comm[indices] = forward
            for mode in REPLAYING:  # the recomputed forward gathers again
                rec[mode][indices] += forward
            for mode in ("none", "selective"):
                act[mode][indices] += saved_kv_bytes(kv, cp, algorithm)
            if algorithm == "ring":
                for mode in transient:
                    transient[mode][indices] += gathered_kv_bytes(kv, cp, algorithm)
        return replace(part, cp_comm_s=comm, recompute_cp_comm_s=rec_comm, activations=act, recompute_s=rec,
                       transient=transient)

    def _expert_shares(self, unit: Unit, b: float) -> list[tuple[float, float]]:
        """Per MoE layer of the unit: the share of the unit's (forward, backward) time its experts
        take in the profile. Applied to the time the cost model uses, so a roofline re-target or
        a whole-model ratio applies to the experts alike."""
        costs = unit.costs
        fwd = interpolate({k: c.forward_time_s for k, c in costs.items()}, b)
        bwd = interpolate({k: c.backward_time_s for k, c in costs.items()}, b)
        shares = []
        for layer in unit.moe:
            lf = interpolate({k: c.expert_forward_time_s for k, c in layer.costs.items()}, b)
            lb = interpolate({k: c.expert_backward_time_s for k, c in layer.costs.items()}, b)
            shares.append((min(lf / fwd, 1.0) if fwd > 0 else 0.0, min(lb / bwd, 1.0) if bwd > 0 else 0.0))
        return shares

    def _unit_seconds(self, unit: Unit, t: int, sp: bool, b: float, sharded_ops: set[str]) -> tuple[float, float, list]:
        """(forward, backward) seconds per GPU under the TP plan, and per MoE layer its experts'
        part of them. Experts are never TP-sharded: their time is whole, or / tp under sequence
        parallelism (each TP rank routes its slice of the sequence); the rest of the unit scales
        with the share of its (non-expert) FLOPs the plan shards (`tp_time_s`)."""
        time = self.compute.unit_time(unit, b)
        shares = self._expert_shares(unit, b)
        if not sharded_ops:
            return time.forward_s, time.backward_s, [(time.forward_s * f, time.backward_s * bk) for f, bk in shares]
        smallest = min(unit.costs)
        unit_flops = max(unit.costs[smallest].forward_flops, sum(op.forward_flops for op in unit.ops), 1)
        expert_flops = sum(layer.costs[min(layer.costs)].expert_forward_flops for layer in unit.moe)
        dense = max(unit_flops - expert_flops, 1)
        fraction = min(sharded_flop_fraction(unit, sharded_ops) * unit_flops / dense, 1.0)
        split = t if sp else 1
        layers = [(time.forward_s * f / split, time.backward_s * bk / split) for f, bk in shares]
        ef, eb = sum(f for f, _ in shares), sum(bk for _, bk in shares)
        return (tp_time_s(time.forward_s * (1 - ef), fraction, t, sp) + sum(f for f, _ in layers),
                tp_time_s(time.backward_s * (1 - eb), fraction, t, sp) + sum(bk for _, bk in layers), layers)

    def _copy_s(self, unit: Unit, strategies: dict[str, str], t: int, sp: bool, scale: float) -> float:
        """Seconds of the copies the runtime makes of sharded outputs the model writes in place
        (runtime/apply_tp.py `_copy_local_outputs`; the plan's `Stage.tp_copy_outputs`): one read
        and one write of each local output at the GPU's bandwidth, per forward (a recomputed
        forward makes them again; a clone's backward passes the gradient through). The local
        output is a colwise module's slice of the features, a rowwise one's whole (reduced) output,
        or under sequence parallelism its slice of the sequence."""
        local = sum(math.prod(op.output_shape) * scale / (1 if strategies[op.name] == "rowwise" and not sp else t)
                    for op in unit.ops if op.output_written_in_place and strategies.get(op.name) in ("colwise", "rowwise"))
        return 2 * local * self.dtype_bytes / self.compute.gpu.achievable_bandwidth * self.compute.slowdown

    def _with_ep(self, base: UnitCostTable, t: int, sp: bool, b: int, ep: int) -> UnitCostTable:
        """`base` (ep 1) with the experts spread over ep ranks (planner/cost/moe.py): experts'
        GEMM time rescaled, permutation and all-to-alls added, experts' parameters / ep."""
        if self.ep_all_to_all_s is None:
            raise ValueError("UnitCosts needs ep_all_to_all_s to price expert parallelism")
        n = len(self.profile.units)
        fwd, bwd = base.forward_s.copy(), base.backward_s.copy()
        exp_fwd, exp_bwd = np.zeros(n), np.zeros(n)
        comm, rec_comm = np.zeros(n), np.zeros(n)
        rec = {m: v.copy() for m, v in base.recompute_s.items()}
        gpu = self.compute.gpu
        flops_per_s, bytes_per_s = gpu.achievable_flops(self.dtype), gpu.achievable_bandwidth
        folded = sp and t > 1
        etp = self.expert_tp
        assert etp == 1 or (etp == t and not sp), "check_pins keeps expert TP at the TP degree, without SP"
        for u in self.profile.units:
            i = u.index
            for (f, bk), shape in zip(self._layer_seconds[(t, sp, b)].get(i, []),
                                      moe_shapes(u, b, self.dtype_bytes, t if sp else 1), strict=True):
                ratio = expert_time_ratio(shape, ep, flops_per_s, bytes_per_s, self.imbalance, etp)
                perm = permutation_s(shape, ep, bytes_per_s, self.imbalance) * self.compute.slowdown
                a2a = self.ep_all_to_all_s(dispatch_bytes_per_rank(shape, ep, self.imbalance), ep, t, folded)
                counts = self.ep_all_to_all_s(COUNT_BYTES * shape.num_experts, ep, t, folded)  # each forward's splits
                if etp > 1:  # expert TP's all-reduces ride with the all-to-alls: 2 per step, the forward's replayed
                    a2a += self.tp_collectives(t).all_reduce_s(expert_tp_all_reduce_bytes(shape, etp)) \
                        * ETP_ALL_REDUCES_PER_STEP / ALL_TO_ALLS_PER_STEP
                exp_fwd[i] += f * ratio
                exp_bwd[i] += bk * ratio
                fwd[i] += f * (ratio - 1) + perm
                bwd[i] += bk * (ratio - 1) + perm
                for mode in REPLAYING:  # the recomputed forward dispatches and combines again
                    rec[mode][i] += f * (ratio - 1) + perm + 2 * a2a + counts
                rec_comm[i] += 2 * a2a + counts
                comm[i] += ALL_TO_ALLS_PER_STEP * a2a + counts
        assert base.expert_parameters is not None, "only a model with experts is priced with ep > 1"
        experts = base.expert_parameters / (ep * etp)
        return replace(base, forward_s=fwd, backward_s=bwd, recompute_s=rec,
                       parameters=base.parameters - base.expert_parameters + experts, expert_parameters=experts,
                       expert_forward_s=exp_fwd, expert_backward_s=exp_bwd, ep_comm_s=comm,
                       recompute_ep_comm_s=rec_comm, ep_degree=ep)

    def _content_groups(self) -> list[tuple[Unit, np.ndarray]]:
        """The profile's units grouped by everything `_unit_row` reads (a representative and the
        indices of its group): the blocks of an analytic profile are one group, so a table costs
        a few unit evaluations, not one per layer (issue #17). A unit's name and index are left
        out, except with FP8, whose filter and TP plan name modules by FQN; and tied units stay
        apart (TP shards them only with every holder of the tie: `tie_pins`), so the key holds
        whether a unit is tied."""
        if self._groups is None:
            tied = tied_unit_indices(self.profile)
            by_key: dict[tuple, list[int]] = {}
            for u in self.profile.units:
                content = u.model_dump_json(exclude=None if self.float8 else {"name", "index"})
                by_key.setdefault((content, u.index in tied), []).append(u.index)
            units = self.profile.units
            self._groups = [(units[indices[0]], np.array(indices)) for indices in by_key.values()]
        return self._groups

    def _unit_row(self, u: Unit, t: int, sp: bool, b: float, tied: bool) -> dict:
        """One unit's entries of the table at (t, sp, b): `_build`'s arrays by name, and its TP
        plan and MoE layers' (fwd, bwd) seconds."""
        scale = b / self.base_mbs
        # Units sharing a weight shard it along the vocabulary, all alike, or stay replicated (`tie_pins`).
        pins = self.tie_pins(t, sp) if tied else {}
        sharded = t > 1 and bool(u.ops) and (not tied or u.index in pins)
        sol = self.tp_solution(u, t, sp, b, pins.get(u.index, ())) if sharded else None
        sharded_ops = {name for name, s in sol.strategies.items() if s in SHARDED} if sol else set()
        is_sharded = bool(sharded_ops)
        row: dict = {}
        row["fwd"], row["bwd"], row["layers"] = self._unit_seconds(u, t, sp, b, sharded_ops)
        row["fwd"] += self._copy_s(u, sol.strategies if sol else {}, t, sp, scale)
        row["comm"] = sol.comm_time_s if sol else 0.0
        row["async_comm"] = sol.async_comm_time_s if sol else 0.0
        row["plan"] = dict(sol.tp_plan) if (sol and is_sharded) else {}
        row["feeds"] = dict(sol.feeds) if (sol and is_sharded) else {}
        fp8 = None
        if self.float8:
            fp8 = price_fp8_unit(u, b, self.compute.gpu, t, skip_fqns=self.fp8_skip,
                                 tp_plan={f"{u.name}.{m}" if m else u.name: v for m, v in row["plan"].items()} if t > 1 else None,
                                 shared_input_casts=self.float8_shared_casts)
            # The saving is taken from the unit's time, which is never below zero (a unit
            # whose roofline is memory-bound gains less than its GEMMs' difference).
            row["fwd"] = max(row["fwd"] - fp8.forward_saved_s * self.compute.slowdown, 0.0)
            row["bwd"] = max(row["bwd"] - fp8.backward_saved_s * self.compute.slowdown, 0.0)
            row["fp8_weights"] = fp8.fp8_weight_elements
            converted = set(fp8.converted)
            row["fp8_flops"] = 3 * sum(op.forward_flops for op in u.ops if op.name in converted) * scale
        op_weight = sum(math.prod(op.weight_shape) for op in u.ops if op.weight_shape)
        op_weight_tp = sol.parameter_bytes / self.dtype_bytes if sol else op_weight
        row["params"] = max(u.num_parameters - op_weight + op_weight_tp, 0)
        largest = max((math.prod(op.weight_shape) for op in u.ops if op.weight_shape), default=0)
        row["largest"] = largest * op_weight_tp / op_weight if op_weight else 0.0
        # The output gradients the weights' gradients are made from (a TP-sharded op's 1/t of them)
        row["wgrad_inputs"] = sum(math.prod(op.output_shape) / (t if op.name in sharded_ops else 1)
                                  for op in u.ops if op.weight_shape) * scale * self.dtype_bytes
        split = self.compute.split_backward(u, b)  # measured: zero bubble's B + W, and W's share of it
        row["wgrad_share"] = split[1] if split else self.compute.weight_gradient_share(u)
        row["split_extra"] = max(split[0] - 1.0, 0.0) * row["bwd"] if split else 0.0
        f_fwd, f_bwd = self.compute.forward_flops(u, b), self.compute.backward_flops(u, b)
        row["flops"] = f_fwd + f_bwd
        core = _attention_flop_share(u)
        row["rec_comm"] = sol.forward_comm_time_s if sol else 0.0
        row[("rec", "full")], row[("rec_flops", "full")] = row["fwd"] + row["rec_comm"], f_fwd
        row[("rec", "selective")], row[("rec_flops", "selective")] = row["fwd"] * core, f_fwd * core
        row[("rec", "none")], row[("rec_flops", "none")] = 0.0, 0.0
        c = u.costs
        saved = interpolate({k: v.saved_bytes for k, v in c.items()}, b)
        if fp8 is not None and fp8.converted and all(v.fp8_saved_bytes is not None for v in c.values()):
            # What the converted linears keep: FP8 inputs, no 16-bit copies (`UnitCosts.fp8_saved_bytes`).
            saved = interpolate({k: float(v.fp8_saved_bytes) for k, v in c.items() if v.fp8_saved_bytes is not None}, b)
        out_b = interpolate({k: v.output_bytes for k, v in c.items()}, b)
        in_b = interpolate({k: v.input_bytes for k, v in c.items()}, b)
        scores = _score_bytes(u, scale, self.dtype_bytes)
        share = split_saved_share(u, sol.strategies, sp) if sol and is_sharded else None
        for mode in ("none", "selective", "full"):
            a = unit_activation_bytes(saved, out_b, in_b, scores, t, sp, mode, sharded=is_sharded, split_share=share)
            row[("act", mode)], row[("transient", mode)] = a.stored, a.transient
        if any(v.stage_start_saved_bytes is not None for v in c.values()):
            # As a stage's first unit: what it keeps then beyond `saved`, split over TP as the rest is.
            start = interpolate({k: float(v.stage_start_saved_bytes if v.stage_start_saved_bytes is not None
                                          else v.saved_bytes) for k, v in c.items()}, b)
            row["start_saved"] = max(start - saved, 0.0) * (row[("act", "none")] / saved if saved > 0 else 1.0)
        if all(v.backward_working_bytes is not None for v in c.values()):
            # The backward's working set, split over the TP ranks as what the unit saves is.
            for name, field in (("working", "backward_working_bytes"), ("working_held", "backward_working_held_bytes")):
                working = interpolate({k: float(getattr(v, field) if getattr(v, field) is not None
                                                else v.backward_working_bytes or 0) for k, v in c.items()}, b)
                row[name] = unit_activation_bytes(working, out_b, in_b, 0.0, t, sp, "none", sharded=is_sharded,
                                                  split_share=share).stored
        # Op-level selective checkpointing (runtime/recompute.py `op_policy`, torchtitan's "op"):
        # saved outputs of attention and every other linear; the rest of the forward replayed.
        outputs, share = op_checkpoint_terms(u, scale, self.dtype_bytes, t, sol.strategies if sol else {})
        a = op_activation_bytes(row[("act", "none")], in_b, outputs, t, sp, sharded=is_sharded)
        row[("act", "op")], row[("transient", "op")] = a.stored, a.transient
        row[("rec", "op")] = row["fwd"] * (1 - share) + row["rec_comm"]
        row[("rec_flops", "op")] = f_fwd * (1 - share)
        return row

    def _boundary_saved(self, b: float) -> np.ndarray:
        """`UnitCostTable.boundary_saved` at micro-batch b: per unit but the last, the smaller of its
        saved outputs and the next unit's saved inputs, where its output is the next one's input
        (as many bytes: no glue code made a new tensor between them)."""
        units = self.profile.units
        boundary = np.zeros(len(units))
        for u in range(len(units) - 1):
            kept = min(_at(units[u], "saved_output_bytes", b), _at(units[u + 1], "saved_input_bytes", b))
            if kept > 0 and math.isclose(_at(units[u], "output_bytes", b), _at(units[u + 1], "input_bytes", b), rel_tol=1e-6):
                boundary[u] = kept
        return boundary

    def _batch_saved(self, b: float) -> float:
        """`UnitCostTable.batch_saved` at micro-batch b: the first unit's saved inputs, where its
        inputs are the batch's (as many bytes: no glue code made new ones before it)."""
        first = self.profile.units[0]
        batch = b * (self.profile.model.input_bytes_per_sample or 0.0)
        if batch <= 0 or not math.isclose(_at(first, "input_bytes", b), batch, rel_tol=1e-6):
            return 0.0
        return _at(first, "saved_input_bytes", b)

    def _ties(self, t: int, sp: bool) -> tuple[TiedWeight, ...]:
        """The profile's tied weights at (t, sp), each per GPU: 1/t of those TP shards (`tie_pins`)."""
        pins = self.tie_pins(t, sp)
        return tuple(replace(tie, num_parameters=tie.num_parameters / t) if tie.units[0] in pins else tie
                     for tie in tied_weights(self.profile))

    def _build(self, t: int, sp: bool, b: float) -> UnitCostTable:
        units = self.profile.units
        n = len(units)
        arrays: dict[str | tuple[str, str], np.ndarray] = {
            name: np.zeros(n) for name in ("fwd", "bwd", "comm", "async_comm", "rec_comm", "params", "largest", "flops", "fp8_weights",
                                           "fp8_flops", "wgrad_inputs", "wgrad_share", "split_extra", "working",
                                           "working_held", "start_saved")}
        arrays |= {(kind, m): np.zeros(n) for kind in ("rec", "rec_flops", "act", "transient") for m in RECOMPUTE_MODES}
        plans: list[dict[str, str]] = [{} for _ in range(n)]
        feeds: list[dict[str, list[str]]] = [{} for _ in range(n)]
        layer_seconds: dict[int, list[tuple[float, float]]] = {}  # unit -> its MoE layers' experts' (fwd, bwd) s
        self._layer_seconds[(t, sp, b)] = layer_seconds
        tied = tied_unit_indices(self.profile)
        for u, indices in self._content_groups():
            row = self._unit_row(u, t, sp, b, u.index in tied)
            for name, values in arrays.items():
                values[indices] = row.get(name, 0.0)
            for i in indices.tolist():
                plans[i] = dict(row["plan"])
                feeds[i] = row["feeds"]
                if row["layers"]:
                    layer_seconds[i] = row["layers"]
        fwd, bwd = arrays["fwd"], arrays["bwd"]
        by_mode = lambda kind: {m: arrays[(kind, m)] for m in RECOMPUTE_MODES}  # noqa: E731
        cut = np.zeros(n)
        for crossing in self.profile.cuts:
            cut[crossing.after_index] = interpolate({k: float(v) for k, v in crossing.bytes.items()}, b) / (t if sp else 1)
        params = arrays["params"]
        output = interpolate({k: float(c.output_bytes) for k, c in units[-1].costs.items()}, b)
        # A tensor a unit keeps of its output and the next one of its input counts once, with the next
        # (under TP a boundary tensor's share per GPU differs by side: counted twice, the safe side).
        boundary = self._boundary_saved(b) if t == 1 else None
        if boundary is not None and boundary.any():
            for mode in KEEPS_OUTPUT:
                arrays[("act", mode)] = np.maximum(arrays[("act", mode)] - boundary, 0.0)
        else:
            boundary = None
        table = UnitCostTable(fwd, bwd, arrays["comm"], by_mode("rec"), arrays["rec_comm"], params, by_mode("act"),
                              by_mode("transient"), cut, arrays["flops"], by_mode("rec_flops"), plans, output_bytes=output,
                              output_element_bytes=self.dtype_bytes, tied=self._ties(t, sp),
                              largest_parameter=arrays["largest"], weight_gradient_inputs=arrays["wgrad_inputs"],
                              input_bytes=b * (self.profile.model.input_bytes_per_sample or 0.0),
                              target_bytes=b * (self.profile.model.target_bytes_per_sample or 0.0),
                              batch_saved=self._batch_saved(b), boundary_saved=boundary, tp_feeds=feeds,
                              weight_gradient_share=arrays["wgrad_share"], backward_working=arrays["working"],
                              backward_working_held=arrays["working_held"],
                              stage_start_saved=arrays["start_saved"] if arrays["start_saved"].any() else None)
        if arrays["split_extra"].any():
            table = replace(table, split_backward_extra_s=arrays["split_extra"])
        if t > 1:
            table = replace(table, tp_async_comm_s=arrays["async_comm"])
        if self.float8:
            table = replace(table, fp8_weight_parameters=arrays["fp8_weights"], fp8_flops=arrays["fp8_flops"])
        frozen = np.array([params[u.index] * (1 - (u.trainable_parameter_bytes or 0) / u.parameter_bytes)
                           if u.parameter_bytes else 0.0 for u in units])  # (the schema fills trainable bytes)
        if frozen.any():  # the share of each unit's parameters that is frozen, after TP alike
            table = replace(table, frozen_parameters=frozen)
        whole = np.array([u.float_fed is False and bool(u.trainable_parameter_bytes) for u in units])
        if whole.any():
            table = replace(table, whole_backward=whole)
        if not layer_seconds:
            return table
        seconds = [layer_seconds.get(u.index, []) for u in units]
        return replace(table, expert_parameters=np.array([float(sum(layer.expert_parameters for layer in u.moe)) for u in units]),
                       expert_forward_s=np.array([sum(f for f, _ in ts) for ts in seconds]),
                       expert_backward_s=np.array([sum(bk for _, bk in ts) for ts in seconds]))


def tied_groups(profile: Profile) -> list[list[int]]:
    """Unit indices of each group of units sharing a parameter (`model.tied_parameters`)."""
    index = {u.name: u.index for u in profile.units}
    return [sorted(index[name] for name in group if name in index) for group in profile.model.tied_parameters]


def tied_unit_indices(profile: Profile) -> set[int]:
    return {i for g in tied_groups(profile) if len(g) > 1 for i in g}


def _borrowed_parameters(unit: Unit) -> float:
    """Parameters the unit's ops use but the unit does not own (`num_parameters` counts a shared
    weight in its first unit only): weights, and biases of linears, minus what it owns."""
    used = 0
    for op in unit.ops:
        if op.weight_shape:
            used += math.prod(op.weight_shape)
            if op.has_bias and op.kind == "linear":
                used += op.weight_shape[-1] if getattr(op, "weight_in_out", False) else op.weight_shape[0]
    return max(used - unit.num_parameters, 0)


def tied_weights(profile: Profile) -> tuple[TiedWeight, ...]:
    """The profile's groups of units sharing a parameter, each with the shared size: what a
    later unit of the group uses without owning it (the profile records no per-tie size)."""
    by_index = {u.index: u for u in profile.units}
    out = []
    for group in tied_groups(profile):
        if len(group) > 1:
            size = max(_borrowed_parameters(by_index[i]) for i in group[1:])
            out.append(TiedWeight(tuple(group), float(size)))
    return tuple(out)
