"""The search's branch and bound: its bounds are bounds, and the free search is never beaten
by a configuration the user pins (it searches a superset and prunes only what cannot win)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from planner.cluster import make_cluster
from planner.cost.collectives import CollectiveModel, group_placement
from planner.cost.compute import ComputeModel
from planner.errors import PlannerError
from planner.plan import SearchReport, parse_plan
from planner.profiler import profile_model
from planner.solver.bounds import TimeBound, memory_lower_bound
from planner.solver.costs import UnitCosts
from planner.solver.pricing import Helpers
from planner.solver.search import evaluate_config
from planner.solver.solve import MEMORY_FRACTION, Pins, _environment, candidate_configs, solve

# Small GPTs: blocks of a 1.3B-class model, few layers, so a solve takes milliseconds.
SHAPES = [dict(n_layers=3, d_model=2048, n_heads=16, d_ff=8192, vocab_size=32000, seq_len=1024),
          dict(n_layers=6, d_model=1024, n_heads=8, d_ff=4096, vocab_size=32000, seq_len=2048)]
# `tp` too: the free search prices a TP degree as a pinned one does (every unit shards a weight
# where it can), so pinning the free plan's own degree can never beat it.
PIN_FIELDS = ("pp", "tp", "dp", "micro_batch_size", "schedule", "virtual_stages", "recompute", "zero_stage", "sequence_parallel")


@pytest.fixture(scope="module")
def profiles():
    return [profile_model("examples/gpt.py", shape, [1, 2, 4], device="meta", gpu="a100-80gb", dtype="bfloat16")
            for shape in SHAPES]


instances = st.fixed_dictionaries({
    "shape": st.integers(0, len(SHAPES) - 1),
    "gpus": st.sampled_from([(4, 4), (8, 8), (16, 8), (16, 4)]),
    "batch": st.sampled_from([8, 16, 32, 64]),
    # Low fractions make memory bind, where recomputation, ZeRO and the cuts interact.
    "memory_fraction": st.sampled_from([0.04, 0.08, 0.15, 0.3, MEMORY_FRACTION]),
    "pick": st.integers(0, 10**6),
    "pinned": st.sets(st.sampled_from(PIN_FIELDS), min_size=1),
})


@settings(max_examples=20, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=instances)
def test_free_search_is_never_beaten_by_a_pinned_configuration(profiles, case):
    """Pin some dimensions of one searchable configuration: the free search's plan is at least as fast.
    Exact up to float rounding (1e-9): both price with the same model."""
    profile = profiles[case["shape"]]
    cluster = make_cluster(case["gpus"][0], case["gpus"][1], "a100-80gb")
    configs = [c for group in candidate_configs(Pins(), cluster, case["batch"], len(profile.units), profile.micro_batch_sizes)
               for c in group]
    pick = case["pick"]
    target = configs[pick % len(configs)]
    # Schedule, chunks and recomputation drawn apart from the target, so that pins outside what
    # the free search enumerates are tried too (most such pins are refused: skipped below).
    values = dict(pp=target.pp, tp=target.tp, dp=target.dp, micro_batch_size=target.micro_batch_size,
                  schedule=("1f1b", "interleaved-1f1b", "zero-bubble")[pick // 3 % 3], virtual_stages=1 + pick // 9 % 3,
                  recompute=("none", "selective", "full")[pick % 3], zero_stage=target.zero_stage,
                  sequence_parallel=target.sequence_parallel)
    pins = Pins(**{name: values[name] for name in case["pinned"]})
    try:
        pinned = solve(profile, cluster, case["batch"], pins, top_k=1, memory_fraction=case["memory_fraction"])
    except PlannerError:
        return  # nothing pinned fits (or the model refuses the pins): nothing to beat
    free = solve(profile, cluster, case["batch"], top_k=1, memory_fraction=case["memory_fraction"])
    assert free.prediction.iteration_time_s <= pinned.prediction.iteration_time_s * (1 + 1e-9), (pins, free.layout)


# (1, 16, 8, 0.9): few micro-batches per pipeline, where zero bubble is played in the simulator (m < p)
@pytest.mark.parametrize("shape,gpus,batch,fraction", [(0, 8, 32, 0.08), (1, 16, 64, 0.9), (1, 8, 16, 0.04), (1, 16, 8, 0.9)])
def test_bounds_never_exceed_the_price(profiles, shape, gpus, batch, fraction):
    """For every configuration: the time bound is at most its price, and the memory bound at most
    the peak of its stages, wherever the DP finds cuts (exact inequalities, up to float rounding)."""
    profile = profiles[1]
    cluster = make_cluster(16, 8, "a100-80gb")
    compute = ComputeModel(profile, cluster.gpu, "bfloat16")
    coll = CollectiveModel(cluster)
    costs = UnitCosts(profile, compute, lambda t: coll.for_group(group_placement(cluster, t, 1)), "bfloat16")
    env = _environment(cluster, compute, "bfloat16", Pins(), fraction)
    bound = TimeBound(env)
    priced = 0
    for group in candidate_configs(Pins(), cluster, batch, len(profile.units), profile.micro_batch_sizes):
        for cfg in group:
            table = costs.table(cfg.tp, cfg.sequence_parallel, cfg.micro_batch_size)
            result = evaluate_config(table, cfg, env)
            if not result.feasible:
                continue
            priced += 1
            assert bound(table, cfg) <= result.iteration_time_s * (1 + 1e-9), cfg
            rank_peak = max(sum(result.peak_memory_bytes[k::cfg.pp]) for k in range(cfg.pp))
            assert memory_lower_bound(table, cfg, env) <= rank_peak * (1 + 1e-9), cfg
    assert priced > 10


@pytest.mark.parametrize("schedule", ["zero-bubble", "interleaved-1f1b", "1f1b"])
def test_bounds_hold_where_the_gradient_reduction_is_exposed(profiles, schedule, monkeypatch):
    """A network 100x slower than the preset leaves the data-parallel gradient reduction and
    gather exposed after the pipeline (`_tail_s`): the bound is still at most every price, and
    for zero bubble and interleaving it counts the exposed tail (higher than without it for some
    configuration); 1F1B's long drain leaves it out."""
    import dataclasses

    import planner.solver.bounds as bounds_module

    profile = profiles[1]
    base = make_cluster(16, 4, "a100-80gb")
    cluster = dataclasses.replace(base, inter_node=dataclasses.replace(
        base.inter_node, bandwidth_bytes_per_s=base.inter_node.bandwidth_bytes_per_s / 100))
    compute = ComputeModel(profile, cluster.gpu, "bfloat16")
    coll = CollectiveModel(cluster)
    costs = UnitCosts(profile, compute, lambda t: coll.for_group(group_placement(cluster, t, 1)), "bfloat16")
    env = _environment(cluster, compute, "bfloat16", Pins(schedule=schedule), 0.9)
    pairs, prices = [], []
    for group in candidate_configs(Pins(schedule=schedule), cluster, 64, len(profile.units), profile.micro_batch_sizes):
        for cfg in group:
            if cfg.dp == 1:
                continue
            table = costs.table(cfg.tp, cfg.sequence_parallel, cfg.micro_batch_size)
            result = evaluate_config(table, cfg, env)
            if result.feasible:
                pairs.append((table, cfg))
                prices.append(result.iteration_time_s)
    bound = TimeBound(env).many(pairs)
    assert len(pairs) > 10 and np.all(bound <= np.array(prices) * (1 + 1e-9))
    monkeypatch.setattr(bounds_module, "_tail_comm_s", lambda *args: (0.0, 0.0))
    without = TimeBound(env).many(pairs)
    assert np.all(without <= bound)
    assert (bound > without * (1 + 1e-6)).any() == (schedule != "1f1b")


def test_zero_bubble_bounds_count_the_gradients_and_their_accumulation(profiles, monkeypatch):
    """Zero bubble under memory pressure: the bound is at most every price, and it is higher for
    some configuration than without the counts held beside the gradients after the first weight
    pass (`_held_with_gradients`: before, the bound left the gradients out of every rank's
    memory) and than without the step's gradient accumulation passes (`accumulation_s`)."""
    import planner.solver.bounds as bounds_module

    profile = profiles[1]
    cluster = make_cluster(16, 8, "a100-80gb")
    compute = ComputeModel(profile, cluster.gpu, "bfloat16")
    coll = CollectiveModel(cluster)
    costs = UnitCosts(profile, compute, lambda t: coll.for_group(group_placement(cluster, t, 1)), "bfloat16")
    pins = Pins(schedule="zero-bubble")
    env = _environment(cluster, compute, "bfloat16", pins, 0.03)
    pairs, prices = [], []
    for group in candidate_configs(pins, cluster, 64, len(profile.units), profile.micro_batch_sizes):
        for cfg in group:
            table = costs.table(cfg.tp, cfg.sequence_parallel, cfg.micro_batch_size)
            result = evaluate_config(table, cfg, env)
            if result.feasible and cfg.pp > 1:
                pairs.append((table, cfg))
                prices.append(result.iteration_time_s)
    bound = TimeBound(env).many(pairs)
    assert len(pairs) > 10 and np.all(bound <= np.array(prices) * (1 + 1e-9))
    with monkeypatch.context() as patch:
        patch.setattr(bounds_module, "_held_with_gradients", lambda *args: (0.0, 0.0, 0.0))
        patch.setattr(bounds_module, "_rank_held_with_gradients", lambda schedule, pp, *args: (0.0,) * pp)
        without_gradients = TimeBound(env).many(pairs)
    with monkeypatch.context() as patch:
        patch.setattr(bounds_module, "accumulation_pass_bytes", lambda *args: 0.0)
        without_accumulation = TimeBound(env).many(pairs)
    for without in (without_gradients, without_accumulation):
        assert np.all(without <= bound * (1 + 1e-12))
        assert (bound > without * (1 + 1e-6)).any()


def test_batched_time_bound_equals_one_at_a_time(profiles):
    """`TimeBound.many` shares terms across configurations (per table, ZeRO stage, dp, hybrid
    sharding, offload, pp) and evaluates the closed forms in one numpy pass: each value must be
    the one a fresh bound computes for that configuration alone (exact: same operations)."""
    profile = profiles[1]
    cluster = make_cluster(16, 8, "a100-80gb")
    compute = ComputeModel(profile, cluster.gpu, "bfloat16")
    coll = CollectiveModel(cluster)
    costs = UnitCosts(profile, compute, lambda t: coll.for_group(group_placement(cluster, t, 1)), "bfloat16")
    env = _environment(cluster, compute, "bfloat16", Pins(), 0.15)
    pairs = [(costs.table(cfg.tp, cfg.sequence_parallel, cfg.micro_batch_size), cfg)
             for group in candidate_configs(Pins(), cluster, 64, len(profile.units), profile.micro_batch_sizes,
                                            allow_offload=True) for cfg in group]
    batched = TimeBound(env).many(pairs)
    alone = [TimeBound(env)(table, cfg) for table, cfg in pairs[::7]]
    assert len({cfg.schedule for _, cfg in pairs}) == 3 and any(cfg.offload for _, cfg in pairs)
    assert list(batched[::7]) == alone
    # With a cap, B* and z* are left out where the rest of the bound already reaches it: the same
    # value below the cap, a weaker one (still at least the cap) above it.
    cap = float(np.median(batched))
    capped = TimeBound(env).many(pairs, cap=cap)
    assert np.all(capped <= batched) and np.all(capped[capped < cap] == batched[capped < cap])
    assert np.all(capped[capped != batched] >= cap) and (capped != batched).any()


def test_weak_bound_per_group_equals_per_configuration(profiles):
    """The search orders configurations by the weak bound computed per group of `candidate_blocks`
    (`_Fitting`: memory once per group, the closed forms per schedule without a Config each):
    the same configurations in the same order as `candidate_configs` lists them, the same memory
    pruning and the same values as `TimeBound.many(whole=False)` one configuration at a time."""
    from planner.solver.solve import _Fitting, candidate_blocks

    profile = profiles[1]
    cluster = make_cluster(16, 8, "a100-80gb")
    compute = ComputeModel(profile, cluster.gpu, "bfloat16")
    coll = CollectiveModel(cluster)
    costs = UnitCosts(profile, compute, lambda t: coll.for_group(group_placement(cluster, t, 1)), "bfloat16")
    env = _environment(cluster, compute, "bfloat16", Pins(), 0.02)  # some prune
    args = (Pins(), cluster, 64, len(profile.units), profile.micro_batch_sizes)
    blocks = list(candidate_blocks(*args, allow_offload=True, allow_async=True))
    tables = {block.table_key(g): costs.table(*block.table_key(g)) for block in blocks for g in range(len(block.rest))}
    fitting = _Fitting(blocks, tables, TimeBound(env), env.usable_memory_bytes, profile.unit_names())
    configs = [cfg for group in candidate_configs(*args, allow_offload=True, allow_async=True) for cfg in group]
    pairs = [(tables[(c.tp, c.sequence_parallel, c.micro_batch_size, c.ep, c.cp, c.cp_algorithm)], c) for c in configs]
    kept = [(table, cfg) for table, cfg in pairs if memory_lower_bound(table, cfg, env) <= env.usable_memory_bytes]
    assert fitting.candidates == len(configs) and fitting.pruned == len(configs) - len(kept) > 0
    assert [cfg for _, cfg in fitting.pairs(range(len(fitting)))] == [cfg for _, cfg in kept]
    assert any(cfg.schedule == "pipedream-2bw" for _, cfg in kept)
    from planner.solver.solve import async_time_bounds

    alone = async_time_bounds(TimeBound(env).many(kept, whole=False), [cfg for _, cfg in kept], env.gpus_per_node)
    assert fitting.weak_bounds(env.gpus_per_node).tolist() == alone.tolist()


@given(st.lists(st.lists(st.sampled_from([0.0, 1.5, -2.0, 3.25]), min_size=4, max_size=4), min_size=1, max_size=30))
def test_distinct_columns_match_numpy_unique(columns):

    from planner.solver.bounds import _distinct_columns

    array = np.array(columns).T
    ours = _distinct_columns(array)
    theirs = np.unique(array, axis=1, return_index=True, return_inverse=True)
    assert np.array_equal(ours[0], theirs[0]) and np.array_equal(ours[1], theirs[1])
    assert np.array_equal(ours[2], np.ravel(theirs[2]))


def test_search_report_counts_and_old_plans_load(profiles):
    plan = solve(profiles[1], make_cluster(8, 8, "a100-80gb"), 32, top_k=3)
    search = plan.search
    assert search.candidates == search.pruned_by_memory_bound + search.pruned_by_time_bound + search.candidates_evaluated
    assert search.pruned_by_time_bound > 0 and search.candidates_evaluated >= 3
    assert all(t >= 0 for t in search.phase_times_s.values())
    # A plan written when `search` was a free-form dict, with a key this version does not know.
    old = json.loads(plan.model_dump_json())
    old["search"] = {"solve_time_s": 1.5, "candidates_evaluated": 7, "pruned_by_memory_bound": 2,
                     "stage_forward_s": [1.0], "stage_backward_s": [2.0], "alternatives": [], "retired_key": 3}
    loaded = parse_plan(old).search
    assert isinstance(loaded, SearchReport) and loaded.candidates_evaluated == 7 and loaded.candidates is None
    assert loaded.solve_time_s == 1.5 and loaded.phase_times_s is None


@pytest.mark.slow
def test_free_search_prices_every_virtual_stage_count():
    """GPT-3 175B on 12,288 A100s: pinned to tp 8, pp 8, dp 192 and 6 virtual stages, zero bubble
    was 2% faster than the free plan when the free search only tried v in {2, 4} for interleaved
    1F1B and v = 1 for zero bubble. Now every v is searched, so the free plan is at least as fast."""
    gpt3 = dict(n_layers=96, d_model=12288, n_heads=96, d_ff=49152, vocab_size=51200, seq_len=2048)
    profile = profile_model("examples/gpt.py", gpt3, [1, 2, 4], device="meta", gpu="a100-80gb", dtype="bfloat16")
    cluster = make_cluster(12288, 8, "a100-80gb")
    pinned = solve(profile, cluster, 6144, Pins(pp=8, tp=8, dp=192, virtual_stages=6), top_k=1)
    free = solve(profile, cluster, 6144, top_k=1)
    assert free.prediction.iteration_time_s <= pinned.prediction.iteration_time_s * (1 + 1e-9)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(times=st.lists(st.floats(0.0, 10.0), min_size=1, max_size=9), chunks=st.integers(1, 9))
def test_least_slowest_chunk_is_the_minimax_cut_from_below(times, chunks):
    """B* (bounds.py `_least_slowest_chunk_s`) against every cut of the units into `chunks`
    contiguous non-empty chunks: never above the best cut's slowest chunk, and within the
    bisection's tolerance of it."""
    from itertools import accumulate, combinations

    from planner.solver.bounds import _least_slowest_chunk_s

    chunks = min(chunks, len(times))
    prefix = [0.0, *accumulate(times)]
    best = min(max(prefix[b] - prefix[a] for a, b in zip((0, *cuts), (*cuts, len(times)), strict=True))
               for cuts in combinations(range(1, len(times)), chunks - 1))
    least = _least_slowest_chunk_s(prefix, chunks)
    assert least <= best * (1 + 1e-12) + 1e-12
    assert least >= best - 1e-3 * (1 + max(times))  # 12 halvings of a bracket one unit wide


@settings(max_examples=200, deadline=None, derandomize=True)
@given(times=st.lists(st.floats(0.0, 10.0), min_size=1, max_size=8), starts=st.data(), chunks=st.integers(1, 8))
def test_least_slowest_chunk_with_start_terms_is_below_every_cut(times, starts, chunks):
    """B* with start terms (a chunk of units i..j-1 takes sum c + s_i, s_i >= 0: ZeRO 3's
    exposed gather at a chunk's first unit) against every cut into `chunks` contiguous chunks:
    never above the best cut's slowest chunk, and never below B* without the start terms."""
    from itertools import accumulate, combinations

    from planner.solver.bounds import _least_slowest_chunk_s

    s = starts.draw(st.lists(st.floats(0.0, 10.0), min_size=len(times), max_size=len(times)))
    chunks = min(chunks, len(times))
    prefix = [0.0, *accumulate(times)]
    offsets = np.maximum.accumulate(np.array(prefix[:-1]) - np.array(s)).tolist()  # as _unit_terms makes them
    best = min(max(prefix[b] - prefix[a] + s[a] for a, b in zip((0, *cuts), (*cuts, len(times)), strict=True))
               for cuts in combinations(range(1, len(times)), chunks - 1))
    least = _least_slowest_chunk_s(prefix, chunks, offsets)
    assert least <= best * (1 + 1e-12) + 1e-12
    assert least >= _least_slowest_chunk_s(prefix, chunks) - 1e-3 * (1 + max(times) + max(s))


@settings(max_examples=200, deadline=None, derandomize=True)
@given(times=st.lists(st.floats(0.0, 10.0), min_size=1, max_size=7), ranks=st.integers(1, 4))
def test_busiest_rank_bound_is_below_every_partition(times, ranks):
    """The pigeonhole bound on the busiest rank (bounds.py `_busiest_rank_s`) against every
    assignment of the units to `ranks` ranks, contiguous or not (interleaving's are not): never
    above the best assignment's busiest rank, and at least the ceil(n / p) fastest units."""
    from itertools import product

    from planner.solver.bounds import _busiest_rank_s

    best = min(max(sum(t for t, r in zip(times, owner, strict=True) if r == rank) for rank in range(ranks))
               for owner in product(range(ranks), repeat=len(times)))
    largest = np.concatenate([[0.0], np.cumsum(sorted(times, reverse=True))])
    terms = SimpleNamespace(largest_prefix_s=largest)
    bound = float(_busiest_rank_s(terms, np.array([float(ranks)]))[0])
    assert bound <= best * (1 + 1e-12) + 1e-12
    assert bound >= sum(sorted(times)[:-(-len(times) // ranks)]) * (1 - 1e-12) - 1e-12


def test_whole_unit_bounds_see_what_the_mean_does_not():
    """Two cases the old bounds missed. 96 blocks, a small embedding and a head on 8 ranks: some
    rank holds 12 blocks and the head (12.35), where the 13 fastest units take 11.36. Four units
    of 1 s whose chunks pay 3 s at any start but the first, cut in two: the best cut is 3 + 1
    (4 s), where the units alone allow 2."""

    from planner.solver.bounds import _busiest_rank_s, _least_slowest_chunk_s

    times = [0.01] + [1.0] * 96 + [0.35]
    terms = SimpleNamespace(largest_prefix_s=np.concatenate([[0.0], np.cumsum(sorted(times, reverse=True))]))
    assert _busiest_rank_s(terms, np.array([8.0]))[0] == pytest.approx(12.35)
    prefix, start = [0.0, 1.0, 2.0, 3.0, 4.0], np.array([0.0, 3.0, 3.0, 3.0])
    offsets = np.maximum.accumulate(np.array(prefix[:-1]) - start).tolist()  # as _unit_terms makes them
    assert _least_slowest_chunk_s(prefix, 2) == pytest.approx(2.0, abs=1e-3)
    assert _least_slowest_chunk_s(prefix, 2, offsets) == pytest.approx(4.0, abs=1e-2)


def test_even_block_cuts_split_the_layers_as_megatron_does(profiles):
    from planner.solver.solve import even_block_cuts

    profile = profiles[1]  # 6 blocks between the embedding and the final norm and head
    names = profile.unit_names()
    cuts = even_block_cuts(profile)
    stages = [names[i:j] for i, j in cuts(3)]
    assert stages[0][0] == names[0] and stages[-1][-1] == names[-1]
    assert [sum(n.startswith("blocks.") for n in stage) for stage in stages] == [2, 2, 2]
    assert cuts(4) is None and cuts(7) is None  # 6 layers do not split into 4 or 7 equal chunks
    plan = solve(profile, make_cluster(8, 8, "a100-80gb"), 16, Pins(pp=2, tp=1, dp=4, schedule="1f1b"), top_k=1, cuts=cuts)
    assert [sum(u.startswith("blocks.") for u in stage.units) for stage in plan.stages] == [3, 3]


@settings(max_examples=150, deadline=None, derandomize=True)
@given(count=st.integers(1, 5), levels=st.lists(st.integers(1, 4), min_size=1, max_size=3),
       modes=st.lists(st.tuples(st.floats(0.1, 2.0), st.floats(0.0, 3.0)), min_size=1, max_size=3),
       states=st.floats(0.0, 2.0), memory=st.floats(1.0, 20.0),
       reserve=st.one_of(st.none(), st.tuples(st.floats(0.0, 2.0), st.floats(0.0, 10.0))))
def test_memory_rank_bound_is_below_every_placement(count, levels, modes, states, memory, reserve):
    """z* (bounds.py `_memory_rank_s`) against every placement of `count` identical units on ranks
    holding `levels` micro-batches in flight, each unit in one of `modes` (time, activation
    bytes), the first rank also running another unit (`reserve`: its seconds and bytes, as the
    embedding on rank 0): where some placement fits every rank's memory, z* is at most its
    busiest rank's time, and at least what the busiest rank's whole units take at the fastest
    mode, ceil(count / ranks) of them (units come whole: the bound is not vacuous)."""
    from itertools import combinations_with_replacement, product

    from planner.solver.bounds import _memory_rank_s

    times, acts = (np.array(column) for column in zip(*modes, strict=True))
    extra_s, extra_bytes = reserve or (0.0, 0.0)

    def loads(units: int):  # (time, bytes at level 1 less states) of each multiset of modes
        return [(sum(times[m] for m in pick), sum(acts[m] for m in pick))
                for pick in combinations_with_replacement(range(len(modes)), units)]

    best = np.inf
    for split in product(range(count + 1), repeat=len(levels)):
        if sum(split) != count:
            continue
        per_rank = []
        for rank, (units, level) in enumerate(zip(split, levels, strict=True)):
            room = memory - (extra_bytes if rank == 0 else 0.0)
            fitting = [t for t, a in loads(units) if units * states + level * a <= room]
            per_rank.append(min(fitting) + (extra_s if rank == 0 else 0.0) if fitting else np.inf)
        best = min(best, max(per_rank))
    distinct = sorted(set(levels))
    counts = [levels.count(x) - (reserve is not None and x == levels[0]) for x in distinct]
    slots = [(x, c, 0.0, 0.0) for x, c in zip(distinct, counts, strict=True)]
    if reserve is not None:
        slots.append((levels[0], 1, extra_s, extra_bytes))
    columns = np.array(slots, dtype=float).T[:, None, :]
    z = _memory_rank_s(times[None], acts[None], np.array([states]), np.array([float(count)]), columns[0], columns[1],
                       memory, reserved_s=columns[2], reserved_bytes=columns[3])[0]
    if np.isfinite(best):
        assert z <= best * (1 + 1e-9)
    assert z >= -(-count // len(levels)) * times.min() * (1 - 1e-5)  # 24 halvings of a bracket <= 60 z* wide


@given(st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=6), min_size=1, max_size=8))
def test_majority_modes_of_all_stages_equal_one_at_a_time(stages):
    """`_price` names each stage's recomputation by `_majority_modes` (all stages in one numpy
    pass); it must equal `majority_mode` (most units, ties to the mode that recomputes least)."""

    from planner.solver.search import _majority_modes, majority_mode

    modes = ("none", "selective", "full")
    unit_mode = np.array([r for stage in stages for r in stage])
    starts = np.cumsum([0] + [len(stage) for stage in stages[:-1]])
    expected = tuple(majority_mode(tuple(modes[r] for r in stage)) for stage in stages)
    assert _majority_modes(unit_mode, starts, modes) == expected
    # Another order of the allowed modes (env.allowed_recompute) names the same ones.
    shuffled = ("full", "none", "selective")
    remap = np.array([shuffled.index(m) for m in modes])
    assert _majority_modes(remap[unit_mode], starts, shuffled) == expected


@pytest.mark.timeout(300)
@pytest.mark.parametrize("shape,gpus,batch,fraction", [(0, 8, 32, 0.08), (1, 16, 64, 0.9), (1, 8, 16, 0.04),
                                                       (0, 16, 32, 0.15), (1, 16, 8, 0.3)])
def test_a_split_search_finds_the_one_process_top_k(profiles, shape, gpus, batch, fraction, monkeypatch):
    """The blocks dealt to two processes with one shared cap (planner/solver/solve.py
    `split_blocks`, planner/solver/pricing.py `run_split`): the same top k, ties in the same
    order, and every configuration counted once (as enumerated, pruned by memory, priced or
    pruned by time)."""
    import planner.solver.solve as solve_module
    from planner.solver.solve import search

    monkeypatch.setattr(solve_module, "SPLIT_MIN", 0)
    made = []
    monkeypatch.setattr(solve_module, "Helpers", lambda parts: made.append(Helpers(parts)) or made[-1])
    profile = profiles[1]
    cluster = make_cluster(16, 8, "a100-80gb")
    alone = search(profile, cluster, batch, memory_fraction=fraction, keep=3, workers=1)
    for workers in (2, 3):
        split = search(profile, cluster, batch, memory_fraction=fraction, keep=3, workers=workers)
        assert alone.ranked, "nothing fits: pick an instance where something does"
        assert [(e.iteration_time_s, e.config) for e in split.ranked[:3]] == \
            [(e.iteration_time_s, e.config) for e in alone.ranked[:3]]
        assert (split.candidates, split.pruned) == (alone.candidates, alone.pruned)
        assert split.evaluated >= 3 and len({e.config for e in split.ranked}) == len(split.ranked)  # each priced once
        assert split.pruned_by_time >= 0 and made[-1].parts == split.processes == workers and alone.processes == 1
    if (shape, gpus, batch) == (1, 16, 8):  # 75 DPs, most in one part: the other serves it once done
        assert any(h.served for h in made), "no part priced for another"


def test_split_blocks_deals_every_block_once_and_keeps_families_whole(profiles):
    from planner.solver.solve import candidate_blocks, split_blocks

    profile = profiles[1]
    blocks = list(candidate_blocks(Pins(), make_cluster(64, 8, "a100-80gb"), 1024, len(profile.units),
                                   profile.micro_batch_sizes))
    parts = split_blocks(blocks, 2)
    assert len(parts) == 2 and split_blocks(blocks, 2) == parts  # deterministic
    assert sorted(map(id, (b for part in parts for b in part))) == sorted(map(id, blocks))
    family = lambda b: (b.tp, b.sequence_parallel, b.micro_batch_size)  # noqa: E731
    assert not {family(b) for b in parts[0]} & {family(b) for b in parts[1]}
    sizes = [sum(len(b.rest) * len(b.schedules) for b in part) for part in parts]
    assert min(sizes) > 0.25 * max(sizes)
    assert split_blocks(blocks[:3], 2) == [blocks[:3]]  # too few configurations to fork for


def test_a_shared_top_k_holds_the_k_best_as_top_k_does():
    import random

    from planner.solver.pricing import SharedTopK, TopK

    rng = random.Random(0)
    alone, shared = TopK(3), SharedTopK(3)
    for _ in range(50):
        seconds = rng.choice([rng.uniform(1, 10), 5.0])  # ties too
        alone.add(seconds)
        shared.add(seconds)
        assert shared.cap == alone.cap
