"""Context parallelism (runtime/apply_cp.py): the chunk layout, the mask, the plan checks, and
parity with one process, first of attention and of one backward on 2 spawned gloo ranks, then of
whole runs under torchrun against `--reference`.

Tolerances. CP computes the same float32 sums in another order: each rank's attention runs over
the gathered keys with an explicit mask instead of `is_causal` on the whole sequence (another
SDPA kernel path on CPU), and a parameter's gradient is summed over 2 ranks' token shares before
the dp average. That is reassociation only, ~1e-7 relative per op; through a few layers and
AdamW's division by sqrt(v) it stays within the parity tests' 1e-5 on losses and 1e-4 on
parameters (tests/test_runtime_parity.py says why). A wrong mask offset or a missing
reduce-scatter changes the outputs by O(1e-2) and more.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from planner.errors import PlannerError
from planner.plan import Plan
from runtime.apply_cp import (
    ContextParallel,
    causal_mask,
    check_attention_seen,
    check_cp,
    is_plain_causal,
    load_balance_indices,
    local_positions,
    restore_indices,
    shard_sequence,
)
from tests.conftest import EXAMPLES
from tests.ranks import free_port
from tests.runtime_plans import GPT_TP, LLAMA_TP, make_plan
from tests.test_runtime_checkpoint import check_resume_matches_reference
from tests.test_runtime_parity import check_parity

# ---- the layout, the mask, the plan checks (one process) ----


@pytest.mark.parametrize("seq_len,cp", [(8, 2), (16, 2), (24, 3), (32, 4)])
def test_chunk_permutation_and_its_inverse(seq_len, cp):
    order = load_balance_indices(seq_len, cp)
    c = seq_len // (2 * cp)
    for j in range(cp):  # rank j: chunks j and 2 cp - 1 - j, in that order
        expected = list(range(j * c, (j + 1) * c)) + list(range((2 * cp - 1 - j) * c, (2 * cp - j) * c))
        assert local_positions(seq_len, cp, j).tolist() == expected
    assert sorted(order.tolist()) == list(range(seq_len))  # a permutation
    assert order[restore_indices(seq_len, cp)].tolist() == list(range(seq_len))
    from torch.distributed.tensor.experimental._context_parallel._load_balancer import _HeadTailLoadBalancer

    torch_order = _HeadTailLoadBalancer(seq_len, cp, "cpu")._generate_indices().squeeze(0)
    assert order.tolist() == torch_order.tolist()  # the layout torch's own context_parallel uses on CUDA


def test_mask_offsets_are_global_positions():
    # T = 8, cp = 2: rank 1 holds positions 2, 3 (chunk 1) and 4, 5 (chunk 2).
    positions = local_positions(8, 2, 1)
    assert positions.tolist() == [2, 3, 4, 5]
    mask = causal_mask(positions, 8)
    assert mask.sum(-1).tolist() == [3, 4, 5, 6]  # query at position p sees keys 0..p
    full = torch.ones(8, 8, dtype=torch.bool).tril()
    for j in range(2):  # each rank's rows are the whole sequence's causal rows at its positions
        p = local_positions(8, 2, j)
        assert torch.equal(causal_mask(p, 8), full[p])


def test_shard_sequence_slices_only_the_sequence_dim():
    tokens = torch.arange(2 * 8).view(2, 8)
    hidden = torch.randn(2, 8, 3)
    per_sample = torch.arange(2)
    assert shard_sequence(tokens, 8, 2, 0).tolist() == [[0, 1, 6, 7], [8, 9, 14, 15]]
    assert torch.equal(shard_sequence(hidden, 8, 2, 1), hidden[:, 2:6])
    assert shard_sequence(per_sample, 8, 2, 1) is per_sample
    assert shard_sequence("not a tensor", 8, 2, 1) == "not a tensor"


def test_plain_causal_masks_are_recognised():
    tril = torch.ones(4, 4, dtype=torch.bool).tril()
    additive = torch.zeros(4, 4).masked_fill(~tril, float("-inf"))
    hf_style = torch.zeros(2, 1, 4, 4).masked_fill(~tril, torch.finfo(torch.float32).min)
    assert is_plain_causal(tril) and is_plain_causal(tril.expand(2, 1, 4, 4))
    assert is_plain_causal(additive) and is_plain_causal(hf_style)
    padded = tril.clone()
    padded[:, 0] = False  # the first token is padding
    assert not is_plain_causal(padded)
    assert not is_plain_causal(torch.ones(4, 4, dtype=torch.bool).tril(-1))  # offset causal: not translatable
    assert not is_plain_causal(torch.ones(4, 6, dtype=torch.bool))


def test_arange_of_the_local_length_gives_global_positions():
    mode = ContextParallel(group=None, seq_len=8, cp=2, cp_rank=1, device=torch.device("cpu"))
    with mode:
        assert torch.arange(4).tolist() == [2, 3, 4, 5]
        assert torch.arange(0, 4).tolist() == [2, 3, 4, 5]
        floats = torch.arange(4, dtype=torch.float32)
        assert floats.dtype == torch.float32 and floats.tolist() == [2.0, 3.0, 4.0, 5.0]
        assert torch.arange(4, device="cpu").dtype == torch.int64
        # Not a local position range: left alone.
        assert torch.arange(5).tolist() == list(range(5))
        assert torch.arange(0, 4, 2).tolist() == [0, 2]
        assert torch.arange(1, 5).tolist() == [1, 2, 3, 4]
    assert torch.arange(4).tolist() == [0, 1, 2, 3]  # only while the mode is active


def test_a_diff_along_positions_sees_one_run():
    """Hugging Face's packed-sequence detection: diff(position_ids) != 1 starts a new document."""
    mode = ContextParallel(group=None, seq_len=8, cp=2, cp_rank=0, device=torch.device("cpu"))
    with mode:
        positions = (torch.arange(4) + 3).unsqueeze(0).expand(2, -1)  # global [0, 1, 6, 7] + 3: a jump after 4
        assert torch.diff(positions, prepend=positions[:, :1] - 1, dim=-1).tolist() == [[1, 1, 1, 1]] * 2
        assert positions.diff().tolist() == [[1, 1, 1]] * 2
        other = torch.tensor([[0, 5, 6, 9]])
        assert torch.diff(other).tolist() == [[5, 1, 3]]  # not this rank's positions: left alone
        assert torch.diff(positions, dim=0).tolist() == [[0, 0, 0, 0]]  # not along the sequence
    assert torch.diff(positions).tolist() == [[1, 5, 1]] * 2  # only while the mode is active


def test_a_scan_along_the_sequence_is_refused_and_one_of_zeros_is_not():
    """OPT numbers its positions with a cumsum of its attention mask: on each rank it would count
    from 0. A scan of zeros (Hugging Face's packed-sequence check) is the same however it is split."""
    mode = ContextParallel(group=None, seq_len=8, cp=2, cp_rank=0, device=torch.device("cpu"))
    with mode:
        assert torch.zeros(2, 4, dtype=torch.bool).cumsum(-1).sum() == 0
        assert torch.ones(8).cumsum(0)[-1] == 8  # a flattened token dim, or not a sequence: left alone
        assert torch.ones(2, 3).cumsum(1)[0, -1] == 3
        with pytest.raises(PlannerError, match=r"scans along the sequence \(cumsum along dim 1 at test_runtime_cp.py"):
            torch.ones(2, 4, dtype=torch.long).cumsum(dim=1)
        with pytest.raises(PlannerError, match="cumprod along dim 2"):
            torch.cumprod(torch.ones(2, 3, 4), -1)


def test_a_model_without_sdpa_is_refused():
    mode = ContextParallel(group=None, seq_len=8, cp=2, cp_rank=0, device=torch.device("cpu"))
    with pytest.raises(PlannerError, match="no call to torch.nn.functional.scaled_dot_product_attention"):
        check_attention_seen(mode)


def cp_plan(model="gpt", dp=2, cp=2, sp=False, shard=None, **kw):
    """A hand-written plan with cp_degree `cp` over `dp` data-parallel ranks (the global batch: one
    micro-batch set per CP group)."""
    plan = make_plan(model, dp=dp, **kw)
    data = plan.model_dump()
    data["layout"].update(cp_degree=cp, sequence_parallel=sp, shard_degree=shard)
    data["batch"]["global_batch_size"] = plan.batch.micro_batch_size * plan.batch.num_microbatches * dp // cp
    return Plan.model_validate(data)


@pytest.mark.parametrize("layout,message", [
    (dict(dp_degree=4, cp_degree=3), "cp_degree 3 does not divide dp_degree 4"),
    (dict(dp_degree=4, cp_degree=2, ep_degree=2), "with ep_degree 2 is not supported"),
])
def test_plan_checks(layout, message):
    data = cp_plan(dp=4).model_dump()
    data["layout"].update(layout)
    with pytest.raises(ValueError, match=message):
        Plan.model_validate(data)


def test_global_batch_counts_each_cp_group_once():
    plan = cp_plan(dp=4, cp=2, mbs=2, m=2)
    assert plan.batch.global_batch_size == 2 * 2 * 2  # 4 dp ranks, 2 groups of 2 holding the same samples
    data = plan.model_dump()
    data["batch"]["global_batch_size"] = 16
    with pytest.raises(ValueError, match="dp_degree / cp_degree 2"):
        Plan.model_validate(data)


def test_sequence_that_does_not_split_is_refused_before_launch():
    plan = cp_plan()
    with pytest.raises(PlannerError, match="does not split into 2 x 2 = 4 equal chunks"):
        check_cp(plan, (torch.zeros(2, 6, dtype=torch.long),))
    with pytest.raises(PlannerError, match="no sequence length"):
        check_cp(plan, (torch.zeros(2, 8),))  # a float first input: not a token tensor
    check_cp(plan, (torch.zeros(2, 8, dtype=torch.long),))


def test_cp_with_the_asynchronous_pipeline_is_refused_before_launch():
    plan = cp_plan(dp=2, pp=2, schedule="pipedream-2bw", m=2)
    with pytest.raises(PlannerError, match="runs under the schedules gpipe, 1f1b, interleaved-1f1b, zero-bubble"):
        check_cp(plan, (torch.zeros(2, 8, dtype=torch.long),))
    for schedule, v in (("1f1b", 1), ("interleaved-1f1b", 2), ("zero-bubble", 2)):  # accepted
        check_cp(cp_plan(dp=2, pp=2, schedule=schedule, v=v, m=2), (torch.zeros(2, 8, dtype=torch.long),))


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", ["gpt-1f1b-v1-m4", "llama-gpipe-v1-m2", "hf_llama-1f1b-v1-m2", "gpt-interleaved-1f1b-v2-m4",
                                  "hf_llama-interleaved-1f1b-v2-m2", "gpt-zero-bubble-v2-m4"])
def test_cp2_x_pp2_parity(case, tmp_path):
    """Each stage runs its micro-batches' sequence chunks: the stages are cut at the local shapes
    (runtime/train.py `meta_inputs`), the mode steps off torch's function-mode stack under the
    pipeline's replay mode (`exit_module`), and shape inference passes through it. Two micro-batches
    or more: the second one is where a mode left on the stack showed (positions not global). With
    virtual stages each of a rank's two chunks has its own mode; the weights are held to 1e-5, the
    gap a gradient divided twice left on the chunk whose backward ends first (runtime/apply_dp.py
    `GradientReducer`, "Scaling")."""
    model, *schedule, v, m = case.split("-")
    kw = dict(model="gpt", mbs=1) if model == "gpt" else \
        dict(model="hf_llama", args=HF_ARGS, units=HF_UNITS) if model == "hf_llama" else dict(model="llama")
    check_parity(cp_plan(dp=2, cp=2, pp=2, schedule="-".join(schedule), v=int(v[1:]), m=int(m[1:]), **kw), tmp_path,
                 noise_only=("wk.bias",), param_atol=1e-5)


# ---- attention and one backward on 2 spawned gloo ranks ----


def _spawned(worker, world: int, *args) -> None:
    mp.spawn(_entry, args=(worker, world, free_port(), args), nprocs=world, join=True)


def _entry(rank: int, worker, world: int, port: int, args: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        worker(rank, world, *args)
    finally:
        dist.destroy_process_group()
    # Leave without the interpreter's teardown, as runtime/__main__.py does: gloo aborts a
    # process there now and then (SIGABRT after a clean finish).
    os._exit(0)


def _attention_worker(rank: int, cp: int) -> None:
    """SDPA of the local queries over gathered K/V: the whole sequence's outputs at this rank's
    positions, and the gradients of Q, K, V at its tokens, for causal attention with grouped-query
    heads (enable_gqa), with a plain causal mask, and bidirectional; an arbitrary mask is refused."""
    seq, group = 16, dist.group.WORLD
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, seq, 8), torch.randn(2, 2, seq, 8), torch.randn(2, 2, seq, 8)
    weight = torch.randn(2, 4, seq, 8)  # a loss that weighs every output differently
    mine = local_positions(seq, cp, rank)
    local_mask = torch.ones(seq // cp, seq // cp, dtype=torch.bool).tril()
    for kwargs, local_kwargs in [(dict(is_causal=True), dict(is_causal=True)),
                                 (dict(is_causal=True), dict(attn_mask=local_mask)),
                                 ({}, {})]:
        full = [t.clone().requires_grad_() for t in (q, k, v)]
        out = F.scaled_dot_product_attention(*full, enable_gqa=True, **kwargs)
        (out * weight).sum().backward()
        part = [t[:, :, mine].clone().requires_grad_() for t in (q, k, v)]
        mode = ContextParallel(group, seq, cp, rank, torch.device("cpu"))
        with mode:
            local = F.scaled_dot_product_attention(*part, enable_gqa=True, **local_kwargs)
        (local * weight[:, :, mine]).sum().backward()
        assert mode.attention_calls == 1
        # Float reassociation only (module docstring): 1e-6 is ~10 ulps of these O(1) values.
        torch.testing.assert_close(local, out[:, :, mine], rtol=1e-6, atol=1e-6)
        for a, b in zip(part, full, strict=True):
            torch.testing.assert_close(a.grad, b.grad[:, :, mine], rtol=1e-5, atol=1e-6)
    arbitrary = torch.rand(seq // cp, seq // cp) > 0.5
    with pytest.raises(PlannerError, match="other than plain causal"), ContextParallel(group, seq, cp, rank, torch.device("cpu")):
        F.scaled_dot_product_attention(q[:, :, mine], k[:, :, mine], v[:, :, mine], attn_mask=arbitrary, enable_gqa=True)


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("cp", [2, pytest.param(4, id="cp4")])
def test_attention_equals_the_whole_sequence(cp):
    _spawned(_attention_worker, cp)


def _gradient_worker(rank: int, world: int, model: str, args: dict, recompute: bool, algorithm: str = "all-gather") -> None:
    """One forward and backward of a whole model under CP (`apply_cp`'s hooks; positions through the
    arange contract) by `algorithm`: each rank's loss is the mean over its own tokens, and the average
    of the ranks' gradients (the dp reduction) is the one-process gradient of the mean over all tokens.
    (tests/test_runtime_cp_ring.py runs it for the ring.)"""
    from torch.distributed.device_mesh import init_device_mesh

    from planner.model_file import load_model_file
    from runtime.apply_cp import apply_cp
    from runtime.build import build_meta_model, init_mode, materialize
    from runtime.recompute import apply_recompute

    cpu = torch.device("cpu")
    mf = load_model_file(str(EXAMPLES / f"{model}.py"), args)
    meta = build_meta_model(mf)
    reference = materialize(meta, 0, cpu, init_mode(meta), mf)
    meta = build_meta_model(mf)
    net = materialize(meta, 0, cpu, init_mode(meta), mf)
    torch.manual_seed(1)
    tokens, targets = mf.make_batch(2)
    seq = tokens.shape[1]
    full_loss = mf.loss(reference(tokens), targets)
    full_loss.backward()
    if recompute:  # every unit replayed in backward: the gather (or the ring) must run again, under the mode
        apply_recompute(net, ["embed", "blocks.0", "blocks.1", "norm", "head"], "full")
    mode = apply_cp(net, init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))["cp"], (tokens,), cpu, algorithm)
    loss = mf.loss(net(shard_sequence(tokens, seq, world, rank)), shard_sequence(targets, seq, world, rank))
    loss.backward()
    assert mode.algorithm == algorithm and mode.attention_calls > 0
    assert mode.depth == 0 and torch._C._len_torch_function_stack() == 0  # left after forward and recomputation
    mean_loss = loss.detach().clone()
    dist.all_reduce(mean_loss)  # equal token counts per rank: the mean of means is the mean
    torch.testing.assert_close(mean_loss / world, full_loss.detach(), rtol=1e-6, atol=0)
    for name, p in net.named_parameters():
        assert p.grad is not None, name
        dist.all_reduce(p.grad)
        name = name.replace("_checkpoint_wrapped_module.", "")
        torch.testing.assert_close(p.grad / world, reference.get_parameter(name).grad, rtol=1e-5, atol=1e-6, msg=name)


GRADIENT_CASES = {
    "gpt": ("gpt", dict(n_layers=2, d_model=32, n_heads=4, d_ff=64, vocab_size=64, seq_len=16), False),
    "gpt-recompute": ("gpt", dict(n_layers=2, d_model=32, n_heads=4, d_ff=64, vocab_size=64, seq_len=16), True),
    "llama-gqa": ("llama", dict(n_layers=2, d_model=32, n_heads=4, n_kv_heads=2, d_ff=64, vocab_size=64, seq_len=16),
                  False),
    "hf-llama": ("hf_llama", dict(n_layers=2, d_model=32, n_heads=4, n_kv_heads=2, d_ff=64, vocab_size=64, seq_len=16),
                 False),
}


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("case", sorted(GRADIENT_CASES))
def test_one_backward_equals_the_one_process_gradients(case):
    if case.startswith("hf"):
        pytest.importorskip("transformers")
    _spawned(_gradient_worker, 2, *GRADIENT_CASES[case])


# ---- whole runs under torchrun against --reference (tests/test_runtime_parity.py) ----

HF_ARGS = dict(n_layers=2, d_model=32, n_heads=4, n_kv_heads=2, d_ff=64, vocab_size=64, seq_len=16)
HF_UNITS = ["model.embed_tokens", "model.rotary_emb", "model.layers.0", "model.layers.1", "model.norm", "lm_head"]

PARITY_CASES = {
    "cp2-gpt": dict(),  # learned positions: the arange of the local length
    "cp2-llama": dict(model="llama"),  # rotary tables of arange, grouped-query heads (repeated by the model)
    "cp2xdp2": dict(dp=4),  # two CP groups of two, each with its own samples
    "cp2xtp2-llama": dict(model="llama", tp=2, tp_plan=LLAMA_TP),  # 1 K/V head per TP rank, gathered over CP
    "cp2xtp2-sp-gpt": dict(tp=2, tp_plan=GPT_TP, sp=True),  # norms on T / (cp tp) tokens
    "cp2-zero3": dict(zero=3),  # FSDP averages over all 2 dp ranks, as the replicated path does
    # HSDP: shard groups of 2 dp ranks (= the CP groups here), replicas across them.
    "cp2xdp2-hsdp": dict(dp=4, zero=3, shard=2),
    "cp2-recompute-full": dict(recompute="full"),  # the gather replayed in backward, under the mode
    # The unmodified Hugging Face Llama: position_ids from arange, its packed-sequence check, SDPA with enable_gqa.
    "cp2-hf_llama": dict(model="hf_llama", args=HF_ARGS, units=HF_UNITS),
}


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", sorted(PARITY_CASES))
def test_cp_parity(case, tmp_path):
    if "hf" in case:
        pytest.importorskip("transformers")
    check_parity(cp_plan(**PARITY_CASES[case]), tmp_path)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("pp", [1, 2])
def test_checkpoint_saved_under_cp2_resumes_under_cp1(pp, tmp_path):
    # CP changes no parameter's layout: the same global batch (4 samples) as 2 dp ranks of 2 samples.
    # Under pp 2 each stage saves its own units, resumed by one process holding them all.
    saved = cp_plan(dp=2, cp=2, pp=pp, mbs=2, m=2, schedule="1f1b")
    check_resume_matches_reference(saved, make_plan(dp=2, mbs=1, m=2), tmp_path)


def test_run_refuses_a_sequence_that_does_not_split_before_launch(tmp_path):
    from runtime.launch import precheck

    plan = cp_plan(args=dict(n_layers=4, d_model=32, n_heads=4, d_ff=64, vocab_size=64, seq_len=6))
    with pytest.raises(PlannerError, match="does not split into 2 x 2 = 4 equal chunks"):
        precheck(str(plan.save(tmp_path / "plan.json")), None)
