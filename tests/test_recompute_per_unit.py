"""Recomputation chosen per unit (planner/solver/unit_recompute.py): the per-range knapsack
against brute force, the solver checkpointing just enough units, the plan field, the runtime."""

from __future__ import annotations

import itertools
import json
from collections import Counter
from dataclasses import replace
from typing import NamedTuple

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

from planner.cluster import make_cluster
from planner.cost.schedules import PeakState, forwards_first
from planner.engines import export_plan
from planner.engines.torchtitan import every_nth_layer
from planner.errors import PlannerError
from planner.plan import parse_plan
from planner.plan_report import recompute_summary
from planner.profiler import profile_model
from planner.solver.search import StageBuffers, _per_unit_range_costs
from planner.solver.solve import Pins, solve
from planner.solver.unit_recompute import UnitChoices, fastest_fitting
from runtime.recompute import apply_unit_recompute

FULL = 2  # mode indices: none, selective, full


def _time_s(unit_s, start_s, i, modes) -> float:
    """An assignment's time, summed unit by unit from the start as the frontier sums it (the
    start term with the first unit), so that equal assignments give equal floats."""
    total = unit_s[modes[0], i] + start_s[modes[0], i]
    for k, r in enumerate(modes[1:], start=1):
        total += unit_s[r, i + k]
    return total


def _fits(act, transient, i, j, level, limit, modes) -> bool:
    """Whether an assignment's activations fit the room the table gives them: the limit less the
    transient when a unit is full (the same subtraction, so a sum that rounds onto the limit,
    as 0.5 + 2e-257 does, is judged alike)."""
    room = limit - (transient[i:j].max() if FULL in modes else 0.0)
    return level * sum(act[r, i + k] for k, r in enumerate(modes)) <= room


def _brute_force(unit_s, start_s, act, transient, i, j, level, limit) -> float:
    """Least time over all 3^(j - i) assignments of [i, j) that fit `limit` (inf: none)."""
    best = np.inf
    for modes in itertools.product(range(3), repeat=j - i):
        time_s = _time_s(unit_s, start_s, i, modes)
        if _fits(act, transient, i, j, level, limit, modes):
            best = min(best, time_s)
    return best


def _table(unit_s, start_s, act, transient, cap, i, j, level, limit):
    """What the cost table gives [i, j): the fastest fitting frontier point, and its modes."""
    choices = UnitChoices(unit_s, start_s, act, FULL, cap=cap)
    rows = choices.rows(np.array([i]), np.array([j]))
    room = np.array([[limit, limit - transient[i:j].max()]])
    cost, column = fastest_fitting(choices, rows, room, np.array([level]))
    modes = choices.modes(i, j, int(column[0, 0]), choices.width) if column[0, 0] >= 0 else None
    return float(cost[0, 0]), modes


def _draw_units(draw, n: int):
    """A value strategy (small integers half the time, which make ties: equal times, equal
    bytes) and, drawn with it for n units and 3 modes, their times, start terms, activation
    bytes and full-recomputation transients."""
    ties = draw(st.booleans())
    value = st.integers(0, 4).map(float) if ties else st.floats(0.0, 10.0, allow_nan=False)
    grid = lambda: np.array(draw(st.lists(st.lists(value, min_size=n, max_size=n), min_size=3, max_size=3)))  # noqa: E731
    return value, grid(), grid(), grid(), np.array(draw(st.lists(value, min_size=n, max_size=n)))


@st.composite
def instances(draw):
    """Small random instances of one unit range."""
    n = draw(st.integers(1, 6))
    value, unit_s, start_s, act, transient = _draw_units(draw, n)
    i = draw(st.integers(0, n - 1))
    j = draw(st.integers(i + 1, n))
    level = draw(st.integers(1, 4))
    limit = draw(st.floats(0.0, 60.0, allow_nan=False))
    return unit_s, start_s, act, transient, i, j, level, limit


@settings(max_examples=300, deadline=None)
@given(instances())
def test_range_choice_equals_brute_force(instance):
    unit_s, start_s, act, transient, i, j, level, limit = instance
    cost, modes = _table(unit_s, start_s, act, transient, None, i, j, level, limit)
    best = _brute_force(unit_s, start_s, act, transient, i, j, level, limit)
    # Both sum unit by unit in the same order (`_time_s`): equal floats, so exact equality.
    assert cost == best
    if modes is not None:  # the modes read back are an assignment achieving the cost and fitting
        assert _time_s(unit_s, start_s, i, modes) == cost
        assert _fits(act, transient, i, j, level, limit, modes)


@settings(max_examples=200, deadline=None)
@given(instances())
def test_thinned_frontier_is_conservative(instance):
    # With a frontier cap of 3 points, the table may miss the optimum but never beats it, and
    # it finds an assignment whenever one fits (the least-memory points are always kept).
    unit_s, start_s, act, transient, i, j, level, limit = instance
    cost, _ = _table(unit_s, start_s, act, transient, 3, i, j, level, limit)
    best = _brute_force(unit_s, start_s, act, transient, i, j, level, limit)
    assert cost >= best and np.isfinite(cost) == np.isfinite(best)


def test_identical_units_share_frontiers():
    # Six identical units: the ranges starting at units 1..5 reuse unit 0's frontiers.
    unit_s, act = np.array([[1.0] * 6, [1.5] * 6, [2.0] * 6]), np.array([[4.0] * 6, [2.0] * 6, [1.0] * 6])
    choices = UnitChoices(unit_s, np.zeros_like(unit_s), act, FULL)
    choices.rows(*np.triu_indices(7, k=1))
    assert all(choices.frontiers[i][k] is choices.frontiers[0][k] for i in range(1, 6) for k in range(6 - i))


GPT = dict(n_layers=8, d_model=2048, n_heads=16, d_ff=8192, vocab_size=32000, seq_len=1024)


@pytest.fixture(scope="module")
def tight_plans():
    """A plan on GPUs with 30% less memory than the recomputation-free plan needs, free and
    with full recomputation pinned (one data-parallel stage, ZeRO off: only recomputation helps)."""
    profile = profile_model("examples/gpt.py", GPT, [1, 2, 4], device="meta", gpu="a100-80gb", dtype="bfloat16")
    cluster = make_cluster(8, 8, "a100-80gb")
    pins = Pins(pp=1, tp=1, dp=8, micro_batch_size=32, zero_stage=0, cp=1)
    roomy = solve(profile, cluster, 256, pins)
    needed = max(roomy.prediction.peak_memory_bytes)
    small = replace(cluster, gpu=replace(cluster.gpu, memory_bytes=int(needed * 0.7 / 0.9)))
    return roomy, solve(profile, small, 256, pins), solve(profile, small, 256, replace(pins, recompute="full"))


def test_solver_recomputes_just_enough_units(tight_plans):
    roomy, tight, all_full = tight_plans
    assert all(r == "none" for s in roomy.stages for r in s.unit_modes().values())
    modes = list(tight.stages[0].unit_modes().values())
    assert 0 < modes.count("full") < len(modes)  # some units recompute, not all
    assert tight.prediction.iteration_time_s < all_full.prediction.iteration_time_s
    assert max(tight.prediction.peak_memory_bytes) <= max(roomy.prediction.peak_memory_bytes) * 0.7 * (1 + 1e-9)


def test_mixed_plan_round_trips_and_prints(tight_plans):
    _, tight, _ = tight_plans
    again = parse_plan(json.loads(tight.model_dump_json()))
    assert again.stages[0].unit_modes() == tight.stages[0].unit_modes()
    assert again.stages[0].unit_recompute  # the mixed stage lists its exceptions
    counts = Counter(tight.stages[0].unit_modes().values())
    summary = recompute_summary(tight.stages[0])
    assert len(counts) > 1 and summary.startswith(counts.most_common(1)[0][0])  # the stage's mode first
    assert all(f"{mode} on {k} of 11 units" in summary for mode, k in counts.most_common()[1:])  # then the exceptions


def test_unknown_unit_in_unit_recompute_is_refused(tight_plans):
    data = json.loads(tight_plans[1].model_dump_json())
    data["stages"][0]["unit_recompute"] = {"blocks.99": "full"}
    with pytest.raises(PlannerError, match="blocks.99"):
        parse_plan(data)


def test_runtime_applies_each_unit_its_mode():
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn, self.mlp = nn.Linear(4, 4), nn.Linear(4, 4)

    model = nn.Module()
    model.blocks = nn.ModuleList([Block() for _ in range(3)])
    apply_unit_recompute(model, {"blocks.0": "full", "blocks.1": "selective", "blocks.2": "none"})
    assert isinstance(model.blocks[0], CheckpointWrapper)
    assert not isinstance(model.blocks[1], CheckpointWrapper) and isinstance(model.blocks[1].attn, CheckpointWrapper)
    assert not any(isinstance(m, CheckpointWrapper) for m in model.blocks[2].modules())


ENGINE_GPT = dict(n_layers=6, d_model=256, n_heads=8, d_ff=1024, vocab_size=1024, seq_len=128)


@pytest.fixture(scope="module")
def engine_plan():
    """A 2-stage plan of embed, blocks.0-5, norm, head (the DP cuts it 1F1B, no recomputation pinned),
    its sends in series as Megatron-LM's non-interleaved 1F1B runs them."""
    from planner.engines import megatron

    profile = profile_model("examples/gpt.py", ENGINE_GPT, [1], device="meta", gpu="a100-80gb", dtype="bfloat16")
    return solve(profile, make_cluster(2, 2, "a100-80gb"), 8,
                 Pins(pp=2, tp=1, dp=1, micro_batch_size=1, schedule="1f1b", recompute="none", zero_stage=0, cp=1,
                      overlap=megatron.overlap(interleaved=False)))


def _with_full(plan, units: set[str]):
    """`plan` with these units fully recomputed (the stages' `unit_recompute`)."""
    stages = [s.model_copy(update={"unit_recompute": {u: "full" for u in s.units if u in units}}) for s in plan.stages]
    return plan.model_copy(update={"stages": stages})


def test_megatron_exports_the_first_k_layers_of_each_stage(engine_plan):
    stage_blocks = [[u for u in s.units if u.startswith("blocks.")] for s in engine_plan.stages]
    assert all(len(b) >= 2 for b in stage_blocks)
    plan = _with_full(engine_plan, {b[0] for b in stage_blocks})  # the first layer of each stage
    exported = export_plan(plan, "megatron")
    assert "--recompute-method block" in exported.text and "--recompute-num-layers 1" in exported.text
    assert exported.warnings == []
    # Any other pattern: the nearest one mode, with a warning.
    other = export_plan(_with_full(engine_plan, {stage_blocks[0][1]}), "megatron")
    assert "--recompute-method uniform" in other.text and "per-unit recompute" in other.warnings[0]


def test_torchtitan_exports_every_nth_layer(engine_plan):
    # Each pipeline rank's 2nd, 4th, ... layer fully: torchtitan's counter runs per process.
    plan = _with_full(engine_plan, {b for s in engine_plan.stages
                                    for n, b in enumerate(u for u in s.units if u.startswith("blocks.")) if n % 2 == 1})
    exported = export_plan(plan, "torchtitan")
    assert 'selective_ac_option = "2"' in exported.text and exported.warnings == []
    other = export_plan(_with_full(engine_plan, {"blocks.0"}), "torchtitan")
    assert 'mode = "full"' in other.text and "per-unit recompute" in other.warnings[0]


def _priced(engine_plan, text: str, engine: str):
    from planner.engines import ENGINES
    from planner.engines.pricing import price

    profile = profile_model("examples/gpt.py", ENGINE_GPT, [1], device="meta", gpu="a100-80gb", dtype="bfloat16")
    return price(profile, make_cluster(2, 2, "a100-80gb"), ENGINES[engine].parse(text), global_batch_size=8)


def test_a_torchtitan_job_recomputing_every_second_layer_is_priced_as_it_runs(engine_plan):
    # selective_ac_option = "2": each process fully recomputes its 2nd, 4th, ... layer (its own
    # counter over the layers it holds), nothing else; priced so, between no and full recomputation.
    head = '[parallelism]\npipeline_parallel_degree = 2\ndata_parallel_shard_degree = 1\n' \
           '[training]\nlocal_batch_size = 8\nglobal_batch_size = 8\n'
    times = {}
    for label, ac in (("none", 'mode = "none"'), ("full", 'mode = "full"'),
                      ("every 2", 'mode = "selective"\nselective_ac_option = "2"')):
        plan = _priced(engine_plan, head + "[activation_checkpoint]\n" + ac + "\n", "torchtitan")
        times[label] = plan.prediction.iteration_time_s
        if label == "every 2":
            for stage in plan.stages:
                blocks = [u for u in stage.units if u.startswith("blocks.")]
                modes = stage.unit_modes()
                assert [modes[b] for b in blocks] == ["full" if n % 2 == 1 else "none" for n in range(len(blocks))]
                assert all(mode == "none" for u, mode in modes.items() if u not in blocks)
            assert every_nth_layer(plan, [u for s in plan.stages for u in s.units]) == 2  # and exported so again
    assert times["none"] < times["every 2"] < times["full"]


def test_megatron_block_recomputation_is_priced_on_the_first_layers_of_each_stage(engine_plan):
    args = ("--num-layers 6 --hidden-size 256 --num-attention-heads 8 --seq-length 128 --micro-batch-size 1 "
            "--global-batch-size 8 --pipeline-model-parallel-size 2 --bf16 --recompute-granularity full "
            "--recompute-method block --recompute-num-layers 1")
    plan = _priced(engine_plan, args, "megatron")
    for stage in plan.stages:
        blocks = [u for u in stage.units if u.startswith("blocks.")]
        assert [stage.unit_modes()[b] for b in blocks] == ["full"] + ["none"] * (len(blocks) - 1)
    everything = _priced(engine_plan, args.replace("--recompute-method block --recompute-num-layers 1",
                                                   "--recompute-method uniform --recompute-num-layers 1"), "megatron")
    assert plan.prediction.iteration_time_s < everything.prediction.iteration_time_s


@st.composite
def rank_instances(draw):
    """One pipeline rank's chunks: a small random model (`instances`' values), cut into 1-3
    contiguous chunks the rank holds, each with fixed bytes, the gradients among them (given back
    where the level holds every micro-batch, m <= level) and the bytes of its optimizer step's
    phase (a floor no recomputation lowers; 0 a third of the time), and a memory limit."""
    n = draw(st.integers(2, 6))
    value, unit_s, start_s, act, transient = _draw_units(draw, n)
    edges = sorted(draw(st.lists(st.integers(1, n - 1), max_size=3, unique=True)))
    cuts = list(zip([0, *edges], [*edges, n], strict=True))
    chunks = draw(st.lists(st.sampled_from(cuts), min_size=1, max_size=3, unique=True))
    fixed = {c: draw(value) for c in cuts}
    floor = {c: draw(st.one_of(st.just(0.0), value.map(lambda x: 3 * x))) for c in cuts}
    grads = {c: min(draw(value), fixed[c]) for c in cuts}
    m = draw(st.integers(1, 5))
    level = draw(st.integers(1, 4))
    limit = draw(st.floats(0.0, 120.0, allow_nan=False))
    return unit_s, start_s, act, transient, sorted(chunks), Held(fixed, floor, grads, m), level, limit


class Held(NamedTuple):
    """A rank instance's bytes per chunk: fixed, the optimizer step's floor, the gradients among
    fixed, and the step's micro-batch count m."""

    fixed: dict
    floor: dict
    grads: dict
    m: int


def _chunk_bytes(held: Held, act, transient, level, chunk, modes) -> float:
    """One chunk's peak: its forward/backward bytes (fixed, less its gradients where the level holds
    every micro-batch, the range's largest transient if a unit is full, level x activations) or its
    optimizer step's, whichever is larger."""
    i, j = chunk
    forward_backward = held.fixed[chunk] + (transient[i:j].max() if FULL in modes else 0.0) \
        - (held.grads[chunk] if level >= held.m else 0.0) + level * sum(act[r, i + k] for k, r in enumerate(modes))
    return max(forward_backward, held.floor[chunk])


def _chunk_brute_force(unit_s, start_s, act, transient, chunk, held: Held, level, limit) -> float:
    """Least time of one chunk's assignments that fit `limit`, judged as the stage DP's table
    judges them (`_fits`' subtraction: the activations against the room the rest leaves)."""
    i, j = chunk
    best = np.inf
    for modes in itertools.product(range(3), repeat=j - i):
        rest = held.fixed[chunk] + (transient[i:j].max() if FULL in modes else 0.0) \
            - (held.grads[chunk] if level >= held.m else 0.0)
        if level * sum(act[r, i + k] for k, r in enumerate(modes)) <= limit - rest and held.floor[chunk] <= limit:
            best = min(best, _time_s(unit_s, start_s, i, modes))
    return best


def _rank_brute_force(unit_s, start_s, act, transient, chunks, held: Held, level, limit) -> float:
    """Least summed time over every assignment of modes to the units of `chunks` whose bytes
    (`_chunk_bytes`) fit `limit` together."""
    best = np.inf
    options = [list(itertools.product(range(3), repeat=j - i)) for i, j in chunks]
    for assignment in itertools.product(*options):
        total = sum(_chunk_bytes(held, act, transient, level, chunk, modes)
                    for chunk, modes in zip(chunks, assignment, strict=True))
        if total <= limit:
            best = min(best, sum(_time_s(unit_s, start_s, i, modes) for (i, _), modes in zip(chunks, assignment, strict=True)))
    return best


@settings(max_examples=200, deadline=None)
@given(rank_instances())
def test_rank_refit_equals_brute_force(instance):
    # A rank's chunks whose modes are chosen together under the rank's memory (the search's
    # repair where the chunks fit one by one but not together): the least summed time of any
    # assignment that fits, and the modes it returns achieve it.
    unit_s, start_s, act, transient, chunks, held, level, limit = instance
    n = unit_s.shape[1]
    start, end = np.triu_indices(n + 1, k=1)
    of = lambda d: np.array([d.get((int(i), int(j)), 0.0) for i, j in zip(start, end, strict=True)])  # noqa: E731
    transient_of = np.array([transient[i:j].max() for i, j in zip(start, end, strict=True)])
    zeros = np.zeros(len(start))
    buffers = StageBuffers(receive=zeros, gathered=zeros, step_transient=zeros, bucket=zeros, batch=zeros,
                           accumulation=zeros, weight_gradient_inputs=zeros, boundary_back=zeros, batch_saved=zeros,
                           gradients=of(held.grads), loss=zeros, gathered_with_loss=zeros)
    # 1F1B: the gradients given back where m <= level (planner/cost/schedules.py `peak_states`)
    group = (PeakState(float(level), 0.0, not bool(forwards_first("1f1b", 2, held.m, level))),)
    choices = UnitChoices(unit_s, start_s, act, FULL, cap=None)
    costs, _, width, refit = _per_unit_range_costs(choices, start, end, of(held.fixed), of(held.floor), transient_of,
                                                   np.zeros(len(start)), [(group, group)], buffers, held.m)
    # Each chunk alone, as the stage DP's table prices it, and with the bytes at its choice.
    cost, _, nbytes = costs(limit)
    for chunk in chunks:
        at = int(np.flatnonzero((start == chunk[0]) & (end == chunk[1]))[0])
        alone = _chunk_brute_force(unit_s, start_s, act, transient, chunk, held, level, limit)
        assert cost[0, at] == pytest.approx(alone, rel=1e-12, abs=1e-12) if np.isfinite(alone) else cost[0, at] == np.inf
        assert nbytes[0, at] <= limit * (1 + 1e-12) + 1e-12 if np.isfinite(alone) else nbytes[0, at] == np.inf
    columns = refit(chunks, [(group, group)] * len(chunks), limit)
    best = _rank_brute_force(unit_s, start_s, act, transient, chunks, held, level, limit)
    assert (columns is None) == (not np.isfinite(best))
    if columns is not None:
        modes = [choices.modes(i, j, c, choices.width) for (i, j), c in zip(chunks, columns, strict=True)]
        total = sum(_time_s(unit_s, start_s, i, m) for (i, _), m in zip(chunks, modes, strict=True))
        nbytes = sum(_chunk_bytes(held, act, transient, level, chunk, m) for chunk, m in zip(chunks, modes, strict=True))
        assert total == pytest.approx(best, rel=1e-12, abs=1e-12)
        assert nbytes <= limit * (1 + 1e-12) + 1e-12


@pytest.mark.parametrize("layers, width, schedule, tighter, slack",
                         [(16, 2048, "interleaved-1f1b", 0.995, 1e-9), (24, 1024, "zero-bubble", 0.98, 0.03)])
def test_rank_whose_chunks_overflow_together_is_refitted(monkeypatch, layers, width, schedule, tighter, slack):
    # 4 ranks x 4 chunks on GPUs with a little less memory (`tighter`) than the plan priced on
    # roomy ones holds on its busiest rank. The DP's chunks each fit, but not all together on one
    # rank: choosing that rank's modes together (`_refit_ranks`, on the DP's cuts and on them
    # leveled for time) keeps the roomy plan's speed, or near it, where holding every chunk to 1/4
    # of the memory recomputes more. (At 0.99 the zero-bubble DP's cuts fit the first limit
    # outright, 6% slower than the roomy plan, and no repair runs: the DP's objective does not
    # see a rank's chunks together.)
    from planner.solver import search
    from planner.solver.solve import price_config

    gpt = dict(n_layers=layers, d_model=width, n_heads=16, d_ff=4 * width, vocab_size=8192, seq_len=1024)
    profile = profile_model("examples/gpt.py", gpt, [1], device="meta", gpu="a100-80gb", dtype="bfloat16")
    cluster = make_cluster(4, 4, "a100-80gb")
    cfg = search.Config(tp=1, sequence_parallel=False, pp=4, dp=1, micro_batch_size=1, num_microbatches=16,
                        schedule=schedule, virtual_stages=4, zero_stage=0)
    roomy = price_config(profile, cluster, cfg)
    busiest = max(sum(roomy.peak_memory_bytes[rank::4]) for rank in range(4))
    small = replace(cluster, gpu=replace(cluster.gpu, memory_bytes=int(busiest * tighter / 0.9)))
    refit, changed = search._refit_ranks, []

    def spy(*args, **kwargs):
        modes = refit(*args, **kwargs)
        changed.append(modes is not None and modes != args[1])
        return modes
    monkeypatch.setattr(search, "_refit_ranks", spy)
    refitted = price_config(profile, small, cfg)
    assert any(changed)  # the case this test is about: the DP's chunks overflowed a rank together
    monkeypatch.setattr(search, "_refit_ranks", lambda *args, **kwargs: None)
    fallback = price_config(profile, small, cfg)
    usable = small.gpu.memory_bytes * 0.9
    assert max(sum(refitted.peak_memory_bytes[rank::4]) for rank in range(4)) <= usable
    assert refitted.iteration_time_s <= roomy.iteration_time_s * (1 + slack)
    assert refitted.iteration_time_s < fallback.iteration_time_s * 0.98


def test_plan_repaired_at_the_first_limit_is_kept_where_the_strict_one_has_none():
    # 4 ranks x 4 chunks with 20% less memory than the roomy plan's busiest rank: holding every
    # chunk to 1/4 of the memory leaves no cuts at all (the head does not fit a quarter), but the
    # first limit's cuts, their ranks' modes chosen together, fit: that plan is the answer.
    from planner.solver import search
    from planner.solver.solve import price_config

    gpt = dict(n_layers=16, d_model=2048, n_heads=16, d_ff=8192, vocab_size=32000, seq_len=1024)
    profile = profile_model("examples/gpt.py", gpt, [1], device="meta", gpu="a100-80gb", dtype="bfloat16")
    cluster = make_cluster(4, 4, "a100-80gb")
    cfg = search.Config(tp=1, sequence_parallel=False, pp=4, dp=1, micro_batch_size=1, num_microbatches=16,
                        schedule="interleaved-1f1b", virtual_stages=4, zero_stage=0)
    roomy = price_config(profile, cluster, cfg)
    busiest = max(sum(roomy.peak_memory_bytes[rank::4]) for rank in range(4))
    small = replace(cluster, gpu=replace(cluster.gpu, memory_bytes=int(busiest * 0.8 / 0.9)))
    plan = price_config(profile, small, cfg)
    assert plan.feasible, plan.reason
    assert max(sum(plan.peak_memory_bytes[rank::4]) for rank in range(4)) <= small.gpu.memory_bytes * 0.9
    assert any(mode != "none" for modes in plan.unit_recompute for mode in modes)
