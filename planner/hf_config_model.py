"""A model file (the contract of planner/model_file.py) for any Hugging Face causal LM config.

`planner profile --hf-config PATH/config.json` profiles this file with `config=PATH`: the
model is `AutoModelForCausalLM.from_config(config)`, unmodified, with random weights (no
download, no network), built on the meta device for analytic profiles and for real for
measured ones, exactly as a user's own model file would be. Every other model argument
overrides a field of the config (`-a num_hidden_layers=2`: a small model of the same shape,
for a test or a measured profile on a small machine), except `seq_len` (tokens per sample of
the synthetic batch, default the smaller of 2048 and the config's context length).

The plan records this file and the same arguments, so `planner run` rebuilds the same model.
"""

from __future__ import annotations

import difflib
import json
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from planner.errors import PlannerError

DEFAULT_SEQ_LEN = 2048


def load_config(config: str, **overrides: Any):
    """The config at `config` (a config.json or a folder holding one) with `overrides` applied;
    unknown override names are refused with the closest known one."""
    from transformers import AutoConfig

    path = Path(config).expanduser()
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise PlannerError(f"Hugging Face config {path} does not exist.", "Pass the path of a model's config.json.")
    try:
        fields = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise PlannerError(f"{path} is not a JSON config: {exc}.", "Pass the path of a model's config.json.") from exc
    model_type = fields.pop("model_type", None) if isinstance(fields, dict) else None
    if not model_type:
        raise PlannerError(f"{path} has no `model_type`, so no model class can be chosen for it.",
                           "Pass a config.json as Hugging Face ships it (it names its model_type).")
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING:
        raise PlannerError(f"transformers does not know model_type {model_type!r} of {path}.",
                           "Upgrade transformers, or check the config's model_type.")
    try:
        cfg = AutoConfig.for_model(model_type, **fields)
    except Exception as exc:  # noqa: BLE001 - the config class's own checks (ValueError, huggingface_hub's validators)
        said = " ".join(str(exc).split())
        raise PlannerError(f"transformers refuses the {model_type} config {path}: {said}",
                           "Fix the fields it names (a config.json as the model ships it is accepted), or start from "
                           "the published config and change fields with -a KEY=VALUE.") from exc
    known = _field_names(cfg)
    unknown = sorted(k for k in overrides if k not in known)
    if unknown:
        close = {k: difflib.get_close_matches(k, known, n=1) for k in unknown}
        said = ", ".join(f"{k!r}" + (f" (did you mean {c[0]!r}?)" if c else "") for k, c in close.items())
        raise PlannerError(f"Model arguments {said} are not fields of the {model_type} config {path}.",
                           "Use the config's own field names (e.g. -a num_hidden_layers=2; a nested config's with its "
                           "name, e.g. -a text_config.num_hidden_layers=2), or seq_len for the batch.")
    if overrides:
        # Built again with the overrides among the fields, so that what the config class derives
        # from them in its __init__ follows (Falcon's ffn_hidden_size is 4 x hidden_size unless
        # given: set after construction, -a hidden_size=64 kept an FFN 32768 wide). Then set, for
        # an alias (num_experts) or a field the class does not take in __init__. A class that
        # refuses the combination (Gemma 3's validator wants as many layer_types as layers, and
        # the JSON lists them all) keeps the fields as built and the overrides set on top, the
        # model reading what it needs of them (the first layers' types).
        try:
            cfg = AutoConfig.for_model(model_type, **_with_overrides(fields, overrides))
        except Exception:  # noqa: BLE001 - any refusal of the class: the config built above stands
            pass
    for key, value in overrides.items():
        owner, _, name = key.rpartition(".")
        setattr(_sub_config(cfg, owner), name, value)
    _check_padding_token(cfg, path, overrides)
    return cfg


def _with_overrides(fields: dict, overrides: dict[str, Any]) -> dict:
    """`fields` (a config.json's) with `overrides` in place, a dotted key (text_config.hidden_size)
    in the nested config's fields where the JSON holds them as an object."""
    merged = json.loads(json.dumps(fields))  # a deep copy of plain JSON
    for key, value in overrides.items():
        *owners, name = key.split(".")
        target = merged
        for part in owners:
            target = target.get(part) if isinstance(target, dict) else None
        if isinstance(target, dict):
            target[name] = value
    return merged


def _text_config(cfg):
    """The config of the language model: `cfg` itself, or a multimodal model's text_config
    (Gemma 3, whose vocabulary and context live there; the batch is text alone)."""
    return cfg.get_text_config(decoder=True) if hasattr(cfg, "get_text_config") else cfg


def _sub_config(cfg, dotted: str):
    """The config reached by the dotted path `dotted` ("" is `cfg`; "text_config" a multimodal
    model's language model)."""
    for part in filter(None, dotted.split(".")):
        cfg = getattr(cfg, part)
    return cfg


def _field_names(cfg, prefix: str = "") -> set[str]:
    """The fields an override may name: the config's own and its aliases (num_experts), and
    those of nested configs by their dotted path (text_config.num_hidden_layers)."""
    from transformers import PretrainedConfig

    names = {prefix + k for k in (*cfg.to_dict(), *getattr(cfg, "attribute_map", {}))}
    for key, value in vars(cfg).items():
        if isinstance(value, PretrainedConfig):
            names |= _field_names(value, f"{prefix}{key}.")
    return names


def _check_padding_token(cfg, path: Path, overrides: dict) -> None:
    """A padding token outside the vocabulary, as shrinking vocab_size leaves it: the embedding
    would refuse it with an assertion about padding_idx; say which fields to change instead."""
    text = _text_config(cfg)
    pad, vocab = getattr(text, "pad_token_id", None), getattr(text, "vocab_size", None)
    if isinstance(pad, int) and isinstance(vocab, int) and not 0 <= pad < vocab:
        how = " (vocab_size set by -a)" if "vocab_size" in overrides else ""
        raise PlannerError(f"The {cfg.model_type} config {path} pads with token {pad}, outside its vocabulary of "
                           f"{vocab}{how}: the embedding cannot reserve it.",
                           f"Pass -a pad_token_id=0 with the smaller vocabulary, or keep vocab_size above {pad}.")


CONTEXT_FIELDS = ("max_position_embeddings", "n_positions", "max_seq_len")
"""Where configs state their context length (GPT-2's n_positions, MPT's max_seq_len: its ALiBi
biases are built for that many tokens, and a longer batch failed inside the attention)."""


def _seq_len(cfg, seq_len: int | None) -> int:
    text = _text_config(cfg)
    field = next((f for f in CONTEXT_FIELDS if getattr(text, f, None)), None)
    context = getattr(text, field) if field else None
    if seq_len is None:
        return min(DEFAULT_SEQ_LEN, context) if context else DEFAULT_SEQ_LEN
    if context and seq_len > context:
        raise PlannerError(f"seq_len={seq_len} is longer than the config's context of {context} tokens ({field}).",
                           f"Use seq_len <= {context}, or raise {field} in the config (-a {field}={seq_len}).")
    return int(seq_len)


def build_model(config: str, seq_len: int | None = None, **overrides: Any):
    from transformers import AutoModelForCausalLM

    cfg = load_config(config, **overrides)
    _seq_len(cfg, seq_len)  # refuse a bad length before the (possibly long) build
    try:
        model = AutoModelForCausalLM.from_config(cfg)
    except ValueError as exc:
        if "Unrecognized configuration class" not in str(exc):
            raise
        raise PlannerError(f"transformers has no causal language model for model_type {cfg.model_type!r} "
                           "(AutoModelForCausalLM does not map it): --hf-config builds decoder-only language models.",
                           "Write a model file for it (build_model, make_batch, loss_fn: see examples/hf_llama.py) "
                           "and profile that.") from None
    # A config's dtype is how its checkpoint is stored (transformers 5 builds in it); training
    # keeps float32 master weights and the plan's dtype runs under autocast, as for any model file.
    return model.to(torch.float32)


def make_batch(batch_size: int, config: str, seq_len: int | None = None, **overrides: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Random tokens; the targets are the inputs shifted left by one (next-token prediction)."""
    cfg = load_config(config, **overrides)
    tokens = torch.randint(_text_config(cfg).vocab_size, (batch_size, _seq_len(cfg, seq_len) + 1))
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def loss_fn(output: Any, targets: torch.Tensor) -> torch.Tensor:
    logits = getattr(output, "logits", output)  # a ModelOutput, or a plain tensor
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
