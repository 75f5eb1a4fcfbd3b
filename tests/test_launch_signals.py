"""`planner run` under Ctrl-C, SIGTERM, --timeout and a failing rank: every process ends, the exit says why.

The process tests start `planner run` in a session of its own, record its whole process tree
(planner, torchrun, the ranks) once the ranks train, and check that every recorded process
is gone after the launcher returns. Whatever a test leaves is killed in `finally`.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from planner.launcher import describe_failure, failure_summary
from tests.conftest import ROOT
from tests.runtime_plans import make_plan

MODEL = '''
import os, time
import torch
import torch.distributed as dist
from torch import nn

class Net(nn.Module):
    def __init__(self, fault, marker):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        self.head = nn.Linear(8, 4)
        self.fault, self.marker, self.calls = fault, marker, 0

    def forward(self, x):
        self.calls += 1
        if dist.is_initialized():
            open(f"{self.marker}.rank{dist.get_rank()}", "w").close()  # this rank trains
            if dist.get_rank() == 1 and self.calls >= 3:
                if self.fault == "raise":
                    raise ValueError("injected: bad value in batch 3")
                if self.fault == "hang":
                    time.sleep(3600)
        time.sleep(0.02)  # a long run lasts: 400 steps take more than 8 s
        for b in self.blocks:
            x = b(x)
        return self.head(x)

def build_model(fault="none", marker="", **_):
    return Net(fault, marker)

def make_batch(batch_size, **_):
    return torch.randn(batch_size, 8), torch.randint(4, (batch_size,))
'''


def _plan(tmp_path, write_model, fault: str):
    plan = make_plan(dp=2, args={"fault": fault, "marker": str(tmp_path / "trains")}, units=["blocks.0", "blocks.1", "head"])
    plan.model.file = str(write_model(MODEL, "model.py"))
    return plan.save(tmp_path / "plan.json")


def _start(tmp_path, *args) -> subprocess.Popen:
    out = open(tmp_path / "output.txt", "w")
    return subprocess.Popen([sys.executable, "-m", "planner.cli", "run", *args], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)


def _tree(proc: subprocess.Popen) -> list[psutil.Process]:
    try:
        root = psutil.Process(proc.pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def _wait_for_ranks(tmp_path, proc: subprocess.Popen, timeout_s: float = 90) -> dict[int, psutil.Process]:
    """Every process of the job once both ranks are training (torchrun starts ranks in sessions of their own)."""
    seen: dict[int, psutil.Process] = {}
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        seen.update((p.pid, p) for p in _tree(proc))
        if all((tmp_path / f"trains.rank{r}").exists() for r in (0, 1)):
            seen.update((p.pid, p) for p in _tree(proc))
            return seen
        time.sleep(0.2)
    raise AssertionError(f"the ranks did not start (exit {proc.poll()}): {(tmp_path / 'output.txt').read_text()[-2000:]}")


def _left(processes) -> list[psutil.Process]:
    alive = []
    for p in processes:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                alive.append(p)
        except psutil.NoSuchProcess:
            pass
    return alive


def _kill(proc: subprocess.Popen, processes) -> None:
    for p in _left([*processes, *_tree(proc)]):
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    proc.wait(timeout=10)


@pytest.mark.slow
@pytest.mark.parametrize("sig,to_group,code", [(signal.SIGINT, True, 130), (signal.SIGTERM, False, 143)], ids=["sigint", "sigterm"])
def test_signal_stops_every_process_and_exits_128_plus_it(tmp_path, write_model, sig, to_group, code):
    # SIGINT goes to the whole process group, as a terminal's Ctrl-C does; SIGTERM to planner alone, as `kill` does.
    proc = _start(tmp_path, str(_plan(tmp_path, write_model, "none")), "--steps", "4000", "--timeout", "300")
    processes = {}
    try:
        processes = _wait_for_ranks(tmp_path, proc)
        assert len(processes) >= 4, processes  # planner, torchrun, two ranks
        start = time.monotonic()
        os.killpg(proc.pid, sig) if to_group else proc.send_signal(sig)
        assert proc.wait(timeout=10) == code
        assert time.monotonic() - start < 10
        gone, alive = psutil.wait_procs(_left(processes.values()), timeout=1)
        assert not _left(alive), [p.cmdline() for p in _left(alive)]
        text = " ".join((tmp_path / "output.txt").read_text().split())
        assert f"interrupted by {signal.Signals(sig).name}" in text and "Nothing was kept" in text, text[-2000:]
    finally:
        _kill(proc, processes.values())


@pytest.mark.slow
def test_timeout_ends_a_hung_rank_and_everything_else(tmp_path, write_model):
    proc = _start(tmp_path, str(_plan(tmp_path, write_model, "hang")), "--steps", "50", "--timeout", "25")
    processes = {}
    try:
        processes = _wait_for_ranks(tmp_path, proc)
        assert proc.wait(timeout=60) == 124
        gone, alive = psutil.wait_procs(_left(processes.values()), timeout=1)
        assert not _left(alive), [p.cmdline() for p in _left(alive)]
        text = " ".join((tmp_path / "output.txt").read_text().split())
        assert "did not finish within 25 s and was stopped" in text, text[-2000:]
    finally:
        _kill(proc, processes.values())


@pytest.mark.slow
def test_failing_rank_shows_its_own_exception(tmp_path, write_model):
    proc = _start(tmp_path, str(_plan(tmp_path, write_model, "raise")), "--steps", "5", "--timeout", "120")
    processes = {}
    try:
        assert proc.wait(timeout=150) == 1
        processes = {p.pid: p for p in _tree(proc)}
        text = (tmp_path / "output.txt").read_text()
        assert "Rank 1 failed (ValueError: injected: bad value in batch 3)" in " ".join(text.split()), text[-3000:]
        summary = text[text.index("Rank 1 failed"):]
        assert "Rank 1's last lines of stderr" in summary and 'raise ValueError("injected' in summary, summary
    finally:
        _kill(proc, processes.values())


def test_failure_summary_reads_the_failing_ranks_own_stderr(tmp_path):
    # torchrun's report names rank 1 but holds no exception (no error file); rank 1's log has it.
    torchrun = "Root Cause (first observed failure):\n[0]:\n  rank      : 1 (local_rank: 1)\n  exitcode  : 1 (pid: 7)\n"
    log = tmp_path / "run_x" / "attempt_0" / "1" / "stderr.log"
    log.parent.mkdir(parents=True)
    log.write_text("[rank1]: Traceback (most recent call last):\n[rank1]:   File 'x.py', line 3\n"
                   "[rank1]: torch.distributed.DistBackendError: NCCL error: unhandled system error\n")
    message, hint = describe_failure(torchrun, 1, tmp_path, "the whole job was stopped")
    assert message == "Rank 1 failed (torch.distributed.DistBackendError: NCCL error: unhandled system error); the whole job was stopped."
    assert hint.startswith("Rank 1's last lines of stderr:\n  Traceback")
    # Without a log, the exit code is all there is; a signal is named.
    assert failure_summary(torchrun, 1) == "Rank 1 failed (exit code 1); the whole job was stopped."
    assert "killed by SIGKILL" in failure_summary(torchrun + "  traceback : Signal 9 (SIGKILL) received by PID 7\n", -9)


def test_a_torchrun_that_crashed_itself_still_names_the_failing_rank(tmp_path):
    """torchrun can fail while reading a dying rank's half-written error file (CI once saw a
    JSONDecodeError from torch.distributed.elastic). Then it prints its own traceback and no
    report; the rank whose log holds its own error is the cause, not torchrun's exception."""
    torchrun = ('Traceback (most recent call last):\n  File "json/decoder.py", line 355, in raw_decode\n'
                "json.decoder.JSONDecodeError: Expecting value: line 1 column 1 (char 0)\n")
    for rank, text in ((0, "[rank0]: RuntimeError: [pair.cc:553] Connection closed by peer [127.0.0.1]:420\n"),
                       (1, "[rank1]: Traceback (most recent call last):\n[rank1]: ValueError: injected\n")):
        log = tmp_path / "run_x" / "attempt_0" / str(rank) / "stderr.log"
        log.parent.mkdir(parents=True)
        log.write_text(text)
    message, hint = describe_failure(torchrun, 1, tmp_path, "the whole job was stopped")
    assert message == "Rank 1 failed (ValueError: injected); the whole job was stopped."
    assert hint.startswith("Rank 1's last lines of stderr:")
    # With no rank's own error in the logs, torchrun's exception is all there is.
    (tmp_path / "run_x" / "attempt_0" / "1" / "stderr.log").write_text("")
    assert describe_failure(torchrun, 1, tmp_path, "stopped")[0].startswith("A rank failed (json.decoder.JSONDecodeError")


def test_a_killed_rank_is_named_when_its_peer_is_reported_first(tmp_path):
    """torchrun dates a failure without an error file when it notices it, so a rank killed by
    SIGKILL can lose the root cause to the peer whose collective broke on it: the peer's error is
    a follow-on, and the killed rank, listed among the failures with its signal, is named."""
    torchrun = ("Failures:\n[1]:\n  time      : t\n  rank      : 1 (local_rank: 1)\n  exitcode  : -9 (pid: 8)\n"
                "  error_file: <N/A>\n  traceback : Signal 9 (SIGKILL) received by PID 8\n" + "-" * 60 + "\n"
                "Root Cause (first observed failure):\n[0]:\n  time      : t\n  rank      : 0 (local_rank: 0)\n"
                "  exitcode  : 1 (pid: 7)\n" + "=" * 60 + "\n")
    for rank, text in ((0, "[rank0]: Traceback (most recent call last):\n[rank0]: RuntimeError: [pair.cc:553] "
                           "Connection closed by peer [127.0.0.1]:420\n"), (1, "")):
        log = tmp_path / "run_x" / "attempt_0" / str(rank) / "stderr.log"
        log.parent.mkdir(parents=True)
        log.write_text(text)
    message, _ = describe_failure(torchrun, 1, tmp_path, "the whole job was stopped")
    assert message == "Rank 1 failed (killed by SIGKILL); the whole job was stopped."
    # Without the follow-on (rank 0 failed on its own), rank 0 stays the cause.
    (tmp_path / "run_x" / "attempt_0" / "0" / "stderr.log").write_text("[rank0]: ValueError: bad batch\n")
    assert describe_failure(torchrun, 1, tmp_path, "the whole job was stopped")[0].startswith("Rank 0 failed")


def test_the_profilers_own_lines_are_kept_from_the_console(capsys):
    """torch's profiler (kineto) writes a line at each start and stop whatever its log level; the
    runtime profiles a step on CPU to measure memory, so those lines are the planner's noise. They
    stay in the kept tail (for a failure summary) and off the console; a rank's other lines, and a
    line that merely begins with the same word, are shown."""
    import collections
    import io

    from planner.launcher import _read

    lines = ["[default0]:USDT:2026-11-29 18:07:15 11391:11391 SyncActivityProfilerHandler.cpp:52] profiler_start\n",
             "[default1]:STAGE:2026-11-29 18:11:56 12451:12451 SyncActivityProfilerHandler.cpp:51] Completed Stage: Warm Up\n",
             "[default0]:losses: 5.69857\n", "[default1]:USDT is a word\n", "torchrun's own line\n"]
    kept: collections.deque = collections.deque()
    _read(io.StringIO("".join(lines)), kept, show_all=False)
    assert list(kept) == lines
    assert capsys.readouterr().err == "[default0]:losses: 5.69857\n[default1]:USDT is a word\n"
    _read(io.StringIO(lines[0].split(":", 1)[1] + "a line\n"), collections.deque(), show_all=True)
    assert capsys.readouterr().err == "a line\n"
