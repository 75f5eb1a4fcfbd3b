"""Ring attention for context parallelism (runtime/cp_ring.py, `Layout.cp_algorithm = "ring"`):
the block schedule and its merge in one process, then the ring itself on spawned gloo ranks
(attention alone, one model backward) and whole runs under torchrun against `--reference`.

Tolerances. The ring computes each block's softmax explicitly in float32 and merges blocks by
log-sum-exp, where the reference runs one fused SDPA over the whole sequence: the same sums in
another order, ~1e-7 relative per op. Attention alone is checked at 1e-6 / 1e-5 (about 10 ulps of
its O(1) values); models and runs at tests/test_runtime_cp.py's tolerances (the parity tests'
1e-5 on losses, 1e-4 on parameters), which a wrong block offset or a lost dK/dV accumulator
exceeds by orders of magnitude (O(1e-2) and more).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from planner.errors import PlannerError
from planner.plan import Plan
from runtime.apply_cp import ContextParallel, local_positions
from runtime.cp_ring import block_attention, block_attention_backward, block_part, merge
from tests.runtime_plans import LLAMA_TP, make_plan
from tests.test_runtime_cp import GRADIENT_CASES, _spawned, cp_plan
from tests.test_runtime_parity import check_parity

# ---- the block schedule and the merge (one process, the ring's sends replaced by slicing) ----


@pytest.mark.parametrize("seq_len,cp", [(8, 2), (16, 4), (24, 3)])
def test_blocks_cover_the_causal_rows_with_balanced_work(seq_len, cp):
    chunk = seq_len // (2 * cp)
    for rank in range(cp):
        mine = local_positions(seq_len, cp, rank)
        covered = torch.zeros(len(mine), seq_len, dtype=torch.int64)
        for step in range(cp):
            src = (rank - step) % cp
            theirs = local_positions(seq_len, cp, src)
            rows, cols, inside = block_part(step, rank, cp, chunk, causal=True)
            pairs = torch.ones(len(mine), len(theirs), dtype=torch.int64)[rows, cols]
            if inside:
                pairs = pairs.tril()
            covered[torch.arange(len(mine))[rows][:, None], theirs[cols][None, :]] += pairs
            if step > 0:  # causal load balance: every later step is half a block, on every rank
                assert pairs.numel() == 2 * chunk * chunk and bool(pairs.all())
        causal = (mine[:, None] >= torch.arange(seq_len)[None, :]).long()
        assert torch.equal(covered, causal)  # each allowed pair exactly once, no forbidden one


def _blockwise(q, k, v, grad_out, seq_len: int, cp: int, rank: int, causal: bool, groups: int):
    """What rank `rank` of the ring computes, with each step's K/V block sliced from the whole K/V."""
    mine, chunk = local_positions(seq_len, cp, rank), seq_len // (2 * cp)
    ql, scale = q[:, :, mine], q.shape[-1] ** -0.5
    out, lse = torch.zeros_like(ql), torch.full(ql.shape[:-1], float("-inf"))
    blocks = []
    for step in range(cp):
        theirs = local_positions(seq_len, cp, (rank - step) % cp)
        rows, cols, inside = block_part(step, rank, cp, chunk, causal)
        kb, vb = (t[:, :, theirs][:, :, cols].repeat_interleave(groups, dim=1) for t in (k, v))
        blocks.append((rows, theirs[cols], kb, vb, inside))
        o, m = block_attention(ql[:, :, rows], kb, vb, scale, inside)
        out[:, :, rows], lse[:, :, rows] = merge(out[:, :, rows], lse[:, :, rows], o, m)
    go = grad_out[:, :, mine]
    delta = (go * out).sum(-1)
    dq, dk, dv = torch.zeros_like(ql), torch.zeros_like(k), torch.zeros_like(v)
    for rows, keys, kb, vb, inside in blocks:
        bq, bk, bv = block_attention_backward(ql[:, :, rows], kb, vb, lse[:, :, rows], go[:, :, rows],
                                              delta[:, :, rows], scale, inside)
        dq[:, :, rows] += bq
        dk[:, :, keys] += bk.unflatten(1, (-1, groups)).sum(2)
        dv[:, :, keys] += bv.unflatten(1, (-1, groups)).sum(2)
    return out, dq, dk, dv


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
def test_blockwise_attention_and_backward_equal_sdpa(cp, causal):
    seq_len, groups = 16, 2  # grouped-query: 4 query heads over 2 key/value heads
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, seq_len, 8), torch.randn(2, 2, seq_len, 8), torch.randn(2, 2, seq_len, 8)
    grad_out = torch.randn(2, 4, seq_len, 8)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    F.scaled_dot_product_attention(*full, is_causal=causal, enable_gqa=True).backward(grad_out)
    reference = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    dk_sum, dv_sum = torch.zeros_like(k), torch.zeros_like(v)
    for rank in range(cp):
        mine = local_positions(seq_len, cp, rank)
        out, dq, dk, dv = _blockwise(q, k, v, grad_out, seq_len, cp, rank, causal, groups)
        # Reassociation only (module docstring): ~10 ulps of these O(1) values.
        torch.testing.assert_close(out, reference[:, :, mine], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(dq, full[0].grad[:, :, mine], rtol=1e-5, atol=1e-6)
        dk_sum, dv_sum = dk_sum + dk, dv_sum + dv  # each rank's part of every block's dK/dV
    torch.testing.assert_close(dk_sum, full[1].grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dv_sum, full[2].grad, rtol=1e-5, atol=1e-6)


def test_ring_needs_cp_degree_above_one():
    data = make_plan("gpt").model_dump()
    data["layout"]["cp_algorithm"] = "ring"
    with pytest.raises(ValueError, match="cp_algorithm 'ring' needs cp_degree > 1"):
        Plan.model_validate(data)
    assert ring_plan().layout.cp_algorithm == "ring"


# ---- the ring on spawned gloo ranks ----


# Reassociation only: ~10 ulps of O(1) values in float32 and float64. bfloat16: both sides sum in
# float32 and round the result to bfloat16 (8 bits of mantissa, 2^-8 = 4e-3), so 2 ulps.
TOLERANCES = {torch.float32: 1e-6, torch.float64: 1e-12, torch.bfloat16: 8e-3}


def _attention_worker(rank: int, cp: int, dtype: torch.dtype) -> None:
    """Ring SDPA of the local queries: the whole sequence's outputs at this rank's positions and the
    gradients of Q, K, V at its tokens; causal (is_causal and a plain mask), bidirectional, GQA, and
    multi-query attention passed as one broadcast key/value head without enable_gqa (Falcon's)."""
    seq, group = 8 * cp, dist.group.WORLD  # chunks of 4 tokens
    assert group is not None
    torch.manual_seed(0)
    q = torch.randn(2, 4, seq, 8, dtype=dtype)
    kv_of = {heads: [torch.randn(2, heads, seq, 8, dtype=dtype) for _ in range(2)] for heads in (2, 1)}
    weight = torch.randn(2, 4, seq, 8, dtype=dtype)
    mine = local_positions(seq, cp, rank)
    local_mask = torch.ones(seq // cp, seq // cp, dtype=torch.bool).tril()
    cases: list[tuple[bool, dict, int]] = [(True, dict(is_causal=True, enable_gqa=True), 2),
                                           (True, dict(attn_mask=local_mask, enable_gqa=True), 2),
                                           (False, dict(enable_gqa=True), 2), (True, dict(is_causal=True), 1)]
    for causal, local_kwargs, heads in cases:
        k, v = kv_of[heads]
        full = [t.clone().requires_grad_() for t in (q, k, v)]
        out = F.scaled_dot_product_attention(full[0], full[1], full[2], is_causal=causal, enable_gqa=heads > 1)
        (out * weight).sum().backward()
        part = [t[:, :, mine].clone().requires_grad_() for t in (q, k, v)]
        mode = ContextParallel(group, seq, cp, rank, torch.device("cpu"), algorithm="ring")
        with mode:
            local = F.scaled_dot_product_attention(part[0], part[1], part[2], **local_kwargs)
        (local * weight[:, :, mine]).sum().backward()
        assert mode.attention_calls == 1
        tol = TOLERANCES[dtype]
        torch.testing.assert_close(local, out[:, :, mine], rtol=tol, atol=tol)
        for a, b in zip(part, full, strict=True):
            assert a.grad is not None and b.grad is not None
            torch.testing.assert_close(a.grad, b.grad[:, :, mine], rtol=10 * tol, atol=10 * tol)
    with pytest.raises(PlannerError, match="dropout"), ContextParallel(group, seq, cp, rank, torch.device("cpu"),
                                                                        algorithm="ring"):
        k, v = kv_of[2]
        F.scaled_dot_product_attention(q[:, :, mine], k[:, :, mine], v[:, :, mine], dropout_p=0.1, enable_gqa=True)


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("cp,dtype", [(2, torch.float32), (3, torch.float64), (4, torch.float32), (2, torch.bfloat16)],
                         ids=["cp2", "cp3-float64", "cp4", "cp2-bfloat16"])
def test_ring_attention_equals_the_whole_sequence(cp, dtype):
    _spawned(_attention_worker, cp, dtype)


def _gradient_worker(rank: int, world: int, model: str, args: dict, recompute: bool) -> None:
    """tests/test_runtime_cp.py's whole-model gradient check, attention by the ring."""
    from tests.test_runtime_cp import _gradient_worker as check

    check(rank, world, model, args, recompute, "ring")


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("case", sorted(GRADIENT_CASES))
def test_one_ring_backward_equals_the_one_process_gradients(case):
    if case.startswith("hf"):
        pytest.importorskip("transformers")
    _spawned(_gradient_worker, 2, *GRADIENT_CASES[case])


# ---- whole runs under torchrun against --reference ----


def ring_plan(**kw) -> Plan:
    """tests/test_runtime_cp.py's hand-written CP plan, attention by the ring."""
    data = cp_plan(**kw).model_dump()
    data["layout"]["cp_algorithm"] = "ring"
    return Plan.model_validate(data)


RING_PARITY_CASES = {
    "ring-cp2-gpt": dict(),  # learned positions
    "ring-cp2-llama": dict(model="llama"),  # rotary tables, grouped-query heads (repeated by the model)
    "ring-cp2xdp2": dict(dp=4),  # two rings of two, each with its own samples
    "ring-cp2xtp2-llama": dict(model="llama", tp=2, tp_plan=LLAMA_TP),  # each TP rank's heads go around its ring
    # two stage chunks per rank, each with its own ring, between the schedule's pipeline sends
    "ring-cp2xpp2-interleaved": dict(dp=2, pp=2, schedule="interleaved-1f1b", v=2, m=4, mbs=1),
}


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", sorted(RING_PARITY_CASES))
def test_ring_cp_parity(case, tmp_path):
    # The key bias (GPT's wk.bias) moves by rounding noise alone (tests/test_runtime_parity.py
    # `check_parity`); with it set aside the interleaved case reaches float rounding (about 1e-6).
    tight = dict(noise_only=("wk.bias",), param_atol=1e-5) if case == "ring-cp2xpp2-interleaved" else {}
    check_parity(ring_plan(**RING_PARITY_CASES[case]), tmp_path, **tight)
