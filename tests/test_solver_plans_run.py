"""Every plan the solver writes is one the runtime can run: solver-level checks of the three ways
a plan used not to be (a unit that is itself a module, tied weights cut apart: now held as a
copy per stage, see tests/test_tied_stages.py; a TP degree the model cannot shard), and, slow,
solve-then-run with loss parity for every pinned dimension."""

from __future__ import annotations

import json

import numpy as np
import pytest

from planner.cluster import make_cluster
from planner.errors import PlannerError
from planner.profiler import profile_model
from planner.solver.inter_op import allowed_cuts, brute_force_cuts, solve_cuts
from planner.solver.solve import Pins, search, solve
from tests.conftest import EXAMPLES
from tests.runtime_plans import GPT_ARGS, LLAMA_ARGS

TINY_GPT = {**GPT_ARGS, "n_layers": 2}  # units embed, blocks.0, blocks.1, norm, head
TINY_LLAMA = LLAMA_ARGS  # units embed, layers.0, layers.1, norm, output


def _meta(model: str, args: dict):
    """An analytic profile of an example (seconds; the solver only needs shapes and a roofline)."""
    return profile_model(str(EXAMPLES / f"{model}.py"), args, [1], device="meta", gpu="a100-80gb")


@pytest.fixture(scope="module")
def gpt_meta():
    return _meta("gpt", TINY_GPT)


@pytest.fixture(scope="module")
def llama_meta():
    return _meta("llama", TINY_LLAMA)


def _check_against_model(plan, model_file: str, args: dict):
    """The runtime's own pre-launch check of the tp_plan, on the model built on meta."""
    import torch

    from planner.model_file import load_model_file
    from runtime.apply_tp import check_tp_plan

    with torch.device("meta"):
        model = load_model_file(model_file, args).build_model()
    check_tp_plan(plan, model)


# --- 1. a unit that is itself a module ------------------------------------------------------

@pytest.mark.parametrize("model,whole", [("gpt", ["head"]), ("llama", ["embed", "output"])])
def test_unit_that_is_a_module_is_named_by_itself(model, whole, gpt_meta, llama_meta):
    profile = gpt_meta if model == "gpt" else llama_meta
    plan = solve(profile, make_cluster(2, gpu="cpu"), 4, Pins(tp=2))
    tp_plan = {k: v for s in plan.stages for k, v in s.tp_plan.items()}
    assert not [name for name in tp_plan if name.endswith(".") or ".." in name], tp_plan
    # A pinned tp shards at least one weight per unit that has one, so the whole-module units appear.
    assert all(tp_plan.get(name) in ("colwise", "rowwise") for name in whole), tp_plan
    _check_against_model(plan, str(EXAMPLES / f"{model}.py"), TINY_GPT if model == "gpt" else TINY_LLAMA)


def test_whole_module_units_under_the_root_are_not_a_sandwich():
    from runtime.apply_tp import _paired_owners

    # Llama's `embed` (vocab-parallel) and `output` (colwise) are siblings under the root: each
    # gathers its own output, neither hands a shard to the other.
    plan = {"embed": "rowwise", "output": "colwise", "layers.0.attention.wq": "colwise", "layers.0.attention.wo": "rowwise"}
    assert _paired_owners(plan, ["embed", "layers.0", "output"]) == {"layers.0.attention"}
    assert _paired_owners(plan) == {"layers.0.attention"}


# --- 2. tied parameters ----------------------------------------------------------------------

TIED = '''
import torch
from torch import nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x):
        return x + torch.tanh(self.fc(x))


class Model(nn.Module):
    def __init__(self, vocab, d, n, tie_blocks, tie_head):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(n))
        self.head = nn.Linear(d, vocab, bias=False)
        if tie_blocks:  # blocks.1 and blocks.2 share a weight: no cut may fall between them
            self.blocks[2].fc.weight = self.blocks[1].fc.weight
        if tie_head:
            self.head.weight = self.embed.weight

    def forward(self, idx):
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def build_model(vocab=64, d=256, n=4, tie_blocks=True, tie_head=False, **_):
    return Model(vocab, d, n, tie_blocks, tie_head)


def make_batch(batch_size, vocab=64, **_):
    x = torch.randint(vocab, (batch_size, 9))
    return x[:, :-1], x[:, 1:]


def loss_fn(out, y):
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
'''


def test_cuts_never_split_a_tied_group_and_match_brute_force():
    rng = np.random.default_rng(0)
    for trial in range(30):
        units, stages = int(rng.integers(3, 8)), int(rng.integers(2, 4))
        first = int(rng.integers(0, units - 1))
        group = [first, int(rng.integers(first + 1, units))]
        allowed = allowed_cuts(units, [group])
        if allowed.sum() + 1 < stages:
            with pytest.raises(PlannerError, match="sharing a parameter"):
                solve_cuts(np.ones((stages, units + 1, units + 1)), 4, allowed)
            continue
        cost = np.triu(rng.uniform(0.1, 1.0, (stages, units + 1, units + 1)), 1)
        cost[cost == 0] = np.inf
        got = solve_cuts(cost, 4, allowed)
        want = brute_force_cuts(cost, 4, allowed)
        assert got.pipeline_time_s == pytest.approx(want.pipeline_time_s)
        stage_of = {u: k for k, (i, j) in enumerate(got.bounds) for u in range(i, j)}
        assert stage_of[group[0]] == stage_of[group[1]], (got.bounds, group)


def test_pipeline_may_cut_between_tied_units_and_prices_each_copy(write_model):
    path = write_model(TIED, "tied.py")
    profile = profile_model(str(path), {}, [1], device="meta", gpu="a100-80gb")
    assert profile.model.tied_parameters == [["blocks.1", "blocks.2"]]
    cluster = make_cluster(2, gpu="a100-80gb")
    result = search(profile, cluster, 4, Pins(pp=2, dp=1, tp=1))
    assert result.ranked
    # The profile counts the shared weight once (in blocks.1); a stage holding blocks.2 without
    # blocks.1 holds a copy of it (d x d = 256 x 256), priced in its memory.
    table = result.costs.table(1, False, 1)
    assert table.parameters.sum() == profile.model.num_parameters
    (tie,) = table.tied
    assert tie.units == (2, 3) and tie.num_parameters == 256 * 256
    assert table.copy_parameters(0, 3)[0] == 0 and table.copy_parameters(3, 5)[0] == 256 * 256
    assert table.copy_parameters(2, 5)[0] == 0  # blocks.1 (the owner) is in the range


def test_pinned_pipeline_across_a_tie_solves(write_model):
    path = write_model(TIED, "tied.py")
    profile = profile_model(str(path), {"tie_head": True, "tie_blocks": False}, [1], device="meta", gpu="a100-80gb")
    plan = solve(profile, make_cluster(2, gpu="a100-80gb"), 4, Pins(pp=2))
    assert plan.layout.pp_degree == 2
    assert "embed" in plan.stages[0].units and "head" in plan.stages[-1].units  # every cut splits this tie
    # TP shards the tied pair along the vocabulary, both alike (planner/solver/costs.py `tie_pins`).
    plan = solve(profile, make_cluster(2, gpu="a100-80gb"), 4, Pins(tp=2))
    styles = {k: v for s in plan.stages for k, v in s.tp_plan.items()}
    assert styles["embed"] == "rowwise" and styles["head"] == "colwise"
    # A vocabulary that tp does not divide keeps the pair whole, both alike.
    profile = profile_model(str(path), {"tie_head": True, "tie_blocks": False, "vocab": 63}, [1], device="meta",
                            gpu="a100-80gb")
    plan = solve(profile, make_cluster(2, gpu="a100-80gb"), 4, Pins(tp=2))
    assert not {"embed", "head"} & {k for s in plan.stages for k in s.tp_plan}


def test_hugging_face_gpt2_tied_embeddings_pipeline(write_model):
    pytest.importorskip("transformers")
    path = write_model('''
        import torch
        from transformers import AttentionInterface, GPT2Config, GPT2LMHeadModel
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        AttentionInterface.register("causal_sdpa", sdpa_attention_forward)  # meta-safe, as examples/hf_llama.py


        def build_model(**_):
            config = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=4, bos_token_id=0,
                                eos_token_id=0)
            config._attn_implementation = "causal_sdpa"
            return GPT2LMHeadModel(config)


        def make_batch(batch_size, **_):
            x = torch.randint(64, (batch_size, 17))
            return x[:, :-1], x[:, 1:]


        def loss_fn(out, y):
            return torch.nn.functional.cross_entropy(out.logits.reshape(-1, 64), y.reshape(-1))
        ''', "hf_gpt2.py")
    profile = profile_model(str(path), {}, [1], device="meta", gpu="a100-80gb")
    assert ["transformer.wte", "lm_head"] in profile.model.tied_parameters
    plan = solve(profile, make_cluster(2, gpu="a100-80gb"), 4, Pins(pp=2))
    assert plan.layout.pp_degree == 2
    assert "transformer.wte" in plan.stages[0].units and "lm_head" in plan.stages[-1].units
    assert plan.prediction.breakdown_s["tie_comm"] > 0  # the copies' gradient all-reduce


# --- 3. pins the model cannot honour ---------------------------------------------------------

@pytest.mark.parametrize("model,args,tp,whole", [
    ("gpt", TINY_GPT, 8, "blocks.*.attn.wq x2 (its 4 heads do not split 8 ways)"),
    ("llama", TINY_LLAMA, 4, "layers.*.attention.wk x2 (its 2 heads do not split 4 ways)"),  # grouped-query: 2 key/value heads
    ("llama", {**TINY_LLAMA, "n_kv_heads": 1}, 2, "layers.*.attention.wv x2 (its 1 head does not split 2 ways)"),  # multi-query
])
def test_tp_that_splits_no_whole_head_keeps_the_attention_whole(model, args, tp, whole):
    """A degree that does not split an attention's heads whole (Megatron-LM refuses it; this
    planner did too) plans: the attention's projections stay replicated on every TP rank, the MLP
    shards, the notes say which weights stay whole and why, and the runtime's own check accepts
    the plan. Under sequence parallelism those blocks stay whole (Megatron's layout shards every
    linear of a block or none). A free solve may choose the degree."""
    profile = _meta(model, args)
    plan = solve(profile, make_cluster(tp, gpu="a100-80gb"), 8, Pins(tp=tp))
    styles = {k: v for s in plan.stages for k, v in s.tp_plan.items()}
    attention = [k for k in styles if ".attn." in k or ".attention." in k]
    assert attention and all(styles[k] == "replicate" for k in attention), styles
    assert any(v in ("colwise", "rowwise") for k, v in styles.items() if k not in attention), styles
    # The weight is named with why, or (when the note's list is cut short) cited as the reason others stay whole.
    name, reason = whole.split(" x2 (")
    cited = f"({name.split('.')[-2]}.{name.split('.')[-1]} projects {reason.split()[1]} head"
    assert any(whole in note or cited in note for note in plan.search.notes), plan.search.notes
    _check_against_model(plan, str(EXAMPLES / f"{model}.py"), args)
    plan = solve(profile, make_cluster(tp, gpu="a100-80gb"), 8, Pins(tp=tp, sequence_parallel=True))
    blocks = {k: v for s in plan.stages for k, v in s.tp_plan.items() if k.startswith(("blocks.", "layers."))}
    assert all(v == "replicate" for v in blocks.values()), blocks
    assert any("sequence parallelism keeps its unit whole" in note for note in plan.search.notes)
    result = search(profile, make_cluster(tp, gpu="a100-80gb"), 8)
    assert result.ranked


def test_tp_that_splits_no_weight_is_refused(write_model):
    profile = profile_model(str(write_model(TIED, "tied.py")), {"tie_blocks": False}, [1], device="meta", gpu="a100-80gb")
    with pytest.raises(PlannerError, match=r"--tp 3: no Linear or Embedding weight .* splits 3 ways .*nothing would be sharded"):
        solve(profile, make_cluster(3, gpu="a100-80gb"), 3, Pins(tp=3))


def test_tp_on_a_model_of_convolutions_only_is_refused_saying_so(write_model):
    # SqueezeNet-like: every weight a convolution, which tensor parallelism does not shard.
    source = """
import torch
from torch import nn

def build_model(**_):
    return nn.Sequential(nn.Conv2d(3, 16, 3), nn.ReLU(), nn.Conv2d(16, 10, 1), nn.AdaptiveAvgPool2d(1), nn.Flatten())

def make_batch(batch_size, **_):
    return torch.randn(batch_size, 3, 8, 8), torch.randint(10, (batch_size,))
"""
    profile = profile_model(str(write_model(source, "convs.py")), {}, [1], device="meta", gpu="a100-80gb")
    with pytest.raises(PlannerError, match=r"--tp 2: tensor parallelism shards Linear and Embedding weights, and the "
                                           r"model has none \(its weighted layers are conv\)"):
        solve(profile, make_cluster(2, gpu="a100-80gb"), 2, Pins(tp=2))


def test_pp_above_the_unit_count_is_refused(gpt_meta):
    with pytest.raises(PlannerError, match="--pp 8 x --virtual-stages 1 exceeds the model's 5 units"):
        solve(gpt_meta, make_cluster(8, gpu="cpu"), 8, Pins(pp=8))


def test_math_attention_shards_only_whole_heads():
    from planner.solver.intra_op import _heads_of, _op_strategies

    ops = _meta("gpt", {**TINY_GPT, "attention": "math"}).units[1].ops
    heads = _heads_of(ops)
    assert {heads[n] for n in ("attn.wq", "attn.wk", "attn.wv")} == {4}
    wq = next(op for op in ops if op.name == "attn.wq")  # 32 features: 8 divides them, not the 4 heads
    assert "colwise" in _op_strategies(wq, 4, heads) and "colwise" not in _op_strategies(wq, 8, heads)


def test_pinned_tp_is_used_even_where_the_cost_model_would_replicate(gpt_meta):
    # On gloo CPU processes a tiny model's TP collectives cost more than the matmuls they split,
    # so the ILP alone would replicate everything: a tp2 plan that does nothing.
    plan = solve(gpt_meta, make_cluster(2, gpu="cpu"), 4, Pins(tp=2))
    styles = [v for s in plan.stages for v in s.tp_plan.values()]
    assert styles.count("colwise") + styles.count("rowwise") >= 3  # blocks.0, blocks.1, head at least


def test_sequence_parallel_plans_shard_every_linear_of_a_block(llama_meta):
    # The runtime's SP keeps activations between sandwiches sequence-sharded; a replicated
    # attention inside that region would need the whole sequence, which nothing gathers.
    plan = solve(llama_meta, make_cluster(2, gpu="cpu"), 4, Pins(tp=2, sequence_parallel=True))
    blocks = {k: v for k, v in plan.stages[0].tp_plan.items() if k.startswith("layers.")}
    assert len(blocks) == 14 and set(blocks.values()) == {"colwise", "rowwise"}, blocks


def test_pipeline_plans_have_the_micro_batches_torch_needs(gpt_meta):
    # torch's Schedule1F1B refuses fewer micro-batches than stages; the looped schedules need
    # m divisible by their rounds of pp. The fastest plan on CPU would otherwise be one micro-batch of 4.
    from planner.solver.solve import torch_builds

    for schedule in ("1f1b", "gpipe", "zero-bubble"):
        plan = solve(gpt_meta, make_cluster(2, gpu="cpu"), 4, Pins(pp=2, schedule=schedule))
        assert torch_builds(schedule, 2, plan.batch.num_microbatches)
        if schedule == "1f1b":
            assert plan.batch.num_microbatches >= 2
    assert not torch_builds("1f1b", 2, 1) and not torch_builds("zero-bubble", 2, 5) and torch_builds("zero-bubble", 2, 3)


# --- slow: solve, run, compare with the one-process reference --------------------------------

MODELS = {"gpt": TINY_GPT, "llama": TINY_LLAMA}
GLOBAL_BATCH = 4
CASES = {
    "tp2": Pins(tp=2),
    "pp2-1f1b": Pins(pp=2, schedule="1f1b"),
    "pp2-gpipe": Pins(pp=2, schedule="gpipe"),
    "pp2-interleaved-v2": Pins(pp=2, schedule="interleaved-1f1b", virtual_stages=2, micro_batch_size=1),
    "pp2-zero-bubble": Pins(pp=2, schedule="zero-bubble"),
    **{f"dp2-zero{z}": Pins(dp=2, zero_stage=z) for z in range(4)},
    "sp-tp2": Pins(tp=2, sequence_parallel=True),
    "recompute-full": Pins(recompute="full"),
}
STEPS = ("--steps", "2")
# What tp shards differs between the two models (GPT's fused attention, Llama's GQA, rotary and
# SwiGLU), so the tp cases run on both; every other case on one, alternating: its code path does
# not depend on the model (tests/test_runtime_parity.py runs most of them by hand as well).
CASE_MODELS = [(case, model) for i, case in enumerate(CASES)
               for model in (sorted(MODELS) if "tp" in case else [sorted(MODELS)[i % 2]])]


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    """Per model, one CPU profile and one reference run, shared by every case."""
    from tests.test_runtime_parity import run

    cache = {}

    def get(model: str):
        if model not in cache:
            out = tmp_path_factory.mktemp(f"{model}-ref")
            profile = profile_model(str(EXAMPLES / f"{model}.py"), MODELS[model], [1, 2], device="cpu", repeats=2)
            plan = solve(profile, make_cluster(2, gpu="cpu"), GLOBAL_BATCH, Pins(pp=1, tp=1, dp=2))
            ref = run(plan.save(out / "plan.json"), out, 1, reference=True, extra=STEPS)
            cache[model] = profile, ref
        return cache[model]

    return get


@pytest.mark.slow
@pytest.mark.parametrize("case,model", CASE_MODELS)
def test_solved_plan_runs_with_reference_parity(case, model, measured, tmp_path):
    from tests.test_runtime_parity import LOSS_RTOL, PARAM_ATOL, run

    profile, (ref_metrics, ref_params) = measured(model)
    pins = CASES[case]
    plan = solve(profile, make_cluster(2, gpu="cpu"), GLOBAL_BATCH, pins)
    lay = plan.layout
    for dim in ("pp", "tp", "dp"):
        if getattr(pins, dim):
            assert getattr(lay, f"{dim}_degree") == getattr(pins, dim), lay
    if lay.tp_degree > 1:
        assert any(s in ("colwise", "rowwise") for st in plan.stages for s in st.tp_plan.values())
    metrics, params = run(plan.save(tmp_path / "plan.json"), tmp_path, plan.world_size, extra=STEPS)
    # Tolerances as tests/test_runtime_parity.py argues them (float32, reordered sums, 2 AdamW steps).
    assert metrics["losses"] == pytest.approx(ref_metrics["losses"], rel=LOSS_RTOL), json.dumps(plan.layout.model_dump())
    assert set(params) == set(ref_params)
    worst = max((params[k] - ref_params[k]).abs().max().item() for k in ref_params)
    assert worst < PARAM_ATOL, worst


@pytest.mark.slow
@pytest.mark.parametrize("kv_heads,tp", [(1, 2), (2, 4)])
def test_attention_tp_does_not_split_trains_like_one_process(kv_heads, tp, tmp_path):
    """Llama with fewer key/value heads than tp (multi-query at tp 2, grouped-query's 2 at tp 4):
    the attention replicated beside a sharded MLP trains to the one process's losses and
    parameters."""
    from tests.test_runtime_parity import LOSS_RTOL, PARAM_ATOL, run

    args = {**TINY_LLAMA, "n_kv_heads": kv_heads}
    profile = profile_model(str(EXAMPLES / "llama.py"), args, [1], device="cpu", repeats=1, warmup=0)
    plan = solve(profile, make_cluster(tp, gpu="cpu"), GLOBAL_BATCH, Pins(tp=tp, micro_batch_size=1))
    assert plan.layout.tp_degree == tp
    assert any(s in ("colwise", "rowwise") for st in plan.stages for s in st.tp_plan.values())
    path = plan.save(tmp_path / "plan.json")
    ref_metrics, ref_params = run(path, tmp_path, 1, reference=True, extra=STEPS)
    metrics, params = run(path, tmp_path, plan.world_size, extra=STEPS)
    assert metrics["losses"] == pytest.approx(ref_metrics["losses"], rel=LOSS_RTOL)
    assert set(params) == set(ref_params)
    assert max((params[k] - ref_params[k]).abs().max().item() for k in ref_params) < PARAM_ATOL


# --- slow: the other examples, each pinned dimension it supports --------------------------------
# Small sizes; BatchNorm and dropout are off where a model has them (per-rank batch statistics and
# per-rank random masks differ from one process by design, not by a fault of the layout).
OTHER_MODELS = {
    "cnn": dict(image_size=16, widths="8,16"),
    "unet": dict(image_size=16, base_width=4, depth=2),
    "resnet": dict(depth=18, width=8, image_size=64, norm="group"),  # 64: GroupNorm over 2 values amplifies rounding
    "vgg": dict(depth=11, width=4, hidden=32, image_size=32, dropout=0.0),
    "hf_llama": dict(n_layers=2, d_model=32, n_heads=4, n_kv_heads=2, d_ff=64, vocab_size=64, seq_len=16),
}
OTHER_CASES = {"pp2-1f1b": Pins(pp=2, schedule="1f1b"), "dp2-zero3": Pins(dp=2, zero_stage=3), "tp2": Pins(tp=2)}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(OTHER_CASES))
@pytest.mark.parametrize("model", sorted(OTHER_MODELS))
def test_other_examples_solved_plans_run_or_are_refused_with_the_reason(model, case, tmp_path):
    from tests.test_runtime_parity import LOSS_RTOL, PARAM_ATOL, run

    profile = profile_model(str(EXAMPLES / f"{model}.py"), OTHER_MODELS[model], [1, 2], device="cpu", repeats=1, warmup=0)
    try:
        plan = solve(profile, make_cluster(2, gpu="cpu"), GLOBAL_BATCH, OTHER_CASES[case])
    except PlannerError as exc:
        # Only tensor parallelism may be refused (a model with no weight TP can split); never silently.
        assert case == "tp2" and "--tp 2" in str(exc), str(exc)
        return
    path = plan.save(tmp_path / "plan.json")
    ref_metrics, ref_params = run(path, tmp_path, 1, reference=True, extra=STEPS)
    metrics, params = run(path, tmp_path, plan.world_size, extra=STEPS)
    # Two steps, as the gpt/llama matrix above: float32, reordered sums (test_runtime_parity.py).
    assert metrics["losses"] == pytest.approx(ref_metrics["losses"], rel=LOSS_RTOL)
    assert set(params) == set(ref_params)
    # Parameters: AdamW divides each update by sqrt(v), so a parameter whose gradient is rounding
    # noise (the convnets' GroupNorm-ed channels with the solver's timing-dependent cuts) may move
    # by up to lr per step in either run: 2 steps x lr bounds that. A wrong layout shows in the
    # losses above, which must agree to 1e-5.
    bound = 2 * plan.training.lr * int(STEPS[1]) if model in ("resnet", "unet", "cnn", "vgg") else PARAM_ATOL
    assert max((params[k] - ref_params[k]).abs().max().item() for k in ref_params) < bound
