"""PipeDream stage replication: the partitioner DP against brute force, the step-time form,
the plan's validation, and the 1F1B-RR runtime's parity with the one-process reference."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from planner.solver.replication import (
    ReplicationProblem,
    all_partitions,
    brute_force,
    evaluate,
    partition,
    replica_memory_bytes,
    step_time_s,
)

REL = 1e-9  # the DP and brute force sum the same terms in different orders: float rounding only


def _problem(compute, grads, acts, cuts, gpus, m, limit=math.inf) -> ReplicationProblem:
    return ReplicationProblem(
        compute_s=np.array(compute, dtype=float), grad_bytes=np.array(grads, dtype=float),
        state_bytes=4 * np.array(grads, dtype=float), activation_bytes=np.array(acts, dtype=float),
        cut_bytes=np.array(cuts, dtype=float), num_gpus=gpus, num_microbatches=m,
        all_reduce_s=lambda b, r: 0.0 if r == 1 else 2 * (r - 1) / r * b * 1e-3 + 0.01,
        p2p_s=lambda b: b * 1e-3, memory_limit_bytes=limit)


@st.composite
def problems(draw):
    units = draw(st.integers(1, 5))
    gpus = draw(st.integers(1, 5))
    floats = lambda lo, hi: st.lists(st.floats(lo, hi), min_size=units, max_size=units)  # noqa: E731
    compute, grads, acts, cuts = draw(floats(0.01, 10)), draw(floats(0, 100)), draw(floats(0, 50)), draw(floats(0, 100))
    m = draw(st.integers(1, 8))
    # Limits from tight (often infeasible) to none, so the memory constraint is exercised.
    limit = draw(st.sampled_from([math.inf, 400.0, 1000.0, 2000.0]))
    return _problem(compute, grads, acts, cuts, gpus, m, limit)


@settings(max_examples=300)
@given(problems())
def test_dp_matches_brute_force(problem):
    try:
        expected = brute_force(problem)
    except Exception as error:  # noqa: BLE001  (the DP must refuse exactly when nothing fits)
        with pytest.raises(type(error)):
            partition(problem)
        return
    found = partition(problem)
    assert found.bottleneck_s == pytest.approx(expected.bottleneck_s, rel=REL)
    assert found.fill_s == pytest.approx(expected.fill_s, rel=REL)
    again = evaluate(problem, found.bounds, found.replicas)  # the partition it returns has the values it claims
    assert again.bottleneck_s == pytest.approx(found.bottleneck_s, rel=REL)
    assert sum(found.replicas) == problem.num_gpus
    assert max(replica_memory_bytes(problem, found)) <= problem.memory_limit_bytes


def test_heavy_layer_gets_replicas():
    """PipeDream's VGG case: a unit heavy in compute with few weights, then light units with many
    (the fully connected layers). Replicating the heavy one alone balances the pipeline without
    all-reducing the heavy weights: [0, 1) on 2 replicas (4 / 2 = 2 s), [1, 3) on 1 (2 s)."""
    problem = _problem([4, 1, 1], [0, 1000, 1000], [0] * 3, [0] * 3, gpus=3, m=8)
    found = partition(problem)
    assert (found.bounds, found.replicas) == (((0, 1), (1, 3)), (2, 1))
    unreplicated = step_time_s(problem, ((0, 1), (1, 2), (2, 3)), (1, 1, 1))
    data_parallel = step_time_s(problem, ((0, 3),), (3,))
    assert step_time_s(problem, found.bounds, found.replicas) < min(unreplicated, data_parallel)


def test_step_time_reduces_to_1f1b():
    """Without replicas the step time is 1F1B's closed form, sum + (m - 1) max (Alpa eq. 2);
    with them, stage k paces ceil(m / r_k) micro-batches per replica."""
    problem = _problem([1, 2, 3], [0] * 3, [0] * 3, [0] * 3, gpus=3, m=4)
    assert step_time_s(problem, ((0, 1), (1, 2), (2, 3)), (1, 1, 1)) == pytest.approx(6 + 3 * 3)
    two = _problem([1, 3], [0, 0], [0, 0], [0, 0], gpus=3, m=4)
    # Stage 1 (3 s) on 2 replicas: each runs 2 micro-batches; the pace is (2 - 1) x 3 = 3, and
    # stage 0 (1 s) paces (4 - 1) x 1 = 3 as well; the fill is 1 + 3. The all-reduce of 0 bytes: 0.01.
    assert step_time_s(two, ((0, 1), (1, 2)), (1, 2)) == pytest.approx(4 + 3 + 0.01)


def test_all_partitions_counts():
    """Compositions: U = 3 units, G = 3 GPUs: 1 stage x 1 + 2 stages (2 cuts x 2 splits) + 3 stages x 1."""
    assert len(list(all_partitions(3, 3))) == 1 + 4 + 1


def _replicated_plan(replicas, cuts, m=4, mbs=2):
    from planner.plan import Batch, ClusterRef, Layout, ModelRef, Plan, Stage, stage_ranks
    from tests.conftest import EXAMPLES
    from tests.runtime_plans import GPT_ARGS, GPT_UNITS

    lay = Layout(pp_degree=len(replicas), stage_replicas=list(replicas))
    stages = [Stage(units=GPT_UNITS[cuts[k]:cuts[k + 1]], ranks=stage_ranks(lay, k)) for k in range(len(replicas))]
    return Plan(model=ModelRef(file=str(EXAMPLES / "gpt.py"), args=GPT_ARGS),
                cluster=ClusterRef(name="cpu", gpus_per_node=sum(replicas), gpu="cpu"),
                batch=Batch(global_batch_size=mbs * m, micro_batch_size=mbs, num_microbatches=m), layout=lay, stages=stages)


def test_plan_validates_replicas():
    plan = _replicated_plan((2, 1), [0, 3, 7])
    assert plan.world_size == 3 and [s.ranks for s in plan.stages] == [[0, 1], [2]]
    data = plan.model_dump()
    bad = {**data, "layout": {**data["layout"], "dp_degree": 2}}
    with pytest.raises(ValueError, match="replication is the data parallelism"):
        type(plan).model_validate(bad)
    few = {**data, "batch": {"global_batch_size": 2, "micro_batch_size": 2, "num_microbatches": 1}}
    with pytest.raises(ValueError, match="a replica would get no micro-batch"):
        type(plan).model_validate(few)
    wrong = {**data, "layout": {**data["layout"], "stage_replicas": [2, 1, 1]}}
    with pytest.raises(ValueError, match="at least one replica"):
        type(plan).model_validate(wrong)


def test_actions_round_robin():
    """1F1B-RR: replica q of a stage with r replicas runs micro-batches q, q + r, ..."""
    from runtime.pp_replicated import actions, peer

    plan = _replicated_plan((2, 1), [0, 3, 7], m=4)
    assert actions(plan, 0, 1) == [("F", 1), ("F", 3), ("B", 1), ("B", 3)]
    assert [peer(plan, 0, i) for i in range(4)] == [0, 1, 0, 1]
    assert [peer(plan, 1, i) for i in range(4)] == [2, 2, 2, 2]
    # Without replicas this is 1F1B: stage 0 of 3 warms up with 3 forwards (Narayanan et al. 2021).
    plain = _replicated_plan((1, 1, 1), [0, 2, 4, 7], m=4)
    assert actions(plain, 0, 0) == [("F", 0), ("F", 1), ("F", 2), ("B", 0), ("F", 3), ("B", 1), ("B", 2), ("B", 3)]
    # Stage 0 of (1, 2) feeds 3 ranks: 3 in flight too; each replica of stage 1 holds ceil(2 / 2) = 1.
    assert actions(_replicated_plan((1, 2), [0, 3, 7], m=4), 1, 1) == [("F", 1), ("B", 1), ("F", 3), ("B", 3)]


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize(("replicas", "schedule", "m"), [((2, 1), "1f1b", 4), ((1, 2), "1f1b", 4), ((2, 1), "gpipe", 4),
                                                         ((2, 1), "1f1b", 3)])  # m = 3: replicas of unequal shares
def test_replicated_parity(replicas, schedule, m, tmp_path):
    """examples/gpt.py on 3 gloo processes matches the one-process reference (tolerances:
    tests/test_runtime_parity.py's, float32 with sums reordered over replicas and micro-batches)."""
    from tests.test_runtime_parity import check_parity

    plan = _replicated_plan(replicas, [0, 3, 7], m=m)
    plan.layout.schedule = schedule
    check_parity(plan, tmp_path)


@pytest.fixture(scope="module")
def vgg_profile():
    from planner.profiler import profile_model
    from tests.conftest import EXAMPLES

    return profile_model(str(EXAMPLES / "vgg.py"), {"image_size": 224, "num_classes": 1000, "dropout": 0.0}, [8, 16, 32],
                         device="meta", gpu="h100-80gb", dtype="bfloat16")


def test_solver_chooses_replication_on_slow_network(vgg_profile):
    """VGG-16 on 8 H100s one per node over 25 Gb/s Ethernet (PipeDream's setting): replicating the
    convolutions and keeping the weight-heavy classifier on one GPU beats every 1F1B plan."""
    import dataclasses

    from planner.cluster import Link, make_cluster
    from planner.solver.solve import Pins, solve

    cluster = dataclasses.replace(make_cluster(8, 1, "h100-80gb"), inter_node=Link(25e9 / 8 * 0.8, 20e-6))
    # 1F1B pinned on both: the replicated pipeline is priced as 1F1B-RR (like for like).
    plain = solve(vgg_profile, cluster, 256, Pins(schedule="1f1b"), top_k=1)
    plan = solve(vgg_profile, cluster, 256, Pins(schedule="1f1b"), top_k=1, allow_replication=True)
    assert plan.layout.stage_replicas is not None and sum(plan.layout.stage_replicas) == 8
    assert plan.layout.stage_replicas[0] > 1 and plan.layout.stage_replicas[-1] == 1  # the classifier is not replicated
    assert plan.prediction.iteration_time_s < plain.prediction.iteration_time_s
    assert any("chosen" in note for note in plan.search.notes)
    assert [u for s in plan.stages for u in s.units] == [u.name for u in vgg_profile.units]


def test_solver_keeps_data_parallel_on_nvlink(vgg_profile):
    """On one NVLink node data parallelism's all-reduce is cheap: the search's plan stays, with a note."""
    from planner.cluster import make_cluster
    from planner.solver.solve import solve

    plan = solve(vgg_profile, make_cluster(4, 4, "h100-80gb"), 128, top_k=1, allow_replication=True)
    assert plan.layout.stage_replicas is None
    assert any("not chosen" in note for note in plan.search.notes)


def test_unreplicated_pricing_matches_the_search(vgg_profile):
    """With one replica per stage the 1F1B-RR step time is the search's own 1F1B price of the same
    cuts (same closed form, p2p and optimizer terms): the two models agree where they overlap,
    so comparing a replicated pipeline with the search's plans compares like with like."""
    import dataclasses

    from planner.cluster import Link, make_cluster
    from planner.cost.compute import ComputeModel
    from planner.solver.replication_search import replication_problem
    from planner.solver.solve import MEMORY_FRACTION, Pins, _environment, search

    cluster = dataclasses.replace(make_cluster(4, 1, "h100-80gb"), inter_node=Link(25e9 / 8 * 0.8, 20e-6))
    pins = Pins(pp=4, dp=1, tp=1, zero_stage=0, recompute="none", schedule="1f1b", micro_batch_size=8)
    result = search(vgg_profile, cluster, 128, pins, keep=1)
    best = result.ranked[0]
    env = _environment(cluster, ComputeModel(vgg_profile, cluster.gpu, "bfloat16"), "bfloat16", pins, MEMORY_FRACTION)
    problem = replication_problem(result.costs.table(1, False, 8), env, 4, 16, 8)
    # Float rounding only: the same terms summed in another order.
    assert step_time_s(problem, best.bounds, (1, 1, 1, 1)) == pytest.approx(best.iteration_time_s, rel=1e-9)


@pytest.mark.parametrize(("replicas", "m"), [((1, 1, 1), 4), ((2, 1), 4), ((1, 2), 5), ((3, 1, 2), 7), ((2, 2), 2)])
def test_runtime_order_holds_what_the_cost_model_prices(replicas, m):
    """The 1F1B-RR order's peak micro-batches in flight per replica is the cost model's
    ceil(min(M, g) / r_s), g the ranks from stage s on (planner/solver/replication.py, memory)."""
    from runtime.pp_replicated import actions

    cuts = list(range(len(replicas) + 1))
    plan = _replicated_plan(replicas, cuts, m=m)
    for s, r in enumerate(replicas):
        priced = math.ceil(min(m, sum(replicas[s:])) / r)
        peaks = []
        for q in range(r):
            held, peak = 0, 0
            for kind, _ in actions(plan, s, q):
                held += 1 if kind == "F" else -1
                peak = max(peak, held)
            peaks.append(peak)
        assert max(peaks) == priced, (s, peaks)  # replica 0 has the most micro-batches
