"""`planner run`: check the plan, then start torchrun with the plan's world size.

Everything that can be refused is refused here, before any process group exists: an
unreadable or inconsistent plan, a model file that does not match it. On one node the
ranks are started by `python -m torch.distributed.run --standalone` through
planner/launcher.py: torchrun stops every rank when one fails, and the launcher names the
rank and prints its own error; Ctrl-C, SIGTERM and the wall-clock limit (`--timeout`) end
every rank, and the caller is told what the stopped run kept. For several nodes the
torchrun command of each node is printed instead.
"""

from __future__ import annotations

import json
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
    from runtime.apply_tp import check_tp_plan
    from runtime.build import build_meta_model, check_fingerprint

    plan = load_plan(plan_path)
    path = resolve_model_file(plan, plan_path, model_file)
    mf = load_model_file(path, plan.model.args)
    meta = build_meta_model(mf)
    check_fingerprint(plan, meta, mf)
    check_tp_plan(plan, meta)
    if plan.layout.pp_degree > 1:
        from runtime.pp_split import check_splittable

        check_splittable(meta, plan)
    return plan, path


def run_plan(plan_path: str, model_file: str | None = None, steps: int = 5, seed: int = 0, lr: float | None = None,
             output: str | None = None, reference: bool = False, save_params: str | None = None,
             timeout_s: float = 600.0, checkpoint_dir: str | None = None, resume: bool = False) -> int:
    plan, path = precheck(plan_path, model_file)
    extra = ["--model-file", path, "--steps", str(steps), "--seed", str(seed)]
    extra += ["--lr", str(lr)] if lr is not None else []
    extra += ["--output", output] if output else []
    extra += ["--save-params", save_params] if save_params else []
    extra += ["--checkpoint-dir", checkpoint_dir] if checkpoint_dir else []
    extra += ["--resume"] if resume else []
    threads = plan.training.cpu_threads or os.environ.get("OMP_NUM_THREADS", "1")
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    if plan.cluster.num_nodes > 1 and not reference:
        for node in range(plan.cluster.num_nodes):
            print(f"node {node}: torchrun --nnodes {plan.cluster.num_nodes} --node-rank {node} "
                  f"--nproc-per-node {plan.cluster.gpus_per_node} --rdzv-backend c10d --rdzv-endpoint HOST:29500 "
                  f"-m runtime {plan_path} {' '.join(extra)}")
        return 0
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="planner-run-") as log_dir:
        if reference:
            command, logs = [sys.executable, "-m", "runtime", plan_path, *extra, "--reference"], None
        else:
            command, logs = torchrun_command(plan.world_size, ["-m", "runtime", plan_path, *extra], log_dir), Path(log_dir)
        launch(command, env, timeout_s, what="The run", log_dir=logs, timeout_hint="Run fewer steps or raise --timeout.",
               kept=lambda: kept_after_stop(checkpoint_dir, output, started))
    return 0


def kept_after_stop(checkpoint_dir: str | None, output: str | None, started: float) -> str:
    """What a stopped run leaves: the metrics and checkpoint are written only when a run finishes."""
    from runtime.checkpoint import META

    kept = []
    meta = Path(checkpoint_dir) / META if checkpoint_dir else None
    if meta is not None and meta.is_file():
        try:
            step = json.loads(meta.read_text()).get("step", "?")
        except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
            step = "?"
        if meta.stat().st_mtime >= started:
            kept.append(f"the checkpoint in {checkpoint_dir} (step {step}, saved by this run)")
        elif any(f.stat().st_mtime >= started for f in Path(checkpoint_dir).rglob("*") if f.is_file()):
            kept.append(f"the checkpoint in {checkpoint_dir} (step {step}, from before this run), but this run was "
                        "stopped while overwriting it: it may be damaged")
        else:
            kept.append(f"the checkpoint in {checkpoint_dir} (step {step}, from before this run)")
    if output and Path(output).is_file() and Path(output).stat().st_mtime >= started:
        kept.append(f"the metrics in {output}")
    if kept:
        return "Kept: " + "; ".join(kept) + "."
    return "Nothing was kept: a run writes its metrics and checkpoint only when it finishes."
