"""Pipeline parallelism: the plan's stages as torch.distributed.pipelining stages and schedules.

Stage modules are cut by runtime/pp_split.py (the model's own forward replayed per stage,
so any model whose units the planner found can be cut, skip connections included, and
parameter FQNs stay the model's own). This file turns them into `PipelineStage`s and one
schedule object from torch, chosen by the plan (a schedule is data: torch builds the
per-rank action lists; we pick which):

    gpipe            -> ScheduleGPipe                   (one stage per rank)
    1f1b             -> Schedule1F1B                    (one stage per rank)
    interleaved-1f1b -> ScheduleInterleaved1F1B         (v stages per rank, looping)
    zero-bubble      -> ScheduleInterleavedZeroBubble   (v >= 1 stages per rank, looping)
    pipedream-2bw    -> Schedule1F1B                    (one stage per rank, for layouts the flush-free
                                                         executor of runtime/pp_async.py does not run: a
                                                         batch of PipeDream-2BW ordered as 1F1B's, flushed,
                                                         the older weights swapped in around it)

Placement: stage s lives on pipeline rank s % pp (planner/plan.py's `stage_ranks`, the
looping placement of Narayanan et al. 2021). ScheduleZBVZeroBubble needs the V placement
(rank r holds stages r and 2pp - 1 - r), which the plan's placement does not express, so
zero-bubble runs as ScheduleInterleavedZeroBubble (Qi et al. 2023's B/W split on looping
stages); torch's stage->rank map for it is the same `s % pp`.

Gradients: torch's schedules call `loss_fn` per micro-batch and, with `scale_grads=True`,
divide the accumulated gradients by the number of micro-batches, so for a mean-reduced
loss over equal micro-batches they equal the one-process gradient of the whole local batch.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import time
from collections.abc import Callable

import torch
import torch.distributed.pipelining.stage as torch_stage
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import (
    PipelineScheduleMulti,
    PipelineScheduleSingle,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    _PipelineSchedule,
)
from torch.distributed.pipelining.stage import _PipelineStageBase

from planner.errors import PlannerError
from planner.meta_values import Bfloat16Retry
from planner.plan import Plan, Schedule
from runtime.metrics import synchronize
from runtime.pp_flow import trace_layout
from runtime.pp_split import (
    check_splittable,
    make_stage,
    needs_full_backward,
    restore_output,
    schedule_inputs,
    set_example_microbatch,
    stage_spec,
)

# Keyed by the plan's schedule names (planner/plan.py `Schedule`), so a name the plan does not
# define is a type error here.
SINGLE_STAGE: dict[Schedule, type[PipelineScheduleSingle]] = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B,
                                                              "pipedream-2bw": Schedule1F1B}
"""Schedules that hold one stage per rank."""
MULTI_STAGE: dict[Schedule, type[PipelineScheduleMulti]] = {"interleaved-1f1b": ScheduleInterleaved1F1B,
                                                            "zero-bubble": ScheduleInterleavedZeroBubble}
"""Schedules that take a list of (looping-placed) stages per rank."""


def stage_indices(plan: Plan, pp_rank: int) -> list[int]:
    """Stages on pipeline rank `pp_rank` (looping placement, planner/plan.py)."""
    return [s for s in range(len(plan.stages)) if s % plan.layout.pp_degree == pp_rank]


def build_stage_modules(model: nn.Module, plan: Plan, pp_rank: int, example_inputs: tuple,
                        forward_context: Callable[[], contextlib.AbstractContextManager] | None = None,
                        scatter_group=None) -> list[tuple[int, nn.Module]]:
    """This rank's stage chunks, each a copy of `model` holding only its units (same FQNs).

    `model` is best on the meta device (copies are free); `example_inputs` may have any batch
    size (only used to trace which tensors cross each cut). Materialise, TP, recompute and
    FSDP the returned modules afterwards, by the model's own parameter names.
    `forward_context` (e.g. `lambda: torch.autocast(...)`) is entered around each stage's
    forward, since torch's schedule calls the stage module directly. `scatter_group`: the
    tensor-parallel group when the plan sends activations as slices (runtime/pp_scatter.py).
    """
    check_splittable(model, plan)
    layout = trace_layout(model, plan, example_inputs)
    split = plan.layout.schedule == "zero-bubble"  # torch's B/W split: each stage's outputs sent as copies
    return [(s, make_stage(model, layout, s, tuple(example_inputs), forward_context, scatter_group, split_backward=split))
            for s in stage_indices(plan, pp_rank)]


ACTION_KIND = {"forward_one_chunk": "F", "backward_one_chunk": "BW", "backward_weight_one_chunk": "W"}
"""torch's PipelineStage methods -> action kinds of planner/cost/simulator.py (B: input-gradient only)."""


class PipelineRunner:
    """One optimizer step's forward and backward through the plan's schedule on this rank.

    Each action torch's schedule runs on a stage is timed (forward, full backward, or
    zero-bubble's input- and weight-gradient halves): summed per stage for `stage_times`, and
    kept one by one in `events` for a measured Gantt chart. The p2p waits happen between
    actions, so they show as gaps. On CUDA each action synchronises the device at both ends
    so that its time is the kernels', not the launches' (it serialises a little of what
    would overlap: a measurement of the stages, not of the step).
    """

    def __init__(self, schedule, stages: list[PipelineStage], num_chunks: int):
        self.schedule = schedule
        """torch's schedule object (ScheduleGPipe, ...)."""
        self.stages = stages
        """This rank's PipelineStages."""
        self.has_first = any(s.stage_index == 0 for s in stages)
        self.has_last = any(s.stage_index == num_chunks - 1 for s in stages)
        self.stage_times: dict[int, dict[str, float]] = {}
        """Per stage index: forward_s, backward_s of the last step, summed over its micro-batches
        (wall time on this rank; backward_s includes zero-bubble's deferred weight passes)."""
        self.events: list[tuple[str, int, int, float, float]] = []
        """The last step's actions on this rank: (kind, stage, micro-batch, start, end), start
        and end in seconds of the wall clock (comparable across ranks of one machine)."""
        self._running: dict[int, dict[str, float]] = {}
        self._events: list[tuple[str, int, int, float, float]] = []
        for stage in stages:
            for method in ACTION_KIND:
                self._time(stage, method)

    def report_scaling(self, note: Callable) -> None:
        """Call `note(parameters, factor)` whenever torch's schedule multiplies a stage's gradients
        by `factor` (`PipelineStage.scale_grads(m)`, called with `m` once the stage's backward is
        done: at the end of the step, or after each stage's last backward in the multi-stage
        schedules), so that runtime/apply_dp.py's `GradientReducer` knows which gradients it sent
        before their division."""
        for stage in self.stages:
            inner = stage.scale_grads

            def scale_grads(grad_scale_factor: int, inner=inner, stage=stage) -> None:
                inner(grad_scale_factor)
                if grad_scale_factor != 1:
                    note(stage.submod.parameters(), 1 / grad_scale_factor)
            stage.scale_grads = scale_grads  # type: ignore[method-assign]

    def _time(self, stage: PipelineStage, method: str) -> None:
        inner = getattr(stage, method)
        total = "forward_s" if method == "forward_one_chunk" else "backward_s"

        def timed(chunk_id: int, *args, **kwargs):
            synchronize(stage.device)
            start = time.time()
            try:
                return inner(chunk_id, *args, **kwargs)
            finally:
                synchronize(stage.device)
                end = time.time()
                times = self._running.setdefault(stage.stage_index, {"forward_s": 0.0, "backward_s": 0.0})
                times[total] += end - start
                kind = ACTION_KIND[method]
                if kind == "BW" and not kwargs.get("full_backward", args[1] if len(args) > 1 else True):
                    kind = "B"
                self._events.append((kind, stage.stage_index, chunk_id, start, end))

        setattr(stage, method, timed)

    def step(self, inputs: tuple, targets) -> torch.Tensor | None:
        """Run the schedule over this replica's batch; the mean micro-batch loss on the last stage.

        Gradients are left accumulated on the stage modules (the caller zeroes them).
        """
        self._running, self._events = {}, []
        losses: list[torch.Tensor] = []
        self.schedule.step(
            *(schedule_inputs(inputs) if self.has_first else ()),
            target=targets if self.has_last else None,
            losses=losses if self.has_last else None,
            **_NO_OUTPUTS,
        )
        self.stage_times, self.events = self._running, self._events
        if not self.has_last:
            return None
        return torch.stack([loss.detach() for loss in losses]).mean()


def _step_keyword_no_outputs() -> dict:
    """`return_outputs=False` where torch's schedules take it (torch >= 2.10): the last stage then
    keeps no micro-batch's output to the step's end, which only the losses are read from
    (planner/cost/memory.py `pipeline_keeps_outputs` prices either)."""
    return {"return_outputs": False} if "return_outputs" in inspect.signature(_PipelineSchedule.step).parameters else {}


_NO_OUTPUTS = _step_keyword_no_outputs()


def _NO_SEPARATE_WEIGHT_PASS():  # noqa: N802  (torch's dw_builder: the W action's runner)
    return lambda: None


class _PipelineStage(PipelineStage):
    """torch's stage, telling the stage module when torch runs it to infer shapes (runtime/pp_split.py
    `StageSpec.shape_inference`): it then runs on uninitialised tensors, which glue must not read,
    and on meta ones, whose kernels that refuse float32 run in bfloat16 (`Bfloat16Retry`).

    Its deferred weight pass (zero bubble's W) keeps the autograd graph until the pass ends.
    torch's `stage_backward_weight` differentiates its parameter groups one at a time and frees
    the graph behind each; groups that share a node upstream of their saved intermediates then
    fail, the second one backpropagating through buffers the first freed. Hugging Face's T5 does
    this: the decoder's relative-position bias is made once from a weight of its first block
    and added to the scores of every block. Kept, the graph is freed all the same when the pass
    drops its intermediates, at its end (`_retaining_graph`)."""

    def backward_weight_one_chunk(self, bwd_chunk_id: int, last_backward=False):
        with _retaining_graph():
            return super().backward_weight_one_chunk(bwd_chunk_id, last_backward=last_backward)

    def _forward_metadata_inference(self, *args, **kwargs):
        spec = stage_spec(self.submod)
        spec.shape_inference = True
        try:
            with Bfloat16Retry():
                return super()._forward_metadata_inference(*args, **kwargs)
        finally:
            spec.shape_inference = False


@contextlib.contextmanager
def _retaining_graph():
    """torch's stage calls `stage_backward_weight` by its module's name: for the duration, with
    `retain_graph=True` (see `_PipelineStage`)."""
    original = torch_stage.stage_backward_weight
    torch_stage.stage_backward_weight = functools.partial(original, retain_graph=True)
    try:
        yield
    finally:
        torch_stage.stage_backward_weight = original


def build_schedule(stages: list[tuple[int, nn.Module]], plan: Plan, pp_group, device, loss_fn,
                   example_microbatch: tuple) -> PipelineRunner:
    """PipelineStages for this rank's chunks and the plan's schedule over them.

    `example_microbatch`: one micro-batch of model inputs (any values); later stages replay
    shape arithmetic of the model's forward on it. Shapes crossing each cut are inferred by
    torch on the first step (dynamic metadata inference), so TP/SP-local shapes just work.
    """
    # The plan's stages are chunks: pp_degree x virtual_stages of them over all ranks (torch's
    # `num_stages`; planner/cost/schedules.py counts pipeline ranks instead).
    num_chunks = len(plan.stages)
    num_microbatches = plan.batch.num_microbatches
    for _, module in stages:
        set_example_microbatch(module, example_microbatch)
    # A stage whose weights its inputs' graph does not reach runs its whole backward at once
    # (pp_split.needs_full_backward): torch takes a dw_builder as that request.
    pipeline_stages: list[PipelineStage] = [_PipelineStage(module, index, num_chunks, device, group=pp_group,
                                      dw_builder=_NO_SEPARATE_WEIGHT_PASS if needs_full_backward(module) else None)
                       for index, module in stages]
    last = [module for index, module in stages if index == num_chunks - 1]
    if last:  # the loss sees the model's own output object, not the tensors torch's stage passes around
        user_loss_fn = loss_fn

        def loss_fn(output, target):
            return user_loss_fn(restore_output(last[0], output), target)
    name = plan.layout.schedule
    schedule: _PipelineSchedule  # torch's base class of both kinds (private name, public role)
    try:
        if name in SINGLE_STAGE:
            if len(pipeline_stages) != 1:
                raise PlannerError(f"Schedule {name} runs one stage per pipeline rank; this rank holds {len(pipeline_stages)}.",
                                   "Use interleaved-1f1b or zero-bubble for virtual_stages > 1.")
            schedule = SINGLE_STAGE[name](pipeline_stages[0], num_microbatches, loss_fn=loss_fn)
        elif name in MULTI_STAGE:
            multi: list[_PipelineStageBase] = list(pipeline_stages)  # the base class torch's signature names
            schedule = MULTI_STAGE[name](multi, num_microbatches, loss_fn=loss_fn)
        else:
            raise PlannerError(f"Unknown pipeline schedule {name}.", "Use one of gpipe, 1f1b, interleaved-1f1b, zero-bubble.")
    except ValueError as exc:  # torch's own constraints, e.g. micro-batches a multiple of the rounds
        raise PlannerError(f"torch cannot build schedule {name} for this plan: {exc}",
                           "Change num_microbatches (a multiple of pp_degree is always accepted).") from exc
    return PipelineRunner(schedule, pipeline_stages, num_chunks)
