"""GPT-2/3-style decoder-only transformer (Radford et al. 2019; Brown et al. 2020; nanoGPT layout).

Pre-LayerNorm residual blocks with causal multi-head attention and a GELU (tanh) MLP, learned
token and position embeddings, and an untied output head.

Model args (all optional): n_layers=4, d_model=64, n_heads=4, d_ff=256, vocab_size=256, seq_len=32,
attention="sdpa" (fused scaled_dot_product_attention) or "math" (explicit scores and softmax, as
Megatron-LM ran in 2021), dropout=0.0 (attention and residual dropout, as GPT-2/3 train with 0.1).

Structure (the planner's units are embed, blocks.0 .. blocks.N-1, norm, head):
    embed.{tok,pos}   blocks.i.{ln1, attn.{wq,wk,wv,wo}, ln2, mlp.{fc_in,act,fc_out}}   norm   head
Attention reshapes infer the local head count, so wq/wk/wv (colwise) and wo (rowwise) can be
sharded by tensor parallelism.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Embeddings(nn.Module):
    def __init__(self, vocab_size: int, d_model: int, seq_len: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Embedding(seq_len, d_model)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        return self.tok(idx) + self.pos(positions)


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, n_heads: int, attention: str = "sdpa", dropout: float = 0.0) -> None:
        super().__init__()
        assert d_model % n_heads == 0, "d_model must be divisible by n_heads"
        assert attention in ("sdpa", "math"), "attention must be 'sdpa' or 'math'"
        self.head_dim = d_model // n_heads
        self.attention, self.dropout = attention, dropout
        self.wq = nn.Linear(d_model, d_model)
        self.wk = nn.Linear(d_model, d_model)
        self.wv = nn.Linear(d_model, d_model)
        self.wo = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        # (b, s, local_heads, hd) -> (b, local_heads, s, hd); -1 keeps this valid under TP.
        q = self.wq(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        p = self.dropout if self.training else 0.0
        if self.attention == "sdpa":
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=p)
        else:  # materialised scores: s x s per head, kept for backward
            scores = (q @ k.transpose(-2, -1)) * self.head_dim**-0.5
            causal = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
            y = F.dropout(scores.masked_fill(~causal, float("-inf")).softmax(-1), p) @ v
        return F.dropout(self.wo(y.transpose(1, 2).reshape(b, s, -1)), p)


class MLP(nn.Module):
    def __init__(self, d_model: int, d_ff: int) -> None:
        super().__init__()
        self.fc_in = nn.Linear(d_model, d_ff)
        self.act = nn.GELU(approximate="tanh")
        self.fc_out = nn.Linear(d_ff, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc_out(self.act(self.fc_in(x)))


class Block(nn.Module):
    def __init__(self, d_model: int, n_heads: int, d_ff: int, attention: str = "sdpa", dropout: float = 0.0) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_heads, attention, dropout)
        self.dropout = dropout
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = MLP(d_model, d_ff)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + F.dropout(self.mlp(self.ln2(x)), self.dropout if self.training else 0.0)


class GPT(nn.Module):
    def __init__(self, n_layers: int, d_model: int, n_heads: int, d_ff: int, vocab_size: int, seq_len: int,
                 attention: str = "sdpa", dropout: float = 0.0) -> None:
        super().__init__()
        self.embed = Embeddings(vocab_size, d_model, seq_len)
        self.blocks = nn.ModuleList(Block(d_model, n_heads, d_ff, attention, dropout) for _ in range(n_layers))
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def build_model(
    n_layers: int = 4, d_model: int = 64, n_heads: int = 4, d_ff: int = 256, vocab_size: int = 256, seq_len: int = 32,
    attention: str = "sdpa", dropout: float = 0.0, **_
) -> GPT:
    return GPT(n_layers, d_model, n_heads, d_ff, vocab_size, seq_len, attention, dropout)


def make_batch(batch_size: int, vocab_size: int = 256, seq_len: int = 32, **_) -> tuple[torch.Tensor, torch.Tensor]:
    """Random tokens; the targets are the inputs shifted left by one (next-token prediction)."""
    tokens = torch.randint(vocab_size, (batch_size, seq_len + 1))
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def loss_fn(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.reshape(-1, output.shape[-1]), targets.reshape(-1))
