"""GPU specifications: the numbers every time estimate starts from.

Peak numbers are the vendors' dense (no 2:4 sparsity) figures from their data sheets:
NVIDIA A100 Tensor Core GPU data sheet (2021), H100 Tensor Core GPU data sheet (2023) and
H200 product brief (2024); for B200 and B300 (DGX B200 / B300 data sheets: 2250 TFLOP/s dense
bf16, 4500 FP8, 1125 TF32, 80 float32; 180 and 288 GB of HBM3e at 8 TB/s) as tabulated in
stas00/ml-engineering compute/accelerator/README.md (2026-08). Link bandwidths are per GPU and per direction (NVLink 3 moves
600 GB/s per GPU counting both directions, so 300 GB/s each way; NVLink 4 900 -> 450).

Achievable rates are peaks times an efficiency. The matmul efficiency is per GPU
generation, the product of two factors:

- `SUSTAINED_MATMUL_FRACTION[gpu]`: the best bf16 GEMM a GPU sustains in training, as a
  fraction of its dense peak, from public measurements (stas00/ml-engineering,
  compute/accelerator: "Maximum Achievable Matmul FLOPS" (MAMF, best shape, boost clock)
  and, since 2025, "Maximum Sustainable Matmul FLOPS" (MSMF, the same at the power-saturated
  clock that a training run holds; with all 8 GPUs of a node busy)):
    A100 SXM: MAMF 267.9 of 312 TFLOP/s, 0.859. A100 (400 W) GEMMs are not reported to
      throttle, so MAMF stands for the sustained rate.
    H200 SXM: MSMF 698.6 of 989 with all 8 GPUs busy (MAMF 823.9), 0.706.
    H100 SXM: MAMF 792.1 of 989, times Hopper's sustained / burst ratio at 700 W measured on
      the H200 (698.6 / 823.9 = 0.848; same GH100 die, same power limit): 0.679.
  A short single-GPU profile sees the burst rate: this workplace's H100 ran GPT-3 2.7B
  blocks at 0.73 of peak (benchmarks/results/h100/README.md), the MAMF regime.
- `BLOCK_GEMM_FACTOR` 0.838: what a transformer block's products (narrower than the best
  shape: tile and wave quantization, epilogues) keep of that best GEMM. The one fitted
  constant, the same for every GPU: fitted once to Megatron-LM's SC21 Table 1 on A100
  (0.838 x 0.859 = 0.72, the earlier global efficiency; median error 4%). The Megatron-Core
  H100 and FSDP A100-40GB runs of shared/reference/modern_stacks.csv are checks, not fits
  (benchmarks/cost_model_vs_reference.py).

- Attention (`attention_efficiency`, `attention_backward_ratio`, `attention_causal_ratio`;
  `KERNEL_BENCHMARKS`): fused attention kernels are not GEMMs. Profiles record which attention FLOPs
  run under a causal mask (`UnitCosts.*_causal_attention_flops`) and a GPU prices them by pass and
  mask (`GPUSpec.attention_time_s`). On an A100 FlashAttention-2 reaches 50-73% of the peak (Dao
  2023, arXiv 2307.08691), about what a block's GEMMs keep, so attention runs at the GEMM rate there,
  every score counted. On Hopper the H100 and H200 presets price FlashAttention-2, the kernel torch's
  SDPA runs, at its own benchmarked rates (Shah et al. 2024, FlashAttention-3, arXiv 2407.08608,
  Figures 5 and 6: 370 TFLOP/s forward, 318 backward, a causal kernel half the work at 0.90 of the
  rate), times the sustained / burst ratio above. Our own H200 runs measured it (2026-11-26, one GPU,
  burst clocks; benchmarks/results/h200/): analytic over measured time of GPT blocks at 2048 tokens
  (GPT-3 2.7B's shape, micro-batches 2-4: 1.09-1.22; GPT 1.3B, micro-batches 4-8: 1.13-1.22), where
  the sustained / burst ratio alone gives 1.18; priced at 35% of the peak on every score (the presets
  until 2026-11-30) 1.20-1.36. torchtitan's published H100 runs agree (benchmarks/torchtitan_h100.py:
  median |error| 8.1%, 10 of 18 within 10%, 7.2% with NCCL's collectives as its tuner prices them;
  20.9% and 3 of 18 the old way), and llm-foundry's H100
  runs then show the biases its A100 runs show (without checkpointing -16% against -13% on A100, with
  it -6% against -1%; the old way -4% and +15%: benchmarks/llm_foundry_tables.py).
  Megatron-Core's published H100 runs of shared/reference/ (Transformer Engine, 4096 tokens) do not:
  at the kernel's rates their median |error| goes from 3.8% to 5.0% (1.7B from +3.9% to -10.7%) and
  the Qwen3-235B MoE run from -5.4% to -13.8%; cuDNN's rates, the kernel Transformer Engine prefers
  on Hopper, take them further. So that stack is priced as its runs show
  (`END_TO_END_ATTENTION_FRACTION`: 35% on every score, both passes; planner/engines/megatron.py
  `stack_gpu`, which `planner price` and the Megatron benchmarks apply); NVIDIA's newer
  Megatron-Bridge FP8 runs are nonetheless far faster than either (benchmarks/megatron_bridge.py). A
  cluster file states another stack's kernel (`kernel_attention`; README, "Solve for a cluster").

- `memory_efficiency` 0.85: streaming kernels reach ~85-90% of HBM bandwidth (a device to
  device copy on the H100 here moved 3.0 of 3.35 TB/s, 0.90; STREAM-like results on A100
  ~1.7 of 2.0 TB/s, 0.85).
- `kernel_overhead_s` 5 us: launch and tail cost of one small kernel, so that a model made
  of tiny ops is not predicted to run in zero time.

FP8 (`FP8_DTYPE`, "float8"): H100 SXM and H200 have 1979 TFLOP/s dense FP8 (E4M3/E5M2
inputs, higher-precision accumulate; the same data sheets, "FP8 Tensor Core 3,958 TFLOP/s" with
2:4 sparsity, halved), twice their bf16 peak; B200 and B300 4500, also twice theirs; A100 has no
FP8 tensor cores (compute capability 8.0 < 8.9) and no `float8` entry, so asking it for FP8
raises a PlannerError.
`GPUSpec.fp8_matmul_efficiency` = `matmul_efficiency` x `fp8_relative_efficiency`: the fraction
of its peak an FP8 GEMM keeps over the fraction a bf16 GEMM of the same shape keeps, per GPU
generation from the same measurements as the bf16 figure (stas00/ml-engineering,
compute/accelerator/README.md "Maximum Achievable Matmul FLOPS comparison table", its BF16 and
FP8 (`float8_e4m3fn`) tables, as of 2026-08): FP8 MAMF / FP8 peak over BF16 MAMF / BF16 peak,
  H100 SXM (1402.6 / 1979) / (794.5 / 989) = 0.882
  H200 SXM (1453.4 / 1979) / (794.5 / 989; "H200 is the same" as H100 in bf16) = 0.914
  B200 SXM (3432.5 / 4500) / (1745.0 / 2250) = 0.983
  B300 SXM (3353.3 / 4500) / (1769.0 / 2250) = 0.948
(`FP8_RELATIVE_MATMUL_FRACTION`), so a large linear's GEMMs run 2 x 0.882 = 1.76x faster in FP8 on
an H100. A GPU given an FP8 peak in a cluster file without its own ratio gets the smallest of
these, the H100's (`FP8_GEMM_RELATIVE_EFFICIENCY`). It used to be an assumed 0.85, bracketed by
torchao's float8 README (the GEMM speedup "approaching 2x as M, K, N increase") and end-to-end
speedups with casts included (torchao's README, Llama3-8B on 8 H100, 1.25x tokens/s; PyTorch blog
"Supercharging training using float8 and FSDP2" (2024), Llama3 70B/405B on 128-512 H100,
1.43-1.51x), before the FP8 table was published; the measured ratios sit inside that bracket.

TF32 (`TF32_DTYPE`, "tfloat32"): Ampere and later GPUs multiply float32 tensors in TF32 (10-bit
mantissa, float32 accumulate) at 156 TFLOP/s dense on A100 and 494.7 on H100 SXM / H200 (the same
data sheets, sparse figures halved), 8x and 7.4x their float32 rates. PyTorch runs convolutions in
TF32 by default and matrix products in float32 (`torch.backends.cudnn.allow_tf32` True,
`torch.backends.cuda.matmul.allow_tf32` False: PyTorch's "TensorFloat-32 (TF32) on Ampere (and later)
devices" note, CUDA semantics), and the runtime keeps both defaults, so a float32 plan prices its
convolutions at the TF32 peak (`GPUSpec.achievable_convolution_flops`) and its linears at the float32
one. A run that turns TF32 off for convolutions gives the cluster file `peak_flops: {tfloat32: <the
float32 peak>}`.

The `cpu` entry stands for one gloo process on a workstation core; its numbers are rough
defaults only used when nothing was measured (a measured CPU profile is always preferred).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from planner.errors import PlannerError

TFLOPS = 1e12
GEMM, ATTENTION, CONVOLUTION = "gemm", "attention", "convolution"
"""The kinds of kernel priced at rates of their own (`GPUSpec.kernel_flops`; planner/profiler/counters.py)."""
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
    nvls_all_reduce_bytes_per_s: float | None = None
    """Bytes all-reduced per second (algorithm bandwidth, M / t) by NCCL's NVLink SHARP algorithm
    (NVLS: the NVSwitch reduces, each GPU sends its data once and receives the sum once) inside one
    node, large messages; None where the node's switch has no SHARP (A100's NVSwitch) or no figure
    is published (`NVLS_ALL_REDUCE_ALGBW`)."""
    matmul_efficiency: float = 0.72
    """Fraction of peak FLOP/s a transformer block's matrix products sustain in training
    (presets: `SUSTAINED_MATMUL_FRACTION` x `BLOCK_GEMM_FACTOR`, module docstring)."""
    memory_efficiency: float = 0.85
    """Fraction of peak memory bandwidth streaming kernels reach."""
    attention_efficiency: float | None = None
    """Fraction of the dense peak fused attention kernels (flash, memory-efficient) sustain in
    training on the FLOPs torch counts, without a mask (the forward's; the backward's is this times
    `attention_backward_ratio`); None: `matmul_efficiency` on every score, both passes (module
    docstring, `KERNEL_BENCHMARKS`)."""
    attention_backward_ratio: float = 1.0
    """With `attention_efficiency`: the backward's rate over the forward's (both count the
    backward's work as 2.5 forwards: torch's FLOP counter and FlashAttention's benchmarks)."""
    attention_causal_ratio: float = 1.0
    """With `attention_efficiency`: a causal kernel's rate over the unmasked one's, counting half
    the scores (the masked tiles skipped), as FlashAttention's benchmarks do: 0.90 for
    FlashAttention-2 on an H100 (`KERNEL_BENCHMARKS`); 0.5 prices a causal kernel in the unmasked
    one's time (`END_TO_END_ATTENTION_FRACTION`)."""
    kernel_overhead_s: float = 5e-6
    """Fixed cost per kernel (launch, tail), seconds."""
    fp8_relative_efficiency: float | None = None
    """An FP8 GEMM's fraction of the FP8 peak over a bf16 GEMM's fraction of the bf16 peak; None:
    `FP8_GEMM_RELATIVE_EFFICIENCY` (module docstring, `FP8_RELATIVE_MATMUL_FRACTION`)."""

    def achievable_flops(self, dtype: str) -> float:
        if dtype == FP8_DTYPE:
            return self.fp8_peak_flops() * self.fp8_matmul_efficiency
        if dtype not in self.peak_flops:
            raise PlannerError(
                f"GPU {self.name} has no peak FLOP/s for dtype {dtype}.",
                f"Use one of {sorted(set(self.peak_flops) - {TF32_DTYPE})}.",
            )
        return self.peak_flops[dtype] * self.matmul_efficiency

    def achievable_attention_flops(self, dtype: str) -> float:
        """FLOP/s of a fused attention kernel (planner/profiler/counters.py `ATTENTION_OPS`); FP8
        plans keep attention in 16 bits, so "float8" prices it at the bf16 peak."""
        dtype = "bfloat16" if dtype == FP8_DTYPE else dtype
        if self.attention_efficiency is None:
            return self.achievable_flops(dtype)
        self.achievable_flops(dtype)  # an unknown dtype is refused as there
        return self.peak_flops[dtype] * self.attention_efficiency

    def attention_time_s(self, flops: float, dtype: str, backward: bool = False, causal: bool = False) -> float:
        """Seconds of fused attention kernels doing `flops` as torch counts them (every score: the
        forward 4 b s^2 h d, the backward 2.5 times that, its 5 products with the scores recomputed,
        as FlashAttention counts them too), in the `backward` pass, under a `causal` mask or none
        (module docstring, `KERNEL_BENCHMARKS`). Without `attention_efficiency` the GEMM rate
        prices every counted FLOP, as before causal masks were told apart."""
        if self.attention_efficiency is None:
            return flops / self.achievable_attention_flops(dtype)
        rate = self.achievable_attention_flops(dtype)
        work = flops
        if backward:
            rate *= self.attention_backward_ratio
        if causal:  # the masked tiles are skipped: half the scores, at the causal kernel's rate
            work, rate = work / 2, rate * self.attention_causal_ratio
        return work / rate

    def achievable_convolution_flops(self, dtype: str) -> float:
        """FLOP/s of a convolution (planner/profiler/counters.py `CONVOLUTION_OPS`): in float32 on a GPU
        with a TF32 peak, that peak (cuDNN's default, module docstring), else `achievable_flops`."""
        if dtype == "float32" and TF32_DTYPE in self.peak_flops:
            return self.peak_flops[TF32_DTYPE] * self.matmul_efficiency
        return self.achievable_flops(dtype)

    def kernel_flops(self, dtype: str, kind: str = GEMM) -> float:
        """FLOP/s of a kernel of `kind` (`GEMM`, `ATTENTION`, `CONVOLUTION`: the rates above)."""
        if kind == ATTENTION:
            return self.achievable_attention_flops(dtype)
        if kind == CONVOLUTION:
            return self.achievable_convolution_flops(dtype)
        return self.achievable_flops(dtype)

    def fp8_peak_flops(self) -> float:
        """Dense FP8 peak FLOP/s; a PlannerError for a GPU without FP8 tensor cores."""
        if FP8_DTYPE not in self.peak_flops:
            raise PlannerError(
                f"GPU {self.name} has no FP8 tensor cores (FP8 training needs compute capability 8.9 or "
                "newer: H100, H200), so an FP8 plan cannot be priced for it.",
                "Plan in bfloat16 for this GPU, pick a GPU with FP8 (h100-80gb, h200, b200, b300), or give its dense "
                "FP8 peak as `peak_flops: {float8: ...}` in the cluster file.",
            )
        return self.peak_flops[FP8_DTYPE]

    @property
    def supports_fp8(self) -> bool:
        """Whether the spec has a dense FP8 peak to price FP8 linears with."""
        return FP8_DTYPE in self.peak_flops

    @property
    def fp8_matmul_efficiency(self) -> float:
        """Fraction of the dense FP8 peak a transformer block's FP8 GEMMs sustain:
        `matmul_efficiency` x `fp8_relative_efficiency` (module docstring). A property, not a
        field, so that a calibrated or overridden bf16 efficiency carries over to FP8."""
        relative = self.fp8_relative_efficiency
        return self.matmul_efficiency * (FP8_GEMM_RELATIVE_EFFICIENCY if relative is None else relative)

    @property
    def achievable_bandwidth(self) -> float:
        return self.memory_bandwidth_bytes_per_s * self.memory_efficiency


FP8_DTYPE = "float8"
"""Key of the dense FP8 peak in `GPUSpec.peak_flops`."""
TF32_DTYPE = "tfloat32"
"""Key of the dense TF32 peak in `GPUSpec.peak_flops`: float32 convolutions run at it (module docstring)."""
A100_TF32_DENSE_FLOPS = 156 * TFLOPS
"""A100 dense TF32 peak (data sheet: 156 TFLOP/s, 312 with 2:4 sparsity)."""
H100_TF32_DENSE_FLOPS = 494.7 * TFLOPS
"""H100 SXM / H200 dense TF32 peak (data sheets: 989 TFLOP/s with 2:4 sparsity, halved)."""
H100_FP8_DENSE_FLOPS = 1979 * TFLOPS
"""H100 SXM / H200 dense FP8 peak (data sheets: 3,958 TFLOP/s with 2:4 sparsity, halved)."""
FP8_RELATIVE_MATMUL_FRACTION = {
    "h100": (1402.6 / 1979) / (794.5 / 989),
    "h200": (1453.4 / 1979) / (794.5 / 989),
    "b200": (3432.5 / 4500) / (1745.0 / 2250),
    "b300": (3353.3 / 4500) / (1769.0 / 2250),
}
"""FP8 GEMM's fraction of its peak over bf16's fraction of its peak, same measurement (MAMF tables; module docstring)."""
FP8_GEMM_RELATIVE_EFFICIENCY = min(FP8_RELATIVE_MATMUL_FRACTION.values())
"""The ratio for a GPU that states none (a cluster file's own FP8 peak): the smallest measured, the H100's."""

HOPPER_SUSTAINED_RATIO = 698.6 / 823.9
"""Hopper's sustained / burst GEMM rate at 700 W (H200 MSMF / MAMF, 8 GPUs busy; module docstring)."""
BLOCK_GEMM_FACTOR = 0.838
"""Share of the best sustained GEMM rate a transformer block's products reach (module docstring)."""
SUSTAINED_MATMUL_FRACTION = {
    "a100": 267.9 / 312,  # MAMF, A100 SXM
    "h100": 792.1 / 989 * HOPPER_SUSTAINED_RATIO,  # MAMF x Hopper's MSMF / MAMF at 700 W (H200, 8 GPUs busy)
    "h200": 698.6 / 989,  # MSMF, H200 SXM, all 8 GPUs busy
    "b200": 1745.0 / 2250,  # MAMF, B200 SXM (no sustained figure published: the burst rate stands for it)
    "b300": 1769.0 / 2250,  # MAMF, B300 SXM (likewise)
}
"""Best bf16 GEMM sustained in training / dense peak, per GPU generation (module docstring)."""


def _matmul_efficiency(generation: str) -> float:
    return SUSTAINED_MATMUL_FRACTION[generation] * BLOCK_GEMM_FACTOR


END_TO_END_ATTENTION_FRACTION = 0.35 * HOPPER_SUSTAINED_RATIO
"""FlashAttention-2's 35% of an H100's peak (FlashAttention-3, Shah et al. 2024, arXiv 2407.08608,
abstract), at burst clocks, times the sustained ratio, on every score torch counts, in both passes:
how Megatron-Core's published H100 runs (shared/reference/) price end to end (module docstring;
planner/engines/megatron.py `stack_gpu`). The H100 and H200 presets price the kernels' own rates."""
KERNEL_BENCHMARKS = {
    "flash-attention-2": {"forward": 370.0, "forward_causal": 333.0, "backward": 318.0},
    "cudnn": {"forward": 600.0, "forward_causal": 529.0, "backward": 518.0},
    "flash-attention-3": {"forward": 646.0, "forward_causal": 602.0, "backward": 559.0},
}
"""Fused attention kernels on an H100 SXM5 in TFLOP/s, bf16, head dim 128, 8K tokens, burst clocks, in
FlashAttention's count (a causal kernel counts half the scores; a backward 2.5 forwards, as torch's
FLOP counter counts it: the scores recomputed, 5 products): Shah et al. 2024, FlashAttention-3
(arXiv 2407.08608), Figures 5 (forward, without and with the causal mask) and 6 (backward, without),
as transcribed from the figures. The backward's causal figure is not given: its causal ratio is taken
to be the forward's. The H100 and H200 presets price FlashAttention-2's, the kernel torch's SDPA runs
(its priority order puts flash first, cuDNN's kernel last), so the planner's runtime and torchtitan;
a cluster file prices another stack's kernel with them (`kernel_attention`; Transformer Engine
prefers cuDNN's on Hopper). A100: no rates, the GEMMs' rate on every score (FlashAttention-2 reaches
50-73% of an A100's peak, Dao 2023, arXiv 2307.08691, abstract: about a block's GEMMs' 0.72). B200,
B300: likewise, for want of a published figure for a fused attention kernel on Blackwell."""


def kernel_attention(kernel: str, sustained_ratio: float = HOPPER_SUSTAINED_RATIO, peak_tflops: float = 989.4) -> dict[str, float]:
    """The GPUSpec fields that price attention at a kernel's benchmarked rates (`KERNEL_BENCHMARKS`),
    sustained as the GEMMs are: `attention_efficiency` (the unmasked forward's fraction of the peak),
    `attention_backward_ratio` and `attention_causal_ratio`."""
    rates = KERNEL_BENCHMARKS[kernel]
    return {"attention_efficiency": rates["forward"] / peak_tflops * sustained_ratio,
            "attention_backward_ratio": rates["backward"] / rates["forward"],
            "attention_causal_ratio": rates["forward_causal"] / rates["forward"]}


BLACKWELL_PEAK_FLOPS = {"float32": 80 * TFLOPS, "bfloat16": 2250 * TFLOPS, "float16": 2250 * TFLOPS,
                        FP8_DTYPE: 4500 * TFLOPS, TF32_DTYPE: 1125 * TFLOPS}
"""B200 and B300 dense peaks, the same for both (module docstring)."""
B200 = GPUSpec(
    name="b200",
    peak_flops=BLACKWELL_PEAK_FLOPS,
    memory_bytes=int(180 * GB),
    memory_bandwidth_bytes_per_s=8000 * GB,
    intra_node_bandwidth_bytes_per_s=900 * GB,
    inter_node_bandwidth_bytes_per_s=50 * GB,
    matmul_efficiency=_matmul_efficiency("b200"),
    fp8_relative_efficiency=FP8_RELATIVE_MATMUL_FRACTION["b200"],
)
"""B200 SXM (DGX B200); B300 differs in memory (288 GB), network (ConnectX-8, 100 GB/s per GPU) and its MAMF."""


NVLS_ALL_REDUCE_ALGBW = {"h100": 275 * GB, "h200": 475 * GB * 8 / 14}
"""NCCL's NVLink SHARP all-reduce on 8 GPUs of an NVSwitch (gen 3) node, the default algorithm there
since NCCL 2.17, as bytes all-reduced per second. H100: "on 8 GPUs, you should reach a peak busBw of
~480GB/s (algbw ~275GB/s)" (sjeaugey, NVIDIA/nccl-tests issue #212); H200: busbw 475 GB/s
(nccl-tests issue #272, NCCL 2.20.3), algbw = busbw x 8 / (2 x 7). The ring reaches ~370 GB/s of
busbw on the same node (NVIDIA/nccl issue #1455), so NVLS is about 1.3x faster on 8 GPUs; on 2-4
GPUs that issue measures no gain (busbw 365-370 either way), where this model's NVLS (algbw 275
for any group) is 10% optimistic at 4 GPUs and the ring wins at 2. NVLink SHARP moves no fewer
bytes for all-gather and reduce-scatter, and NCCL's NVLS all-gather is slower than its ring (300
against 350 GB/s at 1 GB, NVIDIA/nccl issue #1506), so only the all-reduce gets it
(planner/cost/collectives.py). B200/B300 (NVSwitch gen 4) have it too, with no published figure:
left out, priced as the ring."""


# 8 x 200 Gb/s HDR InfiniBand per DGX A100 node: one 25 GB/s NIC per GPU.
# DGX H100/H200 and DGX B200: 8 x 400 Gb/s (ConnectX-7, NDR), 50 GB/s per GPU; DGX B300: 8 x 800 Gb/s
# (ConnectX-8, XDR), 100 GB/s (stas00/ml-engineering network/README.md, inter-node table, 2026-07).
# NVLink 5 (B200, B300): 1.8 TB/s per GPU both ways (HGX B200/B300: 14.4 TB/s for 8), 900 GB/s each way.
GPUS: dict[str, GPUSpec] = {
    spec.name: spec
    for spec in (
        GPUSpec(
            name="a100-40gb",
            peak_flops={"float32": 19.5 * TFLOPS, "bfloat16": 312 * TFLOPS, "float16": 312 * TFLOPS,
                        TF32_DTYPE: A100_TF32_DENSE_FLOPS},
            memory_bytes=40 * GIB,
            memory_bandwidth_bytes_per_s=1555 * GB,
            intra_node_bandwidth_bytes_per_s=300 * GB,
            inter_node_bandwidth_bytes_per_s=25 * GB,
            matmul_efficiency=_matmul_efficiency("a100"),
        ),
        GPUSpec(
            name="a100-80gb",
            peak_flops={"float32": 19.5 * TFLOPS, "bfloat16": 312 * TFLOPS, "float16": 312 * TFLOPS,
                        TF32_DTYPE: A100_TF32_DENSE_FLOPS},
            memory_bytes=80 * GIB,
            memory_bandwidth_bytes_per_s=2039 * GB,
            intra_node_bandwidth_bytes_per_s=300 * GB,
            inter_node_bandwidth_bytes_per_s=25 * GB,
            matmul_efficiency=_matmul_efficiency("a100"),
        ),
        GPUSpec(
            name="h100-80gb",
            peak_flops={"float32": 66.9 * TFLOPS, "bfloat16": 989.4 * TFLOPS, "float16": 989.4 * TFLOPS,
                        FP8_DTYPE: H100_FP8_DENSE_FLOPS, TF32_DTYPE: H100_TF32_DENSE_FLOPS},
            memory_bytes=80 * GIB,
            memory_bandwidth_bytes_per_s=3350 * GB,
            intra_node_bandwidth_bytes_per_s=450 * GB,
            inter_node_bandwidth_bytes_per_s=50 * GB,
            nvls_all_reduce_bytes_per_s=NVLS_ALL_REDUCE_ALGBW["h100"],
            matmul_efficiency=_matmul_efficiency("h100"),
            **kernel_attention("flash-attention-2"),
            fp8_relative_efficiency=FP8_RELATIVE_MATMUL_FRACTION["h100"],
        ),
        GPUSpec(
            name="h200",
            peak_flops={"float32": 66.9 * TFLOPS, "bfloat16": 989.4 * TFLOPS, "float16": 989.4 * TFLOPS,
                        FP8_DTYPE: H100_FP8_DENSE_FLOPS, TF32_DTYPE: H100_TF32_DENSE_FLOPS},
            memory_bytes=int(141 * GB),
            memory_bandwidth_bytes_per_s=4800 * GB,
            intra_node_bandwidth_bytes_per_s=450 * GB,
            inter_node_bandwidth_bytes_per_s=50 * GB,
            nvls_all_reduce_bytes_per_s=NVLS_ALL_REDUCE_ALGBW["h200"],
            matmul_efficiency=_matmul_efficiency("h200"),
            **kernel_attention("flash-attention-2"),
            fp8_relative_efficiency=FP8_RELATIVE_MATMUL_FRACTION["h200"],
        ),
        B200,
        replace(B200, name="b300", memory_bytes=int(288 * GB), inter_node_bandwidth_bytes_per_s=100 * GB,
                matmul_efficiency=_matmul_efficiency("b300"), fp8_relative_efficiency=FP8_RELATIVE_MATMUL_FRACTION["b300"]),
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

DEFAULT_ANALYTIC_GPU = "h100-80gb"
"""The GPU an analytic (meta-device) profile prices when none is named."""

ALIASES = {"a100": "a100-80gb", "h100": "h100-80gb", "h100-sxm": "h100-80gb", "h200-141gb": "h200",
           "b200-180gb": "b200", "b300-288gb": "b300"}


def get_gpu(name: str) -> GPUSpec:
    """Look a preset up by name (case-insensitive, a few aliases accepted)."""
    key = ALIASES.get(name.lower(), name.lower())
    if key not in GPUS:
        raise PlannerError(
            f"Unknown GPU {name!r}.",
            f"Known GPUs: {', '.join(sorted(GPUS))}.",
        )
    return GPUS[key]
