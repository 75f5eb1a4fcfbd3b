"""Pipeline schedules in closed form: iteration time and activations in flight.

p pipeline ranks, m micro-batches, v model chunks per rank (interleaving; chunk c of the
p*v lives on rank c % p, the "looping" placement). f_k, b_k: forward and backward time of
chunk k for one micro-batch. The event simulator (planner/cost/simulator.py) plays the
same schedules action by action; on uniform stages the two agree exactly (tests).

GPipe (Huang et al. 2019) and 1F1B (PipeDream-Flush, Narayanan et al. 2021a): the first
micro-batch crosses every stage, the other m-1 are paced by the slowest stage:

    T = sum_k (f_k + b_k) + (m - 1) max_k (f_k + b_k)                  (Alpa's eq. 2)

bubble fraction (p-1)/(m+p-1) on uniform stages. GPipe keeps all m micro-batches'
activations; 1F1B keeps min(m, p - i) on rank i.

Interleaved 1F1B (Narayanan et al. 2021b, SC21, section 2.2): with W_r = rank r's work per
micro-batch (sum of its chunks), the bubble shrinks by v:

    T = m max_r W_r + (p - 1) max_r W_r / v,  bubble fraction ((p-1)/v) / (m + (p-1)/v)

and needs m % p == 0 (Megatron's rule). Rank i holds up to (p - i - 1)·2 + (v - 1)·p + 1
chunk-micro-batches (Megatron's warm-up count plus the one in flight), i.e. that / v
micro-batches' worth of its activations: rank 0 holds p (1 + (p-1)/(p v)) (Korthikanti
et al. 2022, section 4.2.3).

Zero bubble (Qi et al. 2023, "Zero Bubble Pipeline Parallelism", ZB-H1): the backward is
split into B (input gradients, on the critical path) and W (weight gradients, deferrable);
deferred W's fill the cool-down bubble, so with W a fraction w of the backward

    T = T_1F1B - (p - 1) · 2 w · mean_k b_k       (uniform: bubble (p-1)(F + B - W))

Modelled for v = 1 only, as the simulator plays it: B's in 1F1B order, each W deferred to
the first gap it fits or the cool-down. In steady state there are no gaps, so the W's
wait for the cool-down and every micro-batch's weight-gradient inputs stay alive until
then: we charge m micro-batches of activations (more than ZB-H1's 1F1B-sized memory, which
needs a hand-placed W order this simulator does not reproduce). The solver therefore picks
zero-bubble only where memory is plentiful.
"""

from __future__ import annotations

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zero-bubble")


def check_schedule(schedule: str, num_stages: int, num_microbatches: int, virtual_stages: int = 1) -> None:
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; use one of {', '.join(SCHEDULES)}")
    if num_stages < 1 or num_microbatches < 1 or virtual_stages < 1:
        raise ValueError("pipeline ranks, micro-batches and virtual stages must be positive")
    if virtual_stages > 1 and schedule != "interleaved-1f1b":
        raise ValueError(f"virtual stages > 1 are modelled for interleaved-1f1b only, not {schedule}")
    if schedule == "interleaved-1f1b" and num_stages > 1 and num_microbatches % num_stages:
        raise ValueError(f"interleaved 1F1B needs the micro-batches ({num_microbatches}) to be a multiple of the pipeline ranks ({num_stages})")


def bubble_fraction(schedule: str, num_stages: int, num_microbatches: int, virtual_stages: int = 1,
                    backward_weight_fraction: float = 0.5, forward_share: float = 1 / 3) -> float:
    """Idle share of the iteration on uniform stages (bubble time / iteration time)."""
    check_schedule(schedule, num_stages, num_microbatches, virtual_stages)
    p, m, v = num_stages, num_microbatches, virtual_stages
    if schedule == "interleaved-1f1b":
        return ((p - 1) / v) / (m + (p - 1) / v)
    if schedule == "zero-bubble":
        # per micro-batch f + b = 1 with f = forward_share; the bubble is (p-1)(f + b - 2 w b).
        b = 1 - forward_share
        bubble = (p - 1) * (1 - 2 * backward_weight_fraction * b)
        return bubble / (m + bubble)
    return (p - 1) / (m + p - 1)


def iteration_time_s(schedule: str, stage_forward_s: list[float], stage_backward_s: list[float], num_microbatches: int,
                     virtual_stages: int = 1, p2p_s: float = 0.0, backward_weight_fraction: float = 0.5) -> float:
    """Closed-form pipeline time of one iteration (module docstring); lists are per chunk."""
    num_chunks = len(stage_forward_s)
    if len(stage_backward_s) != num_chunks or num_chunks % virtual_stages:
        raise ValueError(f"{num_chunks} forward and {len(stage_backward_s)} backward times for {virtual_stages} virtual stages")
    p, m, v = num_chunks // virtual_stages, num_microbatches, virtual_stages
    check_schedule(schedule, p, m, v)
    work = [f + b for f, b in zip(stage_forward_s, stage_backward_s)]
    latency = 2 * (num_chunks - 1) * p2p_s  # the first micro-batch's sends there and back
    if schedule == "interleaved-1f1b":
        rank_work = [sum(work[k] for k in range(r, num_chunks, p)) for r in range(p)]
        return m * max(rank_work) + (p - 1) * max(rank_work) / v + latency
    t = sum(work) + (m - 1) * max(work)
    if schedule == "zero-bubble":
        mean_b = sum(stage_backward_s) / p
        t = max(t - (p - 1) * 2 * backward_weight_fraction * mean_b, m * max(work))
    return t + latency


def in_flight_microbatches(schedule: str, num_stages: int, num_microbatches: int, stage_index: int, virtual_stages: int = 1) -> float:
    """Peak micro-batches whose activations pipeline rank `stage_index` holds (in whole-rank units)."""
    p, m, v, i = num_stages, num_microbatches, virtual_stages, stage_index
    if schedule in ("gpipe", "zero-bubble"):
        return float(m)
    if schedule == "interleaved-1f1b" and v > 1:
        return min(m * v, (p - i - 1) * 2 + (v - 1) * p + 1) / v
    return float(min(m, p - i))
