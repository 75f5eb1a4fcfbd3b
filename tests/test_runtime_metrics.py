"""Hand-written plans (tests/plans/) run through `planner run`, and their metrics through `planner validate`.

The plans name their model file relative to the plan's folder, as a person writing one
beside their model would; each run must record a forward and a backward time for every stage.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

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
    if not torch.cuda.is_available():  # gpt_pp2 asks for 2; the other plans get the launcher's default
        assert metrics["cpu_threads"] == (plan.training.cpu_threads or int(os.environ.get("OMP_NUM_THREADS", "1")))
    stages = metrics["stage_times_s"]
    assert sorted(stages) == [str(k) for k in range(len(plan.stages))]
    assert all(t["forward_s"] > 0 and t["backward_s"] > 0 for t in stages.values())
    if plan.layout.pp_degree > 1:  # the last step's actions: each stage ran every micro-batch forward and backward once
        events = metrics["timeline"]["events"]
        for k in range(len(plan.stages)):
            for kind in ("F", "BW"):
                mine = sorted(e["microbatch"] for e in events if e["chunk"] == k and e["kind"] == kind)
                assert mine == list(range(plan.batch.num_microbatches)), (k, kind, mine)
        assert all(0 <= e["start_s"] < e["end_s"] for e in events)
        assert {e["rank"] for e in events} == set(range(plan.layout.pp_degree))
    else:
        assert metrics["timeline"] is None
    gantt = tmp_path / "gantt.png"
    checked = cli("validate", str(path), str(metrics_path), *(["--gantt", str(gantt)] if plan.layout.pp_degree > 1 else []))
    assert checked.returncode == 0, checked.stderr
    assert gantt.is_file() == (plan.layout.pp_degree > 1)
    text = " ".join(checked.stdout.split())
    assert all(f"stage {k} fwd+bwd per micro-batch" in text for k in range(len(plan.stages))), text


def test_measured_timeline_round_trips_a_simulated_one(tmp_path):
    # A run's timeline (runtime/metrics.py's JSON form) read back by `planner validate` is the
    # same schedule: same actions per rank, same makespan and bubble. Uses the simulator as the "run".
    from planner.cost.simulator import simulate
    from planner.validate import timeline_from_metrics

    sim = simulate("1f1b", [1.0, 1.5, 1.0], [2.0, 2.5, 2.0], 6)
    metrics = {"timeline": {"schedule": "1f1b", "num_ranks": 3, "events": [
        {"rank": e.rank, "chunk": e.chunk, "microbatch": e.microbatch, "kind": e.kind, "start_s": e.start_s, "end_s": e.end_s}
        for e in reversed(sim.events)]}}
    back = timeline_from_metrics(metrics)
    assert back.makespan_s == sim.makespan_s and back.bubble_fraction() == pytest.approx(sim.bubble_fraction())
    for r in range(3):
        assert [(e.kind, e.chunk, e.microbatch) for e in back.events if e.rank == r] == \
               [(e.kind, e.chunk, e.microbatch) for e in sim.events if e.rank == r]
    assert back.peak_in_flight == sim.peak_in_flight
    assert timeline_from_metrics({"timeline": None}) is None
