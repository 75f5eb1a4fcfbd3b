"""`python -m runtime PLAN ...`: one rank of a plan's run under torchrun, or `--reference`.

    torchrun --nproc-per-node 4 -m runtime plan.json --steps 10 --output metrics.json
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from torch.distributed.elastic.multiprocessing.errors import record

from planner.errors import PlannerError


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m runtime", description="Run a plan (one rank under torchrun).")
    parser.add_argument("plan")
    parser.add_argument("--model-file", default=None, help="Model file (default: the plan's).")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lr", type=float, default=None)
    parser.add_argument("--output", default=None, help="Metrics JSON (written by rank 0).")
    parser.add_argument("--save-params", default=None, help="Write the final full parameters here (torch.save; tests).")
    parser.add_argument("--reference", action="store_true", help="One process, no parallelism.")
    parser.add_argument("--checkpoint-dir", default=None, help="Save a checkpoint here at the end (DCP).")
    parser.add_argument("--resume", action="store_true", help="Start from the newest complete step in --checkpoint-dir.")
    parser.add_argument("--overwrite", action="store_true", help="Start fresh in a --checkpoint-dir that holds a checkpoint.")
    return parser.parse_args(argv)


@record
def main(argv=None) -> None:
    from planner.plan import load_plan
    from runtime.launch import check_checkpoint_dir, resolve_model_file
    from runtime.train import train

    args = parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        plan = load_plan(args.plan)
        model_file = resolve_model_file(plan, args.plan, args.model_file)
        # Every rank checks before the process group exists; no rank writes there before a save's barrier.
        check_checkpoint_dir(args.checkpoint_dir, args.resume, args.overwrite, args.reference)
        result = train(plan, model_file, args.steps, args.seed, args.lr, args.reference,
                       checkpoint_dir=args.checkpoint_dir, resume=args.resume)
    except PlannerError as exc:
        print(f"error (rank {os.environ.get('RANK', '0')}): {exc.message}\n{exc.hint or ''}", file=sys.stderr)
        sys.exit(1)
    rank = int(os.environ.get("RANK", 0))
    if args.save_params and result.params:
        import torch

        path = Path(args.save_params)
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(result.params, path.with_name(f"{path.stem}.rank{rank}{path.suffix}") if not args.reference else path)
    if rank == 0:
        metrics = result.metrics.model_copy(update={"plan": str(args.plan), "reference": args.reference})
        if args.output:
            metrics.save(args.output)
        losses = ", ".join(f"{x:.5f}" for x in metrics.losses)
        print(f"losses: {losses}\nmedian step: {metrics.median_iteration_time_s * 1e3:.1f} ms")
    if not args.reference:
        # Everything is written and the process groups are destroyed. Leave without the
        # interpreter's teardown: about one gloo run in 30 aborted there ("terminate called
        # without an active exception": a C++ thread of torch.distributed's statics still
        # joinable when they are destroyed), turning a finished run into a failed job.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
