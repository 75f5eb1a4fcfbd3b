"""One training run under a plan (`python -m runtime PLAN` on every rank), or the reference.

The order of construction is fixed, and each step needs the one before it:

1. check the plan against the model (before anything is allocated);
2. the (pp, dp, tp) mesh (runtime/mesh.py);
3. per stage chunk this rank holds: build the model on meta, drop the other units,
   materialise and initialise (runtime/build.py: identical to the reference's values);
4. pipeline stage forward (runtime/apply_pp.py), since TP and FSDP must see the module
   that will actually run;
5. tensor parallelism (runtime/apply_tp.py), which shards the initialised full tensors;
6. activation checkpointing (runtime/recompute.py), inside the sharding wrappers;
7. FSDP (runtime/apply_dp.py) last, wrapping the TP-sharded parameters on the dp mesh;
8. the pipeline schedule, the optimizer, then the loop.

Data: step s's global batch is `make_batch(global_batch_size)` under a seed made of
(seed, s); every rank draws it and keeps its data-parallel slice, which the micro-batches
then split. The loss reported is the mean over the global batch, as in the reference.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from planner.errors import PlannerError
from planner.model_file import load_model_file
from planner.plan import Plan
from runtime import checkpoint
from runtime.apply_dp import apply_fsdp, average_gradients
from runtime.apply_pp import build_schedule, check_chain, make_stage_module, stage_indices
from runtime.apply_tp import apply_tp, check_tp_plan
from runtime.build import as_tuple, build_meta_model, check_fingerprint, init_mode, materialize
from runtime.grad_clip import clip_grad_norm
from runtime.metrics import StageTimer, build_metrics, merge_stage_times, peak_memory
from runtime.recompute import apply_recompute

PROCESS_GROUP_TIMEOUT = timedelta(seconds=120)  # a dead peer fails the job instead of hanging it


def batch_for_step(model_file, global_batch_size: int, seed: int, step: int):
    torch.manual_seed(seed * 100_003 + step)
    inputs, targets = model_file.make_batch(global_batch_size)
    return as_tuple(inputs), targets


def _to(x, device):
    return x.to(device) if isinstance(x, torch.Tensor) else x


def _autocast(plan: Plan, device):
    """Mixed precision: fp32 master weights, 16-bit compute where autocast allows it."""
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(plan.training.dtype)
    return torch.autocast(device.type, dtype=dtype, enabled=dtype is not None)


def _fp32(output):
    """16-bit logits go to the loss in fp32; a model output object (Hugging Face's) gets its logits cast."""
    if isinstance(output, torch.Tensor):
        return output.float()
    logits = getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor) and logits.dtype != torch.float32:
        output.logits = logits.float()
    return output


def _slice(x, start: int, stop: int):
    return x[start:stop] if isinstance(x, torch.Tensor) else x


def train(plan: Plan, model_file_path: str, steps: int, seed: int, lr: float | None, reference: bool,
          checkpoint_dir: str | None = None, resume: bool = False) -> dict:
    mf = load_model_file(model_file_path, plan.model.args)
    meta = build_meta_model(mf)
    traced = check_fingerprint(plan, meta, mf)
    check_tp_plan(plan, meta)
    units = traced.units
    lay = plan.layout
    lr = lr if lr is not None else plan.training.lr
    if reference:
        if checkpoint_dir:
            raise PlannerError("--reference does not save checkpoints.", "Drop --checkpoint-dir for the reference run.")
        return _train_reference(plan, mf, units, meta, steps, seed, lr)
    if lay.pp_degree > 1:
        check_chain(traced, plan)
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, timeout=PROCESS_GROUP_TIMEOUT)
    try:
        from planner.units import model_fingerprint

        fingerprint = model_fingerprint(meta, units)
        first_step = 0
        if resume:
            first_step = checkpoint.read_meta(checkpoint_dir, fingerprint)["step"]
        return _train_parallel(plan, mf, units, steps, seed, lr, device, checkpoint_dir, resume, first_step, fingerprint)
    finally:
        dist.destroy_process_group()


def _train_reference(plan: Plan, mf, units, meta, steps: int, seed: int, lr: float) -> dict:
    model = materialize(meta, units, None, seed, torch.device("cpu"), init_mode(meta), mf)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=plan.training.weight_decay)
    losses, times = [], []
    timer = StageTimer(torch.device("cpu"))
    for step in range(steps):
        timer.step = step
        inputs, targets = batch_for_step(mf, plan.batch.global_batch_size, seed, step)
        start = time.perf_counter()
        optimizer.zero_grad()
        with timer.time(0, "forward"), _autocast(plan, torch.device("cpu")):
            out = model(*inputs)
            loss = mf.loss(_fp32(out), targets)
        with timer.time(0, "backward"):
            loss.backward()
        if plan.training.grad_clip:
            clip_grad_norm([model], plan.training.grad_clip)
        optimizer.step()
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return build_metrics(plan, losses, times, [peak_memory()], merge_stage_times([timer.summary()]), params, world_size=1)


def _train_parallel(plan: Plan, mf, units, steps: int, seed: int, lr: float, device, checkpoint_dir=None, resume=False,
                    first_step: int = 0, fingerprint: str = "") -> dict:
    from runtime.mesh import build_mesh

    lay, batch = plan.layout, plan.batch
    mesh = build_mesh(plan, device.type)
    pp_rank, dp_rank, tp_rank = (mesh[axis].get_local_rank() for axis in ("pp", "dp", "tp"))
    chunks = []
    for s in stage_indices(plan, pp_rank):
        stage = plan.stages[s]
        model = build_meta_model(mf)
        keep = set(stage.units) if lay.pp_degree > 1 else None
        model = materialize(model, units, keep, seed, device, init_mode(model), mf)
        if lay.pp_degree > 1:
            make_stage_module(model, stage.units, lambda: _autocast(plan, device))
        apply_tp(model, mesh["tp"], stage.tp_plan, lay.sequence_parallel, stage.units)
        apply_recompute(model, stage.units, stage.recompute)
        if lay.zero_stage >= 1 and lay.dp_degree > 1:
            apply_fsdp(model, mesh["dp"], stage.units, lay.zero_stage)
        chunks.append((s, model))
    modules = [m for _, m in chunks]
    optimizer = torch.optim.AdamW([p for m in modules for p in m.parameters()], lr=lr, weight_decay=plan.training.weight_decay)
    loss_fn = lambda out, tgt: mf.loss(_fp32(out), tgt)  # noqa: E731  (16-bit logits: loss in fp32)
    schedule = build_schedule(chunks, plan, mesh["pp"].get_group(), device, loss_fn) if lay.pp_degree > 1 else None
    timer = StageTimer(device)
    if schedule is not None:
        timer.watch_pipeline(schedule)
    if resume:
        checkpoint.load(checkpoint_dir, modules, optimizer)
    has_first = any(s == 0 for s, _ in chunks)
    has_last = any(s == len(plan.stages) - 1 for s, _ in chunks)
    local = batch.micro_batch_size * batch.num_microbatches
    losses, times = [], []
    for step in range(first_step, first_step + steps):
        timer.step = step - first_step
        inputs, targets = batch_for_step(mf, batch.global_batch_size, seed, step)
        inputs = tuple(_to(_slice(x, dp_rank * local, (dp_rank + 1) * local), device) for x in inputs)
        targets = _to(_slice(targets, dp_rank * local, (dp_rank + 1) * local), device)
        start = time.perf_counter()
        optimizer.zero_grad()
        if schedule is not None:
            mb_losses: list = []
            schedule.step(*(inputs if has_first else ()), target=targets if has_last else None, losses=mb_losses if has_last else None)
            local_loss = torch.stack([x.detach().float() for x in mb_losses]).mean() if has_last else torch.zeros(())
        else:
            local_loss = torch.zeros((), device=device)
            m = batch.num_microbatches
            for k in range(m):
                lo, hi = k * batch.micro_batch_size, (k + 1) * batch.micro_batch_size
                with timer.time(0, "forward"):
                    with _autocast(plan, device):
                        out = modules[0](*(_slice(x, lo, hi) for x in inputs))
                    loss = mf.loss(_fp32(out), _slice(targets, lo, hi)) / m
                with timer.time(0, "backward"):
                    loss.backward()
                local_loss += loss.detach().float()
        if lay.zero_stage == 0:
            average_gradients(modules, mesh["dp"].get_group())
        if plan.training.grad_clip:  # after the dp reduction: the norm of the averaged gradient
            clip_grad_norm(modules, plan.training.grad_clip, mesh["pp"].get_group())
        optimizer.step()
        times.append(time.perf_counter() - start)
        # One copy per data-parallel replica reports (last stage, tp rank 0); the mean over replicas is the global mean.
        report = local_loss.to(device) if (has_last and tp_rank == 0) else torch.zeros((), device=device)
        dist.all_reduce(report)
        losses.append(report.item() / lay.dp_degree)
    if checkpoint_dir:
        checkpoint.save(checkpoint_dir, modules, optimizer, first_step + steps, fingerprint)
    params = _full_parameters(modules) if (dp_rank == 0 and tp_rank == 0) else _full_parameters(modules, keep=False)
    peaks, stage_times = [None] * dist.get_world_size(), [None] * dist.get_world_size()
    dist.all_gather_object(peaks, peak_memory())
    dist.all_gather_object(stage_times, timer.summary())
    return build_metrics(plan, losses, times, peaks, merge_stage_times(stage_times), params, world_size=dist.get_world_size())


def _full_parameters(modules, keep: bool = True) -> dict:
    """Full (unsharded) parameters by original name; every rank joins the gathers."""
    out = {}
    for module in modules:
        for name, p in module.named_parameters():
            full = p.full_tensor() if hasattr(p, "full_tensor") else p
            if keep:
                out[name.replace("_checkpoint_wrapped_module.", "")] = full.detach().cpu().clone()
    return out
