"""Checkpoints: train under plan A, resume under plan B, match an uninterrupted reference."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import ROOT
from tests.ranks import run_ranks
from tests.runtime_plans import GPT_TP, make_plan


def cli(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "planner.cli", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)


RESUMES = {
    "pp2xdp2-to-tp2xdp2": (dict(pp=2, dp=2, m=2), dict(tp=2, dp=2, m=2, tp_plan=GPT_TP)),
    # Two stage chunks per rank (each with its own optimizer) saved, resumed as FSDP shards: and back.
    "interleaved-to-zero3": (dict(pp=2, v=2, schedule="interleaved-1f1b", m=2, mbs=4), dict(dp=2, zero=3, m=2)),
    "zero3-to-interleaved": (dict(dp=2, zero=3, m=2), dict(pp=2, v=2, schedule="interleaved-1f1b", m=2, mbs=4)),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", RESUMES)
def test_resume_under_another_plan_matches_reference(tmp_path, case):
    a, b = RESUMES[case]
    check_resume_matches_reference(make_plan(**a), make_plan(**b), tmp_path)


def check_resume_matches_reference(a, b, tmp_path):
    """3 steps under plan `a` saved, 3 more resumed under plan `b`: the losses of 6 reference steps.
    The runs are `python -m runtime` as `planner run` starts it (the reference in this process,
    the ranks by tests/ranks.py); test_checkpoint_of_another_model_is_refused goes through the CLI."""
    from tests.test_runtime_parity import _reference_here

    plan_a, plan_b = a.save(tmp_path / "a.json"), b.save(tmp_path / "b.json")
    ck = tmp_path / "ck"
    _reference_here(plan_a, tmp_path, 6)  # ref.json
    for plan, path, resume, out in ((a, plan_a, [], "a-m.json"), (b, plan_b, ["--resume"], "b-m.json")):
        done = run_ranks(plan.world_size, [str(path), "--steps", "3", "--checkpoint-dir", str(ck), *resume,
                                           "--output", str(tmp_path / out)], ROOT, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
    losses = [json.loads((tmp_path / f).read_text())["losses"] for f in ("ref.json", "a-m.json", "b-m.json")]
    # Same tolerance as the parity tests (float32, reordered sums); resuming must not restart Adam or the data.
    assert losses[1] + losses[2] == pytest.approx(losses[0], rel=1e-5)
    return plan_a, plan_b


@pytest.mark.slow
def test_checkpoint_of_another_model_is_refused(tmp_path):
    ck = tmp_path / "ck"
    saved = cli("run", str(make_plan(dp=2).save(tmp_path / "a.json")), "--steps", "1", "--checkpoint-dir", str(ck))
    assert saved.returncode == 0, saved.stderr[-2000:]
    other = make_plan(model="llama", dp=2).save(tmp_path / "b.json")
    done = cli("run", str(other), "--steps", "1", "--checkpoint-dir", str(ck), "--resume")
    assert done.returncode == 1 and "from another model" in " ".join(done.stderr.split())


@pytest.mark.parametrize("meta,message", [
    ({"step": 3, "fingerprint": "abc"}, "has format 1"),  # written before optimizer state was flattened
    ({"step": 3, "fingerprint": "other", "format": 2}, "from another model"),
    ("{not json", "not valid JSON"),
])
def test_checkpoint_metadata_is_checked_before_loading(tmp_path, meta, message):
    from planner.errors import PlannerError
    from runtime.checkpoint import META, read_meta

    (tmp_path / META).write_text(meta if isinstance(meta, str) else json.dumps(meta))
    with pytest.raises(PlannerError, match=message):
        read_meta(tmp_path, "abc")
    with pytest.raises(PlannerError, match="holds no planner checkpoint"):
        read_meta(tmp_path / "empty", "abc")
