"""planner/cost/sharding.py against hand computations: HSDP's collectives and memory, CPU offload."""

from __future__ import annotations

import pytest

from planner.cluster import Link
from planner.cost.memory import model_state_bytes
from planner.cost.sharding import (
    CPU_ADAM_S_PER_PARAMETER,
    PCIE_X16_EFFECTIVE_BYTES_PER_S,
    fsdp_collective_counts,
    hsdp_links,
    hsdp_model_state_bytes,
    hsdp_step_comm,
    offload_step_cost,
    offloaded_state_bytes,
)

# Bandwidth-dominated sizes with zero latency, so every algorithm's byte term decides alone.
NVLINK = Link(bandwidth_bytes_per_s=100e9, latency_s=0.0)
IB = Link(bandwidth_bytes_per_s=25e9, latency_s=0.0)
GB = 1e9


def test_collective_counts_follow_the_runtime():
    assert fsdp_collective_counts(1, 4) == (1, 1)  # one reduce-scatter after the last micro-batch
    assert fsdp_collective_counts(2, 4) == (4, 1)  # one per micro-batch; parameters gathered once
    assert fsdp_collective_counts(3, 4) == (4, 8)  # and gathered before each forward and backward
    with pytest.raises(ValueError, match="ZeRO 1-3"):
        fsdp_collective_counts(0, 4)


def test_links_of_shard_and_replica_groups():
    # 8 GPUs per node, tp 2: a shard group of 4 spans 8 ranks (one node); replicas cross nodes.
    assert hsdp_links(NVLINK, IB, shard_degree=4, dp_degree=16, tp_degree=2, gpus_per_node=8) == (NVLINK, IB)
    # shard 8 x tp 2 = 16 ranks do not fit in a node of 8.
    assert hsdp_links(NVLINK, IB, shard_degree=8, dp_degree=16, tp_degree=2, gpus_per_node=8) == (IB, IB)
    # dp 4 x tp 2 = 8: everything in one node.
    assert hsdp_links(NVLINK, IB, shard_degree=2, dp_degree=4, tp_degree=2, gpus_per_node=8) == (NVLINK, NVLINK)
    with pytest.raises(ValueError, match="must divide"):
        hsdp_links(NVLINK, IB, shard_degree=3, dp_degree=16, tp_degree=1, gpus_per_node=8)


def test_hsdp_step_comm_by_hand():
    # 8 shards x 4 replicas, 1 GB of parameters and of gradients, ZeRO-3 with 2 micro-batches.
    reductions, gathers = fsdp_collective_counts(3, 2)
    comm = hsdp_step_comm(GB, GB, shard_degree=8, replica_degree=4, num_reductions=reductions,
                          num_gathers=gathers, shard_link=NVLINK, replica_link=IB)
    # Reduce-scatter and all-gather move (s-1)/s of the full tensor per rank (no latency: ring = recursive).
    assert comm.reduce_scatter_s == pytest.approx(2 * (7 / 8) * GB / 100e9)
    assert comm.all_gather_s == pytest.approx(4 * (7 / 8) * GB / 100e9)
    # The all-reduce carries the 1/8 shard over the replicas: 2 (r-1)/r x G/s per rank (ring, halving-doubling).
    assert comm.all_reduce_s == pytest.approx(2 * 2 * (3 / 4) * (GB / 8) / 25e9)
    assert comm.total_s == pytest.approx(comm.reduce_scatter_s + comm.all_reduce_s + comm.all_gather_s)


def test_hsdp_crosses_the_network_with_an_eighth_of_the_bytes_of_full_sharding():
    # 32 ranks over 4 nodes. Full sharding's reduce-scatter over 32 ranks on the network link
    # (flat, the slowest hop paces the ring) against HSDP's 8-rank in-node reduce-scatter plus
    # the 4-rank all-reduce of 1/8 of the gradient across nodes.
    hsdp = hsdp_step_comm(GB, GB, 8, 4, num_reductions=1, num_gathers=0, shard_link=NVLINK, replica_link=IB)
    full_rs = (31 / 32) * GB / 25e9
    assert hsdp.total_s == pytest.approx((7 / 8) * GB / 100e9 + 2 * (3 / 4) * (GB / 8) / 25e9)
    assert hsdp.total_s < full_rs / 2


def test_one_replica_or_one_shard_costs_no_collective_there():
    comm = hsdp_step_comm(GB, GB, shard_degree=4, replica_degree=1, num_reductions=1, num_gathers=1,
                          shard_link=NVLINK, replica_link=IB)
    assert comm.all_reduce_s == 0.0 and comm.reduce_scatter_s > 0


def test_hsdp_memory_divides_by_the_shard_group():
    n = 7e9
    states = hsdp_model_state_bytes(n, "bfloat16", zero_stage=3, shard_degree=8)
    assert (states.weights, states.gradients, states.optimizer) == (2 * n / 8, 2 * n / 8, 12 * n / 8)
    assert hsdp_model_state_bytes(n, "float32", 1, 8).weights == 4 * n  # ZeRO-1 shards the optimizer only
    assert hsdp_model_state_bytes(n, "float32", 1, 8).optimizer == 8 * n / 8


def test_offload_by_hand():
    # 13B parameters on one GPU (shard 1), ZeRO-3, one micro-batch: 2 gathers, 1 reduction of fp32 shards.
    n = 13e9
    cost = offload_step_cost(n, "bfloat16", zero_stage=3, shard_degree=1, num_reductions=1, num_gathers=2)
    gen4 = PCIE_X16_EFFECTIVE_BYTES_PER_S["gen4"]
    assert cost.host_to_device_bytes == 2 * 4 * n and cost.device_to_host_bytes == 4 * n
    assert cost.host_to_device_s == pytest.approx(8 * n / gen4)  # 4.16 s at 25 GB/s
    assert cost.device_to_host_s == pytest.approx(4 * n / gen4)
    assert cost.pcie_s == pytest.approx(12 * n / gen4)
    assert cost.cpu_optimizer_s == pytest.approx(n * CPU_ADAM_S_PER_PARAMETER)  # ~2.9 s
    assert cost.gpu_bytes_saved.total == 16 * n  # every model state leaves the GPU


def test_offload_shares_the_host_and_shrinks_with_the_shard():
    # 8 GPUs per host, each with a 1/8 shard: same CPU time per GPU as one GPU with all of it.
    one = offload_step_cost(8e9, "float32", 3, shard_degree=1, num_reductions=1, num_gathers=2)
    eight = offload_step_cost(8e9, "float32", 3, shard_degree=8, num_reductions=1, num_gathers=2, gpus_per_host=8,
                              pcie_bytes_per_s=PCIE_X16_EFFECTIVE_BYTES_PER_S["gen5"])
    assert eight.cpu_optimizer_s == pytest.approx(one.cpu_optimizer_s)
    assert eight.host_to_device_s == pytest.approx(one.host_to_device_s / 8 / 2)  # 1/8 of the bytes, twice the rate


def test_offload_under_zero2_keeps_the_weights_on_the_gpu():
    n = 1e9
    saved = offloaded_state_bytes(n, "bfloat16", zero_stage=2, shard_degree=4)
    held = model_state_bytes(n, "bfloat16", 2, 4)
    assert saved.weights == 0 and saved.gradients == held.gradients and saved.optimizer == held.optimizer
