"""Per-unit costs under one intra-op setting: what the inter-op DP and the search add up.

For a tensor-parallel degree t, sequence parallelism on/off and a micro-batch size b, every
unit gets its forward/backward time per GPU, TP collectives, parameters per GPU, and
activation bytes per recomputation mode (planner/cost/compute.py, planner/cost/memory.py,
planner/solver/intra_op.py). Identical units (same fingerprint) share one ILP solve.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from planner.cost.compute import (
    ComputeModel,
    interpolate,
    sharded_flop_fraction,
    tp_time_s,
)
from planner.cost.memory import unit_activation_bytes
from planner.profile_schema import Profile, Unit
from planner.solver.intra_op import (
    SHARDED,
    IntraOpProblem,
    IntraOpSolution,
    evaluate,
    solve_intra_op,
)

RECOMPUTE_MODES = ("none", "selective", "full")
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class TiedWeight:
    """A parameter that several units share (a tied input embedding and output head)."""

    units: tuple[int, ...]
    """Indices of the units using it, ascending; the first owns it in the profile."""
    num_parameters: float
    """Its size (elements); tied units are never TP-sharded, so this is per GPU too."""


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
    tied: tuple[TiedWeight, ...] = ()
    """Parameters shared by several units (tied embeddings). `parameters` counts each in its
    first unit; a stage holding another of its units holds a copy too (`copy_parameters`)."""

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


def _attention_flop_share(unit: Unit) -> float:
    flops = sum(op.forward_flops for op in unit.ops)
    core = sum(op.forward_flops for op in unit.ops if op.kind in ("attention", "matmul"))
    return core / flops if flops else 0.0


class UnitCosts:
    """Builds `UnitCostTable`s, caching ILP solutions per (fingerprint, t, sp)."""

    def __init__(self, profile: Profile, compute: ComputeModel, tp_collectives, dtype: str, require_sharding: bool = False):
        self.profile, self.compute, self.dtype = profile, compute, dtype
        self.require_sharding = require_sharding  # TP pinned: each unit shards a weight where it can
        self.dtype_bytes = DTYPE_BYTES[dtype]
        self.tp_collectives = tp_collectives  # t -> object with all_reduce_s(nbytes) etc.
        self._ilp: dict[tuple, IntraOpSolution] = {}
        self._tables: dict[tuple, UnitCostTable] = {}
        self.base_mbs = min(profile.micro_batch_sizes)

    def _problem(self, unit: Unit, t: int, sp: bool, b: float) -> IntraOpProblem:
        return IntraOpProblem(
            ops=tuple(unit.ops),
            tp_degree=t,
            dtype_bytes=self.dtype_bytes,
            seconds_per_flop=1.0 / self.compute.gpu.achievable_flops(self.dtype),
            collectives=self.tp_collectives(t),
            activation_scale=b / self.base_mbs,
            sequence_parallel=sp,
            require_sharding=self.require_sharding,
        )

    def tp_solution(self, unit: Unit, t: int, sp: bool, b: float) -> IntraOpSolution:
        """The ILP's answer at the smallest profiled micro-batch, re-priced at b (cached per structure)."""
        key = (unit.fingerprint, t, sp)
        if key not in self._ilp:
            self._ilp[key] = solve_intra_op(self._problem(unit, t, sp, self.base_mbs))
        if b == self.base_mbs:
            return self._ilp[key]
        if (*key, b) not in self._ilp:
            self._ilp[(*key, b)] = evaluate(self._problem(unit, t, sp, b), self._ilp[key].strategies)
        return self._ilp[(*key, b)]

    def table(self, t: int, sp: bool, b: int) -> UnitCostTable:
        key = (t, sp, b)
        if key not in self._tables:
            self._tables[key] = self._build(t, sp, b)
        return self._tables[key]

    def _build(self, t: int, sp: bool, b: int) -> UnitCostTable:
        units = self.profile.units
        n = len(units)
        fwd, bwd, comm, rec_comm, params, flops = (np.zeros(n) for _ in range(6))
        rec = {m: np.zeros(n) for m in RECOMPUTE_MODES}
        rec_flops = {m: np.zeros(n) for m in RECOMPUTE_MODES}
        act = {m: np.zeros(n) for m in RECOMPUTE_MODES}
        transient = {m: np.zeros(n) for m in RECOMPUTE_MODES}
        plans: list[dict[str, str]] = []
        scale = b / self.base_mbs
        tied = tied_unit_indices(self.profile)
        for u in units:
            i = u.index
            # Units sharing a weight stay replicated: DTensor would shard each module's copy of it
            # on its own and untie them (an embedding and an output head also shard it on different dims).
            sol = self.tp_solution(u, t, sp, b) if (t > 1 and u.ops and i not in tied) else None
            sharded_ops = {name for name, s in sol.strategies.items() if s in SHARDED} if sol else set()
            is_sharded = bool(sharded_ops)
            fraction = sharded_flop_fraction(u, sharded_ops) if is_sharded else 0.0
            time = self.compute.unit_time(u, b)
            fwd[i] = tp_time_s(time.forward_s, fraction, t, sp) if is_sharded else time.forward_s
            bwd[i] = tp_time_s(time.backward_s, fraction, t, sp) if is_sharded else time.backward_s
            comm[i] = sol.comm_time_s if sol else 0.0
            plans.append(dict(sol.tp_plan) if (sol and is_sharded) else {})
            op_weight = sum(math.prod(op.weight_shape) for op in u.ops if op.weight_shape)
            op_weight_tp = sol.parameter_bytes / self.dtype_bytes if sol else op_weight
            params[i] = max(u.num_parameters - op_weight + op_weight_tp, 0)
            f_fwd, f_bwd = self.compute.forward_flops(u, b), self.compute.backward_flops(u, b)
            flops[i] = f_fwd + f_bwd
            core = _attention_flop_share(u)
            rec_comm[i] = sol.forward_comm_time_s if sol else 0.0
            rec["full"][i], rec_flops["full"][i] = fwd[i] + rec_comm[i], f_fwd
            rec["selective"][i], rec_flops["selective"][i] = fwd[i] * core, f_fwd * core
            c = u.costs
            saved = interpolate({k: v.saved_bytes for k, v in c.items()}, b)
            out_b = interpolate({k: v.output_bytes for k, v in c.items()}, b)
            in_b = interpolate({k: v.input_bytes for k, v in c.items()}, b)
            scores = _score_bytes(u, scale, self.dtype_bytes)
            for mode in RECOMPUTE_MODES:
                a = unit_activation_bytes(saved, out_b, in_b, scores, t, sp, mode, sharded=is_sharded)
                act[mode][i], transient[mode][i] = a.stored, a.transient
        cut = np.zeros(n)
        for c in self.profile.cuts:
            cut[c.after_index] = interpolate({k: float(v) for k, v in c.bytes.items()}, b) / (t if sp else 1)
        return UnitCostTable(fwd, bwd, comm, rec, rec_comm, params, act, transient, cut, flops, rec_flops, plans,
                             tied_weights(self.profile))


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
