"""PipeDream stage replication: each pipeline stage gets its own number of replicas.

Source: Narayanan et al., "PipeDream: Generalized Pipeline Parallelism for DNN Training",
SOSP 2019, section 3.1 (the partitioner) and 3.2 (1F1B-RR: micro-batch i runs on replica
i mod r_s of stage s; a stage's replicas all-reduce their weight gradients).

Problem. Units 0..U-1 (execution order) on G GPUs: choose stages [i, j) (contiguous) and per
stage a replica count r >= 1 with sum r = G. M micro-batches per step (tp = dp = 1:
replication is the data parallelism).

Partitioner (PipeDream's DP, written from the back so a stage knows how many GPUs follow it,
which its memory needs). `best[i][g]`: the least bottleneck (seconds per micro-batch) of units
[i, U) on exactly g GPUs:

    best[i][g] = min over the first stage [i, j) and its replicas r of
                 T(i, U, r, g)                                           if j = U (then r = g)
                 max(T(i, j, r, g), comm(j), best[j][g - r])             otherwise

    T(i, j, r, g) = replica_s(i, j) / r + (all_reduce(grad_bytes(i, j), r) + optimizer_s(i, j)) / M
                    (+inf when a replica's memory, `replica_memory_bytes`, exceeds the limit)
    comm(j)       = 2 p2p(bytes crossing cut j)       (activations there, gradients back)

This is the paper's A(j, m) = min max(A(i, m - m'), 2 C_i, T(i -> j, m')). The paper's
T = (1/m') max(compute, all-reduce) is for asynchronous PipeDream, which all-reduces once per
input; a flushed 1F1B-RR step (the runtime, runtime/pp_replicated.py) all-reduces once per step
of M micro-batches, after the flush (not overlapped), so its share per micro-batch is
all-reduce / M, added. `partition` also breaks ties: among the partitions of least bottleneck
it takes one of least summed one-replica stage time (the step's fill and drain, below), by a
second DP over the same axes restricted to stages no slower than the bottleneck (exact, as
Alpa's stage-construction DP restricts by t_max). tests/test_replication.py checks both
against brute force.

Step time (`step_time_s`), synchronous 1F1B-RR. A micro-batch crosses stage k in its full
one-replica time t_k (replication does not make one micro-batch faster); replica q of stage
k runs micro-batches q, q + r_k, ..., ceil(M / r_k) of them at most, back to back in the
steady state, which is the paper's observation that r replicas give the stage r times the
throughput (effective time t_k / r_k per micro-batch). The 1F1B closed form of
planner/cost/schedules.py, sum_k t_k + (M - 1) max_k t_k (Alpa eq. 2: the first micro-batch
fills the pipeline, the slowest stage paces the others), becomes with replicas

    T_step = sum_k t_k + max_k (ceil(M / r_k) - 1) t_k + max_k (all_reduce_k + optimizer_k)

(with r_k = 1 everywhere, exactly 1F1B's form), t_k holding its output cut's comm(j) unless
the sends overlap compute (`overlap_p2p`, as the search assumes on GPUs); then only the first
micro-batch's crossing of every cut is paid (+ sum_j comm(j)), the convention of
planner/cost/schedules.py and planner/solver/search.py (p2p as a latency), kept so that a
replicated pipeline and the search's plans are priced alike (tests/test_replication.py: with
one replica per stage this is the search's own 1F1B price). It is optimistic wherever a link
cannot carry M micro-batches' activations in a step, for the search's plans as for these.
We keep t_k, not t_k / r_k, in the fill: a form on the effective times alone would let the
first micro-batch cross a replicated stage faster than its own compute. The all-reduces run
on disjoint groups at once, after the flush. Placement: a stage's replicas are consecutive
ranks (planner/plan.py `stage_ranks`), in one node when r_k fits in one; `all_reduce_s(bytes,
r)` prices such a group (planner/solver/replication_search.py).

Memory per replica (`replica_memory_bytes`): the stage's model states, not divided (every
replica holds all of them, ZeRO 0), plus the stored activations of the micro-batches it holds
at once. Under 1F1B a stage keeps enough micro-batches in flight to feed every GPU from it to
the end of the pipeline (PipeDream's NOAM = ceil(workers / input-stage replicas) for the
input stage; min(M, p - k) without replicas), min(M, g) for the g GPUs from stage k on, spread
round-robin over its r_k replicas: ceil(min(M, g) / r_k) each, exactly what the runtime's
1F1B-RR order holds (runtime/pp_replicated.py `actions`). Plus the send/receive buffers of its
output cut (2 x its bytes: the runtime's own isend/irecv, not torch's PipelineStage, which keeps
a buffer per micro-batch). The optimizer step's phase (states and AdamW's temporaries,
`ReplicationProblem.step_bytes`) replaces the activations where it is larger.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from itertools import combinations

import numpy as np

from planner.errors import PlannerError

TIE_RTOL = 1e-12
"""Relative slack when comparing bottlenecks: the same stages' times summed in another order."""


@dataclass(frozen=True)
class ReplicationProblem:
    """Per-unit costs of one micro-batch on one GPU, and the cluster's terms (SI units)."""

    compute_s: np.ndarray
    """Forward + backward seconds of each unit for one micro-batch on one GPU."""
    grad_bytes: np.ndarray
    """Gradient bytes of each unit, all-reduced over its stage's replicas once per step."""
    state_bytes: np.ndarray
    """Model states of each unit on a GPU holding it (parameters, gradients, optimizer state)."""
    activation_bytes: np.ndarray
    """Bytes each unit stores for its backward, per micro-batch."""
    cut_bytes: np.ndarray
    """Bytes crossing the cut after each unit (the last entry is ignored)."""
    num_gpus: int
    """G: GPUs (ranks) in all, the stages' replicas together."""
    num_microbatches: int
    """M: micro-batches per step, routed round-robin to each stage's replicas."""
    all_reduce_s: Callable[[float, int], float]
    """(bytes, replicas) -> seconds of an all-reduce over a stage's consecutive ranks (0 for 1)."""
    p2p_s: Callable[[float], float]
    """bytes -> seconds of one point-to-point transfer between neighbouring stages."""
    memory_limit_bytes: float = math.inf
    """Usable bytes per GPU."""
    optimizer_s: np.ndarray | None = None
    """Optimizer-step seconds of each unit's parameters (once per step, on every replica); None: 0."""
    accumulation_s: np.ndarray | None = None
    """Seconds of adding each unit's gradients over the step's micro-batches, for one replica that
    ran them all (planner/solver/search.py `accumulation_s` x M); r replicas share them; None: 0."""
    step_bytes: np.ndarray | None = None
    """What each unit's parameters add in the optimizer step's phase, summed over a stage's units
    (torch's foreach AdamW on a GPU: a 4-byte temporary per parameter it steps; planner/cost/memory.py
    `optimizer_transient_bytes`); None: nothing."""
    step_peak_bytes: np.ndarray | None = None
    """The same where it is the largest over a stage's units (AdamW on a CPU steps tensor by tensor:
    two temporaries of its largest parameter); None: nothing."""
    overlap_p2p: bool = False
    """Sends run beside compute (planner/cost/overlap.py `pipeline_p2p`: NCCL on GPUs): `step_time_s`
    then keeps the cuts' transfers out of the stage times (the first micro-batch's latency only)."""

    @property
    def num_units(self) -> int:
        return len(self.compute_s)


@dataclass(frozen=True)
class ReplicatedStages:
    """A partition: stage k holds units bounds[k] = [start, end) on replicas[k] GPUs."""

    bounds: tuple[tuple[int, int], ...]
    """Per stage the unit range [start, end)."""
    replicas: tuple[int, ...]
    """Per stage its replica count r_k (sum = G)."""
    bottleneck_s: float
    """max over stages of T(i, j, r, g) and of the cuts' comm(j): PipeDream's objective."""
    fill_s: float
    """sum over stages of the one-replica time t_k (compute + comm of its output cut)."""


class _Tables:
    """Prefix sums and the per-range terms of the module docstring, for one problem."""

    def __init__(self, problem: ReplicationProblem):
        self.p = problem
        prefix = lambda a: np.concatenate([[0.0], np.cumsum(np.asarray(a, dtype=float))])  # noqa: E731
        self._compute, self._grad = prefix(problem.compute_s), prefix(problem.grad_bytes)
        self._states, self._act = prefix(problem.state_bytes), prefix(problem.activation_bytes)
        self._opt = prefix(problem.optimizer_s if problem.optimizer_s is not None else np.zeros(problem.num_units))
        self._acc = prefix(problem.accumulation_s if problem.accumulation_s is not None else np.zeros(problem.num_units))
        self._step = prefix(problem.step_bytes if problem.step_bytes is not None else np.zeros(problem.num_units))

    def comm_s(self, end: int) -> float:
        """comm(j): activations across cut `end` and their gradients back (0 after the last unit)."""
        return 0.0 if end >= self.p.num_units else 2 * self.p.p2p_s(float(self.p.cut_bytes[end - 1]))

    def replica_s(self, start: int, end: int) -> float:
        """t(i, j) without the cut: one micro-batch's forward + backward on one replica."""
        return float(self._compute[end] - self._compute[start])

    def tail_s(self, start: int, end: int, replicas: int) -> float:
        """Once per step: the stage's gradient all-reduce over its replicas and its optimizer step,
        and the passes adding its micro-batches' gradients (a replica runs 1/r of them)."""
        grad = float(self._grad[end] - self._grad[start])
        return self.p.all_reduce_s(grad, replicas) + float(self._opt[end] - self._opt[start]) \
            + float(self._acc[end] - self._acc[start]) / replicas

    def memory_bytes(self, start: int, end: int, replicas: int, gpus_from_here: int) -> float:
        """The larger of the forward/backward phase (states, activations in flight, the cut's
        buffers) and the optimizer step's (states, its temporaries, the buffers)."""
        held = math.ceil(min(self.p.num_microbatches, gpus_from_here) / replicas)
        buffers = 2 * float(self.p.cut_bytes[end - 1]) if end < self.p.num_units else 0.0
        states = float(self._states[end] - self._states[start])
        peak = float(self.p.step_peak_bytes[start:end].max()) if self.p.step_peak_bytes is not None else 0.0
        step = float(self._step[end] - self._step[start]) + peak
        return states + max(held * float(self._act[end] - self._act[start]), step) + buffers

    def stage_s(self, start: int, end: int, replicas: int, gpus_from_here: int) -> float:
        """T(i, j, r, g) of the module docstring (+inf where a replica does not fit)."""
        if self.memory_bytes(start, end, replicas, gpus_from_here) > self.p.memory_limit_bytes:
            return math.inf
        return self.replica_s(start, end) / replicas + self.tail_s(start, end, replicas) / self.p.num_microbatches


def replica_memory_bytes(problem: ReplicationProblem, stages: ReplicatedStages) -> list[float]:
    """Peak bytes per replica of each stage (module docstring, memory)."""
    tables, out = _Tables(problem), []
    for k, ((i, j), r) in enumerate(zip(stages.bounds, stages.replicas, strict=True)):
        out.append(tables.memory_bytes(i, j, r, sum(stages.replicas[k:])))
    return out


def partition(problem: ReplicationProblem) -> ReplicatedStages:
    """PipeDream's partitioner (module docstring): least bottleneck, then least fill among those."""
    _check(problem)
    tables = _Tables(problem)
    units, gpus = problem.num_units, problem.num_gpus
    # The table's axes: best[first unit i][GPUs g for units i..U-1], seconds per micro-batch.
    best = np.full((units + 1, gpus + 1), math.inf)
    for i in range(units - 1, -1, -1):
        for g in range(1, gpus + 1):
            best[i, g] = min(_options(tables, best, i, g), default=math.inf)
    if not math.isfinite(best[0, gpus]):
        raise PlannerError(f"No replicated pipeline of the model on {gpus} GPUs fits in memory.",
                           "Add GPUs, recomputation, or lower the micro-batch size.")
    return _least_fill(tables, float(best[0, gpus]))


def _options(tables: _Tables, best: np.ndarray, start: int, gpus: int):
    """The bottleneck of every first stage [start, j) x r on `gpus`, followed by best[j][gpus - r]."""
    units = tables.p.num_units
    for end in range(start + 1, units + 1):
        if end == units:
            yield tables.stage_s(start, end, gpus, gpus)
            continue
        for r in range(1, gpus):
            rest = best[end, gpus - r]
            if math.isfinite(rest):
                yield max(tables.stage_s(start, end, r, gpus), tables.comm_s(end), rest)


def _least_fill(tables: _Tables, bottleneck: float) -> ReplicatedStages:
    """Among partitions whose stages and cuts all take at most `bottleneck`: least summed t_k.
    `fill[i][g]`: that sum for units [i, U) on g GPUs; `choice[i][g]` = (end, replicas)."""
    units, gpus = tables.p.num_units, tables.p.num_gpus
    limit = bottleneck * (1 + TIE_RTOL)
    fill = np.full((units + 1, gpus + 1), math.inf)
    choice: dict[tuple[int, int], tuple[int, int]] = {}
    for i in range(units - 1, -1, -1):
        for g in range(1, gpus + 1):
            for end in range(i + 1, units + 1):
                own = tables.replica_s(i, end) + tables.comm_s(end)
                for r in ([g] if end == units else range(1, g)):
                    rest = 0.0 if end == units else fill[end, g - r]
                    if tables.stage_s(i, end, r, g) <= limit and tables.comm_s(end) <= limit and own + rest < fill[i, g]:
                        fill[i, g], choice[i, g] = own + rest, (end, r)
    assert math.isfinite(fill[0, gpus]), "the bottleneck DP found a partition the fill DP must find too"
    bounds, replicas, i, g = [], [], 0, gpus
    while i < units:
        end, r = choice[i, g]
        bounds.append((i, end))
        replicas.append(r)
        i, g = end, g - r
    return ReplicatedStages(tuple(bounds), tuple(replicas), bottleneck, float(fill[0, gpus]))


def _check(problem: ReplicationProblem) -> None:
    if problem.num_gpus < 1 or problem.num_microbatches < 1:
        raise PlannerError(f"Replication needs at least one GPU and one micro-batch (got {problem.num_gpus} GPUs, "
                           f"{problem.num_microbatches} micro-batches).", "Pass positive counts.")
    if problem.num_units < 1:
        raise PlannerError("The model has no units to place.", "Profile the model first.")


def evaluate(problem: ReplicationProblem, bounds, replicas) -> ReplicatedStages:
    """The DP's two objectives for given stages (inf bottleneck where a replica does not fit)."""
    tables = _Tables(problem)
    bottleneck, fill, gpus = 0.0, 0.0, problem.num_gpus
    for (i, j), r in zip(bounds, replicas, strict=True):
        bottleneck = max(bottleneck, tables.stage_s(i, j, r, gpus), tables.comm_s(j))
        fill += tables.replica_s(i, j) + tables.comm_s(j)
        gpus -= r
    return ReplicatedStages(tuple(bounds), tuple(replicas), bottleneck, fill)


def step_time_s(problem: ReplicationProblem, bounds, replicas) -> float:
    """Synchronous 1F1B-RR step time (module docstring): fill + paced steady state + tail."""
    tables, m = _Tables(problem), problem.num_microbatches
    hops = [tables.comm_s(j) for _, j in bounds]
    overlap = problem.overlap_p2p
    times = [tables.replica_s(i, j) + (0.0 if overlap else hop) for (i, j), hop in zip(bounds, hops, strict=True)]
    pace = max((math.ceil(m / r) - 1) * t for t, r in zip(times, replicas, strict=True))
    tail = max(tables.tail_s(i, j, r) for (i, j), r in zip(bounds, replicas, strict=True))
    return float(sum(times) + (sum(hops) if overlap else 0.0) + pace + tail)


def all_partitions(num_units: int, num_gpus: int):
    """Every (bounds, replicas): contiguous stages, replica counts >= 1 summing to G (brute force)."""
    for num_stages in range(1, min(num_units, num_gpus) + 1):
        for cuts in combinations(range(1, num_units), num_stages - 1):
            edges = (0, *cuts, num_units)
            bounds = tuple(zip(edges[:-1], edges[1:], strict=False))
            for split in combinations(range(1, num_gpus), num_stages - 1):
                sizes = np.diff((0, *split, num_gpus))
                yield bounds, tuple(int(s) for s in sizes)


def brute_force(problem: ReplicationProblem) -> ReplicatedStages:
    """Least (bottleneck, fill) over `all_partitions`, lexicographically; for tests on small inputs."""
    found = None
    for bounds, replicas in all_partitions(problem.num_units, problem.num_gpus):
        candidate = evaluate(problem, bounds, replicas)
        if not math.isfinite(candidate.bottleneck_s):
            continue
        if found is None or _better(candidate, found):
            found = candidate
    if found is None:
        raise PlannerError("No replicated pipeline fits in memory.", "Add GPUs.")
    return found


def _better(a: ReplicatedStages, b: ReplicatedStages) -> bool:
    if a.bottleneck_s < b.bottleneck_s * (1 - TIE_RTOL):
        return True
    return a.bottleneck_s <= b.bottleneck_s * (1 + TIE_RTOL) and a.fill_s < b.fill_s
