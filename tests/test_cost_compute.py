"""planner/cost/compute.py: where unit and optimizer times come from, and what scales them."""

from __future__ import annotations


import pytest

from planner.cost.compute import OPTIMIZER_TRAFFIC_BYTES_PER_PARAM, ComputeModel, interpolate, tp_time_s
from planner.hardware import get_gpu
from planner.profiler import profile_model

ARGS = dict(n_layers=2, d_model=32, n_heads=4, d_ff=64, vocab_size=64, seq_len=16)


@pytest.fixture(scope="module")
def cpu_profile():
    return profile_model("examples/gpt.py", ARGS, [1, 2], device="cpu", repeats=2, warmup=1)


def test_interpolation_is_linear_between_sizes_and_proportional_below():
    points = {2: 2.0, 4: 3.0}
    assert interpolate(points, 3) == pytest.approx(2.5)
    assert interpolate(points, 8) == pytest.approx(5.0)  # extrapolated along the last segment
    assert interpolate(points, 1) == pytest.approx(1.5)  # extrapolated along the first segment...
    assert interpolate({2: 1.0, 4: 3.0}, 1) == pytest.approx(0.5)  # ...but never below proportional-to-zero
    assert interpolate({4: 8.0}, 2) == pytest.approx(4.0)


def test_measured_profile_on_its_own_device_is_used_as_measured(cpu_profile):
    model = ComputeModel(cpu_profile, get_gpu("cpu"), use_whole_model_ratio=False)
    assert model.source == "profiled"
    unit = cpu_profile.units[1]
    t = model.unit_time(unit, 2)
    assert t.forward_s == unit.costs[2].forward_time_s and t.backward_s == unit.costs[2].backward_time_s


def test_another_target_is_priced_by_its_roofline(cpu_profile):
    model = ComputeModel(cpu_profile, get_gpu("a100-80gb"), dtype="float32")
    assert model.source == "roofline"
    unit, gpu = cpu_profile.units[1], get_gpu("a100-80gb")
    c = unit.costs[2]
    expected = max(c.forward_flops / gpu.achievable_flops("float32"), c.forward_memory_traffic_bytes / gpu.achievable_bandwidth)
    assert model.unit_time(unit, 2).forward_s == pytest.approx(expected)


def test_node_contention_slows_every_unit_and_the_optimizer(cpu_profile):
    alone = ComputeModel(cpu_profile, get_gpu("cpu"))
    shared = ComputeModel(cpu_profile, get_gpu("cpu"), slowdown=1.5)
    for unit in cpu_profile.units:
        assert shared.unit_time(unit, 2).total_s == pytest.approx(1.5 * alone.unit_time(unit, 2).total_s)
    assert shared.optimizer_s_per_param() == pytest.approx(1.5 * alone.optimizer_s_per_param())


def test_optimizer_step_is_the_measured_one_on_the_profiled_device(cpu_profile):
    measured = ComputeModel(cpu_profile, get_gpu("cpu")).optimizer_s_per_param()
    assert measured == pytest.approx(cpu_profile.optimizer_step_s / cpu_profile.model.num_parameters)
    # Elsewhere (or with nothing measured) AdamW is memory-bound: 32 bytes per parameter at the achievable bandwidth.
    a100 = get_gpu("a100-80gb")
    assert ComputeModel(cpu_profile, a100, dtype="float32").optimizer_s_per_param() == \
        pytest.approx(OPTIMIZER_TRAFFIC_BYTES_PER_PARAM / a100.achievable_bandwidth)
    unmeasured = cpu_profile.model_copy(update={"optimizer_step_s": None})
    cpu = get_gpu("cpu")
    assert ComputeModel(unmeasured, cpu).optimizer_s_per_param() == pytest.approx(OPTIMIZER_TRAFFIC_BYTES_PER_PARAM / cpu.achievable_bandwidth)


def test_tensor_parallel_time_divides_the_sharded_share_only():
    assert tp_time_s(1.0, 0.8, 4, sequence_parallel=False) == pytest.approx(0.8 / 4 + 0.2)
    assert tp_time_s(1.0, 0.8, 4, sequence_parallel=True) == pytest.approx(1.0 / 4)


def test_fused_attention_runs_at_the_gpus_attention_rate():
    """FlashAttention reaches a smaller share of an H100's peak than its GEMMs do: the H100 preset
    prices FlashAttention-2's benchmarked rates (planner/hardware.py `KERNEL_BENCHMARKS`), its backward
    at its own rate and a causal kernel's skipped tiles; an analytic H100 profile prices the flash
    kernels' FLOPs so, records them (and the causal ones) apart, and a roofline for another GPU prices
    them at that GPU's rates. Megatron-LM's stack prices attention as its published runs show it, on
    every score (`stack_gpu`). An A100 prices attention as its GEMMs, every score counted."""
    from dataclasses import replace

    import torch

    from planner.cluster import parse_cluster
    from planner.engines.megatron import stack_gpu
    from planner.hardware import END_TO_END_ATTENTION_FRACTION, KERNEL_BENCHMARKS, kernel_attention
    from planner.profiler.counters import MetaAttentionMode, OpCostMode

    h100, a100 = get_gpu("h100-80gb"), get_gpu("a100-80gb")
    assert h100.attention_efficiency is not None and h100.attention_efficiency < 0.7 * h100.matmul_efficiency
    assert a100.achievable_attention_flops("bfloat16") == a100.achievable_flops("bfloat16")
    f = 1e12  # one forward's FLOPs as torch counts them (every score); its backward: 2.5 f, the scores recomputed
    assert a100.attention_time_s(f, "bfloat16", backward=True, causal=True) == pytest.approx(f / a100.achievable_flops("bfloat16"))
    # FlashAttention-2's own figures (its count: causal = half the scores, backward = 2.5 forwards, as torch's):
    rates = KERNEL_BENCHMARKS["flash-attention-2"]
    sustained = h100.attention_efficiency * 989.4 / rates["forward"]  # the GEMMs' sustained / burst ratio
    assert sustained == pytest.approx(698.6 / 823.9)
    rate = sustained * 1e12
    assert h100.attention_time_s(f, "bfloat16") == pytest.approx(f / (rate * rates["forward"]))
    assert h100.attention_time_s(f, "bfloat16", causal=True) == pytest.approx(f / 2 / (rate * rates["forward_causal"]))
    assert h100.attention_time_s(2.5 * f, "bfloat16", backward=True) == pytest.approx(2.5 * f / (rate * rates["backward"]))
    # The causal backward at the backward's rate times the forward's causal ratio (the figure not given).
    causal_backward = rates["backward"] * rates["forward_causal"] / rates["forward"]
    assert h100.attention_time_s(2.5 * f, "bfloat16", backward=True, causal=True) == pytest.approx(1.25 * f / (rate * causal_backward))
    # Megatron-LM's stack: every score at 35% of the peak (sustained), both passes, causal or not.
    megatron = stack_gpu(h100)
    every_score = f / (h100.peak_flops["bfloat16"] * END_TO_END_ATTENTION_FRACTION)
    for backward in (False, True):
        for causal in (False, True):
            assert megatron.attention_time_s(f, "bfloat16", backward, causal) == pytest.approx(every_score)
    assert stack_gpu(a100) == a100  # the GEMM rate already
    cudnn = parse_cluster({"gpu": {"preset": "h100-80gb", **kernel_attention("cudnn")}, "num_nodes": 1, "gpus_per_node": 8}).gpu
    assert stack_gpu(cudnn) == cudnn  # a cluster file's own kernel is kept
    assert cudnn.attention_causal_ratio == pytest.approx(529 / 600) and cudnn.attention_backward_ratio == pytest.approx(518 / 600)
    assert cudnn.attention_time_s(f, "bfloat16", causal=True) < h100.attention_time_s(f, "bfloat16", causal=True)
    # The kernels' benchmarks against every score at 35%: a causal forward 0.52x, a causal backward 0.60x.
    assert h100.attention_time_s(f, "bfloat16", causal=True) / every_score == pytest.approx(0.52, abs=0.01)
    assert h100.attention_time_s(f, "bfloat16", True, True) / every_score == pytest.approx(0.60, abs=0.01)
    q = torch.empty(8, 16, 4096, 128, device="meta", dtype=torch.bfloat16)
    for gpu in (h100, megatron):
        for causal in (True, False):
            ops = OpCostMode(gpu, "bfloat16")
            with MetaAttentionMode(), ops:
                torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=causal)
            assert ops.totals.attention_flops == ops.totals.flops > 0
            assert ops.totals.causal_attention_flops == (ops.totals.flops if causal else 0)
            compute_bound = gpu.attention_time_s(ops.totals.flops, "bfloat16", causal=causal)
            assert ops.totals.roofline_time_s == pytest.approx(compute_bound + gpu.kernel_overhead_s)

    prof = profile_model("examples/gpt.py", dict(ARGS, seq_len=256), [1], device="meta", gpu="a100-80gb", dtype="bfloat16")
    block = prof.units[1]
    costs = block.costs[1]
    assert 0 < costs.forward_attention_flops < costs.forward_flops and 0 < costs.backward_attention_flops
    # GPT's attention is causal (is_causal=True), forward and backward; torch counts the backward as
    # 2.5 forwards (the scores recomputed), as FlashAttention does.
    assert costs.backward_attention_flops == pytest.approx(2.5 * costs.forward_attention_flops)
    assert costs.forward_causal_attention_flops == costs.forward_attention_flops
    assert costs.backward_causal_attention_flops == costs.backward_attention_flops
    gemm = h100.achievable_flops("bfloat16")
    for gpu in (h100, megatron, replace(h100, name="other")):
        times = ComputeModel(prof, gpu).unit_time(block, 1)
        for pass_, got in (("forward", times.forward_s), ("backward", times.backward_s)):
            flops, attention = getattr(costs, f"{pass_}_flops"), getattr(costs, f"{pass_}_attention_flops")
            expected = max((flops - attention) / gemm + gpu.attention_time_s(attention, "bfloat16", pass_ == "backward", True),
                           getattr(costs, f"{pass_}_memory_traffic_bytes") / gpu.achievable_bandwidth)
            assert got == pytest.approx(expected)


def test_an_analytic_profile_prices_per_op_for_the_spec_it_was_made_for(tmp_path):
    """An analytic profile records the spec whose rates made its times: a cluster GPU with those
    rates (whatever its memory and links) takes the per-op times; one with other rates (a cluster
    file's overrides of the preset) is priced by roofline, and the plan says so. `planner profile
    --gpu` takes a cluster file for it."""
    from dataclasses import replace

    from typer.testing import CliRunner

    from planner.cli import app
    from planner.cluster import load_cluster, make_cluster
    from planner.hardware import kernel_attention
    from planner.profile_schema import Profile
    from planner.solver.plan_builder import device_mismatch

    h100 = get_gpu("h100-80gb")
    kernel = replace(h100, **kernel_attention("cudnn"))
    args = dict(ARGS, seq_len=256)
    preset = profile_model("examples/gpt.py", args, [1], device="meta", gpu="h100-80gb", dtype="bfloat16")
    own = profile_model("examples/gpt.py", args, [1], device="meta", gpu=kernel, dtype="bfloat16")
    assert own.target_gpu == "h100-80gb" and own.target_gpu_spec["attention_causal_ratio"] == kernel.attention_causal_ratio
    assert ComputeModel(preset, h100).source == "profiled" and ComputeModel(preset, kernel).source == "roofline"
    assert ComputeModel(own, kernel).source == "profiled" and ComputeModel(own, h100).source == "roofline"
    assert ComputeModel(preset, replace(h100, memory_bytes=10**9, inter_node_bandwidth_bytes_per_s=1e9)).source == "profiled"
    older = preset.model_copy(update={"target_gpu_spec": None})  # written before the spec was recorded: the preset's
    assert ComputeModel(older, h100).source == "profiled" and ComputeModel(older, kernel).source == "roofline"
    newer = preset.model_copy(update={"target_gpu_spec": {**preset.target_gpu_spec, "a_later_field": 1.0}})
    assert newer.analytic_gpu() == h100 and ComputeModel(newer, h100).source == "profiled"
    # The blocks' times at the cluster's rates are the profile's own per-op times.
    block = own.units[1]
    assert ComputeModel(own, kernel).unit_time(block, 1).backward_s == pytest.approx(block.costs[1].backward_time_s)
    cluster = make_cluster(8, 8, "h100-80gb")
    assert device_mismatch(own, replace(cluster, gpu=kernel)) is None
    assert "prices each unit's totals by roofline" in device_mismatch(preset, replace(cluster, gpu=kernel))
    # The CLI: a cluster file's GPU.
    path = tmp_path / "cluster.yaml"
    path.write_text("gpu: {preset: h100-80gb, memory_bandwidth_bytes_per_s: 2.4e12, attention_causal_ratio: 0.9}\n"
                    "num_nodes: 1\ngpus_per_node: 8\n")
    out = tmp_path / "p.json"
    result = CliRunner().invoke(app, ["profile", "examples/gpt.py", "--device", "meta", "--gpu", str(path), "--dtype", "bfloat16",
                                      "-o", str(out), "--model-arg", "n_layers=2"])
    assert result.exit_code == 0, result.output
    written = Profile.model_validate_json(out.read_text())
    assert written.target_gpu_spec["memory_bandwidth_bytes_per_s"] == 2.4e12
    assert ComputeModel(written, load_cluster(path).gpu).source == "profiled"
    missing = CliRunner().invoke(app, ["profile", "examples/gpt.py", "--device", "meta", "--gpu", str(tmp_path / "none.yaml")])
    assert missing.exit_code != 0 and "does not exist" in str(missing.exception)


@pytest.mark.parametrize("flags, dtype", [(["--device", "meta", "--gpu", "h100-80gb"], "bfloat16"),
                                          (["--device", "meta"], "bfloat16"),  # analytic without --gpu: the h100-80gb
                                          (["--device", "meta", "--gpu", "cpu"], "float32"),  # its bf16 is slower than fp32
                                          (["--device", "meta", "--gpu", "a100-80gb", "--dtype", "float32"], "float32"),
                                          (["--device", "cpu", "--repeats", "1"], "float32")])
def test_profile_trains_a_gpu_in_16_bits_unless_told(tmp_path, flags, dtype):
    """Without --dtype a GPU target is profiled in bfloat16 (mixed precision, as GPUs train and
    `planner run` trains), not float32 at a GPU's tenth-of-the-peak fp32 rate; a CPU in float32;
    --dtype wins. The note says what was chosen and how to have float32."""
    from typer.testing import CliRunner

    from planner.cli import app
    from planner.profile_schema import Profile

    out = tmp_path / "p.json"
    result = CliRunner().invoke(app, ["profile", "examples/gpt.py", *flags, "-o", str(out), "--model-arg", "n_layers=1",
                                      "--model-arg", "d_model=32", "--model-arg", "seq_len=16"])
    assert result.exit_code == 0, result.output
    assert Profile.model_validate_json(out.read_text()).dtype == dtype
    assert ("--dtype float32 for float32" in result.output) == (dtype != "float32" and "--dtype" not in flags)


def test_float32_convolutions_run_at_the_tf32_peak_and_linears_do_not():
    """PyTorch runs float32 convolutions in TF32 on Ampere and later (`cudnn.allow_tf32`) and
    float32 matrix products in float32 (`cuda.matmul.allow_tf32`): an analytic A100 profile prices
    a convolution's FLOPs at the TF32 peak, a linear's at the float32 one, records the convolutions'
    apart, and a roofline for another GPU prices them at that GPU's TF32 rate. In bfloat16, and on a
    GPU without a TF32 peak, a convolution runs at the GEMM rate."""
    import torch

    from planner.errors import PlannerError
    from planner.hardware import TF32_DTYPE, GPUSpec
    from planner.profiler.counters import OpCostMode

    a100, h100 = get_gpu("a100-80gb"), get_gpu("h100-80gb")
    assert a100.achievable_convolution_flops("float32") == pytest.approx(8 * a100.achievable_flops("float32"))
    assert a100.achievable_convolution_flops("bfloat16") == a100.achievable_flops("bfloat16")
    no_tf32 = GPUSpec(name="old", peak_flops={"float32": 1e13, "float16": 1e14})
    assert no_tf32.achievable_convolution_flops("float32") == no_tf32.achievable_flops("float32")
    with pytest.raises(PlannerError) as refused:
        a100.achievable_flops("int8")
    assert TF32_DTYPE not in str(refused.value)  # a key for convolutions, not a dtype a plan is asked in

    x = torch.empty(64, 256, 56, 56, device="meta")
    conv, linear = torch.empty(256, 256, 3, 3, device="meta"), torch.empty(1024, 1024, device="meta")
    ops = OpCostMode(a100, "float32")
    with ops:
        torch.nn.functional.conv2d(x, conv, padding=1)
    assert ops.totals.convolution_flops == ops.totals.flops > 0
    compute_bound = ops.totals.flops / a100.achievable_convolution_flops("float32")
    assert compute_bound > ops.totals.traffic_bytes / a100.achievable_bandwidth
    assert ops.totals.roofline_time_s == pytest.approx(compute_bound + a100.kernel_overhead_s)
    ops = OpCostMode(a100, "float32")
    with ops:
        torch.empty(8192, 1024, device="meta") @ linear
    assert ops.totals.convolution_flops == 0
    assert ops.totals.roofline_time_s == pytest.approx(ops.totals.flops / a100.achievable_flops("float32") + a100.kernel_overhead_s)

    prof = profile_model("examples/resnet.py", dict(depth=18, width=8, image_size=32), [2], device="meta", gpu="a100-80gb",
                         dtype="float32")
    block = next(u for u in prof.units if u.name == "layer1.0")
    costs = block.costs[2]
    assert costs.forward_convolution_flops > 0.9 * costs.forward_flops and costs.backward_convolution_flops > 0
    on_h100 = ComputeModel(prof, h100).unit_time(block, 2)
    expected = max((costs.forward_flops - costs.forward_convolution_flops) / h100.achievable_flops("float32")
                   + costs.forward_convolution_flops / h100.achievable_convolution_flops("float32"),
                   costs.forward_memory_traffic_bytes / h100.achievable_bandwidth)
    assert on_h100.forward_s == pytest.approx(expected)


@pytest.mark.parametrize("masked", [False, True])
def test_meta_attention_keeps_the_value_width(masked):
    """DeepSeek's latent attention has q and k 192 wide and v 128: the meta kernel must return v's
    width, as SDPA does (flash's meta function would return q's), and count q.k over 192 and
    p.v over 128."""
    import torch
    from torch.utils.flop_counter import sdpa_flop_count

    from planner.profiler.counters import MetaAttentionMode, OpCostMode

    q = torch.empty(1, 4, 256, 192, device="meta", dtype=torch.bfloat16)
    v = torch.empty(1, 4, 256, 128, device="meta", dtype=torch.bfloat16)
    mask = torch.ones(256, 256, dtype=torch.bool, device="meta").tril() if masked else None
    ops = OpCostMode(get_gpu("h100-80gb"), "bfloat16")
    with MetaAttentionMode(), ops:
        out = torch.nn.functional.scaled_dot_product_attention(q, q, v, attn_mask=mask, is_causal=not masked)
    assert out.shape == (1, 4, 256, 128)
    assert ops.totals.attention_flops == sdpa_flop_count(q.shape, q.shape, v.shape)


@pytest.mark.parametrize("groups", [1, 4, 16])
def test_a_grouped_convolutions_backward_counts_twice_its_forward(groups):
    """A convolution's backward is two of its forward's products (the input's gradient and the
    weight's), grouped or not. torch's formula counts a grouped weight gradient as if ungrouped:
    a Mamba layer's depthwise conv1d (8192 groups) came out at 8000 times its forward."""
    import torch

    from planner.profiler.counters import flop_counter

    conv = torch.nn.Conv1d(16, 16, 4, groups=groups, padding=3)
    with flop_counter() as counter:
        conv(torch.randn(2, 16, 64, requires_grad=True)).sum().backward()
    counts = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
    assert counts["aten.convolution_backward"] == 2 * counts["aten.convolution"]
