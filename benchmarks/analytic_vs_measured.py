"""How far the analytic (roofline) profile is from a measured one, unit by unit.

Profiles a model twice on the device at hand: measured (real kernels, CUDA events on GPU)
and analytic (meta tensors + the GPU spec's roofline), then writes both profiles and a CSV
of per-unit forward/backward times side by side. On a GPU this is the check that the
analytic constants in planner/hardware.py hold.

    python benchmarks/analytic_vs_measured.py --device cuda --gpu h100-80gb --preset gpt2-medium
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pandas as pd

from planner.profiler import profile_model

ROOT = Path(__file__).resolve().parents[1]
PRESETS = {
    # GPT-2 medium (Radford et al. 2019): 24 layers, d 1024, 16 heads, context 1024.
    "gpt2-medium": ("examples/gpt.py", dict(n_layers=24, d_model=1024, n_heads=16, d_ff=4096, vocab_size=50257, seq_len=1024)),
    # GPT-3 2.7B's layer shape (Brown et al. 2020), 4 layers: GEMMs large enough for the roofline.
    "gpt-2.7b-4l": ("examples/gpt.py", dict(n_layers=4, d_model=2560, n_heads=32, d_ff=10240, vocab_size=50257, seq_len=2048)),
    # GPT-3 6.7B's layer shape, 2 layers, with materialised attention and dropout as Megatron-LM ran in 2021.
    "gpt-6.7b-2l-math": ("examples/gpt.py", dict(n_layers=2, d_model=4096, n_heads=32, d_ff=16384, vocab_size=50257,
                                                  seq_len=2048, attention="math", dropout=0.1)),
    "gpt-small-cpu": ("examples/gpt.py", dict(n_layers=4, d_model=256, n_heads=4, d_ff=1024, vocab_size=1024, seq_len=128)),
}


def compare(measured, analytic) -> pd.DataFrame:
    rows = []
    for m, a in zip(measured.units, analytic.units):
        for b in measured.micro_batch_sizes:
            cm, ca = m.costs[b], a.costs[b]
            rows.append(dict(
                unit=m.name, micro_batch_size=b,
                measured_forward_s=cm.forward_time_s, analytic_forward_s=ca.forward_time_s,
                measured_backward_s=cm.backward_time_s, analytic_backward_s=ca.backward_time_s,
                forward_flops=cm.forward_flops,
                measured_forward_tflops=cm.forward_flops / cm.forward_time_s / 1e12 if cm.forward_time_s else 0.0,
                peak_memory_bytes=cm.peak_memory_bytes,
            ))
    return pd.DataFrame(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--gpu", default="h100-80gb")
    parser.add_argument("--preset", default="gpt2-medium", choices=sorted(PRESETS))
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--micro-batch-sizes", default="1,2,4,8")
    parser.add_argument("--out-dir", default=str(ROOT / "benchmarks" / "results"))
    parser.add_argument("--profile-dir", default=str(ROOT / "profiles"))
    args = parser.parse_args()
    file, model_args = PRESETS[args.preset]
    sizes = [int(x) for x in args.micro_batch_sizes.split(",")]
    measured = profile_model(str(ROOT / file), model_args, sizes, device=args.device, dtype=args.dtype, repeats=10, warmup=3)
    analytic = profile_model(str(ROOT / file), model_args, sizes, device="meta", gpu=args.gpu, dtype=args.dtype)
    tag = f"{args.preset}-{args.device}-{args.gpu if args.device != 'cpu' else 'cpu'}-{args.dtype}"
    profile_dir, out_dir = Path(args.profile_dir), Path(args.out_dir)
    measured.save(profile_dir / f"{tag}-measured.json")
    analytic.save(profile_dir / f"{tag}-analytic.json")
    frame = compare(measured, analytic)
    frame.insert(0, "device_name", measured.device_name)
    out_dir.mkdir(parents=True, exist_ok=True)
    frame.to_csv(out_dir / f"analytic_vs_measured_{tag}.csv", index=False)
    totals = frame.groupby("micro_batch_size")[["measured_forward_s", "analytic_forward_s", "measured_backward_s", "analytic_backward_s"]].sum()
    totals["forward_ratio"] = totals.analytic_forward_s / totals.measured_forward_s
    totals["backward_ratio"] = totals.analytic_backward_s / totals.measured_backward_s
    print(f"device: {measured.device_name}; model {args.preset}; {args.dtype}")
    print(totals.to_string())
    for b, whole in measured.whole_model.items():
        print(f"micro-batch {b}: whole model fwd+bwd {whole.forward_backward_time_s * 1e3:.2f} ms, sum of units "
              f"{whole.sum_of_units_time_s * 1e3:.2f} ms, ratio {whole.ratio:.3f}")


if __name__ == "__main__":
    main()
