"""A unit's matmul-like ops and the data flow between them, for the intra-op solver.

The tensor-parallel ILP (planner/solver) decides a layout for each op that does real work on
a weight or on two activations: Linear, Embedding, Conv, matmul/bmm and attention. Everything
else (norms, activations, reshapes, residual adds) follows its input's layout, so the
solver only needs to know which of these ops feed which. We run the unit once on meta
tensors and tag every tensor with the set of ops it was computed from: a matmul-like op
tags its output with its own name; any other op's output inherits the union of its inputs'
tags. An op's `inputs` are then the tags of the tensors it consumes (`input` for the
unit's own input).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import sdpa_flop_count

from planner.profile_schema import OpNode

INPUT = "input"
LEAF_KINDS = {nn.Linear: "linear", nn.Embedding: "embedding", nn.Conv1d: "conv", nn.Conv2d: "conv", nn.Conv3d: "conv"}
MATMUL_FUNCS = {torch.matmul, torch.bmm, torch.mm, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.Tensor.bmm, torch.Tensor.mm, torch.einsum}
ATTENTION_FUNCS = {F.scaled_dot_product_attention}


def _tensors(obj) -> list[torch.Tensor]:
    return [t for t in tree_flatten(obj)[0] if isinstance(t, torch.Tensor)]


def _leaf_flops(module: nn.Module, x: torch.Tensor, out: torch.Tensor) -> int:
    if isinstance(module, nn.Linear):
        return 2 * math.prod(x.shape[:-1]) * module.in_features * module.out_features
    if isinstance(module, nn.Embedding):
        return 0
    # Conv: one multiply-add per output element per input channel (of its group) per tap.
    weight = module.weight
    return 2 * out.numel() * math.prod(weight.shape[1:])


class _OpGraphRecorder(TorchFunctionMode):
    def __init__(self, unit: nn.Module):
        super().__init__()
        self.tags: dict[int, frozenset] = {}
        self.alive: list[torch.Tensor] = []
        self.ops: list[OpNode] = []
        self.depth = 0
        self.counts: dict[str, int] = {}
        self.handles = []
        for name, module in unit.named_modules():
            kind = LEAF_KINDS.get(type(module))
            if kind:
                self.handles.append(module.register_forward_pre_hook(self._pre(name, kind, module), with_kwargs=True))
                self.handles.append(module.register_forward_hook(self._post(name), with_kwargs=True))
        self.pending: dict[str, dict] = {}

    def tag(self, obj, sources: frozenset) -> None:
        for t in _tensors(obj):
            self.tags[id(t)] = sources
            self.alive.append(t)

    def sources(self, obj) -> frozenset:
        found = frozenset()
        for t in _tensors(obj):
            found |= self.tags.get(id(t), frozenset())
        return found

    def _pre(self, name: str, kind: str, module: nn.Module):
        def hook(mod, args, kwargs):
            if self.depth == 0:
                x = _tensors((args, kwargs))[0]
                self.pending[name] = dict(kind=kind, module=module, x=x, inputs=self.sources((args, kwargs)))
            self.depth += 1

        return hook

    def _post(self, name: str):
        def hook(mod, args, kwargs, out):
            self.depth -= 1
            if self.depth == 0 and name in self.pending:
                info = self.pending.pop(name)
                module, x = info["module"], info["x"]
                y = _tensors(out)[0]
                self.ops.append(
                    OpNode(
                        name=name or info["kind"],  # the unit itself is the leaf (e.g. an Embedding unit)
                        kind=info["kind"],
                        module=name,
                        weight_shape=list(module.weight.shape),
                        has_bias=getattr(module, "bias", None) is not None,
                        input_shape=list(x.shape),
                        output_shape=list(y.shape),
                        forward_flops=_leaf_flops(module, x, y),
                        inputs=sorted(info["inputs"]),
                    )
                )
                self.tag(out, frozenset({name or info['kind']}))

        return hook

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.depth > 0:
            return out
        inputs = self.sources((args, kwargs))
        kind = "attention" if func in ATTENTION_FUNCS else "matmul" if func in MATMUL_FUNCS else None
        if kind is None:
            self.tag(out, inputs)
            return out
        self.counts[kind] = self.counts.get(kind, 0) + 1
        name = f"{kind}_{self.counts[kind]}"
        operands = _tensors(args)
        y = _tensors(out)[0]
        if kind == "attention":
            q, k, v = operands[:3]
            flops = sdpa_flop_count(q.shape, k.shape, v.shape)
        else:
            flops = 2 * y.numel() * operands[0].shape[-1]
        self.ops.append(
            OpNode(name=name, kind=kind, input_shape=list(operands[0].shape), output_shape=list(y.shape), forward_flops=flops, inputs=sorted(inputs))
        )
        self.tag(out, frozenset({name}))
        return out


def record_op_graph(unit: nn.Module, args: tuple, kwargs: dict) -> list[OpNode]:
    """Run `unit` once (meta tensors advised) and return its matmul-like ops in order."""
    recorder = _OpGraphRecorder(unit)
    recorder.tag((args, kwargs), frozenset({INPUT}))
    try:
        with torch.no_grad(), recorder:
            unit(*args, **kwargs)
    finally:
        for h in recorder.handles:
            h.remove()
    return recorder.ops
