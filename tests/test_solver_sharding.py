"""Hybrid sharding and CPU offload in the search (planner/solver, priced with
planner/cost/sharding.py): states by hand, the replica all-reduce, where HSDP is offered,
offload that makes a model fit one GPU, pins, and (slow) solver plans that run with parity."""

from __future__ import annotations

import pytest

from planner.cluster import make_cluster
from planner.cost.memory import model_state_bytes
from planner.cost.sharding import CPU_ADAM_S_PER_PARAMETER, offloaded_state_bytes
from planner.errors import PlannerError
from planner.profiler import profile_model
from planner.solver.search import Config, state_bytes
from planner.solver.solve import Pins, price_config, search, solve
from tests.conftest import EXAMPLES

GPT = dict(n_layers=4, d_model=2048, n_heads=16, d_ff=8192, vocab_size=32000, seq_len=1024)


@pytest.fixture(scope="module")
def gpt_meta():
    return profile_model(str(EXAMPLES / "gpt.py"), GPT, [1, 2], device="meta", gpu="h100-80gb", dtype="bfloat16")


def _cfg(**kw) -> Config:
    base = dict(tp=1, sequence_parallel=False, pp=1, dp=32, micro_batch_size=1, num_microbatches=1, schedule="1f1b",
                virtual_stages=1, zero_stage=3)
    return Config(**{**base, **kw})


def test_hsdp_states_and_replica_all_reduce(gpt_meta):
    from planner.solver.solve import _environment
    from planner.cost.compute import ComputeModel

    cluster = make_cluster(32, 8, "h100-80gb")
    env = _environment(cluster, ComputeModel(gpt_meta, cluster.gpu, "bfloat16"), "bfloat16", Pins(), 0.9)
    plain, hsdp = _cfg(), _cfg(shard_degree=8)
    assert (hsdp.zero_dp, hsdp.replicas) == (8, 4) and (plain.zero_dp, plain.replicas) == (32, 1)
    table = search(gpt_meta, cluster, 32, Pins(pp=1, tp=1, zero_stage=3, micro_batch_size=1)).costs.table(1, False, 1)
    params = gpt_meta.model.num_parameters
    assert state_bytes(table, hsdp, env).sum() == pytest.approx(model_state_bytes(params, "bfloat16", 3, 8).total)
    assert state_bytes(table, plain, env).sum() == pytest.approx(model_state_bytes(params, "bfloat16", 3, 32).total)
    # HSDP's gathers stay in the node; its reduce-scatter adds an all-reduce of the 1/8 shard across 4 nodes.
    a, b = price_config(gpt_meta, cluster, plain), price_config(gpt_meta, cluster, hsdp)
    assert a.feasible and b.feasible and b.breakdown_s["dp_comm"] != a.breakdown_s["dp_comm"]
    assert max(b.peak_memory_bytes) > max(a.peak_memory_bytes)  # 4 replicas of the states


def test_hsdp_is_offered_only_across_nodes(gpt_meta):
    one_node = search(gpt_meta, make_cluster(8, 8, "h100-80gb"), 32, keep=50).ranked
    assert all(e.config.shard_degree is None for e in one_node)
    many = search(gpt_meta, make_cluster(32, 8, "h100-80gb"), 32, Pins(pp=1, tp=1, zero_stage=3), keep=50).ranked
    # The node (8 ranks) and the narrowest group of whole nodes whose states fit, and its double (8, 16).
    assert {e.config.shard_degree for e in many} == {None, 8, 16}
    plan = solve(gpt_meta, make_cluster(32, 8, "h100-80gb"), 32, Pins(pp=1, tp=1, zero_stage=3, shard_degree=8))
    assert plan.layout.shard_degree == 8
    plain = solve(gpt_meta, make_cluster(32, 8, "h100-80gb"), 32, Pins(pp=1, tp=1, zero_stage=3, shard_degree=32))
    assert plain.layout.shard_degree is None  # a group of all dp ranks is plain sharding


def test_sharding_pins_are_checked(gpt_meta):
    cluster = make_cluster(32, 8, "h100-80gb")
    with pytest.raises(PlannerError, match="--shard-degree 3 must be at least 2 and divide --dp 32"):
        solve(gpt_meta, cluster, 32, Pins(dp=32, shard_degree=3))
    with pytest.raises(PlannerError, match="--shard-degree needs ZeRO >= 1"):
        solve(gpt_meta, cluster, 32, Pins(shard_degree=8, zero_stage=0))
    with pytest.raises(PlannerError, match="--offload needs ZeRO >= 1"):
        solve(gpt_meta, cluster, 32, Pins(offload=True, zero_stage=0))


def test_offload_fits_a_model_one_gpu_cannot_hold():
    # 8 layers of d 8192: 6.4 B parameters, 16 bytes each of states = 103 GB > an 80 GB H100.
    args = dict(n_layers=8, d_model=8192, n_heads=64, d_ff=32768, vocab_size=32000, seq_len=1024)
    profile = profile_model(str(EXAMPLES / "gpt.py"), args, [1], device="meta", gpu="h100-80gb", dtype="bfloat16")
    cluster = make_cluster(1, 1, "h100-80gb")
    with pytest.raises(PlannerError, match="--offload"):
        solve(profile, cluster, 4)
    plan = solve(profile, cluster, 4, allow_offload=True)
    assert plan.training.offload == "cpu" and plan.layout.zero_stage >= 1
    params = profile.model.num_parameters
    saved = offloaded_state_bytes(params, "bfloat16", plan.layout.zero_stage, 1).total
    assert saved > 0.5 * model_state_bytes(params, "bfloat16", plan.layout.zero_stage, 1).total
    # The optimizer steps on the host CPU: every parameter at CPU-Adam's rate (one GPU per host).
    assert plan.prediction.breakdown_s["optimizer"] == pytest.approx(params * CPU_ADAM_S_PER_PARAMETER)
    assert plan.prediction.breakdown_s["offload_pcie"] > 0


def test_offload_is_never_chosen_when_it_is_not_needed(gpt_meta):
    cluster = make_cluster(8, 8, "h100-80gb")
    free = search(gpt_meta, cluster, 32, allow_offload=True).ranked[0]
    assert not free.config.offload  # it only adds host work when the states fit the GPU


def test_zero1_offload_keeps_accumulated_gradients_on_the_gpu(gpt_meta):
    # ZeRO 1 reduce-scatters on the step's last backward only: with several micro-batches (or a
    # pipeline) FSDP2 holds the whole gradients on the GPU until then, so offload moves only the
    # optimizer state; with one micro-batch each unit's gradient is reduced as the backward goes.
    from planner.cost.compute import ComputeModel
    from planner.solver.search import gpu_state_parts
    from planner.solver.solve import _environment

    cluster = make_cluster(32, 8, "h100-80gb")
    env = _environment(cluster, ComputeModel(gpt_meta, cluster.gpu, "bfloat16"), "bfloat16", Pins(), 0.9)
    n = float(gpt_meta.model.num_parameters)
    whole = model_state_bytes(n, env.precision, 1, 32)
    one, accumulated, piped = (gpu_state_parts(n, _cfg(zero_stage=1, offload=True, **kw), env)
                               for kw in ({}, {"num_microbatches": 2}, {"pp": 2, "dp": 16}))
    assert one.gradients == 0 and one.optimizer == 0
    assert accumulated.gradients == pytest.approx(whole.gradients) and accumulated.optimizer == 0
    assert piped.gradients == pytest.approx(whole.gradients)
    zero2 = gpu_state_parts(n, _cfg(zero_stage=2, offload=True, num_microbatches=2), env)
    assert zero2.gradients == 0  # sharded every micro-batch, the shards accumulate on the host


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("pins,offload", [(Pins(dp=4, pp=1, tp=1, zero_stage=3, shard_degree=2), False),
                                          (Pins(dp=2, pp=1, tp=1, zero_stage=3, offload=True), True)])
def test_solver_sharding_plans_run_with_parity(pins, offload, tmp_path):
    from tests.runtime_plans import GPT_ARGS
    from tests.test_runtime_parity import check_parity

    profile = profile_model(str(EXAMPLES / "gpt.py"), GPT_ARGS, [1, 2], device="cpu", repeats=2)
    plan = solve(profile, make_cluster(pins.dp, gpu="cpu"), 8, pins)
    assert plan.layout.shard_degree == pins.shard_degree and (plan.training.offload == "cpu") == offload
    check_parity(plan, tmp_path)
