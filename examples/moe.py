"""Mixture-of-experts decoder: a small causal transformer whose feed-forward is a sparse MoE.

Routing as Mixtral (Jiang et al. 2024) and Qwen3-MoE: a linear router, softmax over the
experts, top-k, the k weights renormalised to sum to 1 (top-2 of 8 by default). Each expert
is a SwiGLU MLP. Options:
- `shared_expert=True`: one dense SwiGLU expert every token also goes through (DeepSeekMoE,
  Dai et al. 2024; Qwen2/3-MoE's shared expert), added to the routed output;
- `granularity=g`: fine-grained expert segmentation (DeepSeekMoE, section 3.1): g times as
  many experts, each 1/g as wide, and g times the top-k, so FLOPs per token stay the same.

The experts module follows Hugging Face transformers 5.x's calling convention
(`Qwen3MoeExperts`, `MixtralExperts`): it holds the experts' weights batched with a leading
expert dim (`gate_up_proj` [E, 2F, D], `down_proj` [E, D, F]) and is called as
`experts(hidden_states [T, D], top_k_index [T, k], top_k_weights [T, k])`, returning the
weighted sum of each token's experts [T, D]. runtime/apply_ep.py shards such modules.

Load balancing: Switch Transformer's auxiliary loss (Fedus et al. 2021, eq. 4),
`E * sum_e f_e * P_e` with f_e the fraction of the top-k assignments that went to expert e
and P_e the mean router probability of e (1 when perfectly balanced), computed *per
sequence* and averaged over sequences (DeepSeek-V3's sequence-wise form, Liu et al. 2024,
eq. 17-20). Per sequence, it is a mean over samples, as the cross-entropy is, so splitting a
batch into data-parallel replicas and micro-batches leaves the loss and its gradient
unchanged; the batch-wide form would not be. The two means over the sequence go through
`MoE.sequence_mean`, which a runtime that splits sequences over ranks replaces. Each MoE layer adds its (B,) per-sequence aux
loss to a running total that flows through the blocks beside the hidden state (so it
crosses pipeline cuts as an activation); the model returns (logits, aux [B]) and `loss_fn`
is cross-entropy + aux_loss_coef * mean(aux). The coefficient is applied in the layers.

Model args (all optional): n_layers=2, d_model=32, n_heads=4, vocab_size=64, seq_len=16,
num_experts=8, top_k=2, moe_d_ff=32, granularity=1, shared_expert=False, shared_d_ff=None
(moe_d_ff), aux_loss_coef=0.01. No position encoding: causal attention alone orders the
tokens (NoPE, Haviv et al. 2022), enough for a test model.

Structure (the planner's units are embed, layers.0 .. layers.N-1, norm, output):
    embed   layers.i.{attention_norm, attention.{wq,wk,wv,wo}, moe_norm,
                      moe.{router.proj, experts, shared_expert.{w1,w2,w3}}}   norm   output
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class Attention(nn.Module):
    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        assert d_model % n_heads == 0, "d_model must be divisible by n_heads"
        self.head_dim = d_model // n_heads
        self.wq = nn.Linear(d_model, d_model, bias=False)
        self.wk = nn.Linear(d_model, d_model, bias=False)
        self.wv = nn.Linear(d_model, d_model, bias=False)
        self.wo = nn.Linear(d_model, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        # -1: the local head count, so that wq/wk/wv (colwise) and wo (rowwise) can be TP-sharded.
        q, k, v = (w(x).view(b, s, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, s, -1))


class SwiGLU(nn.Module):
    """A dense SwiGLU MLP (the shared expert)."""

    def __init__(self, d_model: int, d_ff: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(d_model, d_ff, bias=False)  # gate
        self.w2 = nn.Linear(d_ff, d_model, bias=False)  # down
        self.w3 = nn.Linear(d_model, d_ff, bias=False)  # up

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Router(nn.Module):
    """Linear -> softmax (fp32) -> top-k -> renormalised weights (Mixtral, Qwen3-MoE norm_topk_prob)."""

    def __init__(self, d_model: int, num_experts: int, top_k: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.proj = nn.Linear(d_model, num_experts, bias=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, D] -> (probs [T, E], top_k_weights [T, k], top_k_index [T, k])."""
        probs = F.softmax(self.proj(x), dim=-1, dtype=torch.float32)
        weights, index = torch.topk(probs, self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return probs, weights.to(x.dtype), index


class Experts(nn.Module):
    """E SwiGLU experts as batched weights, called like Hugging Face's Qwen3MoeExperts."""

    def __init__(self, num_experts: int, d_model: int, d_ff: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * d_ff, d_model))
        self.down_proj = nn.Parameter(torch.empty(num_experts, d_model, d_ff))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Each expert's matrices as nn.Linear initialises its weight: U(-1/sqrt(fan_in), 1/sqrt(fan_in))."""
        for weight in (self.gate_up_proj, self.down_proj):
            bound = 1.0 / math.sqrt(weight.shape[-1])
            nn.init.uniform_(weight, -bound, bound)

    def _expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(x, self.gate_up_proj[e]).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, self.down_proj[e])

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        num_tokens, k = top_k_index.shape
        # Token copies grouped by expert (a stable sort), one matmul pair per expert.
        flat = top_k_index.reshape(-1)
        order = flat.argsort(stable=True)
        if hidden_states.is_meta:
            # No routing values on the meta device (tracing, analytic profiles): the copies go
            # evenly to the experts, the balanced routing the cost model prices
            # (planner/moe.py `balanced_routing`), with the real grouping's shapes, FLOPs and
            # saved tensors.
            base, extra = divmod(num_tokens * k, self.num_experts)
            counts = [base + (e < extra) for e in range(self.num_experts)]
        else:
            counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        rows = hidden_states[order // k].split(counts)
        out = torch.cat([self._expert(e, x) for e, x in enumerate(rows)])
        out = out * top_k_weights.reshape(-1)[order, None]
        return torch.zeros_like(hidden_states).index_add_(0, order // k, out.to(hidden_states.dtype))


class MoE(nn.Module):
    def __init__(self, d_model: int, num_experts: int, top_k: int, d_ff: int, shared_d_ff: int | None,
                 aux_loss_coef: float) -> None:
        super().__init__()
        self.num_experts, self.aux_loss_coef = num_experts, aux_loss_coef
        self.router = Router(d_model, num_experts, top_k)
        self.experts = Experts(num_experts, d_model, d_ff)
        self.shared_expert = SwiGLU(d_model, shared_d_ff) if shared_d_ff else None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, S, D] -> (output [B, S, D], aux_loss_coef * per-sequence aux loss [B])."""
        b, s, d = x.shape
        flat = x.reshape(-1, d)
        probs, weights, index = self.router(flat)
        out = self.experts(flat, index, weights).view(b, s, d)
        if self.shared_expert is not None:
            out = out + self.shared_expert(x)
        # Switch's f_e (no gradient: a count) and P_e, per sequence (module docstring).
        per_token = F.one_hot(index.view(b, s, -1), self.num_experts).to(probs.dtype).sum(dim=2)  # [B, S, E]
        assigned = self.sequence_mean(per_token) / index.shape[-1]  # [B, E], f_e: a share of the T k copies
        mean_prob = self.sequence_mean(probs.view(b, s, -1))  # [B, E]
        aux = self.num_experts * (assigned * mean_prob).sum(dim=-1)
        return out, self.aux_loss_coef * aux

    def sequence_mean(self, x: torch.Tensor) -> torch.Tensor:
        """Mean over dim 1 (the sequence) of per-token statistics [B, S, E]. A method of its own so
        that a runtime holding only a chunk of each sequence (sequence parallelism) can replace it
        by the mean over the whole sequence (runtime/apply_ep.py `apply_moe_sequence_parallel`)."""
        return x.mean(dim=1)


class Block(nn.Module):
    def __init__(self, d_model: int, n_heads: int, moe: MoE) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(d_model, eps=1e-5)
        self.attention = Attention(d_model, n_heads)
        self.moe_norm = nn.RMSNorm(d_model, eps=1e-5)
        self.moe = moe

    def forward(self, x: torch.Tensor, aux: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = x + self.attention(self.attention_norm(x))
        out, layer_aux = self.moe(self.moe_norm(x))
        return x + out, aux + layer_aux


class MoEDecoder(nn.Module):
    def __init__(self, n_layers: int, d_model: int, n_heads: int, vocab_size: int, num_experts: int, top_k: int,
                 moe_d_ff: int, shared_d_ff: int | None, aux_loss_coef: float) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, d_model)
        self.layers = nn.ModuleList(
            Block(d_model, n_heads, MoE(d_model, num_experts, top_k, moe_d_ff, shared_d_ff, aux_loss_coef))
            for _ in range(n_layers)
        )
        self.norm = nn.RMSNorm(d_model, eps=1e-5)
        self.output = nn.Linear(d_model, vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.embed(tokens)
        aux = torch.zeros(tokens.shape[0], device=x.device, dtype=torch.float32)
        for layer in self.layers:
            x, aux = layer(x, aux)
        return self.output(self.norm(x)), aux


def build_model(n_layers: int = 2, d_model: int = 32, n_heads: int = 4, vocab_size: int = 64, num_experts: int = 8,
                top_k: int = 2, moe_d_ff: int = 32, granularity: int = 1, shared_expert: bool = False,
                shared_d_ff: int | None = None, aux_loss_coef: float = 0.01, **_) -> MoEDecoder:
    if granularity < 1 or moe_d_ff % granularity:
        raise ValueError(f"granularity {granularity} must be >= 1 and divide moe_d_ff {moe_d_ff}")
    shared = (shared_d_ff or moe_d_ff) if shared_expert else None
    return MoEDecoder(n_layers, d_model, n_heads, vocab_size, num_experts * granularity, top_k * granularity,
                      moe_d_ff // granularity, shared, aux_loss_coef)


def make_batch(batch_size: int, vocab_size: int = 64, seq_len: int = 16, **_) -> tuple[torch.Tensor, torch.Tensor]:
    """Random tokens; the targets are the inputs shifted left by one (next-token prediction)."""
    tokens = torch.randint(vocab_size, (batch_size, seq_len + 1))
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def loss_fn(output: tuple[torch.Tensor, torch.Tensor], targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy (mean over tokens) plus the load-balancing loss (mean over sequences; scaled in the layers)."""
    logits, aux = output
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)) + aux.mean()
