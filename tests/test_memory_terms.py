"""The solver's plans name every term of their predicted peak memory (issue #13, "memory you can
trust"): `Prediction.memory_terms_bytes` per stage, summing to `peak_memory_bytes`, each term
what planner/cost/memory.py says it is, and `planner show` prints them."""

from __future__ import annotations

import pytest

from planner.cluster import make_cluster
from planner.cost.memory import STATE_BYTES, stashed_weight_bytes
from planner.solver.solve import Pins, solve
from tests.conftest import EXAMPLES

GPT = dict(n_layers=8, d_model=1024, n_heads=16, d_ff=4096, vocab_size=32000, seq_len=1024)


@pytest.fixture(scope="module")
def gpt_profile():
    from planner.profiler import profile_model

    return profile_model(str(EXAMPLES / "gpt.py"), GPT, [1, 2, 4], device="meta", gpu="a100-80gb", dtype="bfloat16")


def _check_sums(plan):
    pred = plan.prediction
    assert pred.memory_terms_bytes is not None and len(pred.memory_terms_bytes) == len(plan.stages)
    for terms, peak in zip(pred.memory_terms_bytes, pred.peak_memory_bytes, strict=True):
        assert all(v >= 0 for v in terms.values()), terms
        assert sum(v for name, v in terms.items() if name != "fragmentation") == peak
        assert terms["fragmentation"] > 0  # an A100's allowance: the 10% the search keeps free


CASES = {
    "zero0-pp2": (Pins(pp=2, dp=4, tp=1, zero_stage=0), False, False),
    "zero1": (Pins(pp=1, dp=8, tp=1, zero_stage=1), False, False),
    "zero3-tp2": (Pins(pp=1, dp=4, tp=2, zero_stage=3), False, False),
    "offload": (Pins(pp=1, dp=8, tp=1, zero_stage=2, offload=True), True, False),
    "2bw": (Pins(pp=4, dp=2, tp=1, schedule="pipedream-2bw"), False, True),
    "recompute": (Pins(pp=2, dp=4, tp=1, recompute="full"), False, False),
}


@pytest.mark.parametrize("case", list(CASES))
def test_terms_sum_to_the_peak(gpt_profile, case):
    pins, offload, asynchronous = CASES[case]
    plan = solve(gpt_profile, make_cluster(8, gpu="a100-80gb"), 32, pins, allow_offload=offload,
                 allow_async=asynchronous)
    _check_sums(plan)
    terms = plan.prediction.memory_terms_bytes
    assert ("stashed_weights" in terms[0]) == asynchronous
    if case == "recompute":
        assert any(t["transient"] > 0 for t in terms)  # rebuilding a unit's activations in the backward


def test_each_state_term_is_the_memory_model_s(gpt_profile):
    """ZeRO 1 on dp 8: 16-bit weights and gradients whole, fp32 master weights and moments over 8;
    2BW: one more copy of the 16-bit weights."""
    plan = solve(gpt_profile, make_cluster(8, gpu="a100-80gb"), 32, Pins(pp=1, dp=8, tp=1, zero_stage=1))
    (terms,) = plan.prediction.memory_terms_bytes
    n = gpt_profile.model.num_parameters
    weights, grads, optimizer = STATE_BYTES["mixed"]
    assert terms["parameters"] == pytest.approx(n * weights, rel=1e-6)
    assert terms["gradients"] == pytest.approx(n * grads, rel=1e-6)
    assert terms["optimizer_state"] == pytest.approx(n * optimizer / 8, rel=1e-6)
    assert terms["activations"] > 0

    plan = solve(gpt_profile, make_cluster(8, gpu="a100-80gb"), 32, Pins(pp=4, dp=2, tp=1, schedule="pipedream-2bw"),
                 allow_async=True)
    for terms in plan.prediction.memory_terms_bytes:
        assert terms["stashed_weights"] == pytest.approx(stashed_weight_bytes(terms["parameters"] / weights, "bfloat16",
                                                                               0, 2), rel=1e-6)


def test_offload_moves_states_off_the_gpu(gpt_profile):
    cluster = make_cluster(8, gpu="a100-80gb")
    kept = solve(gpt_profile, cluster, 32, Pins(pp=1, dp=8, tp=1, zero_stage=2, offload=False))
    moved = solve(gpt_profile, cluster, 32, Pins(pp=1, dp=8, tp=1, zero_stage=2, offload=True), allow_offload=True)
    (a,), (b,) = kept.prediction.memory_terms_bytes, moved.prediction.memory_terms_bytes
    assert b["optimizer_state"] == 0 and b["gradients"] == 0 and a["optimizer_state"] > 0
    assert b["parameters"] == a["parameters"]  # ZeRO 1-2 offload keeps the weights on the GPU


def test_show_prints_the_terms(gpt_profile, tmp_path):
    import os
    import subprocess
    import sys

    from tests.conftest import ROOT

    plan = solve(gpt_profile, make_cluster(8, gpu="a100-80gb"), 32, Pins(pp=2, dp=4, tp=1))
    path = plan.save(tmp_path / "plan.json")
    done = subprocess.run([sys.executable, "-m", "planner.cli", "show", str(path)], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "COLUMNS": "200"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert "by term" in done.stdout and "optimizer state" in done.stdout
