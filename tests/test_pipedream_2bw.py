"""PipeDream-2BW, the asynchronous schedule: its rule, its parity, its price and when the solver picks it.

The rule (planner/plan.py `Schedule`): W(t+1) = W(t) - lr grad f(W(t-1)), W(-1) = W(0). The
pipelined runs must match the one-process reference that applies the same rule
(tests/test_runtime_parity.py `check_parity`, same tolerances and reasons), and that reference
must train to other parameters than the synchronous one, or parity would prove nothing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

from planner.cluster import make_cluster
from planner.cost.memory import stage_memory, stashed_weight_bytes
from planner.cost.schedules import bubble_fraction, in_flight_microbatches, iteration_time_s
from planner.cost.simulator import schedule_actions, simulate
from planner.errors import PlannerError
from planner.solver.search import Config
from planner.solver.solve import ASYNC_NOTE, Pins, price_config, search, solve
from runtime.checkpoint import check_resume_schedule
from runtime.pp_async import WeightStash
from tests.conftest import ROOT
from tests.runtime_plans import make_2bw_plan, make_plan
from tests.test_runtime_checkpoint import check_resume_matches_reference
from tests.test_runtime_parity import PARAM_ATOL, check_parity

GPT = dict(n_layers=8, d_model=2048, n_heads=16, d_ff=8192, vocab_size=32000, seq_len=1024)


# --- the rule ---------------------------------------------------------------------------------

def test_weight_stash_applies_the_2bw_rule_exactly():
    """SGD through `WeightStash` against the rule written out: W(t+1) = W(t) - lr g_t(W(t-1))."""
    torch.manual_seed(0)
    model, lr = nn.Linear(3, 2), 0.1
    batches = [(torch.randn(4, 3), torch.randn(4, 2)) for _ in range(4)]
    loss = lambda m, x, y: ((m(x) - y) ** 2).mean()  # noqa: E731

    def grad_at(weights, x, y):
        probe = nn.Linear(3, 2)
        probe.load_state_dict(dict(zip(("weight", "bias"), weights, strict=True)))
        loss(probe, x, y).backward()
        return [probe.weight.grad, probe.bias.grad]

    expected = [[p.detach().clone() for p in model.parameters()]]  # W(0)
    older = expected[0]  # W(-1) = W(0)
    for x, y in batches:
        grads = grad_at(older, x, y)
        older = expected[-1]
        expected.append([w - lr * g for w, g in zip(expected[-1], grads, strict=True)])

    stash, optimizer = WeightStash([model]), torch.optim.SGD(model.parameters(), lr=lr)
    for x, y in batches:
        optimizer.zero_grad()
        stash.swap_in()
        loss(model, x, y).backward()
        stash.restore()
        optimizer.step()
    # Same operations in the same order on the same float32 values: equal up to the last bit or two.
    for got, want in zip(model.parameters(), expected[-1], strict=True):
        torch.testing.assert_close(got.detach(), want, rtol=0, atol=1e-6)
    assert stash.state_dict().keys() == {"weight", "bias"}
    for got, want in zip(stash.state_dict().values(), expected[-2], strict=True):  # the stash holds W(T-1)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def test_frozen_parameters_get_no_stash():
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    model[0].weight.requires_grad_(False)
    assert WeightStash([model]).names == ["0.bias", "1.weight", "1.bias"]


def _reference(plan, tmp_path, tag, steps=3):
    path = plan.save(tmp_path / f"{tag}.json")
    out = tmp_path / tag
    done = subprocess.run([sys.executable, "-m", "runtime", str(path), "--steps", str(steps), "--reference",
                           "--output", str(out / "m.json"), "--save-params", str(out / "p.pt")],
                          cwd=ROOT, capture_output=True, text=True, timeout=180, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads((out / "m.json").read_text())["losses"], torch.load(out / "p.pt")


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_2bw_reference_trains_differently_from_the_synchronous_one(tmp_path):
    async_losses, async_params = _reference(make_2bw_plan(pp=2), tmp_path, "async")
    sync_losses, sync_params = _reference(make_plan(pp=2, m=4), tmp_path, "sync")
    # Step 0 runs on W(-1) = W(0) in both: the same loss to float32 rounding.
    assert async_losses[0] == pytest.approx(sync_losses[0], rel=1e-6)
    # Step 1 runs on W(0) under 2BW and W(1) synchronously.
    assert abs(async_losses[1] - sync_losses[1]) > 1e-4
    apart = max((async_params[k] - sync_params[k]).abs().max().item() for k in sync_params)
    assert apart > 10 * PARAM_ATOL  # far outside the parity tolerance: parity below is not vacuous


# --- parity -----------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("layout", [dict(pp=2, m=4), dict(pp=2, dp=2, m=4), dict(dp=2, zero=3, m=2)],
                         ids=["pp2-m4", "pp2xdp2", "dp2-zero3-stash-sharded"])
def test_pipelined_2bw_matches_its_reference(layout, tmp_path):
    check_parity(make_2bw_plan(**layout), tmp_path)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_2bw_checkpoint_keeps_both_versions_and_reshards(tmp_path):
    """3 steps under pp2, resumed for 3 under dp2: the 2BW reference's 6 losses. Losing the older
    version on resume would restart the rule at W(-1) = W(t) and change step 4's loss."""
    check_resume_matches_reference(make_2bw_plan(pp=2), make_2bw_plan(dp=2, m=2), tmp_path)  # 8 samples a step in both


def test_resume_across_the_async_divide_is_refused():
    check_resume_schedule({"stashed_weights": True}, asynchronous=True)
    check_resume_schedule({}, asynchronous=False)  # checkpoints from before the flag are synchronous
    with pytest.raises(PlannerError, match="synchronous run"):
        check_resume_schedule({"step": 3}, asynchronous=True)
    with pytest.raises(PlannerError, match="asynchronous"):
        check_resume_schedule({"stashed_weights": True}, asynchronous=False)


# --- cost -------------------------------------------------------------------------------------

@pytest.mark.parametrize(("p", "m"), [(2, 4), (4, 4), (4, 16), (8, 8)])
def test_2bw_has_no_bubble_where_1f1b_has_its_share(p, m):
    f, b = [1.0] * p, [2.0] * p
    assert bubble_fraction("pipedream-2bw", p, m) == 0.0
    assert bubble_fraction("1f1b", p, m) == pytest.approx((p - 1) / (m + p - 1))  # (p-1)/m of the ideal time
    assert iteration_time_s("pipedream-2bw", f, b, m) == pytest.approx(m * 3.0)
    assert iteration_time_s("1f1b", f, b, m) == pytest.approx((m + p - 1) * 3.0)
    # The simulator plays one batch alone (the flushed step the runtime runs): 1F1B's timeline,
    # slower than the steady state by exactly the fill and drain.
    assert schedule_actions("pipedream-2bw", p, m) == schedule_actions("1f1b", p, m)
    assert simulate("pipedream-2bw", f, b, m).makespan_s - iteration_time_s("pipedream-2bw", f, b, m) == \
        pytest.approx((p - 1) * 3.0)
    assert [in_flight_microbatches("pipedream-2bw", p, m, i) for i in range(p)] == \
        [in_flight_microbatches("1f1b", p, m, i) for i in range(p)]


def test_2bw_steady_state_is_paced_by_the_slowest_stage():
    f, b = [1.0, 2.0, 0.5], [2.0, 3.0, 1.0]
    assert iteration_time_s("pipedream-2bw", f, b, 6) == pytest.approx(6 * 5.0)


def test_2bw_refuses_fewer_micro_batches_than_ranks_and_virtual_stages():
    with pytest.raises(ValueError, match="one chunk per rank"):
        iteration_time_s("pipedream-2bw", [1.0] * 4, [2.0] * 4, 4, 2)
    with pytest.raises(ValueError, match="num_microbatches >= pp_degree"):
        make_2bw_plan(pp=2, m=1)


def test_stage_memory_names_the_stashed_weights():
    mib = 2**20
    sync = stage_memory(mib, "bfloat16", 0, 1, activation_bytes=8 * mib, in_flight=2)
    stashed = stage_memory(mib, "bfloat16", 0, 1, activation_bytes=8 * mib, in_flight=2,
                           stashed_parameters=mib)
    assert stashed.stashed_weights == 2 * mib  # one more 16-bit copy of the weights
    assert stashed.tensor_bytes - sync.tensor_bytes == 2 * mib
    assert "stashed_weights" not in sync.terms() and stashed.terms()["stashed_weights"] == 2 * mib
    assert stashed_weight_bytes(mib, "float32", 3, 4) == mib  # fp32, ZeRO-3 over 4: a quarter of 4 bytes each


# --- solver -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def gpt_profile():
    from planner.profiler import profile_model

    return profile_model("examples/gpt.py", GPT, [1, 2, 4], device="meta", gpu="a100-80gb", dtype="bfloat16")


def test_2bw_is_never_chosen_without_allow_async(gpt_profile):
    plan = solve(gpt_profile, make_cluster(8, 8, "a100-80gb"), 64, Pins(pp=4), top_k=5)
    assert plan.layout.schedule != "pipedream-2bw"
    assert all(a.layout.schedule != "pipedream-2bw" for a in plan.search.alternatives)
    assert ASYNC_NOTE not in plan.search.notes


def test_2bw_wins_with_allow_async_and_the_plan_says_so(gpt_profile):
    cluster = make_cluster(8, 8, "a100-80gb")
    sync = solve(gpt_profile, cluster, 64, Pins(pp=4), top_k=3)
    plan = solve(gpt_profile, cluster, 64, Pins(pp=4), top_k=3, allow_async=True)
    assert plan.layout.schedule == "pipedream-2bw"
    assert plan.prediction.bubble_fraction == 0.0
    assert plan.prediction.iteration_time_s < sync.prediction.iteration_time_s
    assert plan.search.notes[0] == ASYNC_NOTE and "W(t+1) = W(t) - lr grad f(W(t-1))" in ASYNC_NOTE


def test_pinned_2bw_needs_allow_async(gpt_profile):
    cluster = make_cluster(8, 8, "a100-80gb")
    with pytest.raises(PlannerError, match="asynchronous") as info:
        solve(gpt_profile, cluster, 64, Pins(pp=4, schedule="pipedream-2bw"))
    assert "--allow-async" in info.value.hint
    assert solve(gpt_profile, cluster, 64, Pins(pp=4, schedule="pipedream-2bw"), allow_async=True).layout.schedule == \
        "pipedream-2bw"


def test_async_search_keeps_the_exact_top_k(gpt_profile):
    """The time bound of 2BW configurations (`async_time_bounds`) prunes none of the true top k:
    the search with a small k finds the same best plans as pricing every configuration."""
    cluster = make_cluster(8, 8, "a100-80gb")
    pruned = search(gpt_profile, cluster, 64, Pins(pp=4), keep=3, allow_async=True)
    everything = search(gpt_profile, cluster, 64, Pins(pp=4), keep=10**6, allow_async=True)
    assert pruned.pruned_by_time > 0
    assert [e.iteration_time_s for e in pruned.ranked[:3]] == [e.iteration_time_s for e in everything.ranked[:3]]


def test_2bw_memory_is_1f1b_plus_one_weight_copy(gpt_profile):
    cluster = make_cluster(8, 8, "a100-80gb")
    cfg = Config(tp=1, sequence_parallel=False, pp=4, dp=2, micro_batch_size=1, num_microbatches=32,
                 schedule="pipedream-2bw", virtual_stages=1, zero_stage=0)
    async_eval = price_config(gpt_profile, cluster, cfg)
    sync_eval = price_config(gpt_profile, cluster, Config(**{**cfg.__dict__, "schedule": "1f1b"}))
    assert async_eval.bounds == sync_eval.bounds  # memory is roomy: the same cuts
    units = gpt_profile.units
    for (i, j), a, s in zip(async_eval.bounds, async_eval.peak_memory_bytes, sync_eval.peak_memory_bytes, strict=True):
        weights = stashed_weight_bytes(sum(u.num_parameters for u in units[i:j]), async_eval.precision, 0, 2)
        assert a - s == pytest.approx(weights, rel=1e-9)  # exactly one copy of the stage's weights as held (fp32)


def test_cli_allow_async_flag(gpt_profile, tmp_path):
    profile = tmp_path / "profile.json"
    profile.write_text(gpt_profile.model_dump_json())
    base = [sys.executable, "-m", "planner.cli", "solve", "--profile", str(profile), "--global-batch", "64", "--gpus", "8",
            "--gpu", "a100-80gb", "--pp", "4", "--schedule", "pipedream-2bw", "--output", str(tmp_path / "plan.json")]
    refused = subprocess.run(base, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert refused.returncode != 0 and "--allow-async" in refused.stdout + refused.stderr
    allowed = subprocess.run([*base, "--allow-async"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert allowed.returncode == 0, allowed.stderr[-2000:]
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["layout"]["schedule"] == "pipedream-2bw" and plan["search"]["notes"][0] == ASYNC_NOTE
