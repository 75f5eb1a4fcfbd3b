"""Tensor parallelism on stock Hugging Face architectures: does the solver's tp 2 plan train like
one process?

For each model type, transformers' own default config (`AutoConfig.for_model`), shrunk to two
layers of width 64 (the fields each config has of: layers, width, MLP width, heads, key/value
heads, head dim, vocabulary 256, token ids inside it, dropout and PhiMoE's router jitter off:
noise drawn in training draws differently over ranks than in one process), is profiled on CPU, solved
with tp 2 pinned (no sequence parallelism) on two CPU processes, and run for three steps beside
the one-process reference (tests/test_runtime_parity.py `run`). A row per model: how many
modules the plan shards, the largest relative loss difference, the largest parameter
difference after three steps, or the error. The test suite's parity tolerances are 1e-5
(losses) and 1e-4 (parameters). Writes benchmarks/results/hf_tp_parity.csv.

    python benchmarks/hf_tp_parity.py [MODEL_TYPE ...]
"""

from __future__ import annotations

import csv
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODEL_TYPES = ["llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi", "phi3", "gpt_neox", "olmo",
               "olmo2", "mixtral", "granite", "starcoder2", "opt", "cohere", "stablelm", "gptj", "gpt2", "bloom",
               "gpt_bigcode", "codegen", "persimmon", "mpt", "glm", "exaone4", "smollm3", "qwen3_moe", "falcon",
               "llama4_text", "qwen2_moe", "phimoe", "jetmoe", "bitnet", "glm4", "ernie4_5", "helium", "internlm3", "olmo3",
               "seed_oss", "cohere2", "apertus", "vaultgemma", "gpt_neo", "xglm"]
SMALL = {"num_hidden_layers": 2, "n_layer": 2, "hidden_size": 64, "n_embd": 64, "d_model": 64, "intermediate_size": 128,
         "ffn_dim": 128, "n_inner": 128, "ffn_hidden_size": 128, "num_attention_heads": 4, "n_head": 4,
         "num_key_value_heads": 2, "num_kv_heads": 2, "head_dim": 16, "vocab_size": 256, "pad_token_id": 0,
         "bos_token_id": 0, "eos_token_id": 1, "rotary_dim": 8, "n_positions": 128, "max_position_embeddings": 128,
         "word_embed_proj_dim": 64, "sliding_window": 16, "dropout": 0.0, "attention_dropout": 0.0, "layerdrop": 0.0,
         "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "hidden_dropout": 0.0,
         "residual_dropout": 0.0, "router_jitter_noise": 0.0}


def small_args(model_type: str, folder: Path, layers: int = 2) -> dict:
    """Model arguments of planner/hf_config_model.py for transformers' default config of
    `model_type`, written to `folder`, shrunk to `layers` layers and the sizes of `SMALL`."""
    from transformers import AutoConfig

    cfg = AutoConfig.for_model(model_type)
    fields = cfg.to_dict()
    config = folder / f"{model_type}.json"
    config.write_text(json.dumps(dict(fields, model_type=model_type)))
    known = set(fields) | set(getattr(cfg, "attribute_map", {}))
    small = dict(SMALL, num_hidden_layers=layers, n_layer=layers)
    return {"config": str(config), "seq_len": 32,
            **{k: v for k, v in small.items() if k in known and fields.get(k, 0) is not None}}


def parity(plan, folder: Path) -> tuple[float, float]:
    """Three steps of `plan` on its ranks beside one process (tests/test_runtime_parity.py `run`):
    the largest relative loss difference and the largest parameter difference."""
    from tests.test_runtime_parity import run

    folder.mkdir()
    path = plan.save(folder / "plan.json")
    ref, ref_params = run(path, folder, 1, reference=True)
    par, par_params = run(path, folder, plan.world_size)
    loss = max(abs(a - b) / abs(a) for a, b in zip(ref["losses"], par["losses"], strict=True))
    return loss, max((par_params[k] - ref_params[k]).abs().max().item() for k in ref_params)


def check(model_type: str, folder: Path) -> dict:
    import planner.hf_config_model as hf
    from planner.cluster import make_cluster
    from planner.profiler import profile_model
    from planner.solver.solve import Pins, solve

    profile = profile_model(hf.__file__, small_args(model_type, folder), [1, 2], device="cpu", repeats=1, warmup=0)
    plan = solve(profile, make_cluster(2, gpu="cpu"), 4, Pins(tp=2, sequence_parallel=False))
    loss, worst = parity(plan, folder / model_type)
    return dict(sharded=sum(1 for s in plan.stages for v in s.tp_plan.values() if v != "replicate"),
                loss_rel_diff=loss, param_max_diff=worst)


def main(model_types: list[str]) -> None:
    import transformers

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for model_type in model_types:
            started = time.perf_counter()
            try:
                row = dict(model_type=model_type, **check(model_type, Path(tmp)), error="")
            except Exception as exc:  # noqa: BLE001 - a row says what failed
                row = dict(model_type=model_type, sharded="", loss_rel_diff="", param_max_diff="",
                           error=f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1][:200] if str(exc).strip() else ''}")
            row.update(seconds=round(time.perf_counter() - started, 1), transformers=transformers.__version__)
            rows.append(row)
            print(row, flush=True)
    RESULTS = ROOT / "benchmarks" / "results"
    RESULTS.mkdir(parents=True, exist_ok=True)
    with open(RESULTS / "hf_tp_parity.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


if __name__ == "__main__":
    main(sys.argv[1:] or MODEL_TYPES)
