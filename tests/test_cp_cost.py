"""Context parallelism's cost terms (planner/cost/cp.py) against their closed forms."""

from __future__ import annotations

import pytest

from planner.cost.cp import (
    all_gather_cp_s,
    attention_shapes,
    cp_degrees,
    cp_refusal,
    gathered_kv_bytes,
    kv_bytes,
    ring_cp_s,
)
from planner.profiler import profile_model
from tests.conftest import EXAMPLES


@pytest.fixture(scope="module")
def llama():
    # Grouped-query attention: 8 query heads, 2 key/value heads of dim 16.
    args = dict(n_layers=2, d_model=128, n_heads=8, n_kv_heads=2, vocab_size=256, seq_len=64)
    return profile_model(str(EXAMPLES / "llama.py"), args, [1, 2], device="meta", gpu="h100-80gb", dtype="bfloat16")


def test_kv_bytes_read_the_key_value_width(llama):
    block = next(u for u in llama.units if u.name == "layers.0")
    (shape,) = attention_shapes(block, 2)
    assert shape.kv_features == 2 * 16 and shape.tokens == 2 * 64
    assert kv_bytes(block, 2, 2) == 2 * (2 * 64) * 32 * 2  # K and V, b x T x d_kv, bf16
    assert kv_bytes(next(u for u in llama.units if u.name == "embed"), 2, 2) == 0


def test_all_gather_cp_is_one_gather_and_one_reduce_scatter():
    gather = lambda n: 1e-6 + n / 1e11  # noqa: E731
    scatter = lambda n: 2e-6 + n / 1e11  # noqa: E731
    assert all_gather_cp_s(1e8, 4, gather, scatter) == (gather(1e8), scatter(1e8))
    assert all_gather_cp_s(1e8, 1, gather, scatter) == (0.0, 0.0)


def test_ring_hides_blocks_behind_attention():
    p2p = lambda n: n / 1e10  # noqa: E731
    kv, cp = 4e8, 4  # a block is 1e8 bytes: 10 ms to send
    # Attention of 80 ms (20 ms a block) hides every send; of 20 ms (5 ms a block) leaves 5 ms a step.
    assert ring_cp_s(kv, cp, p2p, 0.08, 0.16) == (0.0, 0.0)
    forward, backward = ring_cp_s(kv, cp, p2p, 0.02, 0.04)
    assert forward == pytest.approx(3 * (0.01 - 0.005))
    assert backward == pytest.approx(3 * (0.02 - 0.01))  # K/V and their gradients: twice the bytes


def test_gathered_kv_and_refusals():
    assert gathered_kv_bytes(8.0, 4, "all-gather") == 6.0 and gathered_kv_bytes(8.0, 4, "ring") == 4.0
    assert cp_refusal(4096, 8) is None
    assert "does not split into 2 x 3 = 6 equal chunks" in cp_refusal(4096, 3)
    assert "no sequence length" in cp_refusal(None, 2)
    assert cp_degrees(131072, 8) == [1, 2, 4, 8] and cp_degrees(6, 8) == [1]


# ---- the search (planner/solver: cp is a searched and pinnable dimension) ----

@pytest.fixture(scope="module")
def long_llama():
    # 64k tokens a sample: one sequence's activations do not fit an 80 GB GPU without CP.
    args = dict(n_layers=4, d_model=2048, n_heads=16, n_kv_heads=4, vocab_size=32000, seq_len=65536)
    return profile_model(str(EXAMPLES / "llama.py"), args, [1], device="meta", gpu="h100-80gb", dtype="bfloat16")


def test_solver_finds_cp_for_long_sequences(long_llama):
    from planner.cluster import make_cluster
    from planner.solver.solve import Pins, solve

    cluster = make_cluster(8, 8, "h100-80gb")
    plan = solve(long_llama, cluster, 4, Pins(recompute="none"))
    assert plan.layout.cp_degree > 1 and plan.layout.pp_degree == 1
    # A CP group shares its samples: global batch = micro-batch x micro-batches x dp / cp.
    lay, batch = plan.layout, plan.batch
    assert batch.micro_batch_size * batch.num_microbatches * lay.dp_degree // lay.cp_degree == 4
    # 64k tokens: attention (T^2) hides each ring step's K/V block (T), so the ring wins and exposes
    # nothing; the all-gather would expose its gather and reduce-scatter.
    assert lay.cp_algorithm == "ring" and plan.prediction.breakdown_s["cp_comm"] == 0


def test_cp_pins_are_checked(long_llama):
    from planner.cluster import make_cluster
    from planner.errors import PlannerError
    from planner.solver.solve import Pins, solve

    cluster = make_cluster(8, 8, "h100-80gb")
    plan = solve(long_llama, cluster, 8, Pins(cp=4, tp=1))
    assert plan.layout.cp_degree == 4 and plan.layout.dp_degree == 8
    odd = profile_model(str(EXAMPLES / "llama.py"), dict(n_layers=2, d_model=64, n_heads=4, seq_len=36), [1],
                        device="meta", gpu="h100-80gb", dtype="bfloat16")
    with pytest.raises(PlannerError, match=r"--cp 4: the sequence of 36 tokens does not split into 2 x 4 = 8"):
        solve(odd, cluster, 8, Pins(cp=4))
    with pytest.raises(PlannerError, match="--cp with --pp runs under the schedules"):
        solve(long_llama, cluster, 8, Pins(cp=2, pp=2, schedule="pipedream-2bw"), allow_async=True)
    both = solve(long_llama, cluster, 8, Pins(cp=2, pp=2))  # CP with a pipeline, any synchronous schedule
    assert both.layout.cp_degree == 2 and both.layout.pp_degree == 2
    interleaved = solve(long_llama, cluster, 8, Pins(cp=2, pp=2, schedule="interleaved-1f1b", virtual_stages=2))
    assert (interleaved.layout.cp_degree, interleaved.layout.virtual_stages) == (2, 2)
    chunks = solve(long_llama, cluster, 8, Pins(cp=2, pp=2, schedule="interleaved-1f1b"))  # the schedule pinned, v searched
    assert chunks.layout.cp_degree == 2 and chunks.layout.virtual_stages > 1
    # A CP group's ranks share their samples: pinned dp 8 with cp 2 takes 4 (torchtitan's FSDP 4 x CP 2, local batch 1).
    shared = solve(long_llama, cluster, 4, Pins(cp=2, dp=8, tp=1, pp=1))
    assert (shared.layout.dp_degree, shared.layout.cp_degree, shared.batch.micro_batch_size) == (8, 2, 1)
    with pytest.raises(PlannerError, match=r"--global-batch 3 is not divisible by --dp 8 / --cp 2"):
        solve(long_llama, cluster, 3, Pins(cp=2, dp=8))


def test_attention_without_sdpa_gets_no_cp(long_llama):
    """CP gathers keys for F.scaled_dot_product_attention alone: a model computing its scores
    itself (examples/gpt.py's "math", Gemma 2's softcapped eager attention) is refused CP when
    pinned and offered none when free, where the same model on SDPA is offered it."""
    from planner.cluster import make_cluster
    from planner.errors import PlannerError
    from planner.solver.solve import Pins, _cp_sequence_length, solve

    assert long_llama.model.attention_calls == 4  # one per layer
    args = dict(n_layers=2, d_model=64, n_heads=4, vocab_size=256, seq_len=64)
    sdpa, math = (profile_model(str(EXAMPLES / "gpt.py"), dict(args, attention=a), [1], device="meta", gpu="h100-80gb",
                                dtype="bfloat16") for a in ("sdpa", "math"))
    assert (sdpa.model.attention_calls, math.model.attention_calls) == (2, 0)
    assert (_cp_sequence_length(sdpa), _cp_sequence_length(math)) == (64, None)
    with pytest.raises(PlannerError, match="--cp 2: the model's forward calls no F.scaled_dot_product_attention"):
        solve(math, make_cluster(4, 4, "h100-80gb"), 8, Pins(cp=2))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_solver_cp_plan_runs_with_parity(tmp_path):
    from planner.cluster import make_cluster
    from planner.solver.solve import Pins, solve
    from tests.runtime_plans import LLAMA_ARGS
    from tests.test_runtime_parity import check_parity

    profile = profile_model(str(EXAMPLES / "llama.py"), LLAMA_ARGS, [1, 2], device="cpu", repeats=2)
    plan = solve(profile, make_cluster(2, gpu="cpu"), 2, Pins(cp=2, dp=2, pp=1, tp=1))
    assert plan.layout.cp_degree == 2
    check_parity(plan, tmp_path)


# ---- ring or all-gather (issue #15): both priced for each cp, the cheaper kept and recorded ----


def test_each_algorithm_is_priced_by_its_own_closed_form(llama):
    from planner.cost.cp import CpCollectives, attention_share, cp_unit_s, saved_kv_bytes

    collectives = CpCollectives(lambda n: 1e-5 + n / 1e11, lambda n: 2e-5 + n / 1e11, lambda n: 1e-6 + n / 5e10)
    kv, cp = 4e8, 4
    assert cp_unit_s("all-gather", kv, cp, collectives, 0.02, 0.04) == all_gather_cp_s(
        kv, cp, collectives.all_gather_s, collectives.reduce_scatter_s)
    assert cp_unit_s("ring", kv, cp, collectives, 0.02, 0.04) == ring_cp_s(kv, cp, collectives.p2p_s, 0.02, 0.04)
    # All-gather keeps the other ranks' K/V for its backward; the ring passes them around again.
    assert saved_kv_bytes(8.0, 4, "all-gather") == 6.0 and saved_kv_bytes(8.0, 4, "ring") == 0.0
    # The ring hides its sends behind attention: the block's attention FLOPs over the unit's.
    block = next(u for u in llama.units if u.name == "layers.0")
    attention = sum(op.forward_flops for op in block.ops if op.kind == "attention")
    assert attention_share(block) == pytest.approx(attention / block.costs[1].forward_flops)
    assert 0 < attention_share(block) < 1 and attention_share(next(u for u in llama.units if u.name == "embed")) == 0


@pytest.mark.parametrize("seq_len,kv_heads,expected", [
    # 64k tokens: attention (T^2) hides every ring step's K/V block (T), even across nodes.
    (65536, 4, "ring"),
    # 2k tokens and full-width K/V over a CP group spanning 2 nodes: the ring's 7 cross-node steps
    # are exposed, its backward sends twice the bytes of the reduce-scatter: all-gather is cheaper.
    (2048, 16, "all-gather"),
])
def test_solver_keeps_the_cheaper_cp_algorithm(seq_len, kv_heads, expected):
    from planner.cluster import make_cluster
    from planner.cost.cp import CP_METHODS
    from planner.solver.search import Config
    from planner.solver.solve import Pins, price_config, solve

    args = dict(n_layers=2, d_model=2048, n_heads=16, n_kv_heads=kv_heads, vocab_size=32000, seq_len=seq_len)
    profile = profile_model(str(EXAMPLES / "llama.py"), args, [1], device="meta", gpu="h100-80gb", dtype="bfloat16")
    cluster, pins = make_cluster(8, 4, "h100-80gb"), Pins(cp=8, tp=1, pp=1, recompute="none")
    plan = solve(profile, cluster, 2, pins)
    lay, batch = plan.layout, plan.batch
    assert lay.cp_degree == 8 and lay.cp_algorithm == expected
    # Brute force: the chosen configuration priced under each algorithm.
    seconds = {alg: price_config(profile, cluster, Config(
        lay.tp_degree, lay.sequence_parallel, lay.pp_degree, lay.dp_degree, batch.micro_batch_size,
        batch.num_microbatches, lay.schedule, lay.virtual_stages, lay.zero_stage, shard_degree=lay.shard_degree,
        cp=lay.cp_degree, cp_algorithm=alg), pins).iteration_time_s for alg in CP_METHODS}
    assert seconds[expected] == min(seconds.values()) and len(set(seconds.values())) == 2
    assert plan.prediction.iteration_time_s == pytest.approx(seconds[expected])


def test_planner_show_prints_the_cp_algorithm(long_llama):
    import io

    from rich.console import Console

    from planner.cluster import make_cluster
    from planner.plan_report import print_plan
    from planner.solver.solve import Pins, solve

    plan = solve(long_llama, make_cluster(8, 8, "h100-80gb"), 8, Pins(cp=4, tp=1))
    out = io.StringIO()
    print_plan(plan, Console(file=out, width=250))
    assert f"{plan.layout.cp_degree} {plan.layout.cp_algorithm}" in out.getvalue()


def test_cp_algorithm_pin(long_llama):
    """--cp-algorithm pins what the search would otherwise choose; bad pins are refused with the reason."""
    from planner.cluster import make_cluster
    from planner.errors import PlannerError
    from planner.solver.solve import Pins, solve

    cluster = make_cluster(8, 8, "h100-80gb")
    free = solve(long_llama, cluster, 8, Pins(cp=4, tp=1)).layout.cp_algorithm
    other = "ring" if free == "all-gather" else "all-gather"
    assert solve(long_llama, cluster, 8, Pins(cp=4, tp=1, cp_algorithm=other)).layout.cp_algorithm == other
    with pytest.raises(PlannerError, match="is not one of"):
        solve(long_llama, cluster, 8, Pins(cp=4, cp_algorithm="tree"))
    with pytest.raises(PlannerError, match="--cp 1"):
        solve(long_llama, cluster, 8, Pins(cp=1, cp_algorithm="ring"))
