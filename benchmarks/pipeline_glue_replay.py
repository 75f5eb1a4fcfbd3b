"""What a later pipeline stage's forward costs with and without reusing its earlier glue's replay.

A stage after the first runs the model's forward from the top, earlier stages' units stubbed
and their glue replayed on the meta device with the values it can know (runtime/pp_flow.py);
since 2026-11-28 it reuses that replay's results from its first forward while the glue reads
the same things (`GlueReplay`). For a few models this times the last stage's forward on one
micro-batch, in one process, reused and replayed every time (the record switched off), and
the first stage's forward beside them; the same inputs each call, so both give the same output
(checked).

    OMP_NUM_THREADS=1 python benchmarks/pipeline_glue_replay.py

Writes benchmarks/results/pipeline_glue_replay.csv.
"""

from __future__ import annotations

import csv
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from planner.cluster import make_cluster  # noqa: E402
from planner.model_file import load_model_file  # noqa: E402
from planner.profiler import profile_model  # noqa: E402
from planner.solver.solve import Pins, solve  # noqa: E402
from runtime.apply_pp import build_stage_modules  # noqa: E402
from runtime.pp_split import schedule_inputs, stage_spec  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
MODELS = {  # model file (or a model of benchmarks/hf_architectures.py), its arguments
    "gpt (examples/gpt.py)": ("examples/gpt.py", {}),
    "hf_llama (4 layers)": ("examples/hf_llama.py", {"n_layers": 4}),
    "hf_bert": ("examples/hf_bert.py", {}),
    "t5": ("t5", {}),
    "whisper": ("whisper", {}),
    "gpt_neox": ("gpt_neox", {}),
}
CALLS = 30


def _time_ms(fn, calls: int = CALLS) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(calls):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return sorted(times)[len(times) // 2] * 1e3


def measure(name: str, path: str, args: dict) -> dict:
    torch.manual_seed(0)
    prof = profile_model(path, args, [2], device="cpu", repeats=1, warmup=1)
    plan = solve(prof, make_cluster(2, gpu="cpu"), 4, Pins(pp=2, dp=1, tp=1, schedule="1f1b", micro_batch_size=2))
    mf = load_model_file(path, args)
    model = mf.build_model()
    inputs, _ = mf.make_batch(2)
    inputs = inputs if isinstance(inputs, tuple) else (inputs,)
    (_, first), = build_stage_modules(model, plan, 0, inputs)
    (_, last), = build_stage_modules(model, plan, 1, inputs)
    # With autograd on, as a training step runs them; what the stage received requires grad.
    tensors = schedule_inputs(inputs)  # what torch's schedule hands the first stage
    sent = first(*tensors)
    sent = tuple(t.detach().requires_grad_(t.is_floating_point()) for t in (sent if isinstance(sent, tuple) else (sent,)))
    spec = stage_spec(last)
    reused_out = last(*sent)
    reused_ms = _time_ms(lambda: last(*sent))
    reused_ops = len(spec.glue.ops) if spec.glue.usable else 0
    spec.glue.usable = False  # every forward replays, as before 2026-11-28
    replayed_out = last(*sent)
    replayed_ms = _time_ms(lambda: last(*sent))
    first_ms = _time_ms(lambda: first(*tensors))
    same = all(torch.equal(a, b) for a, b in zip(torch.utils._pytree.tree_leaves(reused_out),
                                                   torch.utils._pytree.tree_leaves(replayed_out), strict=True))
    row = dict(model=name, stage_units=" | ".join(",".join(s.units) for s in plan.stages), earlier_glue_ops=reused_ops,
               first_stage_forward_ms=round(first_ms, 3), last_stage_forward_replayed_ms=round(replayed_ms, 3),
               last_stage_forward_reused_ms=round(reused_ms, 3), speedup=round(replayed_ms / reused_ms, 2), same_output=same)
    print(row, flush=True)
    return row


def main() -> None:
    import tempfile

    from hf_architectures import model_file

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        rows = [measure(name, path if path.endswith(".py") else str(model_file(path, Path(tmp))), args)
                for name, (path, args) in MODELS.items()]
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / "pipeline_glue_replay.csv"
    with out.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
