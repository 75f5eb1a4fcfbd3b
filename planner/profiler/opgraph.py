"""A unit's matmul-like ops and the data flow between them, for the intra-op solver.

The tensor-parallel ILP (planner/solver) decides a layout for each op that does real work on
a weight or on two activations: Linear, Embedding, Conv, matmul/bmm and attention. Everything
else (norms, activations, reshapes, residual adds) follows its input's layout, so the
solver only needs to know which of these ops feed which. We run the unit once on meta
tensors and tag every tensor with the set of ops it was computed from: a matmul-like op
tags its output with its own name; any other op's output inherits the union of its inputs'
tags. An op's `inputs` are then the tags of the tensors it consumes (`input` for the
unit's own input).

A module outside LEAF_KINDS is a `linear` by structure (`linear_weight_orientation`): it owns a
2-D `weight` and its own forward multiplies its input by that weight, stored [out, in] as
nn.Linear's (`F.linear(x, weight)`, or `x @ weight.T` as Falcon's `FalconLinear` computes it)
or [in, out] (`x @ weight`, `addmm(bias, x, weight)`: Hugging Face's `Conv1D`, which GPT-2's
attention and MLP use). A class-name list would miss every model's own variant of it.
"""

from __future__ import annotations

import math
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import sdpa_flop_count

from planner.profile_schema import OpNode, SavedRegion
from planner.profiler.counters import SavedBytes, tensors_in

INPUT = "input"
LEAF_KINDS = {nn.Linear: "linear", nn.Embedding: "embedding", nn.Conv1d: "conv", nn.Conv2d: "conv", nn.Conv3d: "conv"}
MATMUL_FUNCS = {torch.matmul, torch.bmm, torch.mm, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.Tensor.bmm, torch.Tensor.mm, torch.einsum}
ATTENTION_FUNCS = {F.scaled_dot_product_attention}
# How a structural linear may consume its weight W with its input x (the weight's position in args).
IN_OUT_FUNCS = {torch.mm: 1, torch.matmul: 1, torch.Tensor.mm: 1, torch.Tensor.matmul: 1, torch.Tensor.__matmul__: 1,
                torch.addmm: 2, torch.Tensor.addmm: 2}  # x @ W: W is [in, out]
OUT_IN_FUNCS = {F.linear: 1}  # x @ W^T: W is [out, in]
# W^T taken as a view of a 2-D weight (`W.T`, `W.t()`, `W.transpose(0, 1)`, `W.mT`), then used as an
# IN_OUT_FUNCS operand: x @ W^T again, W stored [out, in].
TRANSPOSE_PROPERTIES = {torch._C.TensorBase.__dict__["T"], torch._C.TensorBase.__dict__["mT"]}


def _transposes_weight(func, args, kwargs, weight: torch.Tensor) -> bool:
    """Whether `func(*args, **kwargs)` is the transpose of the 2-D `weight` (a property's getter is a
    fresh method wrapper each time, so it is known by the descriptor it is bound to)."""
    if not args or args[0] is not weight:
        return False
    if getattr(func, "__self__", None) in TRANSPOSE_PROPERTIES or func in (torch.t, torch.Tensor.t):
        return True
    if func in (torch.transpose, torch.Tensor.transpose):
        dims = [*args[1:], *kwargs.values()]
        return len(dims) == 2 and {int(d) % 2 for d in dims} == {0, 1}
    return False


IN_PLACE_DUNDERS = {"__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__", "__imod__", "__ipow__",
                    "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__", "__setitem__"}


def _written_in_place(func, args, kwargs) -> torch.Tensor | None:
    """The tensor `func(*args, **kwargs)` writes in place (`add_`, `+=`, `x[i] = v`, `relu(x,
    inplace=True)`), or None."""
    name = getattr(func, "__name__", "")
    in_place = (name.endswith("_") and not name.endswith("__")) or name in IN_PLACE_DUNDERS or kwargs.get("inplace") is True
    target = args[0] if in_place and args else None
    return target if isinstance(target, torch.Tensor) else None


SPLIT_FUNCS = {torch.chunk: 2, torch.Tensor.chunk: 2, torch.split: 2, torch.Tensor.split: 2, torch.tensor_split: 2,
               torch.Tensor.tensor_split: 2, torch.unbind: 1, torch.Tensor.unbind: 1, torch.narrow: 1,
               torch.Tensor.narrow: 1}
"""Functions that cut a tensor into pieces along a dim (0 unless given): the dim's position in args."""


def _splits_features(func, args, kwargs, out, features: int) -> bool:
    """Whether `func(*args, **kwargs)` (giving `out`) cuts its first argument along a dim of size
    `features` (a linear's output features, the last dim of its output or a dim of a view of it):
    chunk, split, tensor_split, unbind, narrow by their `dim`, indexing by comparing shapes
    (`y[..., :n]`)."""
    x = args[0]
    if func in SPLIT_FUNCS:
        pos = SPLIT_FUNCS[func]
        dim = kwargs.get("dim", args[pos] if len(args) > pos else 0)
        return isinstance(dim, int) and -x.dim() <= dim < x.dim() and x.shape[dim] == features
    return (func is torch.Tensor.__getitem__ and x.shape[-1] == features and isinstance(out, torch.Tensor)
            and out.dim() == x.dim() and out.shape[-1] < features)


REDUCING_FUNCS = {torch.mean: 1, torch.Tensor.mean: 1, torch.sum: 1, torch.Tensor.sum: 1, torch.var: 1, torch.Tensor.var: 1,
                  torch.std: 1, torch.Tensor.std: 1, torch.amax: 1, torch.Tensor.amax: 1, torch.logsumexp: 1,
                  torch.Tensor.logsumexp: 1, torch.norm: 2, torch.Tensor.norm: 2, torch.linalg.vector_norm: 2,
                  F.softmax: 1, torch.softmax: 1, torch.Tensor.softmax: 1, F.log_softmax: 1, F.normalize: 2}
"""Functions that reduce over a dim (a norm's statistics, a softmax): the dim's position in args."""
NORM_FUNCS = {F.layer_norm, F.rms_norm, F.group_norm}


def _reduced_sizes(func, args, kwargs) -> set[int]:
    """Sizes of the dims `func(*args, **kwargs)` reduces its first argument over (all of them for a
    reduction without a dim; the normalised shape's for layer_norm and rms_norm)."""
    x = args[0]
    if func in NORM_FUNCS:
        shape = kwargs.get("normalized_shape", args[1] if len(args) > 1 else ())
        return {int(d) for d in ([shape] if isinstance(shape, int) else shape)} if func is not F.group_norm else set(x.shape)
    pos = REDUCING_FUNCS[func]
    dim = kwargs.get("dim", args[pos] if len(args) > pos else None)
    if dim is None:
        return set(x.shape)
    dims = [dim] if isinstance(dim, int) else list(dim)
    return {x.shape[d] for d in dims if isinstance(d, int) and -x.dim() <= d < x.dim()}


RESHAPE_FUNCS = {torch.Tensor.view, torch.Tensor.reshape, torch.reshape}


def _heads_fixed(func, args, out, features: int) -> bool:
    """Whether `func(*args)` splits a `features`-wide last dim into several, (heads, head_dim) or
    BLOOM's (heads, 3, head_dim), with the first (the heads) written out: only an inferred count
    (-1) follows a tensor-parallel rank's share of the features."""
    x = args[0]
    if func not in RESHAPE_FUNCS or not isinstance(out, torch.Tensor) or out.dim() <= x.dim() or x.shape[-1] != features:
        return False
    split = out.dim() - x.dim() + 1  # the dims the features became, the leading ones kept
    if tuple(out.shape[:-split]) != tuple(x.shape[:-1]) or math.prod(out.shape[-split:]) != features \
            or out.shape[-split] == 1:
        return False
    sizes = args[1] if len(args) == 2 and isinstance(args[1], (tuple, list, torch.Size)) else args[1:]
    return len(sizes) == out.dim() and sizes[-split] != -1


def _inferred_heads(func, args, out, features: int) -> int | None:
    """The number of heads `func(*args)` views a `features`-wide last dim into, where that number
    is inferred (-1) and the rest of each head's width written out: (b, s, -1, head_dim), GPT-NeoX's
    fused (b, s, -1, 3 head_dim), DeepSeek-V3's kv_b_proj (b, s, -1, k_head_dim + v_head_dim),
    Falcon's (b, s, -1, q_per_kv + 2, head_dim). Each head's block is then contiguous in the
    features, so a contiguous column shard of tp ways holds whole heads (those counts divided by
    tp), whatever the block holds. None for any other op, or a head count written out
    (`_heads_fixed`)."""
    x = args[0]
    if func not in RESHAPE_FUNCS or not isinstance(out, torch.Tensor) or x.shape[-1] != features:
        return None
    sizes = args[1] if len(args) == 2 and isinstance(args[1], (tuple, list, torch.Size)) else args[1:]
    if len(sizes) != out.dim():
        return None
    for first in range(out.dim() - 2, -1, -1):  # the heads' dim, with each head's block after it
        if math.prod(out.shape[first:]) == features:
            tokens = math.prod(out.shape[:first]) == math.prod(x.shape[:-1])
            return int(out.shape[first]) if tokens and sizes[first] == -1 and out.shape[first] > 1 else None
    return None


def _features(op: OpNode) -> int | None:
    """The features of an op's output a unit may reduce over: a linear's output features, an
    attention's heads x value head dim (its (b, heads, s, d) output merged back), else None."""
    if op.kind == "linear":
        return op.output_shape[-1]
    if op.kind == "attention" and len(op.output_shape) >= 3:
        return op.output_shape[-3] * op.output_shape[-1]
    return None


class _WeightUse(TorchFunctionMode):
    """Records how one forward consumes `weight`: True for x @ W, False for x @ W^T, None otherwise."""

    def __init__(self, weight: torch.Tensor, x: torch.Tensor):
        super().__init__()
        self.weight, self.derived, self.keep = weight, {id(x)}, [x]
        self.transposed: set[int] = set()  # ids of W^T views (kept alive in `keep`)
        self.uses: list[bool | None] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if _transposes_weight(func, args, kwargs, self.weight):
            self.transposed.add(id(out))  # not a use yet: what multiplies it decides
            self.keep.append(out)
            return out
        operands = tree_flatten((args, kwargs))[0]
        if any(t is self.weight or id(t) in self.transposed for t in operands if isinstance(t, torch.Tensor)):
            use = None
            for funcs, in_out in ((IN_OUT_FUNCS, True), (OUT_IN_FUNCS, False)):
                pos = funcs.get(func)
                if pos is not None and len(args) > pos and id(args[pos - 1]) in self.derived:
                    if args[pos] is self.weight:
                        use = in_out
                    elif in_out and id(args[pos]) in self.transposed:
                        use = False  # x @ W^T
            self.uses.append(use)
        if any(isinstance(t, torch.Tensor) and id(t) in self.derived for t in operands):
            for t in tensors_in(out):  # tensors computed from the input (kept alive so ids stay unique)
                self.derived.add(id(t))
                self.keep.append(t)
        return out


def linear_weight_orientation(module: nn.Module) -> bool | None:
    """Whether `module` is a linear by structure, and how it stores its weight: True [in, out], False
    [out, in], None not a linear. It must own a 2-D `weight` (and at most a 1-D `bias`) and its own
    forward, run once on meta copies of its parameters, must use the weight in exactly one
    multiplication with its input (nothing else). The runtime asks the same question
    (runtime/apply_tp.py), so profile and runtime agree on square weights, which no shape settles."""
    weight, bias = module._parameters.get("weight"), module._parameters.get("bias")
    if weight is None or weight.dim() != 2 or (bias is not None and bias.dim() != 1):
        return None
    if any(True for _ in module.children()) or any(n not in ("weight", "bias") for n, p in module._parameters.items() if p is not None):
        return None
    params = {n: torch.empty_like(t, device="meta") for n, t in [*module.named_parameters(), *module.named_buffers()]}
    for in_features in dict.fromkeys(weight.shape):
        x = torch.empty(2, in_features, device="meta")
        probe = _WeightUse(params["weight"], x)
        try:
            with torch.no_grad(), probe:
                functional_call(module, params, (x,))
        except Exception:  # noqa: BLE001 - any failure means "not a linear taking this input"
            continue
        if len(probe.uses) == 1 and probe.uses[0] is not None:
            return probe.uses[0]
    return None


def _weight(module: nn.Module) -> torch.Tensor:
    """The leaf's `weight` (nn.Module's attribute lookup is typed Tensor | Module)."""
    weight = module.weight
    assert isinstance(weight, torch.Tensor), f"{type(module).__name__}.weight is not a tensor"
    return weight


def _linear_features(module: nn.Module, weight_in_out: bool) -> tuple[int, int]:
    rows, cols = _weight(module).shape
    return (rows, cols) if weight_in_out else (cols, rows)


def _leaf_flops(module: nn.Module, x: torch.Tensor, out: torch.Tensor, weight_in_out: bool | None = None) -> int:
    if isinstance(module, nn.Linear) or weight_in_out is not None:
        in_f, out_f = _linear_features(module, bool(weight_in_out))
        return 2 * math.prod(x.shape[:-1]) * in_f * out_f
    if isinstance(module, nn.Embedding):
        return 0
    # Conv: one multiply-add per output element per input channel (of its group) per tap.
    return 2 * out.numel() * math.prod(_weight(module).shape[1:])


class _OpGraphRecorder(TorchFunctionMode):
    def __init__(self, unit: nn.Module):
        super().__init__()
        self.tags: dict[int, frozenset] = {}
        self.alive: list[torch.Tensor] = []
        self.ops: list[OpNode] = []
        self.depth = 0
        self.counts: dict[str, int] = {}
        self.handles = []
        self.in_out: dict[str, bool] = {}  # structural linears -> weight stored [in, out]
        self.outputs: dict[int, OpNode] = {}  # id of a leaf's output (kept alive in `alive`) -> its op
        self.linears: dict[str, OpNode] = {}  # name -> op, of the linears recorded so far
        for name, module in unit.named_modules():
            kind = LEAF_KINDS.get(type(module))
            if kind is None and (orientation := linear_weight_orientation(module)) is not None:
                kind, self.in_out[name] = "linear", orientation
            if kind:
                self.handles.append(module.register_forward_pre_hook(self._pre(name, kind, module), with_kwargs=True))
                self.handles.append(module.register_forward_hook(self._post(name), with_kwargs=True))
        self.pending: dict[str, dict] = {}
        self.per_head_fused: dict[str, OpNode] = {}  # `_mark_fused`'s exceptions, for `_shards_whole_heads`
        self.storage_tags: dict[int, frozenset] = {}
        """Tags by storage (the latest tensor tagged over it): autograd may save a view made
        inside a kernel (nn.Linear's 2-D view of a 3-D input), a tensor no call returned."""
        self.current: frozenset = frozenset()
        """The tags the output of the call now running will carry: a tensor saved for backward
        that no earlier call made (softmax's output, attention's log-sum-exp) belongs to it."""
        self.saved_tags: dict[int, frozenset] = {}  # storage key (SavedBytes) -> its tags

    def note_saved(self, t: torch.Tensor) -> None:
        """A tensor autograd saves for backward (`SavedBytes.on_save`): its storage takes the tags
        of the tensor, or of the call making it."""
        key = t.untyped_storage()._cdata
        self.saved_tags.setdefault(key, self.tags.get(id(t)) or self.storage_tags.get(key) or self.current)

    def tag(self, obj, sources: frozenset) -> None:
        for t in tensors_in(obj):
            self.tags[id(t)] = sources
            self.storage_tags[t.untyped_storage()._cdata] = sources
            self.alive.append(t)

    def sources(self, obj) -> frozenset:
        found: frozenset = frozenset()
        for t in tensors_in(obj):
            found |= self.tags.get(id(t), frozenset())
        return found

    def _pre(self, name: str, kind: str, module: nn.Module):
        def hook(mod, args, kwargs):
            if self.depth == 0:
                x = tensors_in((args, kwargs))[0]
                self.pending[name] = dict(kind=kind, module=module, x=x, inputs=self.sources((args, kwargs)))
                self.current = frozenset({name or kind})
            self.depth += 1

        return hook

    def _post(self, name: str):
        def hook(mod, args, kwargs, out):
            self.depth -= 1
            if self.depth == 0 and name in self.pending:
                info = self.pending.pop(name)
                if name in self.in_out and not isinstance(out, torch.Tensor):
                    # A module that multiplies by its weight but returns more than the product
                    # (GPT-OSS's router: logits, scores and indices) is no linear to shard: a TP
                    # style's output hook takes one tensor. Not recorded, it stays replicated.
                    return
                module, x = info["module"], info["x"]
                y = tensors_in(out)[0]
                in_out = self.in_out.get(name)
                self.ops.append(
                    node := OpNode(
                        name=name or info["kind"],  # the unit itself is the leaf (e.g. an Embedding unit)
                        kind=info["kind"],
                        module=name,
                        weight_shape=list(_weight(module).shape),
                        weight_in_out=bool(in_out),
                        has_bias=getattr(module, "bias", None) is not None,
                        input_shape=list(x.shape),
                        output_shape=list(y.shape),
                        forward_flops=_leaf_flops(module, x, y, in_out),
                        inputs=sorted(info["inputs"]),
                    )
                )
                self.tag(out, frozenset({name or info['kind']}))
                self.outputs[id(y)] = node
                if node.kind == "linear":
                    self.linears[node.name] = node
                if y._base is not None:  # a view itself (nn.Linear on 3-D input): its views share this base
                    self.outputs[id(y._base)] = node

        return hook

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.multi_head_attention_forward and self.depth == 0:
            return self._multi_head_attention(func, args, kwargs)
        if self.depth == 0:  # what this call's output will be tagged with (below), for what it saves
            kind = "attention" if func in ATTENTION_FUNCS else "matmul" if func in MATMUL_FUNCS else None
            self.current = frozenset({f"{kind}_{self.counts.get(kind, 0) + 1}"}) if kind else self.sources((args, kwargs))
        out = func(*args, **kwargs)
        if self.depth > 0:
            return out
        written = _written_in_place(func, args, kwargs)
        if written is not None:  # into a leaf's output, or a view of it (whose _base it is)
            node = self.outputs.get(id(written)) or self.outputs.get(id(written._base))
            if node is not None:
                node.output_written_in_place = True
        first = args[0] if args else None
        # Computed from one linear's output alone (a residual stream mixes in the unit's input, and
        # an expert's functional F.linear passes its input's tags on): cut along its features,
        # reduced over them, or viewed into heads.
        tagged = self.tags.get(id(first), frozenset()) if isinstance(first, torch.Tensor) else frozenset()
        node = self.linears.get(next(iter(tagged))) if len(tagged) == 1 else None
        if node is not None:
            if (func in REDUCING_FUNCS or func in NORM_FUNCS) and node.output_shape[-1] in _reduced_sizes(func, args, kwargs):
                node.output_reduced_on_features = True
            features = node.output_shape[-1]
            if _heads_fixed(func, args, out, features):
                node.output_heads_fixed = True
            heads = _inferred_heads(func, args, out, features)
            if heads is not None:  # two views that disagree keep neither (the solver's own count)
                node.output_heads = heads if node.output_heads in (None, heads) else 0
            if _splits_features(func, args, kwargs, out, features):
                node.output_split_on_features = True
        elif tagged and INPUT not in tagged and (func in REDUCING_FUNCS or func in NORM_FUNCS):
            # Reduced over the features several ops' outputs combine into, none of the unit's input
            # (which a residual stream carries): BitNet norms its MLP's act(gate) * up over the
            # intermediate features and its attention's output over all heads before o_proj.
            reduced = _reduced_sizes(func, args, kwargs)
            for op in self.ops:
                if op.name in tagged and _features(op) in reduced:
                    op.output_reduced_on_features = True
        inputs = self.sources((args, kwargs))
        if written is not None and written._base is not None:
            # Written into a view (DeepSeek-V3 fills its keys by `key[..., :n].copy_(k_nope)` and
            # `key[..., n:].copy_(k_rot)`): what flowed in reaches the base, and what reads it.
            self.tag(written._base, self.tags.get(id(written._base), frozenset()) | inputs)
        kind = "attention" if func in ATTENTION_FUNCS else "matmul" if func in MATMUL_FUNCS else None
        if kind is None:
            self.tag(out, inputs)
            return out
        self.counts[kind] = self.counts.get(kind, 0) + 1
        name = f"{kind}_{self.counts[kind]}"
        operands = tensors_in(args)
        y = tensors_in(out)[0]
        if kind == "attention":
            q, k, v = operands[:3]
            flops = sdpa_flop_count(q.shape, k.shape, v.shape)
        else:
            flops = 2 * y.numel() * operands[0].shape[-1]
        if kind == "attention" or len(operands[0].shape) >= 4:
            self._mark_fused(operands[:3] if kind == "attention" else operands[:2])
        self.ops.append(
            OpNode(name=name, kind=kind, input_shape=list(operands[0].shape), output_shape=list(y.shape), forward_flops=flops, inputs=sorted(inputs))
        )
        self.tag(out, frozenset({name}))
        return out


    def _multi_head_attention(self, func, args, kwargs):
        """torch's nn.MultiheadAttention: one call that projects q, k and v from its own
        parameters, attends and projects the output, all inside (`OpNode.projections_inside`).
        Recorded as one attention of those FLOPs on the sources of its query, key and value."""
        self.counts["attention"] = self.counts.get("attention", 0) + 1
        name = f"attention_{self.counts['attention']}"
        self.current = frozenset({name})
        out = func(*args, **kwargs)
        query, key = args[0], args[1]  # (target length, batch, embed) and (source length, batch, embed)
        tokens, source, embed = query.shape[0] * query.shape[1], key.shape[0], query.shape[-1]
        flops = 2 * tokens * embed * 4 * embed + 4 * tokens * source * embed  # q, k, v and out projections; scores, mix
        y = tensors_in(out)[0]
        self.ops.append(OpNode(name=name, kind="attention", input_shape=list(query.shape), output_shape=list(y.shape),
                               forward_flops=flops, inputs=sorted(self.sources(args[:3])), projections_inside=True))
        self.tag(out, frozenset({name}))
        return out

    def _mark_fused(self, operands: list[torch.Tensor]) -> None:
        """A linear feeding more than one of q, k, v (one fused projection split into them), unless
        its output was viewed into heads of an inferred count (`OpNode.output_heads`): then q, k
        and v are pieces of each head's block (GPT-NeoX's query_key_value, DeepSeek-V3's
        kv_b_proj holding k and v), and a column shard holds whole heads of each."""
        seen: dict[str, int] = {}
        for t in operands:
            for src in self.tags.get(id(t), frozenset()):
                seen[src] = seen.get(src, 0) + 1
        for op in self.ops:
            if op.kind == "linear" and seen.get(op.name, 0) > 1:
                if op.output_heads:
                    self.per_head_fused[op.name] = op
                else:
                    op.fused_attention_input = True


def record_op_graph(unit: nn.Module, args: tuple, kwargs: dict, precision=nullcontext) -> list[OpNode]:
    """`record_unit`'s ops."""
    return record_unit(unit, args, kwargs, precision)[0]


def record_unit(unit: nn.Module, args: tuple, kwargs: dict, precision=nullcontext) -> tuple[list[OpNode], list[SavedRegion]]:
    """Run `unit` once (meta tensors advised) and return its matmul-like ops in order, and what it
    saves for backward by the ops it was computed from (`SavedRegion`). `precision`: the context
    the forward runs in (planner/profiler/autocast.py on meta), entered inside the recorder so
    that the recorder sees the casts and follows the data through them.

    The forward runs with autograd on, so that what it saves is seen (`SavedBytes`, each storage
    once, parameters and buffers excluded); the graph keeps none of it (`keep=False`)."""
    recorder = _OpGraphRecorder(unit)
    recorder.tag((args, kwargs), frozenset({INPUT}))
    saved = SavedBytes(exclude=[*unit.parameters(), *unit.buffers()], on_save=recorder.note_saved, keep=False)
    try:
        with torch.enable_grad(), recorder, precision(), saved.hooks():
            unit(*args, **kwargs)
    finally:
        saved.release()
        for h in recorder.handles:
            h.remove()
    if recorder.per_head_fused and not _shards_whole_heads(unit, args, kwargs, precision, recorder.ops):
        for op in recorder.per_head_fused.values():
            op.fused_attention_input = True
    regions: dict[frozenset, int] = {}
    for key, nbytes in saved.sizes.items():
        tags = recorder.saved_tags.get(key, frozenset())
        regions[tags] = regions.get(tags, 0) + nbytes
    return recorder.ops, [SavedRegion(ops=sorted(tags), bytes=n) for tags, n in regions.items()]


class _AttentionShapes(TorchFunctionMode):
    """The (q, k, v) shapes of every fused attention call of a forward."""

    def __init__(self):
        super().__init__()
        self.shapes: list[tuple[torch.Size, ...]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in ATTENTION_FUNCS:
            self.shapes.append(tuple(t.shape for t in tensors_in(args)[:3]))
        return func(*args, **(kwargs or {}))


def _shards_whole_heads(unit: nn.Module, args: tuple, kwargs: dict, precision, ops: list[OpNode]) -> bool:
    """Whether the unit runs as a tensor-parallel rank would with every projection that feeds an
    attention and is viewed into heads (`OpNode.output_heads`) column-sharded p ways (p: the least
    prime dividing all their head counts) and the projections reading the attention's output
    row-sharded: the forward runs, its output keeps its shape, and each attention call sees the
    same shapes but for its heads, divided by p.

    Asked where a projection feeds more than one of q, k and v through a per-head view
    (`_mark_fused`'s exceptions), which may be sound (DeepSeek-V3's kv_b_proj: each head's k and v
    side by side) or not: Falcon views its fused query_key_value into (-1, q_per_kv + 2, head_dim)
    blocks, then reshapes q, k and v with the head counts written out, which a shard breaks. The
    code after the view decides, so the unit is run on shards, as `linear_weight_orientation` runs
    a module to learn its weight's use. False keeps those projections replicated."""
    attention = {op.name for op in ops if op.kind == "attention"}
    feeding = {src for op in ops if op.kind == "attention" for src in op.inputs}
    columns = [op for op in ops if op.kind == "linear" and op.output_heads and op.name in feeding]
    rows = [op for op in ops if op.kind == "linear" and attention & set(op.inputs)]  # o_proj, row-sharded
    common = math.gcd(*(op.output_heads for op in columns if op.output_heads))
    if common < 2 or not rows or any(set(op.inputs) - attention for op in rows):
        return False
    ways = next(p for p in range(2, common + 1) if common % p == 0)
    params = dict(unit.named_parameters())
    shards = {}
    for op, column in [(op, True) for op in columns] + [(op, False) for op in rows]:
        for suffix in ("weight", "bias") if column else ("weight",):
            full = params.get(f"{op.module}.{suffix}")
            if full is None:
                continue
            shape = list(full.shape)  # [out, in], or [in, out] (`weight_in_out`); a bias [out]
            shape[0 if suffix == "bias" or column != op.weight_in_out else 1] //= ways
            shards[f"{op.module}.{suffix}"] = torch.empty(shape, dtype=full.dtype, device=full.device)
    whole, split = _AttentionShapes(), _AttentionShapes()
    try:
        with torch.no_grad(), precision():
            with whole:
                expected = tensors_in(unit(*args, **kwargs))[0].shape
            with split:
                got = tensors_in(functional_call(unit, shards, args, kwargs, strict=False))[0].shape
    except Exception:  # noqa: BLE001 - the model's code refuses a shard: not whole heads
        return False
    if got != expected or len(whole.shapes) != len(split.shapes):
        return False
    for whole_call, shard_call in zip(whole.shapes, split.shapes, strict=True):
        for before, after in zip(whole_call, shard_call, strict=True):
            if len(before) < 3 or before[:-3] + before[-2:] != after[:-3] + after[-2:] or after[-3] * ways != before[-3]:
                return False
    return True
