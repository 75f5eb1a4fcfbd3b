"""ZeRO in a pipeline runs as ZeRO 1 (planner/solver/solve.py `PIPELINE_ZERO`): torch's pipeline
schedules reduce FSDP's gradients once, after the stage's last backward, and keep parameters
gathered after each backward. Measured on CPU (gpt, pp2 x dp2, benchmarks/memory_cpu.py case
gpt-pp2xdp2-zero1 and the note of 2026-11-29): ZeRO 2 peaked at ZeRO 1's bytes and ZeRO 3 above
them, while the memory model priced them 16-25% lower. So the search writes no such plan, a pin
asking for one is refused with the reason, and an engine's configuration is priced as it runs."""

from __future__ import annotations

import pytest

from planner.cluster import make_cluster
from planner.engines.common import EngineLayout
from planner.engines.pricing import price
from planner.errors import PlannerError
from planner.profiler import profile_model
from planner.solver.solve import Pins, search, solve
from tests.conftest import EXAMPLES

ARGS = dict(n_layers=8, d_model=1024, n_heads=16, d_ff=4096, vocab_size=8192, seq_len=512)


@pytest.fixture(scope="module")
def gpt():
    return profile_model(str(EXAMPLES / "gpt.py"), ARGS, [1, 2], device="meta", gpu="a100-80gb", dtype="bfloat16")


def test_the_search_writes_no_pipeline_with_zero_above_1(gpt):
    # A memory limit tight enough that sharding pays: ZeRO 2-3 win without a pipeline, never with one.
    result = search(gpt, make_cluster(16, 8, "a100-80gb"), 64, Pins(), keep=400, memory_fraction=0.05)
    layouts = {(e.config.pp, e.config.zero_stage) for e in result.ranked}
    assert any(pp > 1 for pp, _ in layouts) and any(z >= 2 for _, z in layouts)
    assert not [(pp, z) for pp, z in layouts if pp > 1 and z >= 2]


@pytest.mark.parametrize("zero", [2, 3])
def test_a_pinned_pipeline_with_zero_above_1_is_refused_with_the_reason(gpt, zero):
    with pytest.raises(PlannerError, match=rf"--zero {zero} with --pp 2: a pipeline defers FSDP's gradient reduction "
                                           r".*pin --zero 1"):
        solve(gpt, make_cluster(8, 8, "a100-80gb"), 32, Pins(pp=2, zero_stage=zero))
    # Unpinned pp: a pinned ZeRO 3 is searched without a pipeline.
    plan = solve(gpt, make_cluster(8, 8, "a100-80gb"), 32, Pins(zero_stage=3))
    assert plan.layout.pp_degree == 1 and plan.layout.zero_stage == 3


def test_an_engine_pipeline_with_zero_3_is_priced_as_zero_1_and_says_so(gpt):
    cluster = make_cluster(8, 8, "a100-80gb")
    layout = EngineLayout(pp_degree=2, tp_degree=1, zero_stage=3, micro_batch_size=1, global_batch_size=32,
                          schedule="1f1b", recompute="full")
    priced = price(gpt, cluster, layout)
    as_one = price(gpt, cluster, EngineLayout(**{**layout.__dict__, "zero_stage": 1}))
    assert priced.layout.zero_stage == 1
    assert priced.prediction.iteration_time_s == as_one.prediction.iteration_time_s
    assert any(n.startswith("ZeRO 2-3 with pp 2 priced as ZeRO 1: a pipeline defers") for n in priced.search.notes)
