"""A Hugging Face `transformers.LlamaForCausalLM`, used unchanged, built from a config (no download, random init).

This is the planner's test case for a third-party model: its units are model.embed_tokens,
model.rotary_emb, model.layers.0 .. model.layers.N-1, model.norm and lm_head, and the rotary
cos/sin computed once at the top are passed to every layer (so they cross every cut).

Attention is the config's default (SDPA) with its mask code as shipped: the planner answers the
mask code's data-dependent checks on the meta device itself (planner/meta_values.py), so the
model file needs nothing special.

Model args (all optional): n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, d_ff=128,
vocab_size=256, seq_len=32.

Structure: model.{embed_tokens, rotary_emb, layers.i.{input_layernorm, self_attn.{q_proj,k_proj,v_proj,o_proj},
post_attention_layernorm, mlp.{gate_proj,up_proj,down_proj}}, norm}   lm_head
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM


def make_config(
    n_layers: int = 2,
    d_model: int = 64,
    n_heads: int = 4,
    n_kv_heads: int = 2,
    d_ff: int = 128,
    vocab_size: int = 256,
    seq_len: int = 32,
    **_,
) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=d_model,
        intermediate_size=d_ff,
        num_hidden_layers=n_layers,
        num_attention_heads=n_heads,
        num_key_value_heads=n_kv_heads,
        max_position_embeddings=max(seq_len, 1),
        attention_dropout=0.0,
        tie_word_embeddings=False,
    )


def build_model(**model_args: Any) -> LlamaForCausalLM:
    return LlamaForCausalLM(make_config(**model_args))


def make_batch(batch_size: int, vocab_size: int = 256, seq_len: int = 32, **_) -> tuple[torch.Tensor, torch.Tensor]:
    """Random tokens; the targets are the inputs shifted left by one (next-token prediction)."""
    tokens = torch.randint(vocab_size, (batch_size, seq_len + 1))
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def loss_fn(output: Any, targets: torch.Tensor) -> torch.Tensor:
    logits = getattr(output, "logits", output)  # a ModelOutput, or a plain tensor
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
