"""Gradient clipping by the global norm matches the reference under sharded and pipelined plans.

max_norm is far below the gradient norm of a fresh model (~1), so every step clips. Adam is
invariant to a constant gradient scale but not to one that changes from step to step, so a
norm taken over part of the model (one pipeline stage, one TP shard) moves the parameters
away from the reference by more than the parity tolerance (see test_runtime_parity.py).
"""

from __future__ import annotations

import pytest

from tests.runtime_plans import GPT_TP, make_plan
from tests.test_runtime_parity import check_parity

MAX_NORM = 0.05

CASES = {
    "clip-pp2": dict(pp=2, m=2),
    "clip-tp2": dict(tp=2, tp_plan=GPT_TP),
    "clip-dp2xtp2-zero3": dict(dp=2, tp=2, zero=3, tp_plan=GPT_TP),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_clipped_parity(case, tmp_path):
    plan = make_plan(**CASES[case])
    plan.training.grad_clip = MAX_NORM
    check_parity(plan, tmp_path)
