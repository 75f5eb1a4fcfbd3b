"""Issue #12: checkpoints survive a rank killed mid-save; wrong input and unwritable outputs are
refused before any work, each with a message that says what to change.

The input checks run in this process (typer's CliRunner, or the functions behind the verbs)
and, where the check must come before the work, the work is replaced by a function that fails
the test if reached. The checkpoint tests start real 2-rank runs (gloo) and are `slow`.

What the kill tests test, precisely: a test-only model file, when an environment variable asks
for it, makes one rank stop at a chosen point of `runtime.checkpoint.save` and write its pid to
a marker file; the test then sends that process SIGKILL. Two points: (a) "during the write":
rank 1 stops as DCP hands it its shard to write, while rank 0 has written its own shard (the
test waits until that file exists), so the new step's folder holds part of the data and no
index; (b) "before the rename": rank 0 stops after every rank's data is on disk, before the
metadata and the rename. A kill at any instant in between leaves one of those two states or
the renamed, complete step. The test does not cut a file's write() half-way; an atomic
rename makes that case the same as (a).
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from planner.errors import PlannerError
from tests.conftest import ROOT
from tests.runtime_plans import make_plan

MODEL = '''
import os, time
import torch
from torch import nn

class Net(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(2))
        self.head = nn.Linear(width, 4)

    def forward(self, x):
        for b in self.blocks:
            x = torch.relu(b(x))
        return self.head(x)

def build_model(width=8, **_):
    return Net(width)

def make_batch(batch_size, width=8, **_):
    return torch.randn(batch_size, width), torch.randint(4, (batch_size,))

# Test hooks (tests/test_reliability.py): stop one rank at a point of a checkpoint save.
FAULT, MARKER = os.environ.get("RELIABILITY_SAVE_FAULT", ""), os.environ.get("RELIABILITY_MARKER", "")

def _stop_here():
    with open(MARKER + ".part", "w") as f:
        f.write(str(os.getpid()))
    os.rename(MARKER + ".part", MARKER)
    time.sleep(300)

if FAULT:
    import torch.distributed as dist
    import runtime.checkpoint as ck
    from torch.distributed.checkpoint import filesystem as fs

    if FAULT == "during-write":
        _write = fs.FileSystemWriter.write_data
        def write_data(self, plan, planner):
            if dist.get_rank() == 1:
                _stop_here()
            return _write(self, plan, planner)
        fs.FileSystemWriter.write_data = write_data
    elif FAULT == "before-rename":
        _publish = ck._publish
        def publish(*args, **kwargs):
            _stop_here()
            return _publish(*args, **kwargs)
        ck._publish = publish
'''

runner = CliRunner()


def invoke(*args):
    """A `planner` verb in this process; the PlannerError it raises, if any."""
    from planner.cli import app

    result = runner.invoke(app, list(args))
    return result.exception if isinstance(result.exception, PlannerError) else result


def message(exc) -> str:
    assert isinstance(exc, PlannerError), getattr(exc, "output", exc)
    return " ".join(f"{exc.message} {exc.hint or ''}".split())


def _forbid(*_, **__):
    raise AssertionError("the work started before the input was refused")


@pytest.fixture
def model_file(write_model):
    return write_model(MODEL, "model.py")


@pytest.fixture
def plan_file(tmp_path, model_file):
    plan = make_plan(dp=2, args={"width": 8}, units=["blocks.0", "blocks.1", "head"])
    plan.model.file = str(model_file)
    return plan.save(tmp_path / "plan.json")


@pytest.fixture(scope="module")
def meta_profile(tmp_path_factory):
    from planner.profiler import profile_model

    path = tmp_path_factory.mktemp("profile") / "gpt-meta-h100.json"
    return profile_model("examples/gpt.py", {"n_layers": 2}, [1], device="meta", gpu="h100-80gb").save(path)


# ---- B. wrong input accepted silently ----

def test_misspelt_model_arg_names_the_closest(tmp_path):
    from planner.model_file import load_model_file

    # examples/gpt.py's functions take **_, so Python itself would accept and drop the typo.
    with pytest.raises(PlannerError) as err:
        load_model_file("examples/gpt.py", {"n_layerz": 2})
    assert "Unknown --model-arg n_layerz" in message(err.value) and "Did you mean n_layers?" in message(err.value)
    load_model_file("examples/gpt.py", {"n_layers": 2, "seq_len": 8})  # named by build_model or make_batch
    load_model_file("examples/hf_llama.py", {"num_key_value_heads": 2})  # **model_args forwards to the config


def test_make_batch_that_ignores_batch_size_is_refused(write_model):
    from planner.profiler import profile_model

    path = write_model(MODEL.replace("return torch.randn(batch_size, width), torch.randint(4, (batch_size,))",
                                     "return torch.randn(4, width), torch.randint(4, (4,))"), "fixed.py")
    with pytest.raises(PlannerError, match="does not follow batch_size"):
        profile_model(str(path), {}, [1], device="meta")


def test_model_without_parameters_is_refused(write_model):
    from planner.profiler import profile_model

    path = write_model(MODEL.replace("self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(2))",
                                     "self.blocks = nn.ModuleList(nn.ReLU() for _ in range(2))")
                       .replace("self.head = nn.Linear(width, 4)", "self.head = nn.Identity()"), "noparams.py")
    with pytest.raises(PlannerError, match="no parameters"):
        profile_model(str(path), {}, [1], device="meta")


def test_device_mismatch_is_refused_unless_allowed(tmp_path, meta_profile):
    plan = tmp_path / "plan.json"
    refused = invoke("solve", "--profile", str(meta_profile), "--gpus", "8", "--gpu", "a100-80gb", "--global-batch", "8", "-o", str(plan))
    assert "Device mismatch" in message(refused) and "h100-80gb" in message(refused) and "--allow-device-mismatch" in message(refused)
    assert not plan.exists()
    # --gpus without --gpu solves for the profile's own device
    same = invoke("solve", "--profile", str(meta_profile), "--gpus", "8", "--global-batch", "8", "-o", str(plan))
    assert same.exit_code == 0, same.output
    assert json.loads(plan.read_text())["cluster"]["gpu"] == "h100-80gb"
    allowed = invoke("solve", "--profile", str(meta_profile), "--gpus", "4", "--gpu", "cpu", "--global-batch", "8", "-o", str(plan),
                     "--allow-device-mismatch")
    assert allowed.exit_code == 0, allowed.output
    recorded = json.loads(plan.read_text())["device_mismatch"]
    assert "h100-80gb" in recorded and "cpu" in recorded
    shown = invoke("show", str(plan))
    assert "device mismatch" in " ".join(shown.output.split())


def test_top_zero_is_refused(meta_profile, tmp_path):
    assert "--top must be at least 1" in message(invoke("solve", "--profile", str(meta_profile), "--gpus", "8", "--global-batch", "8",
                                                       "--top", "0", "-o", str(tmp_path / "p.json")))


def test_solve_takes_the_profile_as_an_argument_or_option_once(meta_profile, tmp_path):
    plan = tmp_path / "plan.json"
    positional = invoke("solve", str(meta_profile), "--gpus", "8", "--global-batch", "8", "-o", str(plan))
    assert positional.exit_code == 0, positional.output
    assert json.loads(plan.read_text())["profile"] == str(meta_profile)
    assert "given twice" in message(invoke("solve", str(meta_profile), "--profile", str(meta_profile), "--gpus", "8",
                                          "--global-batch", "8", "-o", str(plan)))
    assert "No profile given" in message(invoke("solve", "--gpus", "8", "--global-batch", "8", "-o", str(plan)))


def test_a_plan_over_several_nodes_prints_their_commands_and_claims_no_metrics(tmp_path, model_file):
    """`planner run` of a plan over two nodes starts nothing here: it prints each node's torchrun
    command, and does not say it wrote the metrics file it could not have written."""
    plan = make_plan(dp=2, args={"width": 8}, units=["blocks.0", "blocks.1", "head"])
    plan.model.file = str(model_file)
    plan.cluster.num_nodes, plan.cluster.gpus_per_node = 2, 1
    path = plan.save(tmp_path / "plan.json")
    result = invoke("run", str(path), "-o", str(tmp_path / "m.json"))
    assert result.exit_code == 0, result.output
    assert "spans 2 nodes" in result.output and "--node-rank 1" in result.output
    assert "wrote" not in result.output and not (tmp_path / "m.json").exists()


def test_plan_carries_the_model_source_hash(meta_profile):
    from planner.cluster import make_cluster
    from planner.profile_schema import load_profile
    from planner.solver.solve import solve

    profile = load_profile(meta_profile)
    plan = solve(profile, make_cluster(8, 8, "h100-80gb"), 8)
    assert plan.model.source_sha256 == profile.model.source_sha256 and plan.device_mismatch is None


def test_edited_model_file_warns_at_run(plan_file, capsys):
    from planner.plan import load_plan
    from runtime.launch import precheck

    plan = load_plan(plan_file)
    plan.model.source_sha256 = "0" * 64  # as profiled before an edit that kept the structure
    edited = plan.save(plan_file)
    precheck(str(edited), None)
    err = " ".join(capsys.readouterr().err.split())
    assert "model.py has changed since it was profiled" in err and "the prediction may not hold" in err


def test_metrics_of_another_plan_are_refused(tmp_path, plan_file):
    from planner.plan import load_plan
    from planner.validate import compare, plan_digest

    plan = load_plan(plan_file)
    metrics = {"losses": [1.0], "step_times_s": [0.01], "median_iteration_time_s": 0.01, "samples_per_s": 800.0,
               "peak_memory_bytes": [0], "world_size": plan.world_size, "plan_sha256": plan_digest(plan), "plan": "a.json"}
    path = tmp_path / "m.json"
    path.write_text(json.dumps(metrics))
    assert compare(plan, path)  # its own metrics compare
    other = make_plan(dp=2, args={"width": 16}, units=["blocks.0", "blocks.1", "head"])
    with pytest.raises(PlannerError, match="recorded by another plan"):
        compare(other, path)
    refused = invoke("validate", str(other.save(tmp_path / "other.json")), str(path))
    assert "recorded by another plan" in message(refused)


@pytest.mark.parametrize("change,text", [
    (dict(lr=-0.1), "--lr must be a finite number >= 0 (got -0.1)"),
    (dict(lr=math.nan), "--lr must be a finite number >= 0 (got nan)"),
    (dict(steps=-1), "--steps must be at least 1"),
    (dict(timeout_s=0.0), "--timeout must be a positive number"),
])
def test_training_settings_are_refused_before_launch(plan_file, monkeypatch, change, text):
    import runtime.launch as launch

    monkeypatch.setattr(launch, "launch", _forbid)
    args = {"steps": 2, "lr": None, "timeout_s": 60.0, **change}
    with pytest.raises(PlannerError) as err:
        launch.run_plan(str(plan_file), **args)
    assert text in message(err.value)


# ---- C. outputs checked before the work ----

def _unwritable(tmp_path) -> Path:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    return blocker / "out.json"  # its folder would have to be made inside a file


@pytest.mark.parametrize("verb", ["profile", "profile-cluster", "solve", "show-csv", "show-gantt", "validate-gantt"])
def test_unwritable_output_is_refused_before_any_work(tmp_path, monkeypatch, verb, meta_profile, plan_file, model_file):
    import planner.launcher
    import planner.profiler
    import planner.solver.solve

    monkeypatch.setattr(planner.profiler, "profile_model", _forbid)
    monkeypatch.setattr(planner.solver.solve, "solve", _forbid)
    monkeypatch.setattr(planner.launcher, "launch", _forbid)
    bad = str(_unwritable(tmp_path))
    metrics = tmp_path / "m.json"
    metrics.write_text(json.dumps({"median_iteration_time_s": 0.1, "samples_per_s": 1.0}))
    args = {"profile": ["profile", str(model_file), "-o", bad],
            "profile-cluster": ["profile-cluster", "--nproc", "2", "-o", bad],
            "solve": ["solve", "--profile", str(meta_profile), "--gpus", "8", "--global-batch", "8", "-o", bad],
            "show-csv": ["show", str(meta_profile), "--csv", bad],
            "show-gantt": ["show", str(plan_file), "--gantt", bad],
            "validate-gantt": ["validate", str(plan_file), str(metrics), "--gantt", bad]}[verb]
    assert "cannot be written" in message(invoke(*args))
    assert "is a directory" in message(invoke(*args[:-1], str(tmp_path)))


@pytest.mark.parametrize("option", ["output", "save_params", "checkpoint_dir"])
def test_run_outputs_are_checked_before_launch(tmp_path, plan_file, monkeypatch, option):
    import runtime.launch as launch

    monkeypatch.setattr(launch, "launch", _forbid)
    monkeypatch.setattr(launch, "precheck", _forbid)
    with pytest.raises(PlannerError, match="cannot be written"):
        launch.run_plan(str(plan_file), **{option: str(_unwritable(tmp_path))})


# ---- A. checkpoints ----

def test_existing_checkpoint_dir_needs_resume_or_overwrite(tmp_path, plan_file, monkeypatch):
    import runtime.launch as launch

    ck = tmp_path / "ck"
    (ck / "step-00000004").mkdir(parents=True)
    monkeypatch.setattr(launch, "launch", _forbid)
    with pytest.raises(PlannerError) as err:
        launch.run_plan(str(plan_file), checkpoint_dir=str(ck))
    assert "already holds a checkpoint (step-00000004)" in message(err.value) and "--overwrite" in message(err.value)
    with pytest.raises(PlannerError, match="contradict"):
        launch.run_plan(str(plan_file), checkpoint_dir=str(ck), resume=True, overwrite=True)


def _save_in_process(directory: Path, step: int) -> Path:
    """A one-process checkpoint step as runtime/checkpoint.py lays it out (DCP needs no process group)."""
    import torch
    import torch.distributed.checkpoint as dcp

    from runtime.checkpoint import FORMAT, META, step_dir

    folder = step_dir(directory, step)
    dcp.save({"model": {"w": torch.arange(50_000, dtype=torch.float32)}}, checkpoint_id=str(folder))
    (folder / META).write_text(json.dumps({"step": step, "fingerprint": "fp", "format": FORMAT}))
    return folder


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_truncated_or_missing_checkpoint_file_is_named(tmp_path):
    from runtime.checkpoint import read_meta

    folder = _save_in_process(tmp_path, 2)
    assert read_meta(tmp_path, "fp")["directory"] == str(folder)
    shard = next(folder.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:1000])
    with pytest.raises(PlannerError) as err:
        read_meta(tmp_path, "fp")
    assert f"The checkpoint file {shard} is truncated" in message(err.value)
    (folder / ".metadata").write_bytes(b"\x80\x04")
    with pytest.raises(PlannerError, match=r"\.metadata cannot be read"):
        read_meta(tmp_path, "fp")


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_resume_picks_the_newest_complete_step(tmp_path):
    from runtime.checkpoint import read_meta

    _save_in_process(tmp_path, 2)
    newest = _save_in_process(tmp_path, 10)  # numerically, not by name order (step-00000010 > step-00000002)
    (tmp_path / ".step-00000012.tmp").mkdir()  # a save cut short: ignored
    assert read_meta(tmp_path, "fp") == {"step": 10, "fingerprint": "fp", "format": 2, "directory": str(newest)}


def cli(*args, env=None, timeout=240):
    return subprocess.run([sys.executable, "-m", "planner.cli", "run", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


def _losses(path: Path) -> list[float]:
    return json.loads(path.read_text())["losses"]


def _snapshot(folder: Path) -> dict:
    return {f.name: (f.stat().st_size, f.stat().st_mtime_ns) for f in folder.iterdir()}


def _killed_mid_save(tmp_path, plan_file, ck: Path, fault: str) -> subprocess.CompletedProcess:
    """Resume for 2 steps with `fault`; SIGKILL the stopped rank; the run's result."""
    marker = tmp_path / f"stopped-{fault}"
    out = open(tmp_path / f"{fault}.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "planner.cli", "run", str(plan_file), "--steps", "2", "--checkpoint-dir", str(ck),
                             "--resume", "--timeout", "200"], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "RELIABILITY_SAVE_FAULT": fault, "RELIABILITY_MARKER": str(marker)},
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 150
        while not marker.exists():
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / f"{fault}.log").read_text()[-2000:]
            time.sleep(0.1)
        temp = ck / ".step-00000004.tmp"
        if fault == "during-write":  # rank 0's shard is on disk, rank 1's is not: the kill lands mid-save
            while not list(temp.glob("__0_*.distcp")):
                assert time.monotonic() < deadline
                time.sleep(0.1)
            assert not list(temp.glob("__1_*.distcp")) and not (temp / ".metadata").exists()
        else:  # every rank's data and DCP's index written; no planner metadata, no rename
            assert (temp / ".metadata").exists() and not (temp / "planner_checkpoint.json").exists()
        os.kill(int(marker.read_text()), signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        out.close()
    return subprocess.CompletedProcess(proc.args, proc.returncode, (tmp_path / f"{fault}.log").read_text(), "")


@pytest.mark.slow
def test_rank_killed_mid_save_keeps_the_previous_step(tmp_path, plan_file):
    ck = tmp_path / "ck"
    whole = cli(str(plan_file), "--steps", "4", "--output", str(tmp_path / "whole.json"))
    first = cli(str(plan_file), "--steps", "2", "--checkpoint-dir", str(ck))
    for done in (whole, first):
        assert done.returncode == 0, done.stderr[-2000:]
    step2 = ck / "step-00000002"
    before = _snapshot(step2)
    for fault in ("during-write", "before-rename"):
        killed = _killed_mid_save(tmp_path, plan_file, ck, fault)
        assert killed.returncode != 0, killed.stdout[-2000:]
        assert sorted(p.name for p in ck.iterdir()) == [".step-00000004.tmp", "step-00000002"]
        assert _snapshot(step2) == before  # the previous step was not touched
    resumed = cli(str(plan_file), "--steps", "2", "--checkpoint-dir", str(ck), "--resume", "--output", str(tmp_path / "resumed.json"))
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"resuming from step 2 ({step2})" in resumed.stdout
    # Same plan, same reduction order, Adam state restored bit for bit: the losses are equal, not close.
    assert _losses(tmp_path / "resumed.json") == _losses(tmp_path / "whole.json")[2:]
    # The new step is complete, the cut-short save is gone, and the previous good step is kept.
    assert sorted(p.name for p in ck.iterdir()) == ["step-00000002", "step-00000004"]

    refused = cli(str(plan_file), "--steps", "1", "--checkpoint-dir", str(ck))
    assert refused.returncode == 1 and "already holds a checkpoint (step-00000004)" in " ".join(refused.stderr.split())
    shard = next((ck / "step-00000004").glob("__1_*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])  # a copy cut short
    damaged = cli(str(plan_file), "--steps", "1", "--checkpoint-dir", str(ck), "--resume")
    assert damaged.returncode == 1 and f"checkpoint file {shard} is truncated" in " ".join(damaged.stderr.split()).replace("\n", "")
    assert "Traceback" not in damaged.stderr.split("error")[-1]
    overwritten = cli(str(plan_file), "--steps", "1", "--checkpoint-dir", str(ck), "--overwrite")
    assert overwritten.returncode == 0, overwritten.stderr[-2000:]
    assert sorted(p.name for p in ck.iterdir()) == ["step-00000001"]
