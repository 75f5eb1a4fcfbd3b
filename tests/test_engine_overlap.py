"""Each engine's file says which communication it hides behind compute, and `planner price` prices
exactly that (planner/engines/*.py `overlap`, planner/cost/overlap.py)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from planner.cluster import make_cluster
from planner.cost.overlap import SERIAL, Overlap
from planner.engines import deepspeed, megatron, torchtitan
from planner.engines.common import EngineLayout
from planner.engines.pricing import price
from planner.plan_report import print_plan
from planner.profiler import profile_model
from tests.conftest import EXAMPLES

MEGATRON = "--tensor-model-parallel-size 1\n--pipeline-model-parallel-size {pp}\n--num-layers 4\n--micro-batch-size 1\n" \
           "--global-batch-size 16\n--bf16\n"


@pytest.mark.parametrize("extra, pp, expected", [
    ("", 1, SERIAL),  # Megatron-LM's defaults: every --overlap-* flag off
    ("--overlap-grad-reduce\n", 1, Overlap(True, False, False, False)),
    ("--use-distributed-optimizer\n--overlap-grad-reduce\n--overlap-param-gather\n--tp-comm-overlap\n", 1,
     Overlap(True, True, False, True)),
    ("", 2, SERIAL),  # non-interleaved 1F1B: no p2p overlap (validate_args turns it off)
    ("--num-layers-per-virtual-pipeline-stage 1\n", 2, Overlap(False, False, True, False)),  # interleaved: on by default
    ("--num-layers-per-virtual-pipeline-stage 1\n--no-overlap-p2p-communication\n", 2, SERIAL),
    ("--use-torch-fsdp2\n", 1, Overlap(True, True, False, False)),  # FSDP2's own per-unit overlap
])
def test_megatron_reads_its_overlap_flags(extra, pp, expected):
    assert megatron.parse(MEGATRON.format(pp=pp) + extra).overlap == expected


def _ds(zero: dict, pipeline: dict | None = None) -> str:
    config = {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 2,
              "zero_optimization": zero, "bf16": {"enabled": True}}
    if pipeline:
        config["pipeline"] = pipeline
    return json.dumps(config)


@pytest.mark.parametrize("text, expected", [
    # The pipeline engine: blocking sends, gradients reduced after the last micro-batch, whatever overlap_comm says.
    (_ds({"stage": 1, "overlap_comm": True}, {"stages": 2}), SERIAL),
    (_ds({"stage": 0}), SERIAL),  # the engine's all-reduce after the backward
    (_ds({"stage": 2}), SERIAL),  # overlap_comm unset: off below stage 3
    (_ds({"stage": 2, "overlap_comm": True}), Overlap(True, False, False, False)),  # ZeRO 2 gathers inside the step
    (_ds({"stage": 3}), Overlap(True, True, False, False)),  # stage 3: overlap_comm and prefetch on
    (_ds({"stage": 3, "overlap_comm": False, "stage3_prefetch_bucket_size": 0}), SERIAL),
])
def test_deepspeed_reads_its_overlap(text, expected):
    assert deepspeed.parse(text).overlap == expected


def test_torchtitan_async_tp_needs_compile():
    base = "[parallelism]\ntensor_parallel_degree = 2\nenable_async_tensor_parallel = true\n"
    assert torchtitan.parse(base + "[compile]\nenable = true\n").overlap == Overlap(tp_comm=True)
    uncompiled = torchtitan.parse(base)
    assert uncompiled.overlap is None and any("without the model compiled" in n for n in uncompiled.notes)
    loss_only = torchtitan.parse(base + '[compile]\nenable = true\ncomponents = ["loss"]\n')  # the model runs eager
    assert loss_only.overlap is None and loss_only.loss_kernel == "compiled"
    assert torchtitan.parse("[parallelism]\ndata_parallel_shard_degree = -1\n").overlap is None  # FSDP2's: the runtime's


@pytest.fixture(scope="module")
def gpt():
    return profile_model(EXAMPLES / "gpt.py", {"n_layers": 4, "d_model": 1024, "n_heads": 16, "vocab_size": 8192,
                                               "seq_len": 512}, [1], device="meta", gpu="a100-80gb", dtype="bfloat16")


def _layout(pp: int, overlap: Overlap | None) -> EngineLayout:
    return EngineLayout(pp_degree=pp, tp_degree=1, zero_stage=1, micro_batch_size=1, global_batch_size=16,
                        dtype="bfloat16", overlap=overlap)


def test_price_charges_what_the_engine_leaves_in_series(gpt):
    cluster = make_cluster(16, 8, "a100-80gb")  # two nodes: the gradient all-reduce crosses the network
    hidden, serial = (price(gpt, cluster, _layout(1, o)) for o in (Overlap(), SERIAL))
    assert hidden.prediction.overlap == ["grad_reduce", "param_gather", "pipeline_p2p"]
    assert serial.prediction.overlap == []
    # Everything but the data-parallel collectives is the same step.
    rest = [p.prediction.iteration_time_s - p.prediction.breakdown_s["dp_comm"] for p in (hidden, serial)]
    assert rest[0] == pytest.approx(rest[1], rel=1e-9)
    assert serial.prediction.breakdown_s["dp_comm"] > hidden.prediction.breakdown_s["dp_comm"] > 0
    # A pipeline whose sends block pays them on every micro-batch (in the sending stage's time), not
    # only in the fill and drain.
    async_p2p, blocking = (price(gpt, cluster, _layout(2, o)) for o in (Overlap(), deepspeed.overlap(1, pp=2)))
    assert blocking.prediction.stage_time_s[0] > async_p2p.prediction.stage_time_s[0]
    assert blocking.prediction.stage_time_s[1] == pytest.approx(async_p2p.prediction.stage_time_s[1], rel=1e-9)
    assert blocking.prediction.iteration_time_s > async_p2p.prediction.iteration_time_s


def test_show_says_what_was_overlapped(gpt, capsys):
    from rich.console import Console

    plan = price(gpt, make_cluster(8, 8, "a100-80gb"), _layout(2, deepspeed.overlap(1, pp=2)))
    print_plan(plan, Console(width=200))
    out = capsys.readouterr().out
    assert "communication overlapped with compute: none; in series: grad_reduce, param_gather, pipeline_p2p, tp_comm" in out


def test_deepspeed_zero3_holds_submodules_not_units():
    """DeepSpeed's ZeRO 3 gathers a submodule's parameters at a time and reduces through a bucket
    (planner/cost/memory.py `LiveParameters`): a model whose layers are far larger than its
    bounds is held at the bounds, one whose layers are smaller as FSDP holds them."""
    from planner.cost.memory import LiveParameters, gathered_bytes

    layer, pair, tensor = 5e9, 1e10, 1.7e9  # a 530B model's layer, two of them, its largest matrix
    fsdp = gathered_bytes(1e11, layer, pair, "float16", 3, 64, copy_out=False)
    assert fsdp == 2 * pair + 2 * layer
    live = LiveParameters()
    ds = gathered_bytes(1e11, layer, pair, "float16", 3, 64, copy_out=False, live=live, largest_parameter=tensor)
    assert ds == 2 * (tensor + live.prefetch) + 2 * (tensor + live.reduce_bucket)
    small = gathered_bytes(1e9, 1e7, 2e7, "float16", 3, 64, copy_out=False, live=live, largest_parameter=4e6)
    assert small == gathered_bytes(1e9, 1e7, 2e7, "float16", 3, 64, copy_out=False)
    # FSDP2 copies a unit out of its all-gather buffer: two copies of a unit where that is more than a pair.
    assert gathered_bytes(1e9, 1e7, 1.5e7, "float16", 3, 64) == 2 * 2e7 + 2 * 1e7
    # Read from the config, DeepSpeed's defaults where it is silent.
    assert deepspeed.parse(_ds({"stage": 3})).zero3_live == live
    assert deepspeed.parse(_ds({"stage": 3, "stage3_max_live_parameters": 3e8})).zero3_live.max_live == 3e8
    assert deepspeed.parse(_ds({"stage": 2})).zero3_live is None


def test_a_deepspeed_zero3_config_is_priced_with_less_gathered_than_fsdp():
    # Layers far larger than the bounds, a small vocabulary (its tied embedding is held whole by both).
    gpt = profile_model(EXAMPLES / "gpt.py", {"n_layers": 2, "d_model": 2048, "n_heads": 16, "vocab_size": 1024,
                                              "seq_len": 256}, [1], device="meta", gpu="a100-80gb", dtype="bfloat16")
    cluster = make_cluster(8, 8, "a100-80gb")
    text = _ds({"stage": 3, "stage3_max_live_parameters": 1e6, "stage3_prefetch_bucket_size": 1e5,
                "reduce_bucket_size": 1e6})
    ds = price(gpt, cluster, deepspeed.parse(text))
    fsdp = price(gpt, cluster, replace(deepspeed.parse(text), zero3_live=None))
    terms = [p.prediction.memory_terms_bytes[0]["communication"] for p in (ds, fsdp)]
    assert terms[0] < terms[1]
    assert ds.prediction.iteration_time_s == pytest.approx(fsdp.prediction.iteration_time_s, rel=1e-9)


def test_accumulation_pass_bytes_per_stack():
    """Adding a micro-batch's gradients to the step's (planner/cost/memory.py `accumulation_pass_bytes`)."""
    from planner.cost.memory import Precision, accumulation_pass_bytes

    fp32, megatron_bf16 = Precision.of("float32"), Precision.of("bfloat16", grad="float32")
    assert accumulation_pass_bytes("autograd", fp32, 1) == 0.0  # one micro-batch: the gradient stays as made
    assert accumulation_pass_bytes("autograd", fp32, 4) == 3 * 4 * 3 / 4  # later ones added in place
    assert accumulation_pass_bytes("buffer", megatron_bf16, 1) == 2 + 2 * 4  # bf16 read, fp32 buffer read and written
    assert accumulation_pass_bytes("fused", megatron_bf16, 8) == 0.0
    with pytest.raises(ValueError):
        accumulation_pass_bytes("unknown", fp32, 2)


def test_engines_say_how_they_accumulate():
    assert megatron.parse(MEGATRON.format(pp=1)).grad_accumulation == "fused"  # Megatron-Core's default
    assert megatron.parse(MEGATRON.format(pp=1) + "--no-gradient-accumulation-fusion\n").grad_accumulation == "buffer"
    bf16_fp32 = json.loads(_ds({"stage": 1}))
    bf16_fp32["data_types"] = {"grad_accum_dtype": "fp32"}
    layout = deepspeed.parse(json.dumps(bf16_fp32))  # BF16_Optimizer: fp32 gradients, reduced in bf16
    assert (layout.grad_accumulation, layout.grad_dtype, layout.reduce_dtype) == ("buffer", "float32", "bfloat16")
    assert deepspeed.parse(_ds({"stage": 1})).grad_accumulation == "autograd"  # its .grad, as the runtime


def test_the_accumulation_pass_is_charged_once_per_micro_batch(gpt):
    cluster = make_cluster(8, 8, "a100-80gb")
    layout = EngineLayout(pp_degree=1, tp_degree=1, zero_stage=0, micro_batch_size=1, global_batch_size=32,
                          dtype="bfloat16", param_dtype="float32")  # fp32 weights and gradients, as the runtime's
    autograd, fused = (price(gpt, cluster, replace(layout, grad_accumulation=mode)) for mode in ("autograd", "fused"))
    m = 32 // 8
    trained = sum(u.num_parameters for u in gpt.units)
    expected = (m - 1) * 3 * 4 * trained / cluster.gpu.achievable_bandwidth
    assert autograd.prediction.breakdown_s["grad_accumulation"] == pytest.approx(expected, rel=1e-6)
    assert fused.prediction.breakdown_s["grad_accumulation"] == 0.0
    assert autograd.prediction.iteration_time_s - fused.prediction.iteration_time_s == pytest.approx(expected, rel=1e-6)


def test_async_tp_hides_each_collective_behind_its_own_gemms_only():
    """Async TP decomposes a collective with the GEMM it feeds or follows: one chunk's transfer
    is always exposed, and where the transfers outlast that GEMM, the difference. A narrow model at
    TP 8 (the attention projections' GEMMs far shorter than their gathers) keeps more exposed than
    its whole unit's compute would hide; the serial collectives bound it above."""
    from planner.solver.intra_op import async_exposed_s

    assert async_exposed_s(8.0, 100.0, 8) == 1.0  # hidden but for one chunk
    assert async_exposed_s(8.0, 4.0, 8) == pytest.approx(8.0 - 4.0 * 7 / 8)  # the GEMM too short
    assert async_exposed_s(0.0, 4.0, 8) == 0.0
    narrow = profile_model(EXAMPLES / "llama.py", {"n_layers": 2, "d_model": 512, "n_heads": 8, "n_kv_heads": 2,
                                                   "d_ff": 4096, "vocab_size": 1024, "seq_len": 2048}, [4],
                           device="meta", gpu="h100-80gb", dtype="bfloat16")
    cluster = make_cluster(8, 8, "h100-80gb")
    layout = EngineLayout(pp_degree=1, tp_degree=8, dp_degree=1, zero_stage=1, sequence_parallel=True, micro_batch_size=4,
                          global_batch_size=4, dtype="bfloat16")
    serial, overlapped = (price(narrow, cluster, replace(layout, overlap=o)).prediction.breakdown_s["tp_comm"]
                          for o in (SERIAL, Overlap(tp_comm=True)))
    whole_unit = serial / 8  # what hiding behind the whole unit's compute left: the first chunk of each
    assert whole_unit * 1.5 < overlapped < serial
