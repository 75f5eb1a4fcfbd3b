"""LoRA fine-tuning of an unmodified Hugging Face Llama, wrapped by the `peft` library.

The base model is `AutoModelForCausalLM.from_config` of a shipped config (examples/hf/, by
default Llama 3 8B's; planner/hf_config_model.py), shrunk by config overrides for tests
(`-a num_hidden_layers=2 -a hidden_size=64 ...`), with random weights (no download). `peft`'s
`get_peft_model` then freezes every base weight (requires_grad=False) and adds rank-`lora_r`
adapters beside the target projections: lora_A (Kaiming-uniform random) and lora_B (zeros),
so the wrapped model starts equal to the base model. Only the adapters train; the runtime
gives frozen weights no optimizer state and no gradient traffic.

Structure (peft's names): base_model.model.model.{embed_tokens, rotary_emb, layers.i.{self_attn.{q_proj,
k_proj, v_proj, o_proj}, mlp.{gate_proj, up_proj, down_proj}, ...}, norm}, base_model.model.lm_head;
a target projection becomes `<name>.{base_layer, lora_A.default, lora_B.default}`. The
planner's units are found by structure under those wrapper names (planner/units.py).

Model args (all optional): config (path of a config.json), seq_len, lora_r=4, lora_alpha=8,
lora_targets="q_proj,v_proj" (comma-separated module names; peft matches name suffixes),
and any field of the config as an override.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from planner import hf_config_model as hf

DEFAULT_CONFIG = str(Path(__file__).resolve().parent / "hf" / "llama3-8b.json")


def build_model(config: str = DEFAULT_CONFIG, seq_len: int | None = None, lora_r: int = 4, lora_alpha: int = 8,
                lora_targets: str = "q_proj,v_proj", **overrides: Any):
    from peft import LoraConfig, get_peft_model

    base = hf.build_model(config, seq_len, **overrides)
    lora = LoraConfig(r=lora_r, lora_alpha=lora_alpha, lora_dropout=0.0, bias="none",
                      target_modules=[t.strip() for t in lora_targets.split(",") if t.strip()])
    return get_peft_model(base, lora)


def make_batch(batch_size: int, config: str = DEFAULT_CONFIG, seq_len: int | None = None, lora_r: int = 4,
               lora_alpha: int = 8, lora_targets: str = "q_proj,v_proj", **overrides: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Random tokens; the targets are the inputs shifted left by one (next-token prediction)."""
    return hf.make_batch(batch_size, config, seq_len, **overrides)


loss_fn = hf.loss_fn
