"""Gradient clipping by the global norm, under any plan.

The norm must be the one the one-process reference computes over the whole model
(torch.nn.utils.clip_grad_norm_ with the same formula, coef = min(1, max_norm / (norm + 1e-6))).
Under a plan a rank holds a part of the gradients, in three ways, each summed once:
- DTensor gradients (TP shards, FSDP shards): DTensor reduces their norm over their own
  mesh; they are grouped by mesh because one foreach kernel cannot mix meshes;
- plain gradients (replicated parameters): every TP/DP replica holds the same values, so
  they count once, locally;
- pipeline stages: each pp rank holds other units, so the squared norms add over the pp group
  (as torchtitan's dist_utils.clip_grad_norm_ does);
- a weight tied across stages has a copy on several stages, each holding the summed gradient
  (runtime/apply_dp.py `sum_tied_gradients`): only one copy counts (`uncounted`: the others),
  as Megatron-LM counts shared embeddings once. Every copy is scaled.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor


def clip_grad_norm(modules: list[nn.Module], max_norm: float, pp_group=None, uncounted=()) -> torch.Tensor:
    """Scale every gradient so the global L2 norm is at most `max_norm`; returns the norm before clipping.
    `uncounted`: parameters whose gradient another copy already counts (weights tied across stages)."""
    skip = {id(p) for p in uncounted}
    # (parameter, gradient) of every trained parameter; a frozen one has no gradient.
    trained = [(p, p.grad) for m in modules for p in m.parameters() if p.requires_grad and p.grad is not None]
    grads = [g for _, g in trained]
    groups: dict[object, list[torch.Tensor]] = {}
    for p, g in trained:
        if id(p) not in skip:
            groups.setdefault(g.device_mesh if isinstance(g, DTensor) else None, []).append(g)
    squared = torch.zeros((), dtype=torch.float32, device=grads[0].device if grads else "cpu")
    for group in groups.values():
        norm = torch.nn.utils.get_total_norm(group, norm_type=2.0)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        squared = squared + norm.float() ** 2
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        dist.all_reduce(squared, group=pp_group)
    total = squared.sqrt()
    coef = min(max_norm / (total.item() + 1e-6), 1.0)
    if coef < 1.0:
        for g in grads:
            g.mul_(coef)
    return total
