"""Start the ranks of a test job directly, without torchrun.

`planner run` launches with torchrun (planner/launcher.py), and the tests of that path
(test_launch_signals.py, test_examples.py, the CLI tests) keep doing so. The parity tests only
need N processes of `python -m runtime` that find each other: torchrun's elastic agent (its own
interpreter importing torch, a rendezvous store, a monitor loop and a graceful shutdown) took
about as long as the ranks' few training steps on the 2-core machine, for every parallel run
in the suite. Here each rank gets the environment torchrun would give it (RANK, LOCAL_RANK,
WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT: torch.distributed's env:// contract),
and the job is supervised as torchrun supervises it: when one rank fails the others are
stopped at once (a rank left waiting in a collective for a dead peer would otherwise hang until
gloo's timeout), and the whole job under a deadline.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass


@dataclass
class Job:
    returncode: int
    """0 when every rank exited 0; else the first failing rank's exit code."""
    stderr: str
    """Every rank's standard error, rank by rank."""
    stdout: str


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop(processes: list[subprocess.Popen]) -> None:
    for p in processes:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)  # each rank leads a session of its own, with its children
    for p in processes:
        p.wait()


def run_ranks(world: int, args: list[str], cwd, env: dict | None = None, timeout: float = 240) -> Job:
    """`python -m runtime ARGS` on `world` ranks of one gloo job (module docstring); every rank's
    output once all have ended. Raises subprocess.TimeoutExpired past `timeout` seconds, after
    stopping them."""
    base = {**(env if env is not None else os.environ), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
            "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world)}
    processes, outputs = [], []
    try:
        for rank in range(world):
            out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")  # no pipe to fill and block on
            outputs.append((out, err))
            processes.append(subprocess.Popen([sys.executable, "-u", "-m", "runtime", *args], cwd=cwd, stdout=out,
                                              stderr=err, start_new_session=True,
                                              env={**base, "RANK": str(rank), "LOCAL_RANK": str(rank)}))
        deadline = time.monotonic() + timeout
        while True:
            codes = [p.poll() for p in processes]
            failed = [c for c in codes if c not in (None, 0)]
            if failed or all(c == 0 for c in codes):
                break
            if time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(args, timeout)
            time.sleep(0.05)
        _stop(processes)
        texts = []
        for out, err in outputs:
            out.seek(0), err.seek(0)
            texts.append((out.read(), err.read()))
        return Job(failed[0] if failed else 0, "".join(f"[rank {r}] {e}" for r, (_, e) in enumerate(texts) if e),
                   "".join(o for o, _ in texts))
    finally:
        _stop(processes)
        for out, err in outputs:
            out.close(), err.close()
