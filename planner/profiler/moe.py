"""The mixture-of-experts records of a profile (profile_schema.MoELayer), per unit.

For every unit holding an experts module, at every micro-batch size:
1. run the unit once (no gradients) to recognise its MoE layers and capture what each experts
   module receives: hidden_states [T, D], top_k_index [T, k], top_k_weights (planner/moe.py
   `recognise_moe`). T and k come from there; in measured profiles the real top_k_index gives
   the routing spread (planner/moe.py `routing_spread`);
2. count the experts module alone, forward and backward, on those hidden states with a
   *balanced* top_k_index (planner/moe.py `balanced_routing`) and uniform weights 1/k, with the
   counters units are counted with (planner/profiler/measure.py `unit_costs`). Substituting the
   routing, rather than rescaling what the profiled routing cost, gives the balanced case
   exactly: every expert receives T*k/E copies, whatever the experts' implementation does
   per expert (Hugging Face's loop over the experts hit, examples/moe.py's sort or gather);
3. measured profiles also time it: a `UnitJob` of the experts alone with the balanced routing,
   in the same round-robin passes as the units (planner/profiler/__init__.py `_time_units`), so
   the experts' time is measured as the units' is; analytic ones take the roofline times of step 2.

Analytic profiles count identical units (same fingerprint and input shapes) once, as
`_count_units` does; on the meta device the balanced index is bound to its value
(planner/meta_values.py `KnownValues.to_meta`) so an implementation that reads it (a loop over
the experts hit) follows it.
"""

from __future__ import annotations

from collections import Counter
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from functools import partial

import torch
from torch import nn
from torch.utils._pytree import tree_map

from planner.meta_values import KnownValues
from planner.moe import (
    ExpertsCall,
    MoEStructure,
    balanced_routing,
    expert_hidden_dim,
    experts_inputs,
    find_experts,
    num_experts,
    recognise_moe,
    routing_spread,
    with_top_k_index,
)
from planner.profile_schema import MoECosts, MoELayer, UnitCosts
from planner.profiler.counters import MetaAttentionMode
from planner.profiler.measure import UnitJob, unit_costs


@dataclass
class _Found:
    """One MoE layer of one unit, as counted so far."""

    structure: MoEStructure
    """Where its parts are (paths relative to the unit)."""
    experts: nn.Module
    """The experts module."""
    tokens: dict[int, int] = field(default_factory=dict)
    """micro-batch size -> T."""
    top_k: int = 0
    model_dim: int = 0
    element_bytes: int = 0
    """Bytes per element of the hidden states entering the experts."""
    counted: dict[int, UnitCosts] = field(default_factory=dict)
    """micro-batch size -> the experts alone under balanced routing (times: analytic, or 0)."""
    spread: dict[int, float] = field(default_factory=dict)
    """micro-batch size -> routing spread of the profiled (real) routing; measured only."""
    job: UnitJob | None = None
    """Measured: the experts alone under balanced routing, to time (the size just counted)."""


@dataclass
class MoECount:
    """Every unit's MoE layers, and (measured) the jobs timing their experts."""

    layers: dict[str, list[_Found]] = field(default_factory=dict)
    """unit name -> its MoE layers (units without one are absent)."""
    jobs: dict[tuple[str, int, int], UnitJob] = field(default_factory=dict)
    """(unit name, layer index, micro-batch size) -> the experts alone under balanced routing."""


def count_moe(modules: dict[str, nn.Module], units: list[str], fingerprints: dict[str, str], unit_inputs: dict,
              signature, *, analytic_gpu, dtype: str, fusion: str, values: KnownValues, precision=nullcontext) -> MoECount:
    """Recognise and count every unit's MoE layers at every micro-batch size (module docstring).
    `unit_inputs`: size -> unit -> (args, kwargs), as planner/profiler/__init__.py traced them;
    `signature(fingerprint, args, kwargs)`: the key identical units share. Run inside `values`.
    `precision`: the context the units' forwards run in (autocast for a measured 16-bit profile)."""
    # The recognising forward repeats the counted one: keep the count of control-flow reads of
    # sampled values (a profile note) as the units' counting left it.
    decisions = Counter(values.sampled_decisions)
    try:
        return _count_all(modules, units, fingerprints, unit_inputs, signature, analytic_gpu, dtype, fusion, values, precision)
    finally:
        values.sampled_decisions = decisions


def _count_all(modules, units, fingerprints, unit_inputs, signature, analytic_gpu, dtype, fusion, values, precision) -> MoECount:
    count = MoECount()
    cache: dict[tuple, list[_Found]] = {}
    for b in sorted(unit_inputs):
        for name in units:
            args, kwargs = unit_inputs[b][name]
            key = signature(fingerprints[name], args, kwargs)
            if analytic_gpu is not None and key in cache:
                if cache[key]:
                    count.layers[name] = _merge(count.layers.get(name), cache[key], b)
                continue
            found = _count_unit(modules[name], args, kwargs, b, analytic_gpu, dtype, fusion, values, precision)
            cache[key] = found
            if not found:
                continue
            count.layers[name] = _merge(count.layers.get(name), found, b)
            for i, layer in enumerate(found):
                if layer.job is not None:  # measured mode only (`_count_unit` sets it)
                    count.jobs[name, i, b] = layer.job
    return count


def _merge(previous: list[_Found] | None, found: list[_Found], b: int) -> list[_Found]:
    """The unit's layers with size `b`'s numbers (from `found`, counted at `b` or, for an
    identical unit, taken from the cache) added to the earlier sizes'."""
    if previous is None:
        previous = [_Found(f.structure, f.experts, top_k=f.top_k, model_dim=f.model_dim, element_bytes=f.element_bytes)
                    for f in found]
    for mine, new in zip(previous, found, strict=True):  # the same unit structure at every size
        mine.tokens[b], mine.counted[b] = next(iter(new.tokens.values())), next(iter(new.counted.values()))
        mine.spread.update(new.spread)
    return previous


def _count_unit(module: nn.Module, args, kwargs, b: int, analytic_gpu, dtype, fusion, values, precision) -> list[_Found]:
    meta = analytic_gpu is not None
    with MetaAttentionMode() if meta else nullcontext(), precision():
        structures = recognise_moe(module, *_copies(args, kwargs))
    modules = dict(module.named_modules())
    found = []
    for s in structures:
        if s.call is None:  # an experts module the unit's forward never called
            continue
        experts, call = modules[s.experts], s.call
        width = num_experts(experts)
        balanced = _balanced_inputs(call, width, values if meta else None)
        layer = _Found(s, experts, {b: call.tokens}, call.top_k, call.model_dim, call.hidden_states.element_size())
        layer.counted[b] = unit_costs(experts, balanced, {}, analytic_gpu=analytic_gpu, dtype=dtype, fusion=fusion,
                                      precision=precision, fp8=False)  # torchao's Float8Linear converts no experts
        if not meta:
            layer.spread[b] = routing_spread(call.top_k_index, width)
            layer.job = UnitJob(experts, balanced, {}, precision)
        found.append(layer)
    return found


@contextmanager
def balanced_experts(model: nn.Module, values: KnownValues):
    """Every experts module of `model` routes its tokens evenly (`balanced_routing`, bound as known
    values so code that reads the index follows it) for the block: an analytic profile's units are
    counted so, as the experts' own records are (module docstring). Their routing is otherwise a
    draw from sampled router logits (planner/meta_values.py), and a loop over the experts hit
    costs what that draw hit: a small Qwen3-MoE with transformers' eager experts moved its
    forward traffic from 516 to 578 KB across three draws, all below the balanced 733 KB (every
    expert's weights read). The router's weights are left as computed: they train."""
    handles = [experts.register_forward_pre_hook(partial(_balanced_call, values), with_kwargs=True)
               for experts in find_experts(model).values()]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _balanced_call(values: KnownValues, module: nn.Module, args: tuple, kwargs: dict):
    found = experts_inputs(module, args, kwargs)
    if found is None or not isinstance(found[1], torch.Tensor) or found[1].dim() == 0 or not found[1].is_meta:
        return None
    index = found[1]
    top_k = index.shape[-1]
    balanced = balanced_routing(index.numel() // top_k, top_k, num_experts(module)).view(index.shape).to(index.dtype)
    return with_top_k_index(module, args, kwargs, values.to_meta(balanced))


def _copies(args, kwargs) -> tuple:
    """Copies of the unit's floating inputs, so a unit that writes its input in place leaves the
    captured inputs (later counted and timed) as they were."""
    return tree_map(lambda x: x.detach().clone() if isinstance(x, torch.Tensor) and x.is_floating_point() else x,
                    (args, kwargs))


def _balanced_inputs(call: ExpertsCall, width: int, values: KnownValues | None) -> tuple:
    """(hidden_states, balanced top_k_index, weights 1/k) for the experts alone; on meta the
    index is bound to its value so data-dependent code follows it. The hidden states and the
    weights require grad, as in the model (the router's weights train)."""
    hidden = call.hidden_states.detach().requires_grad_(True)
    index = balanced_routing(call.tokens, call.top_k, width).view(call.top_k_index.shape).to(call.top_k_index.dtype)
    index = values.to_meta(index) if values is not None else index.to(hidden.device)
    weights = torch.full(call.top_k_weights.shape, 1.0 / call.top_k, dtype=call.top_k_weights.dtype, device=hidden.device,
                         requires_grad=True)
    return hidden, index, weights


def moe_records(count: MoECount, unit: str, element_bytes: int) -> list[MoELayer]:
    """The unit's MoE layer records, once `count.jobs` (measured) have been timed.
    `element_bytes`: bytes per parameter element in the profiled dtype."""
    records = []
    for i, layer in enumerate(count.layers.get(unit, [])):
        params = list(layer.experts.parameters())
        numel = sum(p.numel() for p in params)
        costs = {b: _costs(layer, b, count.jobs.get((unit, i, b))) for b in sorted(layer.counted)}
        largest = max(layer.spread) if layer.spread else None
        records.append(MoELayer(
            experts=layer.structure.experts,
            router=layer.structure.router,
            shared_experts=layer.structure.shared_experts,
            num_experts=num_experts(layer.experts),
            top_k=layer.top_k,
            model_dim=layer.model_dim,
            expert_hidden_dim=expert_hidden_dim(layer.experts, layer.model_dim),
            expert_parameters=numel,
            expert_parameter_bytes=numel * element_bytes,
            expert_trainable_parameter_bytes=sum(p.numel() for p in params if p.requires_grad) * element_bytes,
            costs=costs,
            routing_spread=layer.spread[largest] if largest is not None else None,
        ))
    return records


def _costs(layer: _Found, b: int, job: UnitJob | None) -> MoECosts:
    counted = layer.counted[b]
    forward_s, backward_s = job.typical() if job is not None else (counted.forward_time_s, counted.backward_time_s)
    return MoECosts(
        tokens=layer.tokens[b],
        expert_forward_flops=counted.forward_flops,
        expert_backward_flops=counted.backward_flops,
        expert_forward_time_s=forward_s,
        expert_backward_time_s=backward_s,
        expert_saved_bytes=counted.saved_bytes,
        dispatch_bytes=layer.tokens[b] * layer.top_k * layer.model_dim * layer.element_bytes,
    )
