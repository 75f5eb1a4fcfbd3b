"""Unmodified Hugging Face models, profiled, solved and run from their config alone.

Each case is a shipped config (examples/hf/) shrunk by config overrides to a few layers of
width 64, so the same transformers code paths run in seconds: default attention, default
`use_cache`, no model file written. Analytic (meta) and measured (CPU) profiles must agree
on FLOPs; the solver's plan for each pinned layout must train to the one-process losses.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

import planner.hf_config_model as hf  # noqa: E402
from planner.cluster import make_cluster  # noqa: E402
from planner.errors import PlannerError  # noqa: E402
from planner.profiler import profile_model  # noqa: E402
from planner.solver.solve import Pins, solve  # noqa: E402
from tests.conftest import EXAMPLES, ROOT  # noqa: E402

SMALL = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=256)
NO_DROPOUT_GPT2 = dict(n_layer=2, n_embd=64, n_head=4, vocab_size=256, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
CONFIGS = {
    # head_dim 32: 4 query heads of 32 on a width of 64 (head_dim is derived from the overridden
    # sizes otherwise: 16 here). At 16, one embedding element's gradient at the second step is
    # 1e-6, cancelled from terms a thousand times larger: a one-process batch of 4 and micro-batches
    # of 2 sum it in another order, its sign flips, and Adam's normalised step turns that into a
    # 1.4e-3 parameter difference, the losses agreeing to 2e-7 (Adam's amplification, not a layout's).
    "llama3-8b": dict(SMALL, head_dim=32),
    "qwen3-8b": dict(SMALL, head_dim=16),
    "mistral-7b": SMALL,
    "gpt2": NO_DROPOUT_GPT2,
    "qwen3-30b-a3b": dict(SMALL, head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32),
    # FalconLinear computes x @ W.T; the decoder layer adds into the MLP's output in place.
    "falcon-40b": dict(num_hidden_layers=2, hidden_size=64, ffn_hidden_size=256, num_attention_heads=4, num_kv_heads=2,
                       vocab_size=256),
    # Fused projections the unit cuts in pieces: qkv_proj (fed to attention) and gate_up_proj (chunked).
    "phi-3-mini": dict(SMALL, pad_token_id=0),
    # q_norm and k_norm over all of q's and k's features, before the heads are split.
    "olmo2-7b": dict(SMALL, pad_token_id=0),
    "opt-1.3b": dict(num_hidden_layers=2, hidden_size=64, ffn_dim=128, num_attention_heads=4, vocab_size=256,
                     word_embed_proj_dim=64, pad_token_id=0, dropout=0.0, attention_dropout=0.0),
    # Multi-head latent attention (q and k 24 wide, v 8: another head dim than q's), a dense first
    # layer, then shared and routed experts. head_dim is the rotary width (qk_rope_head_dim).
    "deepseek-v3": dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                        num_key_value_heads=4, vocab_size=256, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8,
                        head_dim=8, qk_nope_head_dim=16, v_head_dim=8, n_routed_experts=8, num_experts_per_tok=2,
                        moe_intermediate_size=32, first_k_dense_replace=1, n_group=1, topk_group=1),
}
SEQ_LEN = 32


def args_of(name: str) -> dict:
    return {"config": str(EXAMPLES / "hf" / f"{name}.json"), "seq_len": SEQ_LEN, **CONFIGS[name]}


def _flops(profile, b=1):
    return {u.name: (u.costs[b].forward_flops, u.costs[b].backward_flops) for u in profile.units}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_analytic_and_measured_profiles_agree(name):
    analytic = profile_model(hf.__file__, args_of(name), [1, 2], device="meta", gpu="h100-80gb")
    measured = profile_model(hf.__file__, args_of(name), [1, 2], device="cpu", repeats=1, warmup=0)
    assert [u.name for u in analytic.units] == [u.name for u in measured.units]
    assert analytic.model.fingerprint == measured.model.fingerprint
    assert analytic.model.num_parameters == measured.model.num_parameters
    meta, cpu = _flops(analytic), _flops(measured)
    for unit, (forward, backward) in cpu.items():
        assert meta[unit][0] == forward, unit
        # The analytic profile prices attention as the flash kernel a GPU runs, whose backward
        # recomputes the scores (2.5x the forward's attention FLOPs, not 2x): at most a quarter more.
        assert backward <= meta[unit][1] <= 1.25 * backward, unit
    assert all(u.costs[1].forward_time_s > 0 for u in measured.units if u.num_parameters)
    assert [c.bytes for c in analytic.cuts] == [c.bytes for c in measured.cuts]


def test_seventy_b_config_profiles_on_meta_as_a_whole():
    profile = profile_model(hf.__file__, {"config": str(EXAMPLES / "hf" / "llama3-70b.json"), "seq_len": 4096}, [1],
                            device="meta", gpu="h100-80gb", dtype="bfloat16")
    assert len(profile.units) == 80 + 4  # embed, rotary, 80 layers, norm, head
    assert 70e9 < profile.model.num_parameters < 71e9


def test_config_overrides_are_checked_by_name():
    with pytest.raises(PlannerError, match=r"'n_layr' \(did you mean 'n_layer'\?\)"):
        hf.load_config(str(EXAMPLES / "hf" / "gpt2.json"), n_layr=2)
    with pytest.raises(PlannerError, match="longer than the config's context"):
        hf.make_batch(1, str(EXAMPLES / "hf" / "gpt2.json"), seq_len=4096)


def test_a_context_stated_as_max_seq_len_bounds_the_sequence(tmp_path):
    """MPT states its context as max_seq_len (its ALiBi biases are built for that many tokens): a
    longer sequence failed inside its attention with a broadcast error; now it is refused first,
    naming the field to raise."""
    from transformers import AutoConfig

    path = tmp_path / "mpt.json"
    path.write_text(AutoConfig.for_model("mpt", max_seq_len=64).to_json_string())
    with pytest.raises(PlannerError, match=r"context of 64 tokens \(max_seq_len\)") as info:
        hf.make_batch(1, str(path), seq_len=128)
    assert "-a max_seq_len=128" in info.value.hint


def test_fields_a_config_derives_follow_the_overridden_sizes(tmp_path):
    """Falcon's config derives ffn_hidden_size (4 x hidden_size) when its JSON leaves it out: -a
    hidden_size=64 gives a 256-wide FFN, not the 32768 of the shipped size. A field the JSON names
    keeps its value, and an override of it wins; so does one of a nested config's field."""
    falcon = str(EXAMPLES / "hf" / "falcon-40b.json")
    assert "ffn_hidden_size" not in json.loads(Path(falcon).read_text())
    assert hf.load_config(falcon).ffn_hidden_size == 4 * 8192
    assert hf.load_config(falcon, hidden_size=64, num_attention_heads=4).ffn_hidden_size == 256
    assert hf.load_config(falcon, hidden_size=64, ffn_hidden_size=96).ffn_hidden_size == 96
    qwen = str(EXAMPLES / "hf" / "qwen3-8b.json")
    assert hf.load_config(qwen, hidden_size=64).head_dim == json.loads(Path(qwen).read_text())["head_dim"]
    assert hf._with_overrides({"text_config": {"hidden_size": 8, "vocab_size": 9}, "tie": True},
                              {"text_config.hidden_size": 64, "tie": False}) == \
        {"text_config": {"hidden_size": 64, "vocab_size": 9}, "tie": False}
    gemma = _shipped_default("gemma3", tmp_path)  # lists every layer's type: built first, overridden after
    nested = hf.load_config(gemma, **{"text_config.hidden_size": 64, "text_config.num_hidden_layers": 2})
    assert (nested.text_config.hidden_size, nested.text_config.num_hidden_layers) == (64, 2)


def test_a_padding_token_outside_a_shrunk_vocabulary_is_named(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(dict(json.loads((EXAMPLES / "hf" / "llama3-8b.json").read_text()), pad_token_id=32000)))
    with pytest.raises(PlannerError, match=r"pads with token 32000, outside its vocabulary of 256 \(vocab_size set by -a\)"):
        hf.load_config(str(config), vocab_size=256)
    assert hf.load_config(str(config), vocab_size=256, pad_token_id=0).pad_token_id == 0


def _shipped_default(model_type: str, folder) -> str:
    from transformers import AutoConfig

    path = folder / f"{model_type}.json"
    path.write_text(json.dumps(dict(AutoConfig.for_model(model_type).to_dict(), model_type=model_type)))
    return str(path)


def test_a_config_with_no_causal_lm_is_refused_with_what_to_do(tmp_path):
    with pytest.raises(PlannerError, match="no causal language model for model_type 't5'") as caught:
        hf.build_model(_shipped_default("t5", tmp_path), num_layers=1)
    assert "Write a model file" in caught.value.hint


def test_a_config_its_class_refuses_or_an_unknown_type_is_a_clear_error(tmp_path):
    """A config.json whose fields its class's validators refuse (Gemma 3's layer_types, one per
    layer) names the refusal; an unknown model_type says to upgrade. Neither is an internal error."""
    fields = json.loads(Path(_shipped_default("gemma3_text", tmp_path)).read_text())
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(dict(fields, num_hidden_layers=2)))  # layer_types still lists the shipped depth
    with pytest.raises(PlannerError, match="transformers refuses the gemma3_text config .*layer_types") as caught:
        hf.load_config(str(bad))
    assert "-a KEY=VALUE" in caught.value.hint
    unknown = tmp_path / "unknown.json"
    unknown.write_text(json.dumps(dict(fields, model_type="no_such_model")))
    with pytest.raises(PlannerError, match="does not know model_type 'no_such_model'"):
        hf.load_config(str(unknown))


def test_a_nested_config_field_is_overridden_by_its_path(tmp_path):
    """A multimodal config (Gemma 3) keeps its language model's fields in text_config: -a
    text_config.num_hidden_layers=2 reaches them, and the batch takes that config's vocabulary."""
    from planner.model_file import parse_model_args

    config = _shipped_default("gemma3", tmp_path)
    overrides = parse_model_args(["text_config.num_hidden_layers=2", "text_config.vocab_size=300"])
    cfg = hf.load_config(config, **overrides)
    assert (cfg.text_config.num_hidden_layers, cfg.text_config.vocab_size) == (2, 300)
    tokens, _ = hf.make_batch(2, config, seq_len=8, **overrides)
    assert tokens.shape == (2, 8) and int(tokens.max()) < 300
    with pytest.raises(PlannerError, match=r"'text_config.num_hiden_layers' \(did you mean 'text_config.num_hidden_layers'\?\)"):
        hf.load_config(config, **{"text_config.num_hiden_layers": 2})
    with pytest.raises(PlannerError, match="Malformed --model-arg"):
        parse_model_args(["text_config..num_hidden_layers=2"])


def test_cli_profiles_from_a_config(tmp_path):
    out = tmp_path / "p.json"
    command = [sys.executable, "-m", "planner.cli", "profile", "--hf-config", str(EXAMPLES / "hf" / "mistral-7b.json"),
               "--device", "meta", "--seq-len", "64", *[f"-a{k}={v}" for k, v in SMALL.items()], "-o", str(out)]
    done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-2000:]
    profile = json.loads(out.read_text())
    assert profile["model"]["args"]["seq_len"] == 64 and profile["model"]["file"].endswith("hf_config_model.py")
    both = subprocess.run([*command[:4], "examples/gpt.py", *command[4:]], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert both.returncode == 1 and "not both" in both.stderr


# --- solve, then run with parity -------------------------------------------------------------

LAYOUTS = {
    "tp2": (2, Pins(tp=2)),
    "pp2-1f1b": (2, Pins(pp=2, schedule="1f1b")),
    "fsdp2": (2, Pins(dp=2, zero_stage=3)),
    "pp2xtp2": (4, Pins(pp=2, tp=2)),
}
# For Llama, Qwen3 and GPT-2 the two that cover the rest (pp2 x tp2 holds tp2's and pp2's code
# paths; fsdp2 the sharded one; tests/test_runtime_tp.py runs examples/hf_llama.py, the same
# Hugging Face class, under tp2 alone), pp2 x tp2 alone for the two whose difference is in
# what tp shards (Falcon's x @ W.T linears and the MLP output it writes in place; DeepSeek's
# latent attention and experts): the full product cost minutes of a suite near its budget.
PARITY_LAYOUTS = {"llama3-8b": ["fsdp2", "pp2xtp2"], "qwen3-8b": ["fsdp2", "pp2xtp2"], "gpt2": ["fsdp2", "pp2xtp2"],
                  "falcon-40b": ["pp2xtp2"], "deepseek-v3": ["pp2xtp2"], "phi-3-mini": ["tp2"], "olmo2-7b": ["tp2"], "opt-1.3b": ["tp2"]}
PARITY_CASES = [(name, layout) for name, layouts in PARITY_LAYOUTS.items() for layout in layouts]


@pytest.fixture(scope="module")
def measured_profiles():
    return {}


@pytest.mark.slow
@pytest.mark.parametrize("name,layout", PARITY_CASES)
def test_solver_plan_trains_like_one_process(name, layout, measured_profiles, tmp_path):
    from tests.test_runtime_parity import check_parity

    if name not in measured_profiles:
        # Three timed passes after a warm-up: the TP plan's choice between sharding and replicating
        # these tiny ops turns on their measured times, which one cold pass left to chance (a
        # CI run under load once found replicating Falcon's every op cheaper).
        measured_profiles[name] = profile_model(hf.__file__, args_of(name), [1, 2], device="cpu", repeats=3, warmup=1)
    world, pins = LAYOUTS[layout]
    plan = solve(measured_profiles[name], make_cluster(world, gpu="cpu"), 4, pins)
    assert plan.world_size == world
    if pins.tp:
        assert any(s.tp_plan for s in plan.stages), "a tp plan that shards nothing"
    check_parity(plan, tmp_path)


def test_falcon_mlp_is_sharded_and_its_written_output_copied():
    """FalconLinear (x @ W.T) is a linear by structure, so tp shards Falcon's MLP; the layer then
    writes the MLP's output in place (`mlp_output += attention_output`), so the plan lists the
    rowwise projection for the runtime to copy (the parity test runs it)."""
    profile = profile_model(hf.__file__, args_of("falcon-40b"), [1], device="meta", gpu="h100-80gb")
    block = next(u for u in profile.units if u.kind == "FalconDecoderLayer")
    linears = {op.name: (op.weight_shape, op.weight_in_out) for op in block.ops if op.kind == "linear"}
    assert linears["mlp.dense_h_to_4h"] == ([256, 64], False) and linears["mlp.dense_4h_to_h"] == ([64, 256], False)
    assert [op.name for op in block.ops if op.output_written_in_place] == ["mlp.dense_4h_to_h"]
    plan = solve(profile, make_cluster(2, gpu="h100-80gb"), 4, Pins(tp=2, sequence_parallel=False))
    stage = plan.stages[0]
    assert stage.tp_plan["transformer.h.0.mlp.dense_4h_to_h"] == "rowwise"
    assert stage.tp_copy_outputs == ["transformer.h.0.mlp.dense_4h_to_h", "transformer.h.1.mlp.dense_4h_to_h"]


NEVER_COLWISE = {
    # Phi-3 computes gate and up with one gate_up_proj and chunks its output in two: a contiguous
    # column shard would hand rank 0 the gate alone, which it would chunk into a false gate and up
    # (a plan that trained to other losses, with no error).
    "phi-3-mini": ("Phi3DecoderLayer", "output_split_on_features", {"mlp.gate_up_proj", "self_attn.qkv_proj"}),
    # OLMo 2 normalises q and k over all their features (one RMSNorm of width heads x head_dim)
    # before splitting heads: column-sharded, each rank would normalise its own shard (the
    # solver's tp plan failed at the norm's weight).
    "olmo2-7b": ("Olmo2DecoderLayer", "output_reduced_on_features", {"self_attn.q_proj", "self_attn.k_proj"}),
    # OPT views q, k and v as (bsz, -1, num_heads, head_dim): column-sharded, a rank's half of the
    # features would be folded into half the sequence, with no error and other losses.
    "opt-1.3b": ("OPTDecoderLayer", "output_heads_fixed", {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"}),
}


@pytest.mark.parametrize("name", sorted(NEVER_COLWISE))
def test_a_projection_cut_or_reduced_along_its_features_is_never_column_sharded(name):
    """The op graph flags the cut or the reduction; the solver shards the projection by rows
    instead, or not at all, and under sequence parallelism keeps such a unit replicated."""
    kind, flag, names = NEVER_COLWISE[name]
    profile = profile_model(hf.__file__, args_of(name), [1], device="meta", gpu="h100-80gb")
    block = next(u for u in profile.units if u.kind == kind)
    assert names <= {op.name for op in block.ops if getattr(op, flag)}
    for sequence_parallel in (False, True):
        plan = solve(profile, make_cluster(2, gpu="h100-80gb"), 4, Pins(tp=2, sequence_parallel=sequence_parallel))
        styles = {k: v for s in plan.stages for k, v in s.tp_plan.items()}
        assert all(styles.get(f"{block.name}.{n}") != "colwise" for n in names), styles


def test_plan_refuses_copying_an_unsharded_output():
    from planner.plan import Stage

    with pytest.raises(ValueError, match="tp_copy_outputs names"):
        Stage(units=["a"], ranks=[0, 1], tp_plan={"a.x": "replicate"}, tp_copy_outputs=["a.x"])


def test_training_turns_the_kv_cache_off():
    from planner.model_file import load_model_file

    model = load_model_file(hf.__file__, args_of("llama3-8b")).build_model()
    assert model.config.use_cache is False


@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "deepseek-v3"])
@pytest.mark.parametrize("layout", ["pp2-1f1b", "fsdp2"])
def test_mixture_of_experts_model_solves(layout, name):
    """The unmodified Qwen3-MoE and DeepSeek-V3 models, profiled on meta, get a plan for each
    pinned layout (expert parallelism itself is examples/moe.py's and runtime/apply_ep.py's)."""
    profile = profile_model(hf.__file__, args_of(name), [1, 2], device="meta", gpu="h100-80gb")
    world, pins = LAYOUTS[layout]
    plan = solve(profile, make_cluster(world, gpu="h100-80gb"), 4, pins)
    assert plan.world_size == world and plan.prediction.iteration_time_s > 0
    assert [u for s in plan.stages for u in s.units] == [u.name for u in profile.units]


def test_a_model_whose_forward_a_split_sequence_cannot_follow_gets_no_context_parallelism():
    """OPT numbers its positions with a cumsum of its attention mask, which CP would run over each
    rank's tokens alone (it trained to other losses with no error): the profile records the scan,
    and a pinned cp is refused saying where (the free search reads the same field). Llama's one scan (the
    packed-sequence check, a cumsum of zeros for one sequence per sample) does not count."""
    from planner.errors import PlannerError

    opt = profile_model(hf.__file__, args_of("opt-1.3b"), [1], device="meta", gpu="h100-80gb")
    assert len(opt.model.cp_obstacles) == 1 and opt.model.cp_obstacles[0].startswith("cumsum along dim 1 at modeling_opt.py")
    assert opt.model.attention_calls == 2  # it does compute attention by SDPA: the scan alone refuses CP
    cluster = make_cluster(4, gpu="h100-80gb")
    with pytest.raises(PlannerError, match="--cp 2: the model's forward does what a split sequence cannot follow"):
        solve(opt, cluster, 8, Pins(cp=2))
    llama = profile_model(hf.__file__, args_of("llama3-8b"), [1], device="meta", gpu="h100-80gb")
    assert llama.model.cp_obstacles == []
    # A sliding window shorter than the sequence: a mask CP cannot translate to the other ranks' keys.
    windowed = profile_model(hf.__file__, dict(args_of("mistral-7b"), sliding_window=SEQ_LEN // 2), [1], device="meta",
                             gpu="h100-80gb")
    assert [o.split(" at ")[0] for o in windowed.model.cp_obstacles] == [
        f"attention with a mask other than plain causal (({SEQ_LEN}, {SEQ_LEN}) tokens)"]
    assert solve(llama, cluster, 8, Pins(cp=2)).layout.cp_degree == 2


def test_ep_is_not_folded_over_tp_where_the_experts_unit_stays_replicated(tmp_path):
    """OLMoE normalises q over all its features (q_norm), so under sequence parallelism the
    intra-op solution keeps its decoder layer, experts included, replicated; EP over the TP ranks
    would then dispatch the same tokens from every TP rank, which the runtime refuses. The solver
    offers no such plan and says why when it is pinned; EP over dp alone still solves."""
    from planner.errors import PlannerError

    args = _default_config("olmoe", tmp_path, seq_len=32, num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                           num_attention_heads=4, num_key_value_heads=2, vocab_size=256, pad_token_id=0, bos_token_id=0,
                           eos_token_id=1, num_experts=4, num_experts_per_tok=2)
    profile = profile_model(hf.__file__, args, [1], device="meta", gpu="h100-80gb")
    if not any(u.moe for u in profile.units):
        import transformers

        assert int(transformers.__version__.split(".")[0]) < 5, "transformers 5's OLMoE holds its experts stacked"
        pytest.skip(f"transformers {transformers.__version__}'s OLMoE holds its experts as a ModuleList of MLPs: no "
                    "experts module to parallelise (planner/moe.py `find_experts`), so no EP to refuse")
    cluster = make_cluster(4, gpu="h100-80gb")
    with pytest.raises(PlannerError, match=r"needs every unit holding experts tensor-parallel.*model\.layers\.0 replicated"):
        solve(profile, cluster, 8, Pins(ep=2, tp=2, dp=2, sequence_parallel=True))
    assert solve(profile, cluster, 8, Pins(ep=2, tp=2, dp=2, sequence_parallel=False)).layout.ep_degree == 2


def _default_config(model_type: str, folder: Path, **sizes) -> dict:
    """planner/hf_config_model.py's arguments for transformers' default config of `model_type`."""
    return dict(config=_shipped_default(model_type, folder), **sizes)


@pytest.mark.slow
def test_gpt_neox_fused_query_key_value_is_split_head_by_head(tmp_path):
    """GPT-NeoX's query_key_value feeds q, k and v, viewed into (b, s, -1, 3 x head_dim): each
    head's q, k and v side by side, so a column shard holds whole heads of each (the profiler runs
    the layer on one, `_shards_whole_heads`). At GPT-NeoX-20B's sizes tp 8 is Megatron's layout
    (it was row-parallel with attention computed whole on every rank, 8 times over), and under
    sequence parallelism the small model trains like one process."""
    from tests.test_runtime_parity import check_parity

    full = profile_model(hf.__file__, _default_config("gpt_neox", tmp_path, seq_len=512, num_hidden_layers=2), [1],
                         device="meta", gpu="h100-80gb")
    layer = next(u for u in full.units if u.kind == "GPTNeoXLayer")
    qkv = next(op for op in layer.ops if op.name == "attention.query_key_value")
    assert not qkv.fused_attention_input and qkv.output_heads == 64
    plan = solve(full, make_cluster(8, gpu="h100-80gb"), 8, Pins(tp=8, pp=1, sequence_parallel=False))
    styles = plan.stages[0].tp_plan
    assert styles["gpt_neox.layers.0.attention.query_key_value"] == "colwise"
    assert styles["gpt_neox.layers.0.attention.dense"] == "rowwise"
    small = _default_config("gpt_neox", tmp_path, seq_len=32, num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                            num_attention_heads=4, vocab_size=256)
    measured = profile_model(hf.__file__, small, [1, 2], device="cpu", repeats=1, warmup=0)
    plan = solve(measured, make_cluster(2, gpu="cpu"), 4, Pins(tp=2, sequence_parallel=True))
    assert plan.stages[0].tp_plan["gpt_neox.layers.0.attention.query_key_value"] == "colwise"
    check_parity(plan, tmp_path)


@pytest.mark.slow
def test_gpt_oss_attention_sinks_are_sharded_with_their_heads(tmp_path):
    """gpt-oss's attention holds `sinks`, a learned logit per query head appended to each head's
    scores, as a parameter of its own (not of a child module). Its q, k and v projections are
    sharded by heads under TP, so each rank must hold its heads' sinks: replicated, the tp2 plan
    failed at its first forward (`torch.cat([attn_weights, sinks])`: 2 heads against 4). They are
    sharded by rows (runtime/apply_tp.py `_per_head_parameters`), and the plan, with sequence
    parallelism and the experts over both ranks, trains like one process."""
    from runtime.apply_tp import _per_head_parameters
    from tests.test_runtime_parity import check_parity

    small = _default_config("gpt_oss", tmp_path, seq_len=32, num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                            vocab_size=256, pad_token_id=0, bos_token_id=0, eos_token_id=1)
    # Analytic (CPU preset): whether a measured profile's tp2 plan shards these small projections
    # turns on their timings (a CI run kept layer 0's attention whole), and this test needs them sharded.
    profile = profile_model(hf.__file__, small, [1, 2], device="meta", gpu="cpu")
    plan = solve(profile, make_cluster(2, gpu="cpu"), 4, Pins(tp=2, sequence_parallel=True))
    styles = plan.stages[0].tp_plan
    assert styles["model.layers.0.self_attn.q_proj"] == "colwise" and styles["model.layers.0.self_attn.o_proj"] == "rowwise"
    model = hf.build_model(**small)
    present = dict(model.named_modules())
    found = _per_head_parameters(present, {"model.layers.0.self_attn"}, styles, 2)
    assert found == {"model.layers.0.self_attn": ["sinks"]}
    assert _per_head_parameters(present, {"model.layers.0.self_attn"}, styles, 8) == {}  # 4 heads do not split 8 ways
    check_parity(plan, tmp_path)


@pytest.mark.slow
def test_llama4_moe_block_under_sequence_parallelism_runs(tmp_path):
    """Llama 4's MoE block flattens its tokens to [T, D] for its router, shared expert and experts,
    and its experts take tokens already routed (no experts module planner/moe.py recognises). SP
    would shard dim 1 of those, the features: its plan failed at the router's first forward. The
    layer stays whole under SP (the plan's note says why) and the plan trains like one process;
    a linear on flattened tokens inside a recognised MoE block (Qwen2-MoE's shared expert) is
    still sharded, as the runtime runs such a block on each rank's own tokens."""
    from planner.solver.intra_op import _sequence_parallel_blocked, moe_blocks
    from tests.test_runtime_parity import check_parity

    small = _default_config("llama4_text", tmp_path, seq_len=32, num_hidden_layers=2, hidden_size=64,
                            intermediate_size=64, intermediate_size_mlp=128, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=16, num_local_experts=4, vocab_size=256, pad_token_id=0,
                            bos_token_id=0, eos_token_id=1)
    profile = profile_model(hf.__file__, small, [1, 2], device="cpu", repeats=1, warmup=0)
    layer = next(u for u in profile.units if u.kind == "Llama4TextDecoderLayer")
    assert not layer.moe and _sequence_parallel_blocked(layer.ops)
    qwen = profile_model(hf.__file__, _default_config("qwen2_moe", tmp_path, seq_len=32, num_hidden_layers=2, hidden_size=64,
                                                      intermediate_size=128, moe_intermediate_size=32,
                                                      shared_expert_intermediate_size=64, num_attention_heads=4,
                                                      num_key_value_heads=2, num_experts=4, vocab_size=256),
                         [1], device="meta", gpu="h100-80gb")
    block = next((u for u in qwen.units if u.moe), None)
    if block is not None:  # transformers 4.x's Qwen2-MoE holds its experts as a ModuleList: no MoE block
        assert any(len(op.input_shape) == 2 for op in block.ops if op.kind == "linear")  # the shared expert's
        assert not _sequence_parallel_blocked(block.ops, moe_blocks(block))
    else:
        import transformers

        assert int(transformers.__version__.split(".")[0]) < 5
    plan = solve(profile, make_cluster(2, gpu="cpu"), 4, Pins(tp=2, sequence_parallel=True))
    note = next(n for n in plan.search.notes if n.startswith("tensor parallelism"))
    assert "sequence parallelism keeps its unit whole" in note
    check_parity(plan, tmp_path)


T5 = """
import torch
import torch.nn.functional as F
from transformers import T5Config, T5ForConditionalGeneration

def build_model(layers=2):
    return T5ForConditionalGeneration(T5Config(vocab_size=128, d_model=32, d_kv=8, d_ff=64, num_layers=layers,
                                               num_heads=4, decoder_start_token_id=0, dropout_rate=0.0))

def make_batch(batch_size, layers=2, seq=16):
    g = torch.Generator().manual_seed(0)
    source = torch.randint(1, 128, (batch_size, seq), generator=g)
    target = torch.randint(1, 128, (batch_size, seq + 1), generator=g)
    return (source, None, target[:, :-1]), target[:, 1:]  # (input_ids, attention_mask, decoder_input_ids)

def loss_fn(output, targets):
    return F.cross_entropy(output.logits.reshape(-1, output.logits.shape[-1]), targets.reshape(-1))
"""


def test_an_encoder_decoder_keeps_no_key_value_cache(write_model):
    """T5's decoder stack reads its own copy of the config: the cache is off there too
    (`for_training`), so profiling a decoder block alone runs it as training does."""
    from planner.model_file import load_model_file

    model = load_model_file(str(write_model(T5)), {}).build_model()
    assert model.decoder.config is not model.config and model.decoder.config.use_cache is False
    assert not any(m.config.use_cache for m in model.modules() if hasattr(m, "config"))


@pytest.mark.slow
@pytest.mark.parametrize("pins", [Pins(pp=2, dp=1, tp=1, micro_batch_size=1, schedule="zero-bubble"),
                                  Pins(pp=1, dp=2, tp=1, zero_stage=3)], ids=["pp2-zero-bubble", "zero3"])
def test_an_encoder_decoder_trains_like_one_process(write_model, tmp_path, pins):
    """Hugging Face's T5, a model file written by a user: a None among the inputs, a dropout
    module called twice (after the embedding and after the last norm: the second call makes the
    encoder's output, which crosses to the decoder's stage), an embedding the forward reaches
    only through tied names (its owner, `shared`, in their FSDP group), and a relative-position
    bias every decoder block adds that zero bubble's deferred weight pass differentiates with the
    blocks' weights."""
    from tests.test_runtime_parity import check_parity

    profile = profile_model(str(write_model(T5)), {}, [1, 2], device="cpu", repeats=1, warmup=0)
    plan = solve(profile, make_cluster(2, gpu="cpu"), 4, pins)
    if pins.pp == 2:
        assert any(u.startswith("decoder.") for u in plan.stages[1].units)
    check_parity(plan, tmp_path)


@pytest.mark.slow
def test_an_encoders_linears_paired_across_sibling_modules_train_like_one_process(tmp_path):
    """Hugging Face's BERT under TP2: the MLP's `intermediate.dense` column-sharded with
    `output.dense`, under another module, row-sharded, paired by data flow (`Stage.tp_feeds`;
    the attention too where the ILP shards it): the features between stay split, and the run
    trains to the one-process losses and parameters."""
    from tests.test_runtime_parity import check_parity

    profile = profile_model(str(EXAMPLES / "hf_bert.py"), {}, [1, 2], device="cpu", repeats=1, warmup=0)
    plan = solve(profile, make_cluster(2, gpu="cpu"), 4, Pins(pp=1, dp=1, tp=2, sequence_parallel=False))
    feeds = plan.stages[0].tp_feeds or {}
    assert feeds["bert.encoder.layer.0.output.dense"] == ["bert.encoder.layer.0.intermediate.dense"]
    check_parity(plan, tmp_path)
