"""Activation recomputation per unit: `full` checkpoints the unit, `selective` only the
attention modules inside it (Korthikanti et al. 2022 recompute the attention core;
here the whole attention module, found by name: `attn`, `attention`, `self_attn`), `op`
checkpoints the unit with torchtitan's op-level policy (`op_policy`: the outputs of attention
and of every other matmul saved, the rest recomputed; torch.utils.checkpoint's selective
checkpointing). A plan gives each unit its mode (planner/plan.py `Stage.unit_modes`), so one
stage may checkpoint some units and not others (`apply_unit_recompute`)."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    checkpoint_wrapper,
)
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

ATTENTION_NAMES = ("attn", "attention", "self_attn")
aten = torch.ops.aten
MATMULS = {aten.mm.default, aten.addmm.default}
"""A linear layer's matmul as it dispatches (nn.Linear: mm, or addmm with a bias); counted to
save every other one. torchtitan counts aten.mm (its linears have no bias)."""
SAVED = {aten._scaled_dot_product_flash_attention.default, aten._scaled_dot_product_efficient_attention.default,
         aten._scaled_dot_product_cudnn_attention.default, aten._scaled_dot_product_flash_attention_for_cpu.default,
         torch.ops._c10d_functional.reduce_scatter_tensor.default}
"""Other ops whose outputs are saved: attention (each SDPA kernel, the CPU one included) and
reduce-scatters, torchtitan's save list (torchtitan/distributed/activation_checkpoint.py)."""


def op_policy():
    """torchtitan's op-level selective checkpointing context (`_apply_op_sac`), one per
    checkpointed call: `op_policy_fn`'s decisions."""
    return create_selective_checkpoint_contexts(op_policy_fn())


def op_policy_fn():
    """The policy: save the outputs of `SAVED` ops and of the odd-numbered matmuls of the forward
    (1st, 3rd, ...; counted apart in the recomputation, which replays the same order), recompute
    everything else. What the cost model prices as mode `op` (planner/solver/costs.py
    `op_checkpoint_terms`)."""
    counts = {"forward": 0, "recompute": 0}

    def policy(ctx, func, *args, **kwargs):
        if func in MATMULS:
            mode = "recompute" if ctx.is_recompute else "forward"
            counts[mode] += 1
            return CheckpointPolicy.MUST_SAVE if counts[mode] % 2 == 1 else CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE if func in SAVED else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def _wrap(model: nn.Module, name: str, mode: str) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    module = parent.get_submodule(child)
    wrapped = checkpoint_wrapper(module, context_fn=op_policy) if mode == "op" else checkpoint_wrapper(module)
    setattr(parent, child, wrapped)  # by name, in a Sequential too (DenseNet's are named: "denseblock1")


def apply_recompute(model: nn.Module, units: list[str], mode: str) -> None:
    if mode == "none":
        return
    present = dict(model.named_modules())
    targets = []
    for unit in units:
        if unit not in present:
            continue
        if mode in ("full", "op"):
            targets.append(unit)
        else:
            targets += [f"{unit}.{n}" for n, _ in present[unit].named_modules() if n.rpartition(".")[2] in ATTENTION_NAMES]
    for name in targets:
        _wrap(model, name, mode)


def apply_unit_recompute(model: nn.Module, modes: Mapping[str, str]) -> None:
    """Each unit (FQN) its own mode, e.g. a stage's `Stage.unit_modes()`; units this chunk lacks are skipped."""
    for mode in ("selective", "op", "full"):
        apply_recompute(model, [unit for unit, r in modes.items() if r == mode], mode)
