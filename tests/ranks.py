"""Start the ranks of a test job directly, without torchrun.

`planner run` launches with torchrun (planner/launcher.py), and the tests of that path
(test_launch_signals.py, test_examples.py, the CLI tests) keep doing so. The parity tests only
need N processes of `python -m runtime` that find each other: torchrun's elastic agent (its own
interpreter importing torch, a rendezvous store, a monitor loop and a graceful shutdown) took
about as long as the ranks' few training steps on the 2-core machine, for every parallel run
in the suite. Here each rank gets the environment torchrun would give it (RANK, LOCAL_RANK,
WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT: torch.distributed's env:// contract),
the ranks are forked from one interpreter that imported what they import (tests/fork_ranks.py),
and the job is supervised as torchrun supervises it: when one rank fails the others are
stopped at once (a rank left waiting in a collective for a dead peer would otherwise hang until
gloo's timeout), and the whole job under a deadline.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
from dataclasses import dataclass


@dataclass
class Job:
    returncode: int
    """0 when every rank exited 0; else the first failing rank's exit code."""
    stderr: str
    """Every rank's standard error."""
    stdout: str


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(world: int, args: list[str], cwd, env: dict | None = None, timeout: float = 240) -> Job:
    """`python -m runtime ARGS` on `world` ranks of one gloo job (module docstring), forked from
    one interpreter (tests/fork_ranks.py); their output once all have ended. Raises
    subprocess.TimeoutExpired past `timeout` seconds, after stopping every rank."""
    env = {**(env if env is not None else os.environ), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world)}
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:  # no pipe to fill and block on
        job = subprocess.Popen([sys.executable, "-u", "-m", "tests.fork_ranks", str(world), *args], cwd=cwd, env=env,
                               stdout=out, stderr=err, start_new_session=True)
        try:
            code = job.wait(timeout)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(job.pid, signal.SIGKILL)  # the ranks are in its session
            job.wait()
        out.seek(0), err.seek(0)
        return Job(code, err.read(), out.read())
