"""Tensor data flow between units, keyed the way planner/units.py keys it, for pipeline cuts.

A tensor made outside a unit's internals gets a key (position, ordinal): position -1 is the
model input, i the output of unit i, i + 0.5 the glue code after unit i (which runs in the
stage of unit i + 1); the ordinal counts new tensors made at that position. `Flow` is one
`TorchFunctionMode` with two uses: recording consumers on a meta run (`trace_layout`, which
gives every cut's crossing set) and replaying one stage (runtime/pp_split.py), where the same
code makes the same keys in the same order, so a received tensor can stand in for its key.

Tensors no visible op made. Some glue makes tensors below the reach of a function mode:
`torch.vmap` returns its result by unwrapping a batched tensor in C++ (transformers 4.x builds
its attention masks so), and a tensor may come from module state. Such a tensor is keyed
when glue or a unit first consumes it ("late"), at the position where it was really made: the
meta trace watches every aten op under a dispatch mode (`_Births`) and takes the position of
the op that made the tensor's storage (the glue position of that consumption if none did).
The trace lists late keys in the order it assigned them (`CutLayout.late`); a replay, running
the same code, assigns the same keys in the same order. A late tensor a stage receives is a
meta stand-in in its replay that the model's own variables still hold, so the received
tensor replaces it at every consumption (`Flow.stand_ins`). A meta tensor that reaches the
stage's own code anyway (torch's shape inference runs a stage on uninitialised tensors, and
glue that reads them may take another path) is replaced by its exact value when the replay
knows it, and refused otherwise: real code must never compute on memory that does not exist.
"""

from __future__ import annotations

import contextlib
import copy
import functools
from collections import Counter, defaultdict
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_unflatten

from planner.errors import PlannerError
from planner.meta_values import KnownValues, model_line
from planner.plan import Plan

Key = tuple[float, int]
"""(position, ordinal): position -1 model input, i unit i's output, i + 0.5 glue after unit i."""
INPUT = -1.0


class StopStage(Exception):
    """Raised at the first code of a later stage: this stage's outputs are all made."""


@dataclass
class CutLayout:
    """Where the plan cuts the model and which tensors cross each cut (one meta trace)."""

    units: list[str]
    """Unit FQNs in execution order."""
    unit_stage: list[int]
    """Stage index of each unit."""
    num_stages: int
    crossings: list[list[Key]] = field(default_factory=list)
    """crossings[k]: keys of the tensors sent from stage k to k + 1, sorted."""
    traced: dict[Key, tuple[torch.dtype, tuple[int, ...]]] = field(default_factory=dict)
    """dtype and shape (at the trace's batch size) of every crossing tensor."""
    late: list[Key] = field(default_factory=list)
    """Keys of tensors no visible op made, in the order the trace assigned them (module docstring)."""
    known: dict[Key, torch.Tensor] = field(default_factory=dict)
    """Exact values (cpu) of the crossing tensors the trace could know (position ids, masks made
    from the batch's shape): a stage fed placeholders gives them to its glue (runtime/pp_split.py)."""

    def stage_of(self, position: float) -> int:
        """The stage that runs code at `position`; glue after unit i runs with unit i + 1."""
        if position < 0:
            return 0
        index = int(position + 0.5) if position % 1 else int(position)
        return self.unit_stage[min(index, len(self.units) - 1)]


def to_meta(t: torch.Tensor) -> torch.Tensor:
    return t if t.is_meta else t.detach().to("meta")


class Flow(TorchFunctionMode):
    """Numbers tensors made outside units (as planner/units.py's tracer does) and either
    records their consumers (`stage` None) or replays stage `stage` of `layout`."""

    def __init__(self, layout: CutLayout | None = None, stage: int | None = None, received: dict[Key, torch.Tensor] | None = None,
                 device: torch.device | None = None):
        super().__init__()
        self.layout, self.stage, self.received = layout, stage, received or {}
        self.device = device
        """Where this stage computes; None: on meta (torch's shape inference may run a stage so)."""
        self.depth = 0
        self.suspended = False
        """True while a unit runs: the mode is off the stack, so the unit's ops run at full speed."""
        self.glue = -0.5
        self.keys: dict[int, Key] = {}
        self.values: dict[Key, torch.Tensor] = {}
        self.ordinals: Counter = Counter()
        self.consumers: dict[Key, set[float]] = defaultdict(set)
        self.order: list[int] = []
        self._known_values: KnownValues | None = None
        self.stand_ins: dict[int, torch.Tensor] = {}
        """id of a late tensor's meta stand-in -> the received tensor that replaces it."""
        self.late: list[Key] = layout.late if layout is not None and not self.recording else []
        self.late_index = 0
        self.births: dict[StorageWeakRef, float] = {}
        """Recording: storage -> glue position of the aten op that made it (`_Births`)."""
        self._alive: list[torch.Tensor] = []
        """Tensors whose ids or storages are keys above: kept alive so no new object reuses them."""

    @property
    def known_values(self) -> KnownValues:
        """Values of the meta tensors an earlier stage's glue makes, where they can be known
        (made on first use: most stages' glue never needs one)."""
        if self._known_values is None:
            # Exact values only: a sampled one could steer this stage's glue down another path
            # than the trace and stage 0 took, and the tensor keys would no longer agree.
            self._known_values = KnownValues(sample=False)
        return self._known_values

    @property
    def recording(self) -> bool:
        return self.stage is None

    def produce(self, obj, position: float):
        """Key the new tensors in `obj`; a received crossing tensor replaces its stand-in."""
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
                self.values[key] = t  # also keeps the object alive, so ids stay unique
        return tree_unflatten(flat, spec) if changed else obj

    def consume(self, obj, position: float) -> None:
        for t in tree_flatten(obj)[0]:
            key = self.keys.get(id(t)) if isinstance(t, torch.Tensor) else None
            if key is not None:
                self.consumers[key].add(position)

    def key_late(self, obj, own: bool):
        """`obj` with its late tensors keyed and received ones in place of their stand-ins
        (module docstring). `own`: code of the stage being replayed consumes `obj`, so a meta
        tensor in it must become a real one (`_materialise`)."""
        with torch._C.DisableTorchFunction():  # reading `t.is_meta` here is not the model's code
            return self._key_late_in(obj, own)

    def _key_late_in(self, obj, own: bool):
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
            if own and self.device is not None and flat[i].is_meta:
                flat[i], changed = self._materialise(flat[i]), True
        return tree_unflatten(flat, spec) if changed else obj

    def _materialise(self, t: torch.Tensor) -> torch.Tensor:
        """A meta tensor this stage's own code consumes: an earlier stage's glue made it in this
        replay and the trace saw no crossing for it (torch's shape inference feeds a stage
        uninitialised tensors, and glue reading them, such as a check for packed position ids,
        may make a tensor the real run does not). Its exact value, when the replay knows it."""
        value = self._known_values.values.get(t) if self._known_values is not None else None
        if value is None or t in self._known_values.sampled:
            raise PlannerError(
                f"Pipeline stage {self.stage}'s code at {model_line()} uses a tensor of shape {tuple(t.shape)} that "
                "an earlier stage's code made where the tracer could not see it, so its value is unknown here.",
                "Run this model without pipeline parallelism (--pp 1), or make that tensor in the stage that uses it.",
            )
        real = self.stand_ins[id(t)] = value.to(self.device)
        self._alive.append(t)
        return real

    def _key_late(self, t: torch.Tensor) -> torch.Tensor:
        if self.recording:
            try:
                position = self.births.get(StorageWeakRef(t.untyped_storage()), self.glue)
            except (RuntimeError, NotImplementedError):  # no storage (a vmap batched tensor's wrapper)
                position = self.glue
            key = (position, self.ordinals[position])
            self.late.append(key)
        else:
            if self.late_index >= len(self.late):
                raise PlannerError(
                    f"Pipeline stage {self.stage}'s forward used more tensors made outside the tracer's view than the "
                    "meta trace did: the forward does not run the same code on every call.",
                    "Run this model without pipeline parallelism (--pp 1).",
                )
            key = self.late[self.late_index]
            self.late_index += 1
            if key in self.values:  # this call made more tensors before it than the trace did
                raise PlannerError(
                    f"Pipeline stage {self.stage}: the model's forward made different tensors at {model_line()} on this "
                    "call than in the planner's trace (code that caches tensors across calls does this), so the "
                    "stage cannot tell which tensors to send.",
                    "Run this model without pipeline parallelism (--pp 1).",
                )
        self.ordinals[key[0]] = max(self.ordinals[key[0]], key[1] + 1)
        self.keys[id(t)] = key
        self._alive.append(t)
        if key in self.received:
            self.stand_ins[id(t)] = t = self.received[key]
            self.keys[id(t)] = key
        self.values[key] = t
        return t

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.depth > 0:  # inside a unit: its internals are the unit's business
            return func(*args, **kwargs)
        position = self.glue
        if self.recording:
            args, kwargs = self.key_late((args, kwargs), own=False)
            self.consume((args, kwargs), position)
        else:
            stage = self.layout.stage_of(position)
            args, kwargs = self.key_late((args, kwargs), own=stage == self.stage)
            if stage > self.stage:
                raise StopStage
            if stage < self.stage:  # an earlier stage's glue: shapes only, the values arrive by p2p
                # On meta, but with the values it can know (received tensors such as position
                # ids, and what follows from them): glue may read them, as mask code does.
                values = self.known_values
                args, kwargs = values.to_meta((args, kwargs))
                with values:
                    return self.produce(func(*args, **kwargs), position)
        return self.produce(func(*args, **kwargs), position)

    # A unit's internals are not numbered, so while one runs the mode steps off torch's
    # function-mode stack: its ops then pay no Python dispatch (a TorchFunctionMode costs a few
    # microseconds per op, which is most of a small stage's overhead on CPU).
    def _suspend(self) -> None:
        depth = torch._C._len_torch_function_stack()
        if not self.suspended and depth and torch._C._get_function_stack_at(depth - 1) is self:
            torch._C._pop_torch_function_stack()
            self.suspended = True

    def _resume(self) -> None:
        if self.suspended:
            torch._C._push_on_torch_function_stack(self)
            self.suspended = False

    def __exit__(self, exc_type, exc_value, traceback):
        self._resume()  # a unit that raised left the mode off the stack
        return super().__exit__(exc_type, exc_value, traceback)

    def enter_unit(self, index: int, args, kwargs):
        """Unit `index` is called (its pre-hook, runtime/pp_flow.py's UnitHooks); replacement
        (args, kwargs) when a received tensor stands in for one of them, else None."""
        new = None
        if self.depth == 0:
            if self.recording:
                self.order.append(index)
                new = self.key_late((args, kwargs), own=False)
                self.consume(new, float(index))
            else:
                stage = self.layout.unit_stage[index]
                new = self.key_late((args, kwargs), own=stage == self.stage)
                if stage > self.stage:
                    raise StopStage
            self._suspend()
        self.depth += 1
        return new if new is not None and new is not (args, kwargs) else None

    def leave_unit(self, index: int, output):
        """Unit `index` returned `output`; a replacement output, or None to keep it."""
        self.depth -= 1
        if self.depth == 0:
            self._resume()
            self.glue = index + 0.5
            new = self.produce(output, float(index))
            return new if new is not output else None
        return None


class UnitHooks:
    """Hooks on every unit, installed once, that report to the active `Flow` (if any).

    Installed once rather than per forward (registering hooks costs about as much as a small
    unit's Python work), and after TP, FSDP and checkpoint wrappers replaced the units, so
    the modules hooked are the ones that run. Outside `active(flow)` they do nothing, so an
    activation-checkpoint recompute or a plain call of a unit is unaffected. The pre-hook is
    prepended so depth rises before other pre-hooks (FSDP's all-gather) run: their tensor
    ops must not be numbered as glue. The post-hook runs last so it sees the output after
    TP's output hooks.
    """

    def __init__(self, root: nn.Module, units: list[str]):
        self.flow: Flow | None = None
        self.handles = []
        for index, name in enumerate(units):
            module = root.get_submodule(name)
            self.handles.append(module.register_forward_pre_hook(functools.partial(self._pre, index), with_kwargs=True, prepend=True))
            self.handles.append(module.register_forward_hook(functools.partial(self._post, index), with_kwargs=True))

    def _pre(self, index: int, module, args, kwargs):
        return self.flow.enter_unit(index, args, kwargs) if self.flow is not None else None

    def _post(self, index: int, module, args, kwargs, output):
        return self.flow.leave_unit(index, output) if self.flow is not None else None

    @contextlib.contextmanager
    def active(self, flow: Flow):
        """`flow` numbers and replays while inside (the mode entered, the hooks reporting to it)."""
        self.flow = flow
        try:
            with flow:
                yield flow
        finally:
            self.flow = None

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def trace_layout(model: nn.Module, plan: Plan, example_inputs: tuple) -> CutLayout:
    """One meta forward of `model`: unit order and the crossing set of every cut."""
    units = [u for s in plan.stages for u in s.units]
    unit_stage = [k for k, s in enumerate(plan.stages) for _ in s.units]
    layout = CutLayout(units, unit_stage, len(plan.stages))
    meta_model = model if all(p.is_meta for p in model.parameters()) else copy.deepcopy(model).to("meta")
    flow = Flow()
    values = KnownValues()
    inputs = flow.produce(values.to_meta(tuple(example_inputs)), INPUT)
    hooks = UnitHooks(meta_model, units)
    try:
        with values, _Births(flow), hooks.active(flow), torch.no_grad():
            meta_model(*inputs)
    finally:
        hooks.remove()
    if flow.order != list(range(len(units))):
        seen = [units[i] for i in flow.order]
        raise PlannerError(
            f"The model's forward calls its units as {seen[:8]}..., not once each in the plan's order {units[:8]}...: "
            "a pipeline needs each unit called once, in order.",
            "Re-solve the plan for this model, or run it without pipeline parallelism (--pp 1).",
        )
    for k in range(layout.num_stages - 1):
        layout.crossings.append(sorted(
            key for key, users in flow.consumers.items()
            if layout.stage_of(key[0]) <= k < max(layout.stage_of(u) for u in users)
        ))
    layout.late = flow.late
    layout.known = {key: values.values[flow.values[key]] for keys in layout.crossings for key in keys
                    if flow.values[key] in values.values and flow.values[key] not in values.sampled}
    layout.traced = {key: (flow.values[key].dtype, tuple(flow.values[key].shape)) for keys in layout.crossings for key in keys}
    return layout


class _Births(TorchDispatchMode):
    """Records, for the meta trace, the glue position at which each storage was made."""

    def __init__(self, flow: Flow):
        super().__init__()
        self.flow = flow

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        with torch._C.DisableTorchFunction():  # its own work, not the model's code (meta_values.py)
            out = func(*args, **(kwargs or {}))
            if self.flow.depth == 0:
                for t in tree_flatten(out)[0]:
                    if isinstance(t, torch.Tensor) and t.is_meta:
                        self.flow.births.setdefault(StorageWeakRef(t.untyped_storage()), self.flow.glue)
                        self.flow._alive.append(t)
        return out
