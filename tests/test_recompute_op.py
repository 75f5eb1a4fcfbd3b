"""Op-level selective recomputation (torchtitan's selective_ac_option "op", issue #13 item 4):
the policy the runtime applies, the price the cost model gives it, and parity under plans."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from planner.model_file import load_model_file
from planner.profiler import profile_model
from runtime.recompute import MATMULS, SAVED, op_policy_fn
from tests.conftest import EXAMPLES
from tests.runtime_plans import GPT_ARGS, make_plan
from tests.test_runtime_parity import check_parity


def _block():
    mf = load_model_file(str(EXAMPLES / "gpt.py"), GPT_ARGS)
    torch.manual_seed(0)
    model = mf.build_model()
    return model.blocks[0], torch.randn(2, GPT_ARGS["seq_len"], GPT_ARGS["d_model"], requires_grad=True)


def test_the_policy_saves_attention_and_every_other_matmul():
    block, x = _block()
    decisions: list[tuple[str, CheckpointPolicy]] = []
    policy = op_policy_fn()

    def spy(ctx, func, *args, **kwargs):
        decision = policy(ctx, func, *args, **kwargs)
        if not ctx.is_recompute:
            decisions.append((str(func), decision))
        return decision

    out = checkpoint(block, x, use_reentrant=False, context_fn=lambda: create_selective_checkpoint_contexts(spy))
    out.sum().backward()
    matmuls = [d for f, d in decisions if f in {str(m) for m in MATMULS}]
    assert len(matmuls) == 6  # a GPT block's q, k, v, o and two MLP linears
    assert matmuls == [CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_RECOMPUTE] * 3
    assert any(f in {str(s) for s in SAVED} and d == CheckpointPolicy.MUST_SAVE for f, d in decisions)
    others = [d for f, d in decisions if f not in {str(m) for m in MATMULS | SAVED}]
    assert others and all(d == CheckpointPolicy.PREFER_RECOMPUTE for d in others)


def test_the_policy_leaves_the_gradients_unchanged():
    block, x = _block()
    plain = torch.autograd.grad(block(x).square().sum(), [x, *block.parameters()])
    recomputed = torch.autograd.grad(
        checkpoint(block, x, use_reentrant=False,
                   context_fn=lambda: create_selective_checkpoint_contexts(op_policy_fn())).square().sum(),
        [x, *block.parameters()])
    for a, b in zip(plain, recomputed, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)  # the same kernels on the same inputs


@pytest.fixture(scope="module")
def gpt_table():
    from planner.cluster import make_cluster
    from planner.cost.collectives import CollectiveModel, group_placement
    from planner.cost.compute import ComputeModel
    from planner.solver.costs import UnitCosts

    args = dict(n_layers=2, d_model=1024, n_heads=16, d_ff=4096, vocab_size=32000, seq_len=2048)
    profile = profile_model(str(EXAMPLES / "gpt.py"), args, [1], device="meta", gpu="h100-80gb", dtype="bfloat16")
    cluster = make_cluster(8, 8, "h100-80gb")
    coll = CollectiveModel(cluster)
    costs = UnitCosts(profile, ComputeModel(profile, cluster.gpu, "bfloat16"),
                      lambda t: coll.for_group(group_placement(cluster, t, 1)), "bfloat16")
    return profile, costs


def test_op_is_priced_between_the_attention_core_and_the_whole_unit(gpt_table):
    profile, costs = gpt_table
    table = costs.table(1, False, 1)
    block = next(u.index for u in profile.units if u.name == "blocks.0")
    act, rec = {m: table.activations[m][block] for m in table.activations}, {m: table.recompute_s[m][block] for m in table.recompute_s}
    assert act["full"] < act["op"] < act["none"]
    assert rec["selective"] < rec["op"] < rec["full"]
    # Stored: the block's input, the outputs of the 1st, 3rd, 5th linears and of attention (bf16).
    unit = profile.units[block]
    linears = [op for op in unit.ops if op.kind == "linear"]
    kept = linears[0::2] + [op for op in unit.ops if op.kind == "attention"]
    expected = unit.costs[1].input_bytes + sum(math.prod(op.output_shape) * 2 for op in kept)
    assert act["op"] == pytest.approx(expected)
    # Transient: what it does not keep, rebuilt in its backward.
    assert table.transient["op"][block] == pytest.approx(act["none"] - act["op"])


def test_op_under_tensor_parallelism_keeps_sharded_outputs_sharded(gpt_table):
    _, costs = gpt_table
    one, two = costs.table(1, False, 1), costs.table(2, False, 1)
    block = 1
    assert two.activations["op"][block] < one.activations["op"][block]


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("layout", [dict(pp=2, recompute="op"), dict(dp=2, tp=2, recompute="op", model="llama")],
                         ids=["pp2-op", "dp2xtp2-op-llama"])
def test_op_recompute_parity(layout, tmp_path):
    from tests.runtime_plans import LLAMA_TP

    if layout.get("model") == "llama":
        layout = {**layout, "tp_plan": LLAMA_TP}
    check_parity(make_plan(**layout), tmp_path)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_stage_mixing_op_with_the_other_modes(tmp_path):
    plan = make_plan(pp=2, m=2)
    first = plan.stages[0]
    first.unit_recompute = {first.units[1]: "op", first.units[2]: "full", first.units[3]: "selective"}
    plan.stages[1].unit_recompute = {plan.stages[1].units[0]: "op"}
    check_parity(plan, tmp_path)
