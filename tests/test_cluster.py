"""Cluster presets and files: defaults, round trips, overrides, and errors that name the field."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from planner.cluster import NETWORK_EFFICIENCY, NVLINK_EFFICIENCY, Link, load_cluster, make_cluster, save_cluster
from planner.errors import PlannerError
from planner.hardware import GPUS, get_gpu
ROOT = Path(__file__).resolve().parents[1]


def test_make_cluster_defaults_to_nodes_of_eight():
    c = make_cluster(16)
    assert (c.num_nodes, c.gpus_per_node, c.world_size, c.gpu.name) == (2, 8, 16, "a100-80gb")
    assert make_cluster(4).gpus_per_node == 4  # fewer than a node: one node
    assert make_cluster(12, gpu="cpu").gpus_per_node == 12  # gloo processes share one machine


def test_preset_links_come_from_the_gpu_spec():
    # What NCCL reaches: a fixed share of the data sheet's link rates (planner/cluster.py docstring).
    c = make_cluster(8, 8, "h100-80gb")
    gpu = get_gpu("h100-80gb")
    assert c.intra_node.bandwidth_bytes_per_s == gpu.intra_node_bandwidth_bytes_per_s * NVLINK_EFFICIENCY
    assert c.inter_node.bandwidth_bytes_per_s == gpu.inter_node_bandwidth_bytes_per_s * NETWORK_EFFICIENCY
    assert c.intra_node.latency_s < c.inter_node.latency_s  # NVLink hop cheaper than an InfiniBand one


def test_gpus_must_fill_whole_nodes():
    with pytest.raises(PlannerError, match="do not split into nodes") as err:
        make_cluster(12, 8)
    assert "--gpus-per-node" in err.value.hint
    with pytest.raises(PlannerError, match="must be positive"):
        make_cluster(0)
    with pytest.raises(PlannerError, match="Unknown GPU"):
        make_cluster(8, gpu="tpu-v9")


def test_to_ref_names_the_cluster():
    assert make_cluster(16, 8, "h200").to_ref() == {"name": "h200x16", "num_nodes": 2, "gpus_per_node": 8, "gpu": "h200"}


@pytest.mark.parametrize("gpu", sorted(GPUS))
def test_round_trip_every_preset(tmp_path, gpu):
    c = make_cluster(16 if gpu != "cpu" else 4, 8 if gpu != "cpu" else 2, gpu)
    back = load_cluster(save_cluster(c, tmp_path / "c.yaml"))
    assert back == c and back.name == c.name


def test_round_trip_keeps_overrides_and_fits(tmp_path):
    c = make_cluster(8, 8, "a100-80gb")
    c = replace(c, gpu=replace(c.gpu, memory_bytes=12345, peak_flops={**c.gpu.peak_flops, "bfloat16": 1e14}),
                inter_node=Link(1e9, 1e-5),
                fitted={"all_reduce": {"latency_s": 1e-4, "bandwidth_bytes_per_s": 2e9, "num_ranks": 8, "points": [[1, 2.0]]}},
                compute_slowdown=1.25, pipeline_overhead_s=4e-4)
    path = save_cluster(c, tmp_path / "c.yaml")
    assert "memory_bytes: 12345" in path.read_text() and "memory_bandwidth" not in path.read_text()  # only what changed
    back = load_cluster(path)
    assert back == c and back.fitted == c.fitted


def test_round_trip_of_a_renamed_gpu(tmp_path):
    c = make_cluster(2, 2, "cpu")
    c = replace(c, gpu=replace(c.gpu, name="my-accelerator", memory_bytes=2**30))
    assert load_cluster(save_cluster(c, tmp_path / "c.yaml")).gpu == c.gpu


def test_json_file_overrides_a_preset(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"gpu": {"preset": "a100-80gb", "memory_bytes": 12345, "intra_node_bandwidth_bytes_per_s": 1e11},
                                "num_nodes": 2, "gpus_per_node": 4}))
    c = load_cluster(path)
    assert c.gpu.memory_bytes == 12345 and c.world_size == 8 and c.name == "c"
    assert c.intra_node.bandwidth_bytes_per_s == 1e11 * NVLINK_EFFICIENCY  # the GPU override carries into the default link
    assert c.gpu.peak_flops == get_gpu("a100-80gb").peak_flops


def test_links_in_the_file_win(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("gpu: h100-80gb\nnum_nodes: 2\ninter_node: {bandwidth_bytes_per_s: 1.0e10}\n")
    c = load_cluster(path)
    assert c.inter_node == Link(1e10, make_cluster(8, 8, "h100-80gb").inter_node.latency_s)


@pytest.mark.parametrize("text,needle", [
    ("gpu: a100-80gb\nnum_nodes: -1\n", "num_nodes must be positive"),
    ("gpu: a100-80gb\nnum_nodes: 1.5\n", "num_nodes must be a whole number"),
    ("gpu: a100-80gb\ngpus_per_node: eight\n", "gpus_per_node must be a number"),
    ("gpu: tpu-v9\n", "gpu: Unknown GPU 'tpu-v9'"),
    ("gpu: {preset: tpu-v9}\n", "gpu.preset: Unknown GPU"),
    ("gpu: {preset: a100-80gb, memory_bytes: lots}\n", "gpu.memory_bytes must be a number"),
    ("gpu: {preset: a100-80gb, peak_flops: {bfloat16: -1}}\n", r"gpu.peak_flops.bfloat16 must be positive"),
    ("gpu: {preset: a100-80gb, hbm: 3}\n", "unknown gpu fields \\['hbm'\\]"),
    ("gpu: [a100]\n", "`gpu` must be a preset name"),
    ("gpu: a100-80gb\nintra_node: {bandwidth_bytes_per_s: .inf}\n", "intra_node.bandwidth_bytes_per_s must be positive and finite"),
    ("gpu: a100-80gb\ninter_node: {latency_s: 0}\n", "inter_node.latency_s must be positive"),
    ("gpu: a100-80gb\ninter_node: {bw: 1}\n", "unknown inter_node fields"),
    # A missing field is named as missing (before the pydantic schema it read "must be a number (got None)").
    ("gpu: a100-80gb\nfitted: {all_reduce: {latency_s: 1.0e-5}}\n", "missing `fitted.all_reduce.bandwidth_bytes_per_s`"),
    ("gpu: a100-80gb\nfitted: {all_reduce: {latency_s: 1.0e-5, bandwidth_bytes_per_s: fast}}\n",
     "fitted.all_reduce.bandwidth_bytes_per_s must be a number"),
    ("gpu: a100-80gb\nfitted: {all_reduce: {latency_s: 1.0e-5, bandwidth_bytes_per_s: 1.0e9, num_ranks: 2.5}}\n",
     "fitted.all_reduce.num_ranks must be a whole number"),
    ("gpu: a100-80gb\nfitted: {all_reduce: 3}\n", "`fitted.all_reduce` must be a mapping"),
    ("gpu: a100-80gb\nintra_node: 3\n", "`intra_node` must be a mapping"),
    ("gpu: {preset: a100-80gb, peak_flops: {}}\n", "`gpu.peak_flops` must be a mapping of dtype names to FLOP/s"),
    ("gpu: {memory_bytes: 1}\n", "missing `gpu.preset`"),
    ("nodes: [{gpu: tpu-v9}]\n", r"nodes\[0\].gpu: Unknown GPU 'tpu-v9'"),
    ("nodes: [{gpu: a100-80gb, count: 0}]\n", r"nodes\[0\].count must be positive"),
    ("nodes: [{gpu: a100-80gb}]\ngpu: a100-80gb\n", "give either `nodes` or `gpu`"),
    ("gpu: a100-80gb\nnum_gpus: 8\n", "unknown fields \\['num_gpus'\\]"),
    ("num_nodes: 2\n", "missing `gpu`"),
    ("- a list\n", "expected a mapping"),
    ("gpu: [unclosed\n", "cannot be parsed"),
    ("nodes: [{gpu: a100-80gb, count: 1}, {gpu: h100-80gb, count: 1}]\n", "heterogeneous clusters are not supported yet"),
    ("nodes: [{gpu: a100-80gb, gpus_per_node: 8}, {gpu: a100-80gb, gpus_per_node: 4}]\n", "heterogeneous clusters"),
    ("nodes: []\n", "`nodes` must be a non-empty list"),
    ("gpu: cpu\ncompute_slowdown: 0.5\n", "compute_slowdown must be at least 1"),
    ("gpu: cpu\ncompute_slowdown: fast\n", "compute_slowdown must be a number"),
    ("gpu: cpu\npipeline_overhead_s: -1.0e-4\n", "pipeline_overhead_s must be 0 or positive"),
    ("gpu: cpu\npipeline_overhead_s: false\n", "pipeline_overhead_s must be a number"),
])
def test_bad_cluster_files_are_explained(tmp_path, text, needle):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(PlannerError, match=needle) as err:
        load_cluster(path)
    assert str(path) in err.value.message and err.value.hint


def test_every_problem_is_listed_with_the_known_fields(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("gpu: {preset: a100-80gb, hbm: 3}\nnum_nodes: 0\ninter_node: {bw: 1}\n")
    with pytest.raises(PlannerError) as err:
        load_cluster(path)
    lines = err.value.message.splitlines()
    assert lines[0] == f"{path}:" and "num_nodes must be positive and finite (got 0)" in lines[1:][0]
    assert {"unknown gpu fields ['hbm'].", "unknown inter_node fields ['bw']."} <= {line.strip() for line in lines}
    assert "'memory_bytes'" in err.value.hint and "'latency_s'" in err.value.hint  # each parent's own fields


def test_heterogeneous_message_lists_the_node_types(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("nodes: [{gpu: a100-80gb, count: 2, gpus_per_node: 8}, {gpu: h100-80gb, count: 1, gpus_per_node: 8}]\n")
    with pytest.raises(PlannerError, match=r"8 x a100-80gb, 8 x h100-80gb"):
        load_cluster(path)


def test_homogeneous_node_list_is_accepted(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("nodes: [{gpu: a100-80gb, count: 2, gpus_per_node: 8}, {gpu: a100-80gb, count: 1, gpus_per_node: 8}]\n")
    c = load_cluster(path)
    assert (c.num_nodes, c.gpus_per_node, c.gpu.name) == (3, 8, "a100-80gb")


def test_missing_file_is_explained(tmp_path):
    with pytest.raises(PlannerError, match="does not exist"):
        load_cluster(tmp_path / "nope.yaml")


@pytest.mark.parametrize("path", sorted((ROOT / "profiles" / "clusters").glob("*.yaml")), ids=lambda p: p.stem)
def test_bundled_cluster_files_load(path: Path):
    c = load_cluster(path)
    if c.gpu.name == path.stem:  # one file per preset: exactly the preset's numbers
        assert c.gpu == get_gpu(path.stem) and c.name == path.stem
        preset = make_cluster(c.world_size, c.gpus_per_node, path.stem)
        assert (c.intra_node, c.inter_node) == (preset.intra_node, preset.inter_node)


def test_one_bundled_file_per_preset():
    assert set(GPUS) <= {p.stem for p in (ROOT / "profiles" / "clusters").glob("*.yaml")}
