"""What profiling costs: wall time and peak RSS per profile, each in a fresh process.

Measured CPU profiles of the bundled examples, and analytic (meta device) profiles of
GPT-3 175B, a Llama-3-405B-shaped model, and unmodified Hugging Face Llama-3 70B and Qwen3-30B-A3B
built from their configs, whose goal is under 30 s and 4 GiB each on the project's 2-core machine. Writes benchmarks/results/profile_cost.csv.

    python benchmarks/profile_cost.py
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"

GPT3_175B = dict(n_layers=96, d_model=12288, n_heads=96, d_ff=49152, vocab_size=51200, seq_len=2048)
# Llama 3.1 405B (Meta, 2024): 126 layers, d 16384, 128 heads, 8 KV heads, FFN 53248, vocab 128256.
LLAMA3_405B = dict(n_layers=126, d_model=16384, n_heads=128, n_kv_heads=8, d_ff=53248, vocab_size=128256, seq_len=8192)

CASES = [
    ("gpt (default args)", "examples/gpt.py", {}, "cpu", None, "float32", [1, 2, 4]),
    ("llama (default args)", "examples/llama.py", {}, "cpu", None, "float32", [1, 2, 4]),
    ("cnn (default args)", "examples/cnn.py", {}, "cpu", None, "float32", [1, 2, 4]),
    ("unet (default args)", "examples/unet.py", {}, "cpu", None, "float32", [1, 2, 4]),
    ("GPT-3 175B analytic", "examples/gpt.py", GPT3_175B, "meta", "a100-80gb", "bfloat16", [1, 2, 4]),
    ("Llama-3 405B analytic", "examples/llama.py", LLAMA3_405B, "meta", "h100-80gb", "bfloat16", [1, 2]),
    # Unmodified Hugging Face models from their config alone (planner profile --hf-config).
    ("HF Llama-3 70B config", "planner/hf_config_model.py", dict(config="examples/hf/llama3-70b.json", seq_len=4096),
     "meta", "h100-80gb", "bfloat16", [1, 2]),
    ("HF Qwen3-30B-A3B config", "planner/hf_config_model.py", dict(config="examples/hf/qwen3-30b-a3b.json", seq_len=4096),
     "meta", "h100-80gb", "bfloat16", [1]),
]

CHILD = """
import json, resource, sys, time
start = time.perf_counter()
from planner.profiler import profile_model
case = json.loads(sys.argv[1])
p = profile_model(case["file"], case["args"], case["sizes"], device=case["device"], gpu=case["gpu"], dtype=case["dtype"])
print(json.dumps(dict(
    wall_s=time.perf_counter() - start,
    peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    units=len(p.units),
    parameters=p.model.num_parameters,
)))
"""


def main() -> None:
    rows = []
    for name, file, args, device, gpu, dtype, sizes in CASES:
        case = dict(file=str(ROOT / file), args=args, device=device, gpu=gpu, dtype=dtype, sizes=sizes)
        done = subprocess.run([sys.executable, "-c", CHILD, json.dumps(case)], capture_output=True, text=True, timeout=600, cwd=ROOT)
        if done.returncode != 0:
            raise SystemExit(f"{name} failed:\n{done.stderr}")
        result = json.loads(done.stdout.strip().splitlines()[-1])
        rows.append(dict(case=name, device=device, gpu=gpu or "", dtype=dtype, micro_batch_sizes=",".join(map(str, sizes)), **result))
        print(f"{name:24s} {result['wall_s']:7.2f} s  {result['peak_rss_bytes'] / 2**30:5.2f} GiB  "
              f"{result['parameters'] / 1e9:8.3f} B params  {result['units']} units")
    RESULTS.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(rows).to_csv(RESULTS / "profile_cost.csv", index=False)
    print(f"wrote {RESULTS / 'profile_cost.csv'}")


if __name__ == "__main__":
    main()
