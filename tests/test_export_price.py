"""planner export / planner price (planner/engines/): a plan written in each engine's terms reads back
as the same layout, what an engine cannot express is warned about with its price, and Megatron-LM
arguments parse from either shape people keep them in. Analytic profiles: seconds, not hardware."""

from __future__ import annotations

import pytest

from planner.cluster import make_cluster
from planner.engines import ENGINES, export_plan, megatron
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
                       recompute="selective", zero_stage=2, sequence_parallel=True),
    "megatron": Pins(pp=2, tp=2, dp=2, micro_batch_size=1, schedule="1f1b", recompute="full", zero_stage=1,
                     sequence_parallel=True),
    "deepspeed": Pins(pp=2, tp=1, dp=4, micro_batch_size=2, schedule="1f1b", recompute="full", zero_stage=1),
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
        assert priced.prediction.iteration_time_s == pytest.approx(plan.prediction.iteration_time_s, rel=1e-9)


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


def test_megatron_non_uniform_cuts(gpt):
    # First/last stage sizes: Megatron's own flags, no warning.
    plan = _plan_with_cuts(gpt, [UNITS[:2], UNITS[2:5], UNITS[5:8] + ["head"]])  # blocks 1, 3, 2
    exported = export_plan(plan, "megatron", gpt)
    assert exported.warnings == []
    assert "--decoder-first-pipeline-num-layers 1" in exported.text and "--decoder-last-pipeline-num-layers 2" in exported.text
    assert stage_bounds(megatron.parse(exported.text), gpt) == ((0, 2), (2, 5), (5, 9))
    # Any other cuts: the pipeline layout string, read back exactly.
    plan = _plan_with_cuts(gpt, [UNITS[:2], UNITS[2:3], UNITS[3:5], UNITS[5:]])  # blocks 1, 1, 2, 2
    exported = export_plan(plan, "megatron", gpt)
    assert "--pipeline-model-parallel-layout 'Et|t|t*2|t*2L'" in exported.text
    assert stage_bounds(megatron.parse(exported.text), gpt) == ((0, 2), (2, 3), (3, 5), (5, 9))
    # The head cut off from the last block's stage: Megatron puts the output layer on the last stage
    # with the final norm, so the norm moves; the warning says so and prices it.
    plan = _plan_with_cuts(gpt, [UNITS[:4], UNITS[4:7] + ["norm"], ["head"]])
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
    out = runner.invoke(app, ["price", "--from", str(tmp_path / "args.txt"), "--profile", str(profile_path),
                              "--gpus", "8", "--gpu", "a100-80gb"])
    assert out.exit_code == 0, out.output
    assert "your configuration:" in out.output and "best plan:" in out.output
