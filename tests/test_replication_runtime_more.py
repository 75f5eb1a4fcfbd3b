"""PipeDream stage replication (runtime/pp_replicated.py) with what the normal runtime supports:
weights tied across stages, gradient clipping by the global norm, and checkpoints (saved by a
replicated run, resumed by one or by a plain pipeline).

The reductions are checked exactly on spawned gloo ranks with known gradients (Adam divides
each update by sqrt(v), so a wrong clipping norm would barely move a parity test's
parameters); the end-to-end runs match the one-process reference with the parity tests'
tolerances (tests/test_runtime_parity.py: float32, sums reordered over replicas and
micro-batches)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.conftest import ROOT
from tests.ranks import free_port, run_ranks
from tests.runtime_plans import make_plan
from tests.test_replication import _replicated_plan
from tests.test_runtime_parity import LOSS_RTOL, PARAM_ATOL, check_parity
from tests.test_tied_stages import TIED_GPT

# ---- the reductions, on 3 spawned gloo ranks: stage 0 on ranks 0 and 1, stage 1 on rank 2 ----

def _reduction_worker(rank: int, port: int) -> None:
    """Rank r holds gradients r + 1 (its stage's own weight) and 10 (r + 1) (the tied copy)."""
    from runtime.mesh import build_replica_groups, build_replicated_tie_groups
    from runtime.pp_replicated import clip_replicated, sum_replica_gradients

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=3)
    try:
        replicas = [2, 1]
        stage, replica = (0, rank) if rank < 2 else (1, 0)
        groups = build_replica_groups(replicas)
        (tie_group,) = build_replicated_tie_groups(replicas, [(0, 1)])
        module = torch.nn.ParameterDict({"own": torch.nn.Parameter(torch.zeros(3)),
                                         "tied": torch.nn.Parameter(torch.zeros(3))})
        module["own"].grad = torch.full((3,), float(rank + 1))
        module["tied"].grad = torch.full((3,), 10.0 * (rank + 1))
        sum_replica_gradients(module, groups[stage], [(module["tied"], tie_group)])
        own = 1.0 + 2.0 if stage == 0 else 3.0  # the stage's replicas only
        tied = 10.0 * (1 + 2 + 3)  # every micro-batch of both uses, once
        assert torch.equal(module["own"].grad, torch.full((3,), own)), module["own"].grad
        assert torch.equal(module["tied"].grad, torch.full((3,), tied)), module["tied"].grad
        # The global norm: each stage's weight once, the tie once (on stage 0).
        norm = clip_replicated(module, 1.0, replica, [module["tied"]] if stage == 1 else [])
        expected = (3 * (3.0 ** 2 + tied ** 2 + 3.0 ** 2)) ** 0.5
        torch.testing.assert_close(norm, torch.tensor(expected))  # float32 sums of exact squares: rounding only
        coef = 1.0 / (expected + 1e-6)  # torch.nn.utils.clip_grad_norm_'s formula
        torch.testing.assert_close(module["own"].grad, torch.full((3,), own * coef))
        torch.testing.assert_close(module["tied"].grad, torch.full((3,), tied * coef))
    finally:
        dist.destroy_process_group()
    os._exit(0)  # as tests/test_expert_tp.py's workers: gloo aborts in the interpreter's teardown now and then


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_tied_and_clipped_gradients_are_summed_and_counted_once():
    mp.spawn(_reduction_worker, args=(free_port(),), nprocs=3, join=True)


# ---- end to end: examples/gpt.py on 3 gloo processes against the one-process reference ----

@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize(("replicas", "tied", "clip"), [((2, 1), True, None), ((1, 2), True, 0.05), ((2, 1), False, 0.05)],
                         ids=["tied-2x1", "tied-clipped-1x2", "clipped-2x1"])
def test_replicated_parity_with_ties_and_clipping(replicas, tied, clip, write_model, tmp_path):
    """The head tied to the token embedding, cut so that the tie spans stage 0 and stage 1 (cuts
    [0, 3, 7]); clipping at 0.05, far below the gradient norm, clips every step."""
    plan = _replicated_plan(replicas, [0, 3, 7], m=4)
    if tied:
        plan.model.file = str(write_model(TIED_GPT, "tied_gpt.py"))
    plan.training.grad_clip = clip
    check_parity(plan, tmp_path)


def _run(plan, out, steps: int, world: int | None = None, extra=()) -> tuple[list[float], dict]:
    """`python -m runtime` (`world` ranks, tests/ranks.py, or the reference): losses and parameters."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out.mkdir(parents=True, exist_ok=True)
    args = [str(plan), "--steps", str(steps), "--output", str(out / "m.json"), "--save-params", str(out / "p.pt"), *extra]
    if world is None:
        done = subprocess.run([sys.executable, "-m", "runtime", *args, "--reference"], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=240)
    else:
        done = run_ranks(world, args, ROOT, env)
    assert done.returncode == 0, done.stderr[-3000:]
    params: dict = {}
    for path in sorted(out.glob("p*.pt")):
        params.update(torch.load(path))
    return json.loads((out / "m.json").read_text())["losses"], params


def _assert_matches(losses, params, ref_losses, ref_params) -> None:
    assert losses == pytest.approx(ref_losses, rel=LOSS_RTOL)  # the parity tests' tolerances (module docstring)
    assert set(params) == set(ref_params)
    worst = max((params[k] - ref_params[k]).abs().max().item() for k in ref_params)
    assert worst < PARAM_ATOL, worst


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_replicated_checkpoint_resumes_replicated_and_as_a_plain_pipeline(tmp_path):
    """2 steps under stage replicas (2, 1) saved; 2 more resumed under the same plan, and 2 more
    resumed from a copy under a plain 1F1B pp2 plan of the same cuts: both are the reference's
    4 steps (Adam's moments and the data's step number resumed, not restarted)."""
    replicated = _replicated_plan((2, 1), [0, 3, 7], m=4).save(tmp_path / "rep.json")
    plain = make_plan(pp=2, m=4, mbs=2, cuts=[0, 3, 7]).save(tmp_path / "pp.json")
    ref_losses, ref_params = _run(replicated, tmp_path / "ref", 4)
    ck, copy = tmp_path / "ck", tmp_path / "ck-copy"
    first, _ = _run(replicated, tmp_path / "a", 2, 3, ("--checkpoint-dir", str(ck)))
    shutil.copytree(ck, copy)
    again, params = _run(replicated, tmp_path / "b", 2, 3, ("--checkpoint-dir", str(ck), "--resume"))
    _assert_matches(first + again, params, ref_losses, ref_params)
    plain_losses, plain_params = _run(plain, tmp_path / "c", 2, 2, ("--checkpoint-dir", str(copy), "--resume"))
    _assert_matches(first + plain_losses, plain_params, ref_losses, ref_params)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_plain_pipeline_checkpoint_resumes_replicated(tmp_path):
    """The other direction: 2 steps of plain pp2 saved, 2 more under stage replicas (1, 2)."""
    replicated = _replicated_plan((1, 2), [0, 3, 7], m=4).save(tmp_path / "rep.json")
    plain = make_plan(pp=2, m=4, mbs=2, cuts=[0, 3, 7]).save(tmp_path / "pp.json")
    ref_losses, ref_params = _run(plain, tmp_path / "ref", 4)
    ck = tmp_path / "ck"
    first, _ = _run(plain, tmp_path / "a", 2, 2, ("--checkpoint-dir", str(ck)))
    second, params = _run(replicated, tmp_path / "b", 2, 3, ("--checkpoint-dir", str(ck), "--resume"))
    _assert_matches(first + second, params, ref_losses, ref_params)
