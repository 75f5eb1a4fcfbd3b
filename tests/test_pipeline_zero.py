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


def test_a_pipeline_s_fsdp_reduction_waits_for_the_chunk_s_last_backward(gpt):
    # torch's schedules reduce-scatter a chunk's gradients after its last backward: on the first
    # pipeline rank (no drain after it) nothing of its one chunk's backward hides them, where
    # bucketed hooks (Megatron-LM's --overlap-grad-reduce) hide all but the last bucket.
    from dataclasses import replace

    from planner.cost.overlap import SERIAL
    from planner.solver.comm_pricing import dp_tail_s
    from planner.solver.solve import _environment

    cluster = make_cluster(8, 8, "a100-80gb")
    result = search(gpt, cluster, 32, Pins(pp=2, dp=4, zero_stage=1, micro_batch_size=1, schedule="1f1b"), keep=1)
    best = result.ranked[0]
    cfg = best.config
    assert (cfg.pp, cfg.zero_stage, cfg.virtual_stages) == (2, 1, 1)
    table = result.costs.table(cfg.tp, cfg.sequence_parallel, cfg.micro_batch_size)
    fsdp = _environment(cluster, result.costs.compute, "bfloat16", Pins(), 0.9)
    recompute = table.recompute_s["none"]
    deferred, _ = dp_tail_s(table, cfg, fsdp, best.bounds, recompute)
    in_series, _ = dp_tail_s(table, cfg, replace(fsdp, overlap=SERIAL), best.bounds, recompute)
    bucketed, _ = dp_tail_s(table, cfg, replace(fsdp, dp_collectives="bucketed"), best.bounds, recompute)
    assert deferred[0] > 0 and deferred[0] == pytest.approx(in_series[0])  # rank 0: nothing hides them
    assert deferred[1] < in_series[1]  # rank 1: rank 0's last backward (the drain) runs after its own
    assert bucketed[0] < deferred[0]


def test_zero_bubble_weight_gradients_reach_no_gradient_hook():
    # Why a zero-bubble step's ZeRO 0 reduction is priced with no window (planner/solver/
    # comm_pricing.py `dp_tail_s`): torch's weight pass adds the gradients by hand, so the
    # post-accumulate-grad hooks the runtime's buckets launch from never fire.
    import torch
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

    layer = torch.nn.Linear(4, 4)
    fired = []
    for p in layer.parameters():
        p.register_post_accumulate_grad_hook(lambda p: fired.append(p))
    x = torch.randn(2, 4, requires_grad=True)
    loss = layer(x).square().sum()
    _, groups = stage_backward_input([loss], None, [x], layer.parameters())
    stage_backward_weight(layer.parameters(), groups)
    assert layer.weight.grad is not None and x.grad is not None and not fired
    layer.zero_grad()
    layer(x).square().sum().backward()  # a whole backward: every parameter's hook fires
    assert len(fired) == 2
