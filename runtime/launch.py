"""`planner run`: check the plan, then start torchrun with the plan's world size.

Everything that can be refused is refused here, before any process group exists: an
unreadable or inconsistent plan, a model file that does not match it. On one node the
ranks are started by `python -m torch.distributed.run --standalone`; torchrun stops every
rank when one fails, and we turn its report into one line naming the rank and the cause.
The whole job has a wall-clock limit so that nothing can hang. For several nodes the
torchrun command of each node is printed instead.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from planner.errors import PlannerError
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
    if reference:
        command = [sys.executable, "-m", "runtime", plan_path, *extra, "--reference"]
    elif plan.cluster.num_nodes > 1:
        for node in range(plan.cluster.num_nodes):
            print(f"node {node}: torchrun --nnodes {plan.cluster.num_nodes} --node-rank {node} "
                  f"--nproc-per-node {plan.cluster.gpus_per_node} --rdzv-backend c10d --rdzv-endpoint HOST:29500 "
                  f"-m runtime {plan_path} {' '.join(extra)}")
        return 0
    else:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(plan.world_size),
                   "-m", "runtime", plan_path, *extra]
    try:
        done = subprocess.run(command, env=env, timeout=timeout_s, capture_output=True, text=True)
    except subprocess.TimeoutExpired:
        raise PlannerError(f"The run did not finish within {timeout_s:.0f} s and was stopped.", "Run fewer steps or raise the timeout.") from None
    sys.stdout.write(done.stdout)
    if done.returncode != 0:
        raise PlannerError(failure_summary(done.stderr, done.returncode), "See the ranks' output above (re-run with --debug for it all).")
    return 0


def failure_summary(stderr: str, code: int) -> str:
    """One paragraph from torchrun's report: which rank failed first, and why."""
    own = re.findall(r"error \(rank (\d+)\): (.+)", stderr)
    if own:
        return f"Rank {own[0][0]} failed: {own[0][1]}"
    # torchrun's "Root Cause (first observed failure)" block names the rank that failed first.
    root = stderr[stderr.rfind("Root Cause"):] if "Root Cause" in stderr else stderr
    rank = re.search(r"rank\s*:\s*(\d+)", root)
    exitcode = re.search(r"exitcode\s*:\s*(-?\d+)", root)
    signal = re.search(r"Signal (\d+) \((\w+)\)", root)
    cause = [line.strip() for line in root.splitlines() if re.match(r"\s*[\w.]*(Error|Exception)\b.*:", line)]
    if signal:
        what = f"killed by {signal.group(2)}"
    elif cause:
        what = cause[-1]
    else:
        what = f"exit code {exitcode.group(1) if exitcode else code}"
    who = f"Rank {rank.group(1)}" if rank else "A rank"
    return f"{who} failed ({what}); the whole job was stopped."
