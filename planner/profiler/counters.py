"""Counting what a piece of model code does: FLOPs, memory traffic, saved bytes.

- FLOPs come from torch's `FlopCounterMode` and its formula registry (a multiply-add is 2
  FLOPs). Two gaps in that registry are filled with torch's own attention formulas
  (`sdpa_flop_count`, `sdpa_backward_flop_count`): the CPU flash-attention kernels, which
  the registry does not list, so that CPU, CUDA and meta profiles count the same FLOPs.
- Memory traffic is the bytes each aten op reads and writes (inputs + outputs), counted per
  op as if nothing were fused; views and allocations are free. It is the memory term of
  the roofline, so it is an upper bound: fused kernels move less.
- Analytic time of an op is the roofline max(FLOPs / achievable FLOP/s, bytes / achievable
  bandwidth) plus a fixed per-kernel overhead (constants in planner/hardware.py).
- Saved bytes are the distinct storages autograd keeps for backward (saved-tensor hooks),
  excluding parameters, which are counted once as parameter memory.

On the meta device `scaled_dot_product_attention` would decompose into its math form and
be charged for an s x s score matrix that flash attention never writes to memory; during
analytic profiling it is routed to the flash (or, with a mask, memory-efficient) kernel,
whose meta implementation and FLOP formula torch provides.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import (
    FlopCounterMode,
    flop_registry,
    sdpa_backward_flop_count,
    sdpa_flop_count,
    shape_wrapper,
)

from planner.hardware import GPUSpec

aten = torch.ops.aten


def _cpu_flash_flops(query, key, value, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(query, key, value)


def _cpu_flash_backward_flops(grad_out, query, key, value, *args, out_shape=None, **kwargs) -> int:
    return sdpa_backward_flop_count(grad_out, query, key, value)


EXTRA_FLOP_FORMULAS = {
    aten._scaled_dot_product_flash_attention_for_cpu: _cpu_flash_flops,
    aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_flash_backward_flops,
}
FLOP_FORMULAS = {**flop_registry, **{k: shape_wrapper(v) for k, v in EXTRA_FLOP_FORMULAS.items()}}

# Ops that move no data: they re-describe memory or only allocate it.
FREE_OPS = {
    aten.detach,
    aten.alias,
    aten._unsafe_view,
    aten.lift_fresh,
    aten.empty,
    aten.empty_like,
    aten.empty_strided,
    aten.new_empty,
    aten.new_empty_strided,
    aten.scalar_tensor,
}


def flop_counter() -> FlopCounterMode:
    """torch's FlopCounterMode with the missing CPU attention formulas added."""
    return FlopCounterMode(display=False, custom_mapping=dict(EXTRA_FLOP_FORMULAS))


def _tensor_bytes(obj) -> int:
    return sum(t.numel() * t.element_size() for t in tree_flatten(obj)[0] if isinstance(t, torch.Tensor))


@dataclass
class OpTotals:
    """Sums over the aten ops run under an `OpCostMode`."""

    flops: int = 0
    traffic_bytes: int = 0
    roofline_time_s: float = 0.0
    num_kernels: int = 0


class OpCostMode(TorchDispatchMode):
    """Sums per-op FLOPs, memory traffic and (given a GPU spec) roofline time."""

    def __init__(self, gpu: GPUSpec | None = None, dtype: str = "float32"):
        super().__init__()
        self.totals = OpTotals()
        self.gpu = gpu
        self.dtype = dtype

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        packet = func._overloadpacket
        if getattr(func, "is_view", False) or packet in FREE_OPS:
            return out
        flops = FLOP_FORMULAS[packet](*args, **kwargs, out_val=out) if packet in FLOP_FORMULAS else 0
        traffic = self._traffic(packet, args, kwargs, out)
        totals = self.totals
        totals.flops += flops
        totals.traffic_bytes += traffic
        totals.num_kernels += 1
        if self.gpu is not None:
            totals.roofline_time_s += self.gpu.kernel_overhead_s + max(
                flops / self.gpu.achievable_flops(self.dtype), traffic / self.gpu.achievable_bandwidth
            )
        return out

    @staticmethod
    def _traffic(packet, args, kwargs, out) -> int:
        if packet is aten.embedding:  # reads only the looked-up rows, not the whole table
            return 2 * _tensor_bytes(out) + _tensor_bytes(args[1])
        return _tensor_bytes((args, kwargs)) + _tensor_bytes(out)


class SavedBytes:
    """Counts distinct storages saved for backward, parameters excluded."""

    def __init__(self, exclude: list[torch.Tensor] = ()):
        self.excluded = {t.untyped_storage()._cdata for t in exclude}
        self.seen: set[int] = set()
        self.bytes = 0

    def pack(self, t: torch.Tensor):
        storage = t.untyped_storage()
        key = storage._cdata
        if key not in self.excluded and key not in self.seen:
            self.seen.add(key)
            self.bytes += storage.nbytes()
        return t

    @contextmanager
    def hooks(self):
        with torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t):
            yield self


def _flash_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """Flash/efficient attention on meta tensors: same result shape, realistic costs."""
    if enable_gqa and key.shape[-3] != query.shape[-3]:
        repeat = query.shape[-3] // key.shape[-3]
        key = key.repeat_interleave(repeat, dim=-3)
        value = value.repeat_interleave(repeat, dim=-3)
    if attn_mask is None:
        return aten._scaled_dot_product_flash_attention(query, key, value, dropout_p, is_causal, scale=scale)[0]
    if attn_mask.dtype == torch.bool:
        attn_mask = torch.zeros(attn_mask.shape, dtype=query.dtype, device=query.device)
    attn_mask = attn_mask.expand(query.shape[:-1] + key.shape[-2:-1])
    return aten._scaled_dot_product_efficient_attention(
        query, key, value, attn_mask, True, dropout_p, is_causal, scale=scale
    )[0]


class MetaAttentionMode(TorchFunctionMode):
    """Routes scaled_dot_product_attention on meta tensors to the flash kernel."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention and args and args[0].device.type == "meta":
            return _flash_sdpa(*args, **kwargs)
        return func(*args, **kwargs)
