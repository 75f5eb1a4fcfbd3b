"""Which units move information between tokens outside attention, found by running them.

A token shift (RWKV's time mix), a recurrence over the sequence (RecurrentGemma's RG-LRU,
Mamba's scan, gated DeltaNet), a convolution along it or a norm over the batch cannot run on a
share of the sequence, as sequence parallelism runs the modules between a block's Megatron
pairs and context parallelism runs all of it: the solver keeps such a unit whole under SP and
offers the model no CP (planner/solver/intra_op.py `_sequence_parallel_blocked`,
`ModelInfo.cp_obstacles`). Reading the code for every way of doing so is hopeless; running it
is not. The unit's first input, a (batch, sequence, ...) activation, is run twice, the second
time with its first token moved in a random direction, and if any later token's output moved,
the tokens met.

Attention's own mixing must not count (`_SelfOnlyAttention`): fused attention answers each
query with its own value, and attention written out (scores = q @ k^T, a softmax, scores @ v,
as Megatron-LM ran it and Hugging Face's eager attention does) gets scores that keep each query
to itself, which the softmax turns into the identity. A product over the sequence with no
softmax after it (linear attention's chunked form) is then still caught: its self-only scores
are not a probability table.

A measured profile runs each distinct unit with its own inputs, under its own weights and random
ones (an initialisation may hide the path: RWKV zeroes its output projections). An analytic one
has no values (`mixes_tokens_on_meta`): the unit is run on the CPU at its full width and a few
tokens, with weights that cost almost no memory to hold nor time to multiply by (`ProbeWeights`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map_only

from planner.profiler.counters import tensors_in

PROBE_LENGTHS = (5, 7, 11, 13, 17, 19, 23, 29, 31)
"""Tokens an analytic probe may run (`_probe_length`): enough for a shift, a short convolution
and a chunked scan to carry the first token to a later one, and primes, which no head size or
other size a unit computes with equals, so that `_SelfOnlyAttention` tells scores from anything
else."""

DENSE_ELEMENTS = 1 << 16
"""An analytic probe's parameters up to this size are dense random tensors; larger ones are
strided views of one random vector (`ProbeWeights`)."""

DENSE_BYTES = 1 << 30
"""Most an op that refuses `ProbeWeights`' views may have them made dense for (a mixture of
experts' grouped_mm over all its experts at once can want many gigabytes): past it the probe
does not know."""

RANK = 32
"""Rank of the product an analytic probe's linear computes in place of its large weight's
(`ProbeWeights`): generic enough that no direction of a token's change is lost on the way."""

_PRODUCTS = {torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.bmm, torch.Tensor.bmm}
_SCORE_PRODUCTS = _PRODUCTS | {torch.baddbmm, torch.Tensor.baddbmm}  # BLOOM's ALiBi scores
_EXPERT_PRODUCTS = _PRODUCTS | {torch._grouped_mm, F.grouped_mm}  # HF's grouped_mm experts
_OFF_DIAGONAL = -1e4
"""Score of a query against another token in `_self_only_scores`: zero weight after a softmax,
finite in float16 and under any mask the model adds."""


def _self_only_scores(like: torch.Tensor) -> torch.Tensor:
    scores = like.new_full(like.shape, _OFF_DIAGONAL)
    scores.diagonal(dim1=-2, dim2=-1).zero_()
    return scores


class _SelfOnlyAttention(TorchFunctionMode):
    """Attention that moves nothing between tokens (module docstring): fused attention returns
    each query's own value (its keys' heads repeated to the queries' under grouped-query
    attention); a product of a (..., s, d) tensor with a (..., d, s) one, d not s, which is
    attention's scores q @ k^T, returns scores that keep each query to itself."""

    def __init__(self, sequence_length: int):
        super().__init__()
        self.length = sequence_length

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            q, v = (args[0] if args else kwargs["query"]), (args[2] if len(args) > 2 else kwargs["value"])
            if q.dim() == v.dim() >= 3 and q.shape[-2] == v.shape[-2] and q.shape[-3] % v.shape[-3] == 0:
                return v.repeat_interleave(q.shape[-3] // v.shape[-3], dim=-3)
        out = func(*args, **kwargs)
        if func in _SCORE_PRODUCTS and self._scores(func, args, kwargs):
            return _self_only_scores(out)
        return out

    def _scores(self, func, args, kwargs) -> bool:
        if func in (torch.baddbmm, torch.Tensor.baddbmm):  # beta * input + alpha * (batch1 @ batch2): BLOOM's ALiBi
            left, right = (list(args[1:3]) + [None, None])[:2]
            left, right = kwargs.get("batch1", left), kwargs.get("batch2", right)
        else:
            left, right = (list(args[:2]) + [None, None])[:2]
            right = kwargs.get("other", kwargs.get("mat2", right))
        if not (isinstance(left, torch.Tensor) and isinstance(right, torch.Tensor) and left.dim() >= 2 and right.dim() >= 2):
            return False
        s = self.length
        return left.shape[-2] == s and right.shape[-1] == s and left.shape[-1] != s


def probed_input(args: tuple, kwargs: dict, sequence_length: int | None) -> torch.Tensor | None:
    """The input the probe perturbs, if a unit called with these inputs has one: its first input,
    a floating (batch, sequence, ...) activation of the model's sequence (not token ids, not an
    image); else None."""
    first = args[0] if args else next(iter(kwargs.values()), None)
    if (isinstance(first, torch.Tensor) and first.is_floating_point() and first.dim() >= 3
            and sequence_length is not None and sequence_length >= 2 and first.shape[1] == sequence_length):
        return first
    return None


def mixes_tokens_outside_attention(unit: nn.Module, args: tuple, kwargs: dict, sequence_length: int | None,
                                   precision=nullcontext, weights: Sequence[dict] | None = None) -> bool | None:
    """Whether the unit's forward moves information between tokens other than through attention
    (module docstring). `weights`: the parameter sets to try in turn, the first whose outputs
    are finite deciding; by default random ones, then the unit's own. None where it cannot
    tell: on the meta device (`mixes_tokens_on_meta` runs those), where the first input is no
    (batch, sequence, ...) activation (token ids, images) or the output keeps no sequence dim."""
    first = probed_input(args, kwargs, sequence_length)
    if first is None or sequence_length is None or first.device.type == "meta":
        return None
    generator = torch.Generator(device=first.device).manual_seed(0)
    changed = first.detach().clone()  # not by a constant, which the next norm over the features would take away
    changed[:, 0] += torch.randn(changed[:, 0].shape, generator=generator, device=first.device, dtype=first.dtype)
    if weights is None:
        shaken = {name: torch.randn(p.shape, generator=generator, device=p.device, dtype=p.dtype) * 0.1
                  for name, p in unit.named_parameters() if p.is_floating_point()}
        weights = (shaken, {})

    def run(x: torch.Tensor, weights: dict) -> torch.Tensor | None:
        devices = [x.device] if x.device.type == "cuda" else []
        call_args, call_kwargs = ((x, *args[1:]), kwargs) if args else ((), {**kwargs, next(iter(kwargs)): x})
        with torch.no_grad(), torch.random.fork_rng(devices=devices), _SelfOnlyAttention(sequence_length), precision():
            torch.manual_seed(0)
            out = functional_call(unit, weights, call_args, call_kwargs, strict=False)
        found = tensors_in(out)
        if not found:
            return None
        return (torch.view_as_real(found[0]) if found[0].is_complex() else found[0]).float()  # Llama 4's rotary: complex

    for chosen in weights:
        before, after = run(first.detach(), chosen), run(changed, chosen)
        if before is None or after is None or before.shape != after.shape or before.dim() < 2 or before.shape[1] != sequence_length:
            return None
        if not (before.isfinite().all() and after.isfinite().all()):
            continue  # random weights overflowed (an exponential of them): the next set decides
        moved = (after[:, 1:] - before[:, 1:]).abs().max().item()
        return bool(moved > 1e-5 * (before.abs().max().item() + 1.0))
    return None


def _probe_length(unit: nn.Module, inputs: list[torch.Tensor], sequence_length: int) -> int:
    """The tokens an analytic probe runs: the first of PROBE_LENGTHS that no size of the unit's
    parameters or inputs equals, so that the inputs are cut along their sequence dims alone;
    the whole sequence if it is shorter."""
    sizes = {d for p in [*unit.parameters(), *unit.buffers()] for d in p.shape}
    sizes |= {d for t in inputs for d in t.shape if d != sequence_length}
    return next((n for n in PROBE_LENGTHS if n < sequence_length and n not in sizes), sequence_length)


class ProbeWeights(TorchFunctionMode):
    """Random float32 parameters and buffers for a unit of a meta model, on the CPU, that hold almost
    no memory and cost almost nothing to multiply by, at any width (`mixes_tokens_on_meta`).

    A vector (a norm's weight, a multiplier, a decay rate) is drawn about one, as models start
    theirs: drawn about zero, Falcon-H1's (1, 1, n) multiplier of its Mamba projections shrank the
    scan's contribution to later tokens below rounding. A larger parameter of up to DENSE_ELEMENTS
    is a dense draw; a larger one still is a Hankel tensor (entry
    [i, j, ...] = v[i + j + ...]) viewed out of one random vector, full rank like a dense draw,
    and scaled by 1/sqrt(fan-in) so that activations keep their size through the unit. As a mode,
    it computes `F.linear` with such a weight as a product of random factors of rank RANK
    instead (a function of the input as generic as any other for the probe, which only compares
    two runs of the same function), and a product of many experts' weights at once likewise (one
    product for all the experts, HF's grouped_mm experts over a 512-expert layer); any other op
    that refuses the view gets it dense for the time of the op, up to DENSE_BYTES. Integer buffers are
    zeros, boolean ones True."""

    def __init__(self, unit: nn.Module, generator: torch.Generator):
        super().__init__()
        self.factors: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.shared: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self.generator = generator
        self.weights = self._draw(unit, generator)

    def _draw(self, unit: nn.Module, generator: torch.Generator) -> dict[str, torch.Tensor]:
        weights: dict[str, torch.Tensor] = {}
        for name, tensor in [*unit.named_parameters(), *unit.named_buffers()]:
            shape = tuple(tensor.shape)
            if not tensor.is_floating_point():
                weights[name] = torch.ones(shape, dtype=torch.bool) if tensor.dtype == torch.bool else torch.zeros(shape, dtype=tensor.dtype)
            elif all(d == 1 for d in shape[:-1]):  # a vector, or Falcon-H1's (1, 1, n) multiplier
                weights[name] = 1 + 0.1 * torch.randn(shape, generator=generator)
            elif tensor.numel() <= DENSE_ELEMENTS:
                weights[name] = torch.randn(shape, generator=generator) / math.sqrt(math.prod(shape[1:]))
            else:
                scale = 1 / math.sqrt(math.prod(shape[1:]))
                weights[name] = (torch.randn(sum(shape) - len(shape) + 1, generator=generator) * scale).as_strided(shape, (1,) * len(shape))
                if len(shape) == 2:
                    self.factors[id(weights[name])] = (torch.randn(shape[0], RANK, generator=generator) / math.sqrt(RANK),
                                                       torch.randn(RANK, shape[1], generator=generator) * scale)
        return weights

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            x, weight = args[0], args[1] if len(args) > 1 else kwargs["weight"]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            if id(weight) in self.factors:
                left, right = self.factors[id(weight)]
                out = (x @ right.T.to(x.dtype)) @ left.T.to(x.dtype)
                return out if bias is None else out + bias
        if func in _EXPERT_PRODUCTS and len(args) >= 2 and _overlapping(args[1]) and args[1].dim() == 3:
            # A mixture of experts' batched product over all its experts' weights at once (HF's
            # grouped_mm experts): one low-rank product for every expert, as generic for the probe.
            x, weight = args[0], args[1]
            left, right = self._shared_factors(x.shape[-1], weight.shape[-1])
            return (x @ left.to(x.dtype)) @ right.to(x.dtype)
        try:
            return func(*args, **kwargs)
        except RuntimeError:
            overlapping = [t for t in tree_flatten((args, kwargs))[0] if _overlapping(t)]
            if not overlapping or sum(t.numel() * t.element_size() for t in overlapping) > DENSE_BYTES:
                raise
            args, kwargs = tree_map_only(torch.Tensor, lambda t: t.contiguous() if any(t is o for o in overlapping) else t,
                                         (args, kwargs))
            return func(*args, **kwargs)

    def _shared_factors(self, features_in: int, features_out: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rank-RANK factors for a (features_in -> features_out) product, the same at every call."""
        key = (features_in, features_out)
        if key not in self.shared:
            self.shared[key] = (torch.randn(features_in, RANK, generator=self.generator) / math.sqrt(features_in),
                                torch.randn(RANK, features_out, generator=self.generator) / math.sqrt(RANK))
        return self.shared[key]


def _overlapping(t) -> bool:
    """Whether `t` is a tensor whose elements share memory (a `ProbeWeights` view)."""
    return isinstance(t, torch.Tensor) and torch._debug_has_internal_overlap(t) != 0


def mixes_tokens_on_meta(unit: nn.Module, args: tuple, kwargs: dict, sequence_length: int | None,
                         exact=lambda t: None) -> bool | None:
    """`mixes_tokens_outside_attention` for a unit of a model built on the meta device, which has
    no values (module docstring). The unit runs on the CPU in float32 at its full width, on
    `_probe_length` tokens: the first input's dim 1 and any other input's dims of the sequence's
    length are cut to it (an input shaped as the first is cut as it is); `exact(t)`
    gives a meta input's value where it is known (planner/meta_values.py `KnownValues.exact`:
    position ids, masks), cut alike; any other floating input is drawn at random, an integer one
    is zeros and a boolean one True. Weights and their products from `ProbeWeights`. None where the unit
    cannot run so (an op wants a weight too large to make dense, or the code refuses the inputs)."""
    if sequence_length is None or sequence_length < 2:
        return None
    inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
    length = _probe_length(unit, inputs, sequence_length)
    generator = torch.Generator().manual_seed(0)

    first = inputs[0] if inputs else None

    def real(t: torch.Tensor) -> torch.Tensor:
        if not t.is_meta:
            return t
        if first is not None and t.shape == first.shape and t.dim() >= 2:  # an activation: its features may be as many as the tokens
            cut = tuple(slice(0, length) if i == 1 else slice(None) for i in range(t.dim()))
        else:
            cut = tuple(slice(0, length) if d == sequence_length else slice(None) for d in t.shape)
        known = exact(t)
        if known is not None:
            value = known[cut].clone()
            return value.float() if value.is_floating_point() else value
        shape = tuple(len(range(d)[c]) for d, c in zip(t.shape, cut, strict=True))
        if t.is_floating_point():
            return torch.randn(shape, generator=generator)
        return torch.ones(shape, dtype=torch.bool) if t.dtype == torch.bool else torch.zeros(shape, dtype=t.dtype)

    probe = ProbeWeights(unit, generator)
    real_args, real_kwargs = tree_map_only(torch.Tensor, real, (args, kwargs))
    try:
        with probe:
            return mixes_tokens_outside_attention(unit, real_args, real_kwargs, length, weights=[probe.weights])
    except Exception:  # noqa: BLE001 - the unit's code refuses drawn inputs (an index out of range): unknown
        return None
