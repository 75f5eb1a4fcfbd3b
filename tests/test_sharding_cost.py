"""planner/cost/sharding.py against hand computations: HSDP's collectives and memory, CPU offload."""

from __future__ import annotations

import pytest

from planner.cluster import Link
from planner.cost.memory import model_state_bytes
from planner.cost.sharding import (
    CPU_ADAM_S_PER_PARAMETER,
    PCIE_X16_EFFECTIVE_BYTES_PER_S,
    fsdp_collective_counts,
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


def test_offload_by_hand():
    # 13B parameters on one GPU (shard 1), ZeRO-3, one micro-batch: 2 gathers, 1 reduction of fp32 shards.
    n = 13e9
    cost = offload_step_cost(n, shard_degree=1, num_reductions=1, num_gathers=2)
    gen4 = PCIE_X16_EFFECTIVE_BYTES_PER_S["gen4"]
    assert cost.host_to_device_bytes == 2 * 4 * n and cost.device_to_host_bytes == 4 * n
    assert cost.host_to_device_s == pytest.approx(8 * n / gen4)  # 4.16 s at 25 GB/s
    assert cost.device_to_host_s == pytest.approx(4 * n / gen4)
    assert cost.pcie_s == pytest.approx(12 * n / gen4)
    assert cost.cpu_optimizer_s == pytest.approx(n * CPU_ADAM_S_PER_PARAMETER)  # ~2.9 s
    assert offloaded_state_bytes(n, "bfloat16", zero_stage=3, shard_degree=1).total == 16 * n  # every state leaves


def test_offload_shares_the_host_and_shrinks_with_the_shard():
    # 8 GPUs per host, each with a 1/8 shard: same CPU time per GPU as one GPU with all of it.
    one = offload_step_cost(8e9, shard_degree=1, num_reductions=1, num_gathers=2)
    eight = offload_step_cost(8e9, shard_degree=8, num_reductions=1, num_gathers=2, gpus_per_host=8,
                              pcie_bytes_per_s=PCIE_X16_EFFECTIVE_BYTES_PER_S["gen5"])
    assert eight.cpu_optimizer_s == pytest.approx(one.cpu_optimizer_s)
    assert eight.host_to_device_s == pytest.approx(one.host_to_device_s / 8 / 2)  # 1/8 of the bytes, twice the rate


def test_offload_under_zero2_keeps_the_weights_on_the_gpu():
    n = 1e9
    saved = offloaded_state_bytes(n, "bfloat16", zero_stage=2, shard_degree=4)
    held = model_state_bytes(n, "bfloat16", 2, 4)
    assert saved.weights == 0 and saved.gradients == held.gradients and saved.optimizer == held.optimizer


def test_fsdp2_copies_each_gather_out_on_the_compute_stream():
    # FSDP2 (the planner's runtime, torchtitan) copies each unit's all-gather out of its flat
    # buffer into the parameters before the unit runs: a read and a write of the gathered bytes
    # per gather, in series with compute: every unit's forward gather, and the backward gather of
    # every unit but the last, which keeps its parameters. FSDP1 and DeepSpeed gather into the
    # parameters' own storage (`gather_copy_out=False`): no copy.
    from dataclasses import replace

    from planner.cluster import make_cluster
    from planner.hardware import get_gpu
    from planner.profiler import profile_model
    from planner.solver.solve import Pins, solve

    args = dict(n_layers=4, d_model=1024, n_heads=16, d_ff=4096, vocab_size=8192, seq_len=512)
    profile = profile_model("examples/gpt.py", args, [2], device="meta", gpu="a100-80gb", dtype="bfloat16")
    pins = Pins(pp=1, tp=1, dp=8, micro_batch_size=2, schedule="1f1b", recompute="none", zero_stage=3, cp=1)
    cluster = make_cluster(8, 8, "a100-80gb")
    copied = solve(profile, cluster, 32, pins)
    viewed = solve(profile, cluster, 32, replace(pins, gather_copy_out=False))
    gpu = get_gpu("a100-80gb")
    # read + write of the weights as gathered: fp32, the runtime's parameters under autocast
    assert copied.prediction.state_bytes["weights"] == 4
    gathered = [2 * u.num_parameters * 4 / gpu.achievable_bandwidth for u in profile.units]
    expected = copied.batch.num_microbatches * (2 * sum(gathered) - gathered[-1])
    difference = copied.prediction.iteration_time_s - viewed.prediction.iteration_time_s
    assert difference == pytest.approx(expected, rel=1e-6)
    assert difference > 0
