"""A measured 16-bit profile runs the model as the runtime trains it (planner/profiler
`mixed_precision`): fp32 parameters, each forward under autocast; and measured times are not
extrapolated to larger micro-batches more cheaply per sample than the largest one profiled."""

from __future__ import annotations

import json
from contextlib import nullcontext

import pytest
import torch
import torch.nn.functional as F

from planner.cluster import make_cluster
from planner.cost.compute import interpolate, interpolate_time
from planner.errors import PlannerError
from planner.model_file import load_model_file
from planner.profiler import mixed_precision, profile_model
from planner.profiler.autocast import CPU_POLICY, CUDA_POLICY, EmulatedAutocast
from planner.profiler.counters import SavedBytes
from planner.solver.solve import AUTOCAST_NOTE, solve
from tests.conftest import EXAMPLES, ROOT

GPT = dict(n_layers=2, d_model=64, n_heads=4, d_ff=256, vocab_size=128, seq_len=32)


def test_mixed_precision_is_the_runtimes_autocast():
    run_as = mixed_precision("cpu", torch.bfloat16)
    assert run_as.param_dtype == torch.float32
    with run_as.on_device():
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
    assert run_as.on_meta().policy is CPU_POLICY  # the meta trace of a CPU profile casts as CPU autocast does
    analytic = mixed_precision("meta", torch.bfloat16)
    assert analytic.param_dtype == torch.float32 and analytic.on_meta().policy is CUDA_POLICY
    assert mixed_precision("meta", torch.bfloat16, "pure").param_dtype == torch.bfloat16
    assert mixed_precision("cuda", torch.bfloat16, "pure").param_dtype == torch.bfloat16
    assert mixed_precision("cpu", torch.float32).param_dtype == torch.float32


def test_measured_bf16_profile_keeps_what_autocast_training_keeps():
    """Under autocast the residual stream stays fp32 (it starts at fp32 embeddings) and each
    linear saves its 16-bit weight copy for backward, so a block saves more than the same block
    run in pure bf16. An analytic autocast profile keeps what the measured one keeps. Parameters
    are counted in the profile's dtype either way."""
    measured = profile_model(str(EXAMPLES / "gpt.py"), GPT, [2], device="cpu", dtype="bfloat16", repeats=2, warmup=1)
    pure = profile_model(str(EXAMPLES / "gpt.py"), GPT, [2], device="meta", gpu="h100-80gb", dtype="bfloat16",
                         precision="pure")
    analytic = profile_model(str(EXAMPLES / "gpt.py"), GPT, [2], device="meta", gpu="h100-80gb", dtype="bfloat16")
    block_m, block_p, block_a = (next(u for u in p.units if u.name == "blocks.0") for p in (measured, pure, analytic))
    assert block_m.parameter_bytes == block_a.parameter_bytes == 2 * block_m.num_parameters
    # the block's input arrives in fp32 (the residual stream), as in training
    assert block_m.costs[2].input_bytes == block_a.costs[2].input_bytes == 2 * block_p.costs[2].input_bytes
    assert block_m.costs[2].saved_bytes > block_p.costs[2].saved_bytes + 0.5 * 2 * block_m.num_parameters
    # the flash kernel the meta trace prices keeps its random seed and offset (24 bytes) where CPU's keeps none
    assert 0 <= block_a.costs[2].saved_bytes - block_m.costs[2].saved_bytes <= 32
    assert (measured.precision, pure.precision, analytic.precision) == ("autocast", "pure", "autocast")
    assert measured.whole_model[2].forward_backward_time_s > 0


def test_times_do_not_get_cheaper_per_sample_past_the_largest_size():
    launch_bound = {1: 0.040, 2: 0.040, 4: 0.041, 8: 0.045}  # GPT-2-medium bf16 on an H200
    assert abs(interpolate(launch_bound, 16) - 0.053) < 1e-9  # linear: the flat slope continues
    assert interpolate_time(launch_bound, 16) == 0.045 * 2  # per sample as at micro-batch 8
    assert interpolate_time(launch_bound, 6) == interpolate(launch_bound, 6)
    superlinear = {1: 1.0, 2: 3.0}
    assert interpolate_time(superlinear, 4) == interpolate(superlinear, 4) == 7.0


# --- Analytic profiles under autocast (planner/profiler/autocast.py) ---------------------------

MODELS = {  # the bundled examples, shrunk: attention (flash and math), RMSNorm + RoPE, conv + BN, MoE, U-Net
    "gpt-sdpa": ("gpt.py", GPT),
    "gpt-math": ("gpt.py", {**GPT, "attention": "math"}),
    "llama": ("llama.py", dict(n_layers=2, d_model=64, n_heads=4, vocab_size=128, seq_len=32)),
    "hf-llama": ("hf_llama.py", dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                     num_key_value_heads=2, vocab_size=128)),
    "resnet": ("resnet.py", dict(depth=18, width=8, image_size=32)),
    "moe": ("moe.py", {}),
    "unet": ("unet.py", {}),
}


def _train_step(mf, model, batch, precision):
    """One forward (under `precision`) and backward: loss, gradients, bytes saved for backward."""
    inputs, targets = batch
    saved = SavedBytes(exclude=list(model.parameters()))
    with saved.hooks(), precision:
        out = model(*(inputs if isinstance(inputs, tuple) else (inputs,)))
        loss = mf.loss(out, targets)
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads, saved.bytes


@pytest.mark.parametrize("name", sorted(MODELS))
def test_emulated_autocast_is_torchs_autocast(name):
    """With CPU's policy the emulation reproduces torch's CPU autocast exactly: the same loss and
    gradients bit for bit and the same bytes saved for backward, on every bundled model family.
    (CUDA's policy, the one analytic profiles use, is held to an H200 below.)"""
    file, args = MODELS[name]
    mf = load_model_file(str(EXAMPLES / file), args)
    torch.manual_seed(0)
    model = mf.build_model()
    batch = mf.make_batch(2)
    real = _train_step(mf, model, batch, torch.autocast("cpu", dtype=torch.bfloat16))
    emulated = _train_step(mf, model, batch, EmulatedAutocast(torch.bfloat16, CPU_POLICY))
    assert torch.equal(real[0], emulated[0])
    assert len(real[1]) == len(emulated[1]) and all(torch.equal(a, b) for a, b in zip(real[1], emulated[1]))
    assert real[2] == emulated[2]
    pure = _train_step(mf, model, batch, nullcontext())
    assert pure[0].dtype == torch.float32 and real[2] != pure[2]  # autocast changed what is kept


def test_a_parameter_is_cast_once_per_region():
    """Autocast's cache: a weight used twice in one region is cast once (one 16-bit copy kept);
    a new region casts again."""
    weight = torch.nn.Parameter(torch.randn(8, 8))
    x = torch.randn(4, 8, requires_grad=True)
    with EmulatedAutocast(torch.bfloat16) as region:
        a = F.linear(x, weight)
        b = F.linear(x, weight)
        cast = region._cache[id(weight)][1]
    assert a.dtype == b.dtype == torch.bfloat16 and cast.dtype == torch.bfloat16
    with EmulatedAutocast(torch.bfloat16) as region:
        F.linear(x, weight)
        assert region._cache[id(weight)][1] is not cast
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        EmulatedAutocast(torch.float32)


H200 = ROOT / "benchmarks" / "results" / "h200" / "run2"


@pytest.mark.parametrize("model", ["gpt2-medium", "gpt-1.3b"])
def test_analytic_autocast_profile_keeps_what_the_h200_kept(model):
    """An analytic bf16 profile (CUDA's autocast emulated on meta tensors) records, unit by unit
    and at every micro-batch size, the bytes a measured profile on an H200 recorded under torch's
    CUDA autocast (benchmarks/results/h200/README.md, run 2): saved for backward, in and out.
    Two layers of each model: every block is the same."""
    measured = json.loads((H200 / f"pvm-cuda-h200-bfloat16-1-{model}-chain0-profile.json").read_text())
    analytic = profile_model(str(EXAMPLES / "gpt.py"), {**measured["model"]["args"], "n_layers": 2},
                             measured["micro_batch_sizes"], device="meta", gpu="h200", dtype="bfloat16")
    assert analytic.precision == "autocast" and analytic.computes_as() == "autocast"
    on_gpu = {u["name"]: u["costs"] for u in measured["units"]}
    for unit in analytic.units:
        for b, costs in unit.costs.items():
            gpu = on_gpu[unit.name][str(b)]
            assert costs.input_bytes == gpu["input_bytes"] and costs.output_bytes == gpu["output_bytes"]
            assert costs.saved_bytes == pytest.approx(gpu["saved_bytes"], rel=1e-6)  # flash attention's 8-byte seed
    pure = profile_model(str(EXAMPLES / "gpt.py"), {**measured["model"]["args"], "n_layers": 2}, [1], device="meta",
                         gpu="h200", dtype="bfloat16", precision="pure")
    block = next(u for u in pure.units if u.name == "blocks.0")
    assert block.costs[1].saved_bytes < 0.6 * on_gpu["blocks.0"]["1"]["saved_bytes"]  # what pure bf16 misses


def test_a_pure_profile_plan_says_the_runtime_computes_otherwise():
    args = dict(GPT, seq_len=64)
    cluster = make_cluster(2, 2, "h100-80gb")
    for precision, noted in (("pure", True), ("autocast", False)):
        prof = profile_model(str(EXAMPLES / "gpt.py"), args, [1, 2], device="meta", gpu="h100-80gb", dtype="bfloat16",
                             precision=precision)
        plan = solve(prof, cluster, 8)
        assert plan.search is not None and (AUTOCAST_NOTE in plan.search.notes) == noted
    legacy = prof.model_copy(update={"precision": None})  # written before precision was recorded: analytic was pure
    assert legacy.computes_as() == "pure"


def test_unknown_precision_is_refused_before_any_work():
    with pytest.raises(PlannerError, match="Unknown precision 'fp8'"):
        profile_model(str(EXAMPLES / "gpt.py"), GPT, [1], device="meta", dtype="bfloat16", precision="fp8")


def test_model_code_that_turns_autocast_off_turns_the_emulation_off(write_model):
    """A block run under `torch.autocast(device_type=x.device.type, enabled=False)` computes in
    fp32 under torch's autocast; the analytic profile's emulation stands aside there too: its
    product saves the fp32 input and weight (nothing 16-bit)."""
    source = """
        import torch
        from torch import nn

        class Rotary(nn.Module):
            def __init__(self):
                super().__init__()
                self.w = nn.Parameter(torch.ones(64, 64))

            def forward(self, x):
                with torch.autocast(device_type=x.device.type, enabled=False):
                    return x.float() @ self.w.float()

        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.a, self.b = Rotary(), nn.Linear(64, 64)

            def forward(self, x):
                return self.b(self.a(x))

        def build_model():
            return Net()

        def make_batch(b):
            return torch.randn(b, 64), torch.randn(b, 64)
    """
    prof = profile_model(str(write_model(source)), {}, [8], device="meta", gpu="h100-80gb", dtype="bfloat16")
    off, on = prof.units[0].costs[8], prof.units[1].costs[8]
    assert off.saved_bytes == 8 * 64 * 4  # the fp32 input; the weight is a parameter
    assert on.saved_bytes == 8 * 64 * 2 + 64 * 64 * 2  # the 16-bit input and weight copies


def test_pricing_an_engine_that_computes_pure_from_an_autocast_profile_says_so():
    from planner.engines import precision_note

    autocast = profile_model(str(EXAMPLES / "gpt.py"), GPT, [1], device="meta", gpu="h100-80gb", dtype="bfloat16")
    pure = autocast.model_copy(update={"precision": "pure"})
    for engine in ("megatron", "torchtitan", "deepspeed"):
        note = precision_note(engine, autocast)
        assert note is not None and "--precision pure" in note and engine in note
        assert precision_note(engine, pure) is None
    assert precision_note("accelerate", autocast) is None
