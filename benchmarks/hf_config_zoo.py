"""Causal LMs of transformers the planner was never shown, from a config alone, as a user runs them.

For each model type: `AutoConfig.for_model(type)` shrunk to two layers of width 64 (vocabulary
256, special tokens moved inside it, every `*dropout*`, `*pdrop*` and `*jitter*` field 0 so that layouts can be held to
one another), then the CLI end to end on CPU: `planner profile --hf-config` (measured, 32 tokens),
`planner solve` for one process and for two (free, `--tp 2`, `--pp 2`), `planner run` for two
steps each. Recorded: whether each stage ran, the layout the solver chose, how many modules the
tp2 plan shards, and whether each layout's losses match the one-process run's (float32; 1e-4).
The first fifteen types were named nowhere in tests/ or examples/hf/ when they were added (Llama,
Qwen3, Mistral, Falcon, Phi-3, OLMo 2, OPT, GPT-2, DeepSeek-V3, Mixtral, GPT-NeoX, BERT, T5, ViT,
Whisper are). The others (2026-11-29) are the newest families of transformers 5.24: Qwen3.5 (dense
and MoE), Qwen3-Next, Gemma 4, gpt-oss, Llama 4, DeepSeek-V3.2 and V4, GLM-4.5 MoE and its latent
attention "lite", MiniMax-M2, OLMoE, Hunyuan V3, Laguna, MiMo-V2-Flash, Qwen4, and the hybrids of
attention with state-space or linear-attention layers (Falcon-H1, Nemotron-H, Jamba, Granite 4
hybrid, Kimi Linear, Bamba, OLMo hybrid), recurrent models (RWKV, xLSTM, RecurrentGemma), and a few
older ones (BLOOM, MPT, StarCoder's GPT-BigCode, PhiMoE, AFMoE). Left out because their default config, shrunk so, does not run in
transformers itself (a forward of the model alone fails the same way): DBRX, LFM2-MoE, dots1,
LongCat-Flash, Gemma 3n, Youtu, Zamba2 and Mamba2 (their configs tie sizes the shrink breaks).

    OMP_NUM_THREADS=1 python benchmarks/hf_config_zoo.py [MODEL_TYPE ...]

Writes benchmarks/results/hf_config_zoo.csv.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
TYPES = ["gemma3_text", "smollm3", "granite", "glm4", "cohere2", "qwen2_moe", "ernie4_5", "exaone4", "seed_oss",
         "apertus", "olmo3", "hunyuan_v1_dense", "minimax", "arcee", "lfm2",
         "qwen3_5_text", "qwen3_5_moe_text", "qwen3_next", "gemma4_text", "gpt_oss", "llama4_text", "deepseek_v32",
         "deepseek_v4", "glm4_moe", "glm4_moe_lite", "minimax_m2", "olmoe", "hy_v3", "laguna", "mimo_v2_flash",
         "qwen4_exp_text", "falcon_h1", "nemotron_h", "jamba", "granitemoehybrid", "kimi_linear", "bamba", "olmo_hybrid",
         "rwkv", "xlstm", "recurrent_gemma", "bloom", "mpt", "gpt_bigcode", "phimoe", "afmoe", "falcon"]
SMALL = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, vocab_size=256, max_position_embeddings=128)
LAYOUTS = {"one": ["--gpus", "1"], "free": ["--gpus", "2"], "tp2": ["--gpus", "2", "--tp", "2"],
           "pp2": ["--gpus", "2", "--pp", "2"]}
TIMEOUT_S = 600  # a hybrid's CPU profile (Mamba's reference scan) takes minutes under load


def small_config(model_type: str, path: Path) -> Path:
    """The model type's default config at SMALL sizes, its special tokens inside the vocabulary, no dropout
or router jitter
(and as many key heads as query heads where attention is latent: its code needs them equal)."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.for_model(model_type, **SMALL).to_dict()
    except AttributeError:  # a config whose head_dim is derived, read-only (Falcon's)
        config = AutoConfig.for_model(model_type, **{k: v for k, v in SMALL.items() if k != "head_dim"}).to_dict()
    if config.get("kv_lora_rank"):  # latent attention (MLA) has no grouped keys: as many as the queries
        config["num_key_value_heads"] = config["num_attention_heads"]
    for key, value in list(config.items()):
        if key.endswith("token_id") and isinstance(value, int) and value >= SMALL["vocab_size"]:
            config[key] = 0
        elif key.endswith("token_id") and isinstance(value, list):
            config[key] = [v if v < SMALL["vocab_size"] else 0 for v in value]
        elif any(word in key for word in ("dropout", "pdrop", "jitter")) and isinstance(value, float):
            config[key] = 0.0
    path.write_text(json.dumps(config))
    return path


def planner(*args: str, cwd: Path, timeout_s: float = TIMEOUT_S) -> subprocess.CompletedProcess:
    """`planner ARGS` as a user types it, one thread per process (also benchmarks/torchvision_zoo.py's)."""
    return subprocess.run([sys.executable, "-m", "planner.cli", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout_s, env={**os.environ, "OMP_NUM_THREADS": "1"})


def _last_line(done: subprocess.CompletedProcess) -> str:
    lines = [line for line in (done.stderr + done.stdout).splitlines() if line.strip()]
    return lines[-1][:200] if lines else f"exit {done.returncode}"


def try_type(model_type: str, work: Path) -> dict:
    row: dict = {"model_type": model_type}
    config = small_config(model_type, work / f"{model_type}.json")
    done = planner("profile", "--hf-config", str(config), "--seq-len", "32", "--micro-batch-sizes", "1,2",
                   "-o", str(work / "profile.json"), cwd=ROOT)
    row["profiled"] = done.returncode == 0
    if not row["profiled"]:
        return {**row, "note": _last_line(done)}
    losses = {}
    for name, args in LAYOUTS.items():
        plan = work / f"plan-{name}.json"
        done = planner("solve", "-p", str(work / "profile.json"), "--gpu", "cpu", "-b", "4", *args, "-o", str(plan), cwd=ROOT)
        if done.returncode == 0:
            done = planner("run", str(plan), "--steps", "2", "-o", str(work / f"metrics-{name}.json"), cwd=ROOT)
        row[f"{name}_ran"] = done.returncode == 0
        if done.returncode:
            row["note"] = f"{name}: {_last_line(done)}"
            continue
        losses[name] = json.loads((work / f"metrics-{name}.json").read_text())["losses"]
        written = json.loads(plan.read_text())
        lay = written["layout"]
        if name == "free":
            row["free_layout"] = f"pp{lay['pp_degree']} dp{lay['dp_degree']} tp{lay['tp_degree']} zero{lay['zero_stage']}"
        if name == "tp2":
            row["tp2_sharded_modules"] = sum(len(s.get("tp_plan") or {}) for s in written["stages"])
    reference = losses.get("one")
    for name in ("free", "tp2", "pp2"):
        if reference and name in losses:
            row[f"{name}_losses_match"] = all(abs(a - b) <= 1e-4 * abs(b) for a, b in zip(losses[name], reference, strict=True))
    return row


def main(types: list[str]) -> pd.DataFrame:
    return run_each(types, TYPES, try_type, "hf_config_zoo", "model_type")


def run_each(asked: list[str], every: list[str], try_one, stem: str, key: str) -> pd.DataFrame:
    """`try_one(name, work folder)` for each name `asked` (all of `every` if none), each in a
    temporary folder, the rows as benchmarks/results/<stem>.csv; a subset replaces its rows (by
    `key`) and keeps the others."""
    rows = []
    for name in asked or every:
        with tempfile.TemporaryDirectory() as work:
            try:
                row = try_one(name, Path(work))
            except subprocess.TimeoutExpired as exc:  # one slow case must not lose the others' rows
                row = {key: name, "note": f"`planner {exc.cmd[3]}` timed out after {exc.timeout:.0f} s"}
        rows.append(row)
        print(row, flush=True)
    frame = pd.DataFrame(rows)
    path = RESULTS / f"{stem}.csv"
    if asked and path.exists():
        old = pd.read_csv(path)
        frame = pd.concat([old[~old[key].isin(frame[key])], frame], ignore_index=True)
    frame.to_csv(path, index=False)
    return frame


if __name__ == "__main__":
    main(sys.argv[1:])
