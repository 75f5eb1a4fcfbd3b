"""Zero bubble's split of each stage's backward, as the runtime runs it.

torch's zero-bubble schedules split a chunk's backward into B (input gradients) and W (weight
gradients: the weight GEMMs, planner/cost/compute.py `weight_gradient_share`). Two kinds of
stage do not: the first (torch runs its whole backward at W, nothing needing its input
gradients) and a later stage whose weights its inputs' graph does not reach
(runtime/pp_split.py `needs_full_backward`: the whole backward at B, W empty). The price
gives the second W = 0 (planner/solver/search.py `zero_bubble_split`); the first's split
moves nothing.
"""

from __future__ import annotations

import random
from dataclasses import replace

import numpy as np
import pytest

from planner.cluster import make_cluster
from planner.cost.schedules import BACKWARD_WEIGHT_FRACTION, iteration_time_s
from planner.cost.simulator import simulate
from planner.solver.solve import Pins, solve
from tests.test_memory_terms import DECODER_EMBEDDING


def _random_pipeline(rng: random.Random) -> tuple[list[float], list[float], int, int]:
    p = rng.choice([2, 3, 4, 8])
    v = rng.choice([1, 1, 2])
    m = rng.choice([p, 2 * p, 3 * p]) if v > 1 else rng.choice([max(1, p // 2), p, p + 1, 2 * p, 3 * p])
    forward = [rng.uniform(0.5, 2.0) for _ in range(p * v)]
    backward = [rng.uniform(1.0, 4.0) for _ in range(p * v)]
    return forward, backward, m, v


def test_the_first_stages_split_never_moves_the_makespan():
    # Nothing waits on the first chunk's B: all of its backward at W (torch's rule) or at B, the
    # step is the same. So the price keeps the common split there (no case for chunk 0).
    rng = random.Random(0)
    for _ in range(200):
        forward, backward, m, v = _random_pipeline(rng)
        rest = [BACKWARD_WEIGHT_FRACTION] * (len(forward) - 1)
        times = [simulate("zero-bubble", forward, backward, m, v, backward_weight_fraction=[w0, *rest]).makespan_s
                 for w0 in (0.0, BACKWARD_WEIGHT_FRACTION, 1.0)]
        assert times == pytest.approx([times[1]] * 3, rel=1e-12)


def test_a_stage_run_whole_takes_zero_bubbles_saving_away_at_its_hop():
    # Uniform stages f = 1, b = 2, p = 4, m = 8: ZB-H1 27, 1F1B 33. One whole stage of four
    # plays 30; the closed form, which takes each chunk's hop with its own split, says 29.
    forward, backward, half = [1.0] * 4, [2.0] * 4, BACKWARD_WEIGHT_FRACTION
    split = [half, half, 0.0, half]
    assert iteration_time_s("zero-bubble", forward, backward, 8) == 27.0
    assert iteration_time_s("1f1b", forward, backward, 8) == 33.0
    assert simulate("zero-bubble", forward, backward, 8, backward_weight_fraction=split).makespan_s == 30.0
    assert iteration_time_s("zero-bubble", forward, backward, 8, backward_weight_fraction=split) == 29.0
    # Every stage after the first whole: 1F1B's time, not better (played and in the form).
    whole = [half, 0.0, 0.0, 0.0]
    assert simulate("zero-bubble", forward, backward, 8, backward_weight_fraction=whole).makespan_s == 33.0
    assert iteration_time_s("zero-bubble", forward, backward, 8, backward_weight_fraction=whole) == 33.0


def test_per_chunk_splits_in_the_closed_form_stay_near_the_simulator():
    # Random stages, each with its own split in [0.3, 0.5] (the weight GEMMs' shares the solver
    # gives; the first stage's whole backward at W): the form stays within the band it has for
    # one split; fewer micro-batches than ranks are played exactly.
    rng = random.Random(1)
    errors = []
    for _ in range(200):
        forward, backward, m, v = _random_pipeline(rng)
        split = [1.0, *(rng.uniform(0.3, 0.5) for _ in forward[1:])]
        priced = iteration_time_s("zero-bubble", forward, backward, m, v, backward_weight_fraction=split)
        played = simulate("zero-bubble", forward, backward, m, v, backward_weight_fraction=split).makespan_s
        if m < len(forward) // v:
            assert priced == played
        errors.append(priced / played - 1)
    assert -0.15 < min(errors) and max(errors) < 0.2
    assert np.mean(np.abs(errors)) < 0.05


def test_bad_weight_fractions_are_refused():
    with pytest.raises(ValueError, match="one per chunk"):
        iteration_time_s("zero-bubble", [1.0] * 4, [2.0] * 4, 8, backward_weight_fraction=[0.5, 0.5])
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        simulate("zero-bubble", [1.0] * 2, [2.0] * 2, 4, backward_weight_fraction=[0.5, 1.5])


def test_the_weight_gradient_share_follows_the_ops():
    # A GPT block at 2048 tokens: its linears' weight GEMMs against a backward that also holds the
    # input gradients and attention's backward; at long context attention's backward dominates.
    # The output head is one linear: a half. Embeddings and norms: no GEMM, no W.
    from planner.cost.compute import ComputeModel
    from planner.hardware import get_gpu
    from planner.profiler import profile_model

    shares = {}
    for seq_len in (2048, 32768):
        args = dict(n_layers=1, d_model=4096, n_heads=32, d_ff=16384, vocab_size=50304, seq_len=seq_len,
                    attention="sdpa", dropout=0.0)
        profile = profile_model("examples/gpt.py", args, [1], device="meta", gpu="h100-80gb", dtype="bfloat16")
        model = ComputeModel(profile, get_gpu("h100-80gb"), "bfloat16")
        shares[seq_len] = {u.name: model.weight_gradient_share(u) for u in profile.units}
    assert 0.4 < shares[2048]["blocks.0"] < 0.5
    assert shares[32768]["blocks.0"] < 0.2
    assert shares[2048]["head"] == pytest.approx(0.5)
    assert shares[2048]["embed"] == shares[2048]["norm"] == 0.0
    # A MoE layer's experts are grouped GEMMs the op graph does not list: counted from the layer.
    args = dict(n_layers=1, d_model=1024, n_heads=16, vocab_size=4096, seq_len=1024, num_experts=8, top_k=2, moe_d_ff=1024)
    profile = profile_model("examples/moe.py", args, [1], device="meta", gpu="h100-80gb", dtype="bfloat16")
    layer = profile.units[1]
    share = ComputeModel(profile, get_gpu("h100-80gb"), "bfloat16").weight_gradient_share(layer)
    without = ComputeModel(profile, get_gpu("h100-80gb"), "bfloat16").weight_gradient_share(layer.model_copy(update={"moe": []}))
    assert layer.moe and share > without + 0.1


def test_the_solver_prices_a_whole_stage_as_the_runtime_runs_it(write_model):
    # A decoder's token embedding in the second stage: fed no floating-point tensor, so the
    # runtime runs that stage's backward whole at B. The plan records the split it priced and
    # its Gantt (the simulator) plays the same.
    from planner.plan import parse_plan
    from planner.plan_report import simulated_timeline
    from planner.profiler import profile_model
    from planner.validate import predicted_bubble

    path = write_model(DECODER_EMBEDDING, "decoder_embedding.py")
    profile = profile_model(str(path), {}, [2], device="meta", gpu="a100-80gb")
    pins = Pins(pp=2, dp=1, tp=1, schedule="zero-bubble", virtual_stages=1, micro_batch_size=2, recompute="none")
    plan = solve(profile, make_cluster(2, gpu="a100-80gb"), 8, pins, cuts=lambda chunks: ((0, 2), (2, 5)))
    assert plan.stages[1].units[0] == "decoder_embed"
    assert plan.search.stage_weight_fraction == [1.0, 0.0]  # torch's first stage all at W; this one all at B
    forward, backward = plan.search.stage_forward_s, plan.search.stage_backward_s
    assert simulated_timeline(plan).makespan_s == pytest.approx(
        simulate("zero-bubble", forward, backward, 4, backward_weight_fraction=[1.0, 0.0]).makespan_s, rel=1e-12)
    assert predicted_bubble(plan) == pytest.approx(simulated_timeline(plan).bubble_fraction(), rel=1e-12)
    # Cut where the second stage has no embedding: its linears' share of its backward.
    other = solve(profile, make_cluster(2, gpu="a100-80gb"), 8, pins, cuts=lambda chunks: ((0, 3), (3, 5)))
    assert other.search.stage_weight_fraction[0] == 1.0
    assert 0.0 < other.search.stage_weight_fraction[1] <= BACKWARD_WEIGHT_FRACTION
    # A hand-edited plan whose shares do not match its stages is refused with what to do.
    data = plan.model_dump(mode="json")
    data["search"]["stage_weight_fraction"] = [0.5]
    with pytest.raises(Exception, match="stage_weight_fraction"):
        parse_plan(data)
    assert np.isfinite(plan.prediction.iteration_time_s)


def _with_split(profile, ratio: float | None, weight_share: float = 0.0):
    """The profile with every split-run unit's B and W set to `ratio` x its backward, W taking
    `weight_share` of it (None: the split not recorded, as an analytic or older profile)."""
    units = []
    for unit in profile.units:
        costs = {}
        for b, c in unit.costs.items():
            if c.backward_input_time_s is None or ratio is None:
                costs[b] = c.model_copy(update={"backward_input_time_s": None, "backward_weight_time_s": None})
            else:
                split = ratio * c.backward_time_s
                costs[b] = c.model_copy(update={"backward_input_time_s": split * (1 - weight_share),
                                                "backward_weight_time_s": split * weight_share})
        units.append(unit.model_copy(update={"costs": costs}))
    return profile.model_copy(update={"units": units})


def test_a_measured_split_backward_is_priced_on_the_stages_torch_splits(write_model):
    # A profile measured on this CPU times each unit's backward split as torch's zero bubble runs
    # it (B, then W). Where B + W costs more than the one backward, a split stage's backward costs
    # that much more and W is the measured share of it; the first stage (torch runs its backward
    # whole, at W) and a stage run whole at B cost what they did, and no other schedule changes.
    from planner.cost.compute import ComputeModel
    from planner.hardware import get_gpu
    from planner.profiler import profile_model

    profile = profile_model("examples/gpt.py", dict(n_layers=2, d_model=32, n_heads=2, d_ff=64, vocab_size=64, seq_len=8),
                            [2], device="cpu", repeats=2, warmup=1)
    assert [u.costs[2].backward_input_time_s is not None for u in profile.units] == [False, True, True, True, True]
    cluster = make_cluster(2, gpu="cpu")
    zb = Pins(pp=2, dp=1, tp=1, schedule="zero-bubble", virtual_stages=1, micro_batch_size=2, recompute="none")

    def priced(ratio, share=0.0, pins=zb):
        return solve(_with_split(profile, ratio, share), cluster, 8, pins, cuts=lambda chunks: ((0, 2), (2, 5)))

    free, even, dear = priced(None), priced(1.0, 0.3), priced(1.5, 0.4)
    assert even.search.stage_backward_s == pytest.approx(free.search.stage_backward_s, rel=1e-12)
    model = ComputeModel(profile, get_gpu("cpu"), profile.dtype, slowdown=cluster.compute_slowdown)
    later = sum(model.unit_time(u, 2).backward_s for u in profile.units[2:])
    assert dear.search.stage_backward_s[0] == pytest.approx(free.search.stage_backward_s[0], rel=1e-12)
    assert dear.search.stage_backward_s[1] - free.search.stage_backward_s[1] == pytest.approx(0.5 * later, rel=1e-9)
    assert dear.search.stage_weight_fraction[0] == 1.0
    assert dear.search.stage_weight_fraction[1] == pytest.approx(0.4 * 1.5 * later / dear.search.stage_backward_s[1], rel=0.05)
    assert dear.prediction.iteration_time_s > free.prediction.iteration_time_s
    one_f_one_b = replace(zb, schedule="1f1b")
    assert priced(1.5, 0.4, one_f_one_b).prediction.iteration_time_s == pytest.approx(
        priced(None, pins=one_f_one_b).prediction.iteration_time_s, rel=1e-12)
    # A stage run whole at B (a decoder's token embedding in it): no split, no extra.
    path = write_model(DECODER_EMBEDDING, "decoder_embedding.py")
    embedding = profile_model(str(path), {}, [2], device="cpu", repeats=2, warmup=1)
    profile = embedding
    assert priced(1.5, 0.4).search.stage_backward_s == pytest.approx(priced(None).search.stage_backward_s, rel=1e-12)
