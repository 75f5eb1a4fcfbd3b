"""Checkpoints with torch.distributed.checkpoint (DCP), loadable under another plan.

State is keyed by the model's own parameter names (get_state_dict strips FSDP and
checkpoint-wrapper prefixes) and saved as DTensor shards, so DCP reshards on load: a run
saved as PP2 x DP2 resumes as TP2 x DP2. A rank may hold several stage chunks (virtual
stages), each with its own optimizer (runtime/train.py); every chunk holds different
parameters under the model's names, so their state dicts merge into one without clashes.
Optimizer state is saved flattened (`state.<fqn>.exp_avg`, `param_groups.<fqn>.lr`), as
torchtitan does for model parts, so it too is keyed by parameter name and each chunk picks
its own entries on load, whatever chunks the saving plan had. The checkpoint also records
the model fingerprint, the step and the format; another model's checkpoint is refused
before loading.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from planner.errors import PlannerError

META = "planner_checkpoint.json"
FORMAT = 2
"""1: one module per rank, nested optimizer state; 2: flattened optimizer state, chunks merged."""
OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


def _state(modules: list, optimizers: list) -> dict:
    """{"model": ..., "optim": ...} over this rank's chunks, keyed by parameter names."""
    model_sd, optim_sd = {}, {}
    for module, optimizer in zip(modules, optimizers, strict=True):
        m, o = get_state_dict(module, optimizer, options=OPTIONS)
        model_sd.update(m)
        optim_sd.update(o)
    return {"model": model_sd, "optim": optim_sd}


def save(directory: str | Path, modules: list, optimizers: list, step: int, fingerprint: str) -> None:
    dcp.save(_state(modules, optimizers), checkpoint_id=str(directory))
    if dist.get_rank() == 0:
        (Path(directory) / META).write_text(json.dumps({"step": step, "fingerprint": fingerprint, "format": FORMAT}))
    dist.barrier()


def read_meta(directory: str | Path, fingerprint: str) -> dict:
    path = Path(directory) / META
    if not path.is_file():
        raise PlannerError(f"{directory} holds no planner checkpoint.", "Pass the --checkpoint-dir a run saved to.")
    try:
        meta = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise PlannerError(f"{path} is not valid JSON ({exc}).", "The checkpoint is damaged: start fresh.") from None
    if meta.get("fingerprint") != fingerprint:
        raise PlannerError(f"The checkpoint in {directory} is from another model (fingerprint {meta.get('fingerprint')}).",
                           "Resume with the model the checkpoint was saved from, or start fresh.")
    if meta.get("format", 1) != FORMAT:
        raise PlannerError(f"The checkpoint in {directory} has format {meta.get('format', 1)}; this runtime reads format {FORMAT}.",
                           "Resume it with the planner version that saved it, or start fresh.")
    return meta


def load(directory: str | Path, modules: list, optimizers: list) -> None:
    state = _state(modules, optimizers)
    dcp.load(state, checkpoint_id=str(directory))
    options = StateDictOptions(flatten_optimizer_state_dict=True, strict=False)  # each chunk takes its own keys
    for module, optimizer in zip(modules, optimizers, strict=True):
        set_state_dict(module, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"], options=options)
