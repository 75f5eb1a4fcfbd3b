"""A measured 16-bit profile runs the model as the runtime trains it (planner/profiler
`mixed_precision`): fp32 parameters, each forward under autocast; and measured times are not
extrapolated to larger micro-batches more cheaply per sample than the largest one profiled."""

from __future__ import annotations

import torch

from planner.cost.compute import interpolate, interpolate_time
from planner.profiler import mixed_precision, profile_model
from tests.conftest import EXAMPLES

GPT = dict(n_layers=2, d_model=64, n_heads=4, d_ff=256, vocab_size=128, seq_len=32)


def test_mixed_precision_is_the_runtimes_autocast():
    dtype, precision = mixed_precision("cpu", torch.bfloat16)
    assert dtype == torch.float32
    with precision():
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
    assert mixed_precision("meta", torch.bfloat16)[0] == torch.bfloat16
    assert mixed_precision("cpu", torch.float32)[0] == torch.float32


def test_measured_bf16_profile_keeps_what_autocast_training_keeps():
    """Under autocast the residual stream stays fp32 (it starts at fp32 embeddings) and each
    linear saves its 16-bit weight copy for backward, so a block saves more than the same block
    run in pure bf16 (the analytic profile's convention). Parameters are still counted in the
    profile's dtype."""
    measured = profile_model(str(EXAMPLES / "gpt.py"), GPT, [2], device="cpu", dtype="bfloat16", repeats=2, warmup=1)
    analytic = profile_model(str(EXAMPLES / "gpt.py"), GPT, [2], device="meta", gpu="h100-80gb", dtype="bfloat16")
    block_m = next(u for u in measured.units if u.name == "blocks.0")
    block_a = next(u for u in analytic.units if u.name == "blocks.0")
    assert block_m.parameter_bytes == 2 * block_m.num_parameters
    # the block's input arrives in fp32 (the residual stream), as in training
    assert block_m.costs[2].input_bytes == 2 * block_a.costs[2].input_bytes
    assert block_m.costs[2].saved_bytes > block_a.costs[2].saved_bytes + 0.5 * 2 * block_m.num_parameters
    assert measured.whole_model[2].forward_backward_time_s > 0


def test_times_do_not_get_cheaper_per_sample_past_the_largest_size():
    launch_bound = {1: 0.040, 2: 0.040, 4: 0.041, 8: 0.045}  # GPT-2-medium bf16 on an H200
    assert abs(interpolate(launch_bound, 16) - 0.053) < 1e-9  # linear: the flat slope continues
    assert interpolate_time(launch_bound, 16) == 0.045 * 2  # per sample as at micro-batch 8
    assert interpolate_time(launch_bound, 6) == interpolate(launch_bound, 6)
    superlinear = {1: 1.0, 2: 3.0}
    assert interpolate_time(superlinear, 4) == interpolate(superlinear, 4) == 7.0
