"""MoE layers in the profile: recognised by structure (planner/moe.py), counted under balanced
routing (planner/profiler/moe.py), checked against each model's own numbers and hand formulas."""

from __future__ import annotations

import json

import pytest
from conftest import EXAMPLES

from planner.profile_schema import load_profile
from planner.profiler import profile_model

MOE = str(EXAMPLES / "moe.py")
# examples/moe.py's defaults (build_model): d_model 32, 8 experts, top-2, moe_d_ff 32, seq_len 16.
MIXTRAL_LIKE = dict(n_layers=2, d_model=32, num_experts=8, top_k=2, moe_d_ff=32)
FINE_SHARED = dict(MIXTRAL_LIKE, granularity=2, shared_expert=True)  # 16 experts of width 16, top-4
SEQ_LEN = 16


def _expect(args: dict) -> dict:
    """The MoE layer examples/moe.py builds for `args`, by its docstring's arithmetic."""
    g = args.get("granularity", 1)
    return dict(num_experts=args["num_experts"] * g, top_k=args["top_k"] * g, model_dim=args["d_model"],
                expert_hidden_dim=args["moe_d_ff"] // g)


def _swiglu_forward_flops(d: int, f: int, tokens: int, k: int) -> int:
    """Three d x f matmuls (gate, up, down) per token copy, 2 FLOPs per multiply-add."""
    return 2 * 3 * d * f * tokens * k


@pytest.fixture(scope="module", params=["meta", "cpu"])
def profiles(request):
    kw = dict(device=request.param, gpu="h100-80gb") if request.param == "meta" else dict(device="cpu", repeats=2, warmup=1)
    return request.param, {name: (args, profile_model(MOE, args, [1, 2], **kw))
                           for name, args in (("mixtral", MIXTRAL_LIKE), ("fine_shared", FINE_SHARED))}


@pytest.mark.parametrize("variant", ["mixtral", "fine_shared"])
def test_examples_moe_layers_recorded(profiles, variant):
    mode, found = profiles
    args, profile = found[variant]
    expect = _expect(args)
    moe_units = [u for u in profile.units if u.moe]
    assert [u.name for u in moe_units] == ["layers.0", "layers.1"]
    assert all(u.moe == [] for u in profile.units if not u.name.startswith("layers."))
    d, f, e, k = expect["model_dim"], expect["expert_hidden_dim"], expect["num_experts"], expect["top_k"]
    for unit in moe_units:
        (layer,) = unit.moe
        assert (layer.experts, layer.router) == ("moe.experts", "moe.router")
        assert layer.shared_experts == (["moe.shared_expert"] if args.get("shared_expert") else [])
        assert {key: getattr(layer, key) for key in expect} == expect
        # gate_up [E, 2F, D] and down [E, D, F]: 3*D*F per expert, float32.
        assert layer.expert_parameters == 3 * d * f * e
        assert layer.expert_parameter_bytes == layer.expert_trainable_parameter_bytes == 4 * layer.expert_parameters
        assert layer.expert_parameters < unit.num_parameters  # the unit's total still holds them, and more
        for b, costs in layer.costs.items():
            tokens = b * SEQ_LEN
            assert costs.tokens == tokens
            # Exact: FlopCounterMode counts the same matmuls the formula does, whatever the routing.
            assert costs.expert_forward_flops == _swiglu_forward_flops(d, f, tokens, k)
            assert costs.expert_backward_flops == 2 * costs.expert_forward_flops  # input and weight gradients
            assert costs.dispatch_bytes == tokens * k * d * 4
            assert costs.expert_forward_flops < unit.costs[b].forward_flops
            assert 0 < costs.expert_forward_time_s and 0 < costs.expert_backward_time_s
            assert costs.expert_saved_bytes > 0
        if mode == "cpu":
            # A fresh router's real routing: max copies over the mean, at least 1, at most E/k
            # (every copy of every token to one expert: at most one copy per token per expert).
            assert 1.0 <= layer.routing_spread <= e / k
        else:
            assert layer.routing_spread is None
            assert layer.costs[1].expert_forward_time_s <= unit.costs[1].forward_time_s


def test_dense_model_has_no_moe():
    profile = profile_model(str(EXAMPLES / "gpt.py"), {"n_layers": 2}, [1], device="meta", gpu="h100-80gb")
    assert profile.units and all(u.moe == [] for u in profile.units)


def test_moe_record_survives_save_and_load(tmp_path):
    profile = profile_model(MOE, FINE_SHARED, [1, 2], device="meta", gpu="h100-80gb")
    loaded = load_profile(profile.save(tmp_path / "profile.json"))
    assert [u.moe for u in loaded.units] == [u.moe for u in profile.units] and loaded.units[1].moe
    # A profile written before MoE layers were recorded reads as dense.
    data = json.loads((tmp_path / "profile.json").read_text())
    for unit in data["units"]:
        del unit["moe"]
    (tmp_path / "old.json").write_text(json.dumps(data))
    assert all(u.moe == [] for u in load_profile(tmp_path / "old.json").units)


# tests/test_hf_models.py's small Qwen3-MoE: the shipped config shrunk to 2 layers of width 64.
QWEN3_MOE = dict(config=str(EXAMPLES / "hf" / "qwen3-30b-a3b.json"), seq_len=32, num_hidden_layers=2, hidden_size=64,
                 intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, vocab_size=256, head_dim=16,
                 num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)


def test_hugging_face_qwen3_moe_on_meta():
    pytest.importorskip("transformers")
    import planner.hf_config_model as hf

    args = QWEN3_MOE
    profile = profile_model(hf.__file__, args, [1, 2], device="meta", gpu="h100-80gb")
    moe_units = [u for u in profile.units if u.moe]
    assert [u.name for u in moe_units] == ["model.layers.0", "model.layers.1"]
    d, f, e, k = args["hidden_size"], args["moe_intermediate_size"], args["num_experts"], args["num_experts_per_tok"]
    for unit in moe_units:
        (layer,) = unit.moe
        assert (layer.experts, layer.router, layer.shared_experts) == ("mlp.experts", "mlp.gate", [])
        assert (layer.num_experts, layer.top_k, layer.model_dim, layer.expert_hidden_dim) == (e, k, d, f)
        assert layer.expert_parameters == 3 * d * f * e
        for b, costs in layer.costs.items():
            tokens = b * args["seq_len"]
            # Hugging Face's grouped-GEMM experts (torch._grouped_mm), counted by our formula.
            assert costs.expert_forward_flops == _swiglu_forward_flops(d, f, tokens, k)
            assert costs.expert_backward_flops == 2 * costs.expert_forward_flops
            assert costs.dispatch_bytes == tokens * k * d * 4


SMALL_HF = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4, vocab_size=256)
OTHER_HF_MOE = {
    # class name: (config fields, (experts, top-k, expert width), shared experts)
    "MixtralConfig": (dict(num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, intermediate_size=48),
                      (4, 2, 48), []),
    "Qwen2MoeConfig": (dict(num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                            shared_expert_intermediate_size=48), (4, 2, 32), ["mlp.shared_expert"]),
    "DeepseekV3Config": (dict(num_key_value_heads=4, first_k_dense_replace=1, moe_intermediate_size=32, n_routed_experts=8,
                              num_experts_per_tok=2, n_shared_experts=1, n_group=1, topk_group=1, q_lora_rank=None,
                              kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16),
                         (8, 2, 32), ["mlp.shared_experts"]),
}


@pytest.mark.parametrize("config_class", sorted(OTHER_HF_MOE))
def test_other_hugging_face_moe_models_on_meta(config_class, tmp_path):
    """Unmodified Mixtral, Qwen2-MoE (a gated shared expert) and DeepSeek-V3 (a dense first
    layer, shared experts), each from a small config."""
    transformers = pytest.importorskip("transformers")
    import planner.hf_config_model as hf

    fields, (e, k, f), shared = OTHER_HF_MOE[config_class]
    config = getattr(transformers, config_class)(**{**SMALL_HF, **fields})
    (tmp_path / "config.json").write_text(config.to_json_string())
    profile = profile_model(hf.__file__, {"config": str(tmp_path / "config.json"), "seq_len": 8}, [1], device="meta",
                            gpu="h100-80gb")
    layers = [layer for u in profile.units for layer in u.moe]
    assert len(layers) == 2 - fields.get("first_k_dense_replace", 0)
    for layer in layers:
        assert (layer.num_experts, layer.top_k, layer.model_dim, layer.expert_hidden_dim) == (e, k, 64, f)
        assert (layer.experts, layer.router, layer.shared_experts) == ("mlp.experts", "mlp.gate", shared)
        assert layer.costs[1].expert_forward_flops == _swiglu_forward_flops(64, f, 8, k)


def test_recognised_by_data_flow_not_names():
    """A layer whose parts have no telling names: a norm and a dense MLP before the experts (not
    shared experts: upstream of them), a gate scaling the shared expert (1 wide: not one), the
    router a bare Linear, the always-on MLP added after."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    from planner.model_file import load_model_file
    from planner.moe import recognise_moe

    moe = load_model_file(MOE, {}).module  # examples/moe.py's classes, reused under other names
    d, e, k = 16, 4, 2

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.RMSNorm(d)
            self.b = moe.SwiGLU(d, 8)
            self.c = nn.Linear(d, e, bias=False)
            self.x = moe.Experts(e, d, 8)
            self.y = moe.SwiGLU(d, 8)
            self.z = nn.Linear(d, 1)

        def forward(self, h):
            h = self.b(self.a(h))
            weights, index = torch.topk(F.softmax(self.c(h), dim=-1), k)
            return self.x(h, index, weights) + torch.sigmoid(self.z(h)) * self.y(h)

    (found,) = recognise_moe(Layer(), (torch.randn(6, d),), {})
    assert (found.experts, found.router, found.shared_experts) == ("x", "c", ["y"])
    assert (found.call.tokens, found.call.top_k, found.call.model_dim) == (6, k, d)


EAGER_QWEN3_MOE = """
    import torch
    import torch.nn.functional as F
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    def build_model():
        config = Qwen3MoeConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                num_key_value_heads=2, vocab_size=256, head_dim=16, num_experts=16,
                                num_experts_per_tok=2, moe_intermediate_size=32, use_cache=False)
        config._experts_implementation = "eager"  # a loop over the experts the routing hits
        return Qwen3MoeForCausalLM(config)

    def make_batch(batch_size):
        ids = torch.randint(0, 256, (batch_size, 8))
        return ids, ids

    def loss_fn(out, targets):
        return F.cross_entropy(out.logits.flatten(0, 1), targets.flatten())
"""


def test_analytic_moe_units_do_not_depend_on_the_sampled_draw(write_model):
    """On the meta device a router's logits are a sampled draw (planner/meta_values.py), so the
    routing was one too, and an experts loop over the experts it hits cost what that draw hit.
    An analytic profile now counts its units with every experts module routing evenly
    (planner/profiler/moe.py `balanced_experts`), as the experts' own records are: profiles
    drawn from different seeds give the same units (8 tokens x 2 copies: one per expert)."""
    pytest.importorskip("transformers")
    path = write_model(EAGER_QWEN3_MOE)
    profiles = [profile_model(str(path), {}, [1], device="meta", gpu="h100-80gb", seed=seed) for seed in (0, 1, 2)]
    dumps = [[u.model_dump() for u in p.units] for p in profiles]
    assert dumps[0] == dumps[1] == dumps[2]
    assert [len(u.moe) for u in profiles[0].units[2:4]] == [1, 1]
