"""GPU specifications: the numbers every time estimate starts from.

Peak numbers are the vendors' dense (no 2:4 sparsity) figures from their data sheets:
NVIDIA A100 Tensor Core GPU data sheet (2021), H100 Tensor Core GPU data sheet (2023) and
H200 product brief (2024). Link bandwidths are per GPU and per direction (NVLink 3 moves
600 GB/s per GPU counting both directions, so 300 GB/s each way; NVLink 4 900 -> 450).

Achievable rates are peaks times an efficiency, and the efficiencies are the only fitted
constants in the analytic model:

- `matmul_efficiency` 0.72: what the matrix products of a transformer block sustain in
  training. An isolated square GEMM does better (an 8192^3 bf16 product ran at 798 of 989
  TFLOP/s on this workplace's H100, 0.81; A100 GEMM benchmarks reach ~250 of 312, 0.80),
  but a block's GEMMs are narrower (tile and wave quantization), and at 0.80 two
  independent checks came out ~10% fast: H100 blocks at GPT-3 2.7B and 6.7B shapes
  measured 1.09-1.15x the roofline (benchmarks/results/h100/README.md), and Megatron-LM's
  published SC21 iteration times were 4-16% slower than predicted on every row above 5B
  parameters (benchmarks/cost_model_vs_reference.py). 0.80 x 0.9 = 0.72 is the one constant
  fitted to them, the same for every GPU and model; with it the Megatron rows land within
  10% (median 4%).
- `memory_efficiency` 0.85: streaming kernels reach ~85-90% of HBM bandwidth (a device to
  device copy on the H100 here moved 3.0 of 3.35 TB/s, 0.90; STREAM-like results on A100
  ~1.7 of 2.0 TB/s, 0.85).
- `kernel_overhead_s` 5 us: launch and tail cost of one small kernel, so that a model made
  of tiny ops is not predicted to run in zero time.

The `cpu` entry stands for one gloo process on a workstation core; its numbers are rough
defaults only used when nothing was measured (a measured CPU profile is always preferred).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from planner.errors import PlannerError

TFLOPS = 1e12
GB = 1e9
GIB = 1024**3


@dataclass(frozen=True)
class GPUSpec:
    """One accelerator model's peak rates and memory."""

    name: str
    """Preset name used on the CLI (`--gpu`)."""
    peak_flops: dict[str, float] = field(default_factory=dict)
    """Dense peak FLOP/s per dtype name (`float32`, `bfloat16`, `float16`)."""
    memory_bytes: int = 0
    """Device memory in bytes."""
    memory_bandwidth_bytes_per_s: float = 0.0
    """HBM bandwidth, bytes/s."""
    intra_node_bandwidth_bytes_per_s: float = 0.0
    """NVLink/NVSwitch bandwidth per GPU per direction, bytes/s."""
    inter_node_bandwidth_bytes_per_s: float = 0.0
    """Network bandwidth per GPU per direction across nodes, bytes/s (one NIC per GPU)."""
    matmul_efficiency: float = 0.72
    """Fraction of peak FLOP/s large matrix products reach."""
    memory_efficiency: float = 0.85
    """Fraction of peak memory bandwidth streaming kernels reach."""
    kernel_overhead_s: float = 5e-6
    """Fixed cost per kernel (launch, tail), seconds."""

    def achievable_flops(self, dtype: str) -> float:
        if dtype not in self.peak_flops:
            raise PlannerError(
                f"GPU {self.name} has no peak FLOP/s for dtype {dtype}.",
                f"Use one of {sorted(self.peak_flops)}.",
            )
        return self.peak_flops[dtype] * self.matmul_efficiency

    @property
    def achievable_bandwidth(self) -> float:
        return self.memory_bandwidth_bytes_per_s * self.memory_efficiency


# 8 x 200 Gb/s HDR InfiniBand per DGX A100 node: one 25 GB/s NIC per GPU.
# DGX H100/H200: 8 x 400 Gb/s NDR, 50 GB/s per GPU.
GPUS: dict[str, GPUSpec] = {
    spec.name: spec
    for spec in (
        GPUSpec(
            name="a100-40gb",
            peak_flops={"float32": 19.5 * TFLOPS, "bfloat16": 312 * TFLOPS, "float16": 312 * TFLOPS},
            memory_bytes=40 * GIB,
            memory_bandwidth_bytes_per_s=1555 * GB,
            intra_node_bandwidth_bytes_per_s=300 * GB,
            inter_node_bandwidth_bytes_per_s=25 * GB,
        ),
        GPUSpec(
            name="a100-80gb",
            peak_flops={"float32": 19.5 * TFLOPS, "bfloat16": 312 * TFLOPS, "float16": 312 * TFLOPS},
            memory_bytes=80 * GIB,
            memory_bandwidth_bytes_per_s=2039 * GB,
            intra_node_bandwidth_bytes_per_s=300 * GB,
            inter_node_bandwidth_bytes_per_s=25 * GB,
        ),
        GPUSpec(
            name="h100-80gb",
            peak_flops={"float32": 66.9 * TFLOPS, "bfloat16": 989.4 * TFLOPS, "float16": 989.4 * TFLOPS},
            memory_bytes=80 * GIB,
            memory_bandwidth_bytes_per_s=3350 * GB,
            intra_node_bandwidth_bytes_per_s=450 * GB,
            inter_node_bandwidth_bytes_per_s=50 * GB,
        ),
        GPUSpec(
            name="h200",
            peak_flops={"float32": 66.9 * TFLOPS, "bfloat16": 989.4 * TFLOPS, "float16": 989.4 * TFLOPS},
            memory_bytes=141 * GB,
            memory_bandwidth_bytes_per_s=4800 * GB,
            intra_node_bandwidth_bytes_per_s=450 * GB,
            inter_node_bandwidth_bytes_per_s=50 * GB,
        ),
        GPUSpec(
            name="cpu",
            peak_flops={"float32": 50e9, "bfloat16": 25e9, "float16": 10e9},
            memory_bytes=8 * GIB,
            memory_bandwidth_bytes_per_s=10 * GB,
            intra_node_bandwidth_bytes_per_s=2 * GB,
            inter_node_bandwidth_bytes_per_s=1 * GB,
            matmul_efficiency=1.0,
            memory_efficiency=1.0,
            kernel_overhead_s=5e-6,
        ),
    )
}

ALIASES = {"a100": "a100-80gb", "h100": "h100-80gb", "h100-sxm": "h100-80gb", "h200-141gb": "h200"}


def get_gpu(name: str) -> GPUSpec:
    """Look a preset up by name (case-insensitive, a few aliases accepted)."""
    key = ALIASES.get(name.lower(), name.lower())
    if key not in GPUS:
        raise PlannerError(
            f"Unknown GPU {name!r}.",
            f"Known GPUs: {', '.join(sorted(GPUS))}.",
        )
    return GPUS[key]
