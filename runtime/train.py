"""One training run under a plan (`python -m runtime PLAN` on every rank), or the reference.

The order of construction is fixed, and each step needs the one before it:

1. check the plan against the model (before anything is allocated);
2. the (pp, dp, tp) mesh (runtime/mesh.py);
3. the model on meta, cut into this rank's stage chunks (runtime/apply_pp.py; the whole
   model without pipelining): TP, FSDP and checkpoints must see the module that will run,
   and cutting on meta costs no memory;
4. materialise and initialise each chunk (runtime/build.py: the reference's values, by FQN);
   this comes *before* TP because TP shards initialised full tensors: a sharded init would
   draw different random numbers than the one-process reference (parity by construction);
5. tensor parallelism (runtime/apply_tp.py), then expert parallelism (runtime/apply_ep.py):
   both slice initialised full tensors; EP keeps this rank's experts as DTensor shards on
   the ep axis (dp, or dp x tp with SP, viewed as (edp, ep), runtime/mesh.py), and its
   all-to-alls run inside the recompute wrapper of step 6 so that recomputation replays them;
   with SP the MoE blocks then take their router statistics over whole sequences;
6. activation checkpointing (runtime/recompute.py), inside the TP hooks so that recompute
   replays the TP collectives;
7. FSDP (runtime/apply_dp.py) last, wrapping the TP-sharded parameters on the dp mesh;
   then context parallelism (runtime/apply_cp.py) hooks its attention mode onto every module
   of the finished model, recompute-wrapped ones included (its sequence chunks are cut in
   `_local_batch`);
8. the pipeline schedule over the chunks, the optimizer, then the loop.

In code: `_check_model` (1), `_build_rank_model` (2-8: `_stage_chunks` 3, `_parallelize_chunks`
4-7, optimizers and schedule 8), `_train_step` per step (`_forward_backward` without pipelining,
then `_reduce_gradients`), `_report` after the last step; `RunSettings` holds the run's options.

Data: step s's global batch is `make_batch(global_batch_size)` under a seed made of
(seed, s); every rank draws it and keeps its data-parallel slice, which the micro-batches
then split. The loss reported is the mean over the global batch, as in the reference.
Real data: a model file may also define

    def get_batch(step: int, batch_size: int, **model_args) -> (inputs, targets)

which the runtime then calls instead of make_batch (make_batch stays the contract's shape
example for profiling and tracing). It must return the same global batch for the same step
on every rank and in the reference (index a dataset by step, e.g. samples
[step * batch_size, (step + 1) * batch_size) of a shuffled-once order); every rank keeps its
slice. That costs each rank the whole global batch's loading, which is what keeps parity
with the reference trivially true; a sharded loader is the next step.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule

from planner.errors import PlannerError
from planner.model_file import call_user, load_model_file
from planner.plan import Plan, flush_free_blocker
from planner.profiler.measure import fp32_logits
from runtime import checkpoint
from runtime.apply_cp import apply_cp, check_cp, has_attention_modules, sequence_length, shard_batch
from runtime.apply_dp import GradientReducer, apply_fsdp, average_gradients, scale_gradients, sum_tied_gradients
from runtime.apply_ep import apply_ep, apply_moe_sequence_parallel, check_ep, expert_parameters
from runtime.apply_fp8 import apply_float8
from runtime.apply_pp import PipelineRunner, build_schedule, build_stage_modules
from runtime.apply_tp import apply_tp, check_tp_plan, sum_partial_gradients
from runtime.build import (
    as_tuple,
    build_meta_model,
    check_fingerprint,
    init_mode,
    materialize,
)
from runtime.grad_clip import clip_grad_norm
from runtime.metrics import (
    RunResult,
    StageTimer,
    TensorPeakMeter,
    build_metrics,
    merge_stage_times,
    peak_memory,
    synchronize,
    timeline_of,
)
from runtime.pp_async import WeightStash, train_flush_free
from runtime.pp_split import CrossStageTie, check_splittable, cross_stage_ties
from runtime.recompute import apply_unit_recompute

PROCESS_GROUP_TIMEOUT = timedelta(seconds=120)  # a dead peer fails the job instead of hanging it
T = TypeVar("T")


def batch_for_step(model_file, global_batch_size: int, seed: int, step: int):
    """Step `step`'s global batch: the model file's `get_batch` if it has one, else `make_batch`
    under a seed made of (seed, step) (module docstring, Data)."""
    torch.manual_seed(seed * 100_003 + step)
    if hasattr(model_file.module, "get_batch"):
        inputs, targets = call_user(model_file, "get_batch", step, global_batch_size, **model_file.model_args)
    else:
        inputs, targets = model_file.make_batch(global_batch_size)
    return as_tuple(inputs), targets


def _own(x, device):
    """`x` on `device` in a storage of its own."""
    return x.to(device, copy=True) if isinstance(x, torch.Tensor) else x


def _autocast(plan: Plan, device):
    """Mixed precision: fp32 master weights, 16-bit compute where autocast allows it."""
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(plan.training.dtype)
    return torch.autocast(device.type, dtype=dtype, enabled=dtype is not None)


_fp32 = fp32_logits  # 16-bit logits go to the loss in fp32 (planner/profiler/measure.py, which the profile shares)


def _slice(x, start: int, stop: int):
    return x[start:stop] if isinstance(x, torch.Tensor) else x


def _local_batch(mf, plan: Plan, seed: int, step: int, dp_rank: int, device):
    """This data-parallel replica's contiguous slice of step `step`'s global batch, on `device`.
    Under context parallelism the cp consecutive dp ranks of a group share their group's slice,
    each keeping its sequence chunks (runtime/apply_cp.py `shard_batch`)."""
    local, cp = plan.batch.micro_batch_size * plan.batch.num_microbatches, plan.layout.cp_degree
    group = dp_rank // cp
    inputs, targets = batch_for_step(mf, plan.batch.global_batch_size, seed, step)
    inputs = tuple(_slice(x, group * local, (group + 1) * local) for x in inputs)
    targets = _slice(targets, group * local, (group + 1) * local)
    if cp > 1:
        inputs, targets = shard_batch(inputs, targets, cp, dp_rank % cp)
    # Copies, even on the CPU: a slice would keep the whole global batch alive through the step.
    return tuple(_own(x, device) for x in inputs), _own(targets, device)


def meta_inputs(mf, batch_size: int, cp_degree: int = 1) -> tuple:
    """A micro-batch on the meta device, to trace which tensors cross each cut. Of the plan's
    micro-batch size: glue may branch on the batch size (transformers 4.57 expands position ids
    when it is above 1), and every stage must number its tensors as the trace did. Under context
    parallelism of a rank's T / cp tokens, the shapes its stages run at (glue such as a causal
    mask made from them must have the trace's shape where a later stage replays it)."""
    inputs = as_tuple(mf.make_batch(batch_size)[0])
    if cp_degree > 1:
        length = sequence_length(inputs)
        inputs = tuple(x[:, :length // cp_degree] if isinstance(x, torch.Tensor) and x.dim() >= 2 and
                       x.shape[1] == length else x for x in inputs)
    return tuple(x.to("meta") if isinstance(x, torch.Tensor) else x for x in inputs)


def train(plan: Plan, model_file_path: str, steps: int, seed: int, lr: float | None, reference: bool, *,
          checkpoint_dir: str | None = None, resume: bool = False, measure_tensor_peak: bool = True) -> RunResult:
    """Train under `plan` on this rank (under torchrun), or in one process with `reference`.

    `lr` None: the plan's. `checkpoint_dir`: save there after the last step; with `resume`, start
    from its newest complete step. `measure_tensor_peak`: measure one step's tensor peak."""
    mf = load_model_file(model_file_path, plan.model.args)
    meta = build_meta_model(mf)
    units = _check_model(plan, mf, meta)  # step 1: before anything is allocated
    lr = lr if lr is not None else plan.training.lr
    if plan.training.cpu_threads and not torch.cuda.is_available():
        torch.set_num_threads(plan.training.cpu_threads)  # as many as the profile measured with
    if reference:
        if checkpoint_dir:
            raise PlannerError("--reference does not save checkpoints.", "Drop --checkpoint-dir for the reference run.")
        return _train_reference(plan, mf, meta, steps, seed, lr)
    if plan.layout.pp_degree > 1:
        check_splittable(meta, plan)
    device = _init_process_group()
    try:
        from planner.units import model_fingerprint

        fingerprint = model_fingerprint(meta, units)
        first_step, resume_from = _resume_point(checkpoint_dir, fingerprint, WeightStash.asynchronous(plan)) \
            if resume else (0, None)
        settings = RunSettings(steps, seed, lr, checkpoint_dir, resume_from, first_step, fingerprint, measure_tensor_peak)
        if plan.layout.stage_replicas is not None:  # PipeDream stage replication: its own executor
            from runtime.pp_replicated import train_replicated

            return train_replicated(plan, mf, settings, device)
        if WeightStash.asynchronous(plan) and plan.layout.pp_degree > 1 and \
                flush_free_blocker(plan.layout, plan.training) is None:  # PipeDream-2BW without a flush
            return train_flush_free(plan, mf, settings, device)
        return _train_parallel(plan, mf, settings, device)
    finally:
        dist.destroy_process_group()


def _check_model(plan: Plan, mf, meta: nn.Module) -> list[str]:
    """The plan against the model on meta: fingerprint, TP plan, experts. Returns the model's units."""
    traced = check_fingerprint(plan, meta, mf)
    check_tp_plan(plan, meta)
    check_ep(plan, meta)
    check_cp(plan, as_tuple(mf.make_batch(1)[0]))
    return traced.units


def _init_process_group() -> torch.device:
    """The default process group (NCCL on GPUs, gloo on CPU) and this rank's device."""
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, timeout=PROCESS_GROUP_TIMEOUT)
    return device


def _resume_point(checkpoint_dir: str | None, fingerprint: str, asynchronous: bool = False) -> tuple[int, str]:
    """The newest complete step saved in `checkpoint_dir` and its directory; `asynchronous`: the plan's
    schedule keeps two weight versions (runtime/pp_async.py), which the checkpoint must match."""
    if checkpoint_dir is None:  # runtime/launch.py `check_checkpoint_dir` says so before launch
        raise PlannerError("--resume needs --checkpoint-dir.", "Pass the directory a previous run saved to.")
    saved = checkpoint.read_meta(checkpoint_dir, fingerprint)
    checkpoint.check_resume_schedule(saved, asynchronous)
    first_step, resume_from = saved["step"], saved["directory"]
    if dist.get_rank() == 0:
        print(f"resuming from step {first_step} ({resume_from})", flush=True)
    return first_step, resume_from


def make_optimizer(module: torch.nn.Module, lr: float, weight_decay: float) -> torch.optim.Optimizer | None:
    """AdamW over `module`'s trainable parameters (requires_grad, as the model file built them:
    a LoRA model's frozen base weights get no optimizer state); None when it has none."""
    params = [p for p in module.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay) if params else None


def _train_reference(plan: Plan, mf, meta, steps: int, seed: int, lr: float) -> RunResult:
    model = materialize(meta, seed, torch.device("cpu"), init_mode(meta), mf)
    optimizer = make_optimizer(model, lr, plan.training.weight_decay)
    stash = WeightStash.of(plan, [model])  # pipedream-2bw: the same rule in one process (runtime/pp_async.py)
    losses, times = [], []
    timer = StageTimer(torch.device("cpu"))
    for step in range(steps):
        timer.step = step
        inputs, targets = batch_for_step(mf, plan.batch.global_batch_size, seed, step)
        start = time.perf_counter()
        model.zero_grad()
        if stash is not None:
            stash.swap_in()  # the gradient is taken at W(t-1)
        with timer.time(0, "forward"), _autocast(plan, torch.device("cpu")):
            out = model(*inputs)
            loss = mf.loss(_fp32(out), targets)
        with timer.time(0, "backward"):
            loss.backward()
        if stash is not None:
            stash.restore()  # the step updates W(t)
        if plan.training.grad_clip:
            clip_grad_norm([model], plan.training.grad_clip)
        if optimizer is not None:
            optimizer.step()
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return build_metrics(plan, losses, times, [peak_memory()], merge_stage_times([timer.summary()]), params, world_size=1)


@dataclass
class RunSettings:
    """How a parallel run trains, beyond what the plan says (the command line's options)."""

    steps: int
    """Steps to train."""
    seed: int
    """Seed of the initial values and of every step's batch (module docstring, Data)."""
    lr: float
    """Learning rate (the plan's unless `--lr` overrides it)."""
    checkpoint_dir: str | None = None
    """Save a DCP checkpoint here after the last step (runtime/checkpoint.py); None: no checkpoint."""
    resume_from: str | None = None
    """A saved step's directory to load before the first step; None: start fresh."""
    first_step: int = 0
    """Number of the first step (the checkpoint's step when resuming): it seeds the batches."""
    fingerprint: str = ""
    """The model's structural fingerprint (planner/units.py `model_fingerprint`), stored with a checkpoint."""
    measure_tensor_peak: bool = True
    """Measure one step's tensor peak (runtime/metrics.py `TensorPeakMeter`)."""


@dataclass
class RankModel:
    """This rank's share of the model after every parallelism is applied, and what its steps need."""

    mesh: DeviceMesh
    """The (pp, dp, tp) mesh (runtime/mesh.py)."""
    ep_mesh: DeviceMesh | None
    """Its (pp, edp, ep, tp) view for expert layers; None without expert parallelism."""
    chunks: list[tuple[int, nn.Module]]
    """(stage index, module) of each stage chunk this rank runs (one, the whole model, without pipelining)."""
    ties: list[CrossStageTie]
    """Weights tied across pipeline stages (runtime/pp_split.py); empty without pipelining."""
    tie_copies: list[list[tuple[int, nn.Parameter]]]
    """Per tie, this rank's (stage, parameter) copies, taken after FSDP replaced the parameters."""
    tie_groups: list[object]
    """Per tie, the process group summing its copies' gradients (runtime/mesh.py `build_tie_groups`)."""
    optimizers: list[torch.optim.Optimizer | None]
    """One per chunk (None for a chunk without trainable parameters)."""
    runner: PipelineRunner | None
    """The pipeline schedule over the chunks; None without pipelining."""
    stash: WeightStash | None = None
    """The older weight version of an asynchronous schedule (runtime/pp_async.py); None when synchronous."""
    reducer: GradientReducer | None = None
    """ZeRO 0 over dp > 1 with the `grad_reduce` overlap the plan assumes: the gradient averaging,
    bucketed and launched during the backward (runtime/apply_dp.py); None: `average_gradients` after it."""

    @property
    def modules(self) -> list[nn.Module]:
        return [m for _, m in self.chunks]

    @property
    def stepping(self) -> list[torch.optim.Optimizer]:
        """The optimizers that exist (chunks with trainable parameters)."""
        return [o for o in self.optimizers if o is not None]

    def rank(self, axis: str) -> int:
        """This rank's coordinate on a mesh axis ("pp", "dp" or "tp")."""
        return self.mesh[axis].get_local_rank()

    def uncounted(self) -> list[nn.Parameter]:
        """Tied copies other than each tie's first: their gradient norm is counted once, on the first."""
        return [p for t, copies in zip(self.ties, self.tie_copies, strict=False) for s, p in copies if s != t.stages[0]]


def _train_parallel(plan: Plan, mf, settings: RunSettings, device: torch.device) -> RunResult:
    """Build this rank's model, train it for `settings.steps` steps, and report (module docstring)."""
    model = _build_rank_model(plan, mf, settings, device)
    tensor_peak = TensorPeakMeter(device, settings.steps, enabled=settings.measure_tensor_peak)
    timer = StageTimer(device, tensor_peak.timing_warmup_steps())  # the measured step is not timed when others follow
    if settings.resume_from:
        _check_tied_resume(settings.resume_from, model.ties)
        checkpoint.load(settings.resume_from, model.modules, model.optimizers, model.stash)
    reports, times = [], []
    for step in range(settings.first_step, settings.first_step + settings.steps):
        loss, seconds = _train_step(plan, mf, model, settings, step, device, timer, tensor_peak)
        reports.append(loss)
        times.append(seconds)
    return _report(plan, model, settings, reports, times, timer, tensor_peak, device)


def _build_rank_model(plan: Plan, mf, settings: RunSettings, device: torch.device, flush_free: bool = False) -> RankModel:
    """Steps 2-8 of the module docstring: the meshes, this rank's chunks with every parallelism
    applied in order, the tied-weight groups, the optimizers and the pipeline schedule.
    `flush_free`: for runtime/pp_async.py's executor, which runs the chunk itself: no torch
    schedule and no overlapped gradient reducer (its hooks would see one weight version only)."""
    from runtime.mesh import build_cp_mesh, build_ep_mesh, build_fsdp_mesh, build_mesh, build_tie_groups

    lay = plan.layout
    mesh = build_mesh(plan, device.type)
    # (pp, edp, ep, tp), or this stage's (edp, ep) folded over dp x tp with SP; None without EP
    ep_mesh = build_ep_mesh(mesh, lay.ep_degree, fold_tp=lay.sequence_parallel and lay.tp_degree > 1)
    fsdp_mesh = build_fsdp_mesh(mesh, lay.shard_degree)  # dp, or (dp_replicate, dp_shard) for HSDP
    meta = build_meta_model(mf)
    mode = init_mode(meta)
    ties = cross_stage_ties(meta, plan) if lay.pp_degree > 1 else []  # weights held by several stages
    chunks = _stage_chunks(plan, mf, meta, mesh, device)
    _parallelize_chunks(plan, mf, chunks, settings.seed, mode, device, mesh, ep_mesh, fsdp_mesh)
    cp_mesh = build_cp_mesh(mesh, lay.cp_degree)  # (pp, dp_outer, cp, tp); None without CP
    if cp_mesh is not None:  # last: its hooks cover every module as it runs, recomputed ones too (runtime/apply_cp.py)
        for _, chunk in chunks:  # each pipeline stage's chunk: its tokens are this rank's sequence chunks
            apply_cp(chunk, cp_mesh["cp"], as_tuple(mf.make_batch(1)[0]), device, lay.cp_algorithm,
                     require_attention=lay.pp_degree == 1 or has_attention_modules(chunk))
    tie_groups = build_tie_groups(mesh, [t.pp_ranks for t in ties])
    tie_copies = [t.copies(chunks) for t in ties]  # after FSDP, which replaces the parameters
    # One optimizer per chunk (AdamW is per parameter, so this is the same update): each
    # chunk's optimizer state is then keyed by its own parameter names (runtime/checkpoint.py).
    # A chunk without trainable parameters (a stage of rotary embeddings alone, or of frozen
    # weights only) has none.
    optimizers = [make_optimizer(m, settings.lr, plan.training.weight_decay) for _, m in chunks]
    runner = None
    if lay.pp_degree > 1 and not flush_free:
        loss_fn = lambda out, tgt: mf.loss(_fp32(out), tgt)  # noqa: E731  (16-bit logits: loss in fp32)
        example, _ = _local_batch(mf, plan, settings.seed, settings.first_step, mesh["dp"].get_local_rank(), device)
        example_microbatch = tuple(_slice(x, 0, plan.batch.micro_batch_size) for x in example)
        runner = build_schedule(chunks, plan, mesh["pp"].get_group(), device, loss_fn, example_microbatch)
    # Asynchronous schedule: the older weights, W(-1) = W(0) (a checkpoint loaded later fills them).
    stash = WeightStash.of(plan, [m for _, m in chunks])
    reducer = None
    if lay.zero_stage == 0 and lay.dp_degree > 1 and overlaps_gradient_reduction(plan) and not flush_free:
        modules = [m for _, m in chunks]
        reducer = GradientReducer(modules, mesh["dp"].get_group(), expert_parameters(modules),
                                  ep_mesh["edp"].get_group() if ep_mesh is not None else None)
        if runner is not None:  # torch's schedules divide each stage's gradients by m once its backward is done
            runner.report_scaling(reducer.note_scaled)
    return RankModel(mesh, ep_mesh, chunks, ties, tie_copies, tie_groups, optimizers, runner, stash, reducer)


def overlaps_gradient_reduction(plan: Plan) -> bool:
    """Whether the runtime overlaps ZeRO 0's gradient reduction with the backward: as the plan's
    prediction assumes (`Prediction.overlap` names `grad_reduce`), and by default for a plan
    predicted before overlaps were recorded or written by hand without a prediction."""
    overlap = plan.prediction.overlap if plan.prediction is not None else None
    return overlap is None or "grad_reduce" in overlap


def _stage_chunks(plan: Plan, mf, meta: nn.Module, mesh: DeviceMesh, device: torch.device) -> list[tuple[int, nn.Module]]:
    """Step 3: the model on meta cut into this rank's stage chunks; the whole model without pipelining."""
    lay = plan.layout
    if lay.pp_degree == 1:
        return [(0, meta)]
    # torch's schedule calls the stage modules itself: autocast goes inside their forward.
    scatter = mesh["tp"].get_group() if (lay.p2p_scatter_gather and lay.tp_degree > 1) else None
    return build_stage_modules(meta, plan, mesh["pp"].get_local_rank(),
                               meta_inputs(mf, plan.batch.micro_batch_size, lay.cp_degree),
                               forward_context=lambda: _autocast(plan, device), scatter_group=scatter)


def _parallelize_chunks(plan: Plan, mf, chunks: list[tuple[int, nn.Module]], seed: int, mode, device: torch.device,
                        mesh: DeviceMesh, ep_mesh: DeviceMesh | None, fsdp_mesh: DeviceMesh) -> None:
    """Steps 4-7 of the module docstring on each chunk, in place and in that order (each step
    needs the one before it): materialise, FP8 linears (where the plan asks), TP, EP, recompute, FSDP."""
    lay = plan.layout
    for s, model in chunks:
        stage = plan.stages[s]
        materialize(model, seed, device, mode, mf)
        apply_float8(model, plan, device)  # FP8 linears before TP/FSDP wrap them (runtime/apply_fp8.py); no-op for bf16
        apply_tp(model, mesh["tp"], stage.tp_plan, lay.sequence_parallel, stage.units, stage.tp_copy_outputs,
                 stage.tp_feeds)
        if ep_mesh is not None or lay.expert_tp_degree > 1:  # experts over ep and/or split over tp (apply_ep.py)
            axes = ("ep",) if lay.expert_tp_degree == 1 else ("tp",) if ep_mesh is None else ("ep", "tp")
            apply_ep(model, (ep_mesh if ep_mesh is not None else mesh)[axes], expert_tp=lay.expert_tp_degree > 1)
        if lay.sequence_parallel and lay.tp_degree > 1:  # MoE blocks on local tokens: whole-sequence router statistics
            apply_moe_sequence_parallel(model, mesh["tp"], experts_replicated=ep_mesh is None)
        apply_unit_recompute(model, stage.unit_modes())
        if lay.zero_stage >= 1 and (lay.dp_degree > 1 or plan.training.offload != "none"):  # offload: FSDP2 even on one dp rank
            apply_fsdp(model, fsdp_mesh, stage.units, lay.zero_stage, ep_mesh["edp"] if ep_mesh is not None else None,
                       offload=plan.training.offload)


def _train_step(plan: Plan, mf, model: RankModel, settings: RunSettings, step: int, device: torch.device,
                timer: StageTimer, tensor_peak: TensorPeakMeter) -> tuple[torch.Tensor, float]:
    """One optimizer step: forward and backward over the micro-batches, the gradient reductions,
    clipping, the update. Returns this rank's share of the step's loss (see `_report`) and its seconds."""
    index = step - settings.first_step
    timer.step = index
    tensor_peak.open(index)  # before the batch: the warm-up's batch is then seen freed
    inputs, targets = _local_batch(mf, plan, settings.seed, step, model.rank("dp"), device)
    if model.runner is not None:  # a pipeline rank keeps what its stages read: inputs first, targets last
        inputs, targets = (inputs if model.runner.has_first else ()), (targets if model.runner.has_last else None)
    start = time.perf_counter()
    for optimizer in model.stepping:
        optimizer.zero_grad()
    tensor_peak.start(index)  # after zero_grad: the gradients it frees are not the step's
    if model.reducer is not None:  # each parameter's gradient is final after its m-th backward
        model.reducer.start_step(plan.batch.num_microbatches)
    if model.stash is not None:  # pipedream-2bw: forward and backward at W(t-1) (runtime/pp_async.py)
        model.stash.swap_in()
    if model.runner is not None:
        mean_loss = model.runner.step(inputs, targets)  # the last stage's mean over micro-batches, else None
        local_loss = mean_loss.float() if mean_loss is not None else torch.zeros((), device=device)
        timer.record(model.runner.stage_times, plan.batch.num_microbatches)
    else:
        local_loss = _forward_backward(plan, mf, model.modules[0], inputs, targets, timer, device)
    _reduce_gradients(plan, model)
    if model.stash is not None:  # the gradient taken at W(t-1) updates W(t)
        model.stash.restore()
    if plan.training.grad_clip:  # after the dp reduction: the norm of the averaged gradient
        clip_grad_norm(model.modules, plan.training.grad_clip, model.mesh["pp"].get_group(), model.uncounted())
    for optimizer in model.stepping:
        optimizer.step()
    synchronize(device)  # the step's kernels are done, not just queued
    seconds = time.perf_counter() - start
    tensor_peak.stop(index)
    # One copy per data-parallel replica reports (last stage, tp rank 0); the mean over replicas is the global mean.
    has_last = any(s == len(plan.stages) - 1 for s, _ in model.chunks)
    reports = has_last and model.rank("tp") == 0
    return (local_loss.detach().to(device) if reports else torch.zeros((), device=device)), seconds


def _forward_backward(plan: Plan, mf, module: nn.Module, inputs: tuple, targets, timer: StageTimer,
                      device: torch.device) -> torch.Tensor:
    """Without pipelining: forward and backward of each micro-batch in turn, gradients accumulated;
    returns the step's mean loss."""
    lay, batch = plan.layout, plan.batch
    local_loss = torch.zeros((), device=device)
    m = batch.num_microbatches
    for k in range(m):
        lo, hi = k * batch.micro_batch_size, (k + 1) * batch.micro_batch_size
        # ZeRO-1 reduce-scatters gradients once per step, after the last micro-batch, as the
        # cost model prices it (planner/solver/comm_pricing.py; Megatron's distributed
        # optimizer). ZeRO 2-3 shard gradients, so they reduce-scatter every micro-batch:
        # holding unsharded gradients across micro-batches would undo that memory saving.
        if lay.zero_stage == 1 and isinstance(module, FSDPModule):
            module.set_requires_gradient_sync(k == m - 1)
        if lay.zero_stage in (1, 2) and isinstance(module, FSDPModule):
            # Parameters stay gathered until the step's last backward: one all-gather per
            # step, as priced (reshard_after_forward is already off for ZeRO 1-2).
            module.set_reshard_after_backward(k == m - 1)
        with timer.time(0, "forward"):
            with _autocast(plan, device):
                out = module(*(_slice(x, lo, hi) for x in inputs))
            loss = mf.loss(_fp32(out), _slice(targets, lo, hi)) / m
        with timer.time(0, "backward"):
            loss.backward()
        local_loss += loss.detach().float()
    return local_loss


def _reduce_gradients(plan: Plan, model: RankModel) -> None:
    """The gradient reductions FSDP and the pipeline schedule do not do themselves: data
    parallelism without ZeRO, expert parameters, TP's partial gradients, tied copies."""
    lay, modules, ep_mesh = plan.layout, model.modules, model.ep_mesh
    if lay.zero_stage == 0 and model.reducer is not None:
        model.reducer.finish()  # the same sums and divisors, launched during the backward
    elif lay.zero_stage == 0:
        # Expert parameters over expert-dp, divided by the whole dp degree (apply_dp.average_gradients).
        average_gradients(modules, model.mesh["dp"].get_group(), expert_parameters(modules),
                          ep_mesh["edp"].get_group() if ep_mesh is not None else None)
    elif ep_mesh is not None:  # FSDP divided the experts' sums by expert-dp, not dp (apply_dp.apply_fsdp)
        scale_gradients(expert_parameters(modules), ep_mesh["edp"].size() / lay.dp_degree)
    if lay.tp_degree > 1:  # replicated parameters inside a column/row pair saw a share of the heads
        sum_partial_gradients(modules, model.mesh["tp"].get_group())
    if model.ties:  # tied copies take the same step: their gradients summed (runtime/pp_split.py)
        sum_tied_gradients([[p for _, p in copies] for copies in model.tie_copies], model.tie_groups)


def _report(plan: Plan, model: RankModel, settings: RunSettings, reports: list[torch.Tensor], times: list[float],
            timer: StageTimer, tensor_peak: TensorPeakMeter, device: torch.device) -> RunResult:
    """After the last step: the losses, the checkpoint, the full parameters, every rank's peaks and
    stage times, and one pipeline's timeline, gathered into the run's metrics (every rank joins)."""
    lay, world_size = plan.layout, dist.get_world_size()
    dp_rank, tp_rank = model.rank("dp"), model.rank("tp")
    # Summed once after the loop: a collective per step would add a synchronisation of all
    # ranks to every step that the training itself does not need.
    total = torch.stack(reports) if reports else torch.zeros(0, device=device)
    dist.all_reduce(total)
    losses = (total / lay.dp_degree).tolist()
    if settings.checkpoint_dir:
        checkpoint.save(settings.checkpoint_dir, model.modules, model.optimizers, settings.first_step + settings.steps,
                        settings.fingerprint, resumed_from=settings.resume_from, stash=model.stash)
    # A tied weight under the reference's name for it (named_parameters() keeps the first).
    aliases = {name: t.names[0] for t in model.ties for name in t.names}
    params = _full_parameters(model.modules, keep=dp_rank == 0 and tp_rank == 0, aliases=aliases)
    peaks, tensor_peaks = _gather(peak_memory()), _gather(tensor_peak.peak_bytes)
    stage_times = _gather(timer.summary())
    timeline = None
    if model.runner is not None:  # the last step's actions of one pipeline (dp and tp rank 0), for a measured Gantt
        events = _gather(model.runner.events if (dp_rank == 0 and tp_rank == 0) else None)
        timeline = timeline_of([e for e in events if e is not None], lay.schedule, lay.pp_degree)
    # Every rank past its last collective before any tears the group down (gloo aborts a
    # process whose peer closed a connection it still reads from).
    dist.barrier()
    return build_metrics(plan, losses, times, peaks, merge_stage_times(stage_times), params, world_size=world_size,
                         timeline=timeline, peak_tensor_bytes=tensor_peaks, warmup_steps=timer.warmup_steps)


def _gather(obj: T) -> list[T]:
    """`obj` of every rank, in rank order (every rank calls it)."""
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _check_tied_resume(directory: str, ties: list[CrossStageTie]) -> None:
    """Refuse to resume with a tied weight cut across stages from a checkpoint saved with it whole:
    that checkpoint keys the optimizer state by the weight's first name only (one parameter), and
    the stage holding the copy under another name would find none. (The reverse works: a cut
    plan saves every copy under its own name.)"""
    if not ties:
        return
    import torch.distributed.checkpoint as dcp

    keys = set(dcp.FileSystemReader(str(directory)).read_metadata().state_dict_metadata)
    missing = [name for t in ties for name in t.names[1:]
               if f"optim.state.{t.names[0]}.step" in keys and f"optim.state.{name}.step" not in keys]
    if missing:
        raise PlannerError(
            f"The checkpoint in {directory} was saved with tied weights in one stage, so it holds no optimizer state "
            f"for {missing}, which this plan keeps as a copy on another pipeline stage.",
            "Resume under a plan that keeps the tied units in one stage (e.g. the saving plan), or start fresh.")


def _full_parameters(modules, keep: bool = True, aliases: dict[str, str] | None = None) -> dict:
    """Full (unsharded) parameters by original name (renamed by `aliases`); every rank joins the gathers."""
    out = {}
    for module in modules:
        for name, p in module.named_parameters():
            full = p.full_tensor() if hasattr(p, "full_tensor") else p
            if keep:
                name = name.replace("_checkpoint_wrapped_module.", "")
                out[(aliases or {}).get(name, name)] = full.detach().cpu().clone()
    return out
