"""Cutting a model into pipeline stages at the plan's unit boundaries, skip connections included.

Approach: *replay the model's own forward, restricted to one stage.* A stage module is the
original model object (deep-copied per chunk) whose units outside the stage are replaced by
parameter-free stubs, and whose `forward` runs the original `forward` under a
`TorchFunctionMode` that numbers every tensor made between units exactly as
`planner/units.py` does: a tensor is keyed by (position, ordinal), position -1 the model
input, i the output of unit i, i + 0.5 the "glue" code after unit i (which belongs to the
stage of unit i + 1). One meta-device run at build time records, per key, who consumes it,
hence the crossing set of every cut (skip connections cross several). At run time stage k:

- runs its own units and glue on real tensors;
- runs the units and glue of earlier stages on the meta device (stubs hold a meta copy of
  the unit, not registered, so it owns no parameters): this costs no FLOPs and yields
  outputs of the right structure, and every crossing tensor among them is replaced by the
  real one received from stage k - 1 as soon as it is made;
- stops (an exception) at the first code of a later stage and returns, in key order, every
  tensor that crosses the cut after it; tensors it only passes on (a U-Net skip from stage
  k - 2) go out through an identity autograd node, so their gradients flow back unchanged.

Why this and not the alternatives:
- torch's tracer frontend `pipeline()` (torch.export) runs each stage as a traced graph
  with its shapes fixed at trace time, not as the model's eager modules: `parallelize_module`
  addresses modules by FQN and expects their code to run (GPT's `view(b, s, -1, head_dim)`
  is what lets colwise-sharded heads work), so TP would have to come before tracing, and
  FSDP, activation checkpointing and checkpoints would need a name mapping. Here the
  model's eager code runs and the stage module keeps the model's own FQNs.
- torchtitan's pruning (`del model.layers[i]`, forward written to skip `None`) needs the
  model's cooperation; any model file must work here, and skip connections are invisible
  to it.

Cost: per micro-batch, a stage re-runs the glue of earlier stages on meta tensors (Python
only) and looks up its stubs' cached meta outputs; the real work is only its own units.

Limits (each raises or is documented): the forward must call units in the plan's order and
each unit once (no weight sharing across calls); parameters owned by the root module (not
by a unit) are refused; glue of an earlier stage runs on
meta tensors, so it must not read tensor values (`.item()`, data-dependent control flow).
Python numbers derived from tensors (e.g. `b, s = idx.shape`) are recomputed from the
placeholder inputs, which therefore carry the micro-batch's shapes (`set_example_microbatch`).

Weights tied across stages (GPT-2's `wte` and `lm_head`) are held as Megatron-LM holds them
(Shoeybi et al. 2019; its "embedding group"): every stage with a unit of the tie keeps its own
copy under its own FQNs, initialised to the reference's value (runtime/build.py), and the
copies' gradients are summed over the pipeline ranks holding them before the optimizer step
(`cross_stage_ties` here, the groups in runtime/mesh.py, the sum in runtime/apply_dp.py), so
every copy takes the same step and they stay equal.
"""

from __future__ import annotations

import contextlib
import copy
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map_only, tree_unflatten

from planner.errors import PlannerError
from planner.meta_values import meta_autocast
from planner.plan import Plan
from planner.units import owned_parameters
from runtime.pp_flow import INPUT, CutLayout, Flow, GlueReplay, Key, StopStage, UnitHooks, to_meta
from runtime.pp_scatter import GatherFromGroup, ScatterToGroup, splits

_SAME = object()  # a _Stub's cache entry for a unit that returns its input


class _Stub(nn.Module):
    """Stands in for a unit another stage holds: outputs of the right structure, on meta.

    The meta copy sits in a tuple so it is not registered: the stage owns no parameters of
    it, and TP, FSDP and the optimizer never see it. Outputs are cached per input shapes
    (stages have static shapes), so a stage replays an earlier unit once, not per micro-batch.
    Each call returns new tensor objects over them (meta aliases, free): the replay keys
    tensors by object, and a unit called twice in one forward on the same shapes (T5's
    dropout, after its embedding and after its last norm) makes two tensors, of which the
    second may be the one a later stage receives.
    """

    def __init__(self, meta_unit: nn.Module):
        super().__init__()
        self._meta = (meta_unit,)
        self._cache: dict = {}

    def __getattr__(self, name: str):
        # The model's glue may read a unit's plain attributes (Hugging Face 4.x's Qwen3 reads each
        # layer's `attention_type` to pick its mask): the stub answers for the unit it stands in for.
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "_meta":
                raise
            return getattr(self._meta[0], name)

    def forward(self, *args, **kwargs):
        if not kwargs and len(args) == 1 and isinstance(args[0], torch.Tensor):  # the common case, without pytree's cost
            key = (tuple(args[0].shape), args[0].dtype)
            if key not in self._cache:
                with torch.no_grad(), meta_autocast():
                    given = to_meta(args[0])
                    out = self._meta[0](given)
                # A unit that returns its input (an in-place ReLU) returns it here too: the tensor
                # keeps the key it had (as in the trace), and a received one stays real.
                self._cache[key] = _SAME if out is given else out
            out = self._cache[key]
            return args[0] if out is _SAME else out.detach()
        args, kwargs = tree_map_only(torch.Tensor, to_meta, (args, kwargs))
        flat = tree_flatten((args, kwargs))[0]
        signature = tuple((tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else repr(x) for x in flat)
        if signature not in self._cache:
            with torch.no_grad(), meta_autocast():
                self._cache[signature] = self._meta[0](*args, **kwargs)
        return tree_map_only(torch.Tensor, torch.Tensor.detach, self._cache[signature])


def check_splittable(model: nn.Module, plan: Plan) -> None:
    """Refuse what stage modules cannot hold: root-owned parameters. (Weights tied across
    stages are held as copies: `cross_stage_ties`.)"""
    units = [u for s in plan.stages for u in s.units]
    root_owned = [name for name, _ in owned_parameters(model, units).get("", [])]
    if root_owned:
        raise PlannerError(
            f"Parameters {root_owned[:4]} belong to the model root, not to a unit, so no pipeline stage owns them.",
            "Move them into a submodule (a unit), or run without pipeline parallelism (--pp 1).",
        )


@dataclass(frozen=True)
class CrossStageTie:
    """One parameter of the model shared by units of several stages; each of them holds a copy."""

    names: tuple[str, ...]
    """The parameter's FQNs in the whole model, in `named_parameters(remove_duplicate=False)`
    order: names[0] is the one `named_parameters()` (the reference's saved parameters) keeps."""
    stages: tuple[int, ...]
    """Stages holding a copy, ascending; stages[0]'s copy is the one the gradient norm counts."""
    pp_ranks: tuple[int, ...]
    """Pipeline ranks holding those stages (looping placement: stage s on rank s % pp)."""

    def copies(self, chunks: list[tuple[int, nn.Module]]) -> list[tuple[int, nn.Parameter]]:
        """(stage, parameter) of every copy among this rank's chunks (one per chunk holding one)."""
        out = []
        for stage, module in chunks:
            held = dict(module.named_parameters(remove_duplicate=False))
            found = {id(held[n]): held[n] for n in self.names if n in held}
            out += [(stage, p) for p in found.values()]
        return out


def _unit_of(name: str, units: list[str]) -> str | None:
    """The unit holding parameter `name`, or None for a module no unit holds: one the forward
    never calls, whose weight the model reaches through a tied name (Hugging Face's T5 keeps
    its embedding as `shared` and calls it as `encoder.embed_tokens` and `decoder.embed_tokens`)."""
    return max((u for u in units if name.startswith(u + ".")), key=len, default=None)


def cross_stage_ties(model: nn.Module, plan: Plan) -> list[CrossStageTie]:
    """Parameters of the whole `model` that the plan's stages share (one entry per parameter)."""
    units = [u for s in plan.stages for u in s.units]
    stage_of_unit = {u: k for k, s in enumerate(plan.stages) for u in s.units}
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    ties = []
    for group in names.values():
        stages = sorted({stage_of_unit[u] for u in (_unit_of(n, units) for n in group) if u is not None})
        if len(stages) > 1:
            pp = plan.layout.pp_degree
            ties.append(CrossStageTie(tuple(group), tuple(stages), tuple(sorted({s % pp for s in stages}))))
    return ties

STAGE_SPEC = "_pp_stage"
"""The attribute of a stage module holding its StageSpec (`stage_spec`)."""


@dataclass
class StageSpec:
    """What a stage module needs to replay its part of the forward."""

    layout: CutLayout
    stage: int
    forward: Callable[..., Any]
    """The model class's own forward (unbound)."""
    placeholders: tuple
    """Meta stand-ins for the model inputs (stages > 0), shaped like one micro-batch."""
    forward_context: Callable[[], contextlib.AbstractContextManager] | None = None
    """Entered around the stage's forward (e.g. autocast for mixed precision), or None."""
    output_tree: tuple | None = None
    """Last stage with a structured output (a Hugging Face ModelOutput): its pytree spec and
    non-tensor leaves, to rebuild it for the loss (torch's stages pass tensors only)."""
    hooks: UnitHooks | None = None
    """Installed on the first forward (runtime/pp_flow.py)."""
    scatter_group: dist.ProcessGroup | None = None
    """Tensor-parallel process group whose ranks send crossing tensors as slices
    (runtime/pp_scatter.py), or None: every rank sends them whole."""
    shape_inference: bool = False
    """True while torch's pipeline infers the shapes crossing each cut by running the stage on
    uninitialised tensors (runtime/apply_pp.py): `_stage_forward` gives them sane values first."""
    split_backward: bool = False
    """The schedule runs this stage's backward as input gradients, then weight gradients (zero
    bubble): its outputs are always sent as copies (`_sendable`)."""
    glue: GlueReplay = field(default_factory=GlueReplay)
    """What the replay of earlier stages' glue returned on the first forward, reused after it
    (runtime/pp_flow.py `GlueReplay`)."""

    def sliced(self, key: Key) -> bool:
        """Whether crossing tensor `key` travels as this group's slices."""
        if self.scatter_group is None:
            return False
        dtype, shape = self.layout.traced[key]
        return splits(dtype, shape, dist.get_world_size(self.scatter_group))

    @property
    def in_keys(self) -> list[Key]:
        return self.layout.crossings[self.stage - 1] if self.stage > 0 else []

    @property
    def out_keys(self) -> list[Key]:
        return self.layout.crossings[self.stage] if self.stage < self.layout.num_stages - 1 else []


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the gradient contiguous.

    The gradient of a received tensor is sent back with gloo/NCCL, which need contiguous
    buffers, and torch sizes the receive buffer from the gradient's strides: a U-Net skip's
    gradient is a slice of `torch.cat`'s gradient (strided), and gloo refuses it.

    The forward copies: a stage may begin with an in-place op (ResNet's `ReLU(inplace=True)`
    after a cut at `bn1`), and autograd forbids writing in place into a view a custom
    Function returned. One copy of each received activation is cheap beside the stage.
    """

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


def _received(t):
    return _ContiguousGrad.apply(t) if isinstance(t, torch.Tensor) and t.requires_grad else t


def stage_spec(module: nn.Module) -> StageSpec:
    """The StageSpec `make_stage` gave a stage module (kept when FSDP2 swaps the module's class)."""
    spec = getattr(module, STAGE_SPEC, None)
    assert isinstance(spec, StageSpec), f"{type(module).__name__} is not a stage module (runtime/pp_split.py make_stage)"
    return spec


def _stage_forward(self: nn.Module, *args):
    spec = stage_spec(self)
    layout = spec.layout
    if spec.stage == 0:
        received, inputs = {}, model_inputs(spec.placeholders, args)
    else:
        if len(args) != len(spec.in_keys):
            raise RuntimeError(f"stage {spec.stage} got {len(args)} tensors, expected {len(spec.in_keys)}")
        if spec.shape_inference:
            _fill_placeholders(spec, args)
        received = {k: _received(GatherFromGroup.apply(t, spec.scatter_group) if spec.sliced(k) else t)
                    for k, t in zip(spec.in_keys, args, strict=False)}
        inputs = spec.placeholders
    if spec.hooks is None:  # first call: after TP, FSDP and recompute wrapped the units
        spec.hooks = UnitHooks(self, layout.units)
    device = next((t.device for t in args if isinstance(t, torch.Tensor) and not t.is_meta), None)
    glue = None if spec.shape_inference or spec.stage == 0 else spec.glue
    flow = Flow(layout, spec.stage, received, device=device, glue=glue)
    inputs = flow.produce(tuple(inputs), INPUT)
    output = None
    try:
        with spec.forward_context() if spec.forward_context else contextlib.nullcontext(), spec.hooks.active(flow):
            output = spec.forward(self, *inputs)
    except StopStage:
        pass
    except BaseException:
        spec.glue.usable = False  # a forward that failed recorded only part of its glue
        raise
    if flow.glue_replay is not None:
        flow.glue_replay.recorded = True
    if spec.stage == layout.num_stages - 1:
        assert output is not None, "the last stage must run to the end of forward"
        return _flatten_output(spec, output)
    missing = [k for k in spec.out_keys if k not in flow.values]
    assert not missing, f"stage {spec.stage} did not make crossing tensors {missing}"
    # A tensor only passed on is already a fresh autograd node (`_received`), so the schedule's
    # backward (autograd.grad w.r.t. the stage inputs) routes its gradient straight back.
    return tuple(_sendable(ScatterToGroup.apply(flow.values[k], spec.scatter_group) if spec.sliced(k) else flow.values[k],
                           copy=spec.split_backward) for k in spec.out_keys)


def schedule_inputs(inputs: tuple) -> tuple:
    """The tensors of the model's inputs, in order: what the first stage gets from torch's
    schedule, which passes tensors only (it splits them into micro-batches and refuses any
    other argument). `model_inputs` puts the rest back."""
    return tuple(x for x in tree_flatten(tuple(inputs))[0] if isinstance(x, torch.Tensor))


def model_inputs(template: tuple, tensors: tuple) -> tuple:
    """The model's inputs for one micro-batch: `template` (the placeholders, shaped like one
    micro-batch) with its tensors replaced, in order, by those the schedule passed, and its
    other leaves (a None for an optional argument, a number) kept: a Hugging Face T5 takes
    (input_ids, None, decoder_input_ids)."""
    leaves, tree = tree_flatten(tuple(template))
    passed = iter(tensors)
    return tuple(tree_unflatten([next(passed) if isinstance(x, torch.Tensor) else x for x in leaves], tree))


def _sendable(t: torch.Tensor, copy: bool = False) -> torch.Tensor:
    """A stage output as torch's schedules need it: contiguous (p2p sends), and not a view
    (the zero-bubble schedules `detach_()` a stage's outputs after its input-gradient pass,
    which autograd refuses on a view). A copy only for those that are not (few activations),
    or for every one with `copy` (zero bubble): that `detach_()` would also cut an output that
    an op of the stage saved for its weight gradient, which the later weight pass then cannot
    use (GoogLeNet cut inside an inception block: its input crosses the cut and feeds the
    stage's own branches' convolutions too)."""
    if (copy and t.requires_grad) or t._base is not None or not t.is_contiguous():
        return t.clone(memory_format=torch.contiguous_format)
    return t


_TENSOR = object()  # marks a tensor leaf in StageSpec.output_tree


def needs_full_backward(module: nn.Module) -> bool:
    """Whether this stage's backward must compute weight gradients together with input gradients.

    torch's zero-bubble schedules split a stage's backward into input gradients (B) and weight
    gradients (W), and find the weights for W through the autograd graph of the stage's inputs.
    A weight that graph does not reach gets no gradient: in a unit fed no floating-point tensor
    (GPT-2's position embedding in a stage of its own), or in any stage whose inputs carry no
    gradient (every earlier stage frozen). Such a stage runs its whole backward at B (correct, it
    only loses the split's scheduling freedom). The first stage is exempt: torch already runs it so."""
    spec = stage_spec(module)
    layout = spec.layout
    if spec.stage == 0:
        return False
    mine = [i for i, s in enumerate(layout.unit_stage) if s == spec.stage]
    earlier_trained = any(layout.unit_stage[i] < spec.stage for i in layout.trained)
    return not earlier_trained or any(i in layout.trained and i not in layout.float_fed for i in mine)


def _fill_placeholders(spec: StageSpec, args: tuple) -> None:
    """Values for the uninitialised tensors torch's shape inference feeds a later stage.

    Glue that reads a received tensor (a check for packed position ids, an embedding lookup of
    position ids) would otherwise branch, or index, on whatever memory held: a different path
    on each run and rank, or an index out of range. Each gets the value the trace knew for it
    (same shape), else zeros, so the inference takes the real run's path where it can and a
    deterministic one where it cannot. In place: torch keeps these tensors as the leaves it
    differentiates for the backward's shapes.
    """
    with torch.no_grad():
        for key, t in zip(spec.in_keys, args, strict=False):
            if not isinstance(t, torch.Tensor) or t.is_meta:
                continue
            known = spec.layout.known.get(key)
            if known is not None and tuple(known.shape) == tuple(t.shape):
                t.copy_(known)
            else:
                t.zero_()


def _flatten_output(spec: StageSpec, output):
    if isinstance(output, torch.Tensor) or (isinstance(output, tuple) and all(isinstance(t, torch.Tensor) for t in output)):
        return output
    leaves, tree = tree_flatten(output)
    spec.output_tree = (tree, [_TENSOR if isinstance(x, torch.Tensor) else x for x in leaves])
    return tuple(x for x in leaves if isinstance(x, torch.Tensor))


def restore_output(module: nn.Module, output):
    """The model's own output object from what the last stage module returned (for the loss)."""
    spec = stage_spec(module)
    if spec.output_tree is None:
        return output
    tree, template = spec.output_tree
    tensors = iter(output if isinstance(output, (tuple, list)) else (output,))
    return tree_unflatten([next(tensors) if x is _TENSOR else x for x in template], tree)


def make_stage(model: nn.Module, layout: CutLayout, stage: int, placeholders: tuple, forward_context=None,
               scatter_group=None, split_backward: bool = False) -> nn.Module:
    """A copy of `model` holding only `stage`'s units (same FQNs), running only its part."""
    chunk = copy.deepcopy(model)
    for name, stage_index in zip(layout.units, layout.unit_stage, strict=False):
        if stage_index == stage:
            continue
        parent_name, _, child = name.rpartition(".")
        parent = chunk.get_submodule(parent_name) if parent_name else chunk
        stub = _Stub(chunk.get_submodule(name).to("meta"))
        setattr(parent, child, stub)  # by name, in a Sequential too (DenseNet's are named: "transition1")
    # The original class's forward, fetched before anything (FSDP2) swaps the class.
    spec = StageSpec(layout, stage, type(model).forward, placeholders, forward_context, scatter_group=scatter_group,
                     split_backward=split_backward)
    setattr(chunk, STAGE_SPEC, spec)  # by name: torch types nn.Module.__setattr__ for tensors and modules only
    chunk.forward = types.MethodType(_stage_forward, chunk)
    return chunk


def set_example_microbatch(module: nn.Module, example_microbatch: tuple) -> None:
    """Placeholders shaped like one micro-batch (see the module docstring: Python shapes)."""
    stage_spec(module).placeholders = tree_map_only(torch.Tensor, to_meta, tuple(example_microbatch))
