"""Hand-written plans (tests/plans/) run through `planner run`, and their metrics through `planner validate`.

The plans name their model file relative to the plan's folder, as a person writing one
beside their model would; each run must record a forward and a backward time for every stage.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from planner.plan import load_plan
from tests.conftest import ROOT

PLANS = sorted((ROOT / "tests" / "plans").glob("*.json"))


def cli(*args, timeout=240):
    return subprocess.run([sys.executable, "-m", "planner.cli", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
@pytest.mark.parametrize("path", PLANS, ids=[p.stem for p in PLANS])
def test_hand_written_plan_runs_and_validates(path, tmp_path):
    plan = load_plan(path)
    metrics_path = tmp_path / "m.json"
    ran = cli("run", str(path), "--steps", "3", "--output", str(metrics_path))
    assert ran.returncode == 0, ran.stderr[-2000:]
    metrics = json.loads(metrics_path.read_text())
    assert len(metrics["losses"]) == 3 and len(metrics["peak_memory_bytes"]) == plan.world_size
    stages = metrics["stage_times_s"]
    assert sorted(stages) == [str(k) for k in range(len(plan.stages))]
    assert all(t["forward_s"] > 0 and t["backward_s"] > 0 for t in stages.values())
    checked = cli("validate", str(path), str(metrics_path))
    assert checked.returncode == 0, checked.stderr
    text = " ".join(checked.stdout.split())
    assert all(f"stage {k} fwd+bwd per micro-batch" in text for k in range(len(plan.stages))), text
