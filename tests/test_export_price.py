"""planner export / planner price (planner/engines/): a plan written in each engine's terms reads back
as the same layout, what an engine cannot express is warned about with its price, and Megatron-LM
arguments parse from either shape people keep them in. Analytic profiles: seconds, not hardware."""

from __future__ import annotations

import pytest

from planner.cluster import make_cluster
from planner.engines import ENGINES, deepspeed, export_plan, megatron, read_config
from planner.engines.common import EngineLayout, Split, plan_layout, stage_bounds
from planner.engines.pricing import compare, price
from planner.profiler import profile_model
from planner.solver.solve import Pins, solve
from tests.conftest import EXAMPLES

# Units: embed, blocks.0 .. blocks.5, norm, head (9); 8 heads so tp 2 splits whole heads.
GPT = dict(n_layers=6, d_model=256, n_heads=8, d_ff=1024, vocab_size=1024, seq_len=128)
BATCH = 16


@pytest.fixture(scope="module")
def gpt():
    return profile_model(str(EXAMPLES / "gpt.py"), GPT, [1, 2], device="meta", gpu="a100-80gb", dtype="bfloat16")


@pytest.fixture(scope="module")
def cluster():
    return make_cluster(8, 8, "a100-80gb")


# One plan per engine, pinned to what that engine can say (DeepSpeed's cuts are the DP's own: the
# warning for them is tested below, the round trip holds either way).
PINS = {
    "torchtitan": Pins(pp=2, tp=2, dp=2, micro_batch_size=1, schedule="interleaved-1f1b", virtual_stages=2,
                       recompute="op", zero_stage=1, sequence_parallel=True),  # ZeRO 2 in a pipeline runs as 1
    "megatron": Pins(pp=2, tp=2, dp=2, micro_batch_size=1, schedule="1f1b", recompute="full", zero_stage=1,
                     sequence_parallel=True, overlap=megatron.overlap(interleaved=False)),
    "deepspeed": Pins(pp=2, tp=1, dp=4, micro_batch_size=2, schedule="1f1b", recompute="full", zero_stage=1,
                      overlap=deepspeed.overlap(1, pp=2)),
    "accelerate": Pins(pp=1, tp=1, dp=8, micro_batch_size=1, recompute="full", zero_stage=3),
}
FIELDS = ("pp_degree", "tp_degree", "dp_degree", "zero_stage", "sequence_parallel", "schedule", "virtual_stages",
          "micro_batch_size", "recompute", "dtype")


def _units_per_stage(plan):
    return [len(s.units) for s in plan.stages]


@pytest.mark.parametrize("engine", list(ENGINES))
def test_round_trip_gives_the_same_layout(engine, gpt, cluster):
    plan = solve(gpt, cluster, BATCH, PINS[engine])
    exported = export_plan(plan, engine, gpt, cluster)
    back = ENGINES[engine].parse(exported.text, f"exported.{engine}")
    priced = price(gpt, cluster, back, BATCH)
    mapped = exported.mapped
    for name in FIELDS:
        assert getattr(plan_layout(priced), name) == getattr(mapped, name), name
    assert tuple((sum(_units_per_stage(priced)[:k]), sum(_units_per_stage(priced)[:k + 1])) for k in range(len(priced.stages))) \
        == stage_bounds(mapped, gpt)
    if not exported.warnings:  # nothing changed: the engine runs the plan, and the price is the plan's own
        assert _units_per_stage(priced) == _units_per_stage(plan)
        # Same cost model, same inputs: equal up to float summation order.
        _assert_priced_as_planned(priced, plan, back)


def _assert_priced_as_planned(priced, plan, engine_layout) -> None:
    """The engine runs the plan: the same cost model and inputs price it at the plan's own time, up
    to float summation order; except the once-per-step ZeRO 1-2 collectives of an engine that runs
    them in buckets (Megatron-LM, DeepSpeed: `EngineLayout.dp_collectives`), not one per unit as the
    planner's runtime (FSDP2) does, and ZeRO 3's copy-out of each gather, which an engine gathering
    into the parameters' own storage (DeepSpeed: `EngineLayout.gather_copy_out`) does not make:
    the rest of the step alike; nor the bytes those collectives move where the engine holds
    weights and gradients in other dtypes than the planner's runtime (fp32 parameters under
    autocast: torchtitan gathers bf16 weights, Megatron-LM keeps bf16 weights and fp32 gradients;
    `Prediction.state_bytes`); nor the pass that adds each micro-batch's gradients to the step's,
    where the engine makes it otherwise (Megatron-Core fuses it into the weight-gradient GEMM) or
    in other dtypes (planner/cost/memory.py `accumulation_pass_bytes`); nor the TP all-gathers an
    engine makes in FP8 (torchtitan's Float8 TP, `EngineLayout.float8_tp_gather`), which can only
    save, at most the plan's TP communication."""
    if engine_layout.float8_tp_gather and plan.layout.tp_degree > 1 and plan.layout.sequence_parallel:
        saved = plan.prediction.iteration_time_s - priced.prediction.iteration_time_s
        assert 0 <= saved <= plan.prediction.breakdown_s["tp_comm"] * (1 + 1e-9)
        return
    bucketed = engine_layout.dp_collectives != "per-unit" and plan.layout.zero_stage in (1, 2)
    uncopied = not engine_layout.gather_copy_out and plan.layout.zero_stage == 3
    dtypes = priced.prediction.state_bytes != plan.prediction.state_bytes and plan.layout.dp_degree > 1
    accumulated = [p.prediction.breakdown_s["grad_accumulation"] for p in (priced, plan)]
    if not bucketed and not uncopied and not dtypes and accumulated[0] == accumulated[1]:
        assert priced.prediction.iteration_time_s == pytest.approx(plan.prediction.iteration_time_s, rel=1e-9)
        return
    rest = [p.prediction.iteration_time_s - p.prediction.breakdown_s["dp_comm"] - p.prediction.breakdown_s["grad_accumulation"]
            for p in (priced, plan)]
    assert rest[0] == pytest.approx(rest[1], rel=1e-9)


def test_megatron_and_torchtitan_say_these_plans_exactly(gpt, cluster):
    # Megatron runs ZeRO 1 as --use-distributed-optimizer and places embed/head where the DP put them;
    # torchtitan names every stage's modules.
    for engine in ("megatron", "torchtitan"):
        plan = solve(gpt, cluster, BATCH, PINS[engine])
        exported = export_plan(plan, engine, gpt, cluster)
        assert plan.stages[0].units[0] == "embed" and plan.stages[-1].units[-1] == "head"
        assert exported.warnings == []
        assert "--tensor-model-parallel-size 2" in exported.text or "tensor_parallel_degree = 2" in exported.text


def _plan_with_cuts(gpt, cuts: list[list[str]], **fields):
    """A priced plan with these cuts on 2 data-parallel pipelines (export re-prices on its cluster)."""
    layout = EngineLayout(pp_degree=len(cuts), tp_degree=1, zero_stage=1, micro_batch_size=1, global_batch_size=BATCH,
                          split=Split("units", tuple(tuple(c) for c in cuts)), **fields)
    return price(gpt, make_cluster(2 * len(cuts), gpu="a100-80gb"), layout)


UNITS = ["embed"] + [f"blocks.{i}" for i in range(6)] + ["norm", "head"]


def test_non_uniform_cuts_warn_with_their_price(gpt):
    plan = _plan_with_cuts(gpt, [UNITS[:2], UNITS[2:]])  # 2 + 7 units
    exported = export_plan(plan, "deepspeed", gpt)
    assert len(exported.warnings) == 1
    warning = exported.warnings[0]
    assert "[2, 7]" in warning and "uniform partition [5, 4]" in warning and "by the cost model" in warning
    assert '"partition": "uniform"' in exported.text
    # The re-priced layout is DeepSpeed's own split, and it is what the warning priced.
    assert stage_bounds(exported.mapped, gpt) == ((0, 5), (5, 9))


MEGATRON_1F1B = dict(overlap=megatron.overlap(interleaved=False))  # plans priced as Megatron-LM runs 1F1B


def test_a_translation_that_overflows_the_gpu_says_so(gpt, cluster):
    """An engine's layout is re-priced with its memory; where that memory exceeds the GPU's usable
    share the warning says it does not fit, not only the figure."""
    from dataclasses import replace

    from planner.engines.pricing import reprice_warning

    plan = solve(gpt, cluster, BATCH, PINS["accelerate"], top_k=1, dtype="bfloat16")
    fits = reprice_warning("same layout", plan, plan_layout(plan), gpt, cluster)
    assert "by the cost model" in fits and "does not fit" not in fits
    small = replace(cluster, gpu=replace(cluster.gpu, memory_bytes=max(plan.prediction.peak_memory_bytes) // 2))
    assert "which does not fit" in reprice_warning("same layout", plan, plan_layout(plan), gpt, small)


def test_megatron_non_uniform_cuts(gpt):
    # First/last stage sizes: Megatron's own flags, no warning.
    plan = _plan_with_cuts(gpt, [UNITS[:2], UNITS[2:5], UNITS[5:8] + ["head"]], **MEGATRON_1F1B)  # blocks 1, 3, 2
    exported = export_plan(plan, "megatron", gpt)
    assert exported.warnings == []
    assert "--decoder-first-pipeline-num-layers 1" in exported.text and "--decoder-last-pipeline-num-layers 2" in exported.text
    assert stage_bounds(megatron.parse(exported.text), gpt) == ((0, 2), (2, 5), (5, 9))
    # Any other cuts: the pipeline layout string, read back exactly.
    plan = _plan_with_cuts(gpt, [UNITS[:2], UNITS[2:3], UNITS[3:5], UNITS[5:]], **MEGATRON_1F1B)  # blocks 1, 1, 2, 2
    exported = export_plan(plan, "megatron", gpt)
    assert "--pipeline-model-parallel-layout 'Et|t|t*2|t*2L'" in exported.text
    assert stage_bounds(megatron.parse(exported.text), gpt) == ((0, 2), (2, 3), (3, 5), (5, 9))
    # The head cut off from the last block's stage: Megatron puts the output layer on the last stage
    # with the final norm, so the norm moves; the warning says so and prices it.
    plan = _plan_with_cuts(gpt, [UNITS[:4], UNITS[4:7] + ["norm"], ["head"]], **MEGATRON_1F1B)
    exported = export_plan(plan, "megatron", gpt)
    assert len(exported.warnings) == 1 and "['norm'] moved" in exported.warnings[0] and "by the cost model" in exported.warnings[0]


PER_LINE = """--tensor-model-parallel-size 2
--pipeline-model-parallel-size 2
--num-layers 6
--sequence-parallel
--recompute-granularity selective
--use-distributed-optimizer
--micro-batch-size 2
--global-batch-size 16
--bf16
"""
COMMAND = """# our launch script
torchrun --nproc-per-node 8 pretrain_gpt.py \\
    --tensor-model-parallel-size=2 --pipeline-model-parallel-size 2 \\
    --num-layers 6 --sequence-parallel --recompute-granularity selective \\
    --use-distributed-optimizer --micro-batch-size 2 --global-batch-size=16 --bf16 --lr 3e-4
"""


def test_megatron_arguments_parse_from_a_file_or_a_command_line(gpt, cluster, tmp_path):
    from planner.engines import read_config

    (tmp_path / "args.txt").write_text(PER_LINE)
    (tmp_path / "train.sh").write_text(COMMAND)
    a, b = read_config(tmp_path / "args.txt"), read_config(tmp_path / "train.sh")
    assert a == b
    assert (a.tp_degree, a.pp_degree, a.sequence_parallel, a.recompute, a.zero_stage, a.micro_batch_size, a.global_batch_size,
            a.dtype) == (2, 2, True, "selective", 1, 2, 16, "bfloat16")
    assert stage_bounds(a, gpt) == ((0, 4), (4, 9))  # 3 blocks each; embed first, norm and head last
    with pytest.raises(Exception, match="not a number"):
        megatron.parse("--tensor-model-parallel-size $TP\n")


def test_price_sets_a_configuration_beside_the_best_plan(gpt, cluster):
    layout = megatron.parse(PER_LINE.replace("--pipeline-model-parallel-size 2", "--pipeline-model-parallel-size 1"))
    result = compare(gpt, cluster, layout)
    assert result.theirs.layout.tp_degree == 2 and result.theirs.layout.pp_degree == 1
    assert result.best.prediction.iteration_time_s <= result.theirs.prediction.iteration_time_s
    lines = result.lines()
    assert lines[0].startswith("your configuration:") and lines[1].startswith("best plan:")
    if result.changes:
        assert " -> " in lines[2] and lines[2].startswith("change: ")


def test_cli_export_and_price(gpt, cluster, tmp_path):
    from typer.testing import CliRunner

    from planner.cli import app

    profile_path = gpt.save(tmp_path / "gpt.json")
    plan = solve(gpt, cluster, BATCH, PINS["megatron"], profile_path=str(profile_path))
    plan.save(tmp_path / "plan.json")
    runner = CliRunner()
    out = runner.invoke(app, ["export", str(tmp_path / "plan.json"), "--to", "megatron", "-o", str(tmp_path / "args.txt")])
    assert out.exit_code == 0, out.output
    # the profile computes under autocast (planner run's way), Megatron-LM in pure bf16: both commands say so
    assert "--precision pure" in " ".join(out.output.split())
    out = runner.invoke(app, ["price", "--from", str(tmp_path / "args.txt"), "--profile", str(profile_path),
                              "--gpus", "8", "--gpu", "a100-80gb"])
    assert out.exit_code == 0, out.output
    assert "your configuration:" in out.output and "best plan:" in out.output
    # and price prices what Megatron-LM computes: the model profiled again in pure bf16
    text = " ".join(out.output.split())
    assert "profiled again analytically with --precision pure" in text
    pure = profile_model(str(EXAMPLES / "gpt.py"), GPT, [1, 2], device="meta", gpu="a100-80gb", dtype="bfloat16",
                         precision="pure")
    expected = compare(pure, cluster, read_config(tmp_path / "args.txt"), profile_path=str(profile_path)).lines()[0]
    assert " ".join(expected.split()) in text


# --- The newer dimensions: expert parallelism, hybrid sharding, CPU offload, FP8 (and CP, not priced yet) ---

MOE = dict(n_layers=4, d_model=256, n_heads=4, vocab_size=256, seq_len=128, num_experts=8, top_k=2, moe_d_ff=512)
NEW_FIELDS = FIELDS + ("ep_degree", "cp_degree", "shard_degree", "offload", "float8")


@pytest.fixture(scope="module")
def gpt_h100():
    return profile_model(str(EXAMPLES / "gpt.py"), GPT, [1, 2], device="meta", gpu="h100-80gb", dtype="bfloat16")


@pytest.fixture(scope="module")
def moe_h100():
    return profile_model(str(EXAMPLES / "moe.py"), MOE, [1, 2], device="meta", gpu="h100-80gb", dtype="bfloat16")


@pytest.fixture(scope="module")
def new_plans(gpt_h100, moe_h100):
    """dimension -> (profile, cluster, solved plan carrying it)."""
    h100x8, h100x1 = make_cluster(8, 8, "h100-80gb"), make_cluster(1, 1, "h100-80gb")
    one = dict(pp=1, tp=1, micro_batch_size=1)
    return {
        "ep": (moe_h100, h100x8, solve(moe_h100, h100x8, BATCH, Pins(dp=8, ep=4, zero_stage=1, **one))),
        "hsdp": (gpt_h100, h100x8, solve(gpt_h100, h100x8, BATCH, Pins(dp=8, zero_stage=3, shard_degree=2, recompute="none", **one))),
        "offload": (gpt_h100, h100x1, solve(gpt_h100, h100x1, BATCH, Pins(zero_stage=3, offload=True), allow_offload=True)),
        "fp8": (gpt_h100, h100x8, solve(gpt_h100, h100x8, BATCH, PINS["megatron"], float8=True)),
    }


# (engine, dimension) -> what the file must say, and whether the engine runs the plan as it is (no priced
# warning). Each name is the engine's own (module docstrings of planner/engines/*.py give the sources).
NEW_EXPECTED = {
    ("megatron", "ep"): (["--expert-model-parallel-size 4", "--use-distributed-optimizer"], True),
    ("megatron", "hsdp"): (["--use-torch-fsdp2"], False),  # FSDP2 has no replica groups
    ("megatron", "offload"): (["--optimizer-cpu-offload", "--use-precision-aware-optimizer"], False),  # ZeRO 3 -> 1
    ("megatron", "fp8"): (["--fp8-format hybrid", "--fp8-recipe tensorwise"], True),
    ("torchtitan", "ep"): (["expert_parallel_degree = 4", "data_parallel_shard_degree = 8"], False),  # ZeRO 1 -> 2
    ("torchtitan", "hsdp"): (["data_parallel_replicate_degree = 4", "data_parallel_shard_degree = 2"], True),
    ("torchtitan", "offload"): (["data_parallel_shard_degree = 1"], False),  # one rank: no FSDP, no offload
    # pp 2 x ZeRO 1: FSDP2 unresharded, which a pipeline runs as ZeRO 1 (solve.py `PIPELINE_ZERO`)
    ("torchtitan", "fp8"): (['converters = ["float8"]', 'recipe_name = "tensorwise"'], True),
    # MoE(ep_size=4) is model code: a note, not a change; ZeRO 1 gathers the parameters inside its step
    ("deepspeed", "ep"): (['"stage": 1'], False),
    ("deepspeed", "hsdp"): (['"mics_shard_size": 2', '"stage": 3'], True),
    ("deepspeed", "offload"): (['"offload_optimizer"', '"offload_param"'], True),
    ("deepspeed", "fp8"): (['"autotp_size": 2'], False),  # sequence parallelism off; FP8 conversion is a note
    ("accelerate", "ep"): (["distributed_type: FSDP"], False),  # no expert parallelism
    ("accelerate", "hsdp"): (["parallelism_config_dp_replicate_size: 4", "parallelism_config_dp_shard_size: 2"], True),
    ("accelerate", "offload"): (["fsdp_offload_params: true"], True),
    ("accelerate", "fp8"): (["mixed_precision: fp8", "backend: AO"], False),  # pp x tp -> dp
}


def _read_back(engine: str, exported) -> EngineLayout:
    """The exported file parsed; for DeepSpeed, EP and FP8 come from the model code (the caller), as
    `read_config(..., ep_degree=, float8=)` takes them."""
    from planner.engines.common import with_defaults

    back = ENGINES[engine].parse(exported.text, f"exported.{engine}")
    if engine == "deepspeed":
        back = with_defaults(back, ep_degree=exported.mapped.ep_degree, float8=exported.mapped.float8)
    return back


@pytest.mark.parametrize("engine", list(ENGINES))
@pytest.mark.parametrize("dimension", ["ep", "hsdp", "offload", "fp8"])
def test_new_dimensions_round_trip(engine, dimension, new_plans):
    profile, cluster, plan = new_plans[dimension]
    exported = export_plan(plan, engine, profile, cluster)
    snippets, exact = NEW_EXPECTED[(engine, dimension)]
    for snippet in snippets:
        assert snippet in exported.text, (snippet, exported.text)
    priced_warnings = [w for w in exported.warnings if "cannot express" in w]
    assert (not priced_warnings) == exact, exported.warnings
    assert all("by the cost model" in w for w in priced_warnings)
    back = _read_back(engine, exported)
    priced = price(profile, cluster, back, BATCH)
    for name in NEW_FIELDS:
        assert getattr(plan_layout(priced), name) == getattr(exported.mapped, name), name
    if exact and not exported.warnings:
        # The engine runs the plan: same cost model, same inputs, equal up to float summation order.
        _assert_priced_as_planned(priced, plan, back)


def test_deepspeed_says_what_the_model_code_sets(new_plans):
    profile, cluster, plan = new_plans["ep"]
    exported = export_plan(plan, "deepspeed", profile, cluster)
    notes = [w for w in exported.warnings if "cannot express" not in w]  # (the step's gather in series is priced)
    assert notes == ["expert parallelism: build the MoE layers with deepspeed.moe.layer.MoE(..., ep_size=4) "
                     "(the JSON has no key for it)"]
    assert not any("expert" in w for w in exported.warnings if "cannot express" in w)
    assert "ep_size" not in exported.text  # no invented config key
    assert ENGINES["deepspeed"].parse(exported.text).ep_degree == 1  # the JSON alone cannot say it


TITAN_HSDP = """
[model]
converters = ["float8"]
[float8]
recipe_name = "rowwise"
[parallelism]
data_parallel_replicate_degree = 2
data_parallel_shard_degree = -1
fsdp_reshard_after_forward = "always"
[training]
local_batch_size = 2
global_batch_size = 16
enable_cpu_offload = true
[activation_checkpoint]
mode = "full"
"""


def test_price_reads_and_prices_the_new_dimensions(gpt_h100):
    from planner.engines import torchtitan

    cluster = make_cluster(8, 8, "h100-80gb")
    layout = torchtitan.parse(TITAN_HSDP)
    assert (layout.replicate_degree, layout.shard_degree, layout.offload, layout.float8) == (2, None, True, True)
    assert any("rowwise" in n for n in layout.notes)
    theirs = price(gpt_h100, cluster, layout)
    assert (theirs.layout.dp_degree, theirs.layout.shard_degree, theirs.layout.zero_stage) == (8, 4, 3)
    assert theirs.training.offload == "cpu" and theirs.training.float8
    # Each dimension is priced, not only recorded: taking one away changes the prediction.
    from dataclasses import replace as copy

    for without in (dict(offload=False), dict(float8=False), dict(replicate_degree=None)):
        other = price(gpt_h100, cluster, copy(layout, **without))
        assert other.prediction.iteration_time_s != theirs.prediction.iteration_time_s, without
    result = compare(gpt_h100, cluster, layout)
    assert result.best.training.float8  # compared at the same numerics
    assert result.best.prediction.iteration_time_s <= theirs.prediction.iteration_time_s


def test_megatron_reads_ep_fp8_and_partial_distributed_optimizer(moe_h100, gpt_h100):
    args = megatron.parse("--expert-model-parallel-size 2 --use-distributed-optimizer --micro-batch-size 1 "
                          "--global-batch-size 16 --bf16 --num-layers 4")
    assert args.ep_degree == 2 and args.zero_stage == 1
    priced = price(moe_h100, make_cluster(8, 8, "h100-80gb"), args)
    assert priced.layout.ep_degree == 2 and priced.stages[0].experts  # each EP rank holds its share of experts
    fp8 = megatron.parse("--fp8-format hybrid --use-distributed-optimizer --num-distributed-optimizer-instances 2 "
                         "--optimizer-cpu-offload --use-precision-aware-optimizer --micro-batch-size 1 --bf16")
    assert fp8.float8 and fp8.offload and fp8.replicate_degree == 2
    assert any("--fp8-recipe delayed priced as torchao tensorwise" in n for n in fp8.notes)  # Megatron's default recipe
    priced = price(gpt_h100, make_cluster(8, 8, "h100-80gb"), fp8, BATCH)
    assert (priced.layout.shard_degree, priced.training.offload, priced.training.float8) == (4, "cpu", True)


def test_context_parallelism_maps_and_is_priced(new_plans):
    from planner.engines.pricing import resolve

    profile, cluster, plan = new_plans["hsdp"]
    cp_plan = plan.model_copy(deep=True)
    cp_plan.layout.cp_degree = 2
    # Same global batch over dp / cp = 4 sample-taking ranks (planner/plan.py): twice the micro-batches.
    cp_plan.batch.num_microbatches = BATCH // (4 * cp_plan.batch.micro_batch_size)
    texts = {"megatron": "--context-parallel-size 2", "torchtitan": "context_parallel_degree = 2",
             "accelerate": "parallelism_config_cp_size: 2"}
    for engine, snippet in texts.items():
        exported = export_plan(cp_plan, engine)
        assert snippet in exported.text, exported.text
        back = ENGINES[engine].parse(exported.text)
        assert back.cp_degree == 2
        resolved, _ = resolve(back, cluster, BATCH)
        assert (resolved.dp, resolved.micro_batch, resolved.num_microbatches) == (8, 1, cp_plan.batch.num_microbatches)
        priced = price(profile, cluster, back, BATCH)
        assert priced.layout.cp_degree == 2 and priced.prediction.breakdown_s["cp_comm"] > 0


def test_megatron_hybrid_sharding_is_the_partial_distributed_optimizer(gpt_h100):
    # ZeRO 1 over groups of 2 of 8 dp ranks: 4 copies of the distributed optimizer, said exactly.
    cluster = make_cluster(8, 8, "h100-80gb")
    plan = solve(gpt_h100, cluster, BATCH, Pins(pp=1, tp=1, dp=8, micro_batch_size=1, zero_stage=1, shard_degree=2))
    exported = export_plan(plan, "megatron", gpt_h100, cluster)
    assert exported.warnings == [] and "--num-distributed-optimizer-instances 4" in exported.text
    back = megatron.parse(exported.text)
    priced = price(gpt_h100, cluster, back, BATCH)
    assert (priced.layout.zero_stage, priced.layout.shard_degree) == (1, 2)
    _assert_priced_as_planned(priced, plan, back)  # same model and inputs


def test_hybrid_sharding_and_offload_spellings_read_back(gpt_h100):
    from planner.engines import accelerate, deepspeed
    from planner.engines.pricing import resolve

    fsdp1 = accelerate.parse("distributed_type: FSDP\nnum_machines: 2\nnum_processes: 16\nmixed_precision: bf16\n"
                             "fsdp_config:\n  fsdp_sharding_strategy: HYBRID_SHARD\n  fsdp_offload_params: true\n")
    assert (fsdp1.zero_stage, fsdp1.shard_degree, fsdp1.offload) == (3, 8, True)  # shard inside each 8-GPU node
    ds = deepspeed.parse('{"train_batch_size": 16, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 2, '
                         '"zero_optimization": {"stage": 3, "mics_shard_size": 4, "zero_hpz_partition_size": 8, '
                         '"offload_optimizer": {"device": "nvme"}}}')
    assert (ds.zero_stage, ds.shard_degree, ds.offload) == (3, 4, True)
    assert any("nvme" in n for n in ds.notes) and any("zero_hpz_partition_size" in n for n in ds.notes)
    assert any("without offload_param" in n for n in ds.notes)
    resolved, _ = resolve(ds, make_cluster(8, 8, "h100-80gb"), None)
    assert (resolved.dp, resolved.shard_degree) == (8, 4)


def test_expert_tp_round_trips_through_megatron_and_torchtitan(moe_h100):
    """Expert TP (pinned) is written in each engine's name and read back; Megatron is told the
    experts' TP size whenever EP is on, since unset it would split them over the whole TP group."""
    cluster = make_cluster(8, 8, "h100-80gb")
    plan = solve(moe_h100, cluster, BATCH, Pins(pp=1, tp=2, dp=4, ep=2, expert_tp=2, micro_batch_size=1, zero_stage=0,
                                               sequence_parallel=False))
    assert plan.layout.expert_tp_degree == 2
    expected = {"megatron": "--expert-tensor-parallel-size 2", "torchtitan": "expert_tensor_parallel_degree = 2"}
    for engine, snippet in expected.items():
        exported = export_plan(plan, engine, moe_h100, cluster)
        assert snippet in exported.text, exported.text
        assert _read_back(engine, exported).expert_tp_degree == 2
    whole = solve(moe_h100, cluster, BATCH, Pins(pp=1, tp=2, dp=4, ep=2, micro_batch_size=1, zero_stage=0, sequence_parallel=True))
    assert "--expert-tensor-parallel-size 1" in export_plan(whole, "megatron", moe_h100, cluster).text
    unset = megatron.parse("--tensor-model-parallel-size 2 --expert-model-parallel-size 2 --num-experts 8 --bf16")
    assert unset.expert_tp_degree == 1 and any("--expert-tensor-parallel-size not given" in n for n in unset.notes)


@pytest.mark.parametrize("engine,ring,other", [("megatron", "--cp-comm-type p2p", "--cp-comm-type allgather"),
                                               ("torchtitan", 'context_parallel_rotate_method = "alltoall"',
                                                'context_parallel_rotate_method = "allgather"')])
def test_cp_attention_round_trips(engine, ring, other, gpt_h100):
    """A CP plan's algorithm in the engine's own words (Megatron-LM's --cp-comm-type, torchtitan's
    context_parallel_rotate_method) and back; the solved one prices to the plan's time."""
    cluster = make_cluster(8, 8, "h100-80gb")
    plan = solve(gpt_h100, cluster, BATCH, Pins(pp=1, tp=1, dp=8, cp=2, micro_batch_size=1))
    for algorithm in ("ring", "all-gather"):
        data = plan.model_dump()
        data["layout"]["cp_algorithm"] = algorithm
        variant = type(plan).model_validate(data)
        exported = export_plan(variant, engine, gpt_h100, cluster)
        assert (ring if algorithm == "ring" else other) in exported.text, exported.text
        back = _read_back(engine, exported)
        assert back.cp_degree == 2 and back.cp_algorithm == algorithm
        priced = price(gpt_h100, cluster, back, BATCH)
        assert plan_layout(priced).cp_algorithm == algorithm
        if algorithm == plan.layout.cp_algorithm and not exported.warnings:
            _assert_priced_as_planned(priced, plan, back)


def test_megatron_all_to_all_cp_is_priced_as_the_ring_with_a_note():
    from planner.engines import megatron

    layout = megatron.parse("--context-parallel-size 2 --cp-comm-type a2a --tensor-model-parallel-size 1")
    assert layout.cp_algorithm == "ring" and any("a2a" in n for n in layout.notes)
    assert megatron.parse("--context-parallel-size 2").cp_algorithm == "ring"  # Megatron-LM's default p2p
    assert megatron.parse("--tensor-model-parallel-size 2").cp_algorithm == "all-gather"  # no CP: unused


def test_op_recompute_through_the_engines(gpt_h100):
    """torchtitan's selective_ac_option "op" is mode `op` both ways; Megatron-LM and DeepSpeed, which
    have no op-level mode, get full recomputation (within the plan's memory) with the change priced;
    `planner price` sets a Megatron-LM file beside a best plan that uses Megatron-LM's modes only."""
    from planner.engines import megatron, torchtitan
    from planner.engines.pricing import compare

    cluster = make_cluster(8, 8, "h100-80gb")
    plan = solve(gpt_h100, cluster, BATCH, Pins(pp=1, tp=1, dp=8, micro_batch_size=1, recompute="op", zero_stage=1))
    titan = export_plan(plan, "torchtitan", gpt_h100, cluster)
    assert 'selective_ac_option = "op"' in titan.text and torchtitan.parse(titan.text).recompute == "op"
    mega = export_plan(plan, "megatron", gpt_h100, cluster)
    assert "--recompute-granularity full" in mega.text and any("recompute op" in w for w in mega.warnings)
    result = compare(gpt_h100, cluster, megatron.parse(mega.text), BATCH)
    assert result.best is not None
    assert {r for s in result.best.stages for r in s.unit_modes().values()} <= {"none", "selective", "full"}


def test_engines_that_split_every_head_get_a_degree_that_divides_them(tmp_path):
    """A plan at tp 4 for a Llama with 2 key/value heads keeps its attentions replicated (the planner's
    runtime can; planner/solver/intra_op.py `tp_obstacles`). Megatron-LM and torchtitan split every
    head and would refuse tp 4: the export maps it to tp 2 (dp doubled), says why and prices it;
    `planner price` refuses such a configuration before any work, naming a degree that divides."""
    from typer.testing import CliRunner

    from planner.cli import app

    llama = profile_model(str(EXAMPLES / "llama.py"), {}, [1, 2], device="meta", gpu="a100-80gb", dtype="bfloat16")
    plan = solve(llama, make_cluster(4, 4, "a100-80gb"), 8, Pins(tp=4, micro_batch_size=2))
    for engine in ("megatron", "torchtitan"):
        out = export_plan(plan, engine, llama)
        assert (out.mapped.tp_degree, out.mapped.dp_degree) == (2, 2), engine
        assert any("tp 4 -> 2, dp 1 -> 2" in w and "projects 2 heads" in w and "by the cost model" in w for w in out.warnings)
        assert not any("TP layout:" in w for w in out.warnings)  # the old degree's replicated modules
        path = tmp_path / ("args.txt" if engine == "megatron" else "job.toml")
        path.write_text(out.text)
        assert read_config(path, engine).tp_degree == 2
    assert export_plan(plan, "deepspeed", llama).mapped.tp_degree == 4  # AutoTP: not said to split every head
    kept = export_plan(plan, "megatron")  # no profile to check the heads with: the plan's own degree, and its layout said
    assert kept.mapped.tp_degree == 4 and any("TP layout:" in w and "replicated" in w for w in kept.warnings)
    profile_path = llama.save(tmp_path / "llama.json")
    (tmp_path / "tp4.txt").write_text((tmp_path / "args.txt").read_text().replace(
        "--tensor-model-parallel-size 2", "--tensor-model-parallel-size 4"))
    done = CliRunner().invoke(app, ["price", "--from", str(tmp_path / "tp4.txt"), "-p", str(profile_path), "--gpus", "4"])
    assert done.exit_code == 1 and "does not split the model's attention heads whole" in str(done.exception), done.output
    assert "(2 does)" in str(done.exception)


def test_torchtitan_shards_over_the_cp_ranks(gpt_h100):
    """torchtitan applies FSDP wherever data_parallel_shard_degree or context_parallel_degree is
    above 1 (parallel_dims.py `fsdp_enabled`, over the "dp_shard_cp" ranks): its job files read so,
    and a ZeRO 0 plan with CP is exported with that change said."""
    from planner.engines import torchtitan

    only_cp = torchtitan.parse("[parallelism]\ndata_parallel_shard_degree = 1\ncontext_parallel_degree = 8\n")
    assert (only_cp.zero_stage, only_cp.dp_degree, only_cp.cp_degree, only_cp.shard_degree) == (3, 8, 8, None)
    hybrid = torchtitan.parse("[parallelism]\ndata_parallel_replicate_degree = 2\ndata_parallel_shard_degree = 1\n"
                              "context_parallel_degree = 4\n")
    assert (hybrid.zero_stage, hybrid.dp_degree, hybrid.shard_degree) == (3, 8, 4)
    assert torchtitan.parse("[parallelism]\ndata_parallel_shard_degree = 1\n").zero_stage == 0
    cluster = make_cluster(8, 8, "h100-80gb")
    plan = solve(gpt_h100, cluster, BATCH, Pins(pp=1, tp=1, dp=8, cp=2, micro_batch_size=1, zero_stage=0))
    exported = export_plan(plan, "torchtitan", gpt_h100, cluster)
    assert any("over the 2 context-parallel ranks" in w for w in exported.warnings), exported.warnings
    back = torchtitan.parse(exported.text)
    assert (back.zero_stage, back.dp_degree, back.cp_degree, back.shard_degree) == (2, 8, 2, 2)
    assert price(gpt_h100, cluster, back, BATCH).layout.zero_stage == 2


def test_megatron_configurations_are_priced_with_its_attention(gpt_h100):
    """`planner price` of a Megatron-LM configuration prices attention as Megatron-Core's published
    H100 runs show it (planner/engines/megatron.py `stack_gpu`), with an analytic profile made again
    for that spec (per-op times); other engines price the preset's kernel rates."""
    from planner.cost.compute import ComputeModel
    from planner.engines import as_the_engine_computes, as_the_engine_runs
    from planner.engines.megatron import stack_gpu

    cluster = make_cluster(8, 8, "h100-80gb")
    profile, priced_on, notes = as_the_engine_runs(gpt_h100, cluster, "megatron")
    assert priced_on.gpu == stack_gpu(cluster.gpu) != cluster.gpu
    assert profile.target_gpu_spec["attention_causal_ratio"] == 0.5 and ComputeModel(profile, priced_on.gpu).source == "profiled"
    assert any("Megatron-Core's published runs" in n for n in notes)
    same_profile, same_cluster, _ = as_the_engine_runs(gpt_h100, cluster, "torchtitan")
    assert same_cluster == cluster
    a100 = make_cluster(8, 8, "a100-80gb")
    assert as_the_engine_runs(gpt_h100, a100, "megatron")[1] == a100  # the GEMM rate there already
    mega = megatron.parse("--tensor-model-parallel-size 2 --micro-batch-size 1 --global-batch-size 16 --bf16 --use-flash-attn\n")
    slower = price(profile, priced_on, mega, BATCH).prediction.iteration_time_s
    pure, _ = as_the_engine_computes(gpt_h100, "megatron")  # the same profile at the preset's kernel rates
    assert slower >= price(pure, cluster, mega, BATCH).prediction.iteration_time_s  # (this small GPT: memory-bound, equal)


def test_torchtitan_compiles_its_loss_with_the_model():
    """torchtitan compiles its cross-entropy when compile is on (components/loss.py; [compile]
    components, default ["model", "loss"]): its loss is priced as compiled, holding the logits and
    their gradient, far under the eager loss the planner's runtime runs."""
    from planner.cost.memory import loss_bytes
    from planner.engines import torchtitan

    assert torchtitan.parse("[compile]\nenable = true\n").loss_kernel == "compiled"
    assert torchtitan.parse("[training]\ncompile = true\n").loss_kernel == "compiled"  # the older key
    assert torchtitan.parse('[compile]\nenable = true\ncomponents = ["model"]\n').loss_kernel == "eager"
    assert torchtitan.parse("[training]\nlocal_batch_size = 2\n").loss_kernel == "eager"
    assert loss_bytes(100.0, 2, 1, "compiled") == 200.0 < loss_bytes(100.0, 2, 1) == 700.0
