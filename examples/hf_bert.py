"""A Hugging Face `transformers.BertForMaskedLM`, used unchanged, built from a config (no download,
random init): an encoder, with the module layout most of Hugging Face's encoders share (BERT,
RoBERTa, ViT's older classes).

Its units are bert.embeddings, bert.encoder.layer.0 .. bert.encoder.layer.N-1 and cls. Each layer
splits its linears over sibling modules: attention.self.{query,key,value}, then
attention.output.dense; intermediate.dense, then output.dense. A tensor-parallel plan pairs them
by data flow, not by parent (planner/solver/intra_op.py `sharded_feeds`): query, key and value
column-sharded with attention.output.dense row-sharded, intermediate.dense with output.dense.
The masked-LM head's decoder is tied to the word embeddings.

Model args (all optional): n_layers=2, d_model=64, n_heads=4, d_ff=256, vocab_size=256,
seq_len=32, dropout=0.0 (BERT trains with 0.1; 0 keeps runs comparable with one process).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from transformers import BertConfig, BertForMaskedLM


def build_model(n_layers: int = 2, d_model: int = 64, n_heads: int = 4, d_ff: int = 256, vocab_size: int = 256,
                seq_len: int = 32, dropout: float = 0.0, **_) -> BertForMaskedLM:
    return BertForMaskedLM(BertConfig(
        vocab_size=vocab_size, hidden_size=d_model, num_hidden_layers=n_layers, num_attention_heads=n_heads,
        intermediate_size=d_ff, max_position_embeddings=max(seq_len, 1), hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout,
    ))


def make_batch(batch_size: int, vocab_size: int = 256, seq_len: int = 32, **_) -> tuple[torch.Tensor, torch.Tensor]:
    """Random tokens, every one of them to predict (a masked LM's targets at the masked
    positions; here all positions, unmasked, which costs the same)."""
    tokens = torch.randint(vocab_size, (batch_size, seq_len))
    return tokens, tokens.clone()


def loss_fn(output: Any, targets: torch.Tensor) -> torch.Tensor:
    logits = getattr(output, "logits", output)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
