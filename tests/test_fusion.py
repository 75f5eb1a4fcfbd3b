"""Fused-kernel traffic (planner/profiler/counters.py, fusion="elementwise") counted by hand."""

from __future__ import annotations

import pytest
import torch

from planner.hardware import get_gpu
from planner.profiler.counters import OpCostMode, SavedBytes

N = 1 << 20  # float32 elements: 4 MiB per tensor


def _count(fn, fusion: str, requires_grad: bool = False):
    x = torch.empty(N, device="meta", requires_grad=requires_grad)
    ops = OpCostMode(get_gpu("a100-80gb"), "float32", fusion)
    with SavedBytes(on_save=ops.note_saved).hooks(), ops:
        fn(x)
    return ops.totals


def test_a_pointwise_chain_is_one_kernel_reading_its_input_and_writing_its_output():
    chain = lambda x: ((x * 2) + 1).exp()  # noqa: E731
    eager, fused = _count(chain, "none"), _count(chain, "elementwise")
    assert (eager.traffic_bytes, eager.num_kernels) == (6 * 4 * N, 3)  # each op reads and writes N floats
    assert (fused.traffic_bytes, fused.num_kernels) == (2 * 4 * N, 1)  # x in, exp(...) out
    assert fused.roofline_time_s < eager.roofline_time_s


def test_what_autograd_keeps_is_still_written():
    # y * y saves y for backward, so y must reach memory: only z's write and read go.
    def chain(x):
        y = x * 2
        return (y * y).exp()

    fused = _count(chain, "elementwise", requires_grad=True)
    assert fused.traffic_bytes == (2 + 3 + 2 - 2) * 4 * N and fused.num_kernels == 2


def test_a_tensor_read_twice_is_written():
    def chain(x):
        y = x + 1
        return y.exp() + y.sin()

    eager, fused = _count(chain, "none"), _count(chain, "elementwise")
    # y has two readers: kept. exp and sin each feed only the final add: both fused away.
    assert eager.traffic_bytes - fused.traffic_bytes == 2 * 2 * 4 * N


def test_matrix_products_stay_kernels_of_their_own():
    def chain(x):
        m = x.view(1024, 1024)
        return (m @ m).relu()

    eager, fused = _count(chain, "none"), _count(chain, "elementwise")
    assert fused.traffic_bytes == eager.traffic_bytes and fused.num_kernels == eager.num_kernels == 2


def test_unknown_fusion_is_refused():
    with pytest.raises(ValueError, match="fusion must be one of"):
        OpCostMode(fusion="everything")


def test_profile_records_its_fusion_and_fused_attention_moves_less():
    from planner.errors import PlannerError
    from planner.profiler import profile_model

    args = dict(n_layers=1, d_model=64, n_heads=4, d_ff=256, vocab_size=128, seq_len=64, attention="math", dropout=0.1)
    eager = profile_model("examples/gpt.py", args, [2], device="meta", gpu="a100-80gb", dtype="float16")
    fused = profile_model("examples/gpt.py", args, [2], device="meta", gpu="a100-80gb", dtype="float16", fusion="elementwise")
    assert (eager.fusion, fused.fusion) == ("none", "elementwise")
    block_eager, block_fused = eager.units[1].costs[2], fused.units[1].costs[2]
    assert block_fused.forward_memory_traffic_bytes < block_eager.forward_memory_traffic_bytes
    assert block_fused.backward_memory_traffic_bytes < block_eager.backward_memory_traffic_bytes
    assert block_fused.forward_flops == block_eager.forward_flops  # fusion moves bytes, not FLOPs
    with pytest.raises(PlannerError, match="Unknown fusion"):
        profile_model("examples/gpt.py", args, [2], device="meta", fusion="all")




def test_no_storage_address_comes_back_within_a_pass():
    """The mode keys tensors by their storage's address and a version it counts from the writes
    it sees. A storage freed mid-pass could hand its address to a later one that no recorded
    op writes (an `empty_like`, which the mode lets pass), whose reads would then count as
    reads of the freed tensor and change which chains fuse. The mode holds every storage it
    keyed until it exits, so within a pass no address is given twice (without that, the next
    op's output takes the freed address at once, as this checks)."""
    x = torch.empty(N, device="meta")
    seen = set()
    with OpCostMode(get_gpu("a100-80gb"), "float32", "elementwise"):
        for _ in range(20):
            a = x.exp()
            seen.add(a.untyped_storage()._cdata)
            del a
            assert x.cos().untyped_storage()._cdata not in seen
