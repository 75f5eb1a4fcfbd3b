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
Expert tensor parallelism (`Layout.expert_tp_degree` = tp_degree, pinned only; Megatron-Core's
ETP). Each expert's MLP is split as Megatron-LM splits a dense one (Shoeybi et al. 2019, section 3):
every per-expert matrix has one dim of the expert width F (`expert_tp_dims`: gate/up [F or 2F, D]
split by columns, down [D, F] by rows), and TP rank j keeps the j-th 1/t block of it; a fused
gate/up of 2F (Hugging Face's `gate_up_proj`, chunked in halves) keeps the j-th block of each
half, a `_StridedShard(dim, split_factor=2)` (the placement FSDP2 x TP uses for strided blocks).
The parameters are DTensors on the (ep, tp) mesh (or tp alone), sliced from the reference's
values, so `full_tensor()` gives the whole experts. The experts' input passes through Megatron's
f (identity forward, gradient all-reduced over TP backward: the router's and the hidden states'
gradients are then whole on every TP rank), the local matrices compute a partial output, and
Megatron's g all-reduces it (backward identity). Tokens must be the same on the TP ranks, so expert
TP runs without sequence parallelism (planner/plan.py refuses the pair; a reduce-scatter form
would first all-gather the sequence-sharded tokens). With EP the dispatch is done identically
by every TP rank in its own EP group (the unfolded mesh: EP groups are dp ranks tp apart), and
f/g wrap the local experts' computation on what arrived. ZeRO 1-3 (FSDP2 over the strided
blocks) is not run with expert TP (`check_ep`), and torch.distributed.checkpoint cannot save a
`_StridedShard` (its planner reads the blocks as contiguous chunks): such tensors (the fused
gate/up and its optimizer state) are saved whole and each rank takes its blocks back on load
(`strided_as_whole`, `load_strided_blocks`), so a checkpoint under expert TP is the same file as
one without it and resumes under any other plan.

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
from torch.distributed.tensor import DTensor, Placement, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from planner.errors import PlannerError
from planner.moe import experts_inputs, find_experts, num_experts
from planner.plan import Plan


def check_ep(plan: Plan, model: nn.Module) -> None:
    """Refuse, before any process group exists, an EP layout this runtime or model cannot run."""
    lay = plan.layout
    if lay.expert_tp_degree > 1:
        check_expert_tp(plan, model)
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


def check_expert_tp(plan: Plan, model: nn.Module) -> None:
    """Refuse expert TP where this runtime cannot run it: no experts, matrices without a clear
    expert-width dim, a width the TP degree does not divide, or ZeRO 1-3 (module docstring)."""
    lay = plan.layout
    experts = find_experts(model)
    hint = "Set layout.expert_tp_degree to 1 (experts whole on every TP rank)."
    if not experts:
        raise PlannerError(f"expert_tp_degree is {lay.expert_tp_degree} but the model has no experts module.", hint)
    if lay.zero_stage >= 1:
        raise PlannerError(f"expert_tp_degree {lay.expert_tp_degree} with zero_stage {lay.zero_stage} is not run: FSDP2 "
                           "would shard the experts' strided TP blocks again.", hint + " Or use zero_stage 0.")
    for name, module in experts.items():
        width = _expert_width(module, name)
        if width % lay.expert_tp_degree:
            raise PlannerError(f"expert_tp_degree {lay.expert_tp_degree} does not divide the expert width {width} of "
                               f"{name}.", hint)


def _expert_width(experts: nn.Module, name: str = "experts") -> int:
    """F, the expert width: the smallest dim other than the model dim D, which every per-expert
    matrix has (`expert_tp_dims`)."""
    dims = expert_tp_dims(experts, name)
    return min(experts._parameters[p].shape[d] // (2 if fused else 1)  # type: ignore[union-attr]
               for p, (d, fused) in dims.items())


def expert_tp_dims(experts: nn.Module, name: str = "experts") -> dict[str, tuple[int, bool]]:
    """Per parameter of an experts module: (the dim expert TP splits, whether it is a fused
    gate/up of 2F to split by halves). Every parameter must be a stack of matrices [E, a, b]
    sharing exactly one dim D (the model dim); its other dim is F, or 2F for a fused gate/up."""
    params = {n: p for n, p in experts._parameters.items() if p is not None}
    if any(p.dim() != 3 for p in params.values()):
        raise PlannerError(f"Expert TP splits matrices, but {name} has a parameter that is not a stack of them "
                           "(a bias?).", "Set layout.expert_tp_degree to 1.")
    common = set.intersection(*(set(p.shape[1:]) for p in params.values()))
    if len(common) != 1 or any(p.shape[1] == p.shape[2] for p in params.values()):
        raise PlannerError(f"Expert TP cannot tell the model dim from the expert width in {name} (shapes "
                           f"{[tuple(p.shape) for p in params.values()]}).", "Set layout.expert_tp_degree to 1.")
    model_dim = common.pop()
    other = {n: (2 if p.shape[1] == model_dim else 1) for n, p in params.items()}
    width = min(params[n].shape[d] for n, d in other.items())
    dims = {}
    for n, d in other.items():
        size = params[n].shape[d]
        if size not in (width, 2 * width):
            raise PlannerError(f"Expert TP: {name}.{n} has dim {size}, neither the expert width {width} nor twice it.",
                               "Set layout.expert_tp_degree to 1.")
        dims[n] = (d, size == 2 * width)
    return dims


def _tp_block(param: torch.Tensor, dim: int, fused: bool, rank: int, degree: int) -> torch.Tensor:
    """TP rank `rank`'s block of `param` along `dim` (of each half when `fused`)."""
    if not fused:
        size = param.shape[dim] // degree
        return param.narrow(dim, rank * size, size)
    halves = param.unflatten(dim, (2, param.shape[dim] // 2))
    size = halves.shape[dim + 1] // degree
    return halves.narrow(dim + 1, rank * size, size).flatten(dim, dim + 1)


def apply_ep(module: nn.Module, experts_mesh: DeviceMesh | None, expert_tp: bool = False) -> None:
    """Keep this rank's experts of every experts module in `module` (a model or a stage) and
    route tokens to the others' by all-to-all (module docstring). `experts_mesh`: the "ep" axis,
    or with `expert_tp` the ("ep", "tp") axes, or "tp" alone (ep 1; module docstring, Expert
    tensor parallelism). Records the experts modules EP shards in `module._ep_modules` for FSDP
    and the gradient reduction (`expert_parameters`); expert TP alone records none (the experts
    are then averaged over dp like the dense parameters)."""
    ep_modules: list[nn.Module] = []
    # nn.Module.__setattr__ takes any value at run time; torch types it Tensor | Module only.
    module._ep_modules = ep_modules  # type: ignore[assignment]
    if experts_mesh is None or experts_mesh.size() == 1:
        return
    names = experts_mesh.mesh_dim_names or ()
    ep_mesh = experts_mesh["ep"] if "ep" in names else None
    tp_mesh = experts_mesh["tp"] if expert_tp else None
    ep_degree = ep_mesh.size() if ep_mesh is not None else 1
    for experts in find_experts(module).values():
        total = num_experts(experts)
        local = total // ep_degree
        assert local * ep_degree == total, "check_ep refuses an ep_degree that does not divide the experts"
        # The module that runs the local experts: a shallow copy over the local slices (set per call).
        runner = copy.copy(experts)
        runner.__dict__["_parameters"] = {}
        if isinstance(getattr(experts, "num_experts", None), int):
            runner.num_experts = local  # type: ignore[assignment]  # as `_ep_modules` above: any value is fine
        _shard_experts(experts, experts_mesh, ep_mesh, tp_mesh)
        tp_group = tp_mesh.get_group() if tp_mesh is not None else None
        if ep_mesh is None:
            experts.forward = _expert_tp_forward(experts, runner, tp_group)
            continue
        ep_modules.append(experts)
        experts.forward = _dispatching_forward(experts, runner, total, ep_degree, ep_mesh.get_group(), tp_group)


def _shard_experts(experts: nn.Module, mesh: DeviceMesh, ep_mesh: DeviceMesh | None, tp_mesh: DeviceMesh | None) -> None:
    """Replace each parameter by this rank's slice of it as a DTensor on `mesh`: experts dim
    Shard(0) over ep, the expert-width dim over tp (module docstring)."""
    tp_dims = expert_tp_dims(experts) if tp_mesh is not None else {}
    for name, param in list(experts._parameters.items()):
        if param is None:  # a parameter slot registered empty: nothing to shard
            continue
        shard, placements = param.detach(), list[Placement]()
        if ep_mesh is not None:
            local = shard.shape[0] // ep_mesh.size()
            shard = shard[ep_mesh.get_local_rank() * local:][:local]
            placements.append(Shard(0))
        if tp_mesh is not None:
            dim, fused = tp_dims[name]
            shard = _tp_block(shard, dim, fused, tp_mesh.get_local_rank(), tp_mesh.size())
            placements.append(_StridedShard(dim, split_factor=2) if fused else Shard(dim))
        sharded = nn.Parameter(DTensor.from_local(shard.clone(memory_format=torch.contiguous_format), mesh, tuple(placements),
                                                  run_check=False), requires_grad=param.requires_grad)
        experts.register_parameter(name, sharded)


class _CopyToTP(torch.autograd.Function):
    """Megatron-LM's f (`copy_to_tensor_model_parallel_region`): identity in the forward, the
    gradient summed over the TP group in the backward (each rank's partial experts see the input)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    """Megatron-LM's g (`reduce_from_tensor_model_parallel_region`): the partial outputs summed
    over the TP group in the forward, the gradient passed through in the backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        x = x.contiguous().clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def _tp_compute(compute, runner: nn.Module, tp_group, hidden: torch.Tensor, index: torch.Tensor,
                weights: torch.Tensor) -> torch.Tensor:
    """The experts' own forward on this rank's blocks, between f and g when `tp_group` is set."""
    if tp_group is None:
        return compute(runner, hidden, index, weights)
    hidden, weights = _CopyToTP.apply(hidden, tp_group), _CopyToTP.apply(weights, tp_group)
    return _ReduceFromTP.apply(compute(runner, hidden, index, weights), tp_group)


def _expert_tp_forward(experts: nn.Module, runner: nn.Module, tp_group):
    compute = type(experts).forward

    def forward(*args, **kwargs) -> torch.Tensor:
        hidden_states, top_k_index, top_k_weights = _inputs(experts, args, kwargs)
        runner.__dict__["_parameters"] = _local_slices(experts)
        out = _tp_compute(compute, runner, tp_group, hidden_states, top_k_index, top_k_weights)
        runner.__dict__["_parameters"] = {}  # hold no activations' graph between calls
        return out

    return forward


def _inputs(experts: nn.Module, args: tuple, kwargs: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The call's (hidden_states, top_k_index, top_k_weights), by the class's parameter names."""
    inputs = experts_inputs(experts, args, kwargs)
    if inputs is None:
        raise TypeError(f"{type(experts).__name__}.forward was called without all three of its inputs "
                        "(hidden_states, top_k_index, top_k_weights), which expert parallelism routes by")
    return inputs


def _local_slices(experts: nn.Module) -> dict[str, torch.Tensor]:
    """This rank's experts' slices of the parameters `apply_ep` sharded on the expert dim (DTensors)."""
    return {n: cast(DTensor, p).to_local() for n, p in experts._parameters.items() if p is not None}


def _dispatching_forward(experts: nn.Module, runner: nn.Module, total: int, ep_degree: int, group, tp_group=None):
    local = total // ep_degree
    compute = type(experts).forward

    def forward(*args, **kwargs) -> torch.Tensor:
        hidden_states, top_k_index, top_k_weights = _inputs(experts, args, kwargs)
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
        out = _tp_compute(compute, runner, tp_group, arrived, which[:, None], ones)
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


def _is_strided(value) -> bool:
    return isinstance(value, DTensor) and any(isinstance(p, _StridedShard) for p in value.placements)


def strided_as_whole(state: dict) -> dict:
    """A copy of the (nested) state dict `state` in which every DTensor with a `_StridedShard`
    placement (expert TP's fused gate/up, its optimizer state) is its whole value, a plain tensor
    torch.distributed.checkpoint can save and load (module docstring). A collective: every rank
    calls it on the same keys, as DCP's save and load are."""
    return {k: strided_as_whole(v) if isinstance(v, dict) else v.full_tensor() if _is_strided(v) else v
            for k, v in state.items()}


def load_strided_blocks(whole: dict, state: dict) -> None:
    """After loading into `whole = strided_as_whole(state)`: copy this rank's blocks of each
    whole value into the DTensor it stands for in `state`, in place."""
    for k, v in state.items():
        if isinstance(v, dict):
            load_strided_blocks(whole[k], v)
        elif _is_strided(v):
            v.to_local().copy_(_local_block(whole[k], v))


def _local_block(value: torch.Tensor, like: DTensor) -> torch.Tensor:
    """This rank's block of the whole `value` under `like`'s placements (Shard and _StridedShard)."""
    mesh = like.device_mesh
    for axis, placement in enumerate(like.placements):
        rank, size = mesh.get_local_rank(axis), mesh.size(axis)
        if isinstance(placement, _StridedShard):
            dim, parts = placement.dim, placement.split_factor
            value = value.unflatten(dim, (parts, -1)).chunk(size, dim=dim + 1)[rank].flatten(dim, dim + 1)
        elif isinstance(placement, Shard):
            value = value.chunk(size, dim=placement.dim)[rank]
    return value
