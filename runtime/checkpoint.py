"""Checkpoints with torch.distributed.checkpoint (DCP), loadable under another plan.

State is keyed by the model's own parameter names (get_state_dict strips FSDP and
checkpoint-wrapper prefixes) and saved as DTensor shards, so DCP reshards on load: a run
saved as PP2 x DP2 resumes as TP2 x DP2. The checkpoint also records the model
fingerprint and the step; another model's checkpoint is refused before loading.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from planner.errors import PlannerError

META = "planner_checkpoint.json"


def _single(modules: list):
    if len(modules) != 1:
        raise PlannerError("Checkpoints of plans with several stage chunks per rank (virtual stages) are not supported yet.",
                           "Checkpoint under a plan with virtual_stages 1.")
    return modules[0]


def save(directory: str | Path, modules: list, optimizer, step: int, fingerprint: str) -> None:
    model_sd, optim_sd = get_state_dict(_single(modules), optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(directory))
    if dist.get_rank() == 0:
        (Path(directory) / META).write_text(json.dumps({"step": step, "fingerprint": fingerprint}))
    dist.barrier()


def read_meta(directory: str | Path, fingerprint: str) -> dict:
    path = Path(directory) / META
    if not path.is_file():
        raise PlannerError(f"{directory} holds no planner checkpoint.", "Pass the --checkpoint-dir a run saved to.")
    meta = json.loads(path.read_text())
    if meta["fingerprint"] != fingerprint:
        raise PlannerError(f"The checkpoint in {directory} is from another model (fingerprint {meta['fingerprint']}).",
                           "Resume with the model the checkpoint was saved from, or start fresh.")
    return meta


def load(directory: str | Path, modules: list, optimizer) -> None:
    model_sd, optim_sd = get_state_dict(_single(modules), optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=str(directory))
    set_state_dict(_single(modules), optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
