"""What FP8 linears keep for backward (planner/profiler/measure.py `Float8Saves`,
`UnitCosts.fp8_saved_bytes`), against torch.compile's own choice for torchao's Float8Linear,
and how the cost tables price it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from planner.profiler import profile_model
from planner.profiler.counters import SavedBytes
from planner.profiler.measure import Float8Saves

torchao_float8 = pytest.importorskip("torchao.float8")


def _compiled_saved_bytes(module: nn.Module, x: torch.Tensor) -> int:
    """Bytes the forward graph of `torch.compile(module)` keeps for backward (its outputs beyond
    the user's, parameters excluded), under the partitioner torch.compile's inductor uses."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    found: list[int] = []

    def forward_compiler(graph, _inputs):
        placeholders = [n for n in graph.graph.nodes if n.op == "placeholder"]
        params = {n.name for n in placeholders[:len(list(module.parameters()))]}  # primals: parameters first
        outputs = [n for n in graph.graph.nodes if n.op == "output"][0].args[0]
        saved = [n for n in outputs[1:] if isinstance(n, torch.fx.Node) and n.name not in params]  # [0]: the user's output
        found.append(sum(n.meta["val"].numel() * n.meta["val"].element_size() for n in saved
                         if isinstance(n.meta.get("val"), torch.Tensor)))
        return make_boxed_func(graph)

    torch._dynamo.reset()
    backend = aot_autograd(fw_compiler=forward_compiler, bw_compiler=lambda graph, _inputs: make_boxed_func(graph),
                           partition_fn=min_cut_rematerialization_partition)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = torch.compile(module, backend=backend)(x)
    out.float().sum().backward()
    torch._dynamo.reset()
    return found[0]


def _stand_in_saved_bytes(module: nn.Module, x: torch.Tensor) -> int:
    counted = SavedBytes(exclude=list(module.parameters()))
    with torch.autocast("cpu", dtype=torch.bfloat16), Float8Saves(), counted.hooks():
        module(x)
    return counted.bytes


def test_compiled_float8_linear_saves_its_fp8_input_and_no_copy():
    """torch.compile (min-cut partitioner) on torchao's Float8Linear saves the input in FP8 and
    the weight parameter itself, plus two scalar scales; an eager linear under autocast saves a
    bf16 copy of the input and of the weight. The stand-in counts the compiled figure."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    linear = nn.Sequential(nn.Linear(256, 512, bias=False))
    x = torch.randn(4, 32, 256, requires_grad=True)
    eager = SavedBytes(exclude=list(linear.parameters()))
    with torch.autocast("cpu", dtype=torch.bfloat16), eager.hooks():
        linear(x)
    assert eager.bytes == 4 * 32 * 256 * 2 + 512 * 256 * 2  # bf16 input and bf16 weight copies
    stand_in = _stand_in_saved_bytes(linear, x)  # the profiler runs the model as written
    convert_to_float8_training(linear, config=Float8LinearConfig(emulate=True))
    compiled = _compiled_saved_bytes(linear, x)
    assert stand_in == 4 * 32 * 256  # one byte per input element, no weight copy
    assert 0 <= compiled - stand_in <= 16  # the compiled graph also keeps the scales (fp32 scalars)


def test_gpt_blocks_save_fp8_inputs_and_no_weight_copies():
    """examples/gpt.py under autocast: a block's four linears (qkv, out, fc1, fc2) keep bf16 copies
    of their weights (12 h^2 elements) and of their inputs (h, h, h and 4h per token); in FP8 the
    weight copies go and each input is kept in 1 byte: 24 h^2 + 7 h T bytes less at T tokens.
    The head (filtered by torchao's converter as `output`) is counted but not priced so."""
    h, heads, seq = 256, 4, 128
    prof = profile_model("examples/gpt.py", dict(n_layers=2, d_model=h, n_heads=heads, d_ff=4 * h, vocab_size=1024,
                                                 seq_len=seq), [1, 2], device="meta", gpu="h100-80gb", dtype="bfloat16")
    for b in (1, 2):
        block = prof.units[1].costs[b]
        assert block.saved_bytes - block.fp8_saved_bytes == 24 * h * h + 7 * h * b * seq
    assert prof.units[0].costs[1].fp8_saved_bytes is None  # the embedding has no linear


def test_fp8_plan_prices_the_fp8_activations():
    """A plan with --fp8 stores less per micro-batch than the same layout in bf16, by what the
    blocks' linears keep less (the head, which torchao's converter filters, keeps its bf16
    figure); profiles without `fp8_saved_bytes` price FP8 activations as bf16 ones, as before."""
    from planner.cluster import make_cluster
    from planner.solver.solve import Pins, solve

    prof = profile_model("examples/gpt.py", dict(n_layers=2, d_model=256, n_heads=4, d_ff=1024, vocab_size=1024,
                                                 seq_len=128), [1, 2], device="meta", gpu="h100-80gb", dtype="bfloat16")
    pins = Pins(pp=1, tp=1, dp=1, micro_batch_size=2, schedule="1f1b", recompute="none", zero_stage=0)

    def activations(profile, float8):
        plan = solve(profile, make_cluster(1, 1, "h100-80gb"), 4, pins, float8=float8)
        return plan.prediction.memory_terms_bytes[0]["activations"]

    blocks = sum(u.costs[2].saved_bytes - u.costs[2].fp8_saved_bytes for u in prof.units[1:3])
    # One stage holds one micro-batch in flight (each backward follows its forward).
    assert activations(prof, False) - activations(prof, True) == blocks > 0
    legacy = prof.model_copy(deep=True)
    for unit in legacy.units:
        for costs in unit.costs.values():
            costs.fp8_saved_bytes = None
    assert activations(legacy, True) == activations(prof, False)
