"""FP8 linears: pricing (planner/cost/fp8.py), the GPU specs, the plan field, the refusal before
launch and torchao's emulated FP8 on CPU (runtime/apply_fp8.py)."""

from __future__ import annotations

import copy
import json
import os
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from planner import hardware
from planner.cost import fp8
from planner.errors import PlannerError
from planner.hardware import FP8_GEMM_RELATIVE_EFFICIENCY, FP8_RELATIVE_MATMUL_FRACTION, get_gpu
from planner.plan import Plan, parse_plan
from planner.profile_schema import OpNode, Unit, UnitCosts, load_profile
from tests.conftest import ROOT
from tests.ranks import free_port
from tests.runtime_plans import GPT_TP, make_plan

H100 = get_gpu("h100")


def _unit(name: str, ops: list[OpNode], mbs: int = 1) -> Unit:
    costs = UnitCosts(forward_time_s=1.0, backward_time_s=2.0, forward_flops=0, backward_flops=0,
                      forward_memory_traffic_bytes=0, backward_memory_traffic_bytes=0, input_bytes=0,
                      output_bytes=0, saved_bytes=0)
    return Unit(index=0, name=name, kind="Block", fingerprint="f", num_parameters=0, parameter_bytes=0,
                costs={mbs: costs}, ops=ops)


def _linear(name: str, m: int, k: int, n: int, **extra) -> OpNode:
    """A linear x[1, m, k] @ W[n, k]^T as the profiler records it: 2 m k n forward FLOPs; its
    module is `name` unless `module=` says otherwise."""
    extra.setdefault("module", name)
    extra.setdefault("inputs", ["input"])
    return OpNode(name=name, kind="linear", weight_shape=[n, k], input_shape=[1, m, k], output_shape=[1, m, n],
                  forward_flops=2 * m * k * n, **extra)


def _cast_s(elements: float, gpu=H100) -> float:
    """One tensorwise cast: read bf16 for amax, read bf16 + write FP8 for the cast, two kernels."""
    return elements * (2 + 2 + 1) / gpu.achievable_bandwidth + 2 * gpu.kernel_overhead_s


def _fp8_plan(**kwargs) -> Plan:
    plan = make_plan("gpt", **kwargs)
    return Plan.model_validate({**plan.model_dump(), "training": {"dtype": "bfloat16", "float8": True}})


# --- pricing -------------------------------------------------------------------------------


def test_fp8_pricing_halves_matmul_time_within_the_stated_efficiency():
    m, k, n = 8192, 8192, 8192
    price = fp8.price_fp8_unit(_unit("blocks.0", [_linear("mlp.fc", m, k, n)]), 1, H100)
    bf16_s = 2 * m * k * n / H100.achievable_flops("bfloat16")
    fp8_s = bf16_s - price.forward_gemm_saved_s
    # FP8 runs at twice the bf16 peak (1979 vs 989.4 TFLOP/s) times the H100's measured relative
    # efficiency: 1 / (2 x 0.882) of the bf16 time; only float rounding separates the two sides.
    assert fp8_s / bf16_s == pytest.approx(1 / (2 * hardware.FP8_RELATIVE_MATMUL_FRACTION["h100"]), rel=1e-3)
    assert 0.5 < fp8_s / bf16_s < 0.6
    assert price.backward_gemm_saved_s == pytest.approx(2 * price.forward_gemm_saved_s)  # dx and dW GEMMs


def test_at_equal_efficiency_fp8_halves_matmul_time_exactly():
    m, k, n = 4096, 4096, 16384
    price = fp8.price_fp8_unit(_unit("blocks.0", [_linear("fc", m, k, n)]), 1, replace(H100, fp8_relative_efficiency=1.0))
    bf16_s = 2 * m * k * n / H100.achievable_flops("bfloat16")
    # 1979 / 989.4 is 2.0002, not 2: half the time to that ratio's rounding.
    assert (bf16_s - price.forward_gemm_saved_s) / bf16_s == pytest.approx(0.5, rel=1e-3)


def test_fp8_efficiency_is_each_generations_measured_ratio():
    """Each FP8 preset keeps its generation's FP8 / bf16 MAMF ratio (planner/hardware.py); a GPU that
    states none, as a cluster file's own FP8 peak may, gets the smallest measured one, the H100's;
    a cluster file can set its own."""
    from planner.cluster import parse_cluster

    for name, generation in (("h100-80gb", "h100"), ("h200", "h200"), ("b200", "b200"), ("b300", "b300")):
        gpu = get_gpu(name)
        assert gpu.peak_flops["float8"] == pytest.approx(2 * gpu.peak_flops["bfloat16"], rel=1e-3)
        assert gpu.fp8_matmul_efficiency == pytest.approx(gpu.matmul_efficiency * FP8_RELATIVE_MATMUL_FRACTION[generation])
    assert FP8_RELATIVE_MATMUL_FRACTION["h100"] == pytest.approx(0.882, abs=1e-3)
    assert FP8_RELATIVE_MATMUL_FRACTION["b200"] == pytest.approx(0.983, abs=1e-3)
    unstated = replace(H100, fp8_relative_efficiency=None)
    assert unstated.fp8_matmul_efficiency == pytest.approx(H100.matmul_efficiency * FP8_GEMM_RELATIVE_EFFICIENCY)
    assert FP8_GEMM_RELATIVE_EFFICIENCY == min(FP8_RELATIVE_MATMUL_FRACTION.values()) == FP8_RELATIVE_MATMUL_FRACTION["h100"]
    assert not get_gpu("a100-80gb").supports_fp8
    own = parse_cluster({"gpu": {"preset": "b200", "fp8_relative_efficiency": 0.9}, "num_nodes": 1, "gpus_per_node": 8})
    assert own.gpu.fp8_matmul_efficiency == pytest.approx(own.gpu.matmul_efficiency * 0.9)


def test_cast_overhead_is_the_stated_passes():
    m, k, n = 2048, 1024, 4096
    unit = _unit("blocks.0", [_linear("fc", m, k, n)])
    price = fp8.price_fp8_unit(unit, 1, H100)
    x, w, dy = m * k, n * k, m * n
    assert price.forward_cast_s == pytest.approx(_cast_s(x) + _cast_s(w))
    # Backward: dy for each GEMM and W again; x's FP8 copy was saved by the compiled forward.
    assert price.backward_cast_s == pytest.approx(2 * _cast_s(dy) + _cast_s(w))
    assert price.forward_saved_s == pytest.approx(price.forward_gemm_saved_s - price.forward_cast_s)
    assert price.cast_transient_bytes == max(x + w, dy + w, dy + x)  # one byte per FP8 element
    assert price.all_gather_bytes_factor == 1.0 and price.fp8_weight_elements == w
    # FSDP FP8 all-gather over 4 ranks: W is cast once, on its quarter, and travels in 1 byte.
    gathered = fp8.price_fp8_unit(unit, 1, H100, fsdp_float8_all_gather_degree=4)
    assert gathered.forward_cast_s == pytest.approx(_cast_s(x) + _cast_s(w / 4))
    assert gathered.backward_cast_s == pytest.approx(2 * _cast_s(dy))
    assert gathered.all_gather_bytes_factor == 0.5


def test_big_linears_gain_and_small_ones_lose():
    """torchao's README: FP8 loses on small GEMMs (casts dominate) and wins on large ones."""
    big = fp8.price_fp8_unit(_unit("b", [_linear("fc", 16384, 8192, 8192)]), 1, H100)
    small = fp8.price_fp8_unit(_unit("b", [_linear("fc", 256, 256, 256)]), 1, H100)
    assert big.forward_saved_s > 0 and big.backward_saved_s > 0
    assert small.forward_saved_s < 0 and small.backward_saved_s < 0


def test_linears_reading_one_input_cast_it_once_when_compiled_together():
    """A block compiled whole (torchtitan) casts an input its q, k and v projections share once,
    and one its gate and up projections share once; the planner's runtime, compiling each linear
    alone, casts it per linear. Only the forward input casts change: each dy is a linear's own."""
    m, d, kv, ff = 4096, 1024, 256, 2048
    attn = _linear("wq", m, d, d), _linear("wk", m, d, kv), _linear("wv", m, d, kv)
    mlp = (_linear("w1", m, d, ff, inputs=["wo", "input"]), _linear("w3", m, d, ff, inputs=["wo", "input"]),
           _linear("w2", m, ff, d, inputs=["w1", "w3"]))
    unit = _unit("layers.0", [*attn, _linear("wo", m, d, d, inputs=["attention"]), *mlp])
    apart, shared = fp8.price_fp8_unit(unit, 1, H100), fp8.price_fp8_unit(unit, 1, H100, shared_input_casts=True)
    assert apart.forward_cast_s - shared.forward_cast_s == pytest.approx(3 * _cast_s(m * d))  # 2 of q,k,v + 1 of gate,up
    assert shared.backward_cast_s == apart.backward_cast_s
    assert shared.forward_gemm_saved_s == apart.forward_gemm_saved_s
    # Under TP a colwise and a rowwise linear reading one tensor read different shards of it: cast apart.
    styles = {"layers.0.wq": "colwise", "layers.0.wk": "rowwise", "layers.0.wv": "colwise"}
    tp = fp8.price_fp8_unit(_unit("layers.0", list(attn)), 1, H100, 2, tp_plan=styles, shared_input_casts=True)
    assert tp.forward_cast_s == pytest.approx(_cast_s(m * d) + _cast_s(m * d / 2) + sum(_cast_s(d * n / 2) for n in (d, kv, kv)))


def test_a_block_compiled_whole_computes_a_shared_input_cast_once():
    """What `shared_input_casts` rests on: torch.compile's AOTAutograd merges identical operations
    on one tensor (torch/_functorch/config.py `cse`, in the min-cut partitioner inductor uses), so
    three linears casting one input as torchao's tensorwise scaling does (amax of |x|, scale,
    saturated cast) leave one amax and one cast in the compiled forward (checked on CPU)."""
    from torch._functorch.aot_autograd import aot_module_simplified
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    graphs = []

    def backend(gm, inputs):
        def keep(fw, _):
            graphs.append(fw)
            return fw.forward

        return aot_module_simplified(gm, inputs, fw_compiler=keep, partition_fn=min_cut_rematerialization_partition)

    def cast(x):  # torchao/float8/float8_utils.py: amax_to_scale, to_fp8_saturated
        scale = torch.finfo(torch.float8_e4m3fn).max / torch.clamp(torch.max(torch.abs(x)).to(torch.float64), min=1e-12)
        scale = scale.to(torch.float32)
        return (x.to(torch.float32) * scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn), scale

    def block(x, *weights):
        return sum(((xf := cast(x))[0].to(torch.float32) @ w.t()) / xf[1] for w in weights)

    torch._dynamo.reset()
    x = torch.randn(64, 32, requires_grad=True)
    torch.compile(block, backend=backend)(x, *(torch.randn(16, 32, requires_grad=True) for _ in range(3)))
    ops = [n.target for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert ops.count(torch.ops.aten.abs.default) == 1 and ops.count(torch.ops.aten.max.default) == 1


def test_micro_batch_size_scales_from_the_profiled_one():
    unit = _unit("b", [_linear("fc", 1024, 1024, 1024)], mbs=2)  # shapes recorded at micro-batch 2
    at2, at8 = (fp8.price_fp8_unit(unit, mbs, H100) for mbs in (2, 8))
    assert at8.forward_gemm_saved_s == pytest.approx(4 * at2.forward_gemm_saved_s)


def test_tensor_parallel_styles_divide_the_sharded_side():
    m, k, n, tp = 2048, 4096, 4096, 4
    unit = _unit("blocks.0", [_linear("wq", m, k, n), _linear("wo", m, k, n)])
    full = fp8.price_fp8_unit(unit, 1, H100)
    styles = {"blocks.0.wq": "colwise", "blocks.0.wo": "rowwise"}
    sharded = fp8.price_fp8_unit(unit, 1, H100, tp_degree=tp, tp_plan=styles)
    assert sharded.forward_gemm_saved_s == pytest.approx(full.forward_gemm_saved_s / tp)
    # colwise: x whole, W and dy / tp; rowwise: x and W / tp, dy whole.
    x, w, dy = m * k, n * k, m * n
    assert sharded.forward_cast_s == pytest.approx(_cast_s(x) + _cast_s(w / tp) + _cast_s(x / tp) + _cast_s(w / tp))
    assert sharded.backward_cast_s == pytest.approx(2 * _cast_s(dy / tp) + _cast_s(w / tp)
                                                    + 2 * _cast_s(dy) + _cast_s(w / tp))
    replicated = fp8.price_fp8_unit(unit, 1, H100, tp_degree=tp, tp_plan={})
    assert replicated.forward_gemm_saved_s == pytest.approx(full.forward_gemm_saved_s)


def test_only_the_linears_torchao_converts_are_priced():
    ops = [
        _linear("fc", 64, 64, 128),
        _linear("odd", 64, 64, 100),  # 100 is not a multiple of 16
        _linear("c_attn", 64, 64, 192, weight_in_out=True),  # Hugging Face Conv1D, not an nn.Linear
        _linear("linear_1", 64, 64, 64, module=None),  # functional F.linear: no module to swap
    ]
    price = fp8.price_fp8_unit(_unit("blocks.0", ops), 1, H100)
    assert price.converted == ("fc",)
    assert [s.split(" ")[0] for s in price.skipped] == ["odd", "c_attn", "linear_1"]
    head = _unit("head", [_linear("linear", 64, 64, 256, module="")])
    assert fp8.price_fp8_unit(head, 1, H100).converted == ("linear",)
    skipped = fp8.price_fp8_unit(head, 1, H100, skip_fqns=("head",))
    assert skipped.converted == () and skipped.forward_saved_s == 0.0 and "output head" in skipped.skipped[0]


def test_output_head_is_the_last_unit_when_it_is_one_linear():
    profile = load_profile(ROOT / "profiles" / "gpt-2.7b-4l-cuda-h100-80gb-bfloat16-measured.json")
    assert fp8.output_head(profile) == "head"
    no_head = profile.model_copy(update={"units": profile.units[:-1]})  # ends with the final norm
    assert fp8.output_head(no_head) is None
    assert fp8.skipped_units(profile) == ("head",)
    # A tied head that is not last (the runtime leaves tied linears alone): skipped all the same.
    tied = no_head.model_copy(update={"model": no_head.model.model_copy(update={"tied_parameters": [["embed", "head"]]}),
                                      "units": [profile.units[-1], *no_head.units]})
    assert fp8.skipped_units(tied) == ("head",)


def test_a_gpu_without_fp8_is_refused_with_the_reason():
    with pytest.raises(PlannerError, match="a100-80gb has no FP8 tensor cores") as err:
        fp8.price_fp8_unit(_unit("b", [_linear("fc", 64, 64, 64)]), 1, get_gpu("a100"))
    assert "bfloat16" in err.value.hint
    assert get_gpu("h100").supports_fp8 and get_gpu("h200").supports_fp8 and not get_gpu("a100").supports_fp8
    assert get_gpu("h200").fp8_peak_flops() == 1979e12


def test_mfu_under_both_conventions():
    flops, time_s = 1e15, 2.0
    all_fp8 = fp8.mfu_conventions(flops, flops, time_s, H100)
    assert all_fp8.bf16 == pytest.approx(flops / (time_s * 989.4e12))
    assert all_fp8.fp8 == pytest.approx(flops / (time_s * 1979e12))
    none_fp8 = fp8.mfu_conventions(flops, 0.0, time_s, H100)
    assert none_fp8.fp8 == pytest.approx(none_fp8.bf16)
    with pytest.raises(ValueError):
        fp8.mfu_conventions(flops, 2 * flops, time_s, H100)


# --- plan ----------------------------------------------------------------------------------


def test_plan_float8_needs_bfloat16():
    data = json.loads(make_plan("gpt").model_dump_json())
    assert parse_plan(data).training.float8 is False
    data["training"] = {"dtype": "bfloat16", "float8": True}
    assert parse_plan(data).training.float8 is True
    data["training"] = {"dtype": "float32", "float8": True}
    with pytest.raises(PlannerError, match="float8 needs dtype bfloat16"):
        parse_plan(data)


# --- runtime -------------------------------------------------------------------------------


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_run_refuses_an_fp8_plan_before_launch_without_cuda(tmp_path):
    from runtime.launch import run_plan

    path = _fp8_plan().save(tmp_path / "plan.json")
    with pytest.raises(PlannerError, match="needs a CUDA GPU of compute capability 8.9") as err:
        run_plan(str(path), steps=1, timeout_s=30)
    assert "bfloat16 plan" in err.value.hint


def test_apply_float8_refuses_cpu_and_leaves_bf16_plans_alone():
    from runtime.apply_fp8 import apply_float8

    model = nn.Sequential(nn.Linear(32, 32))
    assert apply_float8(model, make_plan("gpt"), torch.device("cpu")) == []  # a float32 plan: nothing to do
    with pytest.raises(PlannerError, match="CUDA"):
        apply_float8(model, _fp8_plan(), torch.device("cpu"))
    assert type(model[0]) is nn.Linear


def test_fsdp_float8_all_gather_follows_the_layout():
    from runtime.apply_fp8 import float8_config

    assert float8_config(_fp8_plan(dp=2, zero=3)).enable_fsdp_float8_all_gather
    assert not float8_config(_fp8_plan(dp=2, zero=0)).enable_fsdp_float8_all_gather


def test_tied_linears_and_the_head_stay_in_bf16():
    from runtime.apply_fp8 import skipped_fqns

    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.proj, self.head = nn.Embedding(64, 32), nn.Linear(32, 32), nn.Linear(32, 64)
            self.head.weight = self.embed.weight

    plan = _fp8_plan()  # its last unit is `head`
    assert skipped_fqns(Tied(), plan) == ("head",)
    plan.stages[-1].units[-1] = "proj"  # a last unit that is a linear, and a tied head elsewhere
    assert skipped_fqns(Tied(), plan) == ("proj", "head")


def test_emulated_fp8_step_matches_bf16():
    """torchao's emulation (the FP8 casts and scales, the GEMMs on the dequantised values) on the
    GPT example: the converted linears are the filter's, and FP8's loss and gradients stay close
    to bf16's."""
    from planner.model_file import load_model_file
    from runtime.apply_fp8 import apply_float8

    plan = _fp8_plan()
    mf = load_model_file(plan.model.file, plan.model.args)
    torch.manual_seed(0)
    reference = mf.build_model()
    model = copy.deepcopy(reference)
    converted = apply_float8(model, plan, torch.device("cpu"), emulate=True)
    # Every block linear (32/64-wide: multiples of 16), not the head (the last unit, filtered).
    blocks = [f"blocks.{i}.{m}" for i in range(4) for m in ("attn.wq", "attn.wk", "attn.wv", "attn.wo", "mlp.fc_in", "mlp.fc_out")]
    assert converted == blocks
    assert type(model.head) is nn.Linear
    torch.manual_seed(1)
    inputs, targets = mf.make_batch(8)
    losses, grads = [], []
    for m in (reference, model):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = mf.loss(m(inputs).float(), targets)
        loss.backward()
        losses.append(loss.item())
        grads.append(torch.cat([p.grad.flatten() for p in m.parameters()]))
    # E4M3 keeps 3 mantissa bits (relative rounding <= 2^-4 per element), and rounding errors of
    # random sign partly cancel in each K-long dot product; at initialisation the loss is near
    # ln(vocab) = 4.2 and moves by less than the largest logit error. Measured: 2e-4 relative.
    # 1e-2 leaves room for another seed, and is far below what an unscaled cast would do
    # (values below E4M3's smallest subnormal, 2^-9, flush to zero).
    assert losses[1] == pytest.approx(losses[0], rel=1e-2)
    assert losses[1] != losses[0]  # FP8 did round something: the conversion is not a no-op
    # Gradients: dy is cast to E5M2 (2 mantissa bits); summed over the batch the direction holds.
    cosine = torch.nn.functional.cosine_similarity(grads[0], grads[1], dim=0).item()
    assert cosine > 0.99


def _forward_backward(model, mf):
    torch.manual_seed(1)
    inputs, targets = mf.make_batch(4)
    out = model(inputs)
    mf.loss(out, targets).backward()
    return out.detach()


def _tp_worker(rank: int, world: int, port: int) -> None:
    """FP8 (emulated) then TP, in runtime/train.py's order, against FP8 in one process, in float32."""
    from planner.model_file import load_model_file
    from runtime.apply_fp8 import apply_float8
    from runtime.apply_tp import apply_tp
    from runtime.mesh import build_mesh

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        plan = _fp8_plan(tp=world, tp_plan={n: s for n, s in GPT_TP.items() if n != "head"})
        mf = load_model_file(plan.model.file, plan.model.args)
        cpu = torch.device("cpu")
        torch.manual_seed(0)
        reference = mf.build_model()
        one, sharded = copy.deepcopy(reference), copy.deepcopy(reference)
        apply_float8(one, plan, cpu, emulate=True)
        apply_float8(sharded, plan, cpu, emulate=True)
        apply_tp(sharded, build_mesh(plan, "cpu")["tp"], plan.stages[0].tp_plan, False, plan.stages[0].units)
        high, fp8_one, fp8_tp = (_forward_backward(m, mf) for m in (reference, one, sharded))
        # In float32 the only difference TP may add is summation order (~1e-7); had a rank scaled
        # its shard by its own amax instead of the whole tensor's, FP8 rounding (visible here as
        # FP8's 1e-2-scale distance from float32) would differ too.
        assert (fp8_one - high).abs().max() > 1e-3
        torch.testing.assert_close(fp8_tp, fp8_one, rtol=1e-5, atol=1e-5)
        for name, p in sharded.named_parameters():
            grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            torch.testing.assert_close(grad, one.get_parameter(name).grad, rtol=1e-4, atol=1e-6, msg=name)
    finally:
        dist.destroy_process_group()
    os._exit(0)  # as runtime/__main__.py: gloo aborts a process in interpreter teardown now and then


@pytest.mark.slow
def test_fp8_then_tp_equals_fp8_in_one_process():
    mp.spawn(_tp_worker, args=(2, free_port()), nprocs=2, join=True)


def _fsdp_worker(rank: int, world: int, port: int) -> None:
    """FP8 (emulated) with FSDP2's FP8 all-gather (ZeRO-3) against FP8 in one process."""
    from planner.model_file import load_model_file
    from runtime.apply_dp import apply_fsdp
    from runtime.apply_fp8 import apply_float8
    from runtime.mesh import build_mesh
    from tests.runtime_plans import GPT_UNITS

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        plan = _fp8_plan(dp=world, zero=3)
        mf = load_model_file(plan.model.file, plan.model.args)
        cpu = torch.device("cpu")
        torch.manual_seed(0)
        reference = mf.build_model()
        sharded = copy.deepcopy(reference)
        apply_float8(sharded, plan, cpu, emulate=True)
        assert type(sharded.blocks[0].mlp.fc_in.weight.data).__name__ == "WeightWithDynamicFloat8CastTensor"
        apply_fsdp(sharded, build_mesh(plan, "cpu")["dp"], GPT_UNITS, 3)
        torch.manual_seed(1)
        inputs, targets = mf.make_batch(2 * world)
        # Dynamic scaling takes each activation's amax over the local batch, so the one-process
        # reference runs each rank's slice on its own and averages the gradients, as FSDP does.
        ones = []
        for r in range(world):
            one = copy.deepcopy(reference)
            apply_float8(one, plan, cpu, emulate=True)
            out = one(inputs[2 * r:2 * r + 2])
            mf.loss(out, targets[2 * r:2 * r + 2]).backward()
            ones.append((one, out.detach()))
        out = sharded(inputs[2 * rank:2 * rank + 2])
        mf.loss(out, targets[2 * rank:2 * rank + 2]).backward()
        # The FP8 weights gathered are the casts of the whole weight (amax all-reduced over dp):
        # the same values as one process's, so the outputs agree to the last bit.
        torch.testing.assert_close(out.detach(), ones[rank][1], rtol=0, atol=0)
        for name, p in sharded.named_parameters():
            expected = sum(one.get_parameter(name).grad for one, _ in ones) / world
            # float32: the reduce-scatter's sum of two gradients, rounded once more.
            torch.testing.assert_close(p.grad.full_tensor(), expected, rtol=1e-5, atol=1e-7, msg=name)
    finally:
        dist.destroy_process_group()
    os._exit(0)


@pytest.mark.slow
def test_fp8_with_fsdp_float8_all_gather_equals_one_process():
    mp.spawn(_fsdp_worker, args=(2, free_port()), nprocs=2, join=True)


# ---- the solver (planner/solver: `--fp8`) ----

@pytest.fixture(scope="module")
def gpt_h100():
    from planner.profiler import profile_model
    from tests.conftest import EXAMPLES

    # Wide enough that FP8's GEMM saving outweighs its casts (a d_model 1024 model at 1k tokens
    # loses: test_big_linears_gain_and_small_ones_lose).
    args = dict(n_layers=2, d_model=4096, n_heads=32, d_ff=16384, vocab_size=32000, seq_len=2048)
    return profile_model(str(EXAMPLES / "gpt.py"), args, [1, 2], device="meta", gpu="h100-80gb", dtype="bfloat16")


def test_solver_prices_fp8_and_records_it(gpt_h100):
    from planner.cluster import make_cluster
    from planner.solver.solve import solve

    cluster = make_cluster(8, 8, "h100-80gb")
    bf16 = solve(gpt_h100, cluster, 32)
    fp8_plan = solve(gpt_h100, cluster, 32, float8=True)
    assert fp8_plan.training.float8 and not bf16.training.float8
    assert fp8_plan.prediction.iteration_time_s < bf16.prediction.iteration_time_s
    # Both MFU conventions: the bf16 one credits every FLOP at the bf16 peak, so it is the higher.
    assert bf16.prediction.mfu_fp8 is None
    assert 0 < fp8_plan.prediction.mfu_fp8 < fp8_plan.prediction.mfu


def test_an_fp8_plan_says_what_fp8_reaches_and_when_it_does_not_pay(gpt_h100):
    """The plan's note counts the converted linears and their share of the forward FLOPs (GPT's
    head is filtered, attention stays bf16), and says to solve without --fp8 where the casts cost
    more than the GEMMs save: never for this wide model, always for a narrow one."""
    from planner.cluster import make_cluster
    from planner.cost.fp8 import converted_ops, skipped_units
    from planner.profiler import profile_model
    from planner.solver.solve import solve
    from tests.conftest import EXAMPLES

    cluster = make_cluster(8, 8, "h100-80gb")
    wide = solve(gpt_h100, cluster, 32, float8=True)
    [note] = [n for n in wide.search.notes if n.startswith("FP8:")]
    converted = sum(len(converted_ops(u, skipped_units(gpt_h100))) for u in gpt_h100.units)
    linears = sum(op.kind == "linear" for u in gpt_h100.units for op in u.ops)
    assert f"{converted} of {linears} linears converted" in note and converted == linears - 1
    assert "filtered (output head) x1" in note and "solve without --fp8" not in note
    share = int(note.split("linears converted (torchao Float8Linear), ")[1].split("%")[0])
    assert 50 < share < 100  # the attention scores and the filtered head stay in bf16
    narrow = profile_model(str(EXAMPLES / "gpt.py"), dict(n_layers=2, d_model=256, n_heads=4, d_ff=1024, vocab_size=1024,
                                                          seq_len=128), [1], device="meta", gpu="h100-80gb", dtype="bfloat16")
    assert any("solve without --fp8" in n for n in solve(narrow, cluster, 8, float8=True).search.notes)
    assert not any(n.startswith("FP8:") for n in solve(narrow, cluster, 8).search.notes)


def test_solver_fp8_gathers_weights_in_fp8(gpt_h100):
    from planner.cluster import make_cluster
    from planner.solver.search import Config
    from planner.solver.solve import price_config

    cfg = Config(tp=1, sequence_parallel=False, pp=1, dp=8, micro_batch_size=1, num_microbatches=4, schedule="1f1b",
                 virtual_stages=1, zero_stage=3)
    cluster = make_cluster(8, 8, "h100-80gb")
    bf16, fp8_eval = price_config(gpt_h100, cluster, cfg), price_config(gpt_h100, cluster, cfg, float8=True)
    assert 0 < fp8_eval.breakdown_s["dp_comm"] < bf16.breakdown_s["dp_comm"]  # FSDP's FP8 all-gather moves 1 byte a weight


def test_solver_refuses_fp8_where_it_cannot_run(gpt_h100):
    from planner.cluster import make_cluster
    from planner.solver.solve import solve

    with pytest.raises(PlannerError, match="a100-80gb has no FP8 tensor cores"):
        solve(gpt_h100, make_cluster(8, 8, "a100-80gb"), 32, float8=True)
    with pytest.raises(PlannerError, match="--fp8 needs bfloat16 training"):
        solve(gpt_h100, make_cluster(8, 8, "h100-80gb"), 32, float8=True, dtype="float32")
