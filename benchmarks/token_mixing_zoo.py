"""Which units mix tokens outside attention, found by the analytic (meta) probe against the
measured one, on every Hugging Face model type of benchmarks/hf_config_zoo.py at its shrunk config.

planner/profiler/token_mixing.py finds units that move information between tokens other than
through attention by running them on a perturbed first token: a measured profile with the
unit's own inputs and weights, an analytic one at full width on a few tokens with weights of
its own. Sequence parallelism keeps such units whole and context parallelism is refused, so the
two must agree. Each type is profiled both ways at sequence 32, micro-batch 1, one thread.

    python benchmarks/token_mixing_zoo.py [model_type ...]

Writes benchmarks/results/token_mixing_zoo.csv: per type, the units each probe marks (mixing,
not mixing, unknown), whether they agree, and each profile's seconds.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import pandas as pd
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from hf_config_zoo import TYPES, small_config  # noqa: E402

import planner.hf_config_model as hf  # noqa: E402
from planner.profiler import profile_model  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"


def probe(model_type: str, work: Path) -> dict:
    config = small_config(model_type, work / f"{model_type}.json")
    row: dict = {"model_type": model_type}
    found = {}
    for device, how in (("meta", dict(device="meta", gpu="cpu")), ("cpu", dict(device="cpu", repeats=1, warmup=0))):
        started = time.perf_counter()
        try:
            profile = profile_model(hf.__file__, {"config": str(config), "seq_len": 32}, [1], **how)
            found[device] = {u.name: u.mixes_tokens for u in profile.units}
            row[f"{device}_mixing"] = " ".join(n for n, m in found[device].items() if m)
            row[f"{device}_unknown"] = " ".join(n for n, m in found[device].items() if m is None)
        except Exception as error:  # noqa: BLE001 - a row says what failed
            row[f"{device}_error"] = f"{type(error).__name__}: {str(error)[:160]}"
        row[f"{device}_s"] = round(time.perf_counter() - started, 2)
    row["agree"] = len(found) == 2 and found["meta"] == found["cpu"]
    return row


def main(types: list[str]) -> pd.DataFrame:
    torch.set_num_threads(1)
    rows = []
    with tempfile.TemporaryDirectory() as work:
        for model_type in types:
            rows.append(probe(model_type, Path(work)))
            r = rows[-1]
            print(f"{model_type:>20} agree {r['agree']!s:5} mixing (meta) {r.get('meta_mixing', r.get('meta_error'))!s:.60} "
                  f"(cpu) {r.get('cpu_mixing', r.get('cpu_error'))!s:.60}", flush=True)
    frame = pd.DataFrame(rows)
    RESULTS.mkdir(parents=True, exist_ok=True)
    frame.to_csv(RESULTS / "token_mixing_zoo.csv", index=False)
    print(f"{int(frame['agree'].sum())} of {len(frame)} types: the analytic probe answers as the measured one for every unit")
    return frame


if __name__ == "__main__":
    main(sys.argv[1:] or TYPES)
