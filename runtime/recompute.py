"""Activation recomputation per unit: `full` checkpoints the unit, `selective` only the
attention modules inside it (Korthikanti et al. 2022 recompute the attention core;
here the whole attention module, found by name: `attn`, `attention`, `self_attn`).
A plan gives each unit its mode (planner/plan.py `Stage.unit_modes`), so one stage may
checkpoint some units and not others (`apply_unit_recompute`)."""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    checkpoint_wrapper,
)

ATTENTION_NAMES = ("attn", "attention", "self_attn")


def _wrap(model: nn.Module, name: str) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    module = parent.get_submodule(child)
    wrapped = checkpoint_wrapper(module)
    if isinstance(parent, (nn.ModuleList, nn.Sequential)):
        parent[int(child)] = wrapped
    else:
        setattr(parent, child, wrapped)


def apply_recompute(model: nn.Module, units: list[str], mode: str) -> None:
    if mode == "none":
        return
    present = dict(model.named_modules())
    targets = []
    for unit in units:
        if unit not in present:
            continue
        if mode == "full":
            targets.append(unit)
        else:
            targets += [f"{unit}.{n}" for n, _ in present[unit].named_modules() if n.rpartition(".")[2] in ATTENTION_NAMES]
    for name in targets:
        _wrap(model, name)


def apply_unit_recompute(model: nn.Module, modes: Mapping[str, str]) -> None:
    """Each unit (FQN) its own mode, e.g. a stage's `Stage.unit_modes()`; units this chunk lacks are skipped."""
    for mode in ("selective", "full"):
        apply_recompute(model, [unit for unit, r in modes.items() if r == mode], mode)
