"""Frozen parameters (issue #16): a LoRA model (examples/hf_lora.py, peft on an unmodified
Hugging Face Llama) trains only its adapters, under every plan as in one process.

Frozen weights (requires_grad=False as the model file builds them) get no optimizer state,
no gradient reduction and no clipping; parity with the one-process reference is checked as
in tests/test_runtime_parity.py (same tolerances, same reasons), and in addition every
frozen weight must end bit-identical to its initial value (nothing may touch it: an exact
check) while the adapters move.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")

from planner.model_file import load_model_file  # noqa: E402
from tests.conftest import EXAMPLES  # noqa: E402
from tests.runtime_plans import make_plan  # noqa: E402

LORA_FILE = EXAMPLES / "hf_lora.py"
LORA_ARGS = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                 vocab_size=256, seq_len=32)
PEFT = "base_model.model."  # peft's wrapper names above the Hugging Face model's own
LORA_UNITS = [f"{PEFT}model.embed_tokens", f"{PEFT}model.rotary_emb", f"{PEFT}model.layers.0", f"{PEFT}model.layers.1",
              f"{PEFT}model.norm", f"{PEFT}lm_head"]


def lora_plan(**layout):
    return make_plan(model="hf_lora", args=LORA_ARGS, units=LORA_UNITS, **layout)


def _built(seed: int = 0):
    """The LoRA model as every rank and the reference initialise it (runtime/build.py)."""
    from runtime.build import build_meta_model, init_mode, materialize

    mf = load_model_file(str(LORA_FILE), LORA_ARGS)
    meta = build_meta_model(mf)
    return materialize(meta, seed, torch.device("cpu"), init_mode(meta), mf)


def _frozen_names() -> set[str]:
    from runtime.build import build_meta_model

    model = build_meta_model(load_model_file(str(LORA_FILE), LORA_ARGS))
    return {n for n, p in model.named_parameters() if not p.requires_grad}


def test_units_are_found_under_peft_wrapper_names():
    from runtime.build import build_meta_model, trace

    mf = load_model_file(str(LORA_FILE), LORA_ARGS)
    assert trace(build_meta_model(mf), mf).units == LORA_UNITS


def test_optimizer_holds_only_trainable_parameters_and_init_is_peft_s():
    from runtime.train import make_optimizer

    model = _built()
    optimizer = make_optimizer(model, lr=1e-3, weight_decay=0.1)
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    named = dict(model.named_parameters())
    assert held == trainable and trainable
    assert all("lora_" in n for n, p in named.items() if p.requires_grad)
    assert any(not p.requires_grad for p in named.values())
    # peft's init survives the runtime's (whole-model build under the seed): lora_B zeros, lora_A random.
    assert all(p.abs().sum() == 0 for n, p in named.items() if "lora_B" in n)
    assert all(p.abs().sum() > 0 for n, p in named.items() if "lora_A" in n)
    frozen = torch.nn.Linear(2, 2).requires_grad_(False)
    assert make_optimizer(frozen, lr=1e-3, weight_decay=0.1) is None  # nothing trains: no optimizer


def test_adapters_of_a_plain_torch_model_keep_peft_s_init(write_model):
    # Every module here has reset_parameters(), which would pick the per-module init: its
    # nn.Linear reset would give lora_B Kaiming values instead of peft's zeros. A model with
    # frozen weights is built whole under the seed instead (runtime/build.py `init_mode`).
    from runtime.build import build_meta_model, init_mode, materialize

    path = write_model("""
        import torch
        from torch import nn
        from peft import LoraConfig, get_peft_model

        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
                self.head = nn.Linear(8, 4)

            def forward(self, x):
                for block in self.blocks:
                    x = torch.relu(block(x))
                return self.head(x)

        def build_model():
            return get_peft_model(Net(), LoraConfig(r=2, target_modules=["blocks.0", "blocks.1"]))

        def make_batch(batch_size):
            return torch.randn(batch_size, 8), torch.randint(4, (batch_size,))
    """)
    mf = load_model_file(str(path), {})
    meta = build_meta_model(mf)
    assert init_mode(meta) == "full"
    model = materialize(meta, 3, torch.device("cpu"), "full", mf)
    torch.manual_seed(3)
    direct = dict(mf.build_model().named_parameters())
    for name, p in model.named_parameters():
        assert torch.equal(p, direct[name]), name
        assert p.requires_grad == ("lora_" in name), name
        if "lora_B" in name:
            assert p.abs().sum() == 0, name


def test_profile_records_trainable_bytes():
    from planner.profile_schema import Unit
    from planner.profiler import profile_model

    profile = profile_model(str(LORA_FILE), LORA_ARGS, [1], device="meta", gpu="h100-80gb")
    model = _built()
    trainable = {u: sum(p.numel() * 4 for n, p in model.named_parameters() if p.requires_grad and n.startswith(u + "."))
                 for u in LORA_UNITS}
    assert {u.name: u.trainable_parameter_bytes for u in profile.units} == trainable
    assert trainable[f"{PEFT}model.layers.0"] > 0 and trainable[f"{PEFT}lm_head"] == 0
    assert profile.model.trainable_parameter_bytes == sum(trainable.values()) < profile.model.parameter_bytes
    # A profile written before the field reads as all-trainable.
    old = profile.units[2].model_dump(exclude={"trainable_parameter_bytes"})
    assert Unit.model_validate(old).trainable_parameter_bytes == old["parameter_bytes"]


# --- multi-process parity ------------------------------------------------------------------

CASES = {
    "dp2": dict(dp=2),
    "dp2-zero3-fsdp": dict(dp=2, zero=3),  # one FSDP group per unit holds frozen and trainable weights
    "pp2-1f1b": dict(pp=2, schedule="1f1b", m=4),
    "pp2-1f1b-clipped": dict(pp=2, schedule="1f1b", m=4),
}
CLIPPED = {"pp2-1f1b-clipped": 0.05}
"""Cases run with grad_clip: a third of the adapters' gradient norm (~0.15), so every step clips, by the
norm over both stages' trainable gradients (a norm over one stage, or one that counted frozen
weights, changes the scale from step to step, which Adam does not absorb; test_runtime_clip.py)."""


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_lora_trains_only_adapters_like_one_process(case, tmp_path):
    from tests.test_runtime_parity import LOSS_RTOL, PARAM_ATOL, _initial, run

    plan = lora_plan(**CASES[case])
    plan.training.grad_clip = CLIPPED.get(case, plan.training.grad_clip)
    path = plan.save(tmp_path / "plan.json")
    ref_metrics, ref_params = run(path, tmp_path, 1, reference=True)
    par_metrics, par_params = run(path, tmp_path, plan.world_size)
    initial = _initial(path, tmp_path)
    assert par_metrics["losses"] == pytest.approx(ref_metrics["losses"], rel=LOSS_RTOL)
    assert set(par_params) == set(ref_params) == set(initial)
    worst = max((par_params[k] - ref_params[k]).abs().max().item() for k in ref_params)
    assert worst < PARAM_ATOL, worst
    frozen = _frozen_names()
    assert frozen and frozen < set(initial)
    for name in frozen:  # exact: no update, no weight decay, no reduction may touch a frozen weight
        assert torch.equal(par_params[name], initial[name]) and torch.equal(ref_params[name], initial[name]), name
    adapters = set(initial) - frozen
    for params in (ref_params, par_params):
        moved = min((params[k] - initial[k]).abs().max().item() for k in adapters)
        assert moved > 10 * PARAM_ATOL  # every adapter trained, far beyond the tolerance


@pytest.mark.slow
def test_zero_bubble_after_a_frozen_only_stage(tmp_path):
    from tests.test_runtime_parity import LOSS_RTOL, run

    plan = lora_plan(pp=2, schedule="zero-bubble", m=4, cuts=[0, 2, len(LORA_UNITS)])  # stage 0: embedding, rotary
    path = plan.save(tmp_path / "plan.json")
    ref_metrics, _ = run(path, tmp_path, 1, reference=True)
    par_metrics, _ = run(path, tmp_path, plan.world_size)
    assert par_metrics["losses"] == pytest.approx(ref_metrics["losses"], rel=LOSS_RTOL)


@pytest.mark.slow
def test_lora_resumes_under_another_plan(tmp_path):
    # Saved under PP2 whose first stage (embedding, rotary) is frozen only: that chunk has no
    # optimizer but its weights are saved; resumed as FSDP shards, whose optimizer state is
    # the adapters' alone.
    from tests.test_runtime_checkpoint import check_resume_matches_reference

    saving = lora_plan(pp=2, schedule="1f1b", m=2, mbs=4, cuts=[0, 2, len(LORA_UNITS)])
    check_resume_matches_reference(saving, lora_plan(dp=2, zero=3, m=2), tmp_path)  # the same global batch of 8


# ---- the cost model: frozen weights hold no gradient or optimizer state and send nothing ----

def test_frozen_parameters_are_priced_as_held_not_trained():
    from planner.cluster import make_cluster
    from planner.cost.memory import model_state_bytes
    from planner.profiler import profile_model
    from planner.solver.search import state_bytes, updated_parameters
    from planner.solver.solve import Pins, _environment, search

    profile = profile_model(str(LORA_FILE), LORA_ARGS, [1], device="meta", gpu="h100-80gb", dtype="bfloat16")
    total, trained = profile.model.num_parameters, profile.model.trainable_parameter_bytes / 2  # bf16 bytes
    assert 0 < trained < total / 10  # adapters only
    cluster = make_cluster(4, 4, "h100-80gb")
    result = search(profile, cluster, 8, Pins(pp=1, tp=1, dp=4, zero_stage=1))
    cfg, table = result.ranked[0].config, result.costs.table(1, False, result.ranked[0].config.micro_batch_size)
    assert table.frozen_parameters.sum() == pytest.approx(total - trained)
    env = _environment(cluster, result.costs.compute, "bfloat16", Pins(), 0.9)
    held = env.precision  # the runtime's: fp32 parameters under autocast
    by_hand = model_state_bytes(trained, held, 1, 4).total + model_state_bytes(total - trained, held, 1, 4).weights
    assert state_bytes(table, cfg, env).sum() == pytest.approx(by_hand)
    assert updated_parameters(table, cfg, 0, len(table.parameters)) == pytest.approx(trained / 4)


def test_lora_reduces_only_the_adapters_gradients():
    from planner.cluster import make_cluster
    from planner.profiler import profile_model
    import planner.hf_config_model as hf
    from planner.solver.solve import Pins, solve

    # Wide enough that gradient bytes, not collective latency, make the reduction's time.
    args = {**LORA_ARGS, "hidden_size": 1024, "intermediate_size": 4096, "num_attention_heads": 8, "num_key_value_heads": 8,
            "vocab_size": 32000, "seq_len": 512}
    base_args = {**args, "config": str(EXAMPLES / "hf" / "llama3-8b.json")}  # hf_lora.py's base model
    lora = profile_model(str(LORA_FILE), args, [1], device="meta", gpu="h100-80gb", dtype="bfloat16")
    full = profile_model(hf.__file__, base_args, [1], device="meta", gpu="h100-80gb", dtype="bfloat16")
    pins = Pins(pp=1, tp=1, dp=8, zero_stage=0, micro_batch_size=1)
    cluster = make_cluster(8, 4, "h100-80gb")
    a, b = solve(lora, cluster, 8, pins), solve(full, cluster, 8, pins)
    assert a.prediction.breakdown_s["dp_comm"] < b.prediction.breakdown_s["dp_comm"] / 5
    assert a.prediction.breakdown_s["optimizer"] < b.prediction.breakdown_s["optimizer"] / 5
    assert max(a.prediction.peak_memory_bytes) < max(b.prediction.peak_memory_bytes)
