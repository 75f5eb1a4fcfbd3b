"""Pipeline cuts over the planner's data flow: which tensors cross each cut, and stage replay.

planner/units.py `DataFlow` numbers every tensor made outside a unit's internals by (position,
ordinal): position -1 is the model input, i the output of unit i, i + 0.5 the glue code after
unit i (which runs in the stage of unit i + 1). The profiler traces units with it; here `Flow`
extends it to the pipeline's two uses: recording consumers on a meta run (`trace_layout`, which
gives every cut's crossing set) and replaying one stage (runtime/pp_split.py), where the same
code makes the same keys in the same order, so a received tensor can stand in for its key.

Tensors no visible op made (a `torch.vmap` result, module state) are keyed when first consumed
(`DataFlow` explains how). A late tensor a stage receives is a meta stand-in in its replay that
the model's own variables still hold, so the received tensor replaces it at every consumption
(`stand_ins`). A meta tensor that reaches the stage's own code anyway (torch's shape inference
runs a stage on uninitialised tensors, and glue that reads them may take another path) is
replaced by its exact value when the replay knows it, and refused otherwise: real code must
never compute on memory that does not exist.

Replaying an earlier stage's glue on the meta device with the values it can know costs far
more than running it: Hugging Face's mask code is about fifty small ops, each through the
value tracker, 8-10 ms a micro-batch on CPU for a stage behind Llama's embedding, against 2 ms
for the first stage's whole forward. Every micro-batch replays the same code on inputs of the
same shapes, so a stage keeps what its earlier glue returned the first time (`GlueReplay`) and
hands it back while each op, and what it reads, is the same as then.
"""

from __future__ import annotations

import contextlib
import copy
import functools
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils._pytree import TreeSpec, tree_flatten, tree_unflatten

from planner.errors import PlannerError
from planner.meta_values import KnownValues, model_line
from planner.plan import Plan
from planner.units import DataFlow, Key, StorageBirths, joined_units, repeated_spans

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
    float_fed: set[int] = field(default_factory=set)
    """Units that consume a floating-point tensor (an embedding of token ids does not)."""
    trained: set[int] = field(default_factory=set)
    """Units holding a parameter that requires grad."""
    known: dict[Key, torch.Tensor] = field(default_factory=dict)
    """Exact values (cpu) of the crossing tensors the trace could know (position ids, masks made
    from the batch's shape): a stage fed placeholders gives them to its glue (runtime/pp_split.py)."""

    def stage_at(self, position: float) -> int:
        """The stage that runs code at `position`; glue after unit i runs with unit i + 1."""
        if position < 0:
            return 0
        index = int(position + 0.5) if position % 1 else int(position)
        return self.unit_stage[min(index, len(self.units) - 1)]


def to_meta(t: torch.Tensor) -> torch.Tensor:
    return t if t.is_meta else t.detach().to("meta")


_MISS = object()
_CHECKED_VALUES = 1 << 16
"""Elements of a real tensor earlier glue may read for its result still to be reused (a received
tensor's values, such as position ids: packed sequences change them from one micro-batch to
the next). A larger one turns the reuse off."""


class GlueReplay:
    """What one stage's replay of earlier stages' glue returned, op by op, on its first forward,
    and the values known of it: later forwards take the results back instead of running the
    ops on meta (module docstring).

    An op's result is taken back only if it is the same op at the same place in the sequence,
    reading the same things: each meta tensor the same one by its key in the flow (or the same
    object: a parameter or buffer), each real tensor equal in value, every other argument
    equal. Otherwise the reuse is off from that op on, for good, and the replay runs the ops as
    before. Glue writing in place (its tensors would carry the first forward's writes) is never
    reused. Not used while torch infers shapes (uninitialised inputs) or with no device."""

    def __init__(self) -> None:
        self.known_values = KnownValues(sample=False)
        """Values of the earlier glue's meta tensors, kept with them across forwards."""
        self.ops: list[tuple] = []
        """(op, signature of what it read, its result) in the order the first forward ran them."""
        self.recorded = False
        """The first forward ran to its end: `ops` is complete."""
        self.usable = True
        self.reused = 0
        """Ops whose result was taken back (tests, benchmarks)."""

    @staticmethod
    def signature(flow: "Flow", flat: list, spec) -> tuple | None:
        """What an op reads (its flattened arguments), comparable across forwards; None where it
        cannot be compared."""
        parts: list = [spec]
        for x in flat:
            if isinstance(x, torch.Tensor):
                key = flow.keys.get(id(x))
                if x.is_meta:
                    parts.append(("key", key) if key is not None else ("object", x))  # held: its id stays its own
                elif x.numel() <= _CHECKED_VALUES:
                    parts.append(("value", x.detach().to("cpu", copy=True)))
                else:
                    return None
            else:
                parts.append(("leaf", x))
        return tuple(parts)

    @staticmethod
    def same(a: tuple, b: tuple) -> bool:
        """Whether two signatures read the same things."""
        if len(a) != len(b) or a[0] != b[0]:
            return False
        for x, y in zip(a[1:], b[1:], strict=True):
            if x[0] != y[0]:
                return False
            if x[0] == "value":
                if x[1].dtype != y[1].dtype or x[1].shape != y[1].shape or not torch.equal(x[1], y[1]):
                    return False
            elif x[0] == "leaf":
                try:
                    if x[1] is not y[1] and not bool(x[1] == y[1]):
                        return False
                except Exception:  # an argument that cannot be compared
                    return False
            elif x[0] == "object":
                if x[1] is not y[1]:
                    return False
            elif x[1] != y[1]:
                return False
        return True

    def take(self, flow: "Flow", func, args, kwargs):
        """The recorded result of this op (the flow's `glue_index`-th), or _MISS (reuse off)."""
        index = flow.glue_index
        if index < len(self.ops):
            op, read, out = self.ops[index]
            flat, spec = tree_flatten((args, kwargs))
            # (`==`: a property's getter is a new object at each access)
            now = self.signature(flow, flat, spec) if op is func or op == func else None
            if now is not None and self.same(read, now):
                flow.glue_index += 1
                self.reused += 1
                if not isinstance(out, _Rebuilt):
                    return out
                return tree_unflatten([flat[x.index] if isinstance(x, _Argument) else x for x in out.leaves], out.spec)
        self.usable = False
        return _MISS

    def record(self, flow: "Flow", func, args, kwargs, out) -> None:
        """Keep this op's result (the first forward's); glue that writes turns the reuse off."""
        name = getattr(func, "__name__", "")
        writes = (name.endswith("_") and not name.endswith("__")) or name == "__setitem__" \
            or (name.startswith("__i") and name.endswith("__")) or "out" in kwargs
        flat, spec = tree_flatten((args, kwargs))
        read = None if writes else self.signature(flow, flat, spec)
        if read is None:
            self.usable = False
            return
        # A result that is one of the op's own arguments (`.to` a dtype it has) is that argument
        # on every forward: recorded as its place among them.
        inputs = [id(x) for x in flat]
        leaves, out_spec = tree_flatten(out)
        if any(isinstance(x, torch.Tensor) and id(x) in inputs for x in leaves):
            out = _Rebuilt([_Argument(inputs.index(id(x))) if isinstance(x, torch.Tensor) and id(x) in inputs else x
                            for x in leaves], out_spec)
        self.ops.append((func, read, out))
        flow.glue_index += 1


@dataclass(frozen=True)
class _Argument:
    """In a recorded result: the op's `index`-th flattened argument."""

    index: int


@dataclass(frozen=True)
class _Rebuilt:
    """A recorded result holding some of its op's arguments (`_Argument`), rebuilt on reuse."""

    leaves: list
    spec: TreeSpec


class Flow(DataFlow):
    """The pipeline's `DataFlow` (planner/units.py: the profiler numbers tensors with the same
    class): records the cut layout (`stage` None) or replays stage `stage` of `layout`."""

    def __init__(self, layout: CutLayout | None = None, stage: int | None = None, received: dict[Key, torch.Tensor] | None = None,
                 device: torch.device | None = None, glue: GlueReplay | None = None):
        super().__init__()
        self.glue_replay = glue if glue is not None and glue.usable and device is not None else None
        """The stage's record of its earlier glue (`GlueReplay`), while it may be used."""
        self.glue_index = 0
        """Earlier-glue ops this forward has run (the next one's place in the record)."""
        self.layout, self.stage = layout, stage
        self.received = received or {}
        self.device = device
        """Where this stage computes; None: on meta (torch's shape inference may run a stage so)."""
        self.suspended = False
        """True while a unit runs: the mode is off the stack, so the unit's ops run at full speed."""
        self.order: list[int] = []
        self._known_values: KnownValues | None = None
        self.late = list(layout.late) if layout is not None and not self.recording else []
        self.late_index = 0
        if self.glue_replay is not None:
            self._known_values = self.glue_replay.known_values

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

    def _own(self, t: torch.Tensor) -> torch.Tensor:
        return self._materialise(t) if self.device is not None and t.is_meta else t

    def _materialise(self, t: torch.Tensor) -> torch.Tensor:
        """A meta tensor this stage's own code consumes: an earlier stage's glue made it in this
        replay and the trace saw no crossing for it (torch's shape inference feeds a stage
        uninitialised tensors, and glue reading them, such as a check for packed position ids,
        may make a tensor the real run does not). Its exact value, when the replay knows it."""
        known = self._known_values
        value = known.values.get(t) if known is not None else None
        if known is None or value is None or t in known.sampled:
            raise PlannerError(
                f"Pipeline stage {self.stage}'s code at {model_line()} uses a tensor of shape {tuple(t.shape)} that "
                "an earlier stage's code made where the tracer could not see it, so its value is unknown here.",
                "Run this model without pipeline parallelism (--pp 1), or make that tensor in the stage that uses it.",
            )
        real = self.stand_ins[id(t)] = value.to(self.device)
        self._alive.append(t)
        return real

    def _next_late_key(self) -> Key:
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
        return key

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if self.recording or self.depth > 0:
            return super().__torch_function__(func, types, args, kwargs)
        kwargs = kwargs or {}
        position = self.glue
        stage = self.layout.stage_at(position)
        args, kwargs = self.key_late((args, kwargs), own=stage == self.stage)
        if stage > self.stage:
            raise StopStage
        if stage < self.stage:  # an earlier stage's glue: shapes only, the values arrive by p2p
            # On meta, but with the values it can know (received tensors such as position
            # ids, and what follows from them): glue may read them, as mask code does.
            replay = self.glue_replay
            if replay is not None and replay.recorded:
                out = replay.take(self, func, args, kwargs)
                if out is not _MISS:
                    return self.produce(out, position)
                self.glue_replay = None  # the rest of this forward runs its ops (with the values kept)
            values = self.known_values
            meta_args, meta_kwargs = values.to_meta((args, kwargs))
            with values:
                out = func(*meta_args, **meta_kwargs)
            if replay is not None and not replay.recorded:
                replay.record(self, func, args, kwargs, out)
                if not replay.usable:
                    self.glue_replay = None
            return self.produce(out, position)
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
        """Unit `index` is called (its pre-hook, `UnitHooks`); replacement (args, kwargs) when a
        received tensor stands in for one of them, else None."""
        if self.recording:
            if self.depth == 0:
                self.order.append(index)
            return self.enter(float(index), args, kwargs)
        new = None
        if self.depth == 0:
            assert self.layout is not None and self.stage is not None, "a replay has a layout and a stage"
            stage = self.layout.unit_stage[index]
            new = self.key_late((args, kwargs), own=stage == self.stage)
            if stage > self.stage:
                raise StopStage
            self._suspend()
        self.depth += 1
        return new if new is not None and new is not (args, kwargs) else None

    def leave_unit(self, index: int, output):
        """Unit `index` returned `output`; a replacement output, or None to keep it."""
        if self.depth == 1:
            self._resume()
        return self.leave(float(index), output)


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
        with values, StorageBirths(flow), hooks.active(flow), torch.no_grad():
            meta_model(*inputs)
    finally:
        hooks.remove()
    if list(dict.fromkeys(flow.order)) != list(range(len(units))):
        seen = [units[i] for i in flow.order]
        raise PlannerError(
            f"The model's forward calls its units as {seen[:8]}..., not in the plan's order {units[:8]}...: "
            "a pipeline needs the units first called in its order.",
            "Re-solve the plan for this model, or run it without pipeline parallelism (--pp 1).",
        )
    for k in range(layout.num_stages - 1):
        layout.crossings.append(sorted(
            key for key, users in flow.consumers.items()
            if layout.stage_at(key[0]) <= k < max(layout.stage_at(u) for u in users)
        ))
    layout.late = flow.late
    layout.float_fed = flow.float_fed()
    layout.trained = {i for i, name in enumerate(units) if any(p.requires_grad for p in meta_model.get_submodule(name).parameters())}
    check_unsplit(layout, joined_units(flow.late, flow.late_reach))
    check_unsplit(layout, repeated_spans(flow.order, len(units)),
                  "the model calls the first more than once, and each call must run in the stage that holds it")
    layout.known = {key: values.values[flow.values[key]] for keys in layout.crossings for key in keys
                    if flow.values[key] in values.values and flow.values[key] not in values.sampled}
    layout.traced = {key: (flow.values[key].dtype, tuple(flow.values[key].shape)) for keys in layout.crossings for key in keys}
    return layout


def check_unsplit(layout: CutLayout, runs: list[tuple[int, int]],
                  why: str = "the model makes a tensor there that no tracer sees being made (a torch.vmap result, "
                             "such as transformers 4.x's attention mask), which only the stage that first uses it "
                             "can send") -> None:
    """Refuse a cut inside a run of units one stage must hold (planner/units.py `joined_units`,
    `repeated_spans`), saying `why`."""
    for first, last in runs:
        if len({layout.unit_stage[i] for i in range(first, min(last, len(layout.units) - 1) + 1)}) > 1:
            raise PlannerError(
                f"The plan cuts the pipeline between {layout.units[first]} and "
                f"{layout.units[min(last, len(layout.units) - 1)]}, but {why}.",
                "Re-profile and re-solve (the solver keeps those units in one stage), or move the cut.",
            )
