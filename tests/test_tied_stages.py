"""Weights tied across pipeline stages, as Megatron-LM holds them: each stage with a unit of the
tie keeps a copy, the copies' gradients are summed over the stages holding them before the
optimizer step (runtime/apply_dp.py `sum_tied_gradients`), and the solver prices the copies'
memory in every stage holding one and that all-reduce in the step (planner/solver/search.py).

Fast: the solver. Slow: PP2 runs with loss parity against the one-process reference, Hugging
Face GPT-2 ('full' init) solved with pinned pp, and a tied GPT example written by hand
('per-module' init, where the stage without the head must start from the head's reset)."""

from __future__ import annotations

import pytest

from planner.cluster import make_cluster
from planner.profiler import profile_model
from planner.solver.solve import Pins, search, solve
from tests.conftest import EXAMPLES
from tests.runtime_plans import GPT_ARGS, GPT_TP, GPT_UNITS, make_plan

# examples/gpt.py with its output head tied to the token embedding (Press & Wolf 2017).
TIED_GPT = f'''
import importlib.util

_spec = importlib.util.spec_from_file_location("gpt_example", {str(EXAMPLES / "gpt.py")!r})
gpt = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpt)
make_batch, loss_fn = gpt.make_batch, gpt.loss_fn


def build_model(**args):
    model = gpt.build_model(**args)
    model.head.weight = model.embed.tok.weight
    return model
'''

HF_GPT2 = {"config": str(EXAMPLES / "hf" / "gpt2.json"), "seq_len": 32, "n_layer": 2, "n_embd": 64, "n_head": 4,
           "vocab_size": 256, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}


def _hf_file() -> str:
    import planner.hf_config_model as hf

    return hf.__file__


# --- solver -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tied_profile(tmp_path_factory):
    path = tmp_path_factory.mktemp("tied") / "tied_gpt.py"
    path.write_text(TIED_GPT)
    return profile_model(str(path), {**GPT_ARGS, "d_model": 256, "vocab_size": 4096}, [1], device="meta", gpu="a100-80gb")


def test_tied_gpt_pipelines_and_prices_the_copy(tied_profile):
    from planner.solver.costs import tied_weights

    assert tied_profile.model.tied_parameters == [["embed", "head"]]
    (tie,) = tied_weights(tied_profile)
    assert tie.units == (0, len(GPT_UNITS) - 1) and tie.num_parameters == 4096 * 256
    cluster = make_cluster(2, gpu="a100-80gb")
    plan = solve(tied_profile, cluster, 4, Pins(pp=2, schedule="1f1b"))
    assert plan.layout.pp_degree == 2
    result = search(tied_profile, cluster, 4, Pins(pp=2, schedule="1f1b"))
    best = result.ranked[0]
    assert best.breakdown_s["tie_comm"] > 0
    # The same cuts priced as if the weight were held once: the copy's states and its all-reduce are the difference.
    from planner.cost.memory import model_state_bytes
    from planner.solver.search import evaluate_config
    from planner.solver.solve import _environment

    table = result.costs.table(1, False, best.config.micro_batch_size)
    env = _environment(cluster, result.costs.compute, tied_profile.dtype, Pins(pp=2), 0.9)
    untied = evaluate_config(table.without_ties(), best.config, env, fixed_bounds=best.bounds)
    priced = evaluate_config(table, best.config, env, fixed_bounds=best.bounds)
    copy_bytes = model_state_bytes(tie.num_parameters, env.dtype, best.config.zero_stage, best.config.dp).total
    assert priced.peak_memory_bytes[0] == pytest.approx(untied.peak_memory_bytes[0])  # stage 0 owns the weight
    # The last stage peaks in the optimizer step (foreach AdamW's temporaries, 4 bytes a parameter
    # it steps), the copy's included.
    assert priced.memory_terms[1]["activations"] == untied.memory_terms[1]["activations"] == 0
    assert priced.peak_memory_bytes[1] == pytest.approx(untied.peak_memory_bytes[1] + copy_bytes + 4 * tie.num_parameters)
    assert priced.iteration_time_s > untied.iteration_time_s
    assert untied.breakdown_s["tie_comm"] == 0


def test_hugging_face_gpt2_pipelines(tmp_path):
    pytest.importorskip("transformers")
    profile = profile_model(_hf_file(), HF_GPT2, [1], device="meta", gpu="a100-80gb")
    assert ["transformer.wte", "lm_head"] in profile.model.tied_parameters
    plan = solve(profile, make_cluster(2, gpu="a100-80gb"), 4, Pins(pp=2, schedule="1f1b"))
    assert plan.layout.pp_degree == 2
    assert "transformer.wte" in plan.stages[0].units and "lm_head" in plan.stages[1].units


def test_dp_with_tied_copies_matches_brute_force(tied_profile):
    # A stage's memory depends on whether it holds a copy of the tied weight, which depends on its
    # unit range alone: the DP over ranges stays exact. Every placement of 2 cuts among the 7
    # units, at memory limits from loose to tight, against the DP's choice.
    from dataclasses import replace
    from itertools import combinations, pairwise

    from planner.solver.inter_op import pipeline_time
    from planner.solver.search import evaluate_config

    table, env, cfg = _tied_setup(tied_profile, pp=3, dp=1, zero_stage=0)
    units = len(tied_profile.units)
    placements = [tuple(pairwise(e)) for inner in combinations(range(1, units), 2) for e in [(0, *inner, units)]]
    peaks = sorted({max(evaluate_config(table, cfg, env, fixed_bounds=b).peak_memory_bytes) for b in placements})

    def objective(e):
        return pipeline_time([f + b for f, b in zip(e.stage_forward_s, e.stage_backward_s)], cfg.num_microbatches)

    copies_mattered = False
    for limit in peaks[:: max(len(peaks) // 8, 1)] + [peaks[-1]]:
        tight = replace(env, usable_memory_bytes=limit * (1 + 1e-9))
        feasible = [e for b in placements if (e := evaluate_config(table, cfg, tight, fixed_bounds=b)).feasible]
        untied = [b for b in placements if evaluate_config(table.without_ties(), cfg, tight, fixed_bounds=b).feasible]
        copies_mattered |= len(untied) > len(feasible)
        chosen = evaluate_config(table, cfg, tight)
        assert chosen.feasible == bool(feasible), limit
        if feasible:
            assert max(chosen.peak_memory_bytes) <= limit * (1 + 1e-9)
            assert objective(chosen) == pytest.approx(min(objective(e) for e in feasible), rel=1e-9)
    assert copies_mattered  # some limit admits a placement only when the copy is left out


# --- runtime: stage modules and their initial values (fast) --------------------------------

TIED_NET = """
import torch
import torch.nn.functional as F
from torch import nn

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.embed.weight  # tied input and output embeddings

    def forward(self, x):
        x = self.embed(x)
        for b in self.blocks:
            x = b(x)
        return self.head(x)

def build_model(**_):
    return Net()

def make_batch(batch_size, **_):
    return torch.randint(16, (batch_size, 4)), torch.randint(16, (batch_size, 4))

def loss_fn(out, y):
    return F.cross_entropy(out.reshape(-1, 16), y.reshape(-1))
"""


def test_stages_hold_a_copy_each_initialised_like_the_reference(write_model):
    import torch
    from torch import nn

    from planner.model_file import load_model_file
    from runtime.apply_pp import build_stage_modules
    from runtime.build import _seed_for, build_meta_model, materialize, trace
    from runtime.pp_split import cross_stage_ties

    mf = load_model_file(write_model(TIED_NET, "tied_net.py"))
    units = trace(build_meta_model(mf), mf).units
    plan = make_plan(pp=2, units=units, args={})
    (tie,) = cross_stage_ties(build_meta_model(mf), plan)
    assert (tie.names, tie.stages, tie.pp_ranks) == (("embed.weight", "head.weight"), (0, 1), (0, 1))
    example = (mf.make_batch(1)[0],)
    cpu = torch.device("cpu")
    stages = [build_stage_modules(build_meta_model(mf), plan, rank, example)[0] for rank in (0, 1)]
    for s, module in stages:
        materialize(module, 0, cpu, "per-module", mf)
    reference = materialize(build_meta_model(mf), 0, cpu, "per-module", mf)
    (_, first), (_, last) = stages
    assert [stage for stage, _ in tie.copies(stages)] == [0, 1]
    assert "head.weight" not in dict(first.named_parameters()) and "embed.weight" not in dict(last.named_parameters())
    # The reference's shared weight is the head's reset (the last module holding it), not the embedding's.
    torch.manual_seed(_seed_for(0, "embed"))
    own = nn.Embedding(16, 8)
    assert not torch.equal(own.weight, reference.embed.weight)
    assert torch.equal(first.embed.weight, reference.embed.weight)
    assert torch.equal(last.head.weight, reference.head.weight)


# --- runtime: parity with the one-process reference -------------------------------------------

def _tied_plan(write_model, **kwargs):
    plan = make_plan(**{"pp": 2, "m": 4, **kwargs})
    plan.model.file = str(write_model(TIED_GPT, "tied_gpt.py"))
    return plan


@pytest.mark.slow
@pytest.mark.parametrize("clip,layout", [(None, {}), (0.05, {}), (0.05, {"dp": 2, "zero": 2, "m": 2}),
                                         (0.05, {"schedule": "interleaved-1f1b", "v": 2})],
                         ids=["pp2", "pp2-clip", "pp2xdp2-zero2-clip", "pp2-interleaved-v2-clip"])
def test_hand_written_pp2_with_a_tied_head_per_module_init(clip, layout, write_model, tmp_path):
    from planner.model_file import load_model_file
    from runtime.build import build_meta_model, init_mode
    from tests.test_runtime_parity import check_parity

    plan = _tied_plan(write_model, **layout)  # zero2: the copies' gradients are FSDP2 (DTensor) shards
    assert init_mode(build_meta_model(load_model_file(plan.model.file, plan.model.args))) == "per-module"
    assert "embed" in plan.stages[0].units and "head" in plan.stages[-1].units
    # Clipping far below the gradient norm clips every step: counting the tied gradient twice
    # (once per copy) changes the coefficient, and Adam's update with it.
    plan.training.grad_clip = clip
    check_parity(plan, tmp_path)


@pytest.mark.slow
def test_solved_hugging_face_gpt2_pp2_parity(tmp_path):
    pytest.importorskip("transformers")
    from tests.test_runtime_parity import check_parity

    profile = profile_model(_hf_file(), HF_GPT2, [1, 2], device="cpu", repeats=1, warmup=0)
    plan = solve(profile, make_cluster(2, gpu="cpu"), 4, Pins(pp=2, schedule="1f1b"))
    assert plan.layout.pp_degree == 2 and plan.world_size == 2
    check_parity(plan, tmp_path)


@pytest.mark.slow
def test_resume_across_a_tie_cut(write_model, tmp_path):
    # Saved with the tie cut apart (each stage's copy under its own name, both equal), resumed with
    # it whole: DCP keys the state by parameter name, so the same losses as an uninterrupted run.
    # The reverse is refused, clearly: a whole-model checkpoint keys the shared weight's optimizer
    # state by its first name only (runtime/train.py `_check_tied_resume`).
    from tests.test_runtime_checkpoint import check_resume_matches_reference, cli

    pp2, pp1 = _tied_plan(write_model), make_plan(pp=1, dp=2, m=2)
    pp1.model.file = pp2.model.file
    plan_a, plan_b = check_resume_matches_reference(pp2, pp1, tmp_path)

    whole = tmp_path / "whole"
    saved = cli("run", str(plan_b), "--steps", "1", "--checkpoint-dir", str(whole))
    assert saved.returncode == 0, saved.stderr[-2000:]
    refused = cli("run", str(plan_a), "--steps", "1", "--checkpoint-dir", str(whole), "--resume")
    assert refused.returncode == 1 and "saved with tied weights in one stage" in " ".join(refused.stderr.split())


def test_zero3_gathers_the_copy_with_its_unit(tied_profile):
    # Under ZeRO 3 the stage holding a copy of the tied weight gathers it with the unit it belongs
    # to: two gathered units' weights (or the largest unit twice, during FSDP2's copy-out of its
    # flat buffer) and one unit's gradients, the copy in each.
    from planner.cost.memory import STATE_BYTES
    from planner.solver.search import evaluate_config

    table, env, cfg = _tied_setup(tied_profile, pp=2, dp=2, zero_stage=3)
    bounds = ((0, 3), (3, len(tied_profile.units)))
    priced = evaluate_config(table, cfg, env, fixed_bounds=bounds)
    untied = evaluate_config(table.without_ties(), cfg, env, fixed_bounds=bounds)
    (tie,) = table.tied
    gathered = priced.memory_terms[1]["communication"] - untied.memory_terms[1]["communication"]
    weight_bytes, grad_bytes, _ = STATE_BYTES["float32" if tied_profile.dtype == "float32" else "mixed"]
    units, c = table.parameters[bounds[1][0]:bounds[1][1]], tie.num_parameters
    pair, largest = float((units[:-1] + units[1:]).max()), float(units.max())
    held = max(pair + c, 2 * (largest + c)) - max(pair, 2 * largest)  # the copy's gathered weights
    assert held >= c
    assert gathered == pytest.approx(weight_bytes * held + grad_bytes * c)
    assert priced.memory_terms[0]["communication"] == pytest.approx(untied.memory_terms[0]["communication"])


def _tied_setup(profile, pp: int, dp: int, zero_stage: int):
    """The tied model's tp 1, micro-batch 1 cost table on pp x dp A100s, the search's environment
    there, and the 1F1B configuration of 4 micro-batches per replica with `zero_stage`."""
    from planner.solver.search import Config
    from planner.solver.solve import _environment

    cluster = make_cluster(pp * dp, gpu="a100-80gb")
    result = search(profile, cluster, 4 * dp, Pins(pp=pp, dp=dp, tp=1))
    env = _environment(cluster, result.costs.compute, profile.dtype, Pins(), 0.9)
    cfg = Config(tp=1, sequence_parallel=False, pp=pp, dp=dp, micro_batch_size=1, num_microbatches=4, schedule="1f1b",
                 virtual_stages=1, zero_stage=zero_stage)
    return result.costs.table(1, False, 1), env, cfg


# --- tensor parallelism of a tied weight: sharded along the vocabulary by every holder ----------

TIED_GPT_TP = {**GPT_TP, "embed.tok": "rowwise"}  # the head is colwise: both shard the [vocab, d] weight on dim 0


@pytest.mark.slow
@pytest.mark.parametrize("layout,sp,clip", [({"pp": 1, "tp": 2}, False, None), ({"pp": 1, "tp": 2}, True, None),
                                            ({"pp": 2, "tp": 2, "m": 2}, False, 0.05)],
                         ids=["tp2", "tp2-sp", "pp2xtp2-clip"])
def test_tied_head_sharded_along_the_vocabulary_parity(layout, sp, clip, write_model, tmp_path):
    # One stage: the embedding and the head share one DTensor (runtime/build.py `retie`),
    # whose gradient sums both uses. Two stages: each holds a sharded copy; the copies' local
    # shards are summed over the pipeline ranks of one tp coordinate, before clipping (every step).
    from tests.test_runtime_parity import check_parity

    plan = _tied_plan(write_model, tp_plan=TIED_GPT_TP, **layout)
    plan.layout.sequence_parallel = sp
    plan.training.grad_clip = clip
    styles = {k: v for s in plan.stages for k, v in s.tp_plan.items()}
    assert styles["embed.tok"] == "rowwise" and styles["head"] == "colwise"
    check_parity(plan, tmp_path, noise_only=("attn.wk.bias",))  # 1e-4 off by noise in this model (check_parity)


# The tied GPT with a third holder the forward never calls, as T5's `shared` beside its tied
# `encoder.embed_tokens`, `decoder.embed_tokens` and `lm_head`.
UNCALLED_HOLDER = TIED_GPT.replace("    model.head.weight = model.embed.tok.weight\n",
                                   "    model.head.weight = model.embed.tok.weight\n"
                                   "    model.shared = torch.nn.Embedding(*model.embed.tok.weight.shape)\n"
                                   "    model.shared.weight = model.embed.tok.weight\n")


@pytest.mark.slow
def test_a_tied_holder_the_forward_never_calls_takes_the_sharded_weight_parity(write_model, tmp_path):
    from tests.test_runtime_parity import check_parity

    assert "model.shared.weight" in UNCALLED_HOLDER
    plan = _tied_plan(write_model, pp=1, tp=2, tp_plan=TIED_GPT_TP)
    plan.model.file = str(write_model("import torch\n" + UNCALLED_HOLDER, "uncalled_holder.py"))
    check_parity(plan, tmp_path, noise_only=("attn.wk.bias",))


@pytest.mark.slow
def test_solved_hugging_face_gpt2_tp2_shards_its_tied_embedding_parity(tmp_path):
    pytest.importorskip("transformers")
    from tests.test_runtime_parity import check_parity

    profile = profile_model(_hf_file(), HF_GPT2, [1, 2], device="cpu", repeats=1, warmup=0)
    plan = solve(profile, make_cluster(2, gpu="cpu"), 4, Pins(tp=2))
    styles = {k: v for s in plan.stages for k, v in s.tp_plan.items()}
    assert styles["transformer.wte"] == "rowwise" and styles["lm_head"] == "colwise", styles
    check_parity(plan, tmp_path)


def test_tied_holders_sharded_differently_are_refused_before_launch(write_model, tmp_path):
    from planner.errors import PlannerError
    from runtime.launch import precheck

    plan = _tied_plan(write_model, pp=1, tp=2, tp_plan={**GPT_TP, "embed.tok": "colwise"})  # dim 1 vs the head's 0
    with pytest.raises(PlannerError, match="tp_plan does not fit the model") as info:
        precheck(str(plan.save(tmp_path / "plan.json")), None)
    assert "embed.tok.weight (dim 1 sharded), head.weight (dim 0 sharded) are sharded differently" in str(info.value)


@pytest.mark.slow
def test_solved_tied_qwen3_tp2_sp_parity(tmp_path):
    # Qwen3's small models (and Llama 3.2's) tie the embedding and the head: under tp2 with sequence
    # parallelism both shard the vocabulary, solved from the public config, trained like one process.
    pytest.importorskip("transformers")
    from tests.test_runtime_parity import check_parity

    args = {"config": str(EXAMPLES / "hf" / "qwen3-8b.json"), "seq_len": 16, "num_hidden_layers": 2, "hidden_size": 64,
            "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
            "vocab_size": 256, "tie_word_embeddings": True}
    profile = profile_model(_hf_file(), args, [1, 2], device="cpu", repeats=1, warmup=0)
    assert profile.model.tied_parameters == [["model.embed_tokens", "lm_head"]]
    plan = solve(profile, make_cluster(2, gpu="cpu"), 4, Pins(tp=2, sequence_parallel=True))
    styles = {k: v for s in plan.stages for k, v in s.tp_plan.items()}
    assert (styles["model.embed_tokens"], styles["lm_head"]) == ("rowwise", "colwise")
    check_parity(plan, tmp_path)


TIED_RESUMES = {
    "tp2-to-dp2": (dict(pp=1, tp=2, tp_plan=TIED_GPT_TP), dict(pp=1, dp=2, m=2)),
    "dp2-to-tp2": (dict(pp=1, dp=2, m=2), dict(pp=1, tp=2, tp_plan=TIED_GPT_TP)),
    "pp2xtp2-to-tp2": (dict(pp=2, tp=2, tp_plan=TIED_GPT_TP), dict(pp=1, tp=2, tp_plan=TIED_GPT_TP)),  # a copy per stage -> one weight
}


@pytest.mark.slow
@pytest.mark.parametrize("case", TIED_RESUMES)
def test_resume_of_a_vocabulary_sharded_tie_under_another_plan(case, write_model, tmp_path):
    # DCP saves the tied weight (one DTensor sharded along the vocabulary, or a sharded copy per
    # stage) and its Adam state by name, and reshards them for a plan that holds them whole or
    # sharded otherwise: the same losses as an uninterrupted run.
    from tests.test_runtime_checkpoint import check_resume_matches_reference

    a, b = TIED_RESUMES[case]
    check_resume_matches_reference(_tied_plan(write_model, **a), _tied_plan(write_model, **b), tmp_path)
