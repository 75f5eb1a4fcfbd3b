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

import contextlib
import copy
import gc
import hashlib
import types
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import TreeSpec, tree_flatten, tree_map, tree_unflatten

from planner.errors import PlannerError
from planner.meta_values import leaves

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
    lists: list[str] = []
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
    joined: list[tuple[str, str]] = field(default_factory=list)
    """Runs of units (first, last) no pipeline cut may split (`joined_units`)."""
    cp_obstacles: list[str] = field(default_factory=list)
    """What in the forward a split sequence cannot follow (planner/profiler/counters.py `SequenceSplitChecks`)."""
    attention_calls: int | None = None
    """Its calls to F.scaled_dot_product_attention (None: not counted, the input has no sequence)."""
    float_fed: set[int] = field(default_factory=set)
    """Indices of the units that consume a floating-point tensor (`DataFlow.float_fed`)."""

    def unit_at(self, position: float) -> int:
        """The index of the unit whose stage runs code at `position` (see module docstring):
        glue after unit i runs with unit i + 1, the model's inputs with unit 0."""
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
            if self.unit_at(t.producer) <= cut_after < max(self.unit_at(c) for c in t.consumers):
                out.append(t)
        return out


Key = tuple[float, int]
"""A tensor's name in the data flow: (position, ordinal). Position -1 is the model input, i the
output of unit i, i + 0.5 the glue after unit i; the ordinal counts the tensors made there."""


class DataFlow(TorchFunctionMode):
    """Numbers every tensor made outside units by (position, ordinal) and records its consumers.

    The one tracer of the planner: the profiler's unit trace (`trace_units`) and the pipeline
    runtime's cut layout and stage replay (runtime/pp_flow.py `Flow`, a subclass that replays)
    number tensors with this class, so their keys agree by construction.

    Tensors no visible op made. Some glue makes tensors below the reach of a function mode:
    `torch.vmap` returns its result by unwrapping a batched tensor in C++ (transformers 4.x builds
    its attention masks so), and a tensor may come from module state. Such a tensor is keyed when
    glue or a unit first consumes it ("late"), at the position where it was really made: the
    recording watches every aten op under a dispatch mode (`StorageBirths`) and takes the position
    of the op that made the tensor's storage (the glue position of that consumption if none did).
    `late` lists those keys in the order they were assigned; a replay running the same code
    assigns the same keys in the same order (`_next_late_key`).
    """

    def __init__(self):
        super().__init__()
        self.depth = 0
        """Unit calls in progress: inside one, ops are the unit's own business."""
        self.glue: float = -0.5
        """Position of the glue now running: i + 0.5 after unit i."""
        self.keys: dict[int, Key] = {}
        self.values: dict[Key, torch.Tensor] = {}
        """Every keyed tensor (this also keeps the objects alive, so ids stay unique)."""
        self.ordinals: Counter = Counter()
        self.consumers: dict[Key, set[float]] = defaultdict(set)
        self.late: list[Key] = []
        self.late_reach: list[float] = []
        """Recording: the glue position where each late tensor was first consumed (`joined_units`)."""
        self.received: dict[Key, torch.Tensor] = {}
        """Replay only: tensors that stand in for their keys (runtime/pp_flow.py)."""
        self.stand_ins: dict[int, torch.Tensor] = {}
        """id of a late tensor's stand-in -> the received tensor that replaces it."""
        self.births: dict[StorageWeakRef, float] = {}
        """Recording: storage -> glue position of the aten op that made it (`StorageBirths`)."""
        self.unborn_late = 0
        """Recording: late tensors whose storage no op outside units made, nor the model held
        before the forward (`held`): made inside a unit, which `_Replays` cannot vouch for."""
        self.held: set[StorageWeakRef] = set()
        """Recording: the storages of the model's tensors other than parameters (buffers, tensor
        attributes), which glue may read directly (RecurrentGemma scales its embeddings by one)."""
        self._alive: list[torch.Tensor] = []
        """Tensors whose ids or storages are keys above: kept alive so no new object reuses them."""

    @property
    def recording(self) -> bool:
        return True

    def produce(self, obj, position: float):
        """Key the new tensors in `obj`; a received tensor replaces its stand-in (a replay's)."""
        if isinstance(obj, torch.Tensor):  # the common case, without pytree's cost
            return self.produce((obj,), position)[0]
        flat, spec = tree_flatten(obj)
        changed = False
        for i, t in enumerate(flat):
            if isinstance(t, torch.Tensor) and not isinstance(t, nn.Parameter) and id(t) not in self.keys:
                key = (position, self.ordinals[position])
                self.ordinals[position] += 1
                if key in self.received:
                    t = flat[i] = self.received[key]
                    changed = True
                self.keys[id(t)] = key
                self.values[key] = t
        return tree_unflatten(flat, spec) if changed else obj

    def float_fed(self) -> set[int]:
        """Indices of the units that consume a floating-point tensor (an embedding of token ids
        does not): the profile's `Unit.float_fed`, and the pipeline's cut layout alike."""
        return {int(u) for key, users in self.consumers.items() if self.values[key].is_floating_point()
                for u in users if u % 1 == 0 and u >= 0}

    def consume(self, obj, position: float) -> None:
        for t in leaves(obj):
            key = self.keys.get(id(t)) if isinstance(t, torch.Tensor) else None
            if key is not None:
                self.consumers[key].add(position)

    def key_late(self, obj, own: bool = False):
        """`obj` with its late tensors keyed and received ones in place of their stand-ins.
        `own`: the replayed stage's own code consumes `obj` (runtime/pp_flow.py `Flow`)."""
        with torch._C.DisableTorchFunction():  # reading `t.is_meta` here is not the model's code
            flat, spec = tree_flatten(obj)
            changed = False
            for i, t in enumerate(flat):
                if not isinstance(t, torch.Tensor) or isinstance(t, nn.Parameter):
                    continue
                if id(t) in self.stand_ins:
                    flat[i], changed = self.stand_ins[id(t)], True
                elif id(t) not in self.keys:
                    flat[i] = self._key_late(t)
                    changed = changed or flat[i] is not t
                if own:
                    real = self._own(flat[i])
                    if real is not flat[i]:
                        flat[i], changed = real, True
            return tree_unflatten(flat, spec) if changed else obj

    def _own(self, t: torch.Tensor) -> torch.Tensor:
        """A tensor the replayed stage's own code consumes (recording: every tensor is as made)."""
        return t

    def _key_late(self, t: torch.Tensor) -> torch.Tensor:
        if self.recording:
            try:
                storage: StorageWeakRef | None = StorageWeakRef(t.untyped_storage())
            except (RuntimeError, NotImplementedError):  # no storage (a vmap batched tensor's wrapper)
                storage = None
            position = self.births.get(storage) if storage is not None else None
            if position is None:
                position = self.glue
                self.unborn_late += storage not in self.held
            key = (position, self.ordinals[position])
            self.late.append(key)
            self.late_reach.append(self.glue)
        else:
            key = self._next_late_key()
        self.ordinals[key[0]] = max(self.ordinals[key[0]], key[1] + 1)
        self.keys[id(t)] = key
        self._alive.append(t)
        if key in self.received:
            self.stand_ins[id(t)] = t = self.received[key]
            self.keys[id(t)] = key
        self.values[key] = t
        return t

    def _next_late_key(self) -> Key:
        raise NotImplementedError("only a replay takes late keys from a recording")

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.depth > 0:  # inside a unit: its internals are the unit's business
            return func(*args, **kwargs)
        args, kwargs = self.key_late((args, kwargs))
        self.consume((args, kwargs), self.glue)
        return self.produce(func(*args, **kwargs), self.glue)

    def enter(self, position: float, args, kwargs):
        """A unit at `position` is called (recording): its inputs are consumed there. Replacement
        (args, kwargs), or None to keep them."""
        new = None
        if self.depth == 0:
            new = self.key_late((args, kwargs))
            self.consume(new, position)
        self.depth += 1
        return new if new is not None and new is not (args, kwargs) else None

    def leave(self, position: float, output):
        """The unit at `position` returned `output`; a replacement output, or None to keep it."""
        self.depth -= 1
        if self.depth == 0:
            self.glue = position + 0.5
            new = self.produce(output, position)
            return new if new is not output else None
        return None

    def recorded(self) -> contextlib.AbstractContextManager:
        """Enter to record: this mode and the dispatch mode that dates storages (`StorageBirths`)."""
        stack = contextlib.ExitStack()
        stack.enter_context(StorageBirths(self))
        stack.enter_context(self)
        return stack


def joined_units(late: list[Key], reach: list[float]) -> list[tuple[int, int]]:
    """Runs of units (first, last index) that one pipeline stage must hold together.

    A late tensor (`DataFlow`) made in the glue at position b and first consumed at glue
    position g is keyed only where it is consumed, so the stage that makes it must run on to
    that point: units int(b + 0.5) .. int(g + 0.5) share a stage. (transformers 4.57's GPT-2
    builds its mask after `wpe` and first uses it in `h.0`, so no cut between `drop` and `h.0`.)"""
    runs = {(int(b + 0.5), int(g + 0.5)) for (b, _), g in zip(late, reach, strict=True)}
    return sorted(run for run in runs if run[1] > run[0])


def repeated_spans(calls: list[int], num_units: int) -> list[tuple[int, int]]:
    """Runs of units (first, last index) one pipeline stage must hold for the units the forward
    calls more than once: `calls` is the sequence of unit indices as the forward calls them. A
    unit i called again after units up to k (k = i for calls in a row, as Gemma 3 calls its
    rotary embedding for its local and its global layers) runs each call in its own stage only
    if units i .. k are there, and the glue after its last call (numbered i + 0.5, so run with
    unit i + 1's stage) too: i .. min(k + 1, last unit)."""
    spans: dict[int, int] = {}
    for k, unit in enumerate(calls):
        first = calls.index(unit)
        if first < k:
            reach = max(calls[first:k + 1])
            spans[unit] = max(spans.get(unit, unit), min(reach + 1, num_units - 1))
    return sorted((unit, last) for unit, last in spans.items() if last > unit)


class StorageBirths(TorchDispatchMode):
    """Records, while `flow` records, the glue position at which each storage was made."""

    def __init__(self, flow: DataFlow):
        super().__init__()
        self.flow = flow

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        with torch._C.DisableTorchFunction():  # its own work, not the model's code (meta_values.py)
            out = func(*args, **(kwargs or {}))
            if self.flow.depth == 0:
                for t in leaves(out):
                    if isinstance(t, torch.Tensor) and t.is_meta:
                        self.flow.births.setdefault(StorageWeakRef(t.untyped_storage()), self.flow.glue)
                        self.flow._alive.append(t)
        return out


_SHARED = (torch.Tensor, nn.Module, type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType,
           types.MethodType, type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device)
"""What a copy of a unit's inputs shares rather than copies: tensors and modules (their values are
the unit's inputs and weights), code, and immutable scalars."""


def copy_state(x):
    """`x` copied if it is a mutable object a model's forward updates as it goes, with the tensors
    and modules inside it shared; `x` itself otherwise.

    Hugging Face models pass one key/value `Cache` to every attention layer, and each layer
    appends its keys and values to it (an encoder-decoder's cross-attention computes them once
    and reads them back after). A unit's captured inputs hold that object as the whole forward
    left it, so running the unit alone again would attend over keys it never saw, or backward
    through a graph an earlier run freed. The tracer keeps a copy made when the unit was called
    (`_Tracer.pre_hook`), and every run of the unit alone starts from a fresh copy of that
    (planner/profiler/measure.py `_fresh_inputs`). An object that will not copy is shared, as
    before."""
    if isinstance(x, _SHARED):
        return x
    shared: dict[int, object] = {}
    seen: set[int] = set()
    stack = [x]
    while stack:  # the tensors and modules reachable from x go into deepcopy's memo, as themselves
        o = stack.pop()
        if id(o) in seen or len(seen) > 100_000:
            continue
        seen.add(id(o))
        if isinstance(o, _SHARED):
            shared[id(o)] = o
            continue
        stack.extend(gc.get_referents(o))
    try:
        return copy.deepcopy(x, shared)
    except Exception:  # an object that defines no copy: the unit reads it as the trace left it
        return x


def copy_inputs(args, kwargs) -> tuple:
    """`(args, kwargs)` with `copy_state` applied to every leaf."""
    return tree_map(copy_state, (args, kwargs))


_PLAIN = (type(None), bool, int, float, str, torch.dtype, torch.device, torch.layout, torch.memory_format, slice,
          type(Ellipsis))
"""Non-tensor arguments and outputs a replayed call may have: values, not objects a unit could update."""


class _Replays:
    """Units of a meta-device trace answered from an earlier twin's call, without running.

    The trace runs every layer of the model, though it records only what crosses units; a scan
    written as a Python loop makes that the bulk of a profile (Jamba's 28 Mamba layers, 1,024
    steps each). A unit whose module matches one already run (the classes, shapes, dtypes and
    trainability of `module_fingerprint`'s tree, and every submodule's training flag) and that is
    called alike (the same tensor shapes, strides, dtypes and gradient flags; tensors whose
    values are known exactly the very same objects; the same plain values otherwise; the same
    grad and autocast mode) returns fresh meta tensors shaped as that call's outputs, with
    gradients where they had them and newly drawn values where theirs were sampled (a sampled
    value is only a plausible draw, planner/meta_values.py). That is what the profiler already
    assumes when it measures one unit for all its twins (planner/profiler/__init__.py
    `_signature`). The counts the modes keep as they watch a call (attention calls, sampled
    decisions: `replay_counts`) grow on a replay as the first call grew them.

    Not replayed: real tensors, outputs with exact known values (a later read needs them), a
    unit that holds another unit, arguments or outputs other than tensors and plain values (a
    cache object the unit would update). A first call that let a tensor out other than by its outputs (a hook
    collecting router logits, module state) shows when the glue consumes a tensor no op outside
    the units made (`DataFlow.unborn_late`); the trace then runs again without replays.
    """

    def __init__(self, flow: DataFlow, modules: dict[str, nn.Module], names: list[str]):
        self.flow = flow
        self.used = False
        self.answers: dict[tuple, _Answer | None] = {}
        self.patched: dict[str, tuple[nn.Module, object]] = {}
        self.structure: dict[str, tuple] = {}
        for name in names:
            if any(other.startswith(name + ".") for other in names):
                continue
            module = modules[name]
            self.structure[name] = (module_fingerprint(module), tuple(type(m) for m in module.modules()),
                                    tuple((p.dtype, p.requires_grad) for p in module.parameters()),
                                    tuple(b.dtype for b in module.buffers()), tuple(m.training for m in module.modules()))
            self.patched[name] = (module, module.__dict__.get("forward"))

    def __enter__(self):
        for name, (module, _) in self.patched.items():
            module.forward = self._forward(name, module.forward)
        return self

    def __exit__(self, *exc):
        for module, own in self.patched.values():
            if own is None:
                del module.forward
            else:
                module.forward = own

    def _forward(self, name: str, forward):
        def replaying(*args, **kwargs):
            if self.flow.depth != 1:  # a unit's own call of itself, or one inside another unit
                return forward(*args, **kwargs)
            from planner.meta_values import KnownValues

            modes = _active_modes()
            known = next((m for m in modes if isinstance(m, KnownValues)), None)
            flat, spec = tree_flatten((args, kwargs))
            key = self._key(name, flat, spec, known)
            if key is None:
                return forward(*args, **kwargs)
            if key in self.answers:
                answer = self.answers[key]
                if answer is not None:
                    self.used = True
                    return answer.replay(flat, modes, known)
                return forward(*args, **kwargs)
            before = [Counter(mode.replay_counts()) for mode in modes]
            out = forward(*args, **kwargs)
            grown = [Counter(mode.replay_counts()) - b for mode, b in zip(modes, before, strict=True)]
            self.answers[key] = _Answer.of(out, flat, grown, known)
            return out

        return replaying

    def _key(self, name: str, flat: list, spec: TreeSpec, known: KnownValues | None) -> tuple | None:
        from planner.meta_values import autocast_disabled

        parts: list = [self.structure[name], spec, torch.is_grad_enabled(), autocast_disabled()]
        with torch._C.DisableTorchFunction():  # reading tensors' properties is not the model's code
            for x in flat:
                if isinstance(x, torch.Tensor):
                    if not x.is_meta or isinstance(x, nn.Parameter):
                        return None
                    exact = known is not None and x in known.values and x not in known.sampled
                    parts.append((tuple(x.shape), x.stride(), x.dtype, x.requires_grad, id(x) if exact else None))
                elif isinstance(x, _PLAIN):
                    parts.append((type(x), x))
                else:
                    return None
        return tuple(parts)


def _active_modes() -> list:
    """The active torch function and dispatch modes that keep counts a replay must grow (and a
    trace run again must reset): `replay_counts`, `add_replay_counts`, `replay_state`,
    `restore_replay_state` (planner/meta_values.py `KnownValues`, planner/profiler/counters.py
    `SequenceSplitChecks`)."""
    from torch.overrides import _get_current_function_mode_stack
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    return [m for m in [*_get_current_function_mode_stack(), *_get_current_dispatch_mode_stack()]
            if hasattr(m, "replay_counts")]


@dataclass
class _Answer:
    """What a unit's call returned, to return again (`_Replays`): its output's structure with, for
    each tensor leaf, either the argument it was (by position) or the layout of a new one."""

    spec: TreeSpec
    leaves: list[tuple]
    grown: list[Counter]

    @staticmethod
    def of(out, args: list, grown: list[Counter], known: KnownValues | None) -> _Answer | None:
        flat, spec = tree_flatten(out)
        answer: list[tuple] = []
        with torch._C.DisableTorchFunction():
            for x in flat:
                if isinstance(x, torch.Tensor):
                    same = next((i for i, a in enumerate(args) if a is x), None)
                    if same is not None:
                        answer.append(("argument", same))
                    elif type(x) is not torch.Tensor or not x.is_meta:
                        return None
                    elif known is not None and x in known.values and x not in known.sampled:
                        return None  # an exact value a later read may need
                    else:
                        answer.append(("tensor", tuple(x.shape), x.stride(), x.dtype, x.requires_grad))
                elif isinstance(x, _PLAIN):
                    answer.append(("value", x))
                else:
                    return None
        return _Answer(spec, answer, grown)

    def replay(self, args: list, modes, known: KnownValues | None) -> object:
        """The outputs again: new tensors are drawn sampled values where the known-values mode
        would draw them for a parameter-dependent output (planner/meta_values.py `KnownValues.draw`)."""
        from torch.utils._python_dispatch import _disable_current_modes

        for mode, grown in zip(modes, self.grown, strict=True):
            mode.add_replay_counts(grown)
        out = []
        with _disable_current_modes(), torch._C.DisableTorchFunction():  # not the model's ops
            for leaf in self.leaves:
                if leaf[0] == "argument":
                    out.append(args[leaf[1]])
                elif leaf[0] == "value":
                    out.append(leaf[1])
                else:
                    _, shape, stride, dtype, grad = leaf
                    t = (_Fresh.apply(_GRAD_ANCHOR, shape, stride, dtype) if grad
                         else torch.empty_strided(shape, stride, dtype=dtype, device="meta"))
                    if known is not None:
                        known.draw(t)
                    out.append(t)
        return tree_unflatten(out, self.spec)


class _Fresh(torch.autograd.Function):
    """A new meta tensor that, like a unit's output, has a gradient function (so in-place glue
    on it is allowed, as on the output it stands for)."""

    @staticmethod
    def forward(ctx, anchor, shape, stride, dtype):
        return torch.empty_strided(shape, stride, dtype=dtype, device="meta")

    @staticmethod
    def backward(ctx, grad):
        return None, None, None, None


_GRAD_ANCHOR = torch.empty((), device="meta", requires_grad=True)


class _Tracer:
    """The profiler's unit hooks over a `DataFlow`: units get positions in the order of their
    first call; a unit called again (weight sharing) consumes and produces at that position."""

    def __init__(self, unit_names: list[str]):
        self.flow = DataFlow()
        self.unit_names = unit_names
        self.order: list[str] = []
        self.sequence: list[str] = []
        """Every call of a unit outside another, in order (repeats included: `repeated_spans`)."""
        self.calls: Counter = Counter()
        self.unit_inputs: dict[str, tuple] = {}
        self.positions: dict[str, float] = {}

    def pre_hook(self, name: str):
        def hook(module, args, kwargs):
            self.calls[name] += 1
            if self.flow.depth == 0:
                self.sequence.append(name)
            if self.flow.depth == 0 and name not in self.positions:
                self.positions[name] = float(len(self.order))
                self.order.append(name)
                self.unit_inputs[name] = copy_inputs(args, kwargs)
            return self.flow.enter(self.positions.get(name, -1.0), args, kwargs)

        return hook

    def post_hook(self, name: str):
        def hook(module, args, kwargs, output):
            return self.flow.leave(self.positions.get(name, -1.0), output)

        return hook

    def tensors(self) -> list[TracedTensor]:
        return [TracedTensor(producer=key[0], ordinal=key[1], shape=list(t.shape), dtype=str(t.dtype).removeprefix("torch."),
                             bytes=t.numel() * t.element_size(), consumers=set(self.flow.consumers.get(key, ())))
                for key, t in self.flow.values.items()]


def trace_units(model: nn.Module, inputs: tuple, replay: bool = True) -> UnitTrace:
    """Run `model(*inputs)` (meta tensors advised) and record units and data flow.

    A candidate unit that the forward never calls but whose children it does (a ModuleDict,
    a list iterated by its parent) is replaced by its children and the trace is repeated.
    `replay`: a unit called like an earlier twin returns that call's outputs without running (`_Replays`).
    """
    names = candidate_units(model)
    modules = dict(model.named_modules())
    for _ in range(8):  # nesting depth; real models need one or two rounds
        trace = _trace_once(model, inputs, names, replay)
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


def _trace_once(model: nn.Module, inputs: tuple, names: list[str], replay: bool = True) -> UnitTrace:
    modules = dict(model.named_modules())
    tracer = _Tracer(names)
    handles = []
    for name in names:
        handles.append(modules[name].register_forward_pre_hook(tracer.pre_hook(name), with_kwargs=True))
        handles.append(modules[name].register_forward_hook(tracer.post_hook(name), with_kwargs=True))
    replays = _Replays(tracer.flow, modules, names) if replay else None
    if replays is not None:
        tracer.flow.held = {StorageWeakRef(t.untyped_storage()) for m in model.modules()
                            for t in [*m._buffers.values(), *vars(m).values()]
                            if isinstance(t, torch.Tensor) and not isinstance(t, nn.Parameter)}
    start = [(mode, mode.replay_state()) for mode in _active_modes()]
    tracer.flow.produce(inputs, -1.0)
    try:
        with tracer.flow.recorded(), replays or contextlib.nullcontext():
            output = model(*inputs)
    finally:
        for h in handles:
            h.remove()
    # The loss consumes the output on the last stage: nothing to send.
    del output
    if replays is not None and replays.used and tracer.flow.unborn_late:  # a twin may have let a tensor out unseen
        for mode, state in start:
            mode.restore_replay_state(state)
        return _trace_once(model, inputs, names, replay=False)
    return UnitTrace(
        units=tracer.order,
        tensors=tracer.tensors(),
        unused=[n for n in names if n not in tracer.positions],
        repeated_calls=[n for n, c in tracer.calls.items() if c > 1 and n in tracer.positions],
        unit_inputs=tracer.unit_inputs,
        joined=[(tracer.order[a], tracer.order[b]) for a, b in joined_units(tracer.flow.late, tracer.flow.late_reach)
                if b < len(tracer.order)]
        + [(tracer.order[a], tracer.order[b]) for a, b in
           repeated_spans([int(tracer.positions[n]) for n in tracer.sequence], len(tracer.order))],
        float_fed=tracer.flow.float_fed(),
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


def tied_units(model: nn.Module, units: list[str]) -> list[tuple[str, ...]]:
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
