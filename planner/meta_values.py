"""Meta-device execution that knows the values it can: data-dependent Python on meta tensors.

The planner runs models on the meta device (shapes, no data): to find units and the tensors
crossing each cut, to count FLOPs of models too large to instantiate, and in the runtime to
replay an earlier pipeline stage's glue code. A model's forward may read tensor values in
Python (`if mask.all():`, `.item()`, `torch.nonzero`, `x[bool_mask]`), which a meta tensor
cannot answer. Hugging Face's mask code does this on every call (`find_packed_sequence_indices`
checks the position ids), and so does any mixture-of-experts layer that loops over the
experts its router picked.

`KnownValues` is a `TorchDispatchMode` that carries, beside each small meta tensor, a real
CPU tensor holding its value (a *shadow*), and answers data-dependent operations from the
shadows:

- **exact** where the value follows from data the planner has: the model's inputs (bound with
  `bind`/`to_meta`), factory ops (`arange`, `ones`, `full`: position ids, causal masks) and
  anything computed from those alone. A check like "are these position ids packed?" gets the
  answer the real run would give;
- **sampled** where it depends on parameters, which a meta model does not hold: the output
  of such an op, if small, gets a standard-normal shadow drawn from a seeded generator (a
  freshly initialised network's activations are of that kind). Control flow then follows a
  plausible draw, e.g. a router's top-k over random logits routes tokens about evenly, the
  balanced routing the cost model assumes. Each such decision is counted in
  `sampled_decisions`, by operation and model line, so a profile can say so.

A sampled value is only a plausible draw, so computing one is never worth much time: an op
that reads a sampled shadow and costs more than `MAX_SAMPLED_FLOPS` by the profiler's FLOP formulas
(a convolution of a 224x224 image's feature maps: seconds of one CPU core each, which made a
meta profile of VGG-16 take a minute) gets a fresh standard-normal draw for its floating
outputs instead, as a large output does. Exact values are always computed.

A data-dependent operation on a tensor without a shadow (too large to shadow, or made before
the mode was entered) raises `DataDependentError`, which names the operation and the model's
line. Shadows are only computed for outputs of at most `max_numel` elements, so the cost stays
small for any model size: at a 70B model's shapes only masks, position ids and router logits
are shadowed, never hidden states.

Ordering: enter this mode *before* (outside) a `FlopCounterMode`, so the counter sees only the
meta op and not the shadow computation this mode runs beneath it.
"""

from __future__ import annotations

import contextlib
import traceback
import weakref
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map, tree_map_only
from torch.utils.weak import WeakTensorKeyDictionary

from planner.errors import PlannerError

aten = torch.ops.aten

DEFAULT_MAX_NUMEL = 1 << 20
"""Largest tensor (elements) given a shadow: 4 MiB in float32, far below any hidden state of a
model worth planning, above any mask of a few thousand tokens or router logits of 128 experts."""

SAMPLED_BYTES = 1 << 30
"""Most memory the live shadows that depend on a sampled value may hold (`KnownValues`): a scan
written as a Python loop over the sequence (Jamba's Mamba, Qwen3-Next's gated delta rule) makes
small tensors at every step, kept for the backward, and sampled shadows of all of them took more
than 12 GiB for one layer. Past it, such outputs get none (a read of one raises
`DataDependentError`, as for a tensor too large to shadow)."""

MAX_SAMPLED_FLOPS = 1e8
"""Most FLOPs an op computing from sampled shadows may cost (about 0.1 s of one slow CPU core);
past it the output is drawn instead (module docstring)."""

_TORCH_DIR = Path(torch.__file__).parent
_PLANNER_DIRS = (Path(__file__).parent, Path(__file__).parent.parent / "runtime")


_UNINITIALISED = {aten.empty, aten.empty_like, aten.empty_strided, aten.new_empty, aten.new_empty_strided}
"""Factories whose values are whatever memory held: their outputs are not known, but sampled."""
_OVERWRITES = {aten.fill_, aten.zero_, aten.copy_}
"""In-place ops that replace every value of their `self` without reading it."""


class DataDependentError(PlannerError):
    """A model read a tensor value the meta device does not have."""


def model_line() -> str:
    """`file:line (function)` of the innermost frame that is neither torch's nor the planner's:
    the model code that asked for a value."""
    for frame in reversed(traceback.extract_stack()):
        path = Path(frame.filename)
        if _TORCH_DIR in path.parents or any(d in path.parents for d in _PLANNER_DIRS) or "importlib" in frame.filename:
            continue
        code = f"\n    {frame.line}" if frame.line else ""
        return f"{frame.filename}:{frame.lineno} (in {frame.name}){code}"
    return "an unknown line"


def _flops(func, args, kwargs, out) -> float:
    """FLOPs of one call by the profiler's formulas (torch's and its own, planner/profiler/counters.py
    `FLOP_FORMULAS`), 0 for an op they have none for."""
    from planner.profiler.counters import FLOP_FORMULAS  # here: the profiler imports this module

    formula = FLOP_FORMULAS.get(func.overloadpacket)
    if formula is None:
        return 0.0
    try:
        return float(formula(*args, **kwargs, out_val=out))
    except Exception:  # noqa: BLE001 - a formula that cannot read these arguments counts as cheap
        return 0.0


def leaves(obj) -> list:
    """The leaves of nested lists, tuples (named ones too) and dicts, in order: what pytree's
    `tree_flatten` gives for an op's arguments or outputs, at a fraction of its cost. The modes
    that watch every op of a traced model call it several times an op, and a scan written as a
    Python loop runs hundreds of thousands of ops (Jamba's Mamba layers at 4096 tokens)."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    out: list = []
    stack = [obj]
    while stack:
        node = stack.pop()
        if isinstance(node, (list, tuple)):
            stack.extend(reversed(node))
        elif isinstance(node, dict):
            stack.extend(reversed(list(node.values())))
        else:
            out.append(node)
    return out


_FAST_BINARY = {aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.div.Tensor}
"""The binary arithmetic torch's meta device computes through its Python references (`torch._refs`,
`_prim_elementwise_meta`): about 0.5 ms a call in torch 2.13, a third of an analytic profile of
a model whose scan is a Python loop (Jamba's Mamba: 86,000 such calls at 1,024 tokens).
`fast_binary` gives the same output (shape, strides, dtype) in a few microseconds."""


def fast_binary(func, args, kwargs) -> torch.Tensor | None:
    """The meta output of `func` (one of `_FAST_BINARY`) on meta tensors, computed as torch's meta
    reference computes it, or None where that reference should run (an `alpha`, complex or boolean
    sums and differences, tensors on other devices, channels-last layouts).

    The reference (`torch._refs`, `torch._prims._prim_elementwise_meta`): the operands are cast to
    the computation dtype (float32 for 16-bit floats), which keeps a contiguous operand contiguous
    and makes a sparse one (an expanded or sliced view) contiguous, and lays out a dense permuted
    one as it chooses (left to torch here); broadcast to the output's shape; the output is laid out densely in
    the order the operands' strides sort the dimensions (`_elementwise_strides`), then cast to the
    result dtype, which keeps its strides."""
    if func not in _FAST_BINARY or len(args) != 2 or kwargs:
        return None
    tensors = []
    for x in args:
        if isinstance(x, torch.Tensor):
            if x.device.type == "meta":
                tensors.append(x)
            elif x.dim() != 0 or x.device.type != "cpu":  # a CPU scalar takes part in promotion only
                return None
        elif not isinstance(x, (bool, int, float)):
            return None
    if not tensors:
        return None
    shape = _broadcast_shape([t.shape for t in tensors])
    if shape is None:
        return None
    try:
        result = torch.result_type(*args)
    except RuntimeError:
        return None
    if result.is_complex or (result == torch.bool and func is not aten.mul.Tensor):
        return None
    if func is aten.div.Tensor and not result.is_floating_point:
        result = torch.get_default_dtype()
    compute = torch.float32 if result in (torch.bfloat16, torch.float16) else result
    operands = []
    for t in tensors:
        strides = tuple(t.stride())
        if t.dtype != compute and not _is_contiguous(t.shape, strides):
            if _dense(t.shape, strides) or t.dim() in _CHANNELS_LAST:  # the cast's own choice of strides
                return None
            strides = _contiguous_strides(t.shape)
        operands.append(_broadcast_strides(t.shape, strides, shape))
    out = _elementwise_strides(shape, operands)
    return None if out is None else torch.empty_strided(shape, out, dtype=result, device="meta")


def _broadcast_shape(shapes: list[torch.Size]) -> torch.Size | None:
    """The shape `shapes` broadcast to (torch.broadcast_shapes, without its 45 us), None if they do not."""
    ndim = max(len(shape) for shape in shapes)
    out = [1] * ndim
    for shape in shapes:
        for i, size in enumerate(shape, ndim - len(shape)):
            if size != 1:
                if out[i] not in (1, size):
                    return None
                out[i] = size
    return torch.Size(out)


def _elementwise_strides(shape: torch.Size, operands: list[list[int]]) -> tuple[int, ...] | None:
    """Output strides of an elementwise op over operands with these strides (broadcast to `shape`):
    torch._prims_common's `compute_elementwise_output_logical_to_physical_perm` without its
    symbolic guards, or None where it would pick channels-last."""
    ndim = len(shape)
    if ndim <= 1:
        return _contiguous_strides(shape)
    contiguous = all(_is_contiguous(shape, st) for st in operands)
    if ndim in _CHANNELS_LAST:
        if contiguous and not all(_is_contiguous(shape, st, _CHANNELS_LAST[ndim]) for st in operands):
            return _contiguous_strides(shape)
        return None
    if contiguous:
        return _contiguous_strides(shape)

    def should_swap(a: int, b: int) -> int:  # torch's `ge` is >= on the plain non-negative ints here
        for st in operands:
            sa, sb = st[a], st[b]
            if sa == 0 or sb == 0:
                continue
            if sa == sb:
                if shape[b] >= shape[a]:
                    continue
                return 1
            return -1 if sb > sa else 1
        return 0

    perm = list(reversed(range(ndim)))  # insertion sort, innermost dimension first
    for i in range(1, ndim):
        dim1 = i
        for dim0 in reversed(range(i)):
            comparison = should_swap(perm[dim0], perm[dim1])
            if comparison > 0:
                perm[dim0], perm[dim1] = perm[dim1], perm[dim0]
                dim1 = dim0
            elif comparison < 0:
                break
    out = [0] * ndim
    stride = 1
    for dim in perm:
        out[dim] = stride
        stride *= max(shape[dim], 1)
    return tuple(out)


def _contiguous_strides(shape) -> tuple[int, ...]:
    out, stride = [], 1
    for size in reversed(shape):
        out.append(stride)
        stride *= max(size, 1)
    return tuple(reversed(out))


def _broadcast_strides(shape, strides, target) -> list[int]:
    """`strides` of a tensor of `shape` as `Tensor.expand(target)` gives them (c10's
    `inferExpandGeometry`): 0 on the dimensions broadcast along, and on a new leading dimension of
    size 1 the size times stride of the one after it."""
    out = [0] * len(target)
    pad = len(target) - len(shape)
    for i in reversed(range(len(target))):
        if i >= pad:
            size, stride = shape[i - pad], strides[i - pad]
        else:
            size, stride = 1, (target[i + 1] * out[i + 1] if i + 1 < len(target) else 1)
        out[i] = 0 if size != target[i] else stride
    return out


_CHANNELS_LAST = {4: (1, 3, 2, 0), 5: (1, 4, 3, 2, 0)}
"""ndim -> the dimensions of a channels-last layout, innermost first."""


def _is_contiguous(shape, strides, order=None) -> bool:
    """torch's `is_contiguous` for given sizes and strides (size-1 dimensions ignored; empty is),
    in `order` (dimensions innermost first; default: the last first)."""
    if any(size == 0 for size in shape):
        return True
    expected = 1
    for dim in order if order is not None else reversed(range(len(shape))):
        if shape[dim] != 1:
            if strides[dim] != expected:
                return False
            expected *= shape[dim]
    return True


def _dense(shape, strides) -> bool:
    """torch's `is_non_overlapping_and_dense`: the elements fill a block, in some order of the dimensions."""
    if _is_contiguous(shape, strides):
        return True
    expected = 1
    for size, stride in sorted(zip(shape, strides, strict=True), key=lambda pair: pair[1]):
        if size != 1:
            if stride != expected:
                return False
            expected *= size
    return True


def _is_meta(x) -> bool:
    return isinstance(x, torch.Tensor) and x.device.type == "meta"


def _data_dependent(exc: BaseException) -> bool:
    """Whether a meta kernel failed for want of data (not, say, a dtype check)."""
    text = str(exc).lower()
    return isinstance(exc, NotImplementedError) or "meta" in text or "data-dependent" in text or "data dependent" in text


def _in_bfloat16(func, args, kwargs, exc: BaseException):
    """Retry a meta kernel that refused a float dtype, in bfloat16, and cast back.

    Some meta kernels carry a CUDA kernel's dtype limits (`_grouped_mm`, which Hugging Face's
    mixture-of-experts layers call, accepts only bfloat16). The planner needs only the output's
    shape from a meta run, and that does not depend on the dtype.
    """
    floats = {x.dtype for x in tree_flatten((args, kwargs))[0] if _is_meta(x) and x.is_floating_point()}
    if len(floats) != 1 or torch.bfloat16 in floats:
        raise exc
    (dtype,) = floats
    cast = tree_map_only(torch.Tensor, lambda x: x.to(torch.bfloat16) if _is_meta(x) and x.is_floating_point() else x, (args, kwargs))
    try:
        out = func(*cast[0], **cast[1])
    except Exception:
        raise exc from None
    return tree_map_only(torch.Tensor, lambda x: x.to(dtype) if x.dtype == torch.bfloat16 else x, out)


class Bfloat16Retry(TorchDispatchMode):
    """Meta kernels that refuse a float dtype retried in bfloat16 (`_in_bfloat16`), for a forward on
    meta that needs only shapes: torch's pipeline shape inference runs a stage's units so
    (runtime/apply_pp.py), and a Hugging Face MoE layer's `_grouped_mm` refused float32 there."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        try:
            return func(*args, **kwargs)
        except RuntimeError as exc:
            if not any(_is_meta(x) for x in leaves((args, kwargs))):
                raise
            return _in_bfloat16(func, args, kwargs, exc)


def _on_cpu(value):
    """Arguments for running an op on shadows: meta devices become cpu."""
    if isinstance(value, torch.device) and value.type == "meta":
        return torch.device("cpu")
    return value


class KnownValues(TorchDispatchMode):
    """See the module docstring."""

    def __init__(self, max_numel: int = DEFAULT_MAX_NUMEL, seed: int = 0, sample: bool = True):
        super().__init__()
        self.max_numel = max_numel
        self.sample = sample
        """Whether parameter-dependent values are sampled (False: only exact values; a read of
        another raises DataDependentError)."""
        self.values = WeakTensorKeyDictionary()
        """meta tensor -> its shadow (a real cpu tensor of the same shape and dtype)."""
        self.sampled = WeakTensorKeyDictionary()
        """meta tensors whose shadow depends on a sampled value (marks only: value True)."""
        self.sampled_decisions: Counter = Counter()
        """(operation, model line) -> how often control flow read a sampled value there."""
        self.generator = torch.Generator().manual_seed(seed)
        self.sampled_bytes = 0
        """What the live sampled shadows hold (at most SAMPLED_BYTES)."""
        self._by_storage: dict[int, dict[int, weakref.ref]] = {}
        """storage (its address) -> the shadowed meta tensors viewing it (weakly, by id), so that a
        write forgets its aliases' shadows without a walk over every shadow (a recurrent scan
        writes a slice of one buffer per token: thousands of writes among thousands of shadows).
        Plain dicts of plain references: a `WeakValueDictionary` per storage doubled the memory of
        xLSTM's analytic profile. A dead tensor's reference reads None and is skipped; an address
        a freed storage leaves may be reused, which only adds dead references to the new one's."""
        self._prune_at = 1024

    # -- binding data the planner has ------------------------------------------------------
    def bind(self, meta: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """Record that `meta` holds `value` (moved to cpu); returns `meta`."""
        if meta.numel() <= self.max_numel:
            self._set(meta, value.detach().to("cpu", dtype=meta.dtype))
        return meta

    def to_meta(self, obj, dtype: torch.dtype | None = None):
        """`obj` with every tensor moved to meta (floating ones cast to `dtype`), values bound."""
        def move(t: torch.Tensor) -> torch.Tensor:
            cast = dtype if dtype is not None and t.is_floating_point() else t.dtype
            if t.is_meta:  # no data to know
                return t.to(dtype=cast)
            return self.bind(t.detach().to("meta", dtype=cast), t.to(dtype=cast))

        return tree_map_only(torch.Tensor, move, obj)

    # -- entering: `tolist()` and `numpy()` read data without an aten op, so a function mode
    # beside the dispatch mode answers them ------------------------------------------------
    def __enter__(self):
        self._python_reads = _PythonReads(self)
        self._python_reads.__enter__()
        self._autocast = meta_autocast()
        self._autocast.__enter__()
        return super().__enter__()

    def __exit__(self, exc_type, exc_value, traceback):
        try:
            return super().__exit__(exc_type, exc_value, traceback)
        finally:
            self._autocast.__exit__(exc_type, exc_value, traceback)
            self._python_reads.__exit__(exc_type, exc_value, traceback)

    def read(self, tensor: torch.Tensor, what: str) -> torch.Tensor:
        """The value of meta `tensor` for a Python-level read (`what`), or DataDependentError."""
        value = self.values.get(tensor)
        if value is None:
            raise self._unknown_named(what, None)
        if tensor in self.sampled:
            self.sampled_decisions[(what, model_line())] += 1
        return value

    def exact(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """The value of meta `tensor` where it follows from the inputs alone (not sampled), else None."""
        value = self.values.get(tensor)
        return None if value is None or tensor in self.sampled else value

    def replay_counts(self) -> Counter:
        """What this mode counts as it watches a call (planner/units.py `_Replays`)."""
        return self.sampled_decisions

    def add_replay_counts(self, grown: Counter) -> None:
        self.sampled_decisions.update(grown)

    def replay_state(self) -> tuple:
        """What a trace run again must start from (`_Replays`): the counts and the draws' generator."""
        return Counter(self.sampled_decisions), self.generator.get_state()

    def restore_replay_state(self, state: tuple) -> None:
        self.sampled_decisions = Counter(state[0])
        self.generator.set_state(state[1])

    # -- dispatch ----------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # The ops this mode runs itself (shadows, samples, copies) are its own business: a
        # TorchFunctionMode above it (the pipeline's tracer, runtime/pp_flow.py) must not see
        # them as the model's code, or a traced run would number more tensors than a real one.
        with torch._C.DisableTorchFunction():
            return self._dispatch(func, args, kwargs or {})

    def _dispatch(self, func, args, kwargs):
        flat = leaves((args, kwargs))
        metas = [x for x in flat if _is_meta(x)]
        makes_meta = any(isinstance(x, torch.device) and x.type == "meta" for x in flat)
        if not metas and not makes_meta:
            return func(*args, **kwargs)
        reads = self._reads(func, args, kwargs, metas)
        # Random ops draw from torch's generator: their values are not the batch's, and drawing
        # them for a shadow would move the global RNG. Their small float outputs are sampled.
        known = (all(x in self.values for x in reads) and func.overloadpacket not in _UNINITIALISED
                 and torch.Tag.nondeterministic_seeded not in func.tags)
        sampled = any(x in self.sampled for x in reads)

        if func is aten._local_scalar_dense.default:  # .item(), bool(t), int(t), float(t)
            return self._scalar(func, args[0])

        try:
            out = fast_binary(func, args, kwargs)
            if out is None:
                out = func(*args, **kwargs)
        except (RuntimeError, NotImplementedError) as exc:  # a data-dependent output shape or value
            if not known:
                if _data_dependent(exc):
                    raise self._unknown(func, exc) from exc
                return _in_bfloat16(func, args, kwargs, exc)
            real = self._run_on_shadows(func, args, kwargs)
            if sampled:
                self._note_sampled(func)
            out = tree_map_only(torch.Tensor, lambda r: torch.empty_strided(r.shape, r.stride(), dtype=r.dtype, device="meta"), real)
            self._bind_outputs(out, real, sampled)
            return out

        self._shadow(func, args, kwargs, out, known, sampled)
        return out

    def _scalar(self, func, tensor: torch.Tensor):
        value = self.values.get(tensor)
        if value is None:
            raise self._unknown(func, None)
        if tensor in self.sampled:
            self._note_sampled(func)
        return value.item()

    def _shadow(self, func, args, kwargs, out, known: bool, sampled: bool) -> None:
        """Give the outputs of a successful meta op their shadows (computed, or sampled)."""
        outs = [t for t in leaves(out) if _is_meta(t)]
        mutated = self._mutated(func, args, kwargs)
        if not outs and not mutated:
            return
        small = all(t.numel() <= self.max_numel for t in outs + mutated)
        room = self._room_for(outs + mutated)
        if known and small and not (sampled and (_flops(func, args, kwargs, out) > MAX_SAMPLED_FLOPS or not room)):
            try:
                real = self._run_on_shadows(func, args, kwargs)
            except Exception:  # a shadow is a convenience: losing one only loses an answer
                real = None
            if real is not None:
                self._bind_outputs(out, real, sampled, mutated)
                return
        for t in mutated:  # written with unknown data: the old shadow is stale, and so are its aliases'
            self._forget(t)
        for t in outs:
            if t is not None and t not in self.values:
                self.draw(t)

    def draw(self, t: torch.Tensor) -> None:
        """Give meta `t`, whose value depends on parameters, a sampled shadow (module docstring),
        where sampling is on, it is small and floating, and the budget has room."""
        if self.sample and t.numel() <= self.max_numel and t.is_floating_point() and self._room_for([t]):
            self._hold_sampled(t, torch.randn(t.shape, generator=self.generator).to(t.dtype))

    def _set(self, meta: torch.Tensor, value: torch.Tensor) -> None:
        """`value` as `meta`'s shadow, indexed by `meta`'s storage for `_forget`."""
        self.values[meta] = value
        key = meta.untyped_storage()._cdata
        views = self._by_storage.get(key)
        if views is None:
            if len(self._by_storage) >= self._prune_at:  # drop the storages no live shadowed tensor views
                self._by_storage = {k: v for k, v in self._by_storage.items() if any(r() is not None for r in v.values())}
                self._prune_at = 2 * max(len(self._by_storage), 1024)
            views = self._by_storage[key] = {}
        if id(meta) not in views or views[id(meta)]() is not meta:
            views[id(meta)] = weakref.ref(meta)

    def _aliases(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """The live shadowed meta tensors viewing `tensor`'s storage."""
        views = self._by_storage.get(tensor.untyped_storage()._cdata, {})
        return [t for t in (r() for r in list(views.values())) if t is not None]

    def _forget(self, tensor: torch.Tensor) -> None:
        """Drop the shadows of `tensor` and of every meta tensor viewing the same storage."""
        for t in [tensor, *self._aliases(tensor)]:
            self.values.pop(t, None)
            self.sampled.pop(t, None)

    def _reads(self, func, args, kwargs, metas: list[torch.Tensor]) -> list[torch.Tensor]:
        """`metas` less the arguments `func` only writes (`out=`, the self of fill_/zero_/copy_)."""
        schema = func._schema
        if not schema.is_mutable:
            return metas
        write_only = []
        for i, arg in enumerate(schema.arguments):
            if arg.alias_info is not None and arg.alias_info.is_write and (arg.is_out or func.overloadpacket in _OVERWRITES):
                value = args[i] if i < len(args) else kwargs.get(arg.name)
                write_only += [id(t) for t in leaves(value) if _is_meta(t)]
        return [x for x in metas if id(x) not in write_only]

    @staticmethod
    def _mutated(func, args, kwargs) -> list[torch.Tensor]:
        """The meta tensors `func` writes in place (in-place ops, `out=`)."""
        schema = func._schema
        if not schema.is_mutable:
            return []
        written = []
        for i, arg in enumerate(schema.arguments):
            if arg.alias_info is not None and arg.alias_info.is_write:
                value = args[i] if i < len(args) else kwargs.get(arg.name)
                written += [t for t in leaves(value) if _is_meta(t)]
        return written

    def _run_on_shadows(self, func, args, kwargs):
        def real(x):
            if not _is_meta(x):
                return _on_cpu(x)
            if x in self.values:
                return self.values[x]
            return torch.empty(x.shape, dtype=x.dtype)  # an argument the op only writes (`_reads`)

        real_args, real_kwargs = tree_map(real, (args, kwargs))
        with torch.no_grad():
            return func(*real_args, **real_kwargs)

    def _bind_outputs(self, out, real, sampled: bool, mutated: Sequence[torch.Tensor] = ()) -> None:
        written = {id(t) for t in mutated}
        for t, r in zip(tree_flatten(out)[0], tree_flatten(real)[0], strict=False):
            if _is_meta(t) and isinstance(r, torch.Tensor) and tuple(t.shape) == tuple(r.shape):
                if id(t) in written and self.values.get(t) is not r:
                    self._forget(t)  # written with a new shadow: its aliases' shadows are stale
                elif id(t) in written and sampled:  # written in place with sampled data: so are its aliases
                    for alias in self._aliases(t):
                        self.sampled[alias] = True
                if sampled:
                    self._hold_sampled(t, r)
                else:
                    self._set(t, r)
                    self.sampled.pop(t, None)

    def _room_for(self, tensors: Sequence[torch.Tensor]) -> bool:
        """Whether sampled shadows of `tensors` stay within SAMPLED_BYTES."""
        return self.sampled_bytes + sum(t.numel() * t.element_size() for t in tensors) <= SAMPLED_BYTES

    def _hold_sampled(self, meta: torch.Tensor, value: torch.Tensor) -> None:
        """`value`, which depends on a sampled one, as `meta`'s shadow, counted in `sampled_bytes`
        while it lives."""
        size = value.numel() * value.element_size()
        self._set(meta, value)
        self.sampled[meta] = True
        self.sampled_bytes += size
        weakref.finalize(value, self._release, size)

    def _release(self, size: int) -> None:
        self.sampled_bytes -= size

    def _note_sampled(self, func) -> None:
        self.sampled_decisions[(str(func.overloadpacket.__name__), model_line())] += 1

    def _unknown(self, func, exc: BaseException | None) -> DataDependentError:
        return self._unknown_named(func.overloadpacket.__name__, exc)

    def _unknown_named(self, name: str, exc: BaseException | None) -> DataDependentError:
        why = f" ({exc})" if exc is not None else ""
        return DataDependentError(
            f"The model reads a tensor's value (aten.{name}{why}) on the meta device, where tensors hold "
            f"no data, at {model_line()}",
            "The planner knows values that follow from the batch and from factory ops (arange, ones), and samples "
            "small ones that follow from parameters; this one is neither (too large, or made outside the model's "
            "forward). Profile on a real device (--device cpu or cuda) if the model fits, or guard the check so it "
            "is skipped on meta tensors (`if x.device.type != \"meta\": ...`).",
        )


class _PythonReads(TorchFunctionMode):
    """`Tensor.tolist()` / `.numpy()` / `.__array__` on a meta tensor, answered from its shadow."""

    READS = {torch.Tensor.tolist: "tolist", torch.Tensor.numpy: "numpy", torch.Tensor.__array__: "__array__"}

    def __init__(self, values: KnownValues):
        super().__init__()
        self.values = values

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        what = self.READS.get(func)
        if what is not None and args and _is_meta(args[0]):
            return func(self.values.read(args[0], what), *args[1:], **kwargs)
        return func(*args, **kwargs)


class _MetaAutocast(torch.amp.autocast_mode.autocast):
    """`torch.autocast` that takes device_type "meta" as "cpu" (see `meta_autocast`). A region
    entered with enabled=False is counted (`autocast_disabled`), so that the emulated autocast of
    an analytic profile (planner/profiler/autocast.py) stands aside in it, as torch's would."""

    def __init__(self, device_type: str, dtype=None, enabled: bool = True, cache_enabled=None):
        super().__init__("cpu" if device_type == "meta" else device_type, dtype, enabled, cache_enabled)
        self._off = not enabled

    def __enter__(self):
        _DISABLED[0] += self._off
        return super().__enter__()

    def __exit__(self, *exc):
        _DISABLED[0] -= self._off
        return super().__exit__(*exc)


_DISABLED = [0]
"""How many `torch.autocast(..., enabled=False)` regions of model code are open on the meta device."""


def autocast_disabled() -> bool:
    """Whether model code has turned autocast off here (`_MetaAutocast`)."""
    return _DISABLED[0] > 0


@contextlib.contextmanager
def meta_autocast():
    """Let model code enter `torch.autocast(device_type=x.device.type, ...)` on meta tensors.

    Models force float32 for a block by `with torch.autocast(device_type=x.device.type,
    enabled=False)` (Hugging Face's rotary embeddings in transformers 4.x), and torch refuses the
    device type "meta". On meta tensors autocast changes nothing the planner measures (shapes;
    the profile's dtype is set explicitly), so "meta" is taken as "cpu" while the block runs.
    """
    saved = torch.autocast, torch.amp.autocast
    torch.autocast = torch.amp.autocast = _MetaAutocast
    try:
        yield
    finally:
        torch.autocast, torch.amp.autocast = saved
