"""Bad plans are refused before any process starts; a failing rank stops the job, named."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from tests.conftest import ROOT
from tests.runtime_plans import make_plan

FAULTY = '''
import os, signal
import torch
import torch.distributed as dist
from torch import nn

CALLS = [0]

class Net(nn.Module):
    def __init__(self, fault="none"):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        self.head = nn.Linear(8, 4)
        self.fault = fault

    def forward(self, x):
        CALLS[0] += 1
        if dist.is_initialized() and dist.get_rank() == 1 and CALLS[0] >= 3:
            if self.fault == "raise":
                raise RuntimeError("injected failure in forward")
            if self.fault == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
        for b in self.blocks:
            x = b(x)
        return self.head(x)

def build_model(fault="none", **_):
    return Net(fault)

def make_batch(batch_size, **_):
    return torch.randn(batch_size, 8), torch.randint(4, (batch_size,))
'''


def cli(*args, timeout=180):
    return subprocess.run([sys.executable, "-m", "planner.cli", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def _plan(tmp_path, write_model, fault):
    model = write_model(FAULTY, "faulty.py")
    plan = make_plan(dp=2, args={"fault": fault}, units=["blocks.0", "blocks.1", "head"])
    plan.model.file = str(model)
    return plan.save(tmp_path / "plan.json")


@pytest.mark.slow
@pytest.mark.parametrize("fault,cause", [("raise", "injected failure in forward"), ("kill", "SIGKILL")])
def test_failing_rank_stops_the_job_and_is_named(tmp_path, write_model, fault, cause):
    path = _plan(tmp_path, write_model, fault)
    start = time.monotonic()
    done = cli("run", str(path), "--steps", "5")
    assert time.monotonic() - start < 170
    assert done.returncode != 0
    text = " ".join(done.stderr.split())
    assert "Rank 1" in text and cause in text, text[-2000:]


def test_healthy_faulty_model_runs(tmp_path, write_model):
    # The same file with no fault trains: the failures above come from the injection alone.
    done = cli("run", str(_plan(tmp_path, write_model, "none")), "--steps", "2")
    assert done.returncode == 0, done.stderr[-2000:]


def test_corrupt_plan_is_refused_before_launch(tmp_path):
    bad = tmp_path / "plan.json"
    bad.write_text("{ not json")
    start = time.monotonic()
    done = cli("run", str(bad))
    assert done.returncode == 1 and "not valid JSON" in done.stderr and "Traceback" not in done.stderr
    assert time.monotonic() - start < 30


def test_plan_for_another_model_is_refused(tmp_path):
    plan = make_plan(dp=2)
    plan.stages[0].units = ["embed", "blocks.0", "norm", "head"]  # the model has four blocks
    path = tmp_path / "plan.json"
    path.write_text(plan.model_dump_json())
    done = cli("run", str(path))
    assert done.returncode == 1 and "do not match the model's units" in " ".join(done.stderr.split())


def test_fingerprint_mismatch_is_refused(tmp_path):
    plan = make_plan(dp=2)
    plan.model.fingerprint = "0" * 16
    done = cli("run", str(plan.save(tmp_path / "plan.json")))
    assert done.returncode == 1 and "fingerprint" in done.stderr


def test_inconsistent_plan_is_refused(tmp_path):
    data = json.loads(make_plan(dp=2).model_dump_json())
    data["layout"]["dp_degree"] = 3
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    done = cli("run", str(path))
    assert done.returncode == 1 and "not a valid plan" in done.stderr


@pytest.mark.slow
@pytest.mark.parametrize("pins", [[], ["--tp", "2", "--sequence-parallel"], ["--pp", "2", "--tp", "2", "--sequence-parallel"]],
                         ids=["free", "tp2-sp", "pp2-tp2-sp"])
def test_solver_plan_for_four_cpu_processes_runs_end_to_end(tmp_path, pins):
    # Whatever the solver writes (its own TP plans, sequence parallelism, cuts) the runtime runs.
    profile, plan = tmp_path / "p.json", tmp_path / "plan.json"
    args = ["-a", "n_layers=4", "-a", "d_model=32", "-a", "n_heads=4", "-a", "d_ff=64", "-a", "vocab_size=64", "-a", "seq_len=16"]
    assert cli("profile", "examples/gpt.py", *args, "--micro-batch-sizes", "1,2", "--repeats", "2", "-o", str(profile)).returncode == 0
    solved = cli("solve", "--profile", str(profile), "--gpus", "4", "--gpu", "cpu", "--global-batch", "8", *pins, "-o", str(plan))
    assert solved.returncode == 0, solved.stderr
    ran = cli("run", str(plan), "--steps", "2", "--output", str(tmp_path / "m.json"), timeout=240)
    assert ran.returncode == 0, ran.stderr[-2000:]
    checked = cli("validate", str(plan), str(tmp_path / "m.json"))
    assert checked.returncode == 0 and "iteration time" in checked.stdout
