"""Pipeline parallelism: the plan's stages as torch.distributed.pipelining stages and schedules.

A stage is the original model object with every unit outside the stage replaced by an
empty module and its `forward` replaced by one that runs the stage's units in order, so
parameter names stay the model's own (the plan's TP plans, FSDP and checkpoints address
them). That is exact for *chain* models, where each cut is crossed by one tensor, the
output of the unit before it, and no code runs between units (GPT, Llama, VGG-style
stacks); `check_chain` refuses anything else with a clear message. Models whose skip
connections cross cuts need a graph split (torch's `pipeline()` tracer frontend), which
this runtime does not do yet.

Schedules map one to one: gpipe -> ScheduleGPipe, 1f1b -> Schedule1F1B,
interleaved-1f1b -> ScheduleInterleaved1F1B, zero-bubble -> ScheduleInterleavedZeroBubble;
with virtual stages, stage s lives on pipeline rank s % pp (the plan's looping placement).
"""

from __future__ import annotations

import contextlib
import types

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import (
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
)

from planner.errors import PlannerError
from planner.plan import Plan

SINGLE = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}
MULTI = {"interleaved-1f1b": ScheduleInterleaved1F1B, "zero-bubble": ScheduleInterleavedZeroBubble}


def check_chain(traced, plan: Plan) -> None:
    """Every cut between stages must carry exactly the previous unit's output."""
    index = {u: i for i, u in enumerate(traced.units)}
    for stage in plan.stages[:-1]:
        cut = index[stage.units[-1]]
        crossing = traced.crossings(cut)
        if len(crossing) != 1 or crossing[0].producer != cut:
            what = ", ".join(traced.position_name(t.producer) for t in crossing) or "nothing"
            raise PlannerError(
                f"Pipeline cut after {stage.units[-1]} is crossed by {len(crossing)} tensor(s) from {what}: this runtime "
                "pipelines only chain models (one tensor, the previous unit's output, crosses each cut).",
                "Run this model without pipeline parallelism (re-solve with --pp 1).",
            )


def make_stage_module(model: nn.Module, units: list[str], autocast=None) -> nn.Module:
    """`model` restricted to `units` (already dropped from it by the builder), run in order."""
    def forward(self, *args):
        # Looked up at call time: recomputation and FSDP may wrap the units after this.
        with autocast() if autocast else contextlib.nullcontext():
            x = self.get_submodule(units[0])(*args)
            for unit in units[1:]:
                x = self.get_submodule(unit)(x)
        return x

    model.forward = types.MethodType(forward, model)
    return model


def build_schedule(stages: list[tuple[int, nn.Module]], plan: Plan, pp_group, device, loss_fn):
    num_stages = len(plan.stages)
    pipeline_stages = [PipelineStage(module, index, num_stages, device, group=pp_group) for index, module in stages]
    m = plan.batch.num_microbatches
    schedule = plan.layout.schedule
    if schedule in SINGLE and len(pipeline_stages) == 1:
        return SINGLE[schedule](pipeline_stages[0], m, loss_fn=loss_fn)
    if schedule in MULTI:
        return MULTI[schedule](pipeline_stages, m, loss_fn=loss_fn)
    raise PlannerError(f"Schedule {schedule} with {len(pipeline_stages)} stages per rank is not runnable.",
                       "Use interleaved-1f1b or zero-bubble for virtual stages > 1.")


def stage_indices(plan: Plan, pp_rank: int) -> list[int]:
    return [s for s in range(len(plan.stages)) if s % plan.layout.pp_degree == pp_rank]
