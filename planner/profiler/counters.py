"""Counting what a piece of model code does: FLOPs, memory traffic, saved bytes.

- FLOPs come from torch's `FlopCounterMode` and its formula registry (a multiply-add is 2
  FLOPs). Gaps in that registry are filled: the CPU flash-attention kernels with torch's own
  attention formulas (`sdpa_flop_count`, `sdpa_backward_flop_count`), so that CPU, CUDA and
  meta profiles count the same FLOPs; `torch._grouped_mm` (the grouped GEMM of a mixture of
  experts, Hugging Face's default experts implementation) with its GEMM count.
- Memory traffic is the bytes each aten op reads and writes (inputs + outputs), counted per
  op as if nothing were fused (eager PyTorch); views and allocations are free. With
  `fusion="elementwise"` chains of pointwise and row-wise ops count as fused kernels, as
  torch.compile or Megatron-LM's fused kernels run them (`OpCostMode`).
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

import math
import os
import weakref
from collections import Counter
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.multiprocessing.reductions import StorageWeakRef
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import (
    FlopCounterMode,
    flop_registry,
    sdpa_backward_flop_count,
    sdpa_flop_count,
    shape_wrapper,
)

from planner.hardware import ATTENTION, CONVOLUTION, GEMM, GPUSpec
from planner.meta_values import leaves

aten = torch.ops.aten


def _cpu_flash_flops(query, key, value, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(query, key, value)


def _cpu_flash_backward_flops(grad_out, query, key, value, *args, out_shape=None, **kwargs) -> int:
    return sdpa_backward_flop_count(grad_out, query, key, value)


def _grouped_mm_flops(a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    """`torch._grouped_mm` (torch.nn.functional.grouped_mm: Hugging Face's MoE experts), which the
    registry does not list. With [M, K] x [G, K, N] each of the M rows is multiplied by one
    group's matrix, 2*M*K*N; 3-d operands give 2 * out.numel() * K likewise. [K, M] x [M, N] ->
    [G, K, N] (the weight gradient) splits the contraction M among the groups: 2*K*M*N."""
    if len(a_shape) == 2 and len(b_shape) == 2:
        return 2 * a_shape[0] * a_shape[1] * b_shape[1]
    return 2 * math.prod(out_shape) * a_shape[-1]


def _conv_backward_flops(grad_out_shape, x_shape, w_shape, bias, stride, padding, dilation, transposed, output_padding,
                         groups, output_mask, out_shape=None, **kwargs) -> int:
    """torch's formula (`conv_backward_flop`), whose weight-gradient term counts a grouped
    convolution as if ungrouped, `groups` times too many (its docstring leaves groups out): the
    depthwise causal conv1d of a Mamba layer (8192 channels, 8192 groups) had its backward counted
    at 8000 times its forward. The input-gradient term reads the grouped weight's shape and is
    right as it is."""
    torch_formula = flop_registry[aten.convolution_backward]
    args = (grad_out_shape, x_shape, w_shape, bias, stride, padding, dilation, transposed, output_padding, groups)
    grad_input = torch_formula(*args, [output_mask[0], False, False], out_val=out_shape)
    grad_weight = torch_formula(*args, [False, output_mask[1], False], out_val=out_shape)
    return grad_input + grad_weight // max(groups, 1)


EXTRA_FLOP_FORMULAS = {
    aten._grouped_mm: _grouped_mm_flops,
    aten.convolution_backward: _conv_backward_flops,
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
    """torch's FlopCounterMode with the missing formulas (CPU attention, grouped GEMM) added."""
    return FlopCounterMode(display=False, custom_mapping=dict(EXTRA_FLOP_FORMULAS))


def tensor_bytes(obj) -> int:
    """Bytes of every tensor in a nested structure of them."""
    return sum(t.numel() * t.element_size() for t in tensors_in(obj))


@dataclass
class OpTotals:
    """Sums over the aten ops run under an `OpCostMode`."""

    flops: int = 0
    attention_flops: int = 0
    """The FLOPs of fused attention kernels (`ATTENTION_OPS`), which run at their own rate."""
    causal_attention_flops: int = 0
    """Of `attention_flops`, those of kernels under a causal mask (`is_causal`), which skip the
    masked tiles (planner/hardware.py `GPUSpec.attention_time_s`)."""
    convolution_flops: int = 0
    """The FLOPs of convolutions (`CONVOLUTION_OPS`), likewise."""
    traffic_bytes: int = 0
    roofline_time_s: float = 0.0
    num_kernels: int = 0


FUSIONS = ("none", "elementwise")
"""How the analytic model assumes kernels are fused (`OpCostMode`)."""
FUSIBLE_NON_POINTWISE = {aten._softmax, aten._log_softmax, aten.native_dropout, aten._softmax_backward_data,
                         aten._log_softmax_backward_data}
"""Row-wise ops that fused kernels absorb besides pointwise ones (Megatron's scale-mask-softmax,
dropout; what torch.compile fuses into its reductions)."""


ATTENTION_OPS = {getattr(aten, name) for name in (
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_efficient_attention_backward",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_cudnn_attention_backward",
    "_flash_attention_forward", "_flash_attention_backward", "_efficient_attention_forward",
    "_efficient_attention_backward", "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_flash_attention_for_cpu_backward") if hasattr(aten, name)}
"""Fused attention kernels (flash, memory-efficient, cuDNN; CPU's flash): priced at the GPU's attention rate
(planner/hardware.py `GPUSpec.attention_efficiency`), not its GEMM rate."""
def attention_kind(func, args, kwargs) -> tuple[bool, bool]:
    """(causal, backward) of a fused attention op (`ATTENTION_OPS`): its `is_causal` argument, and
    whether it is a backward kernel. An explicit mask, even a causal one, runs the memory-efficient
    kernel over every tile, so only `is_causal` counts."""
    causal = False
    for i, argument in enumerate(func._schema.arguments):
        if argument.name == "is_causal":
            causal = bool(kwargs["is_causal"] if "is_causal" in kwargs else args[i] if i < len(args) else argument.default_value)
            break
    return causal, func._overloadpacket.__name__.endswith("_backward")


CONVOLUTION_OPS = {aten.convolution, aten._convolution, aten.convolution_backward}
"""Convolutions, which cuDNN runs in TF32 for float32 tensors unless told not to: priced at
planner/hardware.py `GPUSpec.achievable_convolution_flops`."""


@dataclass
class _Op:
    flops: int
    reads: list[tuple[tuple[int, int], int]]
    """((storage, version), bytes) per tensor read."""
    writes: list[tuple[tuple[int, int], int]]
    """((storage, version), bytes) per tensor written."""
    fusible: bool
    traffic_bytes: int
    kind: str = GEMM
    """Which rate prices its FLOPs: `GEMM`, `ATTENTION` or `CONVOLUTION`."""
    causal: bool = False
    """An attention kernel under a causal mask (`attention_kind`)."""
    backward: bool = False
    """An attention kernel's backward."""


class OpCostMode(TorchDispatchMode):
    """Sums per-op FLOPs, memory traffic and (given a GPU spec) roofline time.

    `fusion="none"`: every op is its own kernel and moves all its inputs and outputs (eager
    PyTorch). `fusion="elementwise"`: chains of pointwise and row-wise ops fuse the way
    torch.compile or Megatron-LM's fused kernels (scale-mask-softmax, bias-GeLU,
    bias-dropout-add) fuse them: a tensor written by a fusible op and read exactly once, by
    another fusible op, and not kept for backward (`note_saved`, called by `SavedBytes`)
    never reaches memory, so its write and its read leave the traffic, and the chain is one
    kernel (one launch overhead, one roofline over its FLOPs and remaining bytes). Matrix
    products, attention kernels and norms stay kernels of their own. The decision needs the
    whole pass, so totals are final when the mode exits.
    """

    def __init__(self, gpu: GPUSpec | None = None, dtype: str = "float32", fusion: str = "none"):
        super().__init__()
        if fusion not in FUSIONS:
            raise ValueError(f"fusion must be one of {FUSIONS}, got {fusion!r}")
        self.totals = OpTotals()
        self.gpu = gpu
        self.dtype = dtype
        self.fusion = fusion
        self._saved: set[tuple[int, int]] = set()
        self._ops: list[_Op] = []
        self._version: dict[int, int] = {}
        self._alive: list = []  # `_hold`

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        packet = func._overloadpacket
        if getattr(func, "is_view", False) or packet in FREE_OPS:
            return out
        flops = FLOP_FORMULAS[packet](*args, **kwargs, out_val=out) if packet in FLOP_FORMULAS else 0
        traffic = self._traffic(packet, args, kwargs, out)
        kind = ATTENTION if packet in ATTENTION_OPS else CONVOLUTION if packet in CONVOLUTION_OPS else GEMM
        causal, backward = attention_kind(func, args, kwargs) if kind == ATTENTION else (False, False)
        if self.fusion == "none":
            self._add_kernel(flops, traffic, kind, causal, backward)
        else:
            reads = [(self._key(t), tensor_bytes(t)) for t in tensors_in((args, kwargs))]
            writes = []
            for t in tensors_in(out):
                storage = self._hold(t)
                self._version[storage] = self._version.get(storage, -1) + 1  # a write makes a new version
                writes.append((self._key(t), tensor_bytes(t)))
            fusible = packet is not aten.embedding and (torch.Tag.pointwise in func.tags or packet in FUSIBLE_NON_POINTWISE)
            self._ops.append(_Op(flops, reads, writes, fusible, traffic, kind, causal, backward))
        return out

    def note_saved(self, t: torch.Tensor) -> None:
        """Autograd kept `t` for backward: its current version must reach memory."""
        if self.fusion != "none":
            self._saved.add(self._key(t))

    def _key(self, t: torch.Tensor) -> tuple[int, int]:
        storage = self._hold(t)
        return storage, self._version.setdefault(storage, 0)

    def _hold(self, t: torch.Tensor) -> int:
        """The address of `t`'s storage, the storage kept alive until the pass ends: a storage
        freed mid-pass would let a later one (an `empty`, a FREE_OPS op, so no write is seen)
        take its address and inherit its version, and reads of the new tensor would count as
        reads of the old one, so whether a chain fuses would hang on the allocator (analytic
        profiles differed from run to run by up to 1% of a unit's traffic). On the meta device
        a storage holds no memory; on a real one the pass keeps its tensors until it ends."""
        storage = t.untyped_storage()
        self._alive.append(storage)
        return storage._cdata

    def _add_kernel(self, flops: int, traffic: int, kind: str = GEMM, causal: bool = False, backward: bool = False) -> None:
        totals = self.totals
        totals.flops += flops
        totals.attention_flops += flops if kind == ATTENTION else 0
        totals.causal_attention_flops += flops if kind == ATTENTION and causal else 0
        totals.convolution_flops += flops if kind == CONVOLUTION else 0
        totals.traffic_bytes += traffic
        totals.num_kernels += 1
        if self.gpu is not None:
            compute_s = (self.gpu.attention_time_s(flops, self.dtype, backward, causal) if kind == ATTENTION
                         else flops / self.gpu.kernel_flops(self.dtype, kind))
            totals.roofline_time_s += self.gpu.kernel_overhead_s + max(compute_s, traffic / self.gpu.achievable_bandwidth)

    def __exit__(self, *exc):
        result = super().__exit__(*exc)
        if self.fusion != "none":
            self._fuse()
        self._alive.clear()
        return result

    def _fuse(self) -> None:
        readers: dict[tuple[int, int], list[int]] = {}
        for i, op in enumerate(self._ops):
            for key, _ in op.reads:
                readers.setdefault(key, []).append(i)
        group = list(range(len(self._ops)))  # union-find over fused producer -> consumer edges

        def root(i: int) -> int:
            while group[i] != i:
                group[i] = group[group[i]]
                i = group[i]
            return i

        traffic = [op.traffic_bytes for op in self._ops]
        for p, op in enumerate(self._ops):
            if not op.fusible:
                continue
            for key, nbytes in op.writes:
                users = readers.get(key, [])
                if len(users) == 1 and self._ops[users[0]].fusible and key not in self._saved and users[0] != p:
                    c = users[0]
                    traffic[p] -= nbytes
                    traffic[c] -= sum(b for k, b in self._ops[c].reads if k == key)
                    group[root(c)] = root(p)
        kernels: dict[int, list[int]] = {}
        for i in range(len(self._ops)):
            kernels.setdefault(root(i), []).append(i)
        for members in kernels.values():  # attention and convolution kernels are never fused: alone in their group
            first = self._ops[members[0]]
            kinds = {self._ops[i].kind for i in members} - {GEMM}
            self._add_kernel(sum(self._ops[i].flops for i in members), max(0, sum(traffic[i] for i in members)),
                             kinds.pop() if kinds else GEMM, first.causal, first.backward)

    @staticmethod
    def _traffic(packet, args, kwargs, out) -> int:
        if packet is aten.embedding:  # reads only the looked-up rows, not the whole table
            return 2 * tensor_bytes(out) + tensor_bytes(args[1])
        return tensor_bytes((args, kwargs)) + tensor_bytes(out)


def tensors_in(obj) -> list[torch.Tensor]:
    """The tensors of a nested structure of them."""
    return [t for t in leaves(obj) if isinstance(t, torch.Tensor)]


class SavedBytes:
    """Counts distinct storages saved for backward, parameters excluded.

    A storage is known by its address while a weak reference says it lives. A saved tensor can
    die before the forward ends (one saved by a branch of the graph no output reaches, which
    autograd frees at once), and its address go to a new storage that is saved in turn: keyed by
    address alone, the new one was taken for the dead one and not counted. Which addresses the
    allocator reuses depends on everything else on the heap, so a unit's count moved with the
    sampled values of its inputs (Nemotron-H's MoE block: 171 to 195 MB from one draw to
    another). Now each is counted, as any storage saved is."""

    def __init__(self, exclude: Sequence[torch.Tensor] = (), on_save=None, keep: bool = True):
        self.excluded = {t.untyped_storage()._cdata for t in exclude}
        self.sizes: dict[int, int] = {}
        """Bytes of each counted storage, by key (the latest storage at that address)."""
        self.bytes = 0
        self._refs: dict[int, StorageWeakRef] = {}
        self.on_save = on_save
        """Called with every tensor autograd saves (OpCostMode.note_saved), or None."""
        self.keep = keep
        """False: for a forward that is only counted, never run backward. Autograd then keeps a
        holder of each saved tensor, emptied by `release` once the forward is counted, so the
        graph holds no activations however long it lives."""
        self._holders: list[list] = []

    def bytes_of(self, tensors: Sequence[torch.Tensor]) -> int:
        """Of `bytes`, the storages of `tensors` (the counted code's inputs or outputs, say)."""
        return sum(self.sizes.get(key, 0) for key in {t.untyped_storage()._cdata for t in tensors})

    def pack(self, t: torch.Tensor):
        if self.on_save is not None:
            self.on_save(t)
        storage = t.untyped_storage()
        key = self._address(storage)
        if key not in self.excluded and (key not in self.sizes or self._refs[key].expired()):
            self.sizes[key] = storage.nbytes()
            self._refs[key] = StorageWeakRef(storage)
            self.bytes += storage.nbytes()
        if self.keep:
            return t
        self._holders.append([t])
        return self._holders[-1]

    @staticmethod
    def _address(storage) -> int:
        return storage._cdata

    def release(self) -> None:
        """Empty the holders of a counted forward (`keep=False`)."""
        for holder in self._holders:
            holder.clear()
        self._holders = []

    @contextmanager
    def hooks(self):
        with torch.autograd.graph.saved_tensors_hooks(self.pack, (lambda t: t) if self.keep else (lambda h: h[0])):
            yield self


class LiveBytes(TorchDispatchMode):
    """The peak of the bytes a piece of code holds above what was held when it began: run around
    a unit's backward, its working set (the gradients flowing through it, their temporaries and
    the parameters' fresh gradients, less the saved activations it has released by then),
    beyond the activations it saved and the output gradient it was handed (planner/cost/
    memory.py's "backward working set"). A storage counts from the op that first returns it to
    its release (a weak reference to torch's storage object, which torch keeps one of per
    storage), so a view or an in-place result counts once, and an op's inputs are never new;
    storages made before count only where `watch`ed (the saved activations), by their release.
    `peak_without` replays the same allocations and releases leaving some storages out (the
    parameters' gradients, which a later micro-batch's backward adds into the ones held).
    Device-independent: on meta tensors it counts what the same code allocates on a GPU, as
    torch's own MemTracker (torch/distributed/_tools/mem_tracker.py) tracks storages."""

    def __init__(self, exclude=()):
        super().__init__()
        self._seen = {t.untyped_storage()._cdata for t in exclude}
        self._made: dict[int, int] = {}
        """Storages made here and still alive: key -> serial number."""
        self._events: list[tuple[int, int]] = []
        """(serial, +bytes) at a storage's making, (serial, -bytes) at its release; serial -1 for
        a watched storage's release."""

    def watch(self, t: torch.Tensor) -> None:
        """Count `t`'s storage's release (a saved activation, made before the counted code)."""
        for storage in _storages(t):
            self._count(storage, made=False, released=True)

    @property
    def peak(self) -> int:
        return self.peak_without(())

    def peak_without(self, tensors) -> int:
        """The peak, replayed without the storages of `tensors` (alive now, made here)."""
        keys = {storage._cdata for t in tensors for storage in _storages(t)}
        left_out = {self._made[k] for k in keys if k in self._made}
        live = peak = 0
        for serial, delta in self._events:
            if serial not in left_out:
                live += delta
                peak = max(peak, live)
        return peak

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # An op's inputs were there before it: a view of one (a transposed gradient handed to the
        # backward) or an in-place result is not a new storage.
        for t in leaves((args, kwargs)):
            for storage in _storages(t):
                self._count(storage, made=False, released=False)
        out = func(*args, **(kwargs or {}))
        for t in leaves(out):
            for storage in _storages(t):
                self._count(storage, made=True, released=True)
        return out

    def _count(self, storage, made: bool, released: bool) -> None:
        """Note a storage once: `made` here (counted from now), and whether its release counts."""
        key = storage._cdata
        if key in self._seen:
            return
        size = storage.nbytes() if released else 0
        self._seen.add(key)
        serial = -1
        if made:
            serial = len(self._events)
            self._made[key] = serial
            self._events.append((serial, size))
        weakref.finalize(storage, self._release, key, serial, size)

    def _release(self, key: int, serial: int, size: int) -> None:
        self._seen.discard(key)
        self._made.pop(key, None)
        if size:
            self._events.append((serial, -size))


def _storages(t) -> list:
    """The storages holding a tensor's data: its own, a sparse COO tensor's indices' and values'
    (an `nn.Embedding(sparse=True)`'s gradient), none for a tensor without one (a wrapper
    subclass: what it wraps is counted where an op makes it)."""
    if not isinstance(t, torch.Tensor):
        return []
    if t.layout == torch.sparse_coo:
        return _storages(t._indices()) + _storages(t._values())
    try:
        return [t.untyped_storage()]
    except (RuntimeError, NotImplementedError):
        return []


def _flash_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """Flash/efficient attention on meta tensors: same result shape, realistic costs. The flash
    kernel needs one head dim for q, k and v, so values of another width (DeepSeek's MLA: q, k
    192 wide, v 128) take the memory-efficient kernel, as torch's SDPA dispatch does on a GPU
    (flash's meta function would return q's width)."""
    if enable_gqa and key.shape[-3] != query.shape[-3]:
        repeat = query.shape[-3] // key.shape[-3]
        key = key.repeat_interleave(repeat, dim=-3)
        value = value.repeat_interleave(repeat, dim=-3)
    if attn_mask is None and value.shape[-1] == query.shape[-1]:
        return aten._scaled_dot_product_flash_attention(query, key, value, dropout_p, is_causal, scale=scale)[0]
    if attn_mask is None:
        return aten._scaled_dot_product_efficient_attention(query, key, value, None, True, dropout_p, is_causal, scale=scale)[0]
    if attn_mask.dtype == torch.bool:
        attn_mask = torch.zeros(attn_mask.shape, dtype=query.dtype, device=query.device)
    attn_mask = attn_mask.expand(query.shape[:-1] + key.shape[-2:-1])
    return aten._scaled_dot_product_efficient_attention(
        query, key, value, attn_mask, True, dropout_p, is_causal, scale=scale
    )[0]


def sequence_length(inputs) -> int | None:
    """T when the first input is a (batch, sequence) token tensor (`ModelInfo.sequence_length`;
    runtime/apply_cp.py splits that sequence); None when it is not one."""
    inputs = inputs if isinstance(inputs, (tuple, list)) else (inputs,)
    first = inputs[0] if inputs else None
    if isinstance(first, torch.Tensor) and first.dim() == 2 and not first.is_floating_point():
        return int(first.shape[1])
    return None


SEQUENCE_SCANS = frozenset({torch.cumsum, torch.Tensor.cumsum, torch.cumprod, torch.Tensor.cumprod, torch.logcumsumexp,
                            torch.Tensor.logcumsumexp, torch.cummax, torch.Tensor.cummax, torch.cummin, torch.Tensor.cummin})
"""Scans: each output element reads every earlier element along the dim."""


def sequence_scan(func, args: tuple, kwargs: dict, length: int, values=None) -> str | None:
    """Where `func(*args, **kwargs)` scans along a sequence of `length` tokens (a dim other than
    the first, of that size, of a tensor with a batch dim), as "cumsum along dim 1 at
    modeling_opt.py:66"; None for any other call, and for a scan of zeros, which gives zeros
    however the sequence is split (Hugging Face's packed-sequence check, a cumsum of "the
    positions jump here", all false for one sequence per sample). A meta tensor's values come
    from `values` (planner/meta_values.py `KnownValues.exact`); unknown, the scan counts.
    Context parallelism splits the sequence, so such a scan would run over one rank's tokens
    alone: OPT counts its positions with a cumsum of the attention mask, and under CP each rank
    numbered its tokens from 0 and trained to other losses with no error (runtime/apply_cp.py
    refuses it; the profile records it, `ModelInfo.cp_obstacles`, and the solver offers such a
    model no CP)."""
    if func not in SEQUENCE_SCANS:
        return None
    x = args[0] if args else kwargs.get("input")
    dim = args[1] if len(args) > 1 else kwargs.get("dim")
    if not isinstance(x, torch.Tensor) or x.dim() < 2 or not isinstance(dim, int) or isinstance(dim, bool):
        return None
    dim %= x.dim()
    if dim == 0 or x.shape[dim] != length:
        return None
    value = x if x.device.type != "meta" else (values.exact(x) if values is not None else None)
    if value is not None and not bool(value.any()):
        return None
    return f"{func.__name__} along dim {dim} at {_model_code_line()}"


def _model_code_line() -> str:
    """file:line of the innermost caller outside torch and this project (the model's code)."""
    import traceback

    ours = (f"{os.sep}torch{os.sep}", f"{os.sep}planner{os.sep}", f"{os.sep}runtime{os.sep}")
    for frame in reversed(traceback.extract_stack()):
        if not any(part in frame.filename for part in ours):
            return f"{os.path.basename(frame.filename)}:{frame.lineno}"
    return "an unknown line"


def is_plain_causal(mask: torch.Tensor) -> bool:
    """Whether an explicit SDPA mask over T tokens says only "causal": a bool lower triangle, or an
    additive mask that is 0 on and below the diagonal and -inf (or the dtype's most negative
    value, Hugging Face's convention) above, the same for every batch and head. The one mask
    context parallelism can translate to the keys gathered from the other ranks."""
    length_q, length_k = mask.shape[-2:]
    if length_q != length_k:
        return False
    tril = torch.ones(length_q, length_k, dtype=torch.bool, device=mask.device).tril()
    if mask.dtype == torch.bool:
        return bool((mask == tril).all())
    allowed = mask.masked_select(tril.expand_as(mask))
    blocked = mask.masked_select(~tril.expand_as(mask))
    return bool((allowed == 0).all()) and bool((blocked <= torch.finfo(mask.dtype).min / 2).all())


def masked_attention(args: tuple, kwargs: dict, values=None) -> str | None:
    """Where an F.scaled_dot_product_attention call passes a mask other than plain causal (a sliding
    window, say), which context parallelism cannot translate to the other ranks' keys
    (runtime/apply_cp.py refuses it at the first forward); None otherwise. A meta mask's values
    come from `values`; unknown, it counts."""
    mask = args[3] if len(args) > 3 else kwargs.get("attn_mask")
    if mask is None:
        return None
    value = mask if mask.device.type != "meta" else (values.exact(mask) if values is not None else None)
    if value is not None and is_plain_causal(value):
        return None
    return f"attention with a mask other than plain causal ({tuple(mask.shape[-2:])} tokens) at {_model_code_line()}"


class SequenceSplitChecks(TorchFunctionMode):
    """Records what decides whether a forward can split its sequence over context-parallel ranks:
    in `obstacles`, the scans along the sequence it runs (`sequence_scan`) and the attention masks
    other than plain causal it passes (`masked_attention`; `values`: the meta trace's
    KnownValues); in `attention_calls`, its calls to F.scaled_dot_product_attention, the one
    attention CP can gather keys for (runtime/apply_cp.py)."""

    def __init__(self, length: int, values=None) -> None:
        super().__init__()
        self.length, self.values = length, values
        self.obstacles: list[str] = []
        self.attention_calls = 0

    def replay_counts(self) -> Counter:
        """What this mode counts as it watches a call (planner/units.py `_Replays`): its obstacles
        are a set, which a twin's call leaves as it found it."""
        return Counter(attention_calls=self.attention_calls)

    def add_replay_counts(self, grown: Counter) -> None:
        self.attention_calls += grown["attention_calls"]

    def replay_state(self) -> tuple:
        """What a trace run again must start from (planner/units.py `_Replays`)."""
        return self.attention_calls, list(self.obstacles)

    def restore_replay_state(self, state: tuple) -> None:
        self.attention_calls, self.obstacles = state[0], list(state[1])

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        found = None
        if func is F.scaled_dot_product_attention:
            self.attention_calls += 1
            found = masked_attention(args, kwargs, self.values)
        elif func in SEQUENCE_SCANS:
            found = sequence_scan(func, args, kwargs, self.length, self.values)
        if found is not None and found not in self.obstacles:
            self.obstacles.append(found)
        return func(*args, **kwargs)


class _FusedRMSNorm(torch.autograd.Function):
    """torch's fused RMSNorm kernel as autograd sees it on a GPU: `rms_norm` dispatches to
    aten::_fused_rms_norm (aten/src/ATen/native/layer_norm.cpp `rms_norm_symint`), which has a
    CUDA kernel and a backward formula keeping its input and the per-row reciprocal RMS
    (`_fused_rms_norm_backward(grad, input, normalized_shape, rstd, weight, mask)`). A CPU has no
    such kernel, so there, and on the meta device, the op decomposes and autograd keeps the fp32
    copies of the composite form instead (4 bytes per element twice, against the kernel's 2)."""

    @staticmethod
    def forward(ctx, input, weight, normalized_shape, eps):
        out, rstd = aten._fused_rms_norm(input, normalized_shape, weight, eps)
        ctx.save_for_backward(input, rstd, weight)
        ctx.normalized_shape = normalized_shape
        return out

    @staticmethod
    def backward(ctx, grad):
        input, rstd, weight = ctx.saved_tensors
        mask = [ctx.needs_input_grad[0], weight is not None and ctx.needs_input_grad[1]]
        grad_input, grad_weight = aten._fused_rms_norm_backward(grad, input, ctx.normalized_shape, rstd, weight, mask)
        return grad_input, grad_weight, None, None


def _fused_rms_norm(input, normalized_shape, weight=None, eps=None):
    """`F.rms_norm` as the GPU kernel runs it (`_FusedRMSNorm`), where torch would take the fused
    path: not for a weight of another dtype (torch falls back to the composite form there)."""
    if weight is not None and weight.dtype != input.dtype:
        return None
    return _FusedRMSNorm.apply(input, weight, list(normalized_shape), eps)


class MetaAttentionMode(TorchFunctionMode):
    """Routes scaled_dot_product_attention on meta tensors to the flash kernel, and, with
    `gpu_kernels` (an analytic profile for a GPU), `rms_norm` to the fused kernel (`_FusedRMSNorm`)."""

    def __init__(self, gpu_kernels: bool = False) -> None:
        super().__init__()
        self.gpu_kernels = gpu_kernels

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention and args and args[0].device.type == "meta":
            return _flash_sdpa(*args, **kwargs)
        if self.gpu_kernels and func in (F.rms_norm, torch.rms_norm) and args and args[0].device.type == "meta":
            out = _fused_rms_norm(*args, **kwargs)
            if out is not None:
                return out
        return func(*args, **kwargs)
