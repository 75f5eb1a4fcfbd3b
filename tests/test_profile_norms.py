"""An analytic profile for a GPU keeps what torch's fused RMSNorm kernel keeps.

`rms_norm` dispatches to aten::_fused_rms_norm, whose CUDA kernel's backward needs the input
and the per-row reciprocal RMS; a CPU (and the meta device) runs the composite form, whose
autograd keeps fp32 copies of the input and of the normalised input
(planner/profiler/counters.py `_FusedRMSNorm`).
"""

from __future__ import annotations

import pytest

from planner.profiler import profile_model

NORMED = """
import torch
import torch.nn.functional as F
from torch import nn

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(64, 64, bias=False)
        self.norm = nn.RMSNorm(64, eps=1e-5)
        self.head = nn.Linear(64, 16, bias=False)

    def forward(self, x):
        return self.head(self.norm(self.proj(x)))

def build_model():
    return Net()

def make_batch(batch_size, **_):
    return torch.randn(batch_size, 32, 64), torch.randint(16, (batch_size, 32))

def loss_fn(out, y):
    return F.cross_entropy(out.reshape(-1, 16), y.reshape(-1))
"""


def test_a_gpu_profile_keeps_the_fused_rms_norms_input_and_rstd(write_model):
    path = write_model(NORMED, "normed.py")
    saved = {}
    for target in ("a100-80gb", "cpu"):
        profile = profile_model(str(path), {}, [2], device="meta", gpu=target, dtype="bfloat16", precision="pure")
        norm = next(u for u in profile.units if u.name == "norm")
        saved[target] = norm.costs[2].saved_bytes
        assert norm.costs[2].backward_memory_traffic_bytes > 0  # the backward ran (the fused kernel's on a GPU)
    tokens, width = 2 * 32, 64
    assert saved["a100-80gb"] == tokens * width * 2 + tokens * 4  # its bf16 input, an fp32 rstd per row
    assert saved["cpu"] >= 2 * tokens * width * 4  # the composite's fp32 input and normalised input


def test_llama_norm_written_out_in_fp32_costs_its_kernels_and_matches_torchs():
    # examples/llama.py norm="fp32": the reference Llama RMSNorm (x.float(), pow, mean, rsqrt, ...), each
    # its own kernel in eager mode, where norm="torch" runs the fused kernel on a GPU: same numbers,
    # more time and more saved activations in an analytic H100 profile.
    import importlib.util
    from pathlib import Path

    import torch

    examples = Path(__file__).resolve().parents[1] / "examples"
    spec = importlib.util.spec_from_file_location("llama_example", examples / "llama.py")
    llama = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(llama)

    x = torch.randn(4, 64, dtype=torch.bfloat16)
    norm = llama.Fp32RMSNorm(64).to(torch.bfloat16)
    expected = torch.nn.functional.rms_norm(x.float(), (64,), eps=1e-5).to(torch.bfloat16)
    assert torch.equal(norm(x), expected)
    with pytest.raises(ValueError, match="norm='layer'"):
        llama.build_model(norm="layer")

    args = dict(n_layers=2, d_model=512, n_heads=8, n_kv_heads=4, d_ff=1024, vocab_size=256, seq_len=512)
    units = {}
    for kind in ("torch", "fp32"):
        profile = profile_model(str(examples / "llama.py"), {**args, "norm": kind}, [1], device="meta", gpu="h100-80gb",
                                dtype="bfloat16", precision="pure")
        units[kind] = next(u.costs[1] for u in profile.units if u.name == "layers.0")
    fused, written = units["torch"], units["fp32"]
    assert written.forward_time_s + written.backward_time_s > 1.02 * (fused.forward_time_s + fused.backward_time_s)
    assert written.saved_bytes > fused.saved_bytes
