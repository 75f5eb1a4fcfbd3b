"""Llama-style decoder (Touvron et al. 2023; layout and names follow meta-llama/llama and torchtitan).

RMSNorm pre-normalisation, SwiGLU feed-forward, rotary position embeddings (RoPE, the
"rotate half" form used by Hugging Face) and grouped-query attention, no biases, untied output.

Model args (all optional): n_layers=4, d_model=64, n_heads=4, n_kv_heads=2, d_ff=256,
vocab_size=256, seq_len=32, rope_theta=10000.0, norm="torch".

`norm`: "torch" is `nn.RMSNorm`, which runs torch's fused RMSNorm kernel on a GPU (torch >= 2.8:
pytorch/pytorch PRs #150576 and #153666, "2-5x" and "around 9x" faster in eager mode than the
composite form before them); "fp32" is the reference implementation written out in float32, as
Meta's llama model.py, Hugging Face's LlamaRMSNorm and torchtitan's `RMSNorm` (until 2025, its
configs' `norm_type = "rmsnorm"`) compute it: x.float(), pow, mean, rsqrt, multiply, cast back,
multiply by the weight, each its own kernel in eager mode.

Structure (the planner's units are embed, layers.0 .. layers.N-1, norm, output):
    embed   layers.i.{attention_norm, attention.{wq,wk,wv,wo}, ffn_norm, feed_forward.{w1,w2,w3}}   norm   output
Each attention module computes its own rotary cos/sin from a non-persistent `inv_freq` buffer,
so only the hidden state flows between blocks. After materialising a meta-built model with
`to_empty()`, call `reset_parameters()` on the attention modules (as FSDP does) to refill it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    def __init__(self, d_model: int, n_heads: int, n_kv_heads: int, rope_theta: float) -> None:
        super().__init__()
        assert d_model % n_heads == 0 and n_heads % n_kv_heads == 0, "need d_model % n_heads == 0 == n_heads % n_kv_heads"
        self.head_dim = d_model // n_heads
        self.rope_theta = rope_theta
        self.wq = nn.Linear(d_model, n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(d_model, n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(d_model, n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(n_heads * self.head_dim, d_model, bias=False)
        self.register_buffer("inv_freq", torch.empty(self.head_dim // 2), persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Fill the RoPE inverse frequencies (the Linears initialise themselves)."""
        exponents = torch.arange(0, self.head_dim, 2, dtype=torch.float32, device=self.inv_freq.device) / self.head_dim
        with torch.no_grad():
            self.inv_freq.copy_(1.0 / self.rope_theta**exponents)

    def rotary(self, seq_len: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        positions = torch.arange(seq_len, dtype=torch.float32, device=self.inv_freq.device)
        freqs = torch.outer(positions, self.inv_freq.float())
        angles = torch.cat((freqs, freqs), dim=-1)  # (s, head_dim)
        return angles.cos().to(dtype), angles.sin().to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        # -1: the local head count, so this still works when wq/wk/wv are sharded colwise.
        q = self.wq(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        cos, sin = self.rotary(s, q.dtype)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        n_rep = q.shape[1] // k.shape[1]  # query heads per key/value head
        if n_rep > 1:
            k = k.repeat_interleave(n_rep, dim=1)
            v = v.repeat_interleave(n_rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self, d_model: int, d_ff: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(d_model, d_ff, bias=False)  # gate
        self.w2 = nn.Linear(d_ff, d_model, bias=False)  # down
        self.w3 = nn.Linear(d_model, d_ff, bias=False)  # up

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Fp32RMSNorm(nn.Module):
    """RMSNorm as the reference Llama code writes it, in float32 (module docstring, `norm="fp32"`)."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


NORMS = {"torch": nn.RMSNorm, "fp32": Fp32RMSNorm}


def make_norm(kind: str, dim: int) -> nn.Module:
    if kind not in NORMS:
        raise ValueError(f"norm={kind!r}: use one of {', '.join(NORMS)}")
    return NORMS[kind](dim, eps=1e-5)


class TransformerBlock(nn.Module):
    def __init__(self, d_model: int, n_heads: int, n_kv_heads: int, d_ff: int, rope_theta: float,
                 norm: str = "torch") -> None:
        super().__init__()
        self.attention_norm = make_norm(norm, d_model)
        self.attention = Attention(d_model, n_heads, n_kv_heads, rope_theta)
        self.ffn_norm = make_norm(norm, d_model)
        self.feed_forward = FeedForward(d_model, d_ff)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    def __init__(
        self, n_layers: int, d_model: int, n_heads: int, n_kv_heads: int, d_ff: int, vocab_size: int, rope_theta: float,
        norm: str = "torch",
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, d_model)
        self.layers = nn.ModuleList(
            TransformerBlock(d_model, n_heads, n_kv_heads, d_ff, rope_theta, norm) for _ in range(n_layers)
        )
        self.norm = make_norm(norm, d_model)
        self.output = nn.Linear(d_model, vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.output(self.norm(x))


def build_model(
    n_layers: int = 4,
    d_model: int = 64,
    n_heads: int = 4,
    n_kv_heads: int = 2,
    d_ff: int = 256,
    vocab_size: int = 256,
    rope_theta: float = 10000.0,
    norm: str = "torch",
    **_,
) -> Llama:
    return Llama(n_layers, d_model, n_heads, n_kv_heads, d_ff, vocab_size, rope_theta, norm)


def make_batch(batch_size: int, vocab_size: int = 256, seq_len: int = 32, **_) -> tuple[torch.Tensor, torch.Tensor]:
    """Random tokens; the targets are the inputs shifted left by one (next-token prediction)."""
    tokens = torch.randint(vocab_size, (batch_size, seq_len + 1))
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def loss_fn(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.reshape(-1, output.shape[-1]), targets.reshape(-1))
