"""Lower bounds that let the search skip a configuration without running the inter-op DP.

Both are exact: no plan of the configuration, whatever its cuts and per-unit
recomputation (each unit its own mode, planner/solver/unit_recompute.py), can beat them under
the price of `planner.solver.search._price`.

Time (`TimeBound`). Unit u under recompute mode r takes t_r,u seconds per
micro-batch (compute, the exposed TP collectives, ZeRO 2/3 traffic: `stage_arrays`; a
range's start term first_r,u counted where negative) and stores a_r,u activation bytes per
micro-batch in flight. Pipeline rank r holds L_r micro-batches in flight
(`in_flight_microbatches`) and at most M bytes, and the ranks hold the model states s_u once
(s = sum_u s_u; tied copies, buffers and transients only add; M here is the memory less the
pipeline buffers every rank holds at the least, `receive_floor_bytes`), so the activations a plan keeps,
sum_u a_r(u),u, are at most A, the smaller of

    (p M - s) / min_r L_r                  (all ranks' memory pooled)
    M sum_r 1 / L_r - s / max_r L_r        (rank by rank: L_r A_r <= M - s_r, summed over r)

(with s less the gradients where a rank's peak may come before its first backward makes them:
GPipe and 1F1B with m <= L_r, zero bubble before its first weight pass; a zero-bubble rank then
also holds L'_r micro-batches beside its gradients, `zero_bubble_least_held_with_gradients`, L_r
itself when m > p, so A is at most the same two with s and L'_r as well).

The least summed unit time under that constraint is at least its Lagrangian dual (weak
duality), for every lambda >= 0:

    work_s >= D = max_lambda [ sum_u min_r (t_r,u + lambda a_r,u) - lambda A ]

which lets memory force recomputation into the bound (`TimeBound.many`; lambda = 0 is the
cheapest mode everywhere). The dual is concave and piecewise linear in lambda, so its maximum
lies at 0 or where a unit's best mode changes (`_UnitTerms.lambdas`). With S = pp x v chunks,
p2p_u what a chunk ending after unit u pays per micro-batch (`p2p_arrays`) and P_S the least
the S chunks' start terms add beyond their negative parts (they start at distinct units:
`_UnitTerms.starts_prefix_s`), W = D + S x min_u p2p_u + P_S. Every arrangement's chunk
times sum to at least W. Its slowest chunk takes at least X = max(W / S, B* + min_u p2p_u),
where B* is the least slowest chunk of any cut of the units into S contiguous chunks, each
unit at its least time min_r t_r,u and each chunk paying its first unit's start term at the
least (`_least_slowest_chunk_s`: units come whole, so 98 units in 8 chunks leave one chunk
above the mean; under ZeRO 3 every chunk but one starts at a block and waits for its gather),
and its busiest pipeline rank (v chunks) at least R = max(W / p, X, K, z* + v min_u p2p_u),
where K is the pigeonhole bound on whole units (`_busiest_rank_s`: of the k p + 1 slowest
units some rank holds k + 1, so 96 blocks and a head on 8 ranks leave one rank 12 blocks and
the head).

Memory by rank (z*, `_memory_rank_s`): rank r holds its units' states and L_r micro-batches of
their activations in M, so the ranks with more in flight hold fewer units or recompute more,
and the busiest rank's time rises above the mean. Taking the units of the most common kind
(a transformer's blocks; leaving the others out only lowers it), z* is the least z for which
the ranks can hold them all when each runs at most z seconds of them, fractional modes allowed
(a linear relaxation per rank, solved in closed form at its vertices) and whole units (a rank
holds at most the floor of the relaxation's count). With
v = 1 a rank is a chunk, so X >= z* + min_u p2p_u too. The schedules' closed forms
(planner/cost/schedules.py) then give at least

    GPipe, 1F1B         W + (m - 1) X
    interleaved 1F1B    m R + (p - 1) X
    zero bubble         m R (a rank runs its m v forwards, Bs and Ws in series), plus
                        what the fill and drain add at the least (`_zero_bubble_s`)

plus the overlapped p2p's fill, at least (S - 1) x the cheapest hop, plus the once-per-step
tail, at least the optimizer step of the mean pipeline rank:
the parameters a rank updates (`updated_parameters`: under ZeRO >= 1 dense ones / dp and
experts' / expert-dp) / p x optimizer seconds per parameter, and its m gradient accumulation
passes (`accumulation_s`: the parameters whose gradients the ranks add into, / p, x m x the
pass's bytes per parameter at m micro-batches x the copy time per byte; the cuts do not enter it). For zero bubble and interleaving
the tail also holds the mean rank's exposed gradient reduction and parameter gather (ZeRO 0-2),
with the bandwidth term of the whole model's collectives (`_tail_comm_s`, `_tail_s`).

Memory (`memory_lower_bound`): model states per GPU if the chunks split the model's
parameters perfectly evenly over the p ranks (no activations, no tied copies).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import lru_cache, partial
from itertools import combinations
from typing import NamedTuple

import numpy as np

from planner.cost.memory import accumulation_pass_bytes, model_state_bytes
from planner.cost.schedules import (
    BACKWARD_WEIGHT_FRACTION,
    forwards_first,
    in_flight_microbatches,
    zero_bubble_least_held_with_gradients,
    zero_bubble_least_in_flight,
)
from planner.solver.comm_pricing import bucket_parameters, gathered_dense, tail_collectives
from planner.solver.costs import UnitCostTable
from planner.solver.search import (
    Config,
    Environment,
    accumulated_parameters,
    gpu_state_bytes,
    held_parameters,
    p2p_arrays,
    stage_arrays,
    stage_loss_bytes,
    state_parts,
    updated_share,
)


@dataclass(frozen=True)
class _UnitTerms:
    """The per-unit times and activations of one cost table under one ZeRO setting, identical
    units merged (a transformer has a handful of distinct ones)."""

    time_s: np.ndarray
    """[mode, distinct unit]: t_r,u + min(0, first_r,u), seconds per micro-batch."""
    activation_bytes: np.ndarray
    """[mode, distinct unit]: a_r,u, bytes per micro-batch in flight."""
    count: np.ndarray
    """[distinct unit]: how many units share those numbers."""
    ratios: np.ndarray
    """(t_r' - t_r) / (a_r - a_r') >= 0 for every unit and pair of modes with a_r > a_r': the
    values of lambda where some unit's best mode changes (repeats kept: the dual's maximum over
    them is the same)."""
    lambdas: np.ndarray
    """0 and `ratios`: where the dual's maximum lies (module docstring)."""
    dual_s: np.ndarray
    """[lambda]: sum_u min_r (t_r,u + lambda a_r,u) at each of `lambdas` (the budget-free part of the dual)."""
    least_prefix_s: list[float]
    """Prefix sums, in unit order, of c_u = min_r t_r,u: what a chunk of units i..j-1 takes at
    the least (`_least_slowest_chunk_s`)."""
    start_offsets_s: list[float]
    """[i]: the most of least_prefix_s[k] - s_k over k <= i, s_k = min_r max(first_r,k, 0) the
    positive part of a range's start term at unit k (ZeRO 3's exposed gather, say): a chunk of
    units i..j-1 takes at least least_prefix_s[j] - start_offsets_s[i], which is nondecreasing in
    i, so `_least_slowest_chunk_s`'s greedy cut stays exact (`_least_slowest_chunk_s`)."""
    largest_prefix_s: np.ndarray
    """Prefix sums of the c_u sorted descending: [k] is what the k slowest units take together
    (`_busiest_rank_s`)."""
    inverse: np.ndarray
    """[unit]: the index of its distinct unit."""
    common: int
    """The distinct unit with the most units (a transformer's block): `_memory_rank_s`'s kind."""
    starts_prefix_s: np.ndarray
    """[k]: what the start terms of k + 1 chunks add at the least beyond their negative parts
    (already in `time_s`): a chunk's time is its units' t plus its first unit's start term,
    min(first, 0) + max(first, 0). The first chunk starts at unit 0 and the others at distinct
    units, so the k + 1 chunks' positive parts sum to at least unit 0's plus the k smallest of
    the others' (each at its least mode). ZeRO 2's exposed reduce-scatter at every chunk's
    start, for one, which a floor shared by all would lose to the few units with none."""
    others_negative_s: float
    """The sum over the units not of the most common kind of min(0, c_u): what leaving them out
    of a rank can add to its time bound (`_memory_rank_s`; 0 unless a start term is negative)."""


def _given(cfg: Config) -> Config:
    return cfg


class GroupSettings(NamedTuple):
    """What configurations of one cost table share when they differ only in schedule and virtual
    stages: all `TimeBound.group_columns` and `TimeBound.states_bytes` read of them."""

    zero_stage: int
    dp: int
    shard_degree: int | None
    offload: bool
    pp: int
    tp: int
    ep: int
    sequence_parallel: bool

    @classmethod
    def of(cls, cfg: Config) -> GroupSettings:
        return cls(cfg.zero_stage, cfg.dp, cfg.shard_degree, cfg.offload, cfg.pp, cfg.tp, cfg.ep, cfg.sequence_parallel)


_SCHEDULE_FORM = {"zero-bubble": 2, "interleaved-1f1b": 1}
"""Which closed form of the module docstring bounds a schedule (0: GPipe and 1F1B's)."""


class TimeBound:
    """The time bound of many configurations. What it needs of a configuration's cost table is
    computed once per setting that changes it (`group_columns`; the unit times once per ZeRO 2/3
    setting, since ZeRO 0 and 1 add no per-unit traffic), and `many` evaluates the closed forms
    for all configurations at once with numpy: the Python work per configuration is a lookup."""

    def __init__(self, env: Environment):
        self.env = env
        self._units: dict[tuple, _UnitTerms] = {}
        self._groups: dict[tuple, tuple] = {}  # `group_columns`: key -> (the table, its columns)
        self._memory: dict[tuple, float] = {}  # `states_bytes`
        self._sums: dict[int, tuple] = {}  # id of a table -> (the table, `parameter_sums`)
        self._grouping: dict[int, list] = {}  # `_unit_terms`: number of units -> recent groupings
        self._slowest: dict[tuple, float] = {}  # (id of _UnitTerms or its least prefix, chunks) -> B* (held in self._units)
        self._busiest: dict[tuple, tuple] = {}  # `_memory_rank`
        self._parts: dict[tuple, tuple] = {}  # `group_columns`' parts (the tables are held by the groups)
        self._tables: dict[int, tuple] = {}  # `group_columns`: id of a table -> (the table, what it reads of it alone)
        self._updated: dict[tuple, float] = {}  # `group_columns`' optimizer step per (parameters held, ZeRO 0, degrees)
        self._accumulated: dict[tuple, float] = {}  # `group_columns`' accumulation seconds per byte and pass

    def memory_bytes(self, table: UnitCostTable, cfg: Config) -> float:
        """`memory_lower_bound`, once per setting it reads (the schedule, m and v do not enter it)."""
        return self.states_bytes(table, GroupSettings.of(cfg), partial(_given, cfg)) / cfg.pp

    def states_bytes(self, table: UnitCostTable, settings: GroupSettings, config: Callable[[], Config]) -> float:
        """s: the model states of all units on their ranks (`model_states_bytes`) of the
        configurations of `table` with `settings` (any of them, made by `config` only the first
        time: the search asks for tens of thousands). Tables that hold the same parameters
        (another micro-batch, CP degree or algorithm) share it: it reads their sums alone, and
        of the settings all but pp (tp, ep and sp for the experts' data-parallel degree)."""
        held = self._sums.get(id(table))
        if held is None:
            held = self._sums[id(table)] = (table, parameter_sums(table))
        key = (held[1], settings[:4], settings[5:])  # all but pp (a NamedTuple's _replace costs more than the rest)
        value = self._memory.get(key)
        if value is None:
            value = self._memory[key] = model_states_bytes(table, config(), self.env)
        return value

    def gradients_bytes(self, table: UnitCostTable, settings: GroupSettings, config: Callable[[], Config]) -> float:
        """g: the gradients among `states_bytes` (all units on their ranks), once per setting it reads."""
        held = self._sums.get(id(table))
        if held is None:
            held = self._sums[id(table)] = (table, parameter_sums(table))
        key = ("gradients", held[1], settings[:4], settings[5:])
        value = self._memory.get(key)
        if value is None:
            value = self._memory[key] = model_gradient_bytes(table, config(), self.env)
        return value

    def __call__(self, table: UnitCostTable, cfg: Config) -> float:
        """Seconds per iteration no plan of `cfg` can beat (module docstring)."""
        return float(self.many([(table, cfg)])[0])

    def group_columns(self, table: UnitCostTable, settings: GroupSettings, config: Callable[[], Config]) -> tuple[float, ...]:
        """What the time bound reads of the configurations of `table` with `settings` (ZeRO stage,
        dp, hybrid shard degree, offload, pp, tp, ep, sp), which differ only in schedule and virtual
        stages: s, the model states of all units on their ranks (module docstring); min_u p2p_u,
        the least a chunk pays per micro-batch for its outgoing cut; the cheapest hop across a cut
        (the overlapped p2p's fill); F, the units' forward seconds per micro-batch, summed; their
        backward seconds (no recomputation, no communication); the optimizer step of the mean
        pipeline rank; the backward with each unit's least recomputation (the gradient
        reduction's window at the least); and the least the step's gradient reduction and
        parameter gather can take, summed over the pipeline ranks (`_tail_comm_s`); the fewest
        bytes crossing any cut (`least_cut_bytes`); g, the gradients among s; the mean pipeline
        rank's gradient accumulation seconds per byte of a pass (`accumulated_parameters` / pp x
        the copy time per byte). Each part once per setting it reads; `config` makes one of the
        configurations where a part is computed for the first time (tens of thousands of groups
        on 1024 GPUs need few)."""
        zero, dp, shard, offload, pp, tp, ep, sp = settings
        key = (id(table), zero, dp, shard, offload, pp)
        held = self._groups.get(key)
        if held is not None:
            return held[1]
        env = self.env
        made: list[Config] = []

        def cfg() -> Config:
            if not made:
                made.append(config())
            return made[0]

        p2p_key = ("p2p", id(table), tp, sp, dp * tp < env.gpus_per_node, pp > 1)
        if p2p_key not in self._parts:
            hops, p2p, _ = p2p_arrays(table, cfg(), env)
            self._parts[p2p_key] = (float(p2p.min()), float(hops[:-1].min()) if len(hops) > 1 else 0.0)
        alone = self._tables.get(id(table))
        if alone is None:  # what it reads of the table alone, once per table (the table held: its id stays its own)
            least_recompute = np.stack([table.recompute_s[r] for r in env.allowed_recompute]).min(axis=0)
            fp8 = table.fp8_weight_parameters
            alone = self._tables[id(table)] = (
                table, float(table.forward_s.sum()), float(table.backward_s.sum()),
                float((table.backward_s + least_recompute).sum()), None if fp8 is None else float(fp8.sum()),
                least_cut_bytes(table), *held_parameters(table, 0, len(table.parameters)))  # what the whole model's ranks hold
        _, forward, backward, window, fp8_parameters, least_cut, held, experts = alone
        states = self.states_bytes(table, settings, cfg)  # fills self._sums for the table
        # The tail reads the table's parameter sums alone: tables of another micro-batch or CP share it.
        tail_key = ("tail", self._sums[id(table)][1], fp8_parameters, zero, dp, shard, tp, ep, sp)
        if tail_key not in self._parts:
            self._parts[tail_key] = _tail_comm_s(table, cfg(), env)
        updated_key = (held, experts, zero == 0, shard or dp, dp, tp, ep, sp)  # ZeRO's shards, the experts' dp
        if updated_key not in self._updated:
            # Offload runs the step on the host (slower, plus PCIe): the GPU's step is still a lower bound.
            # A dense model's share needs no Config (the experts' dp is read only where there are experts).
            expert_dp = cfg().expert_dp if experts else 1
            self._updated[updated_key] = updated_share(held, experts, zero, shard or dp, expert_dp) * env.optimizer_s_per_param
        accumulated_key = (id(table), zero <= 1, shard or dp, dp, tp, ep, sp)  # ZeRO's shards, the experts' dp
        if accumulated_key not in self._accumulated:
            self._accumulated[accumulated_key] = float(accumulated_parameters(table, cfg()).sum()) * env.copy_s_per_byte
        min_p2p, min_hop = self._parts[p2p_key]
        columns = (states, min_p2p, min_hop, forward, backward, self._updated[updated_key] / pp, window,
                   *self._parts[tail_key], least_cut, self.gradients_bytes(table, settings, config),
                   self._accumulated[accumulated_key] / pp)
        self._groups[key] = (table, columns)  # the table held: its id stays its own
        return columns

    def _unit_terms(self, table: UnitCostTable, settings: GroupSettings, config: Callable[[], Config],
                    whole: bool) -> _UnitTerms:
        """The unit terms of the configurations of `table` with `settings` (`config` makes one
        where they are new): with ZeRO 2/3's per-unit traffic when `whole` (once per ZeRO stage,
        dp and hybrid shard degree), without it otherwise (once per table: the traffic only adds
        to a unit's time, its range-start term included, `_unit_terms`), a weaker bound."""
        sharded = whole and settings.zero_stage >= 2 and settings.dp > 1  # `zero_unit_s` adds traffic per unit
        key = (id(table), settings.zero_stage if sharded else 0, settings.dp if sharded else 1,
               settings.shard_degree if sharded else None)
        units = self._units.get(key)
        if units is None:
            cfg = config()
            plain = cfg if sharded or cfg.zero_stage < 2 else replace(cfg, zero_stage=0, shard_degree=None)
            units = self._units[key] = _unit_terms(table, plain, self.env, self._grouping)
        return units

    def _least_slowest(self, units: list[_UnitTerms], chunks: np.ndarray) -> np.ndarray:
        """B* of each configuration (`_least_slowest_chunk_s`), once per (unit terms, chunks), and
        once per (least unit times, chunks) across unit terms that share them (ZeRO settings
        whose traffic hides, say)."""
        values = np.empty(len(units))
        for index, (terms, count) in enumerate(zip(units, chunks.astype(int).tolist(), strict=True)):
            key = (id(terms), count)
            value = self._slowest.get(key)
            if value is None:
                prefix, offsets = terms.least_prefix_s, terms.start_offsets_s
                content = (tuple(prefix), tuple(offsets), count)
                value = self._slowest.get(content)
                if value is None:
                    value = self._slowest[content] = _least_slowest_chunk_s(prefix, count, offsets)
                self._slowest[key] = value
            values[index] = value
        return values

    def _memory_rank(self, pairs: list[tuple[UnitCostTable, Config]], units: list[_UnitTerms]) -> np.ndarray:
        """z* (`_memory_rank_s`) of each configuration, once per distinct (unit terms, model
        states, in-flight levels, what the first and last ranks hold besides)."""
        keys, inputs = [], {}
        for (table, cfg), terms in zip(pairs, units, strict=True):
            states = stage_arrays(table, cfg, self.env)[2]
            kind = terms.common
            schedule = (cfg.schedule, cfg.pp, cfg.num_microbatches, cfg.virtual_stages)
            flights = _in_flight_levels(*schedule)
            # Ranks holding every micro-batch in flight hold no gradient at their activations' peak,
            # nor may zero bubble's before their first weight pass (planner/cost/schedules.py
            # `peak_states`): where some rank may, the kind's states without them (a lower bound
            # for every rank). Zero bubble's ranks also hold the gradients beside the fewer
            # micro-batches of `_held_levels` (the more of the two z*).
            unheld = cfg.schedule == "zero-bubble" or bool(
                forwards_first(cfg.schedule, cfg.pp, cfg.num_microbatches, max(level for level, _ in flights)))
            grads = gradient_bytes_per_unit(table, cfg, self.env) if unheld else 0.0
            memory = self.env.usable_memory_bytes - float(receive_floor_bytes(
                cfg.pp, cfg.virtual_stages, cfg.num_microbatches, least_cut_bytes(table), self.env.pipeline_buffers))
            moments = [(flights, _rank_in_flight(*schedule), states - grads, unheld)]
            if cfg.schedule == "zero-bubble" and _held_with_gradients(*schedule)[0] > 0:
                moments.append((_held_levels(*schedule), _rank_held_with_gradients(*schedule), states, False))
            own = []
            for counts, per_rank, held_states, without_gradients in moments:
                reserved = _end_units(table, cfg, self.env, terms, held_states, per_rank)
                key = (id(terms), id(states), counts, reserved, memory, without_gradients)
                own.append(key)
                if key not in self._busiest and key not in inputs:
                    slots = [(level, count - sum(1 for _, at, _, _ in reserved if at == level), 0.0, 0.0)
                             for level, count in counts]
                    slots += [(level, 1, seconds, held) for _, level, seconds, held in reserved]
                    inputs[key] = (terms.time_s[:, kind], terms.activation_bytes[:, kind],
                                   float(held_states[terms.inverse == kind].min()), float(terms.count[kind]), slots,
                                   terms, states, memory)
            keys.append(own)
        if inputs:
            rows = list(inputs.values())
            width = max(len(row[4]) for row in rows)
            levels, weights, seconds, held = np.ones((len(rows), width)), *(np.zeros((len(rows), width)) for _ in range(3))
            for index, row in enumerate(rows):
                columns = np.array(row[4], dtype=float).T
                used = columns.shape[1]
                levels[index, :used], weights[index, :used], seconds[index, :used], held[index, :used] = columns
            values = _memory_rank_s(np.stack([row[0] for row in rows]), np.stack([row[1] for row in rows]),
                                    np.array([row[2] for row in rows]), np.array([row[3] for row in rows]), levels,
                                    weights, np.array([row[7] for row in rows]), reserved_s=seconds, reserved_bytes=held)
            for key, row, value in zip(inputs, rows, values.tolist(), strict=True):
                self._busiest[key] = (value, row[5], row[6])  # the terms and states held: their ids stay theirs
        return np.array([max(self._busiest[key][0] for key in own) for own in keys])

    def many(self, pairs: list[tuple[UnitCostTable, Config]], whole: bool = True, cap: float = math.inf) -> np.ndarray:
        """`__call__` of every (table, configuration) pair, as one array (same numbers, same order of operations).
        `whole=False` leaves out B* (X = W / S) and ZeRO 2/3's per-unit traffic (`_unit_terms`): a
        weaker bound, computed once per table instead of once per (ZeRO stage, dp, shard degree)
        and chunk count; the search orders tens of thousands of configurations by it and applies
        the whole bound to those it reaches (planner/solver/solve.py `search`). B* and z* (a
        bisection per distinct input) are computed only where the rest of the bound is below
        `cap`; where it is not, the configuration cannot beat `cap` anyway and keeps the rest,
        itself a lower bound."""
        if not pairs:
            return np.zeros(0)
        distinct: list[_UnitTerms] = []
        position: dict[int, int] = {}
        groups, which = [], []
        for table, cfg in pairs:
            settings, config = GroupSettings.of(cfg), partial(_given, cfg)
            groups.append(self.group_columns(table, settings, config))
            terms = self._unit_terms(table, settings, config, whole)
            if id(terms) not in position:
                position[id(terms)] = len(distinct)
                distinct.append(terms)
            which.append(position[id(terms)])
        variants = np.array([schedule_columns(cfg.schedule, cfg.pp, cfg.num_microbatches, cfg.virtual_stages)
                             for _, cfg in pairs])
        return self._closed_forms(variants, np.array(groups), distinct, np.array(which), pairs if whole else None, cap)

    def weak_many(self, groups: list[tuple[UnitCostTable, GroupSettings, Callable[[], Config]]], group: np.ndarray,
                  variants: np.ndarray) -> np.ndarray:
        """`many(pairs, whole=False)`, the same numbers, for configurations given per group: those
        sharing a cost table and `group_columns`' settings, differing in what the schedule sets
        (`groups[g]`: its table, settings and a maker of one of its configurations, which is all
        `group_columns` and the weak unit terms read; `variants`: `schedule_columns` of each).
        Configuration i is group `group[i]` with the schedule columns `variants[i]`; the Python
        work is per group, so tens of thousands of configurations need no Config each
        (planner/solver/solve.py `search`)."""
        if not len(group):
            return np.zeros(0)
        distinct: list[_UnitTerms] = []
        position: dict[int, int] = {}  # per table (the weak unit terms are once per table)
        columns, which = [], []
        for table, settings, config in groups:
            if id(table) not in position:
                position[id(table)] = len(distinct)
                distinct.append(self._unit_terms(table, settings, config, False))
            columns.append(self.group_columns(table, settings, config))
            which.append(position[id(table)])
        return self._closed_forms(variants, np.array(columns)[group], distinct, np.array(which)[group], None)

    def _closed_forms(self, variants: np.ndarray, groups: np.ndarray, distinct: list[_UnitTerms], which: np.ndarray,
                      pairs: list[tuple[UnitCostTable, Config]] | None, cap: float = math.inf) -> np.ndarray:
        """The closed forms of the module docstring for N configurations: `variants` [N, 10]
        (`schedule_columns`), `groups` [N, 12] (`group_columns`), each configuration's unit terms
        `distinct[which[i]]`; `pairs` (the whole bound) adds B*, z* and what they bring to those
        whose bound without them is below `cap`, None leaves them out (the weak bound)."""
        least, most, inverse_sum, p, v, m, form, least_held, most_held, inverse_held = variants.T
        states, min_p2p, min_hop, forward, backward, optimizer, window, reduce, gather, least_cut, gradients, accumulated = groups.T
        # The step's gradient accumulation passes on the mean pipeline rank (`accumulation_s`: m
        # passes of accumulation_pass_bytes(m) per parameter a rank adds into, whatever the cuts).
        counts, of_count = np.unique(m, return_inverse=True)
        passes = np.array([count * accumulation_pass_bytes(self.env.grad_accumulation, self.env.precision, int(count))
                           for count in counts.tolist()])[of_count]
        once = optimizer + accumulated * passes
        # A rank that runs every forward of its activations' peak first holds no gradient then
        # (planner/cost/schedules.py `forwards_first`: without a pipeline, GPipe and 1F1B, the
        # closed form 0, with m <= its micro-batches in flight), nor may a zero-bubble rank
        # (form 2) before its first weight pass (`peak_states`): where some rank may, s - g.
        all_states = states
        states = np.where(((m <= most) & ((form == 0) | (p == 1))) | (form == 2), states - gradients, states)
        # What a rank's memory leaves beside its pipeline buffers; activations A may not be negative
        # (below 0 nothing fits, and any bound holds).
        memory = self.env.usable_memory_bytes - receive_floor_bytes(p, v, m, least_cut, self.env.pipeline_buffers)
        budget = np.maximum(np.minimum((p * memory - states) / least, memory * inverse_sum - states / most), 0.0)
        # Zero bubble's ranks also hold, after their first weight pass, the gradients beside
        # `_held_with_gradients` micro-batches: the same budget with s and those counts (none where 0).
        counted = least_held > 0
        safe = np.where(counted, least_held, 1.0), np.where(counted, most_held, 1.0)
        later = np.minimum((p * memory - all_states) / safe[0], memory * inverse_held - all_states / safe[1])
        budget = np.where(counted, np.minimum(budget, np.maximum(later, 0.0)), budget)
        chunks = p * v
        dual, fastest, starts, pigeon, others = (np.empty(len(which)) for _ in range(5))
        for position, terms in enumerate(distinct):
            indices = np.flatnonzero(which == position)
            dual[indices] = (terms.dual_s[None, :] - terms.lambdas[None, :] * budget[indices, None]).max(axis=1)
            fastest[indices] = terms.dual_s[0]  # lambda = 0: every unit at its fastest mode
            n = len(terms.starts_prefix_s)
            starts[indices] = terms.starts_prefix_s[np.minimum(chunks[indices].astype(int), n) - 1]
            pigeon[indices] = _busiest_rank_s(terms, p[indices])
            others[indices] = terms.others_negative_s
        work = dual + chunks * min_p2p + starts
        least_work = fastest + chunks * min_p2p + starts
        fill = (chunks - 1) * min_hop if self.env.overlap.pipeline_p2p else 0.0
        gathers = np.maximum(gather - forward, 0.0)

        def closed_forms(slowest: np.ndarray, rank: np.ndarray) -> np.ndarray:
            pipeline = np.where(form == 2, _zero_bubble_s(work, slowest, rank, forward, backward, m, p, v),
                                np.where(form == 1, m * rank + (p - 1) * slowest, work + (m - 1) * slowest))
            # The step's gradient reduction and gather after the pipeline (`_tail_s`): zero bubble
            # leaves no drain to hide them in, interleaving a short one (its first chunks').
            drained = np.where(form == 1, m * rank + (p - 1) * slowest / 2,
                               np.where((v > 1) & (m >= p), m * rank + (p - 1) * forward / chunks, m * rank))
            tail = np.where(form > 0, _tail_s(drained, rank, least_work, reduce, window, gathers, p), 0.0)
            return np.maximum(pipeline, tail) + fill + once

        # The slowest chunk takes at least W / S; a rank's chunks run in series: their mean
        # share, its slowest chunk, and (units come whole) the pigeonhole bound K on the units
        # some rank must hold.
        slowest = work / chunks
        rank = np.maximum(np.maximum(work / p, slowest), pigeon + v * min_p2p)
        if pairs is None:
            return closed_forms(slowest, rank)
        todo = np.flatnonzero(closed_forms(slowest, rank) < cap)
        if not len(todo):
            return closed_forms(slowest, rank)
        units = [distinct[i] for i in which[todo].tolist()]
        # The slowest chunk also takes at least B* plus its cut's p2p (`_least_slowest_chunk_s`):
        # layers come whole, so S chunks of 98 units cannot all take the mean, and chunks start
        # where their start terms are paid.
        slowest[todo] = np.maximum(slowest[todo], self._least_slowest(units, chunks[todo]) + min_p2p[todo])
        rank[todo] = np.maximum(rank[todo], slowest[todo])
        # Memory by rank: the ranks holding more micro-batches in flight hold fewer units or
        # recompute (`_memory_rank_s`); with v = 1 a rank is one chunk.
        busiest = self._memory_rank([pairs[i] for i in todo.tolist()], units) + others[todo]
        rank[todo] = np.maximum(rank[todo], busiest + v[todo] * min_p2p[todo])
        slowest[todo] = np.where(v[todo] == 1, np.maximum(slowest[todo], busiest + min_p2p[todo]), slowest[todo])
        return closed_forms(slowest, rank)


SCHEDULE_COLUMNS = 10
"""How many numbers `schedule_columns` gives per configuration."""


@lru_cache(maxsize=None)
def schedule_columns(schedule: str, pp: int, num_microbatches: int, virtual_stages: int) -> tuple[float, ...]:
    """What the time bound reads of a configuration's schedule: min_r L_r, max_r L_r,
    sum_r 1 / L_r (`_in_flight`), p, v, m, the closed form (`_SCHEDULE_FORM`), and the same three
    of the counts held beside the gradients (`_held_with_gradients`)."""
    form = _SCHEDULE_FORM.get(schedule, 0) if schedule != "interleaved-1f1b" or virtual_stages > 1 else 0
    return (*_in_flight(schedule, pp, num_microbatches, virtual_stages), pp, virtual_stages, num_microbatches, form,
            *_held_with_gradients(schedule, pp, num_microbatches, virtual_stages))


@lru_cache(maxsize=None)
def _held_with_gradients(schedule: str, pp: int, num_microbatches: int, virtual_stages: int) -> tuple[float, float, float]:
    """Zero bubble: min_r, max_r and sum_r 1 / L'_r of the micro-batches each pipeline rank holds
    at the least beside its gradients (planner/cost/schedules.py
    `zero_bubble_least_held_with_gradients`), where `_rank_in_flight`'s peak may come before any
    gradient exists (the bound then counts s - g); zeros where some rank's is 0, and for the
    other schedules (their states are counted with the peak already)."""
    if schedule != "zero-bubble":
        return 0.0, 0.0, 0.0
    levels = _rank_held_with_gradients(schedule, pp, num_microbatches, virtual_stages)
    return (0.0, 0.0, 0.0) if min(levels) <= 0 else _summary(levels)


def _memory_rank_s(time_s: np.ndarray, activation: np.ndarray, states: np.ndarray, count: np.ndarray,
                   levels: np.ndarray, weights: np.ndarray, memory: float | np.ndarray, iterations: int = 24,
                   reserved_s: np.ndarray | None = None, reserved_bytes: np.ndarray | None = None) -> np.ndarray:
    """z*: the least time of the busiest pipeline rank's units of one kind (the most common: a
    transformer's blocks), when each rank's memory holds the units it runs (module docstring,
    "memory by rank"), per configuration.

    For N configurations: `time_s` and `activation` [N, mode] the kind's t_r and a_r, `states` [N]
    its model states s, `count` [N] how many units of it there are, `levels` and `weights` [N, K]
    the ranks' distinct in-flight counts L and how many ranks hold each (weight 0 pads), `memory`
    M (one for all, or [N]: what a rank holds besides its pipeline buffers, `receive_floor_bytes`). A rank
    with in-flight L that runs at most z seconds of these units holds at most h_L(z) of them, the
    optimum of the linear program

        max sum_r x_r   s.t.   sum_r t_r x_r <= z,   sum_r (s + L a_r) x_r <= M,   x >= 0

    (fractional counts and modes: a relaxation of any plan). Its optimum lies on a vertex: one
    mode with the tighter of the two constraints, or two modes with both tight. A rank holds whole
    units, so at most floor(h_L(z)) of them: with 96 blocks on 8 ranks, a first rank whose memory
    holds 11.5 leaves 85 to seven that then need 13 blocks' time, not the 12.07 of the fractional
    count. The units fit only if sum_ranks floor(h_L(z)) >= count; that is nondecreasing in z, so
    z* is found by bisection,
    and the lower end of the bracket after `iterations` halvings is returned (it failed the test:
    a proven lower bound, within 2^-24 of the bracket [0, count x max_r t_r + reserved] below z*).

    `reserved_s` and `reserved_bytes` [N, K] (default none): a slot's ranks also run a unit of
    another kind that seconds and hold it in those bytes (the first unit on rank 0, the last on
    rank p - 1: `_end_units`), so their program has z - seconds and M - bytes; z is then the
    busiest rank's time with that unit (a rank that cannot hold it holds none of the kind)."""
    width = states[:, None, None] + levels[:, :, None] * activation[:, None, :]  # [N, K, mode]: s + L a_r
    times = np.broadcast_to(time_s[:, None, :], width.shape)
    reserved_s = np.zeros(levels.shape) if reserved_s is None else reserved_s
    room = np.reshape(memory, (-1, 1)) - (np.zeros(levels.shape) if reserved_bytes is None else reserved_bytes)  # [N, K]
    # Where a width or time is zero (or tiny) a rank holds unboundedly many: inf, not a warning.
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        by_memory = np.where(width > 0, room[..., None] / width, np.inf)
        pairs = []
        for i, j in combinations(range(time_s.shape[1]), 2):
            det = times[..., i] * width[..., j] - times[..., j] * width[..., i]
            pairs.append((i, j, np.where(det != 0, det, np.nan)))

        def held(z: np.ndarray) -> np.ndarray:
            zz = z[:, None] - reserved_s  # [N, K]
            most = np.minimum(np.where(times > 0, zz[..., None] / times, np.inf), by_memory).max(axis=2)  # [N, K]
            for i, j, det in pairs:
                x_i = (zz * width[..., j] - room * times[..., j]) / det
                x_j = (room * times[..., i] - zz * width[..., i]) / det
                most = np.fmax(most, np.where((x_i >= 0) & (x_j >= 0), x_i + x_j, np.nan))
            most = np.where((zz < 0) | (room < 0), 0.0, most)  # the rank's other unit alone does not fit
            # Units come whole: a rank holds an integer count of them, at most floor(h_L(z)) (a
            # hair above, 1e-9, so float noise in h never raises z* past a plan's time).
            return (np.minimum(np.floor(most * (1 + 1e-9)), count[:, None]) * weights).sum(axis=1)

        low = np.zeros(len(count))
        high = count * time_s.max(axis=1) + reserved_s.max(axis=1)
        for _ in range(iterations):
            middle = (low + high) / 2
            fits = held(middle) >= count
            high, low = np.where(fits, middle, high), np.where(fits, low, middle)
    return low * (1 - 1e-9)


def _end_units(table: UnitCostTable, cfg: Config, env: Environment, terms: _UnitTerms,
               states: np.ndarray, flights: tuple[float, ...]) -> tuple[tuple[int, float, float, float], ...]:
    """What the first and last pipeline ranks hold besides z*'s kind (`_memory_rank_s`): chunk 0
    starts at unit 0 on rank 0, and the last chunk, on rank p - 1, ends at the last unit with the
    loss (`stage_loss_bytes`), whatever the cuts. Per unit not of the kind: (rank, its in-flight count,
    its least time, at least 0, and its states plus that many micro-batches of its least
    activations), the two on one rank when p = 1. `flights`: each rank's in-flight count at
    the moment bounded (`_rank_in_flight`, or zero bubble's `_rank_held_with_gradients`)."""
    last = len(terms.inverse) - 1
    out = []
    for unit, rank in ((0, 0), (last, cfg.pp - 1)) if last > 0 else ((0, 0),):
        kind = int(terms.inverse[unit])
        if kind == terms.common:
            continue
        held = float(states[unit]) + flights[rank] * float(terms.activation_bytes[:, kind].min())
        if unit == last:
            held += stage_loss_bytes(table, env, cfg)
        out.append((rank, flights[rank], max(float(terms.time_s[:, kind].min()), 0.0), held))
    if len(out) == 2 and out[0][0] == out[1][0]:
        out = [(out[0][0], out[0][1], out[0][2] + out[1][2], out[0][3] + out[1][3])]
    return tuple(out)


def least_cut_bytes(table: UnitCostTable) -> float:
    """The fewest bytes crossing any place a stage may end (after every unit but the last)."""
    return float(table.cut_bytes[:-1].min()) if len(table.cut_bytes) > 1 else 0.0


def receive_floor_bytes(p, v, m, least_cut, buffers: str):
    """The least bytes of pipeline buffers every rank holds, whatever the cuts
    (planner/solver/search.py `stage_buffers`), elementwise over configurations: each of a rank's
    v chunks holds m buffers for what crosses each of its cuts ("per-microbatch"), every chunk but
    the first having an incoming cut and every one but the last an outgoing one, so rank 0 and
    rank p - 1 hold 2v - 1 of them and the others 2v, each at least `least_cut`; "in-flight", the
    outgoing activation and its gradient of each chunk but the model's last, 2 (v - 1) at least.
    None without a pipeline."""
    per_rank = m * (2 * v - 1) if buffers == "per-microbatch" else 2 * (v - 1)
    return np.where(np.asarray(p) > 1, per_rank * least_cut, 0.0)


def _busiest_rank_s(terms: _UnitTerms, ranks: np.ndarray) -> np.ndarray:
    """The least time of the busiest of `ranks` pipeline ranks (per configuration), each unit at
    its least time c_u. Pigeonhole: of the k p + 1 slowest units, some rank holds k + 1 (a rank's
    units need not be contiguous, as interleaving's are not), and those take at least the k + 1
    fastest of them; the bound is the most of that over k = 0 .. (n - 1) // p (k = 0: the slowest
    unit; the last k: ceil(n / p) units, at least the ceil(n / p) fastest of all). 98 units on 16
    ranks leave one rank 7, 14% above the mean 6.125; 96 blocks and a head on 8 ranks leave one
    rank 12 blocks and the head (97 = 12 x 8 + 1), where the mean and the 13 fastest units both
    count the head as a fraction of a block. Once per distinct p."""
    largest = terms.largest_prefix_s
    n = len(largest) - 1
    values = {}
    for p in np.unique(ranks).astype(int).tolist():
        k = np.arange((n - 1) // p + 1)
        values[p] = float((largest[k * p + 1] - largest[k * p - k]).max())
    return np.array([values[p] for p in ranks.astype(int).tolist()])


def _zero_bubble_s(work, slowest, rank, forward, backward, m, p, v):
    """Zero bubble's pipeline time is at least m R (module docstring), and its fill and drain
    add, since a hop max(f + B - W, f, B) is at least the chunk's forward f and the chunks'
    forwards sum to at least F (`forward`): for v = 1, m t_slowest + sum_{k != slowest} f_k
    >= (m - 1) X + F (X: `slowest`); for v > 1, (p - 1) max_k f_k >= (p - 1) F / S. With m < p
    (played in the simulator, which keeps every dependency) the first micro-batch runs every
    chunk's forward in turn and then every chunk's input-gradient B = (1 - w) b in turn back:
    >= F + (1 - w) x the units' backward seconds (`backward`; a chunk's b holds at least its
    units', w = BACKWARD_WEIGHT_FRACTION as the price splits it). Elementwise over numpy arrays
    of configurations."""
    chunks = p * v
    return np.where(m < p, np.maximum(m * rank, forward + (1 - BACKWARD_WEIGHT_FRACTION) * backward),
                    np.where(v == 1, np.maximum(m * rank, (m - 1) * slowest + forward),
                             m * rank + (p - 1) * forward / chunks))


def _tail_s(pipeline, rank, least_work, reduce, window, gathers, p):
    """What a zero-bubble or interleaved 1F1B step takes at the least with its tail: the
    busiest rank's m micro-batches and the schedule's fill and drain (`pipeline`, which
    recomputation does not enter: m R, and for zero bubble with v > 1 its (p - 1) F / S,
    `_zero_bubble_s`; for interleaving (p - 1) X / 2, below) plus the mean pipeline rank's exposed
    gradient reduction and parameter gather (the price's tail is the most over ranks:
    planner/solver/comm_pricing.py `dp_tail_s`).

    Rank r's reduction c_r runs under its last backward w_r and the drain after it, s_r
    (`drain_slack_s`: none in zero bubble; in interleaving the backwards of chunks 0 .. r - 1,
    the first ones, each at most the slowest chunk X, so the ranks' slacks sum to at most
    p (p - 1) / 2 X, which takes half of interleaving's (p - 1) X), so it leaves at least
    c_r - w_r - s_r, and the ranks' c_r sum to at least `reduce` (`_tail_comm_s`); the windows sum to at least
    `window` (each unit's least recomputation) plus rho, the recomputation the plan adds beyond
    that, which also adds rho to the ranks' summed work (ZeRO 0 and 1: no per-unit traffic, so a
    unit's time is its least plus its extra recomputation). With W0 (`least_work`) the summed
    work at the least and R the busiest rank's bound, the step takes at least
    max(m R, m (W0 + rho) / p) + max(0, reduce - window - rho) / p, least at rho = p R - W0 (or 0
    when reduce - window is smaller): m R + max(0, reduce - window - max(0, p R - W0)) / p. The
    gather hides behind the first forward F_r alike (`gathers`: max(0, sum g_r - F) >= 0,
    recomputation does not enter it). Elementwise over numpy arrays of configurations."""
    reduction = np.maximum(reduce - window - np.maximum(p * rank - least_work, 0.0), 0.0)
    return pipeline + (reduction + gathers) / p


def _tail_comm_s(table: UnitCostTable, cfg: Config, env: Environment) -> tuple[float, float]:
    """The least the pipeline ranks' once-per-step gradient reductions and parameter gathers
    (planner/solver/comm_pricing.py `tail_collectives`, priced per rank by `dp_tail_s`) can take,
    summed over the ranks, whatever the cuts.

    A collective's time f(x) is concave in its bytes x and at least 0 near none (the least over
    algorithms of latency + bytes / bandwidth: planner/cost/collectives.py), so it lies above its
    chord from a hair above none (e) to far beyond any bucket (X): f(x) >= a + s x for e <= x <=
    X, with s the chord's slope and a = f(e) - s e >= 0. Summed over the N pieces a step cuts a
    collective's parameters into (the buckets of each rank's share, `bucket_parameters`: each
    rank at least ceil(its parameters / bucket) of them when overlapped, one otherwise), whose
    bytes add to at least the whole model's (tied copies add), that is N a + s x the model's
    bytes, with N at least the model's parameters / bucket (1 when not overlapped)."""
    experts = 0.0 if table.expert_parameters is None else float(table.expert_parameters.sum())
    reductions, gathers = tail_collectives(cfg, env, float(table.trained_dense_parameters().sum()), experts,
                                           float(gathered_dense(table, env.precision.param_bytes).sum()))
    bucket = bucket_parameters(cfg)

    def least(collectives: list, bucketed: bool) -> float:
        total_s = 0.0
        for collective, parameters, bytes_per_param, size, stride in collectives:
            if parameters <= 0 or size <= 1:
                continue
            total, near = parameters * bytes_per_param, 1e-9
            far = total * 1e6
            slope = (collective(far, size, stride) - collective(near, size, stride)) / (far - near)
            pieces = max(1.0, parameters / bucket) if bucketed else 1.0
            total_s += pieces * max(collective(near, size, stride) - slope * near, 0.0) + slope * total
        return total_s

    return least(reductions, env.overlap.grad_reduce), least(gathers, env.overlap.param_gather)


GROUPINGS = 4
"""Groupings `_unit_terms` keeps per number of units, the most recently found first."""


def _unit_terms(table: UnitCostTable, cfg: Config, env: Environment, grouping: dict) -> _UnitTerms:
    """`grouping` holds the last few groupings calls found (the representative of each unit and its
    index among them), per number of units; a later call (another table of the model: another
    TP degree, micro-batch or CP degree, or another ZeRO 2/3 setting) reuses one where every unit
    still equals its representative, a check cheaper than `np.unique` over the columns again.
    There are few: a model's tables group its units alike (a transformer: the embedding, the
    blocks, the norm, the head), and ZeRO 2/3's traffic sets the first block apart (the
    embedding before it hides little of its gather)."""
    times, first, _, _ = stage_arrays(table, cfg, env)
    modes = env.allowed_recompute
    time_s = np.stack([times[r] + np.minimum(first[r], 0.0) for r in modes])
    activation = np.stack([table.activations[r] for r in modes])
    columns = np.concatenate([time_s, activation])
    distinct = None
    found = grouping.setdefault(columns.shape[1], [])
    for held in found:
        if not np.array_equal(columns[:, held[0]][:, held[1]], columns):
            continue
        # In np.unique's order (columns sorted lexicographically, first row first) and only if the
        # representatives are still distinct, so the sums below add as without the cache: same
        # numbers to the last bit.
        representatives, inverse = held
        order = np.lexsort(columns[:, representatives][::-1])
        distinct = columns[:, representatives[order]]
        if np.all(distinct[:, 1:] == distinct[:, :-1], axis=0).any():
            distinct = None
            continue
        rank = np.empty_like(order)
        rank[order] = np.arange(order.size)
        inverse = rank[inverse]
        break
    if distinct is None:
        distinct, representatives, inverse = _distinct_columns(columns)
        found.insert(0, (representatives, inverse))
        del found[GROUPINGS:]
    time_s, activation = distinct[:len(modes)], distinct[len(modes):]
    saved = activation[:, None, :] - activation[None, :, :]  # [r, r', unit]
    slower = time_s[None, :, :] - time_s[:, None, :]
    positive = saved > 0
    ratios = slower[positive] / saved[positive]
    ratios = ratios[ratios >= 0]  # neither sorted nor distinct: the dual's maximum over them does not care
    count = np.bincount(inverse, minlength=distinct.shape[1])
    lambdas = np.concatenate([[0.0], ratios])
    per_unit = (time_s[None] + lambdas[:, None, None] * activation[None]).min(axis=1)
    least = time_s.min(axis=0)[inverse]
    prefix = np.concatenate([[0.0], np.cumsum(least)])
    largest = np.concatenate([[0.0], np.cumsum(np.sort(least)[::-1])])
    common = int(np.argmax(count))
    others = inverse != common
    exposed = np.maximum(np.stack([first[r] for r in modes]).min(axis=0), 0.0)
    starts = np.cumsum(np.concatenate([exposed[:1], np.sort(exposed[1:])]))
    offsets = np.maximum.accumulate(prefix[:-1] - exposed)
    return _UnitTerms(time_s, activation, count, ratios, lambdas, per_unit @ count, prefix.tolist(), offsets.tolist(),
                      largest, inverse,
                      common, starts, float(np.minimum(least[others], 0.0).sum()))


def _distinct_columns(columns: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`np.unique(columns, axis=1, return_index=True, return_inverse=True)`, the same three
    arrays (distinct columns in lexicographic order, each one's first index, each column's
    distinct index), by hashing the columns as tuples: np.unique's axis=1 path builds a structured
    dtype and takes longer than this for the hundred-odd units of a model."""
    first: dict[tuple, int] = {}
    for index, column in enumerate(map(tuple, columns.T.tolist())):
        first.setdefault(column, index)
    ordered = sorted(first)  # tuples of floats compare lexicographically, as np.unique orders them
    position = {column: k for k, column in enumerate(ordered)}
    representatives = np.array([first[column] for column in ordered], dtype=np.intp)
    inverse = np.array([position[column] for column in map(tuple, columns.T.tolist())], dtype=np.intp)
    return columns[:, representatives], representatives, inverse


def _least_slowest_chunk_s(prefix: list[float], chunks: int, offsets: list[float] | None = None,
                           iterations: int = 12) -> float:
    """B*: no cut of the units into `chunks` contiguous chunks has a slowest chunk below this,
    with each unit at its least time c_u (prefix sums `prefix`) and each chunk's start term at
    its least: a chunk of units i..j-1 takes at least prefix[j] - offsets[i] (`offsets`
    nondecreasing, at most prefix: `_UnitTerms.start_offsets_s`; None: prefix, no start terms).
    The minimax partition is found by bisection on B with the greedy test (cut as late as B
    allows: as offsets never fall, a later cut never leaves the next chunk less reach, so it fits
    in `chunks` chunks iff some cut does); the lower end of the bracket is returned, which is a
    proven lower bound (the start, the larger of the mean and the most any unit takes in a chunk
    it starts, is one: a chunk i..j-1 holding unit u takes at least prefix[u + 1] - offsets[u];
    each later value failed the test). Fewer chunks than `chunks` pass the test too (a chunk split
    at a unit with a large start term can take longer), which only lowers the bound. Cuts the plan
    may not make (`Environment.cut_allowed`) only raise the true value."""
    n, total = len(prefix) - 1, prefix[-1]
    if offsets is None:
        offsets = prefix[:-1]
    if n == 0:
        return total
    alone = [b - a for a, b in zip(offsets, prefix[1:], strict=False)]
    if chunks <= 1:
        return total - offsets[0]
    largest = max(b - a for a, b in zip(prefix, prefix[1:], strict=False))
    most_start = max(a - b for a, b in zip(prefix, offsets, strict=False))
    low, high = max(total / chunks, max(alone)), total / chunks + largest + most_start

    def fits(limit: float) -> bool:
        start = 0
        for _ in range(chunks):
            end = bisect.bisect_right(prefix, offsets[start] + limit, lo=start) - 1
            if end <= start:
                return False
            if end >= n:
                return True
            start = end
        return False

    if not fits(low):
        for _ in range(iterations):
            middle = (low + high) / 2
            if fits(middle):
                high = middle
            else:
                low = middle
    return low * (1 - 1e-12)  # the greedy's float sums may differ from the price's in the last bits


@lru_cache(maxsize=None)
def _rank_in_flight(schedule: str, pp: int, num_microbatches: int, virtual_stages: int) -> tuple[float, ...]:
    """L_r of every pipeline rank r (`in_flight_microbatches`), computed once for both uses below.
    Zero bubble: the fewest any rank may hold, every later stage running its whole backward at B
    (planner/cost/schedules.py `peak_states`' `whole_chunks`: it frees each micro-batch there,
    earlier than a deferred W), so the bound holds whichever stages the search finds so."""
    if schedule == "zero-bubble":
        return tuple(zero_bubble_least_in_flight(pp, num_microbatches, k, virtual_stages) for k in range(pp))
    return tuple(in_flight_microbatches(schedule, pp, num_microbatches, k, virtual_stages) for k in range(pp))


@lru_cache(maxsize=None)
def _rank_held_with_gradients(schedule: str, pp: int, num_microbatches: int, virtual_stages: int) -> tuple[float, ...]:
    """L'_r of every pipeline rank r: zero bubble's micro-batches held beside the gradients
    (planner/cost/schedules.py `zero_bubble_least_held_with_gradients`)."""
    return tuple(zero_bubble_least_held_with_gradients(pp, num_microbatches, k, virtual_stages) for k in range(pp))


@lru_cache(maxsize=None)
def _held_levels(schedule: str, pp: int, num_microbatches: int, virtual_stages: int) -> tuple[tuple[float, int], ...]:
    """`_in_flight_levels` of `_rank_held_with_gradients`."""
    return _distinct(_rank_held_with_gradients(schedule, pp, num_microbatches, virtual_stages))


@lru_cache(maxsize=None)
def _in_flight_levels(schedule: str, pp: int, num_microbatches: int, virtual_stages: int) -> tuple[tuple[float, int], ...]:
    """The pipeline ranks' distinct in-flight counts L_r, each with how many ranks hold it."""
    return _distinct(_rank_in_flight(schedule, pp, num_microbatches, virtual_stages))


@lru_cache(maxsize=None)
def _in_flight(schedule: str, pp: int, num_microbatches: int, virtual_stages: int) -> tuple[float, float, float]:
    """min_r L_r, max_r L_r and sum_r 1 / L_r over the pipeline ranks r."""
    return _summary(_rank_in_flight(schedule, pp, num_microbatches, virtual_stages))


def _distinct(levels: tuple[float, ...]) -> tuple[tuple[float, int], ...]:
    """Each distinct count of `levels` with how many ranks hold it, ascending."""
    return tuple((level, levels.count(level)) for level in sorted(set(levels)))


def _summary(levels: tuple[float, ...]) -> tuple[float, float, float]:
    """min, max and sum of 1 / L over ranks' counts `levels` (all positive)."""
    return min(levels), max(levels), sum(1 / level for level in levels)


def memory_lower_bound(table: UnitCostTable, cfg: Config, env: Environment) -> float:
    """Bytes per GPU no plan of `cfg` can go below (module docstring)."""
    return model_states_bytes(table, cfg, env) / cfg.pp


def parameter_sums(table: UnitCostTable) -> tuple[float, float | None, float | None]:
    """The table's dense, frozen and expert parameters, summed: all `model_states_bytes` reads of it."""
    frozen = None if table.frozen_parameters is None else float(table.frozen_parameters.sum())
    experts = None if table.expert_parameters is None else float(table.expert_parameters.sum())
    return float(table.dense_parameters().sum()), frozen, experts


def gradient_bytes_per_unit(table: UnitCostTable, cfg: Config, env: Environment) -> np.ndarray:
    """Each unit's gradients on its rank (`state_parts`' gradients: ZeRO, offload, frozen weights and experts applied)."""
    return np.broadcast_to(np.asarray(state_parts(table, cfg, env).gradients, dtype=float), table.parameters.shape)


def model_gradient_bytes(table: UnitCostTable, cfg: Config, env: Environment) -> float:
    """The gradients among `model_states_bytes`, all units on their ranks."""
    return float(gradient_bytes_per_unit(table, cfg, env).sum())


def model_states_bytes(table: UnitCostTable, cfg: Config, env: Environment) -> float:
    """The model states of all units on their ranks (no tied copies): `state_bytes` summed, as
    the states of the summed parameters (`state_bytes` is linear in them)."""
    dense, frozen, experts = parameter_sums(table)
    states = gpu_state_bytes(dense, cfg, env, frozen)
    if experts is not None:
        states += model_state_bytes(experts, env.precision, cfg.zero_stage, cfg.expert_dp).total
    return states
