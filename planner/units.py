"""Pipeline units, their data flow, and structural fingerprints.

A *unit* is a module where a pipeline stage may begin or end. The rule (ARCHITECTURE.md):
the children of the model's top-most repeated lists (`nn.ModuleList`, or an `nn.Sequential`
of one repeated class), plus every sibling module along the path from the root down to
those lists, in execution order; the top-level children when the model has no such list
(an nn.Sequential among them opened into its layers).
So GPT's units are `embed, blocks.0, ..., blocks.N-1, norm, head`, and a Hugging Face
Llama's are `model.embed_tokens, model.rotary_emb, model.layers.0, ..., model.norm, lm_head`.

Execution order and data flow come from running the model once on the meta device under a
`TorchFunctionMode` that watches the code *between* units (the "glue" in the parent's
forward: residual adds, concatenations, position ids). Every tensor gets a producer (a unit,
the glue after a unit, or the model input) and its consumers. A pipeline that cuts after
unit c must send every tensor made at or before c and used after c; that is the crossing
set of cut c, skip connections included. Glue that runs between units c and c+1 belongs
to the stage of unit c+1 (it runs right before it).
"""

from __future__ import annotations

import hashlib
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from planner.errors import PlannerError

if TYPE_CHECKING:
    from planner.meta_values import KnownValues

INPUT = "input"


def _is_repeated_list(module: nn.Module) -> bool:
    children = list(module.children())
    if isinstance(module, nn.ModuleList):
        return len(children) >= 1  # an explicit list of blocks, even a list of one
    if len(children) < 2:
        return False
    if isinstance(module, nn.Sequential):
        counts = Counter(type(c) for c in children)
        return counts.most_common(1)[0][1] >= 2 and len(counts) == 1
    return False


def candidate_units(model: nn.Module) -> list[str]:
    """Unit FQNs in definition order (execution order comes from `trace_units`)."""
    if isinstance(model, (nn.Sequential, nn.ModuleList)):
        return [name for name, _ in model.named_children()]
    lists = []
    for name, module in model.named_modules():
        if name and _is_repeated_list(module) and not any(name.startswith(outer + ".") for outer in lists):
            lists.append(name)
    if not lists:
        # No repeated blocks: the top-level children, with each nn.Sequential among them opened
        # into its layers (a chain: every boundary is a legal cut). torchvision's VGG keeps all
        # its convolutions in one `features` Sequential; PipeDream cuts between them.
        return [f"{name}.{inner}" if isinstance(child, nn.Sequential) else name
                for name, child in model.named_children()
                for inner in ([n for n, _ in child.named_children()] if isinstance(child, nn.Sequential) else [""])]

    ancestors = {""}
    for name in lists:
        parts = name.split(".")
        ancestors.update(".".join(parts[:i]) for i in range(1, len(parts)))

    units: list[str] = []

    def visit(prefix: str, module: nn.Module) -> None:
        for child_name, child in module.named_children():
            fqn = f"{prefix}.{child_name}" if prefix else child_name
            if fqn in lists:
                units.extend(f"{fqn}.{n}" for n, _ in child.named_children())
            elif fqn in ancestors:
                visit(fqn, child)
            else:
                units.append(fqn)

    visit("", model)
    return units


@dataclass
class TracedTensor:
    """A tensor seen flowing between units during the trace."""

    producer: float
    """Unit index that made it; i + 0.5 for glue after unit i; -1 for the model input."""
    ordinal: int
    """Order among the tensors made at the same position (stable across batch sizes)."""
    shape: list[int]
    dtype: str
    bytes: int
    consumers: set[float] = field(default_factory=set)


@dataclass
class UnitTrace:
    """What one meta-device forward taught us about the units."""

    units: list[str]
    """Unit FQNs in execution order (only units that ran)."""
    tensors: list[TracedTensor]
    """Every tensor that flowed between units or glue."""
    unused: list[str]
    """Candidate units the forward never called."""
    repeated_calls: list[str]
    """Units called more than once (weight sharing); their first call fixes their position."""
    unit_inputs: dict[str, tuple] = field(default_factory=dict)
    """Per unit: (args, kwargs) of its first call, meta tensors (for per-unit profiling)."""

    def stage_of(self, position: float) -> int:
        """The unit whose stage runs code at `position` (see module docstring)."""
        if position < 0:
            return 0
        return min(int(position + 0.5), len(self.units) - 1) if position % 1 else int(position)

    def position_name(self, position: float) -> str:
        if position < 0:
            return INPUT
        if position % 1:
            return f"glue:after:{self.units[int(position)]}"
        return self.units[int(position)]

    def crossings(self, cut_after: int) -> list[TracedTensor]:
        """Tensors made at or before unit `cut_after` and used after it."""
        out = []
        for t in self.tensors:
            if not t.consumers:
                continue
            if self.stage_of(t.producer) <= cut_after < max(self.stage_of(c) for c in t.consumers):
                out.append(t)
        return out


class _FlowMode(TorchFunctionMode):
    """Records producers and consumers of tensors touched outside units."""

    def __init__(self, trace: "_Tracer"):
        super().__init__()
        self.trace = trace

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tracer = self.trace
        if tracer.depth > 0:  # inside a unit: its internals are the unit's business
            return func(*args, **kwargs)
        tracer.consume((args, kwargs), tracer.glue_position)
        out = func(*args, **kwargs)
        tracer.produce(out, tracer.glue_position)
        return out


class _Tracer:
    def __init__(self, model: nn.Module, unit_names: list[str]):
        self.model = model
        self.unit_names = unit_names
        self.order: list[str] = []
        self.calls: Counter = Counter()
        self.depth = 0
        self.glue_position = -0.5
        self.records: dict[int, TracedTensor] = {}
        self.alive: list[torch.Tensor] = []  # keep ids unique while tracing
        self.ordinals: Counter = Counter()
        self.unit_inputs: dict[str, tuple] = {}
        self.positions: dict[str, int] = {}

    def produce(self, obj, position: float) -> None:
        for t in tree_flatten(obj)[0]:
            if isinstance(t, torch.Tensor) and not isinstance(t, nn.Parameter) and id(t) not in self.records:
                self.records[id(t)] = TracedTensor(
                    producer=position,
                    ordinal=self.ordinals[position],
                    shape=list(t.shape),
                    dtype=str(t.dtype).removeprefix("torch."),
                    bytes=t.numel() * t.element_size(),
                )
                self.ordinals[position] += 1
                self.alive.append(t)

    def consume(self, obj, position: float) -> None:
        for t in tree_flatten(obj)[0]:
            record = self.records.get(id(t)) if isinstance(t, torch.Tensor) else None
            if record is not None:
                record.consumers.add(position)

    def pre_hook(self, name: str):
        def hook(module, args, kwargs):
            self.calls[name] += 1
            if self.depth == 0 and name not in self.positions:
                self.positions[name] = len(self.order)
                self.order.append(name)
                self.unit_inputs[name] = (args, kwargs)
            if self.depth == 0:
                self.consume((args, kwargs), self.positions[name])
            self.depth += 1

        return hook

    def post_hook(self, name: str):
        def hook(module, args, kwargs, output):
            self.depth -= 1
            if self.depth == 0:
                self.produce(output, self.positions[name])
                self.glue_position = self.positions[name] + 0.5

        return hook


def trace_units(model: nn.Module, inputs: tuple) -> UnitTrace:
    """Run `model(*inputs)` (meta tensors advised) and record units and data flow.

    A candidate unit that the forward never calls but whose children it does (a ModuleDict,
    a list iterated by its parent) is replaced by its children and the trace is repeated.
    """
    names = candidate_units(model)
    modules = dict(model.named_modules())
    for _ in range(8):  # nesting depth; real models need one or two rounds
        trace = _trace_once(model, inputs, names)
        containers = [n for n in trace.unused if any(True for _ in modules[n].children())]
        if not containers:
            return trace
        names = [
            child for n in names for child in ([f"{n}.{c}" for c, _ in modules[n].named_children()] if n in containers else [n])
        ]
    return trace


def trace_on_meta(model: nn.Module, inputs: tuple, values: KnownValues | None = None) -> UnitTrace:
    """`trace_units` of a meta-device model on `inputs` (real or meta tensors), with the values
    the meta device lacks supplied where they can be (planner/meta_values.py)."""
    from planner.meta_values import KnownValues

    values = values or KnownValues()
    with values:
        return trace_units(model, values.to_meta(inputs))


def _trace_once(model: nn.Module, inputs: tuple, names: list[str]) -> UnitTrace:
    modules = dict(model.named_modules())
    tracer = _Tracer(model, names)
    handles = []
    for name in names:
        handles.append(modules[name].register_forward_pre_hook(tracer.pre_hook(name), with_kwargs=True))
        handles.append(modules[name].register_forward_hook(tracer.post_hook(name), with_kwargs=True))
    tracer.produce(inputs, -1)
    try:
        with _FlowMode(tracer):
            output = model(*inputs)
    finally:
        for h in handles:
            h.remove()
    # The loss consumes the output on the last stage: nothing to send.
    del output
    return UnitTrace(
        units=tracer.order,
        tensors=list(tracer.records.values()),
        unused=[n for n in names if n not in tracer.positions],
        repeated_calls=[n for n, c in tracer.calls.items() if c > 1 and n in tracer.positions],
        unit_inputs=tracer.unit_inputs,
    )


def _hash(lines: list[str]) -> str:
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:16]


def module_fingerprint(module: nn.Module) -> str:
    """Hash of the module tree's classes and parameter/buffer shapes (names relative)."""
    lines = [f"{n} {type(m).__name__}" for n, m in module.named_modules()]
    lines += [f"{n} {list(p.shape)}" for n, p in module.named_parameters()]
    lines += [f"{n} {list(b.shape)}" for n, b in module.named_buffers()]
    return _hash(lines)


def model_fingerprint(model: nn.Module, units: list[str]) -> str:
    """Fingerprint of the whole model: its units in order and every module and shape."""
    return _hash([" ".join(units), module_fingerprint(model)])


def unit_fingerprints(model: nn.Module, units: list[str]) -> dict[str, str]:
    modules = dict(model.named_modules())
    return {name: module_fingerprint(modules[name]) for name in units}


def owned_parameters(model: nn.Module, units: list[str]) -> dict[str, list[tuple[str, nn.Parameter]]]:
    """Parameters per unit; a shared parameter belongs to the first unit that has it.

    Parameters outside every unit (held directly by an ancestor) are reported under "".
    """
    modules = dict(model.named_modules())
    seen: set[int] = set()
    owned: dict[str, list] = defaultdict(list)
    for name in units:
        for pname, p in modules[name].named_parameters(remove_duplicate=False):
            if id(p) not in seen:
                seen.add(id(p))
                owned[name].append((f"{name}.{pname}", p))
    for pname, p in model.named_parameters():
        if id(p) not in seen:
            seen.add(id(p))
            owned[""].append((pname, p))
    return owned


def tied_units(model: nn.Module, units: list[str]) -> list[list[str]]:
    """Groups of units that share a parameter object (e.g. tied input/output embeddings)."""
    modules = dict(model.named_modules())
    users: dict[int, list[str]] = defaultdict(list)
    for name in units:
        for p in {id(p) for p in modules[name].parameters()}:
            users[p].append(name)
    return sorted({tuple(u) for u in users.values() if len(u) > 1})


def check_units_cover(trace: UnitTrace, model: nn.Module) -> None:
    if not trace.units:
        raise PlannerError(
            "The model's forward called none of its submodules, so there is nowhere to cut it into stages.",
            "Give the model submodules (e.g. an nn.ModuleList of blocks) and call them in forward().",
        )
