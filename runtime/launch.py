"""`planner run`: check the plan, then start torchrun with the plan's world size.

Everything that can be refused is refused here, before any process group exists: an
unreadable or inconsistent plan, a model file that does not match it, training settings
no run could use (a negative or NaN learning rate, steps < 1), an output that could not be
written, and a checkpoint directory that holds a checkpoint when neither --resume nor
--overwrite says what to do with it. A model file edited since the plan was solved (its
SHA-256 differs from the profile's) gets a warning: the structure is checked by the
fingerprint, but the predicted times may no longer hold. On one node the
ranks are started by `python -m torch.distributed.run --standalone` through
planner/launcher.py: torchrun stops every rank when one fails, and the launcher names the
rank and prints its own error; Ctrl-C, SIGTERM and the wall-clock limit (`--timeout`) end
every rank, and the caller is told what the stopped run kept. For several nodes the
torchrun command of each node is printed instead.
"""

from __future__ import annotations

import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

from planner.errors import PlannerError
from planner.launcher import launch, torchrun_command
from planner.plan import Plan, load_plan


def resolve_model_file(plan: Plan, plan_path: str, override: str | None) -> str:
    candidates = [Path(override)] if override else [Path(plan_path).parent / plan.model.file, Path(plan.model.file)]
    for path in candidates:
        if path.is_file():
            return str(path.resolve())
    raise PlannerError(f"Model file {candidates[0]} named by the plan does not exist.", "Pass --model-file PATH.")


def precheck(plan_path: str, model_file: str | None) -> tuple[Plan, str]:
    """Refuse a bad plan or a mismatched model before starting any process."""
    from planner.model_file import load_model_file
    from runtime.apply_ep import check_ep
    from runtime.apply_tp import check_tp_plan
    from runtime.build import build_meta_model, check_fingerprint

    plan = load_plan(plan_path)
    if plan.training.float8:  # FP8 GEMMs need CUDA with compute capability 8.9+ (runtime/apply_fp8.py)
        from runtime.apply_fp8 import check_float8_device

        check_float8_device(plan)
    path = resolve_model_file(plan, plan_path, model_file)
    mf = load_model_file(path, plan.model.args)
    meta = build_meta_model(mf)
    if not any(True for _ in meta.parameters()):
        raise PlannerError(f"build_model() in {path} returned a model with no parameters: there is nothing to train.",
                           "Return the model with its layers as submodules.")
    check_fingerprint(plan, meta, mf)
    if plan.model.source_sha256 and mf.source_sha256() != plan.model.source_sha256:
        print(f"warning: {path} has changed since it was profiled for this plan (its SHA-256 differs from the "
              "profile's): the prediction may not hold. Re-profile and re-solve to plan for the edited model.",
              file=sys.stderr, flush=True)
    check_tp_plan(plan, meta)
    check_ep(plan, meta)
    if plan.layout.cp_degree > 1:  # the sequence splits into 2 cp chunks, the layout composes (runtime/apply_cp.py)
        from runtime.apply_cp import check_cp
        from runtime.build import as_tuple

        check_cp(plan, as_tuple(mf.make_batch(1)[0]))
    if plan.layout.pp_degree > 1:
        from runtime.pp_flow import trace_layout
        from runtime.pp_split import check_splittable
        from runtime.train import meta_inputs

        check_splittable(meta, plan)
        trace_layout(meta, plan, meta_inputs(mf, plan.batch.micro_batch_size, plan.layout.cp_degree))  # refuses a cut no stage can send across
    if plan.layout.stage_replicas is not None:  # what the replicated executor does not run (runtime/pp_replicated.py)
        from runtime.pp_replicated import check_replicated

        check_replicated(plan, meta)
    return plan, path


def check_training_args(plan: Plan, steps: int, seed: int, lr: float | None, timeout_s: float) -> None:
    """Refuse settings no run could use, before launching (a rank would refuse them only after start-up)."""
    problems = []
    if steps < 1:
        problems.append(f"--steps must be at least 1 (got {steps})")
    if seed < 0:
        problems.append(f"--seed must be non-negative (got {seed})")
    for what, value in (("--lr" if lr is not None else "the plan's training.lr", lr if lr is not None else plan.training.lr),
                        ("the plan's training.weight_decay", plan.training.weight_decay)):
        if not math.isfinite(value) or value < 0:
            problems.append(f"{what} must be a finite number >= 0 (got {value})")
    clip = plan.training.grad_clip
    if clip is not None and not (math.isfinite(clip) and clip > 0):
        problems.append(f"the plan's training.grad_clip must be a positive number or null (got {clip})")
    if not (math.isfinite(timeout_s) and timeout_s > 0):
        problems.append(f"--timeout must be a positive number of seconds (got {timeout_s})")
    if problems:
        raise PlannerError("Cannot run: " + "; ".join(problems) + ".", "Fix those settings; nothing was started.")


def check_checkpoint_dir(checkpoint_dir: str | None, resume: bool, overwrite: bool, reference: bool = False) -> None:
    """An existing checkpoint is neither silently replaced nor silently ignored."""
    from runtime.checkpoint import has_content, latest

    if checkpoint_dir is None:
        if resume:
            raise PlannerError("--resume needs --checkpoint-dir.", "Pass the directory a previous run saved to.")
        return
    if resume and overwrite:
        raise PlannerError("--resume and --overwrite contradict each other.", "Resume from the checkpoint, or start fresh over it.")
    if reference:
        raise PlannerError("--reference does not save checkpoints.", "Drop --checkpoint-dir for the reference run.")
    if not resume and not overwrite and has_content(checkpoint_dir):
        found = latest(checkpoint_dir)
        what = f"a checkpoint ({found.name})" if found is not None else "files"
        raise PlannerError(f"--checkpoint-dir {checkpoint_dir} already holds {what}; this run would replace it.",
                           "Pass --resume to continue from it, --overwrite to start fresh (its steps are deleted once this "
                           "run's step is saved), or another --checkpoint-dir.")


def run_plan(plan_path: str, model_file: str | None = None, steps: int = 5, seed: int = 0, lr: float | None = None,
             output: str | None = None, reference: bool = False, save_params: str | None = None,
             timeout_s: float = 600.0, checkpoint_dir: str | None = None, resume: bool = False, overwrite: bool = False) -> bool:
    """Run the plan here (True), or, for a plan over several nodes, print each node's torchrun
    command and run nothing (False). Refuses bad arguments before any work (PlannerError)."""
    from planner.cli import check_output_path

    check_output_path(output, "--output")
    check_output_path(save_params, "--save-params")
    check_checkpoint_dir(checkpoint_dir, resume, overwrite, reference)
    check_output_path(checkpoint_dir, "--checkpoint-dir", directory=True)
    check_training_args(load_plan(plan_path), steps, seed, lr, timeout_s)  # cheap: before the model is built
    plan, path = precheck(plan_path, model_file)
    extra = ["--model-file", path, "--steps", str(steps), "--seed", str(seed)]
    extra += ["--lr", str(lr)] if lr is not None else []
    extra += ["--output", output] if output else []
    extra += ["--save-params", save_params] if save_params else []
    extra += ["--checkpoint-dir", checkpoint_dir] if checkpoint_dir else []
    extra += ["--resume"] if resume else []
    extra += ["--overwrite"] if overwrite else []
    threads = plan.training.cpu_threads or os.environ.get("OMP_NUM_THREADS", "1")
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    if plan.cluster.num_nodes > 1 and not reference:
        print(f"The plan spans {plan.cluster.num_nodes} nodes of {plan.cluster.gpus_per_node} GPUs: start one torchrun on "
              "each (HOST: node 0's address, reachable from the others; this checkout and the model file on every node):")
        for node in range(plan.cluster.num_nodes):
            print(f"node {node}: torchrun --nnodes {plan.cluster.num_nodes} --node-rank {node} "
                  f"--nproc-per-node {plan.cluster.gpus_per_node} --rdzv-backend c10d --rdzv-endpoint HOST:29500 "
                  f"-m runtime {plan_path} {' '.join(extra)}")
        return False
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="planner-run-") as log_dir:
        if reference:
            command, logs = [sys.executable, "-m", "runtime", plan_path, *extra, "--reference"], None
        else:
            command, logs = torchrun_command(plan.world_size, ["-m", "runtime", plan_path, *extra], log_dir), Path(log_dir)
        launch(command, env, timeout_s, what="The run", log_dir=logs, timeout_hint="Run fewer steps or raise --timeout.",
               kept=lambda: kept_after_stop(checkpoint_dir, output, started))
    return True


def kept_after_stop(checkpoint_dir: str | None, output: str | None, started: float) -> str:
    """What a stopped run leaves: the metrics and checkpoint are written only when a run finishes."""
    from runtime.checkpoint import META, latest

    kept = []
    found = latest(checkpoint_dir) if checkpoint_dir else None
    if found is not None:
        meta = found / META
        try:
            step = json.loads(meta.read_text()).get("step", "?")
        except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
            step = "?"
        # A step folder appears only complete (runtime/checkpoint.py): a save cut short leaves the previous one.
        when = "saved by this run" if meta.stat().st_mtime >= started else "from before this run"
        kept.append(f"the checkpoint in {found} (step {step}, {when})")
    if output and Path(output).is_file() and Path(output).stat().st_mtime >= started:
        kept.append(f"the metrics in {output}")
    if kept:
        return "Kept: " + "; ".join(kept) + "."
    return "Nothing was kept: a run writes its metrics and checkpoint only when it finishes."
