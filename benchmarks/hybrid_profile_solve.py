"""What an analytic profile and a first solve cost for today's hybrid and recurrent models at
their published sizes, built from transformers' default configs (no download, no weights).

Each model type is profiled as a user would (`planner profile --hf-config config.json --device
meta --gpu h100-80gb --dtype bfloat16 --seq-len S`, S = min(4096, the config's context)), in a
fresh process, then solved for 64 H100s at a global batch of 512 sequences twice: first with the
intra-op ILP cache off (`PLANNER_CACHE_DIR=`, a first solve on a new machine), then with a warm
cache folder. Records wall time and peak RSS of the profile, both solve times, and the plan.

These are the models whose scans are written as Python loops over the sequence (Jamba's Mamba,
RecurrentGemma's RG-LRU, Qwen3-Next's chunked gated delta rule): hundreds of thousands of ops
on the meta device, and op graphs whose merge nodes combine thousands of products. What it took
before the changes of 2026-11-30 (same machine, same commands): RecurrentGemma's profile more
than 400 s (stopped), Jamba's 279 s; the cold solve of Qwen3-Next 27 s (53 s in another
session's measurement), Jamba's 41 s. The CSV's second run that day: Qwen3-Next's cold solve 2.8 s
(its linear attention decided by presolve at tp 2, 4 and 8: planner/solver/intra_op.py
`_presolved`), Jamba's 7.4 s, the same plans. Its third (2026-11-30, later): the analytic profiles
of Jamba 196 -> 62 s, RecurrentGemma 103 -> 34 s, Qwen3-Next 17 -> 12 s (meta arithmetic without
torch's Python references, planner/meta_values.py `fast_binary`; twin layers replayed in the
unit trace, planner/units.py `_Replays`), the same plans; the MoE models' predictions moved by
under 0.1% (units counted under balanced routing, planner/profiler/moe.py `balanced_experts`).

    python benchmarks/hybrid_profile_solve.py [model_type ...]

Writes benchmarks/results/hybrid_profile_solve.csv. Timings drift with the machine's load.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
TYPES = ["qwen3_next", "jamba", "recurrent_gemma", "falcon_h1", "nemotron_h"]
GPUS, GLOBAL_BATCH, GPU = 64, 512, "h100-80gb"
TIMEOUT_S = 900


PEAK = ("import resource, subprocess, sys; code = subprocess.run(sys.argv[1:]).returncode; "
        "print('peak_rss_kib', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr); sys.exit(code)")
"""A wrapper process that runs one command and reports that command's peak RSS."""


def _run(args: list[str], env: dict | None = None) -> tuple[subprocess.CompletedProcess, float, int]:
    """`planner ARGS` in a fresh process: its result, wall seconds, and peak RSS in bytes."""
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", PEAK, sys.executable, "-m", "planner.cli", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=TIMEOUT_S, env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
    wall = time.perf_counter() - start
    peak = [int(line.split()[1]) for line in done.stderr.splitlines() if line.startswith("peak_rss_kib ")]
    return done, wall, peak[-1] * 1024 if peak else 0


def _last_line(done: subprocess.CompletedProcess) -> str:
    lines = [line for line in (done.stderr + done.stdout).splitlines() if line.strip() and not line.startswith("peak_rss_kib ")]
    return lines[-1][:200] if lines else f"exit {done.returncode}"


def try_type(model_type: str, work: Path) -> dict:
    from transformers import AutoConfig

    config = AutoConfig.for_model(model_type).to_dict()
    context = min((config[k] for k in ("max_position_embeddings", "n_positions", "max_seq_len") if config.get(k)), default=4096)
    seq = min(4096, context)
    (work / "config.json").write_text(json.dumps(config))
    row: dict = {"model_type": model_type, "seq_len": seq}
    done, wall, rss = _run(["profile", "--hf-config", str(work / "config.json"), "--device", "meta", "--gpu", GPU,
                            "--dtype", "bfloat16", "--seq-len", str(seq), "-o", str(work / "profile.json")])
    row.update(profile_s=round(wall, 1), profile_peak_rss_gib=round(rss / 2**30, 2))
    if done.returncode:
        return {**row, "note": _last_line(done)}
    profile = json.loads((work / "profile.json").read_text())
    row.update(parameters_b=round(profile["model"]["num_parameters"] / 1e9, 2),
               mixing_units=sum(bool(u.get("mixes_tokens")) for u in profile["units"]),
               slow_backward_noted=any("backward takes more than" in note for note in profile["notes"]))
    solve = ["solve", "-p", str(work / "profile.json"), "--gpus", str(GPUS), "--gpu", GPU, "-b", str(GLOBAL_BATCH),
             "-o", str(work / "plan.json")]
    cache = work / "cache"
    for name, env in (("solve_cold_s", {"PLANNER_CACHE_DIR": ""}), ("solve_cold_fill_s", {"PLANNER_CACHE_DIR": str(cache)}),
                      ("solve_cached_s", {"PLANNER_CACHE_DIR": str(cache)})):
        done, wall, _ = _run(solve, env)
        row[name] = round(wall, 2)
        if done.returncode:
            return {**row, "note": _last_line(done)}
    plan = json.loads((work / "plan.json").read_text())
    lay = plan["layout"]
    row["layout"] = (f"pp{lay['pp_degree']} dp{lay['dp_degree']} tp{lay['tp_degree']} ep{lay['ep_degree']} "
                     f"zero{lay['zero_stage']}{' sp' if lay['sequence_parallel'] else ''}")
    row["predicted_iteration_s"] = round(plan["prediction"]["iteration_time_s"], 3)
    return row


def main(types: list[str]) -> pd.DataFrame:
    rows = []
    for model_type in types or TYPES:
        with tempfile.TemporaryDirectory() as tmp:
            row = try_type(model_type, Path(tmp))
        print(row, flush=True)
        rows.append(row)
    frame = pd.DataFrame(rows)
    out = RESULTS / "hybrid_profile_solve.csv"
    if types and out.exists():  # a subset replaces its own rows
        frame = pd.concat([pd.read_csv(out).query("model_type not in @types"), frame], ignore_index=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    frame.to_csv(out, index=False)
    print(f"wrote {out}")
    return frame


if __name__ == "__main__":
    main(sys.argv[1:])
