"""Communication the step waits for under each overlap (planner/cost/overlap.py), per piece
of the search's price (planner/solver/search.py): tensor-parallel collectives (`tp_comm_s`),
ZeRO 2/3 traffic per micro-batch inside the stage times (`zero_unit_s`), and the once-per-step
data-parallel gradient reduction and parameter gather after the pipeline (`dp_tail_s`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from planner.cost.overlap import drain_slack_s, exposed_s, grad_reduce_tail_s

if TYPE_CHECKING:
    from planner.solver.costs import UnitCostTable
    from planner.solver.search import Config, Environment


def range_sums(per_mode: np.ndarray, modes: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """Per stage k: sum of per_mode[modes[k], starts[k]:ends[k]] (prefix-sum differences, one numpy pass)."""
    prefix = np.concatenate([np.zeros((per_mode.shape[0], 1)), np.cumsum(per_mode, axis=1)], axis=1)
    return prefix[modes, ends] - prefix[modes, starts]


def tp_comm_s(table: UnitCostTable, cfg: Config, env: Environment) -> np.ndarray:
    """TP collectives per unit and micro-batch the compute stream waits for: all of them, or
    with async TP (`tp_comm` overlap: Megatron's --tp-comm-overlap and torch's micro-pipelined TP
    split each collective and the GEMM it feeds or follows into tp chunks, Wang et al. 2023,
    "Overlap Communication with Dependent Computation via Decomposition", ASPLOS) what those
    GEMMs cannot hide, one chunk at least, collective by collective (planner/solver/intra_op.py
    `async_exposed_s`)."""
    comm = table.tp_comm_s
    if not env.overlap.tp_comm or cfg.tp == 1:
        return comm
    assert table.tp_async_comm_s is not None, "UnitCosts builds every table with tp > 1 with it"
    return np.minimum(table.tp_async_comm_s, comm)


def zero_unit_s(table: UnitCostTable, cfg: Config, env: Environment) -> dict:
    """ZeRO 2/3 communication per micro-batch the step waits for, per recompute mode, as
    (per unit, per range start): a range [i, j) pays sum_{u in [i, j)} per_unit[u] + start[i].

    Forward: unit u's all-gather g_u hides behind unit u-1's forward f_{u-1} (`param_gather`),
    the range's first one is exposed. Backward: unit u's reduce-scatter s_u and the gather of
    unit u-1 share the stream under unit u-1's backward b_{u-1} (with its recomputation); the
    range's last reduce-scatter s_i is exposed; its last unit keeps its parameters from the
    forward (torchtitan leaves the last block unresharded for this reason). Overlap off: every
    collective in series, two gathers per unit.

    Modes are chosen per unit (planner/solver/unit_recompute.py) and unit u's entry under mode r
    takes unit u-1's backward window at r too: exact for a range of one mode; in a mixed range
    the window differs by unit u-1's recomputation, an approximation the cost table and the
    price (`_price`) share, so the DP's bounds stay exact about what it prices.

    FSDP2 copies each gather out of its flat buffer into the unit's parameters on the compute
    stream (`Environment.gather_copy_out`, torch's `foreach_all_gather_copy_out`): a read and a
    write of the gathered bytes, c_u, in series with compute, at each gather: unit u's in the
    forward, unit u-1's under unit u's backward, none for the range's last unit, which keeps
    its parameters (so a range pays sum c_u + sum_{u < j-1} c_u; its start term takes off the
    c_{i-1} that unit i's entry holds).
    """
    num_units = len(table.parameters)
    nothing = np.zeros(num_units)
    if cfg.zero_stage < 2 or cfg.dp == 1:
        return {r: (nothing, nothing) for r in env.allowed_recompute}
    grad_bytes = env.precision.reduce_bytes
    scatter = _over_dp(env.dp_reduce_scatter_s, table, cfg, grad_bytes) + _across_replicas(table, cfg, env, grad_bytes)
    gather = nothing if cfg.zero_stage < 3 else _over_dp(env.dp_all_gather_s, table, cfg, env.precision.param_bytes, gather=True)
    hide_gather, hide_scatter = env.overlap.param_gather, env.overlap.grad_reduce
    previous = lambda a: np.concatenate([[0.0], a[:-1]])  # noqa: E731
    weight = env.precision.param_bytes
    copy = 2 * gathered_dense(table, weight) * weight * env.copy_s_per_byte \
        if cfg.zero_stage == 3 and env.gather_copy_out else nothing
    forward = np.maximum(gather - previous(table.forward_s), 0.0) if hide_gather else gather
    hidden = (scatter if hide_scatter else 0.0) + (previous(gather) if hide_gather else 0.0)
    serial = (0.0 if hide_scatter else scatter) + (0.0 if hide_gather else gather)
    out = {}
    for r in env.allowed_recompute:
        window = previous(table.backward_s + table.recompute_s[r])
        backward_hidden = np.maximum(hidden - window, 0.0)
        per_unit = forward + backward_hidden + serial + copy + previous(copy)
        # At a range's start, the pair (u, u-1) is not in the range: its first gather and its
        # last reduce-scatter are exposed instead.
        start = (gather - forward if hide_gather else 0.0) + (scatter if hide_scatter else 0.0) - backward_hidden \
            - previous(copy)
        out[r] = (per_unit, np.broadcast_to(start, (num_units,)).astype(float))
    return out


def gathered_dense(table: UnitCostTable, bytes_per_param: int) -> np.ndarray:
    """Dense parameters per unit as an all-gather moves them, in units of `bytes_per_param`:
    FP8 linears' weights travel as 1 byte each (torchao's FSDP FP8 all-gather, planner/cost/fp8.py)."""
    dense = table.dense_parameters()
    if table.fp8_weight_parameters is None:
        return dense
    return dense - table.fp8_weight_parameters * (bytes_per_param - 1) / bytes_per_param


def _over_dp(collective, table: UnitCostTable, cfg: Config, bytes_per_param: int, gather: bool = False) -> np.ndarray:
    """Per unit: `collective` of its dense parameters over dp, then of its experts' over
    expert-dp (planner/cost/moe.py; two collectives on different groups, one after the other).
    `gather`: an all-gather of parameters (FP8 weights move in FP8: `gathered_dense`)."""
    params = gathered_dense(table, bytes_per_param) if gather else table.trained_dense_parameters()
    dense = _per_distinct(params, lambda p: collective(p * bytes_per_param, cfg.zero_dp, cfg.tp))
    if table.expert_parameters is None:
        return dense
    return dense + _per_distinct(table.expert_parameters,
                                 lambda p: collective(p * bytes_per_param, cfg.expert_dp, cfg.expert_dp_stride))


def _per_distinct(values: np.ndarray, seconds) -> np.ndarray:
    """`seconds(v)` for each entry of `values`, called once per distinct value (a model's
    identical blocks have identical parameter counts)."""
    distinct, inverse = np.unique(values, return_inverse=True)
    return np.array([seconds(float(v)) for v in distinct])[inverse.ravel()]


def _across_replicas(table: UnitCostTable, cfg: Config, env: Environment, bytes_per_param: int) -> np.ndarray | float:
    """Per unit, HSDP's all-reduce of each gradient shard across the replica groups (FSDP2 on a
    (replicate, shard) mesh: reduce-scatter inside the shard group, then this; Zhao et al. 2023).
    A replica group is the shard index's ranks in every group, tp x shard_degree ranks apart."""
    if cfg.replicas == 1:
        return 0.0
    return _per_distinct(table.trained_dense_parameters(),
                         lambda p: env.dp_all_reduce_s(p * bytes_per_param / cfg.zero_dp, cfg.replicas, cfg.tp * cfg.zero_dp))


MEGATRON_BUCKET_PARAMS = 40_000_000
"""Megatron-Core's gradient bucket with --overlap-grad-reduce: max(40M, 1M x dp) parameters
(megatron/core/distributed/distributed_data_parallel_config.py, `bucket_size`); PyTorch
DDP's 25 MiB default is of the same order."""


def bucket_parameters(cfg: Config) -> int:
    """Parameters per gradient bucket: Megatron-Core's max(40M, 1M x dp) (`MEGATRON_BUCKET_PARAMS`)."""
    return max(MEGATRON_BUCKET_PARAMS, 1_000_000 * cfg.dp)


def tail_collectives(cfg: Config, env: Environment, trained: float, experts: float, gathered: float) -> tuple[list, list]:
    """The once-per-step collectives of a pipeline rank whose units hold `trained` trained dense
    parameters, `experts` expert parameters and `gathered` dense weights as an all-gather moves
    them (FP8 weights at 1 byte: `gathered_dense`): (reductions, gathers), each a list of
    (collective, parameters, bytes per parameter, group size, group stride). Reductions: ZeRO 0
    all-reduces, ZeRO 1 reduce-scatters (dense over dp, experts over expert-dp; HSDP then
    all-reduces each shard across the replica groups, tp x shard_degree ranks apart); gathers:
    ZeRO 1 and 2 all-gather the updated weights. None with dp 1 or under ZeRO 3 (per micro-batch:
    `zero_unit_s`). `dp_tail_s` prices them per rank, planner/solver/bounds.py bounds them over
    the whole model."""
    if cfg.dp == 1 or cfg.zero_stage == 3:
        return [], []
    grad_bytes = env.precision.reduce_bytes
    dense_dp = cfg.zero_dp if cfg.zero_stage >= 1 else cfg.dp
    reductions, gathers = [], []
    if cfg.zero_stage <= 1:
        collective = env.dp_all_reduce_s if cfg.zero_stage == 0 else env.dp_reduce_scatter_s
        reductions.append((collective, trained, grad_bytes, dense_dp, cfg.tp))
        if experts:
            reductions.append((collective, experts, grad_bytes, cfg.expert_dp, cfg.expert_dp_stride))
        if cfg.replicas > 1:
            reductions.append((env.dp_all_reduce_s, trained / cfg.zero_dp, grad_bytes, cfg.replicas, cfg.tp * cfg.zero_dp))
    if cfg.zero_stage in (1, 2):
        gathers.append((env.dp_all_gather_s, gathered, env.precision.param_bytes, dense_dp, cfg.tp))
        if experts:
            gathers.append((env.dp_all_gather_s, experts, env.precision.param_bytes, cfg.expert_dp, cfg.expert_dp_stride))
    return reductions, gathers


@dataclass(frozen=True)
class ReductionStream:
    """Per pipeline rank, the once-per-step gradient reduction as its communication stream runs
    it when overlapped (`dp_tail_s`): what the event simulator plays as that stream
    (planner/cost/simulator.py `simulate`, `grad_sync_s` / `num_buckets` / `grad_ready`) and a
    plan's Gantt chart draws."""

    seconds: list[float]
    """All of the rank's reduction collectives, in series on the stream."""
    buckets: list[int]
    """How many pieces the stream runs them in."""
    ready: str
    """When the buckets are ready, in the simulator's terms (`GRAD_READY`): "backward", "chunk", "step"."""


def dp_tail_s(table, cfg: Config, env: Environment, bounds, unit_recompute_s: np.ndarray) -> tuple[list[float], list[float]]:
    """Per pipeline rank, once per step: the exposed gradient reduction and parameter gather
    (`tail_collectives`).

    The reduction runs in buckets (`bucket_parameters`) under the last micro-batch's backward of
    the rank's chunks (`exposed_s` with that backward as window) and goes on while the ranks
    before it finish that micro-batch's backward (`drain_slack_s`, `grad_reduce_tail_s`; the
    event simulator plays the same on its communication streams, tests/test_overlap.py). The
    gather hides behind the first forward (the first bucket is exposed, the mirror image). ZeRO 2
    and 3 reduce every micro-batch (`zero_unit_s`). Not overlapped: one collective over the flat
    buffer, in series. Under FSDP2 (`Environment.dp_collectives` "per-unit") ZeRO 1-2 run one
    collective per unit, which are then the buckets (2 x 7 of them on examples/gpt.py's demo
    model: about 15 ms a step of gloo on the project's CPU, against 2.2 ms priced as two).
    `unit_recompute_s`: each unit's recomputation seconds under its own mode (modes are chosen
    per unit), part of the backward window.

    In a pipeline, FSDP2's reduction (ZeRO 1 there: planner/solver/solve.py `PIPELINE_ZERO`) is
    not bucketed under the last backward: torch's schedules run every micro-batch without
    gradient sync and reduce-scatter a chunk's gradients after its last backward
    (`PipelineStage.perform_reduce_grad`). So its window is the last backward of the rank's
    chunks that run after that chunk's (interleaving: all but its first chunk), plus the drain.
    Zero bubble's ZeRO 0 reduction has no window at all (its weight gradients reach no hook).
    """
    grad_s, gather_s, _ = dp_tail(table, cfg, env, bounds, unit_recompute_s)
    return grad_s, gather_s


def dp_tail(table, cfg: Config, env: Environment, bounds, unit_recompute_s: np.ndarray
            ) -> tuple[list[float], list[float], ReductionStream | None]:
    """`dp_tail_s`'s two lists, and the overlapped reduction they came from (`ReductionStream`):
    None where there is none to overlap (dp 1, ZeRO 3's per-micro-batch traffic, or a reduction
    run in series after the backward)."""
    grad_s, gather_s = [0.0] * cfg.pp, [0.0] * cfg.pp
    if cfg.dp == 1 or cfg.zero_stage == 3:
        return grad_s, gather_s, None
    overlap = env.overlap
    starts, ends = np.array(bounds).T
    zeros = np.zeros(len(bounds), dtype=int)
    rank_of = np.arange(len(bounds)) % cfg.pp  # chunk k runs on pipeline rank k mod pp

    def chunks_of(values: np.ndarray) -> np.ndarray:  # per chunk: the sum over its units
        return range_sums(values[None], zeros, starts, ends)

    def per_rank(chunk_values: np.ndarray) -> list[float]:  # per rank: the sum over its chunks
        return np.bincount(rank_of, weights=chunk_values, minlength=cfg.pp).tolist()

    def by_rank(values: np.ndarray | None, extra=0.0) -> list[float]:
        return [0.0] * cfg.pp if values is None else per_rank(chunks_of(values) + extra)

    backward_chunks = chunks_of(table.backward_s + unit_recompute_s)
    slack = drain_slack_s(cfg.schedule, backward_chunks.tolist(), cfg.pp)
    windows = per_rank(backward_chunks)
    per_unit = cfg.zero_stage in (1, 2) and env.dp_collectives == "per-unit"
    ready = "backward"
    if per_unit and cfg.pp > 1:  # deferred to after each chunk's last backward: rank r's chunk r finishes last
        windows = [w - float(backward_chunks[rank]) for rank, w in enumerate(windows)]
        ready = "chunk"
    if cfg.zero_stage == 0 and cfg.schedule == "zero-bubble":
        # Zero bubble's weight step adds each gradient by hand (torch's `stage_backward_weight`),
        # which no gradient hook sees: the runtime's buckets (runtime/apply_dp.py
        # `GradientReducer.finish`) all go after the step's last weight step, nothing hides them.
        windows = [0.0] * cfg.pp
        ready = "step"
    copies = table.copy_parameters(starts, ends)  # tied weights' copies: dense, trained
    rank_params, rank_dense = by_rank(table.parameters, copies), by_rank(table.dense_parameters(), copies)
    rank_trained, rank_experts = by_rank(table.trained_dense_parameters(), copies), by_rank(table.expert_parameters)
    rank_fp8, rank_forward = by_rank(table.fp8_weight_parameters), by_rank(table.forward_s)

    def seconds(collectives: list, pieces: int) -> float:
        return sum(pieces * collective(p * bytes_per_param / pieces, size, stride)
                   for collective, p, bytes_per_param, size, stride in collectives)

    # FSDP2 (ZeRO 1-2 in the planner's runtime) reduces and gathers each unit on its own: one
    # collective per unit holding parameters, each paying its latency (`Environment.dp_collectives`).
    rank_units = by_rank((table.parameters > 0).astype(float)) if per_unit else None
    stream = ReductionStream([0.0] * cfg.pp, [1] * cfg.pp, ready)
    for rank in range(cfg.pp):
        weight = env.precision.param_bytes
        gathered = rank_dense[rank] - rank_fp8[rank] * (weight - 1) / weight
        reductions, gathers = tail_collectives(cfg, env, rank_trained[rank], rank_experts[rank], gathered)
        buckets = max(1, math.ceil(rank_params[rank] / bucket_parameters(cfg)))
        # Serial: one flat buffer after the backward (the runtime's ZeRO 0, Megatron-LM 2021), or a unit at a time.
        serial = 1
        if rank_units is not None:
            buckets = serial = max(1, round(rank_units[rank]))
        if reductions:
            if overlap.grad_reduce:
                stream.seconds[rank], stream.buckets[rank] = seconds(reductions, buckets), buckets
                grad_s[rank] = grad_reduce_tail_s([stream.seconds[rank]], [windows[rank]], [slack[rank]], buckets)
            else:
                grad_s[rank] = seconds(reductions, serial)
        if gathers:
            gather_s[rank] = exposed_s(seconds(gathers, buckets), rank_forward[rank], buckets) if overlap.param_gather \
                else seconds(gathers, serial)
    overlapped = overlap.grad_reduce and any(stream.seconds)
    return grad_s, gather_s, stream if overlapped else None
