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

from planner.metrics_schema import Metrics, load_metrics
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
    metrics = load_metrics(metrics_path)  # the schema `planner validate` reads
    assert len(metrics.losses) == 3 and len(metrics.peak_memory_bytes) == plan.world_size
    assert metrics.plan == str(path) and not metrics.reference and metrics.world_size == plan.world_size
    if not torch.cuda.is_available():  # gpt_pp2 asks for 2; the other plans get the launcher's default
        assert metrics.cpu_threads == (plan.training.cpu_threads or int(os.environ.get("OMP_NUM_THREADS", "1")))
    stages = metrics.stage_times_s
    assert sorted(stages) == list(range(len(plan.stages)))
    assert all(t.forward_s > 0 and t.backward_s > 0 for t in stages.values())
    if plan.layout.pp_degree > 1:  # the last step's actions: each stage ran every micro-batch forward and backward once
        events = metrics.timeline.events
        for k in range(len(plan.stages)):
            for kind in ("F", "BW"):
                mine = sorted(e.microbatch for e in events if e.chunk == k and e.kind == kind)
                assert mine == list(range(plan.batch.num_microbatches)), (k, kind, mine)
        assert all(0 <= e.start_s < e.end_s for e in events)
        assert {e.rank for e in events} == set(range(plan.layout.pp_degree))
    else:
        assert metrics.timeline is None
    gantt = tmp_path / "gantt.png"
    checked = cli("validate", str(path), str(metrics_path), *(["--gantt", str(gantt)] if plan.layout.pp_degree > 1 else []))
    assert checked.returncode == 0, checked.stderr
    assert gantt.is_file() == (plan.layout.pp_degree > 1)
    text = " ".join(checked.stdout.split())
    assert all(f"stage {k} fwd+bwd per micro-batch" in text for k in range(len(plan.stages))), text


def test_measured_timeline_round_trips_a_simulated_one(tmp_path):
    # The runtime's recording path (runtime/metrics.py: PipelineRunner.events per rank ->
    # timeline_of -> build_metrics -> the metrics file) read back by `planner validate`
    # (load_metrics -> timeline_from_metrics) is the same schedule: same actions per rank, same
    # makespan and bubble. The simulator stands in for the run; its times are shifted to a wall
    # clock, which timeline_of must take off again.
    from planner.cost.simulator import simulate
    from planner.validate import timeline_from_metrics
    from runtime.metrics import build_metrics, timeline_of

    sim = simulate("1f1b", [1.0, 1.5, 1.0], [2.0, 2.5, 2.0], 6)
    wall = 1.7e9  # a time.time() reading: halves and quarters stay exact next to it, so the makespan compares exactly
    runner_events = [[(e.kind, e.chunk, e.microbatch, wall + e.start_s, wall + e.end_s) for e in sim.events if e.rank == r][::-1]
                     for r in range(3)]  # reversed: validate orders the actions by start time itself
    plan = load_plan(ROOT / "tests" / "plans" / "gpt_pp2.json")
    run = build_metrics(plan, [1.0, 0.9], [0.5, 0.4], [1, 1, 1], {}, {"w": torch.zeros(1)}, world_size=3,
                        timeline=timeline_of(runner_events, "1f1b", 3))
    path = run.metrics.save(tmp_path / "metrics.json")
    assert set(json.loads(path.read_text())) == set(Metrics.model_fields)  # no hidden key: the parameters stay beside the file
    assert set(run.params) == {"w"}
    back = timeline_from_metrics(load_metrics(path))
    assert back.makespan_s == sim.makespan_s and back.bubble_fraction() == pytest.approx(sim.bubble_fraction())
    for r in range(3):
        assert [(e.kind, e.chunk, e.microbatch) for e in back.events if e.rank == r] == \
               [(e.kind, e.chunk, e.microbatch) for e in sim.events if e.rank == r]
    assert back.peak_in_flight == sim.peak_in_flight
    assert timeline_from_metrics(run.metrics.model_copy(update={"timeline": None})) is None


def test_metrics_files_load_and_name_a_bad_field(tmp_path):
    # The committed results of this version's runtime (some before the plan fingerprint, the
    # timeline or cpu_threads were recorded) still load; a wrong field is named.
    from planner.errors import PlannerError

    committed = sorted((ROOT / "benchmarks" / "results").rglob("*metrics.json"))
    assert committed and all(load_metrics(p).losses for p in committed)
    bad = tmp_path / "m.json"
    good = ROOT / "benchmarks" / "results" / "pvm-cpu-cpu-float32-2-pp2-schedule1f1b-chain0-metrics.json"
    bad.write_text(good.read_text().replace('"world_size": 2', '"world_size": "two"'))
    with pytest.raises(PlannerError, match=r"world_size: Input should be a valid integer") as err:
        load_metrics(bad)
    assert "planner run" in err.value.hint
    bad.write_text('{"median_iteration_time_s": 1.0, "schema_version": 9}')
    with pytest.raises(PlannerError, match="schema version 9"):
        load_metrics(bad)
