"""Parity for tensor parallelism beyond test_runtime_parity.py: sequence parallelism, pipeline
activations sent as tensor-parallel slices, and a Hugging Face model (examples/hf_llama.py)
sharded unchanged.

Same harness and tolerances as test_runtime_parity.py (float32; TP and SP only reorder sums:
the row-parallel all-reduce or reduce-scatter adds two partial products, and the norms'
weight gradients are summed over sequence chunks, each ~1e-7 relative).
"""

from __future__ import annotations

import pytest

from tests.runtime_plans import GPT_TP, LLAMA_TP, make_plan, megatron_tp_plan
from tests.test_runtime_parity import check_parity

HF_ARGS = dict(n_layers=2, d_model=32, n_heads=4, n_kv_heads=2, d_ff=64, vocab_size=64, seq_len=16)
HF_UNITS = ["model.embed_tokens", "model.rotary_emb", "model.layers.0", "model.layers.1", "model.norm", "lm_head"]
HF_TP = {**megatron_tp_plan("model.layers", 2, ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                            ("mlp.gate_proj", "mlp.up_proj"), "mlp.down_proj", "self_attn.o_proj"), "lm_head": "colwise"}
HF = dict(model="hf_llama", args=HF_ARGS, units=HF_UNITS)
# The final norm styled explicitly: it joins the SP region, so the head's input is gathered after it.
GPT_TP_SP_NORM = {**GPT_TP, "norm": "sequence_parallel"}

CASES = {
    "tp2-hf_llama": dict(**HF, tp=2, tp_plan=HF_TP),
    "tp2-sp-gpt": dict(tp=2, tp_plan=GPT_TP, sp=True),
    "tp2-sp-gpt-norm-styled": dict(tp=2, tp_plan=GPT_TP_SP_NORM, sp=True),
    "tp2-sp-llama": dict(model="llama", tp=2, tp_plan=LLAMA_TP, sp=True),
    "tp2-sp-hf_llama": dict(**HF, tp=2, tp_plan=HF_TP, sp=True),
    "dp2xtp2-sp-zero3": dict(dp=2, tp=2, zero=3, tp_plan=GPT_TP, sp=True),
    "pp2xtp2-sp": dict(pp=2, tp=2, m=2, tp_plan=GPT_TP, sp=True),
    "tp2-sp-recompute-full": dict(tp=2, tp_plan=GPT_TP, sp=True, recompute="full"),
    # Activations cross the cut as 1/tp slices and are all-gathered (runtime/pp_scatter.py); the
    # Hugging Face cut also carries the rotary cos/sin, sliced the same way.
    "pp2xtp2-scatter-gather": dict(pp=2, tp=2, m=2, tp_plan=GPT_TP, sg=True),
    "pp2xtp2-scatter-gather-hf_llama": dict(**HF, pp=2, tp=2, m=2, cuts=[0, 3, 6], tp_plan=HF_TP, sg=True),
}


def _plan(sp: bool = False, sg: bool = False, **kwargs):
    plan = make_plan(**kwargs)
    plan.layout.sequence_parallel = sp
    plan.layout.p2p_scatter_gather = sg
    return plan


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_tp_parity(case, tmp_path):
    check_parity(_plan(**CASES[case]), tmp_path)


@pytest.mark.parametrize("edit,message", [
    (lambda p: p.stages[0].tp_plan.update({"head.": "colwise"}), "'head.' is not a module of the model"),
    (lambda p: p.stages[0].tp_plan.update({"blocks.0.ln1": "colwise"}), "is a LayerNorm; colwise shards nn.Linear"),
    (lambda p: p.stages[0].tp_plan.update({"norm": "sequence_parallel"}), "layout.sequence_parallel is false"),
])
def test_unrunnable_tp_plan_is_refused_before_launch(tmp_path, edit, message):
    from planner.errors import PlannerError
    from runtime.launch import precheck

    plan = make_plan(tp=2, tp_plan=GPT_TP)
    edit(plan)
    with pytest.raises(PlannerError, match="tp_plan does not fit the model") as info:
        precheck(str(plan.save(tmp_path / "plan.json")), None)
    assert message in str(info.value)


def test_pp_stage_tp_plan_outside_its_units_is_refused(tmp_path):
    from planner.errors import PlannerError
    from runtime.launch import precheck

    plan = make_plan(pp=2, tp=2, tp_plan=GPT_TP)
    plan.stages[0].tp_plan["head"] = "colwise"  # head belongs to stage 1
    with pytest.raises(PlannerError, match="outside the stage's units"):
        precheck(str(plan.save(tmp_path / "plan.json")), None)


@pytest.mark.slow
def test_hf_llama_pp2xtp2_sp_parity(tmp_path):
    # Everything at once on a third-party model: a pipeline cut crossed by the rotary cos/sin
    # as well as the hidden state, TP with its attention taking `hidden_states=` by keyword,
    # and sequence-parallel norms (HF's LlamaRMSNorm has no reset_parameters: `full` init).
    check_parity(_plan(**HF, pp=2, tp=2, m=2, cuts=[0, 3, 6], tp_plan=HF_TP, sp=True), tmp_path)
