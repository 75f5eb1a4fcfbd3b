"""PipeDream stage replication at run time: 1F1B-RR over stages with their own replica counts.

The plan (planner/plan.py `Layout.stage_replicas`) gives stage s r_s replicas on consecutive
ranks (`stage_ranks`). Micro-batch i of a step runs on replica i mod r_s of every stage s
(1F1B-RR, Narayanan et al., "PipeDream", SOSP 2019, section 3.2), so its activations go from
replica i mod r_s of stage s to replica i mod r_{s+1} of stage s + 1 and its gradients back.
After the step's last backward, the replicas of a stage sum their gradients (one all-reduce
per stage, in a group of its ranks, runtime/mesh.py `build_replica_groups`).

Why not torch.distributed.pipelining: its stages hold one rank per stage of a pipeline group
(`PipelineStage(..., group=pp_group)`, a stage's peers are fixed ranks `stage_index -/+ 1`),
and its schedules send every micro-batch to the same peer, so a stage that fans out to a
different replica per micro-batch cannot be expressed. The executor here is written in its
style: a schedule is per-rank lists of actions (`actions`: ("F", i) / ("B", i)) run by a
`P2PStage` (runtime/pp_p2p.py: the same `make_stage` module torch's stages run, its messages
`dist.isend` / `dist.irecv`, gloo on CPU, NCCL on GPU) whose peers are the replicas of the
neighbouring stages that run each micro-batch (`peer`).

Order and deadlock freedom. Sends never block (isend, waited at the end of the step); a rank
blocks only on a receive, and between two ranks the messages of one direction are of one kind
(activations forward, gradients back), posted in increasing micro-batch order on both sides,
so receives match sends in order. `actions` orders a rank's work by a key: forward of
micro-batch j at j, backward of i at i + D_s, where D_s = r_s + ... + r_{S-1} (the ranks from
stage s on), a backward first on a tie. That is 1F1B: without replicas D_s = p - s, the
p - s forwards in flight of stage s (Narayanan et al. 2021); with them a replica holds the
micro-batches of [i, i + D_s) that are its own, ceil(D_s / r_s), what planner/solver/
replication.py prices. No deadlock: give forward (s, j) the time j + s / 2 and backward (s, i)
the time i + D_s + s / 2. Every rank runs its actions in non-decreasing time, and every
dependency goes strictly forward in time: forward (s, j) after forward (s - 1, j) (+1/2),
backward (s, i) after backward (s + 1, i) (D_s - D_{s+1} - 1/2 = r_s - 1/2 > 0) and after
forward (s, i) (D_s >= 1). So the actions in time order are a valid run. `gpipe` runs all
forwards, then all backwards: D_s = M + S - s puts every backward past every forward, and
the same proof holds (D_s - D_{s+1} = 1).

Gradient scale. Each micro-batch's loss is divided by M (micro-batches per step) before its
backward, so a replica accumulates sum over its micro-batches of grad(loss_i) / M; summing over
the stage's replicas covers every micro-batch once: the gradient of the mean loss over the
global batch, the one-process reference's (equal micro-batches, mean-reduced loss).

Weights tied across stages (runtime/pp_split.py `cross_stage_ties`: a head tied to the token
embedding, cut apart) are held as a copy per stage, as runtime/train.py holds them. Each copy's
gradient must be the sum over every micro-batch of every use, on every replica of every stage
holding one, so that all copies take the same step. One all-reduce per tie, in the group of all
the replicas of those stages (runtime/mesh.py `build_replicated_tie_groups`), sums each rank's
own micro-batches' gradient; the replica all-reduce skips tied copies, so nothing is counted
twice. Clipping (`training.grad_clip`) takes the global norm as runtime/grad_clip.py does:
squared norms summed over the world, to which only replica 0 of each stage contributes, a tie
counted on its first stage (`uncounted`); every rank then applies the same scale. Checkpoints
are runtime/checkpoint.py's (DCP, keyed by parameter name): the replicas of a stage save the
same keys with equal values, which DCP's save planner writes once (`dedup_save_plans`), so a
replicated run resumes under a plain pipeline and the reverse.

Collective order. After the step's last backward (its p2p sends waited) every rank runs, in
this order: its stage's replica all-reduces (parameter order of the stage module, the same on
every replica), the tie all-reduces (tie order, on every rank of the stages holding each tie),
the clipping norm's all-reduce over the world. A rank joins a group only with ranks that reach
the same point in that sequence (replicas of one stage run the same sequence; stages share a
tie group only after each finished its replica all-reduces, which involve no other stage), so
every collective is matched and none waits on a rank blocked in another group. The loss
all-reduce, the checkpoint's barriers and DCP's collectives and the report's gathers come after
the last step, on every rank.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from planner.errors import PlannerError
from planner.plan import Plan, stage_ranks
from runtime import checkpoint
from runtime.build import build_meta_model, init_mode, materialize
from runtime.grad_clip import clip_grad_norm
from runtime.metrics import RunResult, StageTimer, build_metrics, merge_stage_times, peak_memory, synchronize
from runtime.pp_flow import trace_layout
from runtime.pp_p2p import P2PStage
from runtime.pp_split import CrossStageTie, check_splittable, cross_stage_ties, make_stage
from runtime.recompute import apply_unit_recompute


def stage_and_replica(plan: Plan, rank: int) -> tuple[int, int]:
    """(stage, replica index) of global `rank` (stages on consecutive ranks, planner/plan.py)."""
    for s in range(len(plan.stages)):
        ranks = stage_ranks(plan.layout, s)
        if rank in ranks:
            return s, ranks.index(rank)
    raise PlannerError(f"Rank {rank} holds no stage of the plan.", "Launch with the plan's world size.")


def peer(plan: Plan, stage: int, microbatch: int) -> int:
    """The rank running `microbatch` on `stage`: its replica microbatch mod r_stage (1F1B-RR)."""
    ranks = stage_ranks(plan.layout, stage)
    return ranks[microbatch % len(ranks)]


def actions(plan: Plan, stage: int, replica: int) -> list[tuple[str, int]]:
    """This replica's schedule as data: ("F", i) / ("B", i) for its micro-batches i (those with
    i mod r_stage == replica), ordered as the module docstring says (1F1B-RR, or GPipe)."""
    replicas = plan.layout.stage_replicas or []
    m = plan.batch.num_microbatches
    mine = [i for i in range(m) if i % replicas[stage] == replica]
    later = sum(replicas[stage:]) if plan.layout.schedule == "1f1b" else m + len(replicas) - stage  # D_s
    keyed = [(i, 1, "F", i) for i in mine] + [(i + later, 0, "B", i) for i in mine]  # 0: a backward first on a tie
    return [(kind, i) for _, _, kind, i in sorted(keyed)]


def check_replicated(plan: Plan, meta: nn.Module) -> None:
    """Refuse what this executor does not run, before any process group exists."""
    check_splittable(meta, plan)


def run_step(stage: P2PStage, plan: Plan, replica: int, inputs: tuple, targets, timer: StageTimer) -> torch.Tensor:
    """One step's forwards and backwards on this rank (`actions`); the sum of its losses / M."""
    from runtime.train import _slice

    mbs, loss = plan.batch.micro_batch_size, torch.zeros((), device=stage.device)
    for kind, i in actions(plan, stage.stage, replica):
        lo, hi = i * mbs, (i + 1) * mbs
        if kind == "F":
            with timer.time(stage.stage, "forward"):
                part = stage.forward(i, tuple(_slice(x, lo, hi) for x in inputs), _slice(targets, lo, hi))
            if part is not None:
                loss += part.float()
        else:
            with timer.time(stage.stage, "backward"):
                stage.backward(i)
    stage.finish()
    return loss


def _all_reduce_grad(p: nn.Parameter, group) -> None:
    if p.grad is None:  # a replica whose micro-batches never reached p still joins the sum
        p.grad = torch.zeros_like(p)
    dist.all_reduce(p.grad, group=group)


def sum_replica_gradients(module: nn.Module, group, tied: list[tuple[nn.Parameter, Any]] | None = None) -> None:
    """Sum the trained parameters' gradients over the stage's replicas, then each tied copy's
    over every replica of the stages holding its tie (`tied`: (copy, that group)), so every
    micro-batch's gradient counts once (module docstring: scale, ties, collective order)."""
    tied = tied or []
    skip = {id(p) for p, _ in tied}
    if group is not None:
        for p in module.parameters():
            if p.requires_grad and id(p) not in skip:
                _all_reduce_grad(p, group)
    for p, tie_group in tied:
        if p.requires_grad:  # a frozen tied weight (every copy alike) takes no step
            _all_reduce_grad(p, tie_group)


def clip_replicated(module: nn.Module, max_norm: float, replica: int, tie_uncounted: list[nn.Parameter]) -> torch.Tensor:
    """runtime/grad_clip.py's global norm over the world, each parameter counted once: replica 0
    of each stage counts its stage (tied copies on their first stage only); others count nothing.
    Returns the norm before clipping (the same on every rank)."""
    uncounted = list(module.parameters()) if replica != 0 else tie_uncounted
    return clip_grad_norm([module], max_norm, dist.group.WORLD, uncounted)


@dataclass
class ReplicaModel:
    """This rank's stage of a replicated pipeline and what its steps reduce over."""

    stage: P2PStage
    """The stage module and its p2p with the neighbouring stages' replicas."""
    replica: int
    """This rank's replica index in its stage (0 reports the parameters and counts the norm)."""
    optimizer: torch.optim.Optimizer | None
    """AdamW over the stage's trained parameters; None when it has none."""
    replica_group: Any
    """The stage's replicas (runtime/mesh.py `build_replica_groups`); None for a stage of one rank."""
    ties: list[CrossStageTie]
    """Weights tied across stages (runtime/pp_split.py), each held as a copy per stage."""
    tied: list[tuple[CrossStageTie, nn.Parameter, Any]]
    """This rank's tied copies: (tie, copy, the group of every replica of the tie's stages)."""

    def uncounted(self) -> list[nn.Parameter]:
        """Tied copies other than on each tie's first stage: the norm counts them there."""
        return [p for t, p, _ in self.tied if self.stage.stage != t.stages[0]]


def build_replica_model(plan: Plan, mf, settings, device: torch.device) -> ReplicaModel:
    """This rank's stage module, materialised (the reference's values), recompute-wrapped and
    with its optimizer, and the replica and tie groups (every rank creates every group)."""
    from runtime.mesh import build_replica_groups, build_replicated_tie_groups
    from runtime.train import _autocast, _fp32, make_optimizer, meta_inputs

    meta = build_meta_model(mf)
    check_replicated(plan, meta)
    stage_index, replica = stage_and_replica(plan, dist.get_rank())
    replicas = plan.layout.stage_replicas or []
    groups = build_replica_groups(replicas)
    ties = cross_stage_ties(meta, plan)
    tie_groups = build_replicated_tie_groups(replicas, [t.stages for t in ties])
    layout = trace_layout(meta, plan, meta_inputs(mf, plan.batch.micro_batch_size))
    module = make_stage(meta, layout, stage_index, meta_inputs(mf, plan.batch.micro_batch_size),
                        forward_context=lambda: _autocast(plan, device))
    materialize(module, settings.seed, device, init_mode(meta), mf)
    apply_unit_recompute(module, dict(plan.stages[stage_index].unit_modes()))  # per unit, as runtime/train.py does
    tied = [(t, p, group) for t, group in zip(ties, tie_groups, strict=True) for _, p in t.copies([(stage_index, module)])]
    optimizer = make_optimizer(module, settings.lr, plan.training.weight_decay)
    stage = P2PStage(module, stage_index, len(plan.stages), device, lambda i: peer(plan, stage_index + 1, i),
                     lambda i: peer(plan, stage_index - 1, i), lambda out, tgt: mf.loss(_fp32(out), tgt),
                     plan.batch.num_microbatches)
    return ReplicaModel(stage, replica, optimizer, groups[stage_index], ties, tied)


def train_replicated(plan: Plan, mf, settings, device: torch.device) -> RunResult:
    """`runtime.train` for a plan with `stage_replicas` (every rank, under torchrun)."""
    from runtime.train import _check_tied_resume, _full_parameters, _gather, _local_batch

    if plan.layout.world_size != dist.get_world_size():
        raise PlannerError(f"The plan needs {plan.layout.world_size} ranks; {dist.get_world_size()} were started.",
                           "Launch with `planner run`, which starts the plan's world size.")
    model = build_replica_model(plan, mf, settings, device)
    module, optimizer = model.stage.module, model.optimizer
    if settings.resume_from:
        _check_tied_resume(settings.resume_from, model.ties)
        checkpoint.load(settings.resume_from, [module], [optimizer])
    timer = StageTimer(device)
    reports, times = [], []
    for step in range(settings.first_step, settings.first_step + settings.steps):
        timer.step = step - settings.first_step
        inputs, targets = _local_batch(mf, plan, settings.seed, step, 0, device)
        start = time.perf_counter()
        if optimizer is not None:
            optimizer.zero_grad()
        reports.append(run_step(model.stage, plan, model.replica, inputs, targets, timer))
        sum_replica_gradients(module, model.replica_group, [(p, g) for _, p, g in model.tied])
        if plan.training.grad_clip:
            clip_replicated(module, plan.training.grad_clip, model.replica, model.uncounted())
        if optimizer is not None:
            optimizer.step()
        synchronize(device)
        times.append(time.perf_counter() - start)
    total = torch.stack(reports) if reports else torch.zeros(0, device=device)
    dist.all_reduce(total)  # the last stage's replicas hold the loss / M of their micro-batches: the sum is the mean
    if settings.checkpoint_dir:
        checkpoint.save(settings.checkpoint_dir, [module], [optimizer], settings.first_step + settings.steps,
                        settings.fingerprint, resumed_from=settings.resume_from)
    aliases = {name: t.names[0] for t in model.ties for name in t.names}  # a tied copy under the reference's name
    params = _full_parameters([module], keep=model.replica == 0, aliases=aliases)
    peaks, stage_times = _gather(peak_memory()), _gather(timer.summary())
    dist.barrier()  # every rank past its last collective before any tears the group down
    return build_metrics(plan, total.tolist(), times, peaks, merge_stage_times(stage_times), params,
                         world_size=dist.get_world_size())
