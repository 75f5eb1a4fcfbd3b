"""How a stack holds and moves weights and gradients (planner/cost/memory.py `Precision`): the
planner's runtime trains 16-bit plans under autocast over fp32 parameters, so its gradients,
their reduction and ZeRO's gathers are fp32; Megatron-LM keeps an fp32 gradient buffer in bf16;
torchtitan gathers bf16 weights and reduces in fp32; DeepSpeed and Accelerate's FSDP move 16 bits."""

from __future__ import annotations

from dataclasses import replace

import pytest

from planner.cluster import make_cluster
from planner.cost.memory import Precision, model_state_bytes
from planner.engines import accelerate, deepspeed, megatron, torchtitan
from planner.profiler import profile_model
from planner.solver.comm_pricing import tail_collectives
from planner.solver.search import Config
from planner.solver.solve import Pins, solve
from tests.conftest import EXAMPLES

GPT = dict(n_layers=2, d_model=128, n_heads=4, d_ff=512, vocab_size=512, seq_len=64)


@pytest.fixture(scope="module")
def profiles():
    def make(precision):
        return profile_model(str(EXAMPLES / "gpt.py"), GPT, [1], device="meta", gpu="a100-80gb", dtype="bfloat16",
                             precision=precision)
    return {"autocast": make("autocast"), "pure": make("pure")}


def test_precision_defaults_and_overrides():
    assert Precision.of("float32").state == (4, 4, 8)
    assert Precision.of("bfloat16").state == (2, 2, 12)  # the ZeRO paper's 16 bytes
    megatron_bf16 = Precision.of("bfloat16", grad="float32")
    assert megatron_bf16.state == (2, 4, 12) and megatron_bf16.reduce_bytes == 4  # 18 bytes a parameter
    titan = Precision.of("bfloat16", reduce="float32")
    assert titan.state == (2, 2, 12) and titan.reduce_bytes == 4
    assert Precision.of("bfloat16", param="float32").state == (4, 4, 8)  # autocast over fp32 parameters
    with pytest.raises(ValueError, match="unknown dtype"):
        Precision.of("bfloat16", grad="fp32")
    # ZeRO 1 over 8 ranks shards the optimizer state only: the split decides what stays whole.
    n = 1000
    assert model_state_bytes(n, megatron_bf16, 1, 8).total == pytest.approx(n * (2 + 4 + 12 / 8))
    assert model_state_bytes(n, Precision.of("bfloat16", param="float32"), 1, 8).total == pytest.approx(n * (4 + 4 + 1))


def test_the_runtime_s_autocast_moves_fp32_and_a_pure_profile_16_bits(profiles):
    cluster = make_cluster(8, 8, "a100-80gb")
    pins = Pins(pp=1, tp=1, dp=8, zero_stage=1, micro_batch_size=1)
    autocast = solve(profiles["autocast"], cluster, 16, pins)
    pure = solve(profiles["pure"], cluster, 16, pins)
    assert autocast.prediction.state_bytes == {"weights": 4, "gradients": 4, "reduction": 4, "optimizer": 8}
    assert pure.prediction.state_bytes == {"weights": 2, "gradients": 2, "reduction": 2, "optimizer": 12}
    # Pinned dtypes override the runtime's (an engine's, read from its file).
    pinned = solve(profiles["autocast"], cluster, 16, replace(pins, param_dtype="bfloat16", reduce_dtype="float32"))
    assert pinned.prediction.state_bytes == {"weights": 2, "gradients": 2, "reduction": 4, "optimizer": 12}
    # A float32 profile solved as bf16: the runtime still trains fp32 parameters under autocast.
    fp32 = profile_model(str(EXAMPLES / "gpt.py"), GPT, [1], device="meta", gpu="a100-80gb", dtype="float32")
    assert solve(fp32, cluster, 16, pins, dtype="bfloat16").prediction.state_bytes["reduction"] == 4
    # fp32 weights whole under ZeRO 1 hold more than 16-bit ones.
    assert autocast.prediction.memory_terms_bytes[0]["parameters"] == 2 * pure.prediction.memory_terms_bytes[0]["parameters"]


def test_collectives_move_the_reduction_s_and_the_weights_bytes(profiles):
    from planner.cost.compute import ComputeModel
    from planner.solver.solve import _environment

    cluster = make_cluster(8, 8, "a100-80gb")
    compute = ComputeModel(profiles["autocast"], cluster.gpu, "bfloat16")
    cfg = Config(tp=1, sequence_parallel=False, pp=1, dp=8, micro_batch_size=1, num_microbatches=2, schedule="1f1b",
                 virtual_stages=1, zero_stage=1)
    for pins, reduce_bytes, gather_bytes in ((Pins(), 4, 4), (Pins(param_dtype="bfloat16"), 2, 2),
                                             (Pins(param_dtype="bfloat16", grad_dtype="float32"), 4, 2)):
        env = _environment(cluster, compute, "bfloat16", pins, 0.9)
        reductions, gathers = tail_collectives(cfg, env, trained=1000.0, experts=0.0, gathered=1000.0)
        assert [r[2] for r in reductions] == [reduce_bytes] and [g[2] for g in gathers] == [gather_bytes]


def test_zero0_reduction_costs_more_in_fp32(profiles):
    """The same layout, its gradients reduced in fp32 against bf16: only dp_comm differs, and it grows."""
    cluster = make_cluster(16, 8, "a100-80gb")
    pins = Pins(pp=1, tp=1, dp=16, zero_stage=0, micro_batch_size=1, recompute="none")
    wide = solve(profiles["autocast"], cluster, 16, replace(pins, param_dtype="bfloat16", reduce_dtype="float32"))
    narrow = solve(profiles["autocast"], cluster, 16, replace(pins, param_dtype="bfloat16"))
    assert wide.prediction.breakdown_s["dp_comm"] > narrow.prediction.breakdown_s["dp_comm"]
    assert wide.prediction.breakdown_s["compute"] == pytest.approx(narrow.prediction.breakdown_s["compute"])


@pytest.mark.parametrize("flags, grad", [
    ("--bf16", "float32"),  # arguments.py: bf16 accumulates and all-reduces gradients in fp32
    ("--bf16 --grad-reduce-in-bf16", None),
    ("--fp16", None),
    ("--fp16 --accumulate-allreduce-grads-in-fp32", "float32"),
    ("", None),
])
def test_megatron_reads_its_gradient_buffer_dtype(flags, grad):
    layout = megatron.parse(f"--tensor-model-parallel-size 1 --micro-batch-size 1 --global-batch-size 8 {flags}\n")
    assert layout.grad_dtype == grad
    assert layout.reduce_dtype is None


def test_torchtitan_deepspeed_and_accelerate_say_theirs():
    fsdp = torchtitan.parse("[parallelism]\ndata_parallel_shard_degree = 8\n[training]\nlocal_batch_size = 1\n")
    assert (fsdp.param_dtype, fsdp.reduce_dtype) == ("bfloat16", "float32")  # MixedPrecisionPolicy's defaults
    bf16_reduce = torchtitan.parse("[parallelism]\ndata_parallel_shard_degree = 8\n[training]\nlocal_batch_size = 1\n"
                                   'mixed_precision_reduce = "bfloat16"\n')
    assert bf16_reduce.reduce_dtype == "bfloat16"
    ddp = torchtitan.parse("[parallelism]\ndata_parallel_shard_degree = 1\ndata_parallel_replicate_degree = 8\n"
                           "[training]\nlocal_batch_size = 1\n")
    assert ddp.zero_stage == 0 and ddp.param_dtype == "float32"  # no FSDP: fp32 parameters (maybe_enable_amp)
    assert fsdp.grad_dtype is None  # synced every micro-batch: its bf16 gradients are reduce-scattered as made
    # Under a pipeline FSDP2 syncs on the last micro-batch only and accumulates until then in
    # reduce_dtype (FSDPParam.to_accumulated_grad_if_needed): the gradients held are fp32.
    pipelined = torchtitan.parse("[parallelism]\ndata_parallel_shard_degree = 2\npipeline_parallel_degree = 4\n"
                                 "[training]\nlocal_batch_size = 8\n")
    assert (pipelined.zero_stage, pipelined.grad_dtype, pipelined.reduce_dtype) == (1, "float32", "float32")
    unresharded = torchtitan.parse("[parallelism]\ndata_parallel_shard_degree = 8\nfsdp_reshard_after_forward = \"never\"\n"
                                   "[training]\nlocal_batch_size = 1\n")
    assert (unresharded.zero_stage, unresharded.grad_dtype) == (2, "float32")  # the fp32 shards' .grad
    config = '{"train_batch_size": 8, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, ' \
             '"bf16": {"enabled": true}, "zero_optimization": {"stage": 2}%s}'
    assert deepspeed.parse(config % "").reduce_dtype is None  # the model's dtype
    assert deepspeed.parse(config % ', "communication_data_type": "fp32"').reduce_dtype == "float32"
    multi = accelerate.parse("distributed_type: MULTI_GPU\nnum_processes: 8\nmixed_precision: bf16\n")
    sharded = accelerate.parse("distributed_type: FSDP\nnum_processes: 8\nmixed_precision: bf16\nfsdp_config:\n"
                               "  fsdp_version: 2\n")
    assert multi.param_dtype == "float32" and sharded.param_dtype is None


def test_price_of_an_engine_file_uses_its_precision(profiles):
    from planner.engines.pricing import price

    cluster = make_cluster(8, 8, "a100-80gb")
    layout = megatron.parse("--tensor-model-parallel-size 1 --micro-batch-size 1 --global-batch-size 8 --bf16 "
                            "--use-distributed-optimizer\n")
    plan = price(profiles["pure"], cluster, layout)
    assert plan.prediction.state_bytes == {"weights": 2, "gradients": 4, "reduction": 4, "optimizer": 12}
    in_bf16 = price(profiles["pure"], cluster, replace(layout, grad_dtype=None))
    assert plan.prediction.memory_terms_bytes[0]["gradients"] > in_bf16.prediction.memory_terms_bytes[0]["gradients"]
