"""Expert tensor parallelism (issue #14: "expert TP off unless pinned"): the plan field and its
checks, the cost (planner/cost/moe.py), and one-step gradients against one process
(runtime/apply_ep.py). The parity runs are in tests/test_runtime_ep.py `EP_CASES` (etp2-*).

Tolerances: the gradients compare at rtol 1e-5, as tests/test_runtime_ep.py's: each rank's
expert output is a sum over its half of the expert width, and the all-reduce adds the halves,
so the only difference from one process is float32 reassociation of those sums."""

from __future__ import annotations

import os
from typing import cast

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from pydantic import ValidationError
from torch.distributed.tensor import DTensor

from planner.cluster import make_cluster
from planner.cost.collectives import CollectiveModel, group_placement
from planner.cost.compute import ComputeModel
from planner.cost.moe import MoEShape, expert_time_ratio, expert_tp_all_reduce_bytes
from planner.errors import PlannerError
from planner.plan import Plan
from planner.profiler import profile_model
from planner.solver.costs import UnitCosts
from planner.solver.solve import Pins, ep_all_to_all, search, solve
from tests.conftest import EXAMPLES
from tests.ranks import free_port
from tests.test_runtime_ep import ETP_ARGS, MOE_TP, MOE_UNITS, moe_plan

# As tests/test_moe_cost.py: four layers of top-2-of-8 experts, on H100s.
MOE = dict(n_layers=4, d_model=256, n_heads=4, vocab_size=256, seq_len=128, num_experts=8, top_k=2, moe_d_ff=512)


@pytest.fixture(scope="module")
def moe_meta():
    return profile_model(str(EXAMPLES / "moe.py"), MOE, [1, 2], device="meta", gpu="h100-80gb", dtype="bfloat16")


# ---- cost ----

def _shape(tokens: float) -> MoEShape:
    d, f, e = 1024, 768, 64
    return MoEShape(tokens=tokens, top_k=8, num_experts=e, model_dim=d, flops_per_copy=2 * 3 * d * f,
                    expert_weight_bytes=3 * d * f * 2, copy_activation_bytes=(2 * d + 4 * f) * 2, dtype_bytes=2)


def test_expert_tp_divides_the_expert_gemms():
    flops, bandwidth = 700e12, 2.8e12
    # Compute-bound (many rows per expert): the time is divided by t exactly.
    assert expert_time_ratio(_shape(65536), 1, flops, bandwidth, expert_tp=2) == pytest.approx(0.5)
    assert expert_time_ratio(_shape(65536), 8, flops, bandwidth, expert_tp=2) == pytest.approx(0.5)
    # Weight-bound (8 rows per expert): the weights read shrink by t, the copies' input and output do not.
    shape = _shape(64)
    w, d, f, flop = shape.expert_weight_bytes, 1024, 768, shape.flops_per_copy
    by_hand = max(8 * flop / 2 / flops, (w / 2 + 8 * (2 * d + 4 * f / 2) * 2) / bandwidth) / \
        max(8 * flop / flops, (w + 8 * (2 * d + 4 * f) * 2) / bandwidth)
    assert expert_time_ratio(shape, 1, flops, bandwidth, expert_tp=2) == pytest.approx(by_hand)
    assert 0.5 < by_hand < 0.6
    # The imbalance is EP's busiest rank: without EP every copy is computed on every TP rank alike.
    assert expert_time_ratio(_shape(65536), 1, flops, bandwidth, 1.5, expert_tp=2) == pytest.approx(0.5)
    assert expert_tp_all_reduce_bytes(shape, 2) == 64 * 1024 * 2 and expert_tp_all_reduce_bytes(shape, 1) == 0.0


def _costs(profile, cluster, expert_tp: int) -> UnitCosts:
    coll = CollectiveModel(cluster)
    return UnitCosts(profile, ComputeModel(profile, cluster.gpu, "bfloat16"),
                     lambda t: coll.for_group(group_placement(cluster, t, 1)), "bfloat16",
                     ep_all_to_all_s=ep_all_to_all(cluster, coll), expert_tp=expert_tp)


@pytest.mark.parametrize("ep", [1, 2])
def test_expert_tp_table_by_hand(moe_meta, ep):
    """Experts' parameters and time / t, and 2 all-reduces of the layer's output per MoE layer and step."""
    cluster = make_cluster(8, 8, "h100-80gb")
    plain, split = _costs(moe_meta, cluster, 1).table(2, False, 1, ep), _costs(moe_meta, cluster, 2).table(2, False, 1, ep)
    experts = sum(layer.expert_parameters for u in moe_meta.units for layer in u.moe)
    assert plain.expert_parameters.sum() == pytest.approx(experts / ep)
    assert split.expert_parameters.sum() == pytest.approx(experts / ep / 2)
    assert split.parameters.sum() == pytest.approx(plain.parameters.sum() - experts / ep / 2)
    # The analytic profile's expert GEMMs at 128 tokens x top-2 / 8 experts = 32 rows: the roofline
    # says by how much t = 2 shortens them; at least 1/2 of them, at most all of it.
    assert 0.5 * plain.expert_forward_s.sum() <= split.expert_forward_s.sum() < plain.expert_forward_s.sum()
    gone = plain.expert_forward_s - split.expert_forward_s
    assert split.forward_s == pytest.approx(plain.forward_s - gone)
    # Communication: per MoE layer and step, the forward's and backward's all-reduce of T x d bf16.
    all_reduce = CollectiveModel(cluster).for_group(group_placement(cluster, 2, 1)).all_reduce_s(128 * 256 * 2)
    base_comm = plain.ep_comm_s if plain.ep_comm_s is not None else 0.0
    moe_units = [u.index for u in moe_meta.units if u.moe]
    assert split.ep_comm_s[moe_units] == pytest.approx(base_comm[moe_units] + 2 * all_reduce) if ep > 1 else \
        split.ep_comm_s[moe_units] == pytest.approx(2 * all_reduce)
    # Full recomputation replays the forward's all-reduce.
    base_rec = plain.recompute_ep_comm_s if plain.recompute_ep_comm_s is not None else 0.0
    assert (split.recompute_ep_comm_s - base_rec)[moe_units] == pytest.approx(all_reduce)


def test_expert_tp_is_planned_only_when_pinned(moe_meta):
    cluster = make_cluster(2, 2, "h100-80gb")
    plan = solve(moe_meta, cluster, 4, Pins(tp=2, expert_tp=2))
    assert plan.layout.expert_tp_degree == 2 and plan.layout.tp_degree == 2 and not plan.layout.sequence_parallel
    assert solve(moe_meta, cluster, 4, Pins(tp=2)).layout.expert_tp_degree == 1
    # With dp > 1 the search keeps ZeRO 0, the only stage the runtime runs expert TP with; every
    # alternative it lists is expert TP too.
    result = search(moe_meta, make_cluster(4, 4, "h100-80gb"), 8, Pins(tp=2, expert_tp=2))
    assert result.ranked and all(e.config.expert_tp == 2 and e.config.zero_stage == 0 for e in result.ranked)


def test_expert_tp_pins_are_checked(moe_meta):
    cluster = make_cluster(4, 4, "h100-80gb")
    with pytest.raises(PlannerError, match="--expert-tp 2 needs --tp 2"):
        solve(moe_meta, cluster, 8, Pins(expert_tp=2))
    with pytest.raises(PlannerError, match="--expert-tp 2 needs --tp 2"):
        solve(moe_meta, cluster, 8, Pins(expert_tp=2, tp=4))
    with pytest.raises(PlannerError, match="--expert-tp 2 needs --tp 2 and no --sequence-parallel"):
        solve(moe_meta, cluster, 8, Pins(expert_tp=2, tp=2, sequence_parallel=True))
    with pytest.raises(PlannerError, match="--expert-tp 2 runs with ZeRO 0 only"):
        solve(moe_meta, cluster, 8, Pins(expert_tp=2, tp=2, zero_stage=3))
    dense = profile_model(str(EXAMPLES / "llama.py"), {}, [1], device="meta", gpu="h100-80gb")
    with pytest.raises(PlannerError, match="--expert-tp 2: the model has no mixture-of-experts layer"):
        solve(dense, cluster, 8, Pins(expert_tp=2, tp=2))


# ---- plan and runtime checks ----

@pytest.mark.parametrize("layout,message", [
    (dict(tp=2, expert_tp=4, dp=2), "expert_tp_degree 4 must be 1 or tp_degree"),
    (dict(tp=2, expert_tp=2, sequence_parallel=True), "with sequence_parallel is not supported"),
])
def test_plan_refuses_other_expert_tp_degrees(layout, message):
    with pytest.raises(ValidationError, match=message):
        moe_plan(tp_plan=MOE_TP, args=ETP_ARGS, **layout)


def test_runtime_refuses_expert_tp_it_cannot_run():
    from planner.model_file import load_model_file
    from runtime.apply_ep import check_ep
    from runtime.build import build_meta_model

    def meta(plan: Plan):
        return build_meta_model(load_model_file(str(EXAMPLES / "moe.py"), plan.model.args))

    plan = moe_plan(tp=2, expert_tp=2, tp_plan=MOE_TP, args=ETP_ARGS, dp=2, zero=3)
    with pytest.raises(PlannerError, match="zero_stage 3 is not run"):
        check_ep(plan, meta(plan))
    plan = moe_plan(tp=2, expert_tp=2, tp_plan=MOE_TP, args={"shared_expert": True})  # expert width = model dim
    with pytest.raises(PlannerError, match="cannot tell the model dim from the expert width"):
        check_ep(plan, meta(plan))
    plan = moe_plan(tp=2, expert_tp=2, tp_plan=MOE_TP, args=ETP_ARGS)
    with pytest.raises(PlannerError, match="has no experts module"):
        check_ep(plan, torch.nn.Sequential(torch.nn.Linear(4, 4)))  # a model without experts


# ---- one-step gradients, spawned gloo ranks ----

def _gradient_worker(rank: int, world: int, port: int, ep: int) -> None:
    """One backward under tp 2 with expert TP 2 (and EP over dp = world / 2): every full gradient
    equals the one-process one, reduced as runtime/train.py `_reduce_gradients` reduces them."""
    from planner.model_file import load_model_file
    from runtime.apply_dp import average_gradients
    from runtime.apply_ep import apply_ep, expert_parameters
    from runtime.apply_tp import apply_tp, sum_partial_gradients
    from runtime.build import build_meta_model, materialize
    from runtime.grad_clip import clip_grad_norm
    from runtime.mesh import build_ep_mesh, build_mesh

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        dp = world // 2
        plan = moe_plan(ep=ep, dp=dp, tp=2, expert_tp=2, tp_plan=MOE_TP, args=ETP_ARGS)
        mf = load_model_file(str(EXAMPLES / "moe.py"), plan.model.args)
        mesh = build_mesh(plan, "cpu")
        ep_mesh = build_ep_mesh(mesh, ep)
        cpu = torch.device("cpu")
        reference = materialize(build_meta_model(mf), 0, cpu, "per-module", mf)
        model = materialize(build_meta_model(mf), 0, cpu, "per-module", mf)
        apply_tp(model, mesh["tp"], plan.stages[0].tp_plan, False, MOE_UNITS)
        apply_ep(model, ep_mesh["ep", "tp"] if ep_mesh is not None else mesh["tp",], expert_tp=True)
        experts = cast(DTensor, model.get_parameter("layers.0.moe.experts.gate_up_proj"))
        assert experts.to_local().shape == (4 // ep, 2 * 48 // 2, 32)  # E / ep experts, F / 2 of each half
        torch.manual_seed(1)
        tokens, targets = mf.make_batch(2 * dp)
        mf.loss(reference(tokens), targets).backward()
        mine = slice(2 * (rank // 2), 2 * (rank // 2) + 2)  # pp = 1: the dp index is rank // tp
        mf.loss(model(tokens[mine]), targets[mine]).backward()
        average_gradients([model], mesh["dp"].get_group(), expert_parameters([model]),
                          ep_mesh["edp"].get_group() if ep_mesh is not None else None)
        sum_partial_gradients([model], mesh["tp"].get_group())
        for name, p in model.named_parameters():
            assert p.grad is not None, name
            grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            torch.testing.assert_close(grad, reference.get_parameter(name).grad, rtol=1e-5, atol=1e-7, msg=name)
            value = p.full_tensor() if hasattr(p, "full_tensor") else p
            assert torch.equal(value, reference.get_parameter(name)), name  # the blocks are the reference's
        # Clipping's global norm counts every expert block once.
        norm = clip_grad_norm([model], max_norm=1e9)
        torch.testing.assert_close(norm, torch.nn.utils.get_total_norm([p.grad for p in reference.parameters() if p.grad is not None]))
    finally:
        dist.destroy_process_group()
    os._exit(0)  # as tests/test_runtime_ep.py's workers: gloo aborts in the interpreter's teardown now and then


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("world,ep", [(2, 1), (4, 2)])
def test_expert_tp_gradients_equal_the_one_process_gradients(world, ep):
    mp.spawn(_gradient_worker, args=(world, free_port(), ep), nprocs=world, join=True)


# ---- checkpoints: what runtime/checkpoint.py saves, through apply_ep's strided helpers ----

def _checkpoint_worker(rank: int, world: int, port: int, folder: str) -> None:
    """Expert TP 2 over tp 2 saves model and AdamW state after a step; a replicated (expert TP 1)
    model and optimizer load it, and the reverse: every value arrives whole, and each TP rank
    gets its own blocks back (apply_ep `strided_as_whole` / `load_strided_blocks`)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

    from planner.model_file import load_model_file
    from runtime.apply_ep import apply_ep, load_strided_blocks, strided_as_whole
    from runtime.apply_tp import apply_tp
    from runtime.build import build_meta_model, materialize
    from runtime.mesh import build_mesh

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    options = StateDictOptions(flatten_optimizer_state_dict=True)
    try:
        plan = moe_plan(tp=2, expert_tp=2, tp_plan=MOE_TP, args=ETP_ARGS)
        mf = load_model_file(str(EXAMPLES / "moe.py"), plan.model.args)
        mesh = build_mesh(plan, "cpu")
        cpu = torch.device("cpu")

        def trained(expert_tp: bool, seed: int):
            model = materialize(build_meta_model(mf), seed, cpu, "per-module", mf)
            if expert_tp:
                apply_tp(model, mesh["tp"], plan.stages[0].tp_plan, False, MOE_UNITS)
                apply_ep(model, mesh["tp",], expert_tp=True)
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
            torch.manual_seed(seed)
            tokens, targets = mf.make_batch(2)
            mf.loss(model(tokens), targets).backward()
            optimizer.step()
            return model, optimizer

        def states(model, optimizer) -> dict[str, dict]:
            model_sd, optim_sd = get_state_dict(model, optimizer, options=options)
            return {"model": dict(model_sd), "optim": dict(optim_sd)}

        def whole(state: dict) -> dict:
            return {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in state.items()}

        for source_etp, target_etp in ((True, False), (False, True)):
            model, optimizer = trained(source_etp, 0)
            saved = states(model, optimizer)
            path = f"{folder}/{int(source_etp)}"
            dcp.save(strided_as_whole(saved), checkpoint_id=path)
            other, other_optimizer = trained(target_etp, 1)  # other values, overwritten by the load
            state = states(other, other_optimizer)
            loaded = strided_as_whole(state)
            dcp.load(loaded, checkpoint_id=path)
            load_strided_blocks(loaded, state)
            set_state_dict(other, other_optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                           options=options)
            after = states(other, other_optimizer)
            for part in ("model", "optim"):
                want, got = whole(saved[part]), whole(after[part])
                assert set(want) == set(got)
                for key, value in want.items():
                    same = torch.equal(got[key], value) if isinstance(value, torch.Tensor) else got[key] == value
                    assert same, (part, key)
    finally:
        dist.destroy_process_group()
    os._exit(0)  # as the workers above


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_expert_tp_checkpoint_loads_without_expert_tp_and_back(tmp_path):
    mp.spawn(_checkpoint_worker, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_solver_expert_tp_plan_runs_with_parity(tmp_path):
    # The plan `planner solve --tp 2 --expert-tp 2` writes runs, with the one-process losses and parameters.
    from tests.test_runtime_ep import MOE_ARGS
    from tests.test_runtime_parity import check_parity

    profile = profile_model(str(EXAMPLES / "moe.py"), {**MOE_ARGS, **ETP_ARGS}, [1, 2], device="cpu", repeats=2)
    plan = solve(profile, make_cluster(2, gpu="cpu"), 4, Pins(tp=2, expert_tp=2, pp=1))
    assert plan.layout.expert_tp_degree == 2 and plan.stages[0].tp_plan
    check_parity(plan, tmp_path)
