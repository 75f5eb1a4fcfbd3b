"""Communication overlapped with compute: closed forms (planner/cost/overlap.py) against the
event simulator's communication streams, and the solver's prices with and without overlap."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from planner.cluster import make_cluster
from planner.cost.overlap import SERIAL, Overlap, drain_slack_s, exposed_s, grad_reduce_tail_s, prefetch_exposed_s
from planner.cost.schedules import iteration_time_s
from planner.cost.simulator import simulate
from planner.profiler import profile_model
from planner.solver.solve import Pins, solve


def test_a_collective_hidden_behind_a_long_backward_costs_only_its_last_bucket():
    # 1 s of reduction under a 10 s backward: the stream keeps up; only the bucket that is
    # ready when the backward ends is left, and it shrinks with the bucket count.
    assert exposed_s(1.0, 10.0, 1) == pytest.approx(1.0)  # one bucket: nothing to overlap with
    assert exposed_s(1.0, 10.0, 4) == pytest.approx(0.25)
    assert exposed_s(1.0, 10.0, 1000) == pytest.approx(0.001)
    assert exposed_s(0.0, 10.0, 4) == 0.0


def test_a_collective_longer_than_the_backward_costs_the_difference():
    # 3 s of reduction under a 2 s backward: the step waits C - W, plus the last bucket's share
    # of the window (the stream idled until the first bucket was ready), which vanishes with n.
    for n in (1, 2, 8, 1000):
        assert exposed_s(3.0, 2.0, n) == pytest.approx(3.0 - 2.0 + 2.0 / n)
    assert exposed_s(3.0, 2.0, 10**6) == pytest.approx(1.0, abs=1e-5)


def test_prefetched_gathers_expose_the_first_and_the_excess():
    assert prefetch_exposed_s([1.0, 1.0, 1.0], [2.0, 2.0, 2.0]) == pytest.approx(1.0)
    assert prefetch_exposed_s([1.0, 3.0, 3.0], [2.0, 2.0, 2.0]) == pytest.approx(1.0 + 1.0 + 1.0)
    assert prefetch_exposed_s([], []) == 0.0


def _closed_form_step_s(schedule, f, b, p, m, v, comm_s, buckets):
    chunks = p * v
    pipeline = iteration_time_s(schedule, [f / v] * chunks, [b / v] * chunks, m, v)
    return pipeline + grad_reduce_tail_s([comm_s] * p, [b] * p, drain_slack_s(schedule, [b / v] * chunks, p), buckets)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p,m", [(1, 1), (1, 4), (2, 4), (4, 8), (4, 3)])
@pytest.mark.parametrize("comm_s", [0.5, 1.9, 2.0, 3.0, 9.0])
@pytest.mark.parametrize("buckets", [1, 2, 4])
def test_overlap_closed_form_matches_the_simulator_on_uniform_stages(schedule, p, m, comm_s, buckets):
    # Exact (both are the same max-plus algebra on uniform stages): b = 2, f = 1.
    timeline = simulate(schedule, [1.0] * p, [2.0] * p, m, grad_sync_s=[comm_s] * p, num_buckets=buckets)
    assert timeline.step_s == pytest.approx(_closed_form_step_s(schedule, 1.0, 2.0, p, m, 1, comm_s, buckets), rel=1e-12)
    # The communication stream never runs a bucket before it is ready or two at once.
    for rank in range(p):
        spans = sorted((e.start_s, e.end_s) for e in timeline.comm_events if e.rank == rank)
        assert all(a[1] <= b[0] + 1e-12 for a, b in zip(spans, spans[1:]))
        assert len(spans) == buckets


@pytest.mark.parametrize("comm_s", [0.5, 3.0, 7.0])
@pytest.mark.parametrize("buckets", [1, 4])
def test_interleaved_closed_form_bounds_the_simulator(comm_s, buckets):
    # With v chunks per rank, the earlier chunks' gradients are ready before the last backward,
    # so the closed form (window: one micro-batch's backward of the rank) is an upper bound.
    p, m, v = 4, 8, 2
    simulated = simulate("interleaved-1f1b", [0.5] * 8, [1.0] * 8, m, v, grad_sync_s=[comm_s] * p, num_buckets=buckets).step_s
    closed = _closed_form_step_s("interleaved-1f1b", 1.0, 2.0, p, m, v, comm_s, buckets)
    assert simulated <= closed + 1e-12
    assert closed <= simulated * 1.15  # loose: an estimate, not exact


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p,m", [(1, 4), (2, 4), (4, 8), (4, 3)])
@pytest.mark.parametrize("comm_s", [0.5, 2.0, 9.0])
@pytest.mark.parametrize("buckets", [1, 4])
def test_reductions_after_each_chunk_match_the_closed_form(schedule, p, m, comm_s, buckets):
    # FSDP2 in a pipeline reduces a stage's gradients after its last backward (grad_ready "chunk"):
    # no window, only the drain of the ranks before it hides them (comm_pricing.py `dp_tail_s`).
    timeline = simulate(schedule, [1.0] * p, [2.0] * p, m, grad_sync_s=[comm_s] * p, num_buckets=buckets, grad_ready="chunk")
    pipeline = iteration_time_s(schedule, [1.0] * p, [2.0] * p, m)
    closed = pipeline + grad_reduce_tail_s([comm_s] * p, [0.0] * p, drain_slack_s(schedule, [2.0] * p, p), buckets)
    assert timeline.step_s == pytest.approx(closed, rel=1e-12)
    last_backward = {e.rank: e.end_s for e in timeline.events if e.kind == "BW" and e.microbatch == m - 1}
    assert all(e.start_s >= last_backward[e.rank] - 1e-12 for e in timeline.comm_events)


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 4)])
@pytest.mark.parametrize("comm_s", [0.5, 3.0])
def test_zero_bubble_reductions_after_the_step_are_all_exposed(p, m, comm_s):
    # Zero bubble's ZeRO 0: the weight pass sets gradients by hand, the runtime reduces after the
    # step's last one (grad_ready "step"): the whole reduction is exposed, as dp_tail_s prices it.
    after = simulate("zero-bubble", [1.0] * p, [2.0] * p, m, grad_sync_s=[comm_s] * p, num_buckets=4, grad_ready="step")
    assert after.step_s == pytest.approx(after.makespan_s + comm_s, rel=1e-12)
    assert after.step_s == pytest.approx(iteration_time_s("zero-bubble", [1.0] * p, [2.0] * p, m) + comm_s, rel=1e-12)
    hooked = simulate("zero-bubble", [1.0] * p, [2.0] * p, m, grad_sync_s=[comm_s] * p, num_buckets=4)
    assert hooked.step_s < after.step_s  # buckets fired during the last weight pass would hide some
    with pytest.raises(ValueError, match="grad_ready"):
        simulate("1f1b", [1.0] * p, [2.0] * p, m, grad_sync_s=[comm_s] * p, grad_ready="later")


def test_without_gradient_sync_the_step_is_the_pipeline():
    timeline = simulate("1f1b", [1.0] * 4, [2.0] * 4, 8)
    assert timeline.comm_events == () and timeline.step_s == timeline.makespan_s
    with pytest.raises(ValueError, match="one non-negative time per pipeline rank"):
        simulate("1f1b", [1.0] * 4, [2.0] * 4, 8, grad_sync_s=[1.0])


# A GPT with 8 blocks of 1.3B-class width: profiles analytically in about a second.
GPT = dict(n_layers=8, d_model=2048, n_heads=16, d_ff=8192, vocab_size=32000, seq_len=1024)


@dataclass(frozen=True)
class OverlapPins(Pins):
    overlap: Overlap = Overlap()


@pytest.fixture(scope="module")
def gpt_profile():
    return profile_model("examples/gpt.py", GPT, [2], device="meta", gpu="a100-80gb", dtype="bfloat16")


@pytest.mark.parametrize("zero", [0, 3])
def test_overlap_only_ever_removes_communication_from_the_step(gpt_profile, zero):
    # 16 GPUs over two nodes, data parallel across them: the gradient reduction (ZeRO 0) or
    # FSDP's gathers and reduce-scatters (ZeRO 3) are the only communication.
    cluster = make_cluster(16, 8, "a100-80gb")
    pins = dict(pp=1, tp=1, dp=16, micro_batch_size=2, recompute="none", zero_stage=zero, schedule="1f1b")
    serial = solve(gpt_profile, cluster, 64, OverlapPins(**pins, overlap=SERIAL)).prediction
    hidden = solve(gpt_profile, cluster, 64, OverlapPins(**pins, overlap=Overlap())).prediction
    assert serial.breakdown_s["dp_comm"] > 0
    assert hidden.breakdown_s["dp_comm"] < serial.breakdown_s["dp_comm"]
    # The compute is the same; the step saves exactly the communication that got hidden.
    assert hidden.breakdown_s["compute"] == pytest.approx(serial.breakdown_s["compute"])
    saved = serial.iteration_time_s - hidden.iteration_time_s
    assert saved == pytest.approx(serial.breakdown_s["dp_comm"] - hidden.breakdown_s["dp_comm"], rel=1e-6)


def test_gpu_clusters_assume_the_runtime_overlaps_and_cpu_clusters_none(gpt_profile):
    from planner.cost.compute import ComputeModel
    from planner.solver.solve import _environment, search

    def env(gpu, pins):
        cluster = make_cluster(8, 8, gpu)
        return _environment(cluster, ComputeModel(gpt_profile, cluster.gpu, "bfloat16"), "bfloat16", pins, 0.9)

    assert env("a100-80gb", Pins()).overlap == Overlap()
    assert env("cpu", Pins()).overlap == SERIAL  # gloo's collectives share the cores with the compute
    assert env("a100-80gb", OverlapPins(overlap=SERIAL)).overlap == SERIAL  # a pins object may name them
    # The evaluation records what it assumed, for the plan's prediction.
    best = search(gpt_profile, make_cluster(16, 8, "a100-80gb"), 64, Pins(pp=2, tp=1, dp=8, micro_batch_size=2)).ranked[0]
    assert best.overlap == ("grad_reduce", "param_gather", "pipeline_p2p")
