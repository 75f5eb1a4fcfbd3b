"""`python -m tests.fork_ranks WORLD PLAN [runtime options]`: the ranks of one test job, forked
from one interpreter that has already imported what a rank imports (tests/ranks.py).

Each rank of a parity run is `python -m runtime` (runtime/__main__.py `main`); before its first
step it imports torch, torch.distributed's FSDP, DTensor and pipelining, the planner, and what
the model file imports (transformers for the Hugging Face models): several seconds of one
core. Four ranks on the 2-core machine spent longer importing than training. Here one process
imports all of it once, then forks WORLD children, each with torchrun's environment
(RANK, LOCAL_RANK) and the same `main`; the process group and everything after it are the
children's own, as in separate interpreters.

Forking is safe only while this process has a single thread (a lock held by another thread
would stay held in the child): the imports start none with OMP_NUM_THREADS=1, and if one ever
does, the ranks are exec'd as separate interpreters instead, as before.

Supervision is torchrun's: when one rank fails the others are killed at once (a rank waiting in
a collective for a dead peer would otherwise hang until gloo's timeout), and this process exits
with the first failure's code.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import traceback


def _threads() -> int:
    return len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else 2


def _warm(args: list[str]) -> None:
    """Import what a rank imports, the model file's imports included."""
    import runtime.train  # noqa: F401  (torch, FSDP, DTensor, pipelining, the planner)
    from planner.model_file import load_model_file
    from planner.plan import load_plan
    from runtime.__main__ import parse_args
    from runtime.launch import resolve_model_file

    try:
        options = parse_args(args)
        plan = load_plan(options.plan)
        load_model_file(resolve_model_file(plan, options.plan, options.model_file), plan.model.args)
    except Exception:  # noqa: BLE001 - the ranks meet the same error and report it
        pass


def _rank(rank: int, args: list[str]) -> None:
    """The child: one rank's `python -m runtime ARGS`, then exit without the parent's teardown."""
    from runtime.__main__ import main

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank))
    code = 0
    try:
        main(args)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # noqa: BLE001 - printed, and the exit code says it failed
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main() -> None:
    world, args = int(sys.argv[1]), sys.argv[2:]
    _warm(args)
    if _threads() > 1:  # module docstring: not safe to fork
        ranks = [subprocess.Popen([sys.executable, "-u", "-m", "runtime", *args],
                                  env={**os.environ, "RANK": str(r), "LOCAL_RANK": str(r)}) for r in range(world)]
        children = {p.pid: p for p in ranks}
    else:
        children = {}
        for rank in range(world):
            pid = os.fork()
            if pid == 0:
                _rank(rank, args)
            children[pid] = None
    failed = 0
    while children:
        pid, status = os.wait()
        children.pop(pid, None)
        code = os.waitstatus_to_exitcode(status)
        if code and not failed:
            failed = code if code > 0 else 128 - code
            for other in children:
                os.kill(other, signal.SIGKILL)
    sys.exit(failed)


if __name__ == "__main__":
    main()
