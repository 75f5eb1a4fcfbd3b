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

Two executors. torch.distributed.pipelining has no flush-free schedule: a schedule's `step`
runs one batch and returns after its last backward. So where the layout allows
(planner/plan.py `flush_free_blocker`: one stage module per rank, parameters plain or TP/EP
DTensors, with or without SP, ZeRO 0), `train_flush_free` runs the whole run as one pipeline
that never flushes (`flush_free_actions`: step t + 1's forwards start while step t's backwards
drain), each weight version its own set of parameter tensors (`WeightVersions`): the
bubble-free steady state the cost model prices (planner/cost/schedules.py). Elsewhere (FSDP2
owns the parameters, or CP, virtual stages, replicas) a step runs its batch as torch's
Schedule1F1B with the older version swapped in by `swap_in` / `restore` above, flushed between
steps: 2BW's numbers with 1F1B's timing, which is how the cost model prices those layouts.
Both apply the same rule, so both match the reference, and a checkpoint of one resumes under
the other.

Frozen parameters (requires_grad False) never change, so they get no stash. The memory cost
is one copy of the trained weights per rank (planner/cost/memory.py `stashed_weight_bytes`)
plus, during `swap_in`, one parameter tensor at a time.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from planner.plan import Plan
from runtime.metrics import synchronize
from runtime.pp_p2p import P2PStage

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


# --- The flush-free executor ---------------------------------------------------------------


@dataclass(frozen=True)
class Action:
    """One entry of a rank's flush-free schedule, at a time that orders it (`flush_free_actions`)."""

    time: float
    kind: str
    """"F" / "B": forward / backward of global micro-batch `index`; "U": the update of batch `index`."""
    index: int


def flush_free_actions(stage: int, pp: int, m: int, steps: int, synchronized: bool) -> list[Action]:
    """Stage `stage`'s actions over `steps` batches of m micro-batches, never flushing (`m >= pp`).

    Global micro-batch g = t m + j (batch t). As runtime/pp_replicated.py orders 1F1B, forward
    (s, g) runs at time g + s/2 and backward (s, g) at g + (pp - s) + s/2 (pp - s forwards in
    flight, a backward first on a tie). Batch t's update U(s, t) runs just after the stage's last
    backward of the batch, at (t + 1) m - 1 + (pp - s) + s/2 + 1/4; `synchronized` (weights
    tied across stages, or clipping by the global norm, need the other stages' gradients) puts
    every stage's at stage 0's time, the latest, (t + 1) m - 1 + pp + 1/4.

    Valid and deadlock-free: every rank runs its actions in increasing time, and every
    dependency goes strictly forward in time: forward (s, g) after forward (s - 1, g) (+1/2),
    backward (s, g) after backward (s + 1, g) (+1/2) and after forward (s, g) (+pp - s >= 1);
    a collective (the data-parallel and TP reductions inside U, the ties and the norm across
    stages when synchronized) is at one time in every participant's list. The two weight
    versions suffice: batch t + 2, the next on the weights U(s, t) writes, starts on stage s at
    (t + 2) m + s/2, after U(s, t) when m >= pp (> pp - 3/4 - s/2 is needed); batch t + 1 runs
    on the other version, which U reads and does not change."""
    actions: list[Action] = []
    for t in range(steps):
        for j in range(m):
            g = t * m + j
            actions.append(Action(g + stage / 2, "F", g))
            actions.append(Action(g + pp - stage / 2 - 1e-3, "B", g))  # -1e-3: a backward first on a tie
        tail = pp if synchronized else pp - stage / 2
        actions.append(Action((t + 1) * m - 1 + tail + 0.25, "U", t))
    return sorted(actions, key=lambda a: a.time)


class WeightVersions:
    """The two weight versions of one stage module, as two sets of parameter objects.

    A micro-batch's backward needs the tensors its forward saved, so the version it ran on must
    stay unchanged until then while the other version runs newer micro-batches: the module's
    parameters cannot be overwritten in place (autograd's version counter would refuse, and
    rightly). Each version is its own set of `nn.Parameter`s; `use(v)` registers set v in the
    module (as torch.func.functional_call does for a call), so forwards, backwards and any
    recomputation in them see that set, and each set accumulates its own gradients. Frozen
    parameters are shared. TP parameters are DTensors; so are their copies."""

    def __init__(self, module: nn.Module, stash: WeightStash):
        self.module = module
        self.slots: list[tuple[nn.Module, str, int]] = []
        """(owning module, attribute, index into the sets) of every registration of a trained parameter."""
        index: dict[int, int] = {id(p): i for i, p in enumerate(stash.parameters)}
        for owner in module.modules():
            for name, p in owner._parameters.items():
                if p is not None and id(p) in index:
                    self.slots.append((owner, name, index[id(p)]))
        older = [nn.Parameter(t, requires_grad=True) for t in stash.older]  # the stash's storage, no copy
        self.sets: list[list[nn.Parameter]] = [list(stash.parameters), older]
        """sets[0]: the module's own parameters (W(t) of the first step); sets[1]: W(t - 1)."""
        self.active = 0

    def use(self, version: int) -> None:
        if version != self.active:
            for owner, name, i in self.slots:
                owner._parameters[name] = self.sets[version][i]
            self.active = version

    @torch.no_grad()
    def advance(self, version: int, optimizer: torch.optim.Optimizer | None) -> None:
        """Batch t ran on `version` (W(t - 1)), whose gradients are reduced; the other version holds
        W(t). Make `version` W(t + 1): copy W(t) into it, move the optimizer's state onto its
        parameters, and step with the gradient taken at W(t - 1)."""
        newer, target = self.sets[1 - version], self.sets[version]
        for src, dst in zip(newer, target, strict=True):
            dst.copy_(src)
        if optimizer is not None:
            moved = {id(a): b for a, b in zip(newer, target, strict=True)}
            for group in optimizer.param_groups:
                group["params"] = [moved.get(id(p), p) for p in group["params"]]
            for a, b in zip(newer, target, strict=True):
                if a in optimizer.state:
                    optimizer.state[b] = optimizer.state.pop(a)
            optimizer.step()
        for p in target:
            p.grad = None

    def finish(self, stash: WeightStash, newest: int) -> None:
        """After the last update: the module holds the newest version (`newest`), the stash the
        other, as after a flushed step (checkpoints and the report read them there)."""
        self.use(newest)
        stash.parameters[:] = self.sets[newest]
        stash.older[:] = [p.detach() for p in self.sets[1 - newest]]


def train_flush_free(plan: Plan, mf, settings, device: torch.device):
    """`runtime.train` for a pipedream-2bw plan the flush-free executor runs (planner/plan.py
    `flush_free_blocker` is None): every rank, under torchrun. The rank's stage is built as for any
    plan (runtime/train.py `_build_rank_model`: TP, recomputation, ties), then runs its
    `flush_free_actions` over all the run's batches with `WeightVersions`: batch t's micro-batches
    on W(t - 1), its update writing W(t + 1) into that version. The pipeline drains once, after the
    last batch. Step times are the intervals between this rank's updates."""
    from runtime.metrics import StageTimer, TensorPeakMeter
    from runtime.train import _build_rank_model, _fp32, _local_batch, _report, _slice

    model = _build_rank_model(plan, mf, settings, device, flush_free=True)
    assert model.stash is not None and len(model.chunks) == 1, "flush_free_blocker admits one chunk of a 2BW plan"
    if settings.resume_from:
        from runtime import checkpoint

        checkpoint.load(settings.resume_from, model.modules, model.optimizers, model.stash)
    (index, module), optimizer = model.chunks[0], model.optimizers[0]
    pp, m, mbs = plan.layout.pp_degree, plan.batch.num_microbatches, plan.batch.micro_batch_size
    group = model.mesh["pp"].get_group()
    pp_rank = model.rank("pp")
    peer = (lambda step: lambda _: dist.get_global_rank(group, pp_rank + step))  # noqa: E731
    stage = P2PStage(module, index, pp, device, peer(1), peer(-1), lambda out, tgt: mf.loss(_fp32(out), tgt), m)
    versions = WeightVersions(module, model.stash)
    synchronized = bool(model.ties) or bool(plan.training.grad_clip)
    timer = StageTimer(device, 0)
    batches: dict[int, tuple] = {}
    losses = [torch.zeros((), device=device) for _ in range(settings.steps)]
    times, last = [], time.perf_counter()
    for action in flush_free_actions(index, pp, m, settings.steps, synchronized):
        t, j = divmod(action.index, m) if action.kind != "U" else (action.index, 0)
        version = 1 - t % 2  # batch t runs on W(t - 1): set 1 first (WeightVersions)
        versions.use(version)
        if action.kind == "F":
            if t not in batches:
                batches[t] = _local_batch(mf, plan, settings.seed, settings.first_step + t, model.rank("dp"), device)
            inputs, targets = batches[t]
            with timer.time(index, "forward"):
                part = stage.forward(action.index, tuple(_slice(x, j * mbs, (j + 1) * mbs) for x in inputs),
                                     _slice(targets, j * mbs, (j + 1) * mbs))
            if part is not None:
                losses[t] += part.float()
            if j == m - 1:
                batches.pop(t)
        elif action.kind == "B":
            with timer.time(index, "backward"):
                stage.backward(action.index)
        else:
            _update(plan, model, versions, version, optimizer)
            stage.finish()
            synchronize(device)
            now = time.perf_counter()
            times.append(now - last)
            last = now
    versions.finish(model.stash, 1 - (settings.steps - 1) % 2)
    model.tie_copies[:] = [tie.copies(model.chunks) for tie in model.ties]
    last_stage = index == len(plan.stages) - 1
    reports = [loss if last_stage and model.rank("tp") == 0 else torch.zeros((), device=device) for loss in losses]
    return _report(plan, model, settings, reports, times, timer, TensorPeakMeter(device, settings.steps, enabled=False),
                   device)


def _update(plan: Plan, model, versions: WeightVersions, version: int, optimizer) -> None:
    """Batch t's update on this rank (`flush_free_actions`' "U"): the reductions every plan does
    (runtime/train.py `_reduce_gradients`), clipping, then `WeightVersions.advance`."""
    from runtime.grad_clip import clip_grad_norm
    from runtime.train import _reduce_gradients

    model.tie_copies[:] = [tie.copies(model.chunks) for tie in model.ties]  # this version's copies
    _reduce_gradients(plan, model)
    if plan.training.grad_clip:
        clip_grad_norm(model.modules, plan.training.grad_clip, model.mesh["pp"].get_group(), model.uncounted())
    versions.advance(version, optimizer)
