"""planner solve: plans that are valid, pins honoured, infeasibility explained, no torch on the solve path."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from dataclasses import replace

import pytest

from planner.cluster import make_cluster
from planner.errors import PlannerError
from planner.plan import parse_plan
from planner.profiler import profile_model
from planner.solver.solve import Pins, even_block_cuts, solve
from tests.conftest import ROOT

GIB = 2**30

# A GPT with 1.3B-parameter-class blocks (d 2048) but only 8 layers: small enough to profile in seconds.
GPT = dict(n_layers=8, d_model=2048, n_heads=16, d_ff=8192, vocab_size=32000, seq_len=1024)


@pytest.fixture(scope="module")
def gpt_profile():
    return profile_model("examples/gpt.py", GPT, [1, 2, 4], device="meta", gpu="a100-80gb", dtype="bfloat16")


def _covers_all_units(plan, profile):
    units = [u for s in plan.stages for u in s.units]
    assert units == profile.unit_names()


def test_free_search_gives_a_valid_fast_plan(gpt_profile):
    plan = solve(gpt_profile, make_cluster(8, 8, "a100-80gb"), 64, top_k=5)
    parse_plan(json.loads(plan.model_dump_json()))  # round-trips through the schema
    _covers_all_units(plan, gpt_profile)
    pred = plan.prediction
    assert pred.iteration_time_s > 0 and 0 < pred.mfu < 1
    assert pred.tokens_per_s == pytest.approx(pred.samples_per_s * 1024)
    search = plan.search
    assert search.candidates_evaluated >= 5  # the top 5 at least; the bound prunes the rest
    assert search.candidates == search.pruned_by_memory_bound + search.pruned_by_time_bound + search.candidates_evaluated
    assert set(search.phase_times_s) == {"intra_op", "bounds", "inter_op"}
    alts = search.alternatives
    assert alts and all(a.iteration_time_s >= pred.iteration_time_s for a in alts)
    # Each runner-up states its own slowdown against the winner (plan_builder.why_lost).
    assert all(a.why_lost.startswith(f"{a.iteration_time_s / pred.iteration_time_s - 1:+.1%} slower") for a in alts)
    assert max(pred.peak_memory_bytes) <= 80 * 1024**3


def test_all_pins_evaluate_exactly_that_configuration(gpt_profile):
    pins = Pins(pp=2, tp=2, dp=2, cp=1, micro_batch_size=2, schedule="interleaved-1f1b", virtual_stages=2,
                recompute="full", zero_stage=1, sequence_parallel=True)
    plan = solve(gpt_profile, make_cluster(8, 8, "a100-80gb"), 32, pins)
    lay = plan.layout
    assert (lay.pp_degree, lay.tp_degree, lay.dp_degree, lay.zero_stage) == (2, 2, 2, 1)
    assert (lay.schedule, lay.virtual_stages, lay.sequence_parallel) == ("interleaved-1f1b", 2, True)
    assert plan.batch.micro_batch_size == 2 and plan.batch.num_microbatches == 8
    assert len(plan.stages) == 4 and all(s.recompute == "full" for s in plan.stages)
    assert plan.search.candidates_evaluated == 1
    _covers_all_units(plan, gpt_profile)


def test_activations_cross_nodes_as_tensor_parallel_slices(gpt_profile):
    # pp2 x tp8 on two nodes: each cut is between nodes, so each TP rank sends 1/8 of the
    # activation over its own NIC and the next stage all-gathers it over NVLink (Megatron's
    # scatter/gather); inside one node, or with SP, activations go whole.
    pins = Pins(pp=2, tp=8, dp=1, micro_batch_size=1, sequence_parallel=False, schedule="1f1b")
    across = solve(gpt_profile, make_cluster(16, 8, "a100-80gb"), 16, pins)
    assert across.layout.p2p_scatter_gather
    inside = solve(gpt_profile, make_cluster(16, 16, "a100-80gb"), 16, pins)
    with_sp = solve(gpt_profile, make_cluster(16, 8, "a100-80gb"), 16, replace(pins, sequence_parallel=True))
    assert not inside.layout.p2p_scatter_gather and not with_sp.layout.p2p_scatter_gather


def test_tp_plan_is_megatron_style(gpt_profile):
    plan = solve(gpt_profile, make_cluster(8, 8, "a100-80gb"), 16, Pins(tp=8, pp=1, dp=1))
    tp_plan = plan.stages[0].tp_plan
    for i in range(GPT["n_layers"]):
        assert tp_plan[f"blocks.{i}.attn.wq"] == "colwise" and tp_plan[f"blocks.{i}.attn.wo"] == "rowwise"
        assert tp_plan[f"blocks.{i}.mlp.fc_in"] == "colwise" and tp_plan[f"blocks.{i}.mlp.fc_out"] == "rowwise"


def test_memory_pressure_turns_on_recomputation_or_zero(gpt_profile):
    cluster = make_cluster(8, 8, "a100-80gb")
    pins = Pins(pp=1, tp=1, dp=8, micro_batch_size=32, zero_stage=0, cp=1)  # activations outweigh states (CP would split them)
    roomy = solve(gpt_profile, cluster, 256, pins)
    assert roomy.stages[0].recompute == "none"
    # A GPU with 30% less than that plan needs: with ZeRO pinned off the solver must recompute.
    needed = max(roomy.prediction.peak_memory_bytes)
    small = replace(cluster, gpu=replace(cluster.gpu, memory_bytes=int(needed * 0.7 / 0.9)))
    tight = solve(gpt_profile, small, 256, pins)
    assert max(tight.prediction.peak_memory_bytes) <= needed * 0.7 * (1 + 1e-9)
    assert any(r != "none" for r in tight.stages[0].unit_modes().values())  # some units, not necessarily all
    assert tight.prediction.iteration_time_s > roomy.prediction.iteration_time_s
    # Unpinned, sharding optimizer state (ZeRO) is the cheaper way to fit.
    free = solve(gpt_profile, small, 256, Pins(pp=1, tp=1, dp=8, micro_batch_size=32))
    assert free.prediction.iteration_time_s <= tight.prediction.iteration_time_s


def test_model_that_cannot_fit_says_by_how_much():
    huge = profile_model("examples/gpt.py", dict(n_layers=4, d_model=12288, n_heads=96, d_ff=49152, vocab_size=51200, seq_len=2048),
                         [1], device="meta", gpu="a100-40gb", dtype="bfloat16")
    with pytest.raises(PlannerError, match=r"does not fit: the smallest per-GPU memory .* GiB, but a100-40gb offers") as refused:
        solve(huge, make_cluster(1, 1, "a100-40gb"), 8)
    # What the fullest stage needs at the least, not what the smallest unit range would: on one
    # GPU the one stage holds every weight (16-bit, at least 2 bytes each), and a need the GPU
    # could meet would contradict "does not fit".
    needed_gib = float(re.search(r"needs is ([0-9.]+) GiB", str(refused.value)).group(1))
    assert needed_gib * GIB >= 2 * huge.model.num_parameters
    assert needed_gib > 0.9 * 40


def test_a_pinned_layout_that_cannot_fit_reports_what_its_stage_needs():
    """The DP's refusal reports the least its fullest stage can hold, not the least of any unit
    range: with one stage pinned, that is the whole model's need (the plan that fit on a roomier
    GPU), where it was once the embedding's alone, far below what the GPU offers."""
    profile = profile_model("examples/gpt.py", dict(n_layers=4, d_model=1024, n_heads=16, d_ff=4096, vocab_size=32000, seq_len=2048),
                            [8], device="meta", gpu="a100-80gb", dtype="bfloat16")
    cluster = make_cluster(8, 8, "a100-80gb")
    pins = Pins(pp=1, tp=1, dp=8, cp=1, micro_batch_size=8, zero_stage=3, recompute="none")
    needed = max(solve(profile, cluster, 64, pins).prediction.peak_memory_bytes)
    small = replace(cluster, gpu=replace(cluster.gpu, memory_bytes=int(needed / 2)))
    with pytest.raises(PlannerError, match="does not fit") as refused:
        solve(profile, small, 64, pins)
    reported = float(re.search(r"needs is ([0-9.]+) GiB", str(refused.value)).group(1))
    assert reported == pytest.approx(needed / GIB, abs=0.01)


def test_an_interleaved_layout_that_cannot_fit_reports_what_a_rank_holds():
    """With v chunks a rank, each holding its own receive buffers and states, the need reported is
    the rank's: more than the GPU offers (it does not fit) and no more than the plan that fit on a
    roomier GPU holds. It was once one chunk's, less than the GPU offered: 256 micro-batches'
    receive buffers are most of what each chunk holds."""
    profile = profile_model("examples/gpt.py", dict(n_layers=8, d_model=1024, n_heads=16, d_ff=4096, vocab_size=32000,
                                                    seq_len=2048), [1], device="meta", gpu="a100-80gb", dtype="bfloat16")
    cluster = make_cluster(2, 2, "a100-80gb")
    pins = Pins(pp=2, tp=1, dp=1, cp=1, micro_batch_size=1, virtual_stages=4, schedule="interleaved-1f1b", zero_stage=0,
                recompute="none")
    chunks = solve(profile, cluster, 256, pins).prediction.peak_memory_bytes  # per stage: rank r holds r, r + 2, ...
    needed = max(sum(chunks[rank::2]) for rank in range(2))
    small = replace(cluster, gpu=replace(cluster.gpu, memory_bytes=int(needed / 2)))
    with pytest.raises(PlannerError, match="does not fit") as refused:
        solve(profile, small, 256, pins)
    reported = float(re.search(r"needs is ([0-9.]+) GiB", str(refused.value)).group(1)) * GIB
    assert 0.9 * small.gpu.memory_bytes < reported <= needed * 1.001


@pytest.mark.parametrize("pins,needle", [
    (Pins(pp=3), "do not divide"),
    (Pins(tp=16), "exceeds the 8 GPUs of a node"),
    (Pins(schedule="round-robin"), "is not one of"),
    (Pins(recompute="sometimes"), "is not one of"),
    (Pins(virtual_stages=2, schedule="1f1b"), "needs --schedule interleaved-1f1b or zero-bubble"),
    (Pins(pp=2, tp=2, dp=1), "but the cluster has 8 GPUs"),
])
def test_invalid_pins_are_explained(gpt_profile, pins, needle):
    with pytest.raises(PlannerError, match=needle):
        solve(gpt_profile, make_cluster(8, 8, "a100-80gb"), 64, pins)


def test_solve_path_does_not_import_torch(gpt_profile, tmp_path):
    path = gpt_profile.save(tmp_path / "p.json")
    code = (
        "import sys\n"
        "from planner.profile_schema import load_profile\n"
        "from planner.cluster import make_cluster\n"
        "from planner.solver.solve import solve\n"
        f"plan = solve(load_profile({str(path)!r}), make_cluster(8, 8, 'a100-80gb'), 32)\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr


def test_cli_solve_show_and_gantt(gpt_profile, tmp_path):
    path = gpt_profile.save(tmp_path / "p.json")
    plan_path, png = tmp_path / "plan.json", tmp_path / "g.png"
    cli = [sys.executable, "-m", "planner.cli"]
    done = subprocess.run([*cli, "solve", "--profile", str(path), "--gpus", "8", "--gpu", "a100-80gb", "--global-batch", "32",
                           "--pp", "2", "--output", str(plan_path)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "Stages" in done.stdout and plan_path.is_file()
    shown = subprocess.run([*cli, "show", str(plan_path), "--gantt", str(png)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert shown.returncode == 0, shown.stderr
    assert "Breakdown" in shown.stdout and png.stat().st_size > 1000
    bad = subprocess.run([*cli, "solve", "--profile", str(path), "--gpus", "8", "--global-batch", "32", "--tp", "3"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert bad.returncode == 1 and "Traceback" not in bad.stderr and "Invalid pins" in bad.stderr


def test_plan_carries_the_profiles_cpu_threads(gpt_profile):
    # A CPU profile's times hold for the thread count they were measured with, so the plan
    # tells the run to use it (runtime/train.py); GPU and analytic profiles carry none.
    assert solve(gpt_profile, make_cluster(8, 8, "a100-80gb"), 64).training.cpu_threads is None
    measured = gpt_profile.model_copy(update={"cpu_threads": 3})
    assert solve(measured, make_cluster(8, 8, "a100-80gb"), 64).training.cpu_threads == 3


def test_pipeline_overhead_is_paid_per_micro_batch_and_stage(gpt_profile):
    # 1F1B runs m + p - 1 stage periods, each a micro-batch of one stage; the cluster's
    # pipeline_overhead_s lengthens every period alike, so the step grows by exactly
    # (m + p - 1) x overhead, the cuts held (free cuts may move to equally fast ones whose
    # slowest optimizer step differs). Unpipelined plans do not pay it.
    cluster = make_cluster(8, 8, "a100-80gb")
    slow = replace(cluster, pipeline_overhead_s=1e-3)
    pins = Pins(pp=4, tp=2, dp=1, micro_batch_size=1, schedule="1f1b", recompute="none", zero_stage=0, sequence_parallel=False)
    cuts = even_block_cuts(gpt_profile)
    base, paid = solve(gpt_profile, cluster, 8, pins, cuts=cuts), solve(gpt_profile, slow, 8, pins, cuts=cuts)
    m, p = 8, 4
    assert paid.prediction.iteration_time_s - base.prediction.iteration_time_s == pytest.approx((m + p - 1) * 1e-3, rel=1e-6)
    flat = Pins(pp=1, tp=8, dp=1, micro_batch_size=1, recompute="none", zero_stage=0, sequence_parallel=False)
    assert solve(gpt_profile, slow, 8, flat).prediction.iteration_time_s == solve(gpt_profile, cluster, 8, flat).prediction.iteration_time_s
