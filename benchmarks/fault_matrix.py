"""Every fault and bad input of issue #12, run once through the `planner` command line.

    python benchmarks/fault_matrix.py            # writes benchmarks/results/fault_matrix.csv

For each case: the exit code, the seconds from start to exit and from the fault to exit (after
the signal or the kill -9; after the deadline for --timeout), the first line the user is
shown (the error, warning or stop notice), how many of the job's processes were still alive
after `planner` returned (the whole process tree is recorded while it runs, as
tests/test_launch_signals.py does; any left is killed here and counted), and what data was
kept (checkpoint steps, output files). Signals, the timeout and a failing rank reuse the
model of tests/test_launch_signals.py; a rank killed mid-save reuses the save hooks of
tests/test_reliability.py. Nothing here is a pass/fail assertion: the table is the result.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.runtime_plans import make_plan  # noqa: E402
from tests.test_launch_signals import MODEL as SIGNAL_MODEL  # noqa: E402
from tests.test_reliability import MODEL as SAVE_MODEL  # noqa: E402

UNITS = ["blocks.0", "blocks.1", "head"]


@dataclass
class Outcome:
    code: int
    seconds: float
    stdout: str
    stderr: str
    left: int
    after_fault: float | None = None
    """Seconds from the signal or kill to the exit (None: no fault was injected while it ran)."""


def planner(*args: str, env: dict | None = None, during: Callable[[subprocess.Popen, dict], float] | None = None,
            timeout_s: float = 300) -> Outcome:
    """Run `planner ARGS` in a session of its own, recording its process tree; `during` acts on it while it runs."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        started = time.monotonic()
        proc = subprocess.Popen([sys.executable, "-m", "planner.cli", *args], cwd=ROOT, stdout=out, stderr=err, text=True,
                                env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}, start_new_session=True)
        seen: dict[int, psutil.Process] = {}
        try:
            fault_at = during(proc, seen) if during is not None else None
            while proc.poll() is None and time.monotonic() - started < timeout_s:
                _record(proc, seen)
                time.sleep(0.1)
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            code = proc.wait(timeout=30)
            ended = time.monotonic()
            seconds = ended - started
            after_fault = ended - fault_at if fault_at is not None else None
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
        time.sleep(0.5)  # a process that is on its way out is not "left"
        left = [p for p in seen.values() if p.pid != proc.pid and _alive(p)]
        for p in left:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        out.seek(0)
        err.seek(0)
        return Outcome(code, seconds, out.read(), err.read(), len(left), after_fault)


def _record(proc: subprocess.Popen, seen: dict) -> None:
    try:
        root = psutil.Process(proc.pid)
        seen.update((p.pid, p) for p in [root, *root.children(recursive=True)])
    except psutil.NoSuchProcess:
        pass


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def first_line(o: Outcome) -> str:
    lines = [line.strip() for line in (o.stderr + "\n" + o.stdout).splitlines() if line.strip()]
    for key in ("error", "stopped", "warning", "interrupted", "resuming"):
        hit = next((line for line in lines if line.lower().startswith(key)), None)
        if hit:
            return hit[:200]
    return (lines[0] if lines else "")[:200]


def steps_in(ck: Path) -> str:
    if not ck.is_dir():
        return "no checkpoint dir"
    names = sorted(p.name for p in ck.iterdir())
    return "checkpoint: " + (" ".join(names) if names else "empty")


def wait_for(condition: Callable[[], bool], proc: subprocess.Popen, seen: dict, timeout_s: float = 150) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        _record(proc, seen)
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("the job ended before the fault could be injected")
        time.sleep(0.1)
    _record(proc, seen)


def main() -> None:
    work = Path(tempfile.mkdtemp(prefix="fault-matrix-"))
    rows: list[dict] = []

    def add(case: str, o: Outcome, kept: str) -> None:
        short = lambda text: text.replace(str(work), "$WORK")  # noqa: E731  (the CSV does not depend on the temp folder)
        rows.append({"case": case, "exit_code": o.code, "seconds_to_exit": f"{o.seconds:.1f}",
                     "seconds_after_fault": "" if o.after_fault is None else f"{o.after_fault:.1f}", "message_first_line": short(first_line(o)),
                     "processes_left": o.left, "data_kept": short(kept)})
        print(f"{case}: exit {o.code} in {o.seconds:.1f} s, left {o.left}: {first_line(o)}", flush=True)

    # ---- signals, timeout, failing rank (tests/test_launch_signals.py's model) ----
    signal_model = work / "signal_model.py"
    signal_model.write_text(SIGNAL_MODEL)

    def signal_plan(fault: str, name: str) -> Path:
        plan = make_plan(dp=2, args={"fault": fault, "marker": str(work / f"trains-{name}")}, units=UNITS)
        plan.model.file = str(signal_model)
        return plan.save(work / f"{name}.json")

    for name, sig, to_group in (("SIGINT to the job (Ctrl-C)", signal.SIGINT, True), ("SIGTERM to planner", signal.SIGTERM, False)):
        tag = "int" if sig == signal.SIGINT else "term"
        ck = work / f"ck-{tag}"

        def send(proc, seen, tag=tag, sig=sig, to_group=to_group):
            wait_for(lambda: all((work / f"trains-{tag}.rank{r}").exists() for r in (0, 1)), proc, seen)
            os.killpg(proc.pid, sig) if to_group else proc.send_signal(sig)
            return time.monotonic()

        o = planner("run", str(signal_plan("none", tag)), "--steps", "4000", "--timeout", "300", "--checkpoint-dir", str(ck), during=send)
        add(name, o, steps_in(ck))
    o = planner("run", str(signal_plan("hang", "hang")), "--steps", "50", "--timeout", "20")
    # The limit counts from the launch, after the plan and model checks: an upper bound.
    add("rank hangs, --timeout 20", dataclasses.replace(o, after_fault=o.seconds - 20), "-")
    o = planner("run", str(signal_plan("raise", "raise")), "--steps", "5", "--timeout", "120")
    add("rank raises ValueError", o, "-")

    # ---- checkpoints (tests/test_reliability.py's model and save hooks) ----
    save_model = work / "save_model.py"
    save_model.write_text(SAVE_MODEL)
    plan = make_plan(dp=2, args={"width": 8}, units=UNITS)
    plan.model.file = str(save_model)
    plan_file = plan.save(work / "plan.json")
    ck = work / "ck"
    o = planner("run", str(plan_file), "--steps", "2", "--checkpoint-dir", str(ck))
    add("save step 2 (baseline)", o, steps_in(ck))
    for fault in ("during-write", "before-rename"):
        marker = work / f"stopped-{fault}"

        def kill(proc, seen, marker=marker, fault=fault):
            temp = ck / ".step-00000004.tmp"
            wait_for(marker.exists, proc, seen)
            if fault == "during-write":
                wait_for(lambda: bool(list(temp.glob("__0_*.distcp"))), proc, seen)
            os.kill(int(marker.read_text()), signal.SIGKILL)
            return time.monotonic()

        o = planner("run", str(plan_file), "--steps", "2", "--checkpoint-dir", str(ck), "--resume",
                    env={"RELIABILITY_SAVE_FAULT": fault, "RELIABILITY_MARKER": str(marker)}, during=kill)
        add(f"kill -9 a rank mid-save ({fault})", o, steps_in(ck))
    o = planner("run", str(plan_file), "--steps", "2", "--checkpoint-dir", str(ck), "--resume")
    add("resume after the killed saves", o, steps_in(ck))
    o = planner("run", str(plan_file), "--steps", "1", "--checkpoint-dir", str(ck))
    add("existing --checkpoint-dir without --resume", o, steps_in(ck))
    damaged = work / "ck-damaged"
    shutil.copytree(ck, damaged)
    shard = next((damaged / "step-00000004").glob("__1_*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])
    o = planner("run", str(plan_file), "--steps", "1", "--checkpoint-dir", str(damaged), "--resume")
    add("resume from a truncated shard", o, steps_in(damaged))
    o = planner("run", str(plan_file), "--steps", "1", "--checkpoint-dir", str(ck), "--overwrite")
    add("--overwrite an existing checkpoint", o, steps_in(ck))

    # ---- wrong input ----
    o = planner("profile", "examples/gpt.py", "--model-arg", "n_layerz=2", "--device", "meta", "-o", str(work / "p.json"))
    add("--model-arg n_layerz=2 (typo)", o, "profile written" if (work / "p.json").exists() else "nothing written")
    fixed = work / "fixed_batch.py"
    fixed.write_text(SAVE_MODEL.replace("return torch.randn(batch_size, width), torch.randint(4, (batch_size,))",
                                        "return torch.randn(4, width), torch.randint(4, (4,))"))
    o = planner("profile", str(fixed), "--micro-batch-sizes", "1,2", "-o", str(work / "fixed.json"))
    add("make_batch ignores batch_size", o, "profile written" if (work / "fixed.json").exists() else "nothing written")
    noparams = work / "noparams.py"
    noparams.write_text(SAVE_MODEL.replace("self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(2))",
                                           "self.blocks = nn.ModuleList(nn.ReLU() for _ in range(2))")
                        .replace("self.head = nn.Linear(width, 4)", "self.head = nn.Identity()"))
    o = planner("profile", str(noparams), "-o", str(work / "np.json"))
    add("model without parameters", o, "profile written" if (work / "np.json").exists() else "nothing written")
    cpu_profile = work / "cpu-profile.json"
    o = planner("profile", str(save_model), "-a", "width=8", "--micro-batch-sizes", "1,2", "--repeats", "3", "-o", str(cpu_profile))
    add("profile the test model on CPU (baseline)", o, "profile written" if cpu_profile.exists() else "nothing written")
    o = planner("solve", "--profile", str(cpu_profile), "--gpus", "8", "--gpu", "a100-80gb", "--global-batch", "8",
                "-o", str(work / "mismatch.json"))
    add("CPU profile solved for A100s", o, "plan written" if (work / "mismatch.json").exists() else "nothing written")
    o = planner("solve", "--profile", str(cpu_profile), "--gpus", "8", "--gpu", "a100-80gb", "--global-batch", "8",
                "--allow-device-mismatch", "-o", str(work / "mismatch.json"))
    recorded = json.loads((work / "mismatch.json").read_text()).get("device_mismatch") if (work / "mismatch.json").exists() else None
    add("... with --allow-device-mismatch", o, f"plan written, device_mismatch: {recorded}")
    o = planner("solve", "--profile", str(cpu_profile), "--gpus", "2", "--global-batch", "8", "--top", "0", "-o", str(work / "top0.json"))
    add("--top 0", o, "plan written" if (work / "top0.json").exists() else "nothing written")
    metrics = work / "metrics.json"
    o = planner("run", str(plan_file), "--steps", "2", "--output", str(metrics))
    add("run with --output (baseline)", o, "metrics written" if metrics.exists() else "nothing written")
    other = make_plan(dp=2, args={"width": 8}, units=UNITS, mbs=1, m=4)
    other.model.file = str(save_model)
    o = planner("validate", str(other.save(work / "other.json")), str(metrics))
    add("validate with another plan's metrics", o, "-")
    edited = work / "edited_model.py"
    edited.write_text(SAVE_MODEL + "\n# an edit that keeps the structure\n")
    hashed = make_plan(dp=2, args={"width": 8}, units=UNITS)
    hashed.model.file, hashed.model.source_sha256 = str(edited), __import__("hashlib").sha256(SAVE_MODEL.encode()).hexdigest()
    o = planner("run", str(hashed.save(work / "hashed.json")), "--steps", "1")
    add("model file edited after solving", o, "-")
    for case, extra in (("--lr -0.1", ["--lr", "-0.1"]), ("--lr nan", ["--lr", "nan"]), ("--steps -1", ["--steps", "-1"])):
        o = planner("run", str(plan_file), *extra)
        add(case, o, "-")

    # ---- outputs that cannot be written (a folder would have to be made inside a file) ----
    # (--save-params is an option of `python -m runtime` and run_plan, not of `planner run`: tests/test_reliability.py)
    blocker = work / "a-file"
    blocker.write_text("")
    bad = str(blocker / "out")
    for case, args in (
        ("profile -o unwritable", ["profile", str(save_model), "-o", bad]),
        ("profile-cluster -o unwritable", ["profile-cluster", "--nproc", "2", "-o", bad]),
        ("solve -o unwritable", ["solve", "--profile", str(cpu_profile), "--gpus", "2", "--gpu", "cpu", "--global-batch", "8", "-o", bad]),
        ("run --output unwritable", ["run", str(plan_file), "--output", bad]),
        ("run --checkpoint-dir unwritable", ["run", str(plan_file), "--checkpoint-dir", bad]),
        ("validate --gantt unwritable", ["validate", str(plan_file), str(metrics), "--gantt", bad]),
        ("show --csv unwritable", ["show", str(cpu_profile), "--csv", bad]),
        ("show --gantt unwritable", ["show", str(work / "mismatch.json"), "--gantt", bad]),
        ("profile -o a directory", ["profile", str(save_model), "-o", str(work)]),
    ):
        add(case, planner(*args), "-")

    out = ROOT / "benchmarks" / "results" / "fault_matrix.csv"
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print(f"wrote {out}")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
