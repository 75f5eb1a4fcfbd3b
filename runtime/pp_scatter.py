"""Scatter/gather of pipeline activations across tensor-parallel ranks (Narayanan et al. 2021, section 4.1).

Without sequence parallelism the tensors crossing a pipeline cut are replicated on the t
ranks of a tensor-parallel group, and each of them would send the whole tensor to its peer
in the next stage: t copies of the same bytes over the network. Instead each rank sends
its 1/t slice (split along the last dimension) and the receiving group all-gathers the
slices over the fast in-node link, which divides the cross-node p2p bytes by t. The plan
asks for it with `layout.p2p_scatter_gather` (the solver sets it where it is cheaper; the
cost model prices it the same way, planner/solver/search.py).

Autograd. The gradient of a replicated activation is itself replicated across the group
(the TP layers that read it all-reduce their input gradients), so the two operations are
each other's adjoints on replicated values:

    sender    scatter: forward keeps this rank's slice;  backward all-gathers the slices' gradients
    receiver  gather:  forward all-gathers the slices;   backward keeps this rank's slice of the gradient

A tensor is split only if it is floating point with a last dimension divisible by t (in
the layout's meta trace); anything else (position ids, odd shapes) is sent whole. Both
sides decide from the same trace, so they always agree. The tensors crossing a cut are
replicated across the group because runtime/apply_tp.py styles each stage on its own: a
column-parallel module without its row-parallel partner in the same stage gathers its
output back, so a stage hands on only replicated activations.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def splits(dtype: torch.dtype, shape: tuple[int, ...], tp_degree: int) -> bool:
    """Whether a crossing tensor of this dtype and traced shape is sent as slices."""
    return dtype.is_floating_point and len(shape) >= 1 and shape[-1] % tp_degree == 0


def _all_gather_last_dim(x: torch.Tensor, group) -> torch.Tensor:
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


def _own_slice(x: torch.Tensor, group) -> torch.Tensor:
    return x.chunk(dist.get_world_size(group), dim=-1)[dist.get_rank(group)].contiguous()


class ScatterToGroup(torch.autograd.Function):
    """Sender side: this rank's slice of a replicated tensor."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group):
        ctx.group = group
        return _own_slice(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_gather_last_dim(grad, ctx.group), None


class GatherFromGroup(torch.autograd.Function):
    """Receiver side: the whole tensor from the group's slices."""

    @staticmethod
    def forward(ctx, part: torch.Tensor, group):
        ctx.group = group
        return _all_gather_last_dim(part, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _own_slice(grad, ctx.group), None
