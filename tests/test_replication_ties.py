"""PipeDream replication searched for a model with a weight tied across units (issue #16): the
partition the partitioner chose is priced with the tie's copies and all-reduce, and no plan gives
a replica no micro-batch."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from planner.cluster import Link, make_cluster
from planner.solver.solve import Pins, solve
from tests.runtime_plans import GPT_ARGS
from tests.test_tied_stages import TIED_GPT


@pytest.fixture(scope="module")
def tied_profile(tmp_path_factory):
    from planner.profiler import profile_model

    path = tmp_path_factory.mktemp("tied") / "tied_gpt.py"
    path.write_text(TIED_GPT)
    return profile_model(str(path), GPT_ARGS, [1, 2], device="meta", gpu="h100-80gb", dtype="bfloat16")


def _slow(n: int):
    return dataclasses.replace(make_cluster(n, 1, "h100-80gb"), inter_node=Link(1e8, 20e-6))


def test_a_tied_model_is_searched_and_never_given_an_idle_replica(tied_profile):
    for gpus in (2, 3, 4):
        plan = solve(tied_profile, _slow(gpus), 8, Pins(schedule="1f1b"), top_k=1, allow_replication=True)
        note = next(n for n in plan.search.notes if "(PipeDream" in n)
        assert "(PipeDream" in note and "none fits" not in note, note  # searched: chosen or not
        if plan.layout.stage_replicas is not None:
            assert "chosen" in note and plan.batch.num_microbatches >= max(plan.layout.stage_replicas)
            assert any(len(s.units) for s in plan.stages) and plan.prediction.iteration_time_s > 0


def test_the_tie_is_priced_on_the_partition(tied_profile):
    from planner.cost.compute import ComputeModel
    from planner.solver.costs import UnitCosts
    from planner.solver.replication import ReplicatedStages
    from planner.solver.replication_search import tie_terms
    from planner.solver.search import Config, gpu_state_bytes
    from planner.solver.solve import MEMORY_FRACTION, _environment

    cluster = _slow(3)
    coll_cluster = cluster
    from planner.cost.collectives import CollectiveModel, group_placement

    coll = CollectiveModel(coll_cluster)
    costs = UnitCosts(tied_profile, ComputeModel(tied_profile, cluster.gpu, "bfloat16"),
                      lambda t: coll.for_group(group_placement(cluster, t, 1)), "bfloat16")
    table = costs.table(1, False, 1)
    env = _environment(cluster, ComputeModel(tied_profile, cluster.gpu, "bfloat16"), "bfloat16", Pins(), MEMORY_FRACTION)
    (tie,) = table.tied
    n = len(table.parameters)
    split = ReplicatedStages(((0, n - 1), (n - 1, n)), (2, 1), 0.0, 0.0)  # embed on stage 0, head on stage 1
    copies, seconds = tie_terms(table, env, split, 1, 4)
    cfg = Config(1, False, 1, 1, 1, 4, "1f1b", 1, 0)
    assert copies[0] == 0 and copies[1] == pytest.approx(float(gpu_state_bytes(np.array([tie.num_parameters]), cfg, env)[0]))
    # every replica of both stages, the gradient as the runtime holds it (fp32 parameters under autocast)
    assert env.precision.reduce_bytes == 4
    assert seconds == pytest.approx(env.dp_all_reduce_s(tie.num_parameters * 4, 3, 1))
    together = ReplicatedStages(((0, n),), (3,), 0.0, 0.0)  # one stage holds both uses: no copy
    copies, seconds = tie_terms(table, env, together, 1, 4)
    assert copies == [0.0] and seconds > 0  # its replicas still sum the tied gradient
