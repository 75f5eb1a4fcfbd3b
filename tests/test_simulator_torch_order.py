"""The simulator's per-rank action order (planner/cost/simulator.py `schedule_actions`) is torch's
own: `pipeline_order` of torch.distributed.pipelining's looped schedules, which the runtime runs
(runtime/apply_pp.py). torch computes the whole grid on every rank from the stages' indices and
group size alone, so stand-in stages (no process group, no model) are enough to read it."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.pipelining import schedules

from planner.cost.simulator import schedule_actions

# Our action kinds -> torch's: BW is the full backward (torch's B), B the input-gradient half (I).
TORCH_KIND = {"F": "F", "BW": "B", "B": "I", "W": "W"}


class _Stage:
    """The attributes torch's schedule constructors read from a PipelineStage."""

    def __init__(self, stage_index: int, num_stages: int, group_size: int):
        self.stage_index, self.num_stages = stage_index, num_stages
        self.group_rank, self.group_size = 0, group_size  # rank 0's view: torch builds every rank's order
        self.is_first, self.is_last = stage_index == 0, stage_index == num_stages - 1
        self.has_backward = True
        self.dw_builder = None
        self.stage_index_to_group_rank: dict[int, int] = {}
        self.submod = torch.nn.Identity()


def torch_order(cls, p: int, m: int, v: int) -> dict[int, list[str]]:
    # Looping placement: rank 0 holds chunks 0, p, 2p, ...
    schedule = cls([_Stage(k * p, p * v, p) for k in range(v)], m, loss_fn=lambda out, target: out)
    return {r: [str(a) for a in actions if a is not None] for r, actions in schedule.pipeline_order.items()}


def simulated_order(name: str, p: int, m: int, v: int) -> dict[int, list[str]]:
    return {r: [f"{chunk}{TORCH_KIND[kind]}{mb}" for kind, chunk, mb in actions]
            for r, actions in enumerate(schedule_actions(name, p, m, v))}


@pytest.mark.parametrize("name, cls", [("interleaved-1f1b", schedules.ScheduleInterleaved1F1B),
                                       ("zero-bubble", schedules.ScheduleInterleavedZeroBubble)])
@pytest.mark.parametrize("p, m, v", [(2, 4, 2), (2, 8, 2), (4, 8, 2), (3, 6, 2), (2, 4, 3), (4, 4, 2)])
def test_simulated_action_order_is_torchs(name, cls, p, m, v):
    assert simulated_order(name, p, m, v) == torch_order(cls, p, m, v)


def test_zero_bubble_with_one_chunk_per_rank_is_torchs():
    assert simulated_order("zero-bubble", 4, 8, 1) == torch_order(schedules.ScheduleInterleavedZeroBubble, 4, 8, 1)


@pytest.mark.xfail(strict=True, reason="the simulator runs interleaved-1f1b with one chunk per rank as 1F1B (p - r - 1 "
                   "warm-up forwards); torch's ScheduleInterleaved1F1B, which runtime/apply_pp.py runs for it, warms up "
                   "with 2 (p - r - 1): more micro-batches in flight than priced")
def test_interleaved_1f1b_with_one_chunk_per_rank_is_torchs():
    assert simulated_order("interleaved-1f1b", 4, 8, 1) == torch_order(schedules.ScheduleInterleaved1F1B, 4, 8, 1)
