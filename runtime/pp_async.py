"""PipeDream-2BW's second weight version: the runtime side of the asynchronous schedule.

The rule (planner/plan.py `Schedule`; Narayanan et al. 2021, "Memory-Efficient Pipeline-
Parallel DNN Training", ICML, arXiv 2006.09503, section 3.1), with W(t) the weights before
step t and W(-1) = W(0):

    W(t+1) = W(t) - lr * grad f(W(t-1))        (AdamW: its step on W(t) with that gradient)

Each chunk keeps the older version in a `WeightStash` (one tensor per trainable parameter,
sharded as the parameter is: a DTensor shard under FSDP2 or TP), and a step runs

    swap_in()     parameters <- W(t-1), stash <- W(t)          before the first forward
    forward and backward of the m micro-batches                 gradient at W(t-1), summed over
                                                                them; the data-parallel
                                                                reduction as for any schedule
    restore()     parameters <- W(t) (the stash, which stays)  before clipping and the step
    optimizer     parameters <- W(t+1)                          the stash holds W(t): next
                                                                step's older version

The reference (`python -m runtime PLAN --reference`, runtime/train.py) applies the same
`WeightStash` to the whole model in one process, so parity is defined as for every plan.

Timing: torch.distributed.pipelining has no flush-free schedule: a schedule's `step` runs one
batch and returns after its last backward. A 2BW step therefore runs its batch as torch's
Schedule1F1B (runtime/apply_pp.py), and the pipeline flushes between steps: consecutive steps
do not overlap. The numbers (losses, parameters) are 2BW's; the timing is 1F1B's, fill and
drain included, not the bubble-free steady state the cost model prices
(planner/cost/schedules.py). A flush-free executor would let step t+1's warm-up forwards (on
W(t)) start while step t's last backwards (on W(t-1)) drain, which is exactly what the two
versions make safe; it is not written.

Frozen parameters (requires_grad False) never change, so they get no stash. The memory cost
is one copy of the trained weights per rank (planner/cost/memory.py `stashed_weight_bytes`)
plus, during `swap_in`, one parameter tensor at a time.
"""

from __future__ import annotations

import torch
from torch import nn

from planner.plan import Plan

ASYNC_SCHEDULE = "pipedream-2bw"
"""The plan's name of the asynchronous schedule (planner/plan.py `Schedule`)."""


class WeightStash:
    """The older weight version of a rank's chunks, and the swaps of one 2BW step (module docstring)."""

    def __init__(self, modules: list[nn.Module]):
        self.parameters: list[nn.Parameter] = []
        """The trainable parameters, as the optimizers hold them (FSDP2's sharded ones)."""
        self.names: list[str] = []
        """Their names from the model root (checkpoint-wrapper prefixes removed), as checkpoints key them."""
        self.older: list[torch.Tensor] = []
        """The stashed version, one tensor per parameter: W(t-1) between steps, W(t) after `swap_in`."""
        for module in modules:
            for name, p in module.named_parameters():
                if p.requires_grad:
                    self.parameters.append(p)
                    self.names.append(name.replace("_checkpoint_wrapped_module.", ""))
                    self.older.append(p.detach().clone())  # W(-1) = W(0)

    @staticmethod
    def asynchronous(plan: Plan) -> bool:
        """Whether the plan's schedule keeps two weight versions."""
        return plan.layout.schedule == ASYNC_SCHEDULE

    @classmethod
    def of(cls, plan: Plan, modules: list[nn.Module]) -> WeightStash | None:
        """A stash of `modules`' current weights when the plan's schedule is asynchronous, else None.
        Made before any step (and before a checkpoint is loaded into it): the first step's older
        version is then W(0) itself."""
        return cls(modules) if cls.asynchronous(plan) else None

    @torch.no_grad()
    def swap_in(self) -> None:
        """Before the step's first forward: the parameters take the older version, the stash the newer."""
        for p, older in zip(self.parameters, self.older, strict=True):
            newer = p.detach().clone()  # one tensor at a time: the transient is the largest parameter
            p.copy_(older)
            older.copy_(newer)

    @torch.no_grad()
    def restore(self) -> None:
        """After the step's last backward, before the optimizer: the parameters return to the newer
        version (the gradients, taken at the older one, stay), which the stash keeps for the next step."""
        for p, newer in zip(self.parameters, self.older, strict=True):
            p.copy_(newer)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The stashed tensors by parameter name (runtime/checkpoint.py saves and loads them in place)."""
        return dict(zip(self.names, self.older, strict=True))
