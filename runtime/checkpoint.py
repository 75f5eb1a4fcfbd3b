"""Checkpoints with torch.distributed.checkpoint (DCP), loadable under another plan.

State is keyed by the model's own parameter names (get_state_dict strips FSDP and
checkpoint-wrapper prefixes) and saved as DTensor shards, so DCP reshards on load: a run
saved as PP2 x DP2 resumes as TP2 x DP2. Expert-parallel experts are DTensor shards of the
whole experts tensors too (runtime/apply_ep.py), so a run saved under EP2 resumes under EP1
(plain tensors, read whole) and the reverse (each rank reads its experts' rows). A rank may hold several stage chunks (virtual
stages), each with its own optimizer (runtime/train.py); every chunk holds different
parameters under the model's names, so their state dicts merge into one without clashes.
Optimizer state is saved flattened (`state.<fqn>.exp_avg`, `param_groups.<fqn>.lr`), as
torchtitan does for model parts, so it too is keyed by parameter name and each chunk picks
its own entries on load, whatever chunks the saving plan had. The checkpoint also records
the model fingerprint, the step and the format; another model's checkpoint is refused
before loading.

Asynchronous pipelining (PipeDream-2BW, runtime/pp_async.py) keeps two weight versions; a
checkpoint of such a run saves the older one too, as `stash.<fqn>` (sharded like the
parameter, so it reshards on load as the model does), and its metadata says
`stashed_weights: true`. Resuming across the synchronous/asynchronous divide is refused
(`check_resume_schedule`): the saved state does not define the other rule's next step.

Layout and atomicity. A checkpoint directory holds one folder per saved step,
`step-00000004/` (DCP's files and planner_checkpoint.json). A save never writes into a
step folder that exists: every rank writes its shard into `.step-00000004.tmp/` beside the
others, DCP fsyncs each file, and only after a barrier (every rank has finished writing)
does rank 0 write the metadata, fsync it and rename the folder into place (an atomic
rename on one file system), then fsync the parent. A rank killed before the rename
leaves the previous steps untouched and a `.tmp` folder that readers ignore and the next
save removes. After the rename, rank 0 deletes the steps other than the new one and the
one this run resumed from, so the previous good step survives one more save.
`--resume` loads the newest `step-*` folder; a checkpoint of the older flat layout (the
files directly in the directory) is still read.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from planner.errors import PlannerError
from runtime.apply_ep import load_strided_blocks, strided_as_whole

META = "planner_checkpoint.json"
FORMAT = 2
"""1: one module per rank, nested optimizer state; 2: flattened optimizer state, chunks merged."""
OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
STEP_PREFIX = "step-"
DAMAGED_HINT = ("The checkpoint is damaged (a disk error, or a copy cut short): resume from another copy, or start "
                "fresh with --overwrite.")


def step_dir(directory: str | Path, step: int) -> Path:
    return Path(directory) / f"{STEP_PREFIX}{step:08d}"


def _temp_dir(directory: str | Path, step: int) -> Path:
    return Path(directory) / f".{STEP_PREFIX}{step:08d}.tmp"


def complete_steps(directory: str | Path) -> list[Path]:
    """The step folders a save finished (renamed into place), oldest first."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = [d for d in directory.iterdir() if d.is_dir() and d.name.startswith(STEP_PREFIX) and d.name[len(STEP_PREFIX):].isdigit()]
    return sorted(found, key=lambda d: int(d.name[len(STEP_PREFIX):]))


def latest(directory: str | Path) -> Path | None:
    """The folder to resume from: the newest complete step, or the directory itself in the flat layout."""
    steps = complete_steps(directory)
    if steps:
        return steps[-1]
    return Path(directory) if (Path(directory) / META).is_file() else None


def has_content(directory: str | Path) -> bool:
    """True when `directory` exists and is not empty (a run without --resume would replace what it holds)."""
    directory = Path(directory)
    return directory.is_dir() and any(directory.iterdir())


def _state(modules: list, optimizers: list, stash=None) -> dict:
    """{"model": ..., "optim": ...} over this rank's chunks, keyed by parameter names.

    Frozen parameters (requires_grad=False: a LoRA model's base weights) are saved with the
    model, so a resumed run holds exactly what was saved, but they have no optimizer state
    (runtime/train.py gives the optimizer trainable parameters only); a chunk of frozen
    weights alone has no optimizer (None) and saves its model state only. `stash`: the older
    weight version of an asynchronous run (runtime/pp_async.py `WeightStash`), saved as "stash"."""
    model_sd, optim_sd = {}, {}
    for module, optimizer in zip(modules, optimizers, strict=True):
        if optimizer is None:
            if any(True for _ in module.parameters()):  # a chunk without parameters keeps nothing, as before
                model_sd.update(get_model_state_dict(module, options=OPTIONS))
            continue
        m, o = get_state_dict(module, optimizer, options=OPTIONS)
        model_sd.update(m)
        optim_sd.update(o)
    if stash is not None:
        return {"model": model_sd, "optim": optim_sd, "stash": stash.state_dict()}
    return {"model": model_sd, "optim": optim_sd}


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save(directory: str | Path, modules: list, optimizers: list, step: int, fingerprint: str,
         resumed_from: str | Path | None = None, stash=None) -> Path:
    """Save `step` atomically (module docstring, Layout and atomicity); every rank calls it.
    `stash`: an asynchronous run's older weights (module docstring), or None."""
    final, temp = step_dir(directory, step), _temp_dir(directory, step)
    if dist.get_rank() == 0:
        if temp.exists():
            shutil.rmtree(temp)  # a save of this step that a crash cut short
        temp.mkdir(parents=True)
    dist.barrier()  # the folder exists before any rank writes into it
    dcp.save(strided_as_whole(_state(modules, optimizers, stash)), checkpoint_id=str(temp))  # each file fsynced (FileSystemWriter sync_files)
    dist.barrier()  # every rank's shard is on disk: only now may the step become visible
    if dist.get_rank() == 0:
        _publish(directory, temp, final, {"step": step, "fingerprint": fingerprint, "format": FORMAT,
                                          "stashed_weights": stash is not None})
        _prune(directory, keep={final, Path(resumed_from) if resumed_from else None})
    dist.barrier()
    return final


def _publish(directory: str | Path, temp: Path, final: Path, meta: dict) -> None:
    """Rank 0: write the metadata last, then rename the finished folder into place."""
    path = temp / META
    with open(path, "w") as f:
        f.write(json.dumps(meta))
        f.flush()
        os.fsync(f.fileno())
    _fsync(temp)
    if final.exists():  # the same step saved again (--overwrite): move the old one aside first
        aside = final.with_name(f".{final.name}.old")
        if aside.exists():
            shutil.rmtree(aside)
        os.rename(final, aside)
        os.rename(temp, final)
        shutil.rmtree(aside)
    else:
        os.rename(temp, final)
    _fsync(Path(directory))


def _prune(directory: str | Path, keep: set) -> None:
    """Delete the steps other than `keep`, leftovers of cut-short saves, and files of the flat layout."""
    directory = Path(directory)
    keep = {Path(k).resolve() for k in keep if k is not None}
    for entry in directory.iterdir():
        if entry.resolve() in keep:
            continue
        if entry.is_dir() and (entry.name.startswith(STEP_PREFIX) or entry.name.startswith(f".{STEP_PREFIX}")):
            shutil.rmtree(entry, ignore_errors=True)
        elif entry.is_file() and directory.resolve() not in keep and (entry.name in (META, ".metadata") or entry.suffix == ".distcp"):
            entry.unlink()


def read_meta(directory: str | Path, fingerprint: str) -> dict:
    """The newest complete step's metadata, checked against the model; `meta["directory"]` is its folder."""
    found = latest(directory)
    if found is None:
        raise PlannerError(f"{directory} holds no planner checkpoint.", "Pass the --checkpoint-dir a run saved to.")
    path = found / META
    try:
        meta = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise PlannerError(f"{path} is not valid JSON ({exc}).", "The checkpoint is damaged: start fresh.") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("step"), int):
        raise PlannerError(f"{path} is not a planner checkpoint's metadata (no integer `step`).", DAMAGED_HINT)
    if meta.get("fingerprint") != fingerprint:
        raise PlannerError(f"The checkpoint in {directory} is from another model (fingerprint {meta.get('fingerprint')}).",
                           "Resume with the model the checkpoint was saved from, or start fresh.")
    if meta.get("format", 1) != FORMAT:
        raise PlannerError(f"The checkpoint in {directory} has format {meta.get('format', 1)}; this runtime reads format {FORMAT}.",
                           "Resume it with the planner version that saved it, or start fresh.")
    check_files(found)
    return {**meta, "directory": str(found)}


def check_files(folder: str | Path) -> None:
    """Refuse a step whose DCP index is unreadable or whose shard files are missing or shorter
    than the index says (a truncated copy), naming the file; contents are not checksummed."""
    from torch.distributed.checkpoint import FileSystemReader

    folder = Path(folder)
    index = folder / ".metadata"
    if not index.is_file():
        raise PlannerError(f"The checkpoint file {index} is missing.", DAMAGED_HINT)
    try:
        metadata = FileSystemReader(str(folder)).read_metadata()
    except Exception as exc:  # a truncated pickle raises EOFError, UnpicklingError, ...
        raise PlannerError(f"The checkpoint file {index} cannot be read ({type(exc).__name__}: {exc}).", DAMAGED_HINT) from None
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        shard = folder / name
        if not shard.is_file():
            raise PlannerError(f"The checkpoint file {shard} is missing.", DAMAGED_HINT)
        if shard.stat().st_size < size:
            raise PlannerError(f"The checkpoint file {shard} is truncated: {shard.stat().st_size} bytes, its index "
                               f"({index.name}) needs {size}.", DAMAGED_HINT)


def check_resume_schedule(meta: dict, asynchronous: bool) -> None:
    """Refuse to resume an asynchronous run's checkpoint synchronously, or the reverse (module docstring)."""
    saved = bool(meta.get("stashed_weights", False))
    if saved == asynchronous:
        return
    if saved:
        raise PlannerError(
            f"The checkpoint in {meta.get('directory')} is from an asynchronous (pipedream-2bw) run: it holds two weight "
            "versions, and a synchronous schedule would drop the older one and change the update rule mid-run.",
            "Resume with a pipedream-2bw plan, or start fresh (--overwrite) with this plan.")
    raise PlannerError(
        f"The checkpoint in {meta.get('directory')} is from a synchronous run: it holds one weight version, and "
        "pipedream-2bw needs the previous step's weights too (W(t+1) = W(t) - lr grad f(W(t-1))).",
        "Resume with a synchronous plan (e.g. the saving one), or start fresh (--overwrite) with the pipedream-2bw plan.")


def load(directory: str | Path, modules: list, optimizers: list, stash=None) -> None:
    """Load the step folder `directory` (read_meta's `directory`); a failure names the folder.
    `stash`: an asynchronous run's older weights, loaded in place (module docstring)."""
    state = _state(modules, optimizers, stash)
    whole = strided_as_whole(state)  # expert TP's strided shards saved as whole tensors (runtime/apply_ep.py)
    try:
        dcp.load(whole, checkpoint_id=str(directory))
        load_strided_blocks(whole, state)
    except Exception as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise PlannerError(f"Loading the checkpoint in {directory} failed ({type(exc).__name__}: {first[:300]}).", DAMAGED_HINT) from None
    options = StateDictOptions(flatten_optimizer_state_dict=True, strict=False)  # each chunk takes its own keys
    for module, optimizer in zip(modules, optimizers, strict=True):
        if optimizer is None:
            if any(True for _ in module.parameters()):
                set_model_state_dict(module, state["model"], options=options)
            continue
        set_state_dict(module, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"], options=options)
