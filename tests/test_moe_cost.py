"""Mixture of experts in the cost model and the search (planner/cost/moe.py): the all-to-all
against its closed form, the experts' GEMM rescaling, EP memory by hand, `--ep` pins, and (slow)
a solver plan with EP that the runtime runs with parity."""

from __future__ import annotations

import numpy as np
import pytest

from planner.cluster import make_cluster
from planner.cost.collectives import CollectiveModel, Group
from planner.cost.memory import model_state_bytes
from planner.cost.moe import (
    ALL_TO_ALLS_PER_STEP,
    COUNT_BYTES,
    MoEShape,
    dispatch_bytes_per_rank,
    expert_time_ratio,
    moe_shapes,
    permutation_s,
)
from planner.errors import PlannerError
from planner.profiler import profile_model
from planner.solver.search import Config, state_bytes, updated_parameters
from planner.solver.solve import Pins, price_config, search, solve
from tests.conftest import EXAMPLES

# Four layers of top-2-of-8 experts, wide enough that EP is worth pricing on H100s.
MOE = dict(n_layers=4, d_model=256, n_heads=4, vocab_size=256, seq_len=128, num_experts=8, top_k=2, moe_d_ff=512)


@pytest.fixture(scope="module")
def moe_meta():
    return profile_model(str(EXAMPLES / "moe.py"), MOE, [1, 2], device="meta", gpu="h100-80gb", dtype="bfloat16")


def test_all_to_all_matches_its_closed_form():
    cluster = make_cluster(16, 8, "h100-80gb")
    coll = CollectiveModel(cluster)
    nvl, net = cluster.intra_node, cluster.inter_node
    per_rank = 8e6  # bytes one rank holds; M = n x per_rank
    # Inside a node: pairwise exchange, (n-1) alpha + (n-1)/n^2 M / beta.
    n = 8
    assert coll.all_to_all_s(n * per_rank, Group(n, 1)) == pytest.approx(
        (n - 1) * nvl.latency_s + (n - 1) / n * per_rank / nvl.bandwidth_bytes_per_s)
    # Two nodes of 8: the 8 remote eighths leave through the GPU's NIC while 7 local ones cross NVLink.
    n, g = 16, 8
    expected = (n - 1) * net.latency_s + max((g - 1) / n * per_rank / nvl.bandwidth_bytes_per_s,
                                             (n - g) / n * per_rank / net.bandwidth_bytes_per_s)
    assert coll.all_to_all_s(n * per_rank, Group(n, 2)) == pytest.approx(min(
        expected, (n - 1) * net.latency_s + (n - 1) / n * per_rank / net.bandwidth_bytes_per_s))


def _shape(tokens: float) -> MoEShape:
    d, f, e = 1024, 768, 64
    return MoEShape(tokens=tokens, top_k=8, num_experts=e, model_dim=d, flops_per_copy=2 * 3 * d * f,
                    expert_weight_bytes=3 * d * f * 2, copy_activation_bytes=(2 * d + 4 * f) * 2, dtype_bytes=2)


def test_expert_gemms_rescale_by_the_roofline():
    flops, bandwidth = 700e12, 2.8e12
    # Many tokens: every expert GEMM is compute-bound at ep 1 and 8, the time does not change.
    assert expert_time_ratio(_shape(65536), 8, flops, bandwidth) == pytest.approx(1.0)
    # 64 tokens x top-8 over 64 experts: 8 rows per expert, bound by reading its weights; at ep 8
    # each local expert gets 64 rows, and a rank holds 8 experts instead of 64.
    shape = _shape(64)
    w, a, f = shape.expert_weight_bytes, shape.copy_activation_bytes, shape.flops_per_copy
    by_hand = (8 * max(64 * f / flops, (w + 64 * a) / bandwidth)) / (64 * max(8 * f / flops, (w + 8 * a) / bandwidth))
    assert expert_time_ratio(shape, 8, flops, bandwidth) == pytest.approx(by_hand)
    assert by_hand < 0.2
    # The busiest rank's imbalance scales its rows; permutation moves the copies twice, read + write.
    assert expert_time_ratio(_shape(65536), 8, flops, bandwidth, imbalance=1.5) == pytest.approx(1.5)
    assert permutation_s(shape, 8, bandwidth) == pytest.approx(4 * 64 * 8 * 1024 * 2 / bandwidth)
    assert permutation_s(shape, 1, bandwidth) == 0.0


def test_profile_records_the_experts(moe_meta):
    layers = [layer for u in moe_meta.units for layer in u.moe]
    assert len(layers) == 4 and {(x.num_experts, x.top_k, x.model_dim) for x in layers} == {(8, 2, 256)}


def _cfg(**kw) -> Config:
    base = dict(tp=1, sequence_parallel=False, pp=1, dp=4, micro_batch_size=1, num_microbatches=2, schedule="1f1b",
                virtual_stages=1, zero_stage=1, ep=1)
    return Config(**{**base, **kw})


def test_ep_memory_by_hand(moe_meta):
    from planner.cost.compute import ComputeModel
    from planner.cost.collectives import group_placement
    from planner.solver.costs import UnitCosts
    from planner.solver.solve import _environment, ep_all_to_all

    cluster = make_cluster(8, 8, "h100-80gb")
    coll = CollectiveModel(cluster)
    costs = UnitCosts(moe_meta, ComputeModel(moe_meta, cluster.gpu, "bfloat16"),
                      lambda t: coll.for_group(group_placement(cluster, t, 1)), "bfloat16",
                      ep_all_to_all_s=ep_all_to_all(cluster, coll))
    env = _environment(cluster, ComputeModel(moe_meta, cluster.gpu, "bfloat16"), "bfloat16", Pins(), 0.9)
    dense, ep2 = costs.table(1, False, 1), costs.table(1, False, 1, ep=2)
    experts = sum(layer.expert_parameters for u in moe_meta.units for layer in u.moe)
    assert experts == 4 * 8 * 3 * 256 * 512  # four layers of 8 SwiGLU experts, 3 d x f matrices each
    assert dense.parameters.sum() == moe_meta.model.num_parameters
    assert ep2.parameters.sum() == moe_meta.model.num_parameters - experts / 2  # each rank holds half the experts
    assert ep2.expert_parameters.sum() == experts / 2
    # ZeRO 1 over dp 4: dense states over 4 ranks, the experts' over expert-dp = 4 / 2 = 2 ranks.
    cfg = _cfg(ep=2)
    assert cfg.expert_dp == 2
    dense_states = model_state_bytes(moe_meta.model.num_parameters - experts, env.precision, 1, 4).total
    expert_states = model_state_bytes(experts / 2, env.precision, 1, 2).total
    assert state_bytes(ep2, cfg, env).sum() == pytest.approx(dense_states + expert_states)
    # A rank's optimizer updates 1/4 of the dense parameters and 1/2 of its half of the experts.
    assert updated_parameters(ep2, cfg, 0, len(ep2.parameters)) == pytest.approx(
        (moe_meta.model.num_parameters - experts) / 4 + experts / 2 / 2)
    # The all-to-alls: 4 per MoE layer and micro-batch (dispatch and combine, their reverses in the
    # backward) and each forward's exchange of the per-expert copy counts (E int64s a rank) that
    # sets the splits; the permutation lands in the stage times.
    assert (ep2.ep_comm_s > 0).sum() == 4 and dense.ep_comm_s is None
    seconds = ep_all_to_all(cluster, coll)
    for u in moe_meta.units:
        for shape in moe_shapes(u, 1, 2):
            expected = ALL_TO_ALLS_PER_STEP * seconds(dispatch_bytes_per_rank(shape, 2), 2, 1, False) \
                + seconds(COUNT_BYTES * shape.num_experts, 2, 1, False)
            assert ep2.ep_comm_s[u.index] == pytest.approx(expected)
            assert seconds(COUNT_BYTES * shape.num_experts, 2, 1, False) > 0
    assert np.all(ep2.forward_s >= 0) and np.all(ep2.recompute_s["full"] >= ep2.recompute_s["none"])


def test_ep_pins_are_checked(moe_meta, tmp_path):
    cluster = make_cluster(8, 8, "h100-80gb")
    with pytest.raises(PlannerError, match=r"--ep 3 does not divide the number of experts \(8\)"):
        solve(moe_meta, cluster, 16, Pins(ep=3))
    with pytest.raises(PlannerError, match=r"--ep 4 does not divide --dp 2"):
        solve(moe_meta, cluster, 16, Pins(ep=4, dp=2))
    dense = profile_model(str(EXAMPLES / "llama.py"), {}, [1], device="meta", gpu="h100-80gb")
    with pytest.raises(PlannerError, match="--ep 2: the model has no mixture-of-experts layer"):
        solve(dense, cluster, 16, Pins(ep=2))


def test_pinned_ep_is_planned_and_placed(moe_meta):
    plan = solve(moe_meta, make_cluster(8, 8, "h100-80gb"), 16, Pins(ep=4, dp=8))
    assert plan.layout.ep_degree == 4 and not plan.layout.sequence_parallel
    experts = {k: v for s in plan.stages for k, v in s.experts.items()}
    assert experts == {f"layers.{i}.moe.experts": 2 for i in range(4)}  # 8 experts / ep 4
    assert plan.prediction.breakdown_s["ep_comm"] > 0


def test_free_search_is_never_beaten_by_an_ep_pin(moe_meta):
    cluster = make_cluster(8, 8, "h100-80gb")
    free = search(moe_meta, cluster, 16).ranked[0]
    for ep in (1, 2, 4, 8):
        pinned = search(moe_meta, cluster, 16, Pins(ep=ep)).ranked
        assert pinned and free.iteration_time_s <= pinned[0].iteration_time_s * (1 + 1e-9)


def test_folded_layout_is_priced(moe_meta):
    # EP 4 over dp 2 x tp 2 with sequence parallelism (Megatron-Core's folding): priced and searched.
    cluster = make_cluster(4, 4, "h100-80gb")
    cfg = _cfg(tp=2, sequence_parallel=True, dp=2, ep=4, micro_batch_size=1, num_microbatches=4)
    assert cfg.ep_folded and cfg.expert_dp == 1 and cfg.expert_dp_stride == 4
    e = price_config(moe_meta, cluster, cfg)
    assert e.feasible and e.breakdown_s["ep_comm"] > 0
    # The search reaches it: EP 4 beside TP 2 on 4 GPUs is only possible folded.
    result = search(moe_meta, cluster, 8, Pins(ep=4, tp=2, sequence_parallel=True))
    assert result.ranked and all(c.config.ep_folded for c in result.ranked)


def test_moe_imbalance_slows_the_experts(moe_meta):
    cluster = make_cluster(8, 8, "h100-80gb")
    balanced = search(moe_meta, cluster, 16, Pins(ep=8, dp=8, tp=1, pp=1)).ranked[0]
    skewed = search(moe_meta, cluster, 16, Pins(ep=8, dp=8, tp=1, pp=1), moe_imbalance=1.5).ranked[0]
    assert skewed.iteration_time_s > balanced.iteration_time_s
    # The busiest rank sends 1.5x the bytes; the all-to-all's latency terms do not grow with them.
    assert balanced.breakdown_s["ep_comm"] < skewed.breakdown_s["ep_comm"] <= 1.5 * balanced.breakdown_s["ep_comm"]
    with pytest.raises(PlannerError, match="--moe-imbalance must be at least 1.0"):
        search(moe_meta, cluster, 16, moe_imbalance=0.5)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_solver_ep_plan_runs_with_parity(tmp_path):
    # Every plan the solver writes runs: a measured CPU profile of the small MoE, EP pinned.
    from tests.test_runtime_ep import MOE_ARGS
    from tests.test_runtime_parity import check_parity

    profile = profile_model(str(EXAMPLES / "moe.py"), MOE_ARGS, [1, 2], device="cpu", repeats=2)
    plan = solve(profile, make_cluster(2, gpu="cpu"), 4, Pins(ep=2, dp=2, pp=1))
    assert plan.layout.ep_degree == 2 and plan.stages[0].experts
    check_parity(plan, tmp_path)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_solver_ep_plan_runs_the_unmodified_hugging_face_moe(tmp_path):
    # Qwen3-MoE from its public config, shrunk by overrides: profiled (measured), solved with EP, run with parity.
    pytest.importorskip("transformers")
    import planner.hf_config_model as hf
    from tests.test_runtime_parity import check_parity

    args = dict(config=str(EXAMPLES / "hf" / "qwen3-30b-a3b.json"), seq_len=16, num_hidden_layers=2, hidden_size=32,
                intermediate_size=64, moe_intermediate_size=16, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                num_experts=4, num_experts_per_tok=2, vocab_size=128)
    profile = profile_model(hf.__file__, args, [1, 2], device="cpu", repeats=2)
    assert [layer.num_experts for u in profile.units for layer in u.moe] == [4, 4]
    plan = solve(profile, make_cluster(2, gpu="cpu"), 4, Pins(ep=2, dp=2, pp=1))
    assert plan.layout.ep_degree == 2 and len(plan.stages[0].experts) == 2
    check_parity(plan, tmp_path)
