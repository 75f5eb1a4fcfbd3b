"""Collective costs against their closed forms (Thakur, Rabenseifner & Gropp 2005) and a simulated ring."""

from __future__ import annotations

import math

import numpy as np
import pytest

from planner.cluster import Cluster, Link, make_cluster
from planner.cost.collectives import RING_TRAFFIC, CollectiveModel, Group, flat_times, group_placement

M = 64 * 2**20  # a 64 MiB message
ALPHA, BETA = 5e-6, 100e9


def _cluster(per_node=8, nodes=1, inter_bw=BETA / 10, fitted=None, gpu="cpu") -> Cluster:
    """Links of round numbers; the CPU preset's collectives are gloo's (the textbook algorithms),
    a GPU preset's NCCL's (planner/cost/nccl.py)."""
    c = make_cluster(per_node * nodes, per_node, gpu)
    return Cluster(c.name, c.gpu, nodes, per_node, Link(BETA, ALPHA), Link(inter_bw, 2 * ALPHA), fitted or {})


def _ring_all_reduce_bytes_sent(n: int, elems: int) -> tuple[np.ndarray, list[np.ndarray], np.ndarray]:
    """Run a ring all-reduce on random data: n-1 reduce-scatter steps (after which rank r holds
    the full sum of chunk r+1), then n-1 all-gather steps passing the full chunks on.
    Returns the bytes each rank sent, every rank's result and the true sum."""
    rng = np.random.default_rng(0)
    data = [rng.standard_normal(elems) for _ in range(n)]
    chunks = [np.array_split(d.copy(), n) for d in data]
    sent = np.zeros(n)
    for phase in ("reduce_scatter", "all_gather"):
        for step in range(n - 1):
            # Rank r sends chunk r - step (+1 in the gather) to rank r + 1; a step's sends are simultaneous.
            offset = 0 if phase == "reduce_scatter" else 1
            msgs = [((r - step + offset) % n, chunks[r][(r - step + offset) % n].copy()) for r in range(n)]
            for r, (i, payload) in enumerate(msgs):
                dst = (r + 1) % n
                chunks[dst][i] = chunks[dst][i] + payload if phase == "reduce_scatter" else payload
                sent[r] += payload.nbytes
    return sent, [np.concatenate(c) for c in chunks], sum(data)


@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_simulated_ring_sends_2_n_minus_1_over_n_of_the_message(n):
    elems = 840  # divisible by 2, 3, 4, 8: equal chunks
    sent, results, expected = _ring_all_reduce_bytes_sent(n, elems)
    for r in results:
        np.testing.assert_allclose(r, expected, rtol=1e-12)  # the simulated ring really all-reduces
    message = elems * 8
    assert sent == pytest.approx(np.full(n, RING_TRAFFIC["all_reduce"](n) * message))
    # ... and the model's bandwidth term is exactly those bytes over the link.
    ring = flat_times("all_reduce", n, message, Link(BETA, 0.0))["ring"]
    assert ring == pytest.approx(sent[0] / BETA)


@pytest.mark.parametrize("n", [2, 4, 8])
def test_ring_all_reduce_closed_form(n):
    times = CollectiveModel(_cluster(n)).algorithm_times("all_reduce", M, Group(n, 1))
    assert times["ring"] == pytest.approx(2 * (n - 1) * ALPHA + 2 * (n - 1) / n * M / BETA)
    assert times["halving_doubling"] == pytest.approx(2 * math.log2(n) * ALPHA + 2 * (n - 1) / n * M / BETA)
    assert times["recursive_doubling"] == pytest.approx(math.log2(n) * (ALPHA + M / BETA))


@pytest.mark.parametrize("kind", ["all_gather", "reduce_scatter"])
@pytest.mark.parametrize("n", [2, 4, 8])
def test_ring_all_gather_and_reduce_scatter_move_n_minus_1_over_n(kind, n):
    t = CollectiveModel(_cluster(n)).algorithm_times(kind, M, Group(n, 1))["ring"]
    assert t == pytest.approx((n - 1) * ALPHA + (n - 1) / n * M / BETA)


def test_broadcast_all_to_all_and_p2p_closed_forms():
    model = CollectiveModel(_cluster(8))
    assert model.algorithm_times("broadcast", M, Group(8, 1)) == pytest.approx(
        {"ring": 7 * ALPHA + M / BETA, "tree": 3 * (ALPHA + M / BETA)})
    assert model.all_to_all_s(M, Group(8, 1)) == pytest.approx(7 * ALPHA + 7 / 64 * M / BETA)
    assert model.p2p_s(M) == pytest.approx(ALPHA + M / BETA)
    assert model.p2p_s(M, same_node=False) == pytest.approx(2 * ALPHA + M / (BETA / 10))
    assert model.p2p_s(0) == 0.0


@pytest.mark.parametrize("kind", ["all_reduce", "broadcast"])
def test_cheapest_algorithm_switches_from_latency_to_bandwidth_optimal(kind):
    model, group = CollectiveModel(_cluster(8)), Group(8, 1)
    small, _ = model.best_algorithm(kind, 1024, group)
    large, _ = model.best_algorithm(kind, M, group)
    # Few latency terms win for small messages, few bytes for large ones.
    assert (small, large) == {"all_reduce": ("recursive_doubling", "halving_doubling"), "broadcast": ("tree", "ring")}[kind]


def test_public_methods_return_the_cheapest_algorithm():
    model = CollectiveModel(_cluster(8, nodes=4))
    for group in (Group(8, 1), Group(32, 4), Group(4, 4)):
        for nbytes in (1e3, 1e6, 1e9):
            for kind in ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all"):
                assert getattr(model, f"{kind}_s")(nbytes, group) == min(model.algorithm_times(kind, nbytes, group).values())


def test_group_of_one_is_free():
    model = CollectiveModel(make_cluster(8))
    for kind in ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all"):
        assert getattr(model, f"{kind}_s")(M, Group(1, 1)) == 0.0
    assert group_placement(make_cluster(8), 1, 4) == Group(1, 1)


@pytest.mark.parametrize("size,stride", [(8, 1), (4, 2), (4, 8), (2, 4), (8, 4), (2, 16), (16, 2), (32, 1)])
def test_placement_matches_listing_the_ranks(size, stride):
    c = make_cluster(32, 8)
    ranks = [i * stride for i in range(size)]
    assert group_placement(c, size, stride) == Group(size, len({r // 8 for r in ranks}))


def test_group_larger_than_the_cluster_is_rejected():
    with pytest.raises(ValueError, match="does not fit"):
        group_placement(make_cluster(8), 4, 4)


def test_stride_crossing_nodes_uses_the_inter_node_link():
    c = _cluster(8, nodes=4)
    model = CollectiveModel(c)
    inside, across = group_placement(c, 4, 1), group_placement(c, 4, 8)  # 4 GPUs of one node vs one per node
    assert inside == Group(4, 1) and across == Group(4, 4)
    assert model.all_reduce_s(M, inside) == min(flat_times("all_reduce", 4, M, c.intra_node).values())
    # One GPU per node: no in-node part, so hierarchical is the flat inter-node collective.
    assert model.all_reduce_s(M, across) == pytest.approx(min(flat_times("all_reduce", 4, M, c.inter_node).values()))
    assert model.all_reduce_s(M, across) > 5 * model.all_reduce_s(M, inside)


def test_hierarchical_beats_flat_ring_across_slow_network():
    times = CollectiveModel(_cluster(8, nodes=4)).algorithm_times("all_reduce", M, Group(32, 4))
    assert times["hierarchical"] < times["flat_ring"] and times["hierarchical"] < times["flat_halving_doubling"]
    # In-node reduce-scatter + all-gather on NVLink, cross-node all-reduce on 1/8 of the data.
    in_node = 2 * (3 * ALPHA + 7 / 8 * M / BETA)  # recursive: log2(8) = 3 latency terms beat the ring's 7
    across = min(flat_times("all_reduce", 4, M / 8, Link(BETA / 10, 2 * ALPHA)).values())
    assert times["hierarchical"] == pytest.approx(in_node + across)


def test_fitted_numbers_replace_alpha_beta_inside_a_node():
    fit = {"latency_s": 1e-3, "bandwidth_bytes_per_s": 1e9}
    model = CollectiveModel(_cluster(4, fitted={"all_reduce": fit, "p2p": fit}))
    assert model.algorithm_times("all_reduce", 1e6, Group(4, 1)) == {"fitted": pytest.approx(1e-3 + 1.5e6 / 1e9)}
    assert model.p2p_s(1e6) == pytest.approx(1e-3 + 1e6 / 1e9)
    assert "fitted" not in model.algorithm_times("all_gather", 1e6, Group(4, 1))  # no fit: alpha-beta


def test_fit_latency_scales_with_the_ring_steps():
    fit = {"latency_s": 1e-3, "bandwidth_bytes_per_s": 1e9, "num_ranks": 2}
    model = CollectiveModel(_cluster(8, fitted={"all_reduce": fit}))
    assert model.all_reduce_s(1e6, Group(8, 1)) == pytest.approx(7 * 1e-3 + 2 * 7 / 8 * 1e6 / 1e9)


def test_fit_made_across_nodes_is_not_used_inside_one():
    fit = {"latency_s": 1e-3, "bandwidth_bytes_per_s": 1e9, "num_ranks": 16, "num_nodes": 2}
    model = CollectiveModel(_cluster(8, nodes=2, fitted={"all_reduce": fit}))
    assert "fitted" not in model.algorithm_times("all_reduce", 1e6, Group(8, 1))


def test_for_group_binds_the_group():
    model, group = CollectiveModel(_cluster(8, nodes=2)), Group(16, 2)
    bound = model.for_group(group)
    for kind in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all"):
        assert getattr(bound, f"{kind}_s")(M) == getattr(model, f"{kind}_s")(M, group)


def test_unknown_collective_is_rejected():
    with pytest.raises(ValueError, match="unknown collective"):
        CollectiveModel(make_cluster(8)).algorithm_times("all_scatter", M, Group(8, 1))


def _ring_s(kind: str, n: int, nodes: int, nbytes: float, busbw: float, protocol: str = "Simple") -> float:
    """NCCL's ring as its tuner prices it (planner/cost/nccl.py), written out."""
    from planner.cost.nccl import BASE_LATENCY_US, HOP_LATENCY_US, PROTOCOLS

    p = PROTOCOLS.index(protocol)
    steps = 2 * (n - 1) if kind == "all_reduce" else n - 1
    inter = (2 * (nodes - 1) if kind == "all_reduce" else nodes - 1) if nodes > 1 else 0
    intra = HOP_LATENCY_US["nvlink"]["ring"][p]
    if nodes > 1:
        intra = max(intra, 3.0 if protocol == "Simple" else 1.0)
    latency = BASE_LATENCY_US["ring"][p] + (steps - inter) * intra + inter * HOP_LATENCY_US["net"]["ring"][p]
    return latency * 1e-6 + nbytes / (busbw * n / steps)


@pytest.mark.parametrize("kind", ["all_reduce", "all_gather", "reduce_scatter"])
def test_nccl_prices_its_own_algorithms(kind):
    # A GPU cluster's collectives are NCCL's: rings (and for all-reduce trees) in three protocols,
    # nothing NCCL does not run (no recursive doubling, no hierarchical all-gather).
    model = CollectiveModel(_cluster(8, nodes=4, gpu="a100-80gb"))
    for group in (Group(8, 1), Group(32, 4)):
        times = model.algorithm_times(kind, M, group)
        algorithms = {name.rsplit("_", 1)[0] for name in times}
        assert algorithms == ({"ring", "tree"} if kind == "all_reduce" else {"ring"})
        busbw = BETA if group.num_nodes == 1 else min(BETA, 8 * BETA / 10)
        assert times["ring_Simple"] == pytest.approx(_ring_s(kind, group.size, group.num_nodes, M, busbw))


def test_nccl_rings_across_nodes_use_one_nic_per_gpu_of_the_group():
    # Eight GPUs of a node in one data-parallel group push the ring through eight NICs (one ring
    # per NIC); a group with one GPU per node has one NIC. Large message: bandwidth-bound.
    model = CollectiveModel(_cluster(8, nodes=4, gpu="a100-80gb"))
    wide, narrow = model.algorithm_times("all_reduce", M, Group(32, 4)), model.algorithm_times("all_reduce", M, Group(4, 4))
    network = BETA / 10
    assert wide["ring_Simple"] == pytest.approx(_ring_s("all_reduce", 32, 4, M, 8 * network))
    # One GPU per node: one NIC, and every hop crosses the network at the tree's network latency (NCCL 2.28).
    assert narrow["ring_Simple"] == pytest.approx((8.4 + 6 * 14.0) * 1e-6 + 2 * 3 / 4 * M / network)
    # The node's links are shared: never more than NVLink carries, whatever the NIC count.
    fast_network = CollectiveModel(_cluster(8, nodes=4, inter_bw=BETA, gpu="a100-80gb"))
    assert fast_network.algorithm_times("all_gather", M, Group(32, 4))["ring_Simple"] == pytest.approx(
        _ring_s("all_gather", 32, 4, M, BETA))
    # With one GPU per node all-gather and reduce-scatter may also take PAT (NCCL >= 2.23).
    assert "pat_Simple" in model.algorithm_times("all_gather", M, Group(4, 4))


def test_ring_latency_over_thousands_of_ranks_makes_the_tree_win():
    # 3072 ranks on 384 nodes: the ring pays a latency per rank, the tree 2 log2(nodes).
    model = CollectiveModel(_cluster(8, nodes=384, gpu="a100-80gb"))
    small = model.algorithm_times("all_reduce", 1e6, Group(3072, 384))
    assert min(small, key=small.get).startswith("tree")
    assert small["ring_Simple"] > 2 * 3071 * 3e-6
    # Small messages: the tree is ~20x cheaper than the ring.
    assert model.all_reduce_s(1e6, Group(3072, 384)) < small["ring_LL"] / 20
    # Large messages: both take the node's 8 links (bandwidth-bound): within 20% of each other.
    large = model.algorithm_times("all_reduce", 64e9, Group(3072, 384))
    assert large["tree_Simple"] == pytest.approx(large["ring_Simple"], rel=0.2)
    # An all-gather has no tree: over thousands of ranks its latency is the ring's, linear in them.
    gather = model.all_gather_s(1e6, Group(3072, 384))
    assert gather > 3071 * 0.6e-6 and gather > 10 * model.all_gather_s(1e6, Group(24, 3))


def test_nvlink_sharp_all_reduce_inside_a_hopper_node():
    # NCCL's NVLS all-reduce on 8 H100s: busbw ~480 GB/s (algbw 275) against the ring's ~370
    # (nccl-tests #212, nccl #1455): the model's busbw on a large message lands there.
    from planner.cost.nccl import NVLS_LATENCY_S

    big = 8 * 2**30
    h100 = CollectiveModel(make_cluster(8, 8, "h100-80gb"))
    name, seconds = h100.best_algorithm("all_reduce", big, Group(8, 1))
    assert name == "nvls"
    assert seconds == pytest.approx(NVLS_LATENCY_S + big / 275e9)
    assert RING_TRAFFIC["all_reduce"](8) * big / seconds / 1e9 == pytest.approx(480, rel=0.01)
    # Two GPUs: the ring moves M once each way, faster than NVLS's rate.
    assert h100.best_algorithm("all_reduce", big, Group(2, 1))[0] != "nvls"
    # It moves no fewer bytes for all-gather or reduce-scatter (nccl #1506): not offered there.
    for kind in ("all_gather", "reduce_scatter"):
        assert "nvls" not in h100.algorithm_times(kind, big, Group(8, 1))
    # A100's NVSwitch has no SHARP; a measured fit (profile-cluster on the node) replaces the model.
    assert "nvls" not in CollectiveModel(make_cluster(8, 8, "a100-80gb")).algorithm_times("all_reduce", big, Group(8, 1))
    fitted = make_cluster(8, 8, "h100-80gb")
    fitted = Cluster(fitted.name, fitted.gpu, 1, 8, fitted.intra_node, fitted.inter_node,
                     {"all_reduce": {"latency_s": 1e-5, "bandwidth_bytes_per_s": 3e11, "num_ranks": 8}})
    assert CollectiveModel(fitted).algorithm_times("all_reduce", big, Group(8, 1)).keys() == {"fitted"}


def test_nccl_times_are_positive_and_grow_with_the_message():
    # Over group shapes from one node to thousands of ranks: every (algorithm, protocol) time is
    # positive and finite, the cheapest never falls as the message grows, and a huge message costs
    # the ring's bytes over the bus bandwidth (latency negligible).
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from planner.cost.nccl import tuned_times

    @settings(max_examples=200, deadline=None)
    @given(st.sampled_from(["all_reduce", "all_gather", "reduce_scatter", "broadcast"]), st.integers(0, 9),
           st.sampled_from([1, 2, 4, 8]), st.floats(1, 1e10), st.sampled_from(["a100-80gb", "h100-80gb", "b200"]))
    def check(kind, log_nodes, per_node, nbytes, gpu):
        nodes = 2**log_nodes
        n = nodes * per_node
        if n < 2:
            return
        busbw = 200e9 if nodes == 1 else min(200e9, per_node * 25e9)
        small, large = tuned_times(kind, n, nodes, nbytes, busbw, gpu), tuned_times(kind, n, nodes, 2 * nbytes, busbw, gpu)
        assert all(0 < t < float("inf") for t in [*small.values(), *large.values()])
        assert min(large.values()) >= min(small.values())
        huge = tuned_times(kind, n, nodes, 1e15, busbw, gpu)["ring_Simple"]
        steps = 2 * (n - 1) if kind == "all_reduce" else n - 1 if kind != "broadcast" else n
        assert huge == pytest.approx(1e15 / (busbw * n / steps), rel=1e-3)

    check()
