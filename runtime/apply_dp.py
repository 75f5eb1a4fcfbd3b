"""Data parallelism: replicated parameters with gradient averaging (ZeRO 0) or FSDP2.

Frozen parameters (requires_grad=False) have no gradient: never reduced (`trained`); FSDP2
shards them with the trainable ones of their unit and reduce-scatters only the gradients
that exist (its post-backward skips parameters without one), so a LoRA layer's frozen base
weight and its adapters share one FSDP group.

ZeRO 0 averages gradients over the dp group (expert parameters over expert-dp, with the
same divisor: `average_gradients`) after the step's last backward (one
all-reduce of a flat bucket; written by hand because DDP does not
compose with torch's pipeline schedules and DTensor parameters as simply). ZeRO 1-3 use
FSDP2 `fully_shard` on every unit and on the stage: ZeRO-3 reshards parameters after each
forward; ZeRO-1/2 keep them gathered between forward and backward
(`reshard_after_forward=False`), which is the closest FSDP2 offers (it shards gradients
and optimizer state in both).

Hybrid sharding (planner/plan.py `Layout.shard_degree`): the same calls on the 2D
(dp_replicate, dp_shard) mesh of runtime/mesh.py `build_fsdp_mesh`. FSDP2 then shards over
dim 1 and replicates over dim 0: each gradient is reduce-scattered inside the shard group and
its shard all-reduced across the replica groups, each divided by its group's size, so the
result is the mean over all dp ranks, as with plain sharding; parameters are all-gathered
inside the shard group only. Gradients and parameters are DTensors placed (Replicate,
Shard(0)) on that mesh: DTensor reduces their norm over it (runtime/grad_clip.py groups by
mesh), `full_tensor` gathers them, and DCP saves one copy of each shard (the replicas'
copies are deduplicated), so a checkpoint saved under HSDP loads under any other sharding.

Offload (planner/plan.py `Training.offload`): FSDP2's `CPUOffloadPolicy` on every
`fully_shard` call. On a GPU it keeps the sharded parameters, their gradients and hence the
AdamW state (created from those parameters, runtime/train.py `make_optimizer`) in pinned
host memory: parameters go host-to-device before each all-gather, gradients device-to-host
after each reduce-scatter, and the optimizer step runs on the CPU. The parameters and
gradients are then host tensors on a GPU mesh, so whatever reduces or gathers them as DTensors
(runtime/grad_clip.py's norm, `full_tensor`, DCP) needs a CPU backend in the process group
beside NCCL ("cuda:nccl,cpu:gloo", as torchtitan's `_get_distributed_backend` picks with
CPU offload; runtime/train.py chooses the backend). On CPU processes (gloo)
every tensor already lives in host memory: FSDP2's copies to and from `cpu` return the same
tensor, and pinning is off (it needs an accelerator: `pin_memory()` raises without one). A CPU
run therefore checks the wiring (the policy is accepted by every `fully_shard`, the optimizer
steps the offloaded shards, training matches the reference) but not the transfers, their
overlap with compute, nor the device memory saved; those show only on a GPU.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor

from planner.units import tied_units


def apply_fsdp(module: nn.Module, dp_mesh: DeviceMesh, units: list[str], zero_stage: int,
               expert_dp_mesh: DeviceMesh | None = None, offload: str = "none") -> None:
    """`fully_shard` each unit, then the stage. Units that share a parameter (tied embeddings)
    form one FSDP group, as FSDP2 requires of a shared parameter.

    `dp_mesh`: the dp mesh, or for hybrid sharding the 2D (replicate, shard) mesh
    (runtime/mesh.py `build_fsdp_mesh`). `offload`: "cpu" for `CPUOffloadPolicy` (module docstring).

    Expert parallelism (runtime/apply_ep.py): each experts module is sharded first, on its own,
    over `expert_dp_mesh` (the ranks holding the same experts; torchtitan's dp_mod_ep), so the
    units' FSDP groups leave its parameters out. Its reduce-scatter sums over expert-dp what the
    all-to-all's backward summed over the EP group, so the sum must be divided by the whole dp
    degree (see `average_gradients`, Scale); FSDP divides by the expert-dp size, and
    `scale_gradients` multiplies by expert-dp / dp after the step's backward (1 / ep, or tp / ep
    with EP folded over the TP ranks: runtime/mesh.py `build_ep_mesh`). (FSDP's own
    set_gradient_divide_factor reduces with PREMUL_SUM, which gloo lacks.)"""
    present = dict(module.named_modules())
    reshard = zero_stage >= 3
    policy = offload_policy(offload, dp_mesh.device_type)
    if expert_dp_mesh is not None:
        for experts in getattr(module, "_ep_modules", ()):
            fully_shard(experts, mesh=expert_dp_mesh, reshard_after_forward=reshard, offload_policy=policy)
    held = [name for name in units if name in present and any(True for _ in present[name].parameters())]
    tied = [group for group in tied_units(module, held)]
    grouped = {name for group in tied for name in group}
    joining = _holders_outside_units(present, held)
    for group in [*tied, *([name] for name in held if name not in grouped)]:
        targets = [present[name] for name in group] + [present[m] for name in group for m in joining.get(name, ())]
        fully_shard(targets if len(targets) > 1 else targets[0], mesh=dp_mesh, reshard_after_forward=reshard,
                    offload_policy=policy)
    fully_shard(module, mesh=dp_mesh, reshard_after_forward=reshard, offload_policy=policy)
    _clone_inputs_written_in_place(module)


def _clone_inputs_written_in_place(module: nn.Module) -> None:
    """Let a module that writes its input in place (`inplace=True`: torchvision's EfficientNet and
    MobileNet start their classifier unit with `Dropout(inplace=True)`) take an FSDP unit's input.

    FSDP2 passes each sharded module's inputs through an autograd Function that returns them as
    they are (`RegisterPostBackwardFunction`, which fires the unit's post-backward), so they are
    views made by a custom Function, which autograd refuses to modify in place. Such a module gets
    a copy instead: the write lands on the copy, as it would on the input itself where nothing
    reads the input after the module (the usual case; the one-process parity tests would see
    otherwise). Only those inputs are copied, only ahead of in-place modules."""
    for sub in module.modules():
        if getattr(sub, "inplace", False) is True:
            sub.register_forward_pre_hook(_copy_fsdp_views)


def _copy_fsdp_views(_module: nn.Module, args: tuple) -> tuple | None:
    def made_by_fsdp(x: Any) -> bool:
        return isinstance(x, torch.Tensor) and type(x.grad_fn).__name__ == "RegisterPostBackwardFunctionBackward"

    if not any(made_by_fsdp(a) for a in args):
        return None
    return tuple(a.clone() if made_by_fsdp(a) else a for a in args)


def _holders_outside_units(present: dict[str, nn.Module], held: list[str]) -> dict[str, list[str]]:
    """Per unit, the modules outside every unit that own one of its parameters: Hugging Face's T5
    keeps its embedding as `shared`, which the forward never calls, and reaches it through the
    tied `encoder.embed_tokens` and `decoder.embed_tokens`. FSDP2 wants every holder of a shared
    parameter in one group; left to the root's, `shared` would be a second manager of it."""
    owner = {id(p): name for name in held for p in present[name].parameters()}
    joining: dict[str, list[str]] = {}
    for name, mod in present.items():
        if not name or any(name == u or name.startswith(u + ".") for u in held):
            continue
        for p in mod._parameters.values():
            if p is not None and id(p) in owner and name not in joining.get(owner[id(p)], []):
                joining.setdefault(owner[id(p)], []).append(name)
    return joining


def offload_policy(offload: str, device_type: str) -> OffloadPolicy:
    """FSDP2's policy for planner/plan.py `Training.offload`: `CPUOffloadPolicy` for "cpu", pinned
    only on an accelerator (pinning needs one; on CPU processes the policy is wiring only, module
    docstring); the default `OffloadPolicy` (nothing offloaded) for "none"."""
    if offload == "cpu":
        return CPUOffloadPolicy(pin_memory=device_type != "cpu")
    if offload != "none":
        raise ValueError(f"unknown offload {offload!r}; the plan schema allows 'none' and 'cpu'")
    return OffloadPolicy()


def average_gradients(modules: list[nn.Module], dp_group, expert_params=(), expert_dp_group=None) -> None:
    """All-reduce and average every gradient over the dp group (ZeRO 0); the expert parameters
    of expert parallelism (runtime/apply_ep.py) over their expert-dp group instead.

    Scale. Rank r's loss L_r is the mean over its local batch; the reference's is the mean over
    the global batch, so its gradient is (1/dp) * sum_r grad L_r. A replicated parameter holds
    grad L_r: sum over dp, divide by dp. An expert parameter lives on one rank of each EP group,
    and the all-to-all's backward has already summed into it the gradients of every rank of
    that EP group; summing over expert-dp (the dp / ep groups holding the same experts) then
    counts every dp rank exactly once, so it too is divided by dp_degree, not by the expert-dp
    size (that would leave it ep times too large; torchtitan's FSDP gradient_divide_factor for
    experts is the same dp degree)."""
    size = dist.get_world_size(dp_group)
    if size == 1:
        return
    experts = {id(p) for p in expert_params}
    _sum_and_divide(_local_grads(p for module in modules for p in module.parameters() if id(p) not in experts), dp_group, size)
    _sum_and_divide(_local_grads(expert_params), expert_dp_group, size)


def trained(params) -> list[nn.Parameter]:
    """The parameters among `params` that train and hold a gradient. A frozen parameter
    (requires_grad=False, as the model file built it: a LoRA model's base weights) has no
    gradient and no optimizer state (runtime/train.py), so it is never reduced or clipped;
    every rank freezes the same parameters, so every rank reduces the same list. A trainable
    parameter no micro-batch reached has no gradient either, on every replica alike."""
    return [p for p in params if p.requires_grad and p.grad is not None]


def _local_grads(params) -> list[torch.Tensor]:
    """The (local shards of the) gradients of `trained(params)`."""
    return [_local(p.grad) for p in trained(params) if p.grad is not None]


def scale_gradients(params, factor: float) -> None:
    """Multiply the (local shards of the) gradients of `params` by `factor`, in place."""
    for p in params:
        if p.grad is not None:
            _local(p.grad).mul_(factor)


def _sum_and_divide(grads: list[torch.Tensor], group, divisor: int) -> None:
    """Sum `grads` over `group` (None or one rank: nothing to sum) and divide them by `divisor`."""
    if group is not None and dist.get_world_size(group) == 1:
        group = None
    # One flat bucket per dtype, as DDP buckets gradients: one collective's latency, not one per tensor.
    for dtype in {g.dtype for g in grads}:
        same = [g for g in grads if g.dtype == dtype]
        flat = torch.cat([g.reshape(-1) for g in same])
        if group is not None:
            dist.all_reduce(flat, group=group)
        flat.div_(divisor)
        offset = 0
        for g in same:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()


def _local(t: torch.Tensor) -> torch.Tensor:
    """The tensor a rank holds (a DTensor's shard: FSDP2 and TP gradients)."""
    return t._local_tensor if hasattr(t, "_local_tensor") else t


def _placed_as_parameter(p: nn.Parameter) -> torch.Tensor:
    """`p.grad` (there is one), made a DTensor placed as `p` where it is one placed otherwise:
    DTensor's embedding backward leaves a row-sharded (vocabulary-parallel) weight a replicated
    gradient, whose local tensor is the whole weight's; slicing it to the parameter's shard
    costs no communication."""
    grad = p.grad
    assert grad is not None, "called on parameters with a gradient"
    if isinstance(p, DTensor) and isinstance(grad, DTensor) and grad.placements != p.placements:
        p.grad = grad = grad.redistribute(p.device_mesh, p.placements)
    return grad


def sum_tied_gradients(copies: list[list[nn.Parameter]], groups: list) -> None:
    """Megatron-LM's embedding all-reduce: per weight tied across stages, the sum of its copies'
    gradients (this rank's copies, then the pipeline ranks in `groups`, None: none other) in
    every copy, so that all copies take the same optimizer step and stay equal. After the
    last backward and the dp reduction, before clipping. Every copy of one weight is placed
    alike on its mesh (the same dp shard; TP shards every copy along the vocabulary:
    planner/solver/costs.py `tie_pins`), so local shards add once each gradient is placed as
    its parameter (`_placed_as_parameter`)."""
    for params, group in zip(copies, groups, strict=True):
        grads = [_local(_placed_as_parameter(p)) for p in params if p.grad is not None]
        if not params or (not grads and group is None) or not params[0].requires_grad:
            continue  # a frozen tied weight (every copy on every stage alike) takes no step
        total = torch.zeros_like(_local(params[0]).detach()) if not grads else grads[0].clone()
        for g in grads[1:]:
            total += g
        if group is not None:
            dist.all_reduce(total, group=group)
        for p in params:
            if p.grad is not None:
                _local(p.grad).copy_(total)
            elif not hasattr(p, "_local_tensor"):  # a copy its stage did not use this step
                p.grad = total.clone()


BUCKET_BYTES = 25 * 1024 * 1024
"""Gradient bucket size of `GradientReducer`: DDP's default `bucket_cap_mb` (25 MiB,
torch.nn.parallel.DistributedDataParallel; Li et al. 2020, "PyTorch Distributed", VLDB, section 3.2.3)."""


class GradientReducer:
    """ZeRO 0's gradient averaging (`average_gradients`' sums and divisors) overlapped with the
    backward, as the cost model prices `grad_reduce` (planner/cost/overlap.py `exposed_s`): DDP's
    buckets, written here because DDP does not compose with torch's pipeline schedules and
    DTensor (TP) parameters as simply (module docstring).

    Buckets. Parameters are put in buckets of about `BUCKET_BYTES`, one list per (process group,
    dtype): at first in reverse order of registration (the order a backward roughly produces
    their gradients), then, after the first step, in the order their gradients became ready in
    it, as DDP rebuilds its buckets; the first rank's order is broadcast so that every rank
    holds the same buckets.

    Launch. Each parameter's post-accumulate-grad hook counts the backward passes that reached
    it; at the step's last one (`expected`: one per micro-batch, `start_step`) it is ready, and
    every bucket whose parameters are all ready is all-reduced asynchronously, in bucket order
    (every rank issues the same collectives in the same order, as a collective needs), while the
    backward goes on. `finish` launches what is left (parameters whose gradients arrive without
    the hook: zero-bubble's weight step accumulates them by hand, or a parameter no micro-batch
    reached), waits, and writes the averages back. A parameter without a gradient on this rank
    contributes zeros to the sum and keeps no gradient (it takes no optimizer step, as before).

    Scaling. torch's pipeline schedules divide a stage's gradients by the number of micro-batches
    once its backward is done (`PipelineStage.scale_grads`): a single-stage schedule at the end of
    the step, a multi-stage one (interleaved 1F1B) right after each stage's last backward, so a
    rank holding two stages has one stage's gradients divided while the other's backward still
    runs, and a bucket may carry both. The runner reports each division (`note_scaled`); a bucket
    records which of its parameters were already divided when it went out, and `finish` divides
    the others' share of the sum by what their stage was divided by since. (Applying the factor
    to every bucket sent during the backward, as before, divided the first-finished stage twice:
    its weights ended 3e-5 off under PP2 x DP2 interleaved, 2e-4 with CP, against 1e-6 now.)
    A parameter whose hook fires more than `expected` times (a gradient accumulated twice per
    micro-batch) may have been sent early: `finish` then sums every bucket again from the final
    gradients, so the result is always `average_gradients`'. On gloo the asynchronous
    collectives run on the process group's own threads, so the overlap is real on CPU processes
    as on NCCL streams."""

    def __init__(self, modules: list[nn.Module], dp_group, expert_params=(), expert_dp_group=None,
                 bucket_bytes: int = BUCKET_BYTES):
        self.divisor = dist.get_world_size(dp_group)
        self.bucket_bytes = bucket_bytes
        experts = {id(p) for p in expert_params}
        dense = [p for module in modules for p in module.parameters() if p.requires_grad and id(p) not in experts]
        groups = [(dense, dp_group), ([p for p in expert_params if p.requires_grad], expert_dp_group)]
        # One list per (group, dtype), in launch order; groups of one rank are only divided (`finish`).
        self._lists: list[tuple[list[nn.Parameter], Any]] = [
            ([p for p in reversed(params) if _local(p).dtype == dtype], group)
            for params, group in groups if group is not None and dist.get_world_size(group) > 1
            for dtype in dict.fromkeys(_local(p).dtype for p in params)]
        listed = {id(p) for params, _ in self._lists for p in params}
        self._unreduced = [p for params, _ in groups for p in params if id(p) not in listed]
        self._make_buckets()
        self._ready_order: list[int] | None = []  # ids in hook order during the first step; None once rebuilt
        self._seen: dict[int, int] = {}
        self._work: list[tuple[Any, torch.Tensor, list[bool]]] = []  # (work, flat sum, each parameter divided when sent)
        self.expected = 1
        self._scaled: dict[int, float] = {}  # id -> what the schedule multiplied its gradient by this step
        self._late = False  # a hook past `expected`: a launched bucket may have missed a gradient
        self.hidden_launches = 0
        """Buckets launched from a hook, while the backward was still running (for benchmarks/overlap.py)."""
        for params, _ in self._lists:
            for p in params:
                p.register_post_accumulate_grad_hook(self._ready)

    def _make_buckets(self) -> None:
        self.buckets: list[tuple[list[nn.Parameter], Any]] = []  # (parameters, process group)
        for params, group in self._lists:
            bucket: list[nn.Parameter] = []
            for p in params:
                bucket.append(p)
                if sum(_local(q).numel() * _local(q).element_size() for q in bucket) >= self.bucket_bytes:
                    self.buckets.append((bucket, group))
                    bucket = []
            if bucket:
                self.buckets.append((bucket, group))
        self._bucket_of = {id(p): i for i, (bucket, _) in enumerate(self.buckets) for p in bucket}
        self._missing = [len(bucket) for bucket, _ in self.buckets]

    def _rebuild(self) -> None:
        """The lists in the first step's ready order (never-ready parameters last, as they were),
        the first rank of each group deciding (DDP's `_rebuild_buckets`)."""
        rank_of = {pid: i for i, pid in enumerate(self._ready_order or [])}
        for k, (params, group) in enumerate(self._lists):
            order = sorted(range(len(params)), key=lambda i: rank_of.get(id(params[i]), len(rank_of) + i))
            box = [order]
            dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
            self._lists[k] = ([params[i] for i in box[0]], group)
        self._ready_order = None
        self._make_buckets()

    def start_step(self, backward_passes: int) -> None:
        """Before a step whose backward reaches each parameter `backward_passes` times (its
        micro-batches)."""
        self.expected = backward_passes
        self._scaled.clear()
        self._seen.clear()
        self._missing = [len(bucket) for bucket, _ in self.buckets]
        self._work.clear()
        self.hidden_launches = 0
        self._late = False

    def note_scaled(self, params, factor: float) -> None:
        """The caller multiplied these parameters' gradients by `factor` (a pipeline stage's
        `scale_grads`, after its last backward of the step: class docstring)."""
        for p in params:
            if p.grad is not None:
                self._scaled[id(p)] = self._scaled.get(id(p), 1.0) * factor

    def _ready(self, p: torch.Tensor) -> None:
        seen = self._seen.get(id(p), 0) + 1
        self._seen[id(p)] = seen
        self._late |= seen > self.expected
        if seen == self.expected:
            if self._ready_order is not None:
                self._ready_order.append(id(p))
            self._missing[self._bucket_of[id(p)]] -= 1
            before = len(self._work)
            self._launch(only_ready=True)
            self.hidden_launches += len(self._work) - before

    def _launch(self, only_ready: bool) -> None:
        """All-reduce the next buckets in order: while they are ready, or (`only_ready` False) all."""
        while len(self._work) < len(self.buckets):
            i = len(self._work)
            if only_ready and self._missing[i] > 0:
                return
            bucket, group = self.buckets[i]
            flat = torch.cat([_local(p.grad).reshape(-1) if p.grad is not None else _local(p).new_zeros(_local(p).numel())
                              for p in bucket])
            divided = [id(p) in self._scaled for p in bucket]
            self._work.append((dist.all_reduce(flat, group=group, async_op=True), flat, divided))

    def finish(self) -> None:
        """After the step's backward: the remaining buckets, then every average written back."""
        self._launch(only_ready=False)
        if self._late:  # a parameter accumulated more often than `expected`: sum again, from the final gradients
            for work, _, _ in self._work:
                work.wait()
            self._work.clear()
            self._launch(only_ready=False)
        for (bucket, _), (work, flat, divided) in zip(self.buckets, self._work, strict=True):
            work.wait()
            flat.div_(self.divisor)
            offset = 0
            for p, was_divided in zip(bucket, divided, strict=True):
                n = _local(p).numel()
                if p.grad is not None:
                    part = flat[offset:offset + n]
                    if not was_divided and id(p) in self._scaled:  # sent before its stage divided it
                        part.mul_(self._scaled[id(p)])
                    _local(p.grad).copy_(part.view_as(_local(p.grad)))
                offset += n
        for p in self._unreduced:  # groups of one rank: the divisor alone (`average_gradients`)
            if p.grad is not None:
                _local(p.grad).div_(self.divisor)
        self._work.clear()
        if self._ready_order is not None:
            self._rebuild()
