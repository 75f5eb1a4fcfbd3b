"""Start a job (torchrun and its ranks, or one process), stop all of it, and say why it ended.

Used by `planner run` (runtime/launch.py) and `planner profile-cluster` (cluster_probe.py).

Stopping. torchrun starts each rank in a session of its own, so neither a terminal's Ctrl-C
nor a signal to torchrun's process group reaches the ranks. The job is started in a new
session; while it runs, every descendant is recorded (psutil) so that it can be found after
torchrun is gone. SIGINT or SIGTERM to this process, or the wall-clock limit, ends every
recorded process group: SIGTERM, then SIGKILL to whatever still runs after `GRACE_S`. The
caller then exits 128 + the signal (130, 143), as a shell reports a process a signal ended.

Failures. torchrun is started with `--log-dir D --tee 2`: each rank's stderr goes to the
console as it is written (torchrun prefixes it `[defaultN]:`) and to a file per rank,
D/<run>/attempt_<k>/<local rank>/stderr.log. torchrun's own log lines are kept, not shown;
its "Root Cause" block names the rank that failed first, and that rank's file gives its
exception (type and message) and the last lines it wrote.
"""

from __future__ import annotations

import collections
import logging
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import psutil

from planner.errors import PlannerError

log = logging.getLogger(__name__)

GRACE_S = 5.0
"""Seconds between SIGTERM and SIGKILL when stopping a job (the whole stop stays under 10 s)."""

RANK_LINE = re.compile(r"^\[[A-Za-z]\w*?\d+\]:")
"""A line torchrun's --tee copied from a rank's stream (`[default1]:...`)."""
RANK_PREFIX = re.compile(r"^\[rank\d+\]:\s?", re.MULTILINE)
"""What torch.distributed's excepthook puts before each line of a rank's traceback."""
OWN_LINE = re.compile(r"error \(rank (\d+)\): (.+)")
"""The one line a rank prints for a PlannerError or a caught failure (runtime/__main__.py, cluster_probe.py)."""
PROFILER_LINE = re.compile(r"^(?:\[[A-Za-z]\w*?\d+\]:)?(?:USDT|STAGE):\S+ \S+ \d+:\d+ \w+\.cpp:\d+\] ")
"""A line torch's profiler (kineto) writes at each start and stop, whatever its log level: the runtime
profiles one step on CPU to measure memory (runtime/metrics.py `TensorPeakMeter`), so it is the
planner's noise, not the user's; kept for the failure summary, shown only under --debug."""
EXCEPTION_LINE = re.compile(r"^\s*([A-Za-z_][\w.]*(?:Error|Exception|Interrupt)\w*(?::.*)?)\s*$")


class LaunchStopped(PlannerError):
    """The job was ended from outside (a signal, the wall-clock limit); `exit_code` is the CLI's."""

    def __init__(self, message: str, hint: str | None, exit_code: int):
        super().__init__(message, hint)
        self.exit_code = exit_code


def torchrun_command(nproc: int, program: list[str], log_dir: str | Path) -> list[str]:
    """torchrun on this node with `nproc` ranks running `program` (`-m module args` or `script args`)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
            "--log-dir", str(log_dir), "--tee", "2", *program]


def launch(command: list[str], env: dict, timeout_s: float, *, what: str, log_dir: Path | None = None,
           stopped: str = "the whole job was stopped", timeout_hint: str = "Raise --timeout.",
           progress: Callable[[], str] = lambda: "", kept: Callable[[], str] = lambda: "") -> None:
    """Run `command` to the end; raise PlannerError if it fails, LaunchStopped if it is stopped.

    `log_dir`: torchrun's --log-dir (see torchrun_command); None for a command whose stderr is
    shown whole. `what` names the job in messages ("The run"); `stopped` ends a failure's
    sentence; `progress()` is appended to the timeout message; `kept()` says what a stopped job
    leaves behind.
    """
    received: list[int] = []
    handlers = {}
    if threading.current_thread() is threading.main_thread():
        handlers = {s: signal.signal(s, lambda signum, _: received.append(signum)) for s in (signal.SIGINT, signal.SIGTERM)}
    start = time.monotonic()
    tracked: dict[int, psutil.Process] = {}
    log.debug("%s: starting %s (time limit %.0f s)", what, shlex.join(command), timeout_s)
    try:
        proc = subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True, errors="replace",
                                start_new_session=True)
        lines: collections.deque[str] = collections.deque(maxlen=500)
        reader = threading.Thread(target=_read, args=(proc.stderr, lines, log_dir is None), daemon=True)
        reader.start()
        while not received and time.monotonic() - start < timeout_s:
            _track(proc.pid, tracked)
            try:
                proc.wait(timeout=0.2)
                break
            except subprocess.TimeoutExpired:
                pass
        # A signal that came after the job had finished well does not undo it.
        if (received and proc.poll() != 0) or proc.poll() is None:
            _track(proc.pid, tracked)
            num_stopped = _stop(proc, tracked.values())
            log.debug("%s: stopped %d processes (signals received: %s)", what, num_stopped, received)
            reader.join(timeout=2)
            ended = f"{num_stopped} process{'es' if num_stopped != 1 else ''} ended"
            left = kept()
            if received:
                name = signal.Signals(received[0]).name
                raise LaunchStopped(f"{what} was interrupted by {name} after {time.monotonic() - start:.0f} s and stopped "
                                    f"({ended}).", left or None, 128 + received[0])
            raise LaunchStopped(f"{what} did not finish within {timeout_s:.0f} s{progress()} and was stopped ({ended}).",
                                "\n".join(x for x in (timeout_hint, left) if x), 124)
        reader.join(timeout=5)
        log.debug("%s: exit code %s after %.1f s", what, proc.returncode, time.monotonic() - start)
        if proc.returncode != 0:
            raise PlannerError(*describe_failure("".join(lines), proc.returncode, log_dir, stopped))
    finally:
        _stop(None, tracked.values(), grace_s=0.5)  # anything torchrun left behind
        for s, handler in handlers.items():
            signal.signal(s, handler)


def _read(stream, lines: collections.deque, show_all: bool) -> None:
    """Forward the job's stderr as it comes (ranks' lines only, under torchrun) and keep its tail."""
    for line in stream:
        lines.append(line)
        if (show_all or RANK_LINE.match(line)) and not PROFILER_LINE.match(line):
            sys.stderr.write(line)
            sys.stderr.flush()
        else:  # torchrun's own lines: kept for the failure summary, shown only under --debug
            log.debug("torchrun: %s", line.rstrip())


def _track(pid: int, tracked: dict[int, psutil.Process]) -> None:
    """Record every live descendant of `pid` (a rank outlives torchrun if torchrun is killed first)."""
    try:
        for child in psutil.Process(pid).children(recursive=True):
            tracked.setdefault(child.pid, child)
    except psutil.Error:
        pass


def _alive(procs) -> list[psutil.Process]:
    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.Error:
            pass
    return out


def _signal_all(proc: subprocess.Popen | None, procs, sig: int) -> None:
    """`sig` to torchrun's process group, to each rank's own group, and to each recorded process."""
    groups = {proc.pid} if proc is not None and proc.poll() is None else set()
    for p in procs:
        try:
            groups.add(os.getpgid(p.pid))
        except OSError:
            pass
    groups.discard(os.getpgrp())  # never this process's own group
    for group in groups:
        try:
            os.killpg(group, sig)
        except OSError:
            pass
    for p in procs:
        try:
            p.send_signal(sig)  # psutil checks the pid still names the process it recorded
        except psutil.Error:
            pass


def _stop(proc: subprocess.Popen | None, tracked, grace_s: float = GRACE_S) -> int:
    """End torchrun (`proc`) and every recorded process: SIGTERM, SIGKILL after `grace_s`. Returns how many ran."""
    procs = _alive(tracked)
    running = len(procs) + (proc is not None and proc.poll() is None)
    if not running:
        return 0
    _signal_all(proc, procs, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while (_alive(procs) or (proc is not None and proc.poll() is None)) and time.monotonic() < deadline:
        time.sleep(0.05)
    _signal_all(proc, _alive(procs), signal.SIGKILL)
    if proc is not None:
        try:
            proc.wait(timeout=2)
        except subprocess.TimeoutExpired:
            pass
    return running


def describe_failure(stderr: str, code: int, log_dir: Path | None, stopped: str) -> tuple[str, str]:
    """(message, hint) for a failed job: the first failing rank, its error, and its last lines of stderr."""
    rank = primary_rank(stderr, log_dir)
    log.debug("failure: torchrun's root cause is rank %s, the first rank with an error of its own %s",
              root_cause(stderr)[0], rank)
    own = rank_stderr(log_dir, rank) if rank is not None else None
    own = RANK_PREFIX.sub("", own) if own else own
    message = failure_summary(stderr, code, stopped, own, rank)
    if own and own.strip():
        tail = "\n".join("  " + line for line in own.strip().splitlines()[-10:])
        return message, f"Rank {rank}'s last lines of stderr:\n{tail}"
    tail = "\n".join("  " + line for line in stderr.strip().splitlines()[-8:])
    return message, f"The job's last lines of stderr:\n{tail}" if tail else "It wrote nothing to stderr."


def root_cause(stderr: str) -> tuple[int | None, str]:
    """(rank, text) of torchrun's "Root Cause (first observed failure)" block, else (None, all of stderr)."""
    root = stderr[stderr.rfind("Root Cause"):] if "Root Cause" in stderr else stderr
    rank = re.search(r"rank\s*:\s*(\d+)", root)
    return (int(rank.group(1)) if rank else None), root


FOLLOW_ON = re.compile(r"Connection closed by peer|Connection reset by peer|Broken pipe|remote process exited|"
                       r"ProcessGroupGloo.*(?:closed|timed out)|recv.*failed", re.IGNORECASE)
"""Errors a healthy rank raises because another rank died: never the cause of a failure."""


KILLED = re.compile(r"Signal \d+ \((?!SIGTERM\))\w+\)")
"""torchrun's line for a rank a signal killed, its own cleanup's SIGTERM aside."""


def failure_blocks(stderr: str) -> dict[int, str]:
    """rank -> its block of torchrun's failure report ("Failures:" and "Root Cause"), e.g.
    "[1]:\n  rank : 1 (local_rank: 1)\n  exitcode : -9 ...\n  traceback : Signal 9 (SIGKILL) ..."."""
    blocks: dict[int, str] = {}
    for block in re.finditer(r"^\[\d+\]:\s*$(.*?)(?=^\[\d+\]:|^-{8,}|^={8,}|\Z)", stderr, re.M | re.S):
        rank = re.search(r"rank\s*:\s*(\d+)", block.group(1))
        if rank:
            blocks.setdefault(int(rank.group(1)), block.group(1))
    return blocks


def primary_rank(stderr: str, log_dir: Path | None) -> int | None:
    """The rank whose own error caused the failure. torchrun's root cause is the first rank to
    exit, which may be a healthy rank whose collective broke when its peer died; then the first
    rank whose log holds an error that is not such a follow-on is the cause, and failing that a
    rank torchrun reports killed by a signal (it leaves no error of its own; torchrun dates a
    failure without an error file when it notices it, so it can lose the race to its peer's).

    Without a report (torchrun itself can fail while reading a dying rank's half-written error
    file, and then prints its own traceback instead) the ranks' logs alone name the cause."""
    first = root_cause(stderr)[0]
    if log_dir is None:
        return first
    ranks = sorted({int(p.parent.name) for p in Path(log_dir).glob("*/attempt_*/*/stderr.log") if p.parent.name.isdigit()})
    for rank in [first, *(r for r in ranks if r != first)] if first is not None else ranks:
        text = rank_stderr(log_dir, rank) or ""
        failed = OWN_LINE.search(text) or any(EXCEPTION_LINE.match(line) for line in RANK_PREFIX.sub("", text).splitlines())
        if failed and not FOLLOW_ON.search(text):
            return rank
    if first is not None and FOLLOW_ON.search(rank_stderr(log_dir, first) or ""):
        killed = [rank for rank, block in failure_blocks(stderr).items() if rank != first and KILLED.search(block)]
        if killed:
            return killed[0]
    return first


def rank_stderr(log_dir: Path | None, rank: int) -> str | None:
    """What local rank `rank` wrote to stderr in torchrun's latest attempt (one node: local rank = rank)."""
    if log_dir is None:
        return None
    files = sorted(Path(log_dir).glob(f"*/attempt_*/{rank}/stderr.log"), key=lambda p: p.stat().st_mtime)
    return files[-1].read_text(errors="replace") if files else None


def failure_summary(stderr: str, code: int, stopped: str = "the whole job was stopped", own: str | None = None,
                    failed_rank: int | None = None) -> str:
    """One sentence: which rank failed first, and why (its own error line, its exception, or its signal).

    `stderr` is torchrun's; `own` is the failing rank's own stderr where it was kept, and
    `failed_rank` that rank (`primary_rank`; default torchrun's root cause).
    """
    for text in (own or "", stderr):
        line = OWN_LINE.search(text)
        if line:
            return f"Rank {line.group(1)} failed: {line.group(2).strip()}"
    rank, root = root_cause(stderr)
    if failed_rank is not None and failed_rank != rank:  # that rank's own block of the report
        rank, root = failed_rank, failure_blocks(stderr).get(failed_rank, root)
    exitcode = re.search(r"exitcode\s*:\s*(-?\d+)", root)
    sig = re.search(r"Signal (\d+) \((\w+)\)", root)
    causes = [m.group(1) for m in map(EXCEPTION_LINE.match, (own or root).splitlines()) if m]
    if sig:
        what = f"killed by {sig.group(2)}"
    elif causes:
        what = causes[-1]
    else:
        what = f"exit code {exitcode.group(1) if exitcode else code}"
    return f"{'A rank' if rank is None else f'Rank {rank}'} failed ({what}); {stopped}."
