"""Hybrid sharding (HSDP) and CPU offload: plan validation, parity with the one-process reference,
and a checkpoint saved under HSDP resumed under plain ZeRO-3.

Tolerances: those of tests/test_runtime_parity.py (losses 1e-5 relative, parameters 1e-4
absolute after 3 AdamW steps at lr 1e-3), for the same reason: HSDP only reorders the sum of
the gradient (a reduce-scatter over the shard group, then an all-reduce of the shard over the
replicas, each divided by its group's size) against the reference's one backward over the
whole batch, float32 rounding of ~1e-7 relative that AdamW's division by sqrt(v) can amplify
to ~1e-4 on parameters whose gradient is near zero. A wrong HSDP mesh (gradients averaged over
the shard group only, or summed twice across replicas) changes the first update by a factor
of 2 and misses by orders of magnitude more. On CPU processes offload moves nothing (every
tensor is already in host memory; runtime/apply_dp.py), so its parity checks the wiring:
`CPUOffloadPolicy` on every `fully_shard`, the optimizer stepping the offloaded shards.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from planner.errors import PlannerError
from planner.plan import Plan, parse_plan
from tests.conftest import EXAMPLES
from tests.ranks import free_port
from tests.runtime_plans import GPT_UNITS, make_plan
from tests.test_runtime_checkpoint import check_resume_matches_reference
from tests.test_runtime_parity import check_parity

MAX_NORM = 0.05
"""Far below a fresh model's gradient norm (~1): every step clips (tests/test_runtime_clip.py)."""


def sharded(plan: Plan, shard_degree: int | None = None, offload: str = "none", grad_clip: float | None = None) -> Plan:
    """`plan` with hybrid sharding / offload / clipping set, validated again as a plan file is."""
    data = plan.model_dump()
    data["layout"]["shard_degree"] = shard_degree
    data["training"].update(offload=offload, grad_clip=grad_clip)
    return parse_plan(data)


# --- plan validation (fast) ---------------------------------------------------------------

@pytest.mark.parametrize("layout,training,message", [
    (dict(dp=4, zero=0), dict(shard_degree=2), "shard_degree 2 needs zero_stage >= 1"),
    (dict(dp=4, zero=3), dict(shard_degree=3), "shard_degree 3 must be at least 2 and divide dp_degree 4"),
    (dict(dp=4, zero=3), dict(shard_degree=1), "shard_degree 1 must be at least 2"),
    (dict(dp=2, zero=0), dict(offload="cpu"), "offload 'cpu' needs zero_stage >= 1"),
])
def test_sharding_plans_are_refused_with_the_reason(layout, training, message):
    with pytest.raises(PlannerError, match=message):
        sharded(make_plan(**layout), **training)


def test_hsdp_with_expert_parallelism_is_refused():
    data = make_plan(dp=4, zero=3).model_dump()
    data["layout"].update(ep_degree=2, shard_degree=2)
    with pytest.raises(PlannerError, match="shard_degree 2 with ep_degree 2 is not supported"):
        parse_plan(data)


def test_shard_degree_equal_to_dp_is_plain_sharding_and_zero_is_a_schema_error():
    assert sharded(make_plan(dp=4, zero=3), shard_degree=4).layout.shard_degree == 4  # accepted: one shard group
    data = make_plan(dp=4, zero=3).model_dump()
    data["layout"]["shard_degree"] = 0
    with pytest.raises(PlannerError, match="layout.shard_degree"):
        parse_plan(data)


def test_unknown_offload_target_is_a_schema_error():
    data = make_plan(dp=2, zero=3).model_dump()
    data["training"]["offload"] = "nvme"
    with pytest.raises(PlannerError, match="training.offload"):
        parse_plan(data)


# --- parity on gloo CPU processes (slow) --------------------------------------------------

CASES = {
    # dp 4 = 2 replicas x 2 shards: ranks {0,1} and {2,3} each shard, {0,2} and {1,3} replicate.
    "hsdp-2x2-zero3": dict(plan=dict(dp=4, zero=3), shard_degree=2),
    # ZeRO-2 reduce-scatters each micro-batch's gradient (runtime/train.py), so both micro-batches
    # go through the reduce-scatter + all-reduce pair.
    "hsdp-2x2-zero2-m2": dict(plan=dict(dp=4, zero=2, m=2), shard_degree=2),
    # The global norm of (Replicate, Shard(0)) DTensor gradients (runtime/grad_clip.py).
    "hsdp-2x2-zero3-clipped": dict(plan=dict(dp=4, zero=3), shard_degree=2, grad_clip=MAX_NORM),
    "offload-zero3-dp2": dict(plan=dict(dp=2, zero=3), offload="cpu"),
    "hsdp-2x2-zero3-offload": dict(plan=dict(dp=4, zero=3), shard_degree=2, offload="cpu"),
    # One dp rank: FSDP2 is applied for the offload alone (runtime/train.py).
    "offload-zero3-dp1": dict(plan=dict(dp=1, zero=3), offload="cpu"),
}


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", sorted(CASES))
def test_parity(case, tmp_path):
    spec = dict(CASES[case])
    check_parity(sharded(make_plan(**spec.pop("plan")), **spec), tmp_path)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_checkpoint_saved_under_hsdp_resumes_under_plain_zero3(tmp_path):
    """DCP saves the (Replicate, Shard(0)) DTensors once per shard and reshards on load: 3 steps
    under HSDP 2x2 then 3 under plain ZeRO-3 over 2 ranks give the reference's 6 losses."""
    hsdp = sharded(make_plan(dp=4, zero=3), shard_degree=2)
    check_resume_matches_reference(hsdp, make_plan(dp=2, zero=3, m=4), tmp_path)


# --- the mesh and policy really applied (parity alone would pass a silent fallback) -------

def _placement_worker(rank: int, world: int, port: int) -> None:
    """dp 4 = 2 replicas x 2 shards with offload: every parameter is a DTensor on the 2D
    (dp_replicate, dp_shard) mesh placed (Replicate, Shard(0)), rank r shards with r xor 1 and
    replicates with r xor 2, and every FSDP parameter carries the CPU offload."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import Replicate, Shard

    from planner.model_file import load_model_file
    from runtime.apply_dp import apply_fsdp
    from runtime.build import build_meta_model, materialize
    from runtime.mesh import build_fsdp_mesh, build_mesh

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        plan = sharded(make_plan(dp=world, zero=3), shard_degree=2, offload="cpu")
        mf = load_model_file(str(EXAMPLES / "gpt.py"), plan.model.args)
        mesh = build_fsdp_mesh(build_mesh(plan, "cpu"), plan.layout.shard_degree)
        assert mesh.mesh_dim_names == ("dp_replicate", "dp_shard") and tuple(mesh.shape) == (2, 2)
        assert sorted(dist.get_process_group_ranks(mesh["dp_shard"].get_group())) == sorted({rank, rank ^ 1})
        assert sorted(dist.get_process_group_ranks(mesh["dp_replicate"].get_group())) == sorted({rank, rank ^ 2})
        model = materialize(build_meta_model(mf), 0, torch.device("cpu"), "per-module", mf)
        apply_fsdp(model, mesh, GPT_UNITS, 3, offload=plan.training.offload)
        for name, p in model.named_parameters():
            assert p.device_mesh == mesh and p.placements == (Replicate(), Shard(0)), name
        # FSDP2 keeps the policy per parameter group (private state: no public accessor).
        groups = [m._get_fsdp_state()._fsdp_param_group for m in model.modules() if isinstance(m, FSDPModule)]
        params = [fp for g in groups if g is not None for fp in g.fsdp_params]
        assert params and all(fp.offload_to_cpu and not fp.pin_memory for fp in params)
    finally:
        dist.destroy_process_group()
    os._exit(0)  # as tests/test_runtime_ep.py: no interpreter teardown under gloo


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_hsdp_mesh_placements_and_offload_policy_are_applied():
    mp.spawn(_placement_worker, args=(4, free_port()), nprocs=4, join=True)
