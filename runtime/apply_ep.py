"""Expert parallelism: each rank keeps 1/ep of every MoE layer's experts; tokens travel to them.

Experts modules are found by structure, never by class name: planner/moe.py `find_experts`, whose
docstring states the contract (batched expert weights with a leading expert dim, a forward of
(hidden_states, top_k_index, top_k_weights)). An integer attribute `num_experts` is set to the
local count on the module that runs the local experts.

The EP groups. EP is folded onto the data-parallel ranks (planner/plan.py `Layout.ep_degree`,
Megatron-Core's "parallel folding", torchtitan): the dp axis of the (pp, dp, tp) mesh is viewed
as (edp, ep) with ep innermost (runtime/mesh.py `build_ep_mesh`); the ep ranks of one group
hold different experts, the edp ranks holding the same experts see different data. With
sequence parallelism each TP rank holds its own tokens, so the (dp, tp) ranks of a stage are
viewed as (edp, ep) instead and an EP group may span TP ranks (EP x expert-DP = DP x TP).

Sequence parallelism (`apply_moe_sequence_parallel`). The MoE block's input stays
sequence-sharded (runtime/apply_tp.py hands it the local chunk as a plain tensor and sums the
router's gradients over TP), so the router and the experts see this rank's T/tp tokens and the
output leaves sequence-sharded. What a token's route depends on is its own hidden state, the
same as in one process. What is not per token is the load-balancing loss: examples/moe.py's is
per sequence, E sum_e f_e P_e with f_e and P_e means over the sequence, and a product of
chunk means is not the sequence's. The block's `sequence_mean` is replaced by the mean over
the whole sequence (`whole_sequence_mean`: local sums all-reduced over TP), so every TP rank
computes the one-process loss. (Hugging Face's Qwen3-MoE computes its load-balancing loss
only with `output_router_logits`, off in its configs, from the router logits of the whole
forward at the top of the model: batch-wide, so not per-replica exact under DP either; a
model whose aux loss has no `sequence_mean` gets chunk-wise statistics under SP.)

Placement. After the whole model is initialised as the reference is (runtime/build.py), each
experts parameter becomes a DTensor `Shard(0)` over the ep mesh holding this rank's E/ep
experts: the slice of the reference's values, so initialisation is the reference's by
construction. As DTensors, `full_tensor()` returns the whole experts for parity checks, and
torch.distributed.checkpoint saves and reshards them like TP shards (a run saved under EP2
resumes under EP1 and back: runtime/checkpoint.py).

Dispatch (the wrapped forward; GShard's all-to-all, Lepikhin et al. 2020, section 2.2):
1. sort this rank's T*k token copies by expert (stable), so copies bound for each EP rank are
   contiguous; count copies per expert and exchange the counts (all_to_all of E integers);
2. all_to_all_single with variable splits sends each copy to the rank owning its expert;
3. the local experts run on what arrived, by the module's own per-expert maths (its class's
   forward over the local slice, each copy a "token" with top-1 index = its local expert and
   weight 1.0, which multiplies exactly);
4. all_to_all back by the reverse splits, then the routing weights and the scatter-add into
   token positions in the same order as the one-process forward (examples/moe.py).
The data all-to-alls are `all_to_all_single_autograd` (torch's functional collectives; works
on gloo): its backward is the reverse all-to-all, so each token's gradient returns to its rank
and each expert's weight gradient sums the contributions of every rank in the EP group.
Gradients over expert-dp: runtime/apply_dp.py `average_gradients` (ZeRO 0) and `apply_fsdp`
(ZeRO 1-3: the experts are their own FSDP group on the expert-dp mesh, as torchtitan shards them).
Either way the sum over every rank of the (dp, tp) grid is divided by dp_degree: the TP ranks'
contributions are different tokens of the same samples, so they add, as the router's do.
"""

from __future__ import annotations

import copy
from functools import partial
from typing import cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from planner.errors import PlannerError
from planner.moe import find_experts, num_experts
from planner.plan import Plan


def check_ep(plan: Plan, model: nn.Module) -> None:
    """Refuse, before any process group exists, an EP layout this runtime or model cannot run."""
    lay = plan.layout
    if lay.ep_degree == 1:
        return
    problems = []
    experts = find_experts(model)
    if not experts:
        problems.append(f"ep_degree is {lay.ep_degree} but the model has no experts module (a module whose "
                        "parameters share a leading expert dim and whose forward takes (hidden_states, "
                        "top_k_index, top_k_weights))")
    uneven = {name: num_experts(m) for name, m in experts.items() if num_experts(m) % lay.ep_degree}
    if uneven:
        name, count = next(iter(uneven.items()))
        problems.append(f"ep_degree {lay.ep_degree} does not divide the number of experts of {name} ({count})"
                        + (f" and {len(uneven) - 1} more modules" if len(uneven) > 1 else ""))
    if problems:
        raise PlannerError("The plan's expert parallelism does not fit: " + "; ".join(problems) + ".",
                           "Pick an ep_degree that divides every experts module's number of experts and dp_degree "
                           "(dp_degree x tp_degree with sequence parallelism).")


def apply_ep(module: nn.Module, ep_mesh: DeviceMesh) -> None:
    """Keep this rank's experts of every experts module in `module` (a model or a stage) and
    route tokens to the others' by all-to-all (module docstring). Records the experts modules in
    `module._ep_modules` for FSDP and the gradient reduction (`expert_parameters`)."""
    ep_degree = ep_mesh.size()
    ep_modules: list[nn.Module] = []
    # nn.Module.__setattr__ takes any value at run time; torch types it Tensor | Module only.
    module._ep_modules = ep_modules  # type: ignore[assignment]
    if ep_degree == 1:
        return
    rank = ep_mesh.get_local_rank()
    for experts in find_experts(module).values():
        total = num_experts(experts)
        local = total // ep_degree
        assert local * ep_degree == total, "check_ep refuses an ep_degree that does not divide the experts"
        # The module that runs the local experts: a shallow copy over the local slices (set per call).
        runner = copy.copy(experts)
        runner.__dict__["_parameters"] = {}
        if isinstance(getattr(experts, "num_experts", None), int):
            runner.num_experts = local  # type: ignore[assignment]  # as `_ep_modules` above: any value is fine
        for name, param in list(experts._parameters.items()):
            if param is None:  # a parameter slot registered empty: nothing to shard
                continue
            shard = param.detach()[rank * local:(rank + 1) * local].clone()
            sharded = nn.Parameter(DTensor.from_local(shard, ep_mesh, (Shard(0),), run_check=False),
                                   requires_grad=param.requires_grad)
            experts.register_parameter(name, sharded)
        ep_modules.append(experts)
        experts.forward = _dispatching_forward(experts, runner, total, ep_degree, ep_mesh.get_group())


def _local_slices(experts: nn.Module) -> dict[str, torch.Tensor]:
    """This rank's experts' slices of the parameters `apply_ep` sharded on the expert dim (DTensors)."""
    return {n: cast(DTensor, p).to_local() for n, p in experts._parameters.items() if p is not None}


def _dispatching_forward(experts: nn.Module, runner: nn.Module, total: int, ep_degree: int, group):
    local = total // ep_degree
    compute = type(experts).forward

    def forward(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        k = top_k_index.shape[1]
        flat = top_k_index.reshape(-1)
        order = flat.argsort(stable=True)  # token copies grouped by expert, hence by owning rank
        token = order // k
        counts = torch.bincount(flat, minlength=total)
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=group)  # [source rank, local expert] copy counts
        received = received.view(ep_degree, local)
        send_splits = counts.view(ep_degree, local).sum(dim=1).tolist()
        recv_splits = received.sum(dim=1).tolist()
        arrived = all_to_all_single_autograd(hidden_states[token], recv_splits, send_splits, group)
        which = torch.arange(local, device=flat.device).repeat(ep_degree).repeat_interleave(received.reshape(-1))
        runner.__dict__["_parameters"] = _local_slices(experts)
        ones = torch.ones(which.shape[0], 1, dtype=arrived.dtype, device=arrived.device)
        out = compute(runner, arrived, which[:, None], ones)
        runner.__dict__["_parameters"] = {}  # hold no activations' graph between calls
        back = all_to_all_single_autograd(out, send_splits, recv_splits, group)
        back = back * top_k_weights.reshape(-1)[order, None]
        return torch.zeros_like(hidden_states).index_add_(0, token, back.to(hidden_states.dtype))

    return forward


def apply_moe_sequence_parallel(module: nn.Module, tp_mesh: DeviceMesh, experts_replicated: bool) -> None:
    """Sequence parallelism through the MoE blocks of `module` (module docstring, Sequence
    parallelism). `experts_replicated`: no EP over the TP ranks (ep_degree 1), so every TP rank
    holds all experts and computes its own tokens' share of their gradients, summed over TP
    after backward like the router's (runtime/apply_tp.py `sum_partial_gradients`)."""
    group = tp_mesh.get_group()
    local_blocks = set(getattr(module, "_sp_moe_blocks", ()))  # the blocks apply_tp hands local tokens
    experts = {name: m for name, m in find_experts(module).items() if name.rpartition(".")[0] in local_blocks}
    outside = sorted(set(find_experts(module)) - set(experts))
    if outside and not experts_replicated:
        raise PlannerError(f"Expert parallelism spans the TP ranks, but {outside[0]} lies in a unit the tp_plan does "
                           "not shard, so every TP rank would dispatch the same tokens.",
                           "Give each MoE unit a column/row pair in its tp_plan, or turn sequence_parallel off.")
    for name in experts:
        block = module.get_submodule(name.rpartition(".")[0])
        if callable(getattr(block, "sequence_mean", None)):
            # An instance attribute shadows the class's method (nn.Module keeps plain values in __dict__).
            block.sequence_mean = partial(whole_sequence_mean, group=group)  # type: ignore[assignment]
    if experts_replicated:
        partial_grads: list[str] = getattr(module, "_tp_partial_gradients", [])
        partial_grads += [f"{name}.{p}" for name, m in experts.items() for p, _ in m.named_parameters()]
        module._tp_partial_gradients = partial_grads  # type: ignore[assignment]


def whole_sequence_mean(x: torch.Tensor, group) -> torch.Tensor:
    """The mean over dim 1 of a statistic whose dim 1 is this rank's chunk of the sequence, taken
    over the whole sequence (every TP rank holds an equal chunk): the local sums all-reduced.

    The value is the whole sequence's on every TP rank, so the loss is the same on each, as
    everywhere else under TP; the gradient reaches the local sum only (forward all-reduce,
    backward identity: Megatron-LM's `reduce_from_tensor_model_parallel_region`), since each
    rank's copy of the loss differentiates through its own tokens and the router's gradient
    is then summed over TP."""
    local = x.sum(dim=1)
    total = local.detach().clone()
    dist.all_reduce(total, group=group)
    return (local + (total - local.detach())) / (x.shape[1] * dist.get_world_size(group))


def expert_parameters(modules: list[nn.Module]) -> list[nn.Parameter]:
    """The parameters of the experts modules `apply_ep` sharded, over every stage chunk (read from
    the modules: FSDP replaces the parameter objects)."""
    return [p for m in modules for experts in getattr(m, "_ep_modules", ()) for p in experts.parameters()]
