"""Cluster files, and how a collective's cost depends on message size and group placement.

The closed forms of each algorithm (ring, halving-doubling, hierarchical, fitted) are checked in
tests/test_collectives.py; they are not repeated here."""

from __future__ import annotations

import json

import pytest

from planner.cluster import Cluster, Link, load_cluster, make_cluster, save_cluster
from planner.cost.collectives import CollectiveModel, Group, group_placement
from planner.errors import PlannerError

M = 64 * 2**20  # a 64 MiB message


def _one_link_cluster(n=8, bw=100e9, lat=5e-6, nodes=1) -> Cluster:
    c = make_cluster(n * nodes, n, "a100-80gb")
    return Cluster(c.name, c.gpu, nodes, n, Link(bw, lat), Link(bw / 10, lat * 2))


def test_small_messages_prefer_latency_optimal_algorithms():
    # NCCL (a GPU cluster): the low-latency protocol for small messages, the full-rate one for large.
    model = CollectiveModel(_one_link_cluster(8))
    small, large = model.algorithm_times("all_reduce", 1024, Group(8, 1)), model.algorithm_times("all_reduce", M, Group(8, 1))
    assert min(small, key=small.get).endswith("_LL") and min(large, key=large.get) == "ring_Simple"
    # gloo (the CPU preset): the textbook algorithms, recursive halving-doubling against the ring.
    cpu = make_cluster(8, 8, "cpu")
    gloo = CollectiveModel(Cluster(cpu.name, cpu.gpu, 1, 8, Link(100e9, 5e-6), Link(10e9, 1e-5)))
    small = gloo.algorithm_times("all_reduce", 1024, Group(8, 1))
    assert min(small, key=small.get) in ("halving_doubling", "tree", "recursive_doubling")
    assert small["ring"] > small["halving_doubling"]  # 14 latency terms against 6


def test_placement_decides_the_link():
    c = make_cluster(32, 8, "a100-80gb")
    assert group_placement(c, 8, 1) == Group(8, 1)  # a TP group: one node
    assert group_placement(c, 4, 8) == Group(4, 4)  # a DP group strided by a node: four nodes
    assert group_placement(c, 4, 2) == Group(4, 1)
    model = CollectiveModel(c)
    assert model.all_reduce_s(M, Group(8, 4)) > model.all_reduce_s(M, Group(8, 1))
    assert model.p2p_s(M, same_node=False) > model.p2p_s(M, same_node=True)


def test_cluster_file_round_trip(tmp_path):
    c = make_cluster(16, 8, "h100-80gb")
    back = load_cluster(save_cluster(c, tmp_path / "c.yaml"))
    assert (back.num_nodes, back.gpus_per_node, back.gpu, back.intra_node, back.inter_node) == (2, 8, c.gpu, c.intra_node, c.inter_node)


def test_cluster_file_overrides_a_preset(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"gpu": {"preset": "a100-80gb", "memory_bytes": 12345}, "num_nodes": 2, "gpus_per_node": 4}))
    c = load_cluster(path)
    assert c.gpu.memory_bytes == 12345 and c.world_size == 8


@pytest.mark.parametrize("text,needle", [
    ("gpu: a100-80gb\nnum_nodes: -1\n", "num_nodes must be positive"),
    ("gpu: tpu-v9\n", "Unknown GPU"),
    ("num_nodes: 2\n", "missing `gpu`"),
    ("gpu: [unclosed\n", "cannot be parsed"),
    ("nodes: [{gpu: a100-80gb, count: 1}, {gpu: h100-80gb, count: 1}]\n", "heterogeneous clusters are not supported"),
])
def test_bad_cluster_files_are_explained(tmp_path, text, needle):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(PlannerError, match=needle):
        load_cluster(path)


def test_homogeneous_node_list_is_accepted(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("nodes: [{gpu: a100-80gb, count: 2, gpus_per_node: 8}]\n")
    assert load_cluster(path).world_size == 16


def test_gpus_must_fill_whole_nodes():
    with pytest.raises(PlannerError, match="do not split into nodes"):
        make_cluster(12, 8)
