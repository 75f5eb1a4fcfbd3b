"""The solver's plans name every term of their predicted peak memory (issue #13, "memory you can
trust"): `Prediction.memory_terms_bytes` per stage, summing to `peak_memory_bytes`, each term
what planner/cost/memory.py says it is, and `planner show` prints them."""

from __future__ import annotations

from dataclasses import replace

import pytest

from planner.cluster import make_cluster
from planner.cost.memory import STATE_BYTES, stashed_weight_bytes
from planner.solver.solve import Pins, solve
from tests.conftest import EXAMPLES

GPT = dict(n_layers=8, d_model=1024, n_heads=16, d_ff=4096, vocab_size=32000, seq_len=1024)


@pytest.fixture(scope="module")
def gpt_profile():
    from planner.profiler import profile_model

    return profile_model(str(EXAMPLES / "gpt.py"), GPT, [1, 2, 4], device="meta", gpu="a100-80gb", dtype="bfloat16")


def _check_sums(plan):
    pred = plan.prediction
    assert pred.memory_terms_bytes is not None and len(pred.memory_terms_bytes) == len(plan.stages)
    for terms, peak in zip(pred.memory_terms_bytes, pred.peak_memory_bytes, strict=True):
        assert all(v >= 0 for v in terms.values()), terms
        assert sum(v for name, v in terms.items() if name != "fragmentation") == peak
        assert terms["fragmentation"] > 0  # an A100's allowance: the 10% the search keeps free


CASES = {
    "zero0-pp2": (Pins(pp=2, dp=4, tp=1, zero_stage=0), False, False),
    "zero1": (Pins(pp=1, dp=8, tp=1, zero_stage=1), False, False),
    "zero3-tp2": (Pins(pp=1, dp=4, tp=2, zero_stage=3), False, False),
    "offload": (Pins(pp=1, dp=8, tp=1, zero_stage=2, offload=True), True, False),
    "2bw": (Pins(pp=4, dp=2, tp=1, schedule="pipedream-2bw"), False, True),
    "recompute": (Pins(pp=2, dp=4, tp=1, recompute="full"), False, False),
}


@pytest.mark.parametrize("case", list(CASES))
def test_terms_sum_to_the_peak(gpt_profile, case):
    pins, offload, asynchronous = CASES[case]
    plan = solve(gpt_profile, make_cluster(8, gpu="a100-80gb"), 32, pins, allow_offload=offload,
                 allow_async=asynchronous)
    _check_sums(plan)
    terms = plan.prediction.memory_terms_bytes
    assert ("stashed_weights" in terms[0]) == asynchronous
    if case == "recompute":
        assert any(t["transient"] > 0 for t in terms)  # rebuilding a unit's activations in the backward


def _held(plan):
    """The plan's `Precision` (`Prediction.state_bytes`)."""
    from planner.cost.memory import Precision

    b = plan.prediction.state_bytes
    return Precision(b["weights"], b["gradients"], b["reduction"])


def test_each_state_term_is_the_memory_model_s(gpt_profile):
    """ZeRO 1 on dp 8, as the runtime trains a bf16 plan (fp32 parameters under autocast): fp32
    weights and gradients whole, the moments over 8; a 16-bit stack (Megatron-LM's, DeepSpeed's)
    holds 16-bit weights and gradients whole and the fp32 master weights over 8 too. With one
    micro-batch a step, the activations' peak comes before the first gradient."""
    pins = Pins(pp=1, dp=8, tp=1, zero_stage=1, micro_batch_size=1)  # 4 micro-batches: gradients held
    n = gpt_profile.model.num_parameters
    for stack, state in ((pins, (4, 4, 8)), (replace(pins, param_dtype="bfloat16"), STATE_BYTES["mixed"])):
        plan = solve(gpt_profile, make_cluster(8, gpu="a100-80gb"), 32, stack)
        (terms,) = plan.prediction.memory_terms_bytes
        weights, grads, optimizer = state
        assert _held(plan).state == state
        assert terms["parameters"] == pytest.approx(n * weights, rel=1e-6)
        assert terms["gradients"] == pytest.approx(n * grads, rel=1e-6)
        assert terms["optimizer_state"] == pytest.approx(n * optimizer / 8, rel=1e-6)
        assert terms["activations"] > 0
    one = solve(gpt_profile, make_cluster(8, gpu="a100-80gb"), 32, Pins(pp=1, dp=8, tp=1, zero_stage=1, micro_batch_size=4))
    (alone,) = one.prediction.memory_terms_bytes
    assert alone["gradients"] == 0 and alone["activations"] > 0

    plan = solve(gpt_profile, make_cluster(8, gpu="a100-80gb"), 32, Pins(pp=4, dp=2, tp=1, schedule="pipedream-2bw"),
                 allow_async=True)
    held = _held(plan)
    for terms in plan.prediction.memory_terms_bytes:
        assert terms["stashed_weights"] == pytest.approx(stashed_weight_bytes(terms["parameters"] / held.param_bytes, held,
                                                                               0, 2), rel=1e-6)


def test_offload_moves_states_off_the_gpu(gpt_profile):
    cluster = make_cluster(8, gpu="a100-80gb")
    kept = solve(gpt_profile, cluster, 32, Pins(pp=1, dp=8, tp=1, zero_stage=2, offload=False))
    moved = solve(gpt_profile, cluster, 32, Pins(pp=1, dp=8, tp=1, zero_stage=2, offload=True), allow_offload=True)
    (a,), (b,) = kept.prediction.memory_terms_bytes, moved.prediction.memory_terms_bytes
    assert b["optimizer_state"] == 0 and b["gradients"] == 0 and a["optimizer_state"] > 0
    assert b["parameters"] == a["parameters"]  # ZeRO 1-2 offload keeps the weights on the GPU


def test_show_prints_the_terms(gpt_profile, tmp_path):
    import os
    import subprocess
    import sys

    from tests.conftest import ROOT

    plan = solve(gpt_profile, make_cluster(8, gpu="a100-80gb"), 32, Pins(pp=2, dp=4, tp=1))
    path = plan.save(tmp_path / "plan.json")
    done = subprocess.run([sys.executable, "-m", "planner.cli", "show", str(path)], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "COLUMNS": "200"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert "by term" in done.stdout and "optimizer state" in done.stdout


def test_zero3_holds_two_gathered_units_and_one_unit_s_gradients(gpt_profile):
    # FSDP2 gathers a unit and prefetches the next (or copies the largest out of its flat
    # all-gather buffer: two copies of it), and holds one unit's unsharded gradients before their
    # reduce-scatter: the plan's communication term is that, on top of the shards. While the loss
    # is held the backward has reached the last unit only, so the loss and the largest pair are
    # never held at once: the peak is the larger moment.
    plan = solve(gpt_profile, make_cluster(8, gpu="a100-80gb"), 32, Pins(pp=1, dp=8, tp=1, zero_stage=3))
    (terms,) = plan.prediction.memory_terms_bytes
    weights, grads, _ = _held(plan).state
    units = [u.num_parameters for u in gpt_profile.units]
    pair = max(a + b for a, b in zip(units[:-1], units[1:], strict=True))
    largest = weights * max(pair, 2 * max(units)) + grads * max(units)
    last = weights * max(units[-2] + units[-1], 2 * units[-1]) + grads * units[-1]
    assert terms["loss"] > 0 and terms["loss"] + last >= largest  # the loss's moment is the peak here
    assert terms["communication"] == pytest.approx(last, rel=1e-6)
    assert terms["parameters"] == pytest.approx(weights * sum(units) / 8, rel=1e-6)
    # Where the largest pair outweighs the loss with the last unit, the loss is gone at the peak.
    from planner.cost.memory import gathered_bytes, stage_memory

    mib = 2**20
    pair_moment = gathered_bytes(100 * mib, 10 * mib, 20 * mib, "bfloat16", 3, 8)
    loss_moment = gathered_bytes(100 * mib, mib, 2 * mib, "bfloat16", 3, 8)
    for loss, held in ((mib, (0.0, pair_moment)), (200 * mib, (200 * mib, loss_moment))):
        at = stage_memory(100 * mib, "bfloat16", 3, 8, activation_bytes=mib, in_flight=1, largest_unit_parameters=10 * mib,
                          largest_unit_pair_parameters=20 * mib, loss=loss, last_unit_parameters=mib,
                          last_unit_pair_parameters=2 * mib)
        assert (at.loss, at.communication) == pytest.approx(held)



def _terms(profile, cfg, **habits) -> list[dict[str, float]]:
    """The memory terms per stage of `cfg` priced with `habits` (Pins fields: an engine's, the recomputation)."""
    from planner.solver.solve import price_config

    evaluation = price_config(profile, make_cluster(8, gpu="a100-80gb"), cfg, Pins(**habits))
    assert evaluation.feasible, evaluation.reason
    return list(evaluation.memory_terms)


def test_pipeline_buffers_per_micro_batch_or_in_flight(gpt_profile):
    # torch.distributed.pipelining (the runtime) keeps a receive buffer per micro-batch for what
    # crosses each cut; Megatron-LM and DeepSpeed hold one micro-batch's outgoing activation and its gradient.
    from planner.solver.search import Config

    cfg = Config(tp=1, sequence_parallel=False, pp=2, dp=4, micro_batch_size=1, num_microbatches=8, schedule="1f1b",
                 virtual_stages=1, zero_stage=0)
    ours, megatron = _terms(gpt_profile, cfg), _terms(gpt_profile, cfg, pipeline_buffers="in-flight")
    cut = megatron[0]["communication"] / 2  # the activation crossing the one cut, one micro-batch
    assert cut > 0 and megatron[1]["communication"] == 0
    assert ours[0]["communication"] == pytest.approx(8 * cut) and ours[1]["communication"] == pytest.approx(8 * cut)


def test_optimizer_step_phase_and_fused_optimizers(gpt_profile):
    # ZeRO 0 on dp 8 with full recomputation holds few activations: torch's foreach AdamW step,
    # a 4-byte temporary per parameter, beside the gradient bucket being freed, is the peak;
    # an engine whose AdamW steps in place (fused) peaks in the forward/backward phase instead.
    from planner.solver.search import Config

    cfg = Config(tp=1, sequence_parallel=False, pp=1, dp=8, micro_batch_size=1, num_microbatches=4, schedule="1f1b",
                 virtual_stages=1, zero_stage=0)
    # Priced for a stack holding 16-bit weights and gradients (the runtime's fp32 gradients under
    # autocast would make the forward/backward phase the peak here).
    (ours,), (fused,) = _terms(gpt_profile, cfg, recompute="full", param_dtype="bfloat16"), \
        _terms(gpt_profile, cfg, recompute="full", fused_optimizer=True, param_dtype="bfloat16")
    n = gpt_profile.model.num_parameters
    # The bucket (one copy of the 16-bit gradients) is smaller than the fp32 temporaries, so they are the peak.
    assert ours["activations"] == 0 and ours["loss"] == 0
    assert ours["transient"] == pytest.approx(4 * n, rel=1e-6) and ours["communication"] == 0
    assert fused["activations"] > 0 and fused["transient"] < ours["transient"]


def test_engine_files_say_their_memory_habits():
    from planner.engines import deepspeed, megatron, torchtitan

    mega = megatron.parse("--tensor-model-parallel-size 2 --micro-batch-size 1 --global-batch-size 8 --bf16\n")
    assert mega.fused_optimizer and mega.pipeline_buffers == "in-flight"
    base = '{"train_batch_size": 16, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 2'
    assert deepspeed.parse(base + ', "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}').fused_optimizer
    assert not deepspeed.parse(base + ', "optimizer": {"type": "AdamW", "params": {"torch_adam": true}}}').fused_optimizer
    assert not deepspeed.parse(base + "}").fused_optimizer  # the client's optimizer: torch's
    assert deepspeed.parse(base + "}").pipeline_buffers == "in-flight"
    assert torchtitan.parse("[parallelism]\npipeline_parallel_degree = 2\n").fused_optimizer  # its default, "fused"
    titan = torchtitan.parse('[optimizer]\nimplementation = "foreach"\n[parallelism]\npipeline_parallel_degree = 2\n')
    assert not titan.fused_optimizer and titan.pipeline_buffers == "per-microbatch"


def test_loss_parallel_holds_a_tp_shard_of_the_logits(gpt_profile):
    # torchtitan keeps the logits vocabulary-sharded under TP and computes the loss on the shards
    # (loss parallelism, its default); the planner's runtime computes it on the whole logits.
    from planner.engines import torchtitan
    from planner.solver.search import Config

    assert torchtitan.parse("[parallelism]\ntensor_parallel_degree = 4\n").loss_parallel
    assert not torchtitan.parse("[parallelism]\ntensor_parallel_degree = 4\ndisable_loss_parallel = true\n").loss_parallel
    assert not torchtitan.parse("[parallelism]\ndata_parallel_shard_degree = 8\n").loss_parallel  # no TP
    cfg = Config(tp=4, sequence_parallel=True, pp=1, dp=2, micro_batch_size=4, num_microbatches=1, schedule="1f1b",
                 virtual_stages=1, zero_stage=0)
    (whole,), (sharded,) = _terms(gpt_profile, cfg, recompute="none"), _terms(gpt_profile, cfg, recompute="none", loss_parallel=True)
    assert whole["loss"] > 0 and sharded["loss"] == pytest.approx(whole["loss"] / 4)


def test_receive_floor_is_below_every_rank_s_buffers():
    # `receive_floor_bytes` (the time bound's memory) against every way to cut 7 units with
    # uneven cut sizes into p x v chunks: no rank holds fewer buffer bytes.
    import itertools

    import numpy as np

    from planner.solver.bounds import receive_floor_bytes

    cut = np.array([5.0, 3.0, 8.0, 2.0, 6.0, 4.0, 0.0])  # after each unit; none after the last
    for (p, v), m, buffers in itertools.product([(2, 1), (2, 2), (3, 2), (4, 1)], [1, 3, 8], ["per-microbatch", "in-flight"]):
        floor = float(receive_floor_bytes(p, v, m, cut[:-1].min(), buffers))
        chunks = p * v
        for edges in itertools.combinations(range(1, 7), chunks - 1):
            bounds = list(zip((0, *edges), (*edges, 7), strict=True))
            held = [0.0] * p
            for k, (i, j) in enumerate(bounds):
                if buffers == "per-microbatch":
                    held[k % p] += m * ((cut[i - 1] if i > 0 else 0.0) + cut[j - 1])
                else:
                    held[k % p] += 2 * cut[j - 1]
            assert floor <= min(held) + 1e-9, (p, v, m, buffers, bounds)


@pytest.mark.parametrize("name, args", [("vgg", dict(depth=16, width=8, hidden=64, image_size=32)),
                                        ("resnet", dict(depth=18, width=8, image_size=64))])
def test_a_tensor_two_units_keep_counts_once(name, args):
    # VGG's units are single layers and ResNet's blocks end in an in-place ReLU: a unit keeps its
    # output, the next one its input, the same tensor. The table's activations of the whole model
    # are the distinct storages autograd keeps over its forward in one process, exactly (the
    # units' saved bytes summed count 65% and 23% more).
    import importlib.util

    from planner.profiler import profile_model
    from planner.profiler.counters import SavedBytes
    from planner.solver.solve import search

    profile = profile_model(str(EXAMPLES / f"{name}.py"), args, [2], device="meta", gpu="a100-80gb")
    result = search(profile, make_cluster(1, gpu="cpu"), 2, Pins(pp=1, dp=1, tp=1, micro_batch_size=2, recompute="none"),
                    keep=1)
    table = result.costs.table(1, False, 2)
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    model = module.build_model(**{k: v for k, v in args.items() if k != "image_size"})
    inputs, _ = module.make_batch(2, image_size=args["image_size"])
    saved = SavedBytes(exclude=list(model.parameters()))
    with saved.hooks():
        model(inputs)
    assert table.boundary_saved is not None and table.boundary_saved.sum() > 0
    assert table.activations["none"].sum() == saved.bytes
    assert sum(u.costs[2].saved_bytes for u in profile.units) > 1.2 * saved.bytes


def test_zero3_gathers_experts_as_their_own_group():
    # The runtime shards each experts module on its own (runtime/apply_dp.py), so a MoE layer is
    # two FSDP groups: during the experts' backward FSDP holds the layer whole and has prefetched
    # the layer before without its experts; one group's gradients at a time (measured on a
    # two-layer Mixtral: benchmarks/hf_architectures.py's zero3 peak went from +16% to +3%).
    from planner.cost.memory import gathered_bytes
    from planner.profiler import profile_model

    profile = profile_model(str(EXAMPLES / "moe.py"), dict(n_layers=3, d_model=64, n_heads=4, vocab_size=64, seq_len=16,
                                                             num_experts=8, top_k=2, moe_d_ff=256),
                            [2], device="meta", gpu="a100-80gb", dtype="bfloat16")
    plan = solve(profile, make_cluster(2, gpu="a100-80gb"), 4, Pins(pp=1, dp=2, tp=1, ep=1, zero_stage=3, micro_batch_size=2))
    (terms,) = plan.prediction.memory_terms_bytes
    params = [u.num_parameters for u in profile.units]
    experts = [sum(layer.expert_parameters for layer in u.moe) for u in profile.units]  # all of a layer's experts
    outer = [p - e for p, e in zip(params, experts, strict=True)]
    groups = max(max(o, e) for o, e in zip(outer, experts, strict=True))
    pairs = max(o + p for o, p in zip(outer[:-1], params[1:], strict=True))
    nested = gathered_bytes(sum(params), groups, pairs, _held(plan), 3, 2)
    whole = gathered_bytes(sum(params), max(params), max(a + b for a, b in zip(params[:-1], params[1:], strict=True)),
                           _held(plan), 3, 2)
    assert nested < whole  # the two are told apart here
    assert terms["loss"] == 0 and terms["communication"] == pytest.approx(nested, rel=1e-6)


DECODER_EMBEDDING = """
import torch
import torch.nn.functional as F
from torch import nn

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.encoder = nn.Linear(16, 16)
        self.decoder_embed = nn.Embedding(32, 16)
        self.decoder = nn.Linear(16, 16)
        self.head = nn.Linear(16, 32)

    def forward(self, tokens):
        h = self.encoder(self.embed(tokens))
        return self.head(self.decoder(h + self.decoder_embed(tokens)))

def build_model():
    return Net()

def make_batch(batch_size, **_):
    return torch.randint(32, (batch_size, 8)), torch.randint(32, (batch_size, 8))

def loss_fn(out, y):
    return F.cross_entropy(out.reshape(-1, 32), y.reshape(-1))
"""


def test_zero_bubble_stage_with_a_token_embedding_runs_its_whole_backward(write_model):
    # The profile marks the units fed no floating-point tensor; a zero-bubble stage after the
    # first holding a trained one runs its whole backward at B (runtime/pp_split.py
    # `needs_full_backward`), so no weight pass waits there: measured on Whisper's decoder stage,
    # +57% before (the split's pending passes priced), +2.2% after.
    from planner.profiler import profile_model
    from planner.solver.search import whole_backward_ranges

    path = write_model(DECODER_EMBEDDING, "decoder_embedding.py")
    profile = profile_model(str(path), {}, [2], device="meta", gpu="a100-80gb")
    assert [u.float_fed for u in profile.units] == [False, True, False, True, True]
    pins = Pins(pp=2, dp=1, tp=1, schedule="zero-bubble", virtual_stages=1, micro_batch_size=2, recompute="none")
    plan = solve(profile, make_cluster(2, gpu="a100-80gb"), 8, pins, cuts=lambda chunks: ((0, 2), (2, 5)))
    assert plan.stages[1].units[0] == "decoder_embed"
    import numpy as np

    from planner.solver.solve import search

    result = search(profile, make_cluster(2, gpu="a100-80gb"), 8, pins, keep=1)
    cfg = result.ranked[0].config
    table = result.costs.table(cfg.tp, cfg.sequence_parallel, cfg.micro_batch_size)
    assert list(whole_backward_ranges(table, cfg, np.array([0, 2, 3]), np.array([2, 5, 5]))) == [False, True, False]
    # The whole stage holds one micro-batch at its peak, not two with their weight passes' inputs.
    one = table.activations["none"][2:5].sum() + (table.boundary_saved[4] if table.boundary_saved is not None else 0.0)
    assert plan.prediction.memory_terms_bytes[1]["activations"] == pytest.approx(one, rel=1e-6)


def test_zero3_tied_units_in_one_stage_are_one_group_held_through_the_backward(write_model):
    # The runtime groups a tie's units where one stage holds two of them (runtime/apply_dp.py): a
    # tied embedding and its head are one FSDP group, gathered with its gradients through the
    # backward. (A pipeline runs no ZeRO 3, planner/solver/solve.py `PIPELINE_ZERO`, so a tie
    # split over stages is never a ZeRO 3 plan.)
    from tests.test_tied_stages import TIED_GPT

    path = write_model(TIED_GPT, "tied_gpt.py")
    args = dict(n_layers=2, d_model=64, n_heads=4, d_ff=128, vocab_size=4096, seq_len=16)
    profile = profile_model_meta(path, args)
    embedding = profile.units[0].num_parameters  # the tied weight counts in its first unit
    whole = solve(profile, make_cluster(2, gpu="a100-80gb"), 8, Pins(pp=1, dp=2, tp=1, zero_stage=3, micro_batch_size=2,
                                                                      recompute="none"))
    weights, grads, _ = _held(whole).state
    (terms,) = whole.prediction.memory_terms_bytes
    assert terms["communication"] >= (weights + grads) * embedding  # the group, held through the backward


def profile_model_meta(path, args):
    from planner.profiler import profile_model

    return profile_model(str(path), args, [2], device="meta", gpu="a100-80gb", dtype="bfloat16")


def test_zero_bubble_bounds_hold_for_stages_run_whole():
    # The search's lower bounds take the fewest micro-batches a zero-bubble rank may hold: every
    # later stage run with its whole backward frees each at B (1F1B's count on the later ranks).
    from planner.solver.bounds import _rank_in_flight

    assert _rank_in_flight("zero-bubble", 4, 8, 1) == (4.0, 3.0, 2.0, 1.0)
    assert _rank_in_flight("zero-bubble", 2, 4, 2)[1] <= min(
        s.in_flight for s in __import__("planner.cost.schedules", fromlist=["peak_states"]).peak_states(
            "zero-bubble", 2, 4, 1, 2, frozenset({1, 3})))


def test_gpipe_peaks_after_its_first_backward_where_gradients_outweigh_a_micro_batch():
    # All forwards before the first backward: the in-flight peak holds no gradient, but right
    # after the first backward the stage holds them all with one micro-batch fewer, the larger
    # moment at 8 tokens a micro-batch (planner/cost/schedules.py `peak_states`).
    from planner.profiler import profile_model

    args = dict(n_layers=4, d_model=256, n_heads=4, d_ff=1024, vocab_size=128, seq_len=8)
    profile = profile_model(str(EXAMPLES / "gpt.py"), args, [1], device="meta", gpu="cpu", dtype="float32")
    plan = solve(profile, make_cluster(2, gpu="cpu"), 8, Pins(pp=2, dp=1, tp=1, micro_batch_size=1, schedule="gpipe",
                                                               recompute="none"))
    first = plan.prediction.memory_terms_bytes[0]
    assert first["gradients"] == first["parameters"] > 0  # fp32: as many gradient bytes as weight bytes
    wide = profile_model(str(EXAMPLES / "gpt.py"), {**args, "seq_len": 512, "d_model": 64, "d_ff": 256}, [1],
                         device="meta", gpu="cpu", dtype="float32")
    long = solve(wide, make_cluster(2, gpu="cpu"), 8, Pins(pp=2, dp=1, tp=1, micro_batch_size=1, schedule="gpipe",
                                                            recompute="none"))
    assert long.prediction.memory_terms_bytes[0]["gradients"] == 0  # long sequences: the in-flight peak


def test_a_rank_s_chunks_rebuild_one_unit_at_a_time():
    # Interleaving puts stages k and k + pp on one rank: their states and activations together,
    # the larger of their recomputation transients; in the optimizer step every chunk steps.
    import numpy as np

    from planner.solver.search import rank_memory

    fb, transient, step = np.array([10.0, 8, 12, 9]), np.array([3.0, 2, 4, 1]), np.array([5.0, 5, 5, 5])
    assert rank_memory(fb, transient, step, pp=2) == [7 + 8 + 4, 6 + 8 + 2]
    assert rank_memory(fb, transient, np.array([20.0, 5, 5, 5]), pp=2)[0] == 25  # the step's phase, both chunks
    assert rank_memory(fb, transient, step, pp=4) == [10, 8, 12, 9]  # one chunk a rank: its own peak
