"""Lower bounds that let the search skip a configuration without running the inter-op DP.

Both are exact: no plan of the configuration, whatever its cuts and per-stage
recomputation, can beat them under the price of `planner.solver.search._price`.

Time (`TimeBound`). Unit u under recompute mode r takes t_r,u seconds per
micro-batch (compute, the exposed TP collectives, ZeRO 2/3 traffic: `stage_arrays`; a
range's start term first_r,u counted where negative) and stores a_r,u activation bytes per
micro-batch in flight. Pipeline rank r holds L_r micro-batches in flight
(`in_flight_microbatches`) and at most M bytes, and the ranks hold the model states s_u once
(s = sum_u s_u; tied copies, buffers and transients only add), so the activations a plan keeps,
sum_u a_r(u),u, are at most A, the smaller of

    (p M - s) / min_r L_r                  (all ranks' memory pooled)
    M sum_r 1 / L_r - s / max_r L_r        (rank by rank: L_r A_r <= M - s_r, summed over r)

The least summed unit time under that constraint is at least its Lagrangian dual (weak
duality), for every lambda >= 0:

    work_s >= D = max_lambda [ sum_u min_r (t_r,u + lambda a_r,u) - lambda A ]

which lets memory force recomputation into the bound (`_least_work_s`; lambda = 0 is the
cheapest mode everywhere). With S = pp x v chunks and p2p_u what a chunk ending after unit u
pays per micro-batch (`p2p_arrays`), W = D + S x min_u p2p_u. Every arrangement's chunk
times sum to at least W, its slowest chunk takes at least W / S and its
busiest pipeline rank (v chunks) at least W / p. The schedules' closed forms
(planner/cost/schedules.py) then give at least

    GPipe, 1F1B         W + (m - 1) W / S
    interleaved 1F1B    m W / p + (p - 1) W / S
    zero bubble         m W / p (a rank runs its m v forwards, Bs and Ws in series), plus
                        what the fill and drain add at the least (`_zero_bubble_s`)

plus the overlapped p2p's fill, at least (S - 1) x the cheapest hop, plus the once-per-step
tail, at least the optimizer step of the mean pipeline rank:
the parameters a rank updates (`updated_parameters`: under ZeRO >= 1 dense ones / dp and
experts' / expert-dp) / p x optimizer seconds per parameter.

Memory (`memory_lower_bound`): model states per GPU if the chunks split the model's
parameters perfectly evenly over the p ranks (no activations, no tied copies).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from planner.cost.memory import model_state_bytes
from planner.cost.schedules import in_flight_microbatches
from planner.solver.costs import UnitCostTable
from planner.solver.search import Config, Environment, gpu_state_bytes, p2p_arrays, stage_arrays, updated_parameters


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
    values of lambda where some unit's best mode changes."""


class TimeBound:
    """The time bound of many configurations. What it needs of a configuration's cost table is
    computed once per setting that changes it: the unit times per ZeRO 2/3 setting (ZeRO 0 and
    1 add no per-unit traffic), the model states per (ZeRO stage, dp), the p2p per placement."""

    def __init__(self, env: Environment):
        self.env = env
        self._units: dict[tuple, _UnitTerms] = {}
        self._states: dict[tuple, float] = {}
        self._p2p: dict[tuple, tuple[float, float]] = {}

    def __call__(self, table: UnitCostTable, cfg: Config) -> float:
        """Seconds per iteration no plan of `cfg` can beat (module docstring)."""
        env = self.env
        sharded = cfg.zero_stage >= 2 and cfg.dp > 1  # `zero_unit_s` adds traffic per unit
        units_key = (id(table), cfg.zero_stage if sharded else 0, cfg.dp if sharded else 1, cfg.shard_degree if sharded else None)
        if units_key not in self._units:
            self._units[units_key] = _unit_terms(table, cfg, env)
        states_key = (id(table), cfg.zero_stage, cfg.dp, cfg.shard_degree, cfg.offload)
        if states_key not in self._states:
            self._states[states_key] = float(stage_arrays(table, cfg, env)[2].sum())
        p2p_key = (id(table), cfg.dp * cfg.tp < env.gpus_per_node, cfg.pp > 1)  # what `p2p_arrays` reads of cfg
        if p2p_key not in self._p2p:
            hops, p2p, _ = p2p_arrays(table, cfg, env)
            self._p2p[p2p_key] = float(p2p.min()), float(hops[:-1].min()) if len(hops) > 1 else 0.0
        min_p2p_s, min_hop_s = self._p2p[p2p_key]
        m, p, v = cfg.num_microbatches, cfg.pp, cfg.virtual_stages
        chunks = p * v
        work = _least_work_s(self._units[units_key], self._states[states_key], cfg, env) + chunks * min_p2p_s
        if cfg.schedule == "zero-bubble":
            pipeline = _zero_bubble_s(work, float(table.forward_s.sum()), m, p, v)
        elif cfg.schedule == "interleaved-1f1b" and v > 1:
            pipeline = m * work / p + (p - 1) * work / chunks
        else:
            pipeline = work + (m - 1) * work / chunks
        fill = (chunks - 1) * min_hop_s if env.overlap.pipeline_p2p else 0.0
        # Offload runs the step on the host (slower, plus PCIe): the GPU's step is still a lower bound.
        optimizer = updated_parameters(table, cfg, 0, len(table.parameters)) / p * env.optimizer_s_per_param
        return pipeline + fill + optimizer


def _zero_bubble_s(work: float, forward: float, m: int, p: int, v: int) -> float:
    """Zero bubble's pipeline time is at least m W / p (module docstring), and its fill and drain
    add, since a hop max(f + B - W, f, B) is at least the chunk's forward f and the chunks'
    forwards sum to at least F (`forward`): for v = 1, m t_slowest + sum_{k != slowest} f_k
    >= (m - 1) W / S + F; for v > 1, (p - 1) max_k f_k >= (p - 1) F / S. With m < p (played in
    the simulator) the first micro-batch still runs every chunk's forward in turn: >= F."""
    chunks = p * v
    if m < p:
        return max(m * work / p, forward)
    if v == 1:
        return max(m * work / p, (m - 1) * work / chunks + forward)
    return m * work / p + (p - 1) * forward / chunks


def _unit_terms(table: UnitCostTable, cfg: Config, env: Environment) -> _UnitTerms:
    times, first, _, _ = stage_arrays(table, cfg, env)
    modes = env.allowed_recompute
    time_s = np.stack([times[r] + np.minimum(first[r], 0.0) for r in modes])
    activation = np.stack([table.activations[r] for r in modes])
    distinct, inverse = np.unique(np.concatenate([time_s, activation]), axis=1, return_inverse=True)
    time_s, activation = distinct[:len(modes)], distinct[len(modes):]
    saved = activation[:, None, :] - activation[None, :, :]  # [r, r', unit]
    slower = time_s[None, :, :] - time_s[:, None, :]
    ratios = np.unique(slower[saved > 0] / saved[saved > 0])
    return _UnitTerms(time_s, activation, np.bincount(inverse.ravel(), minlength=distinct.shape[1]), ratios[ratios >= 0])


def _least_work_s(terms: _UnitTerms, states_bytes: float, cfg: Config, env: Environment) -> float:
    """D of the module docstring: max over lambda >= 0 of sum_u min_r (t_r,u + lambda a_r,u) - lambda A.
    The dual is concave and piecewise linear in lambda, so its maximum is at 0 or where a
    unit's best mode changes (one of `terms.ratios`)."""
    least, most, inverse_sum = _in_flight(cfg.schedule, cfg.pp, cfg.num_microbatches, cfg.virtual_stages)
    memory = env.usable_memory_bytes
    budget = min((cfg.pp * memory - states_bytes) / least, memory * inverse_sum - states_bytes / most)
    lambdas = np.concatenate([[0.0], terms.ratios])
    per_unit = (terms.time_s[None] + lambdas[:, None, None] * terms.activation_bytes[None]).min(axis=1)
    return float((per_unit @ terms.count - lambdas * budget).max())


@lru_cache(maxsize=None)
def _in_flight(schedule: str, pp: int, num_microbatches: int, virtual_stages: int) -> tuple[float, float, float]:
    """min_r L_r, max_r L_r and sum_r 1 / L_r over the pipeline ranks r (`in_flight_microbatches`)."""
    levels = [in_flight_microbatches(schedule, pp, num_microbatches, k, virtual_stages) for k in range(pp)]
    return min(levels), max(levels), sum(1 / level for level in levels)


def memory_lower_bound(table: UnitCostTable, cfg: Config, env: Environment) -> float:
    """Bytes per GPU no plan of `cfg` can go below (module docstring)."""
    # `state_bytes` is linear in the parameters: the states of the sums are the sum of the states.
    frozen = None if table.frozen_parameters is None else float(table.frozen_parameters.sum())
    dense = gpu_state_bytes(float(table.dense_parameters().sum()), cfg, env, frozen)
    experts = 0.0 if table.expert_parameters is None else \
        model_state_bytes(float(table.expert_parameters.sum()), env.dtype, cfg.zero_stage, cfg.expert_dp).total
    return (dense + experts) / cfg.pp
