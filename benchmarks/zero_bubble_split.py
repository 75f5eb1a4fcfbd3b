"""Zero bubble's weight-gradient share per unit: predicted from the profile's ops, measured.

torch's zero-bubble schedules run a stage's backward as B (input gradients,
`stage_backward_input`) and later W (weight gradients, `stage_backward_weight`). B + W is
also timed against one whole backward (`split_ratio`), per unit and for stages of 1-8 small GPT
blocks: what the split costs, which a measured profile now records per unit
(planner/cost/compute.py `split_backward`). The solver
prices W as the unit's weight GEMMs' share of its backward (planner/cost/compute.py
`weight_gradient_share`; 0.5 everywhere before 2026-11-29). For each unit of a few models fed
a floating-point tensor, this runs the unit alone on its captured inputs on this CPU (one
thread) and times B and W with torch's own functions: the measured share is W / (B + W).

    OMP_NUM_THREADS=1 python benchmarks/zero_bubble_split.py

Writes benchmarks/results/zero_bubble_split.csv.
"""

from __future__ import annotations

import csv
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from planner.cost.compute import ComputeModel  # noqa: E402
from planner.hardware import get_gpu  # noqa: E402
from planner.model_file import load_model_file  # noqa: E402
from planner.profiler import profile_model  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
BATCH = 2
REPEATS = 7
MODELS = {  # name: model file, arguments
    "gpt s128": ("examples/gpt.py", dict(n_layers=2, d_model=256, n_heads=4, d_ff=1024, vocab_size=512, seq_len=128)),
    "gpt s1024": ("examples/gpt.py", dict(n_layers=2, d_model=256, n_heads=4, d_ff=1024, vocab_size=512, seq_len=1024)),
    "hf_llama": ("examples/hf_llama.py", dict(n_layers=2)),
    "resnet": ("examples/resnet.py", {}),
    "moe": ("examples/moe.py", dict(n_layers=2, d_model=128, n_heads=4, vocab_size=512, seq_len=128, num_experts=4, top_k=2,
                                    moe_d_ff=256)),
}


def captured_inputs(model: torch.nn.Module, units: list[str], batch) -> dict[str, tuple[tuple, dict]]:
    """Each unit's positional and keyword inputs in one forward of the whole model."""
    seen: dict[str, tuple[tuple, dict]] = {}
    handles = []
    for name in units:
        module = model.get_submodule(name)

        def keep(_module, args, kwargs, name=name):
            seen.setdefault(name, (tuple(a.detach() if torch.is_tensor(a) else a for a in args),
                                   {k: v.detach() if torch.is_tensor(v) else v for k, v in kwargs.items()}))
        handles.append(module.register_forward_pre_hook(keep, with_kwargs=True))
    with torch.no_grad():
        model(batch)
    for handle in handles:
        handle.remove()
    return seen


def _tensors(output) -> list[torch.Tensor]:
    if torch.is_tensor(output):
        return [output]
    if isinstance(output, (tuple, list)):
        return [t for item in output for t in _tensors(item)]
    if isinstance(output, dict) or hasattr(output, "values"):
        return [t for item in output.values() for t in _tensors(item)]
    return []


def split_seconds(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[float, float, float]:
    """(B, W, one whole backward) seconds of the unit, medians of REPEATS after one warm-up,
    the whole and the split run alternately on fresh forwards."""
    params = [p for p in module.parameters() if p.requires_grad]
    b_times, w_times, whole_times = [], [], []

    def forward():
        inputs = [a.clone().requires_grad_(True) if torch.is_tensor(a) and a.is_floating_point() else a for a in args]
        leaves = [a for a in inputs if torch.is_tensor(a) and a.requires_grad]
        outputs = [t for t in _tensors(module(*inputs, **kwargs)) if t.requires_grad]
        # As the runtime hands a stage's outputs to torch (runtime/pp_split.py `_sendable`): no views.
        outputs = [t.clone() if t._base is not None else t for t in outputs]
        return leaves, outputs, [torch.randn_like(t) for t in outputs]

    for repeat in range(REPEATS + 1):
        _, outputs, grads = forward()
        started = time.perf_counter()
        torch.autograd.backward(outputs, grads)
        whole = time.perf_counter() - started
        for p in params:
            p.grad = None
        leaves, outputs, grads = forward()
        started = time.perf_counter()
        _, groups = stage_backward_input(outputs, grads, leaves, iter(params))
        middle = time.perf_counter()
        stage_backward_weight(iter(params), groups, retain_graph=True)  # as runtime/apply_pp.py calls it
        done = time.perf_counter()
        for p in params:
            p.grad = None
        if repeat:
            b_times.append(middle - started)
            w_times.append(done - middle)
            whole_times.append(whole)
    return statistics.median(b_times), statistics.median(w_times), statistics.median(whole_times)


def stage_rows() -> list[dict]:
    """A stage of k small GPT blocks (width 64, 32 tokens, micro-batch 4), split against whole:
    how the split's cost grows with the stage against the sum of its units' (the profile's)."""
    rows = []
    for k in (1, 2, 4, 8):
        args = dict(n_layers=k, d_model=64, n_heads=4, d_ff=256, vocab_size=256, seq_len=32)
        torch.manual_seed(0)
        model = load_model_file(ROOT / "examples" / "gpt.py", args).build_model()
        stage = torch.nn.Sequential(*model.blocks)
        b_s, w_s, whole_s = split_seconds(stage, (torch.randn(4, 32, 64),), {})
        rows.append(dict(model="gpt d64 s32 stage", unit=f"{k} blocks", b_ms=1e3 * b_s, w_ms=1e3 * w_s,
                         whole_ms=1e3 * whole_s, split_ratio=(b_s + w_s) / whole_s))
        print(f"stage of {k} blocks: B {1e3 * b_s:.3f} W {1e3 * w_s:.3f} whole {1e3 * whole_s:.3f} ms, "
              f"B + W = {(b_s + w_s) / whole_s:.2f} x whole", flush=True)
    return rows


def main() -> list[dict]:
    torch.set_num_threads(1)
    cpu = get_gpu("cpu")
    rows = []
    for label, (path, args) in MODELS.items():
        profile = profile_model(path, args, [BATCH], device="cpu", repeats=3)
        prices = ComputeModel(profile, cpu, profile.dtype)
        model_file = load_model_file(ROOT / path, args)
        torch.manual_seed(0)
        model = model_file.build_model()
        inputs, _ = model_file.make_batch(BATCH)
        names = [u.name for u in profile.units]
        captured = captured_inputs(model, names, inputs)
        for unit in profile.units:
            if unit.float_fed is False or unit.name not in captured or not unit.num_parameters:
                continue  # a unit fed token ids runs its whole backward at B: no split to measure
            b_s, w_s, whole_s = split_seconds(model.get_submodule(unit.name), *captured[unit.name])
            measured = w_s / (b_s + w_s) if b_s + w_s > 0 else 0.0
            predicted = prices.weight_gradient_share(unit)
            rows.append(dict(model=label, unit=unit.name, b_ms=1e3 * b_s, w_ms=1e3 * w_s, measured_share=measured,
                             predicted_share=predicted, old_share=0.5, error=predicted - measured,
                             whole_ms=1e3 * whole_s, split_ratio=(b_s + w_s) / whole_s if whole_s > 0 else float("nan")))
            print(f"{label:>10} {unit.name:>16}  B {1e3 * b_s:7.3f} ms  W {1e3 * w_s:7.3f} ms  whole {1e3 * whole_s:7.3f} ms  "
                  f"W share measured {measured:.3f} predicted {predicted:.3f}", flush=True)
    stages = stage_rows()
    RESULTS.mkdir(parents=True, exist_ok=True)
    with open(RESULTS / "zero_bubble_split.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows + stages)
    for label in MODELS:  # the model's measured units as one stage: shares weighted by their backward
        part = [r for r in rows if r["model"] == label]
        total = sum(r["b_ms"] + r["w_ms"] for r in part)
        measured = sum(r["w_ms"] for r in part) / total
        predicted = sum(r["predicted_share"] * (r["b_ms"] + r["w_ms"]) for r in part) / total
        print(f"{label:>10} as one stage: W share measured {measured:.3f}, predicted {predicted:.3f}")
    errors = [abs(r["error"]) for r in rows]
    old = [abs(0.5 - r["measured_share"]) for r in rows]
    print(f"{len(rows)} units: |predicted - measured| median {statistics.median(errors):.3f}, max {max(errors):.3f} "
          f"(a half everywhere: median {statistics.median(old):.3f}, max {max(old):.3f})")
    for label in MODELS:  # what the split costs: B + W over one whole backward, the model's units as one stage
        part = [r for r in rows if r["model"] == label]
        print(f"{label:>10}: B + W = {sum(r['b_ms'] + r['w_ms'] for r in part) / sum(r['whole_ms'] for r in part):.2f} "
              f"x the whole backward (units {min(r['split_ratio'] for r in part):.2f}-{max(r['split_ratio'] for r in part):.2f})")
    return rows


if __name__ == "__main__":
    main()
