"""Ring attention: context parallelism's `cp_algorithm = "ring"` (planner/plan.py), K/V blocks
passed around the CP group while attention runs on the block at hand (Liu et al. 2023, "Ring
Attention with Blockwise Transformers for Near-Infinite Context", arXiv 2310.01889; the layout,
the chunks and the positions are runtime/apply_cp.py's).

Why hand-written. torch's own ring (`torch.distributed.tensor.experimental.context_parallel`,
`_context_parallel/_attention.py`) wraps the flash / memory-efficient / cuDNN SDPA kernels, which
return the log-sum-exp it merges blocks with; all are CUDA kernels, gloo has none, and CPU's
`F.scaled_dot_product_attention` returns no log-sum-exp. So each block's attention is written
out here (scores, masked softmax, log-sum-exp, in float32 or wider: `_accumulation_dtype`) with its flash-attention-style
backward, and works on any device and backend.

**Forward** (`RingAttention.forward`). Rank j of cp holds chunks j and 2 cp - 1 - j (c tokens
each) of Q, K and V. At step s it holds the K/V block of rank src = (j - s) mod cp; it posts the
send of that block to rank j + 1 and the receive of the next from rank j - 1 *before* computing on
it (the overlap the paper's speed-up rests on), attends, merges, then waits. Which part of a
block the causal mask leaves (`block_part`), with positions in the global order:
- s = 0, its own block: causal inside it (its positions increase, so a lower triangle);
- src < j: every local query sees src's first chunk (earlier than both of j's chunks) and none
  of its second (later than both): all queries x first c keys, no mask;
- src > j: j's first chunk sees nothing of src; its second chunk sees all of src:
  last c queries x all keys, no mask.
So every step after the first costs half of the first, the same on every rank: the causal load
balance. Bidirectional attention takes whole blocks. Partial results merge by log-sum-exp (online
softmax, Milakov & Gimelshein 2018; Dao et al. 2022 "FlashAttention", section 3.1):
lse = logaddexp(lse_a, lse_b), out = out_a exp(lse_a - lse) + out_b exp(lse_b - lse).

**Backward** (`RingAttention.backward`, FlashAttention's backward, Dao et al. 2022, Algorithm 4).
With the final out and lse saved, a block's probabilities are P = exp(S - lse) whatever the
other blocks were, so each block's dQ, dK, dV follow alone, with D = rowsum(dO * O):
dV = P^T dO, dP = dO V^T, dS = P * (dP - D), dQ = dS K scale, dK = dS^T Q scale.
K/V blocks go around the ring again (nothing of other ranks is saved between forward and
backward, the memory the ring saves over all-gather). dQ stays local; a block's dK/dV
accumulator travels with it one step behind: the rank that computed step s on src's block sends
the accumulator to the next rank, which adds its own part at step s + 1, and after the last step
each accumulator lands home. cp - 1 sends of K/V and cp - 1 of accumulators per rank, as
planner/cost/cp.py `ring_cp_s` prices. Accumulators travel in K/V's dtype (as all-gather CP's
reduce-scatter of dK/dV does) and are summed in float32 (or wider).

Grouped-query attention: K/V travel with their own (fewer) heads and are repeated per query head
only for the block's compute (`enable_gqa`'s `repeat_interleave`); their gradients are summed
back over the repeats.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

_KV_TAG, _GRAD_TAG = 1, 2  # K/V blocks and gradient accumulators can be in flight together: gloo matches by tag


@dataclass(frozen=True)
class Ring:
    """The CP group as a ring: this rank sends to the next and receives from the previous."""

    group: dist.ProcessGroup
    """The CP group (runtime/mesh.py `build_cp_mesh`)."""
    rank: int
    """This rank's index in the group (its chunks are rank and 2 size - 1 - rank)."""
    size: int
    """cp, the group's size."""

    def exchange(self, send: torch.Tensor, tag: int) -> tuple[torch.Tensor, list]:
        """Post the send of `send` to the next rank and the receive of a tensor like it from the
        previous; returns the receive buffer and the works to wait on before reading it."""
        received = torch.empty_like(send)
        peer = lambda r: dist.get_global_rank(self.group, r % self.size)  # noqa: E731
        ops = [dist.P2POp(dist.isend, send, peer(self.rank + 1), self.group, tag),
               dist.P2POp(dist.irecv, received, peer(self.rank - 1), self.group, tag)]
        return received, dist.batch_isend_irecv(ops)


def _wait(works: list) -> None:
    for work in works:
        work.wait()


def block_part(step: int, rank: int, cp: int, chunk: int, causal: bool) -> tuple[slice, slice, bool]:
    """(local queries, block keys, causal inside) that attend at `step` (module docstring)."""
    whole = slice(None)
    if not causal:
        return whole, whole, False
    if step == 0:
        return whole, whole, True
    src = (rank - step) % cp
    return (whole, slice(0, chunk), False) if src < rank else (slice(chunk, None), whole, False)


def _repeat_heads(x: torch.Tensor, groups: int) -> torch.Tensor:
    return x if groups == 1 else x.repeat_interleave(groups, dim=-3)


def _sum_heads(x: torch.Tensor, groups: int) -> torch.Tensor:
    return x if groups == 1 else x.unflatten(-3, (-1, groups)).sum(-3)


def _accumulation_dtype(x: torch.Tensor) -> torch.dtype:
    """Float32 for half-precision inputs (softmax sums and merges lose too much in 16 bits), else theirs."""
    return torch.promote_types(x.dtype, torch.float32)


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, causal: bool) -> torch.Tensor:
    scores = (q @ k.transpose(-2, -1)) * scale
    if causal:
        n_q, n_k = scores.shape[-2:]
        allowed = torch.ones(n_q, n_k, dtype=torch.bool, device=scores.device).tril()
        scores = scores.masked_fill(~allowed, float("-inf"))
    return scores


def block_attention(q, k, v, scale: float, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of queries over one block, both in the accumulation dtype (heads already matched).
    Every row sees at least one key in the parts `block_part` gives, so lse is finite."""
    scores = _scores(q, k, scale, causal)
    lse = scores.logsumexp(-1)
    return torch.exp(scores - lse.unsqueeze(-1)) @ v, lse


def block_attention_backward(q, k, v, lse, grad_out, delta, scale: float, causal: bool):
    """(dq, dk, dv) of one block given the merged lse and D = rowsum(dO * O) (module docstring)."""
    probs = torch.exp(_scores(q, k, scale, causal) - lse.unsqueeze(-1))
    grad_v = probs.transpose(-2, -1) @ grad_out
    grad_scores = probs * (grad_out @ v.transpose(-2, -1) - delta.unsqueeze(-1))
    return grad_scores @ k * scale, grad_scores.transpose(-2, -1) @ q * scale, grad_v


def merge(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor):
    """Online softmax: two partial attentions over disjoint keys as one (module docstring)."""
    merged = torch.logaddexp(lse, block_lse)
    return out * torch.exp(lse - merged).unsqueeze(-1) + block_out * torch.exp(block_lse - merged).unsqueeze(-1), merged


class RingAttention(torch.autograd.Function):
    """SDPA of this rank's queries over the whole sequence's keys, K/V passed around `ring`."""

    @staticmethod
    def forward(ctx, query, key, value, ring: Ring, causal: bool, scale: float):
        groups, chunk = query.shape[-3] // key.shape[-3], query.shape[-2] // 2
        q = query.to(_accumulation_dtype(query))
        out = torch.zeros_like(q)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=q.dtype, device=q.device)
        kv = torch.cat([key, value], dim=-1)  # one message a step; value's head dim may differ from key's
        for step in range(ring.size):
            incoming, works = ring.exchange(kv, _KV_TAG) if step < ring.size - 1 else (kv, [])
            rows, cols, inside = block_part(step, ring.rank, ring.size, chunk, causal)
            k, v = (_repeat_heads(t[..., cols, :].to(q.dtype), groups) for t in kv.split(key.shape[-1], dim=-1))
            block_out, block_lse = block_attention(q[..., rows, :], k, v, scale, inside)
            out[..., rows, :], lse[..., rows] = merge(out[..., rows, :], lse[..., rows], block_out, block_lse)
            _wait(works)
            kv = incoming
        result = out.to(query.dtype)
        ctx.save_for_backward(query, key, value, result, lse)  # the output as SDPA keeps it (FlashAttention does too)
        ctx.ring, ctx.causal, ctx.scale = ring, causal, scale
        return result

    @staticmethod
    def backward(ctx, grad_output):
        query, key, value, out, lse = ctx.saved_tensors
        ring, causal, scale = ctx.ring, ctx.causal, ctx.scale
        groups, chunk = query.shape[-3] // key.shape[-3], query.shape[-2] // 2
        acc = _accumulation_dtype(query)
        q, grad_out = query.to(acc), grad_output.to(acc)
        delta = (grad_out * out.to(acc)).sum(-1)
        grad_q = torch.zeros_like(q)
        kv, passed, pending = torch.cat([key, value], dim=-1), None, []
        own = torch.zeros(kv.shape, dtype=acc, device=kv.device)  # dK | dV of this rank's block
        for step in range(ring.size):
            incoming, works = ring.exchange(kv, _KV_TAG) if step < ring.size - 1 else (kv, [])
            rows, cols, inside = block_part(step, ring.rank, ring.size, chunk, causal)
            k, v = (_repeat_heads(t[..., cols, :].to(q.dtype), groups) for t in kv.split(key.shape[-1], dim=-1))
            dq, dk, dv = block_attention_backward(q[..., rows, :], k, v, lse[..., rows], grad_out[..., rows, :],
                                                  delta[..., rows], scale, inside)
            grad_q[..., rows, :] += dq
            part = own if step == 0 else torch.zeros_like(own)
            part[..., cols, :] += torch.cat([_sum_heads(dk, groups), _sum_heads(dv, groups)], dim=-1)
            if step > 0:  # src's accumulator: the ranks between src and this one added theirs
                _wait(pending)
                if passed is not None:
                    part += passed.to(acc)
                passed, pending = ring.exchange(part.to(key.dtype), _GRAD_TAG)
            _wait(works)
            kv = incoming
        _wait(pending)
        if passed is not None:  # home: every other rank's part of this rank's own block
            own += passed.to(acc)
        grad_k, grad_v = own.split(key.shape[-1], dim=-1)
        return grad_q.to(query.dtype), grad_k.to(key.dtype), grad_v.to(value.dtype), None, None, None


def ring_attention(query, key, value, ring: Ring, causal: bool, scale: float | None, enable_gqa: bool):
    """F.scaled_dot_product_attention's result for this rank's queries over the whole sequence
    (dropout 0): `query` (..., heads, T / cp, d) in the chunk layout, `key`/`value` likewise with
    heads, one head (broadcast, as SDPA broadcasts its batch dims: Falcon's multi-query attention
    passes its one key/value head so) or (enable_gqa) a divisor of them."""
    if query.shape[-3] != key.shape[-3] and not enable_gqa and key.shape[-3] != 1:
        raise ValueError(f"attention with {query.shape[-3]} query heads and {key.shape[-3]} key/value heads needs "
                         "enable_gqa=True (as F.scaled_dot_product_attention does)")
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    # Autocast off: it would run the blocks' matmuls in 16 bits, and their softmax is summed wider by design.
    with torch.autocast(query.device.type, enabled=False):
        return RingAttention.apply(query, key, value, ring, causal, scale)
