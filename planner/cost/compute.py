"""Compute time of a unit on the target GPU, from the profile.

Two sources, chosen per profile and target (`ComputeModel.source`):

- **profiled**: the profile was made on the target itself (a measured CPU profile for the
  `cpu` cluster, a measured CUDA profile whose device name matches the target GPU, or an
  analytic profile made for the same GPU, its preset's rates unchanged by a cluster file, and
  dtype). Unit times are the profile's times,
  interpolated linearly between the profiled micro-batch sizes (and extrapolated from the
  two nearest sizes, never below proportional-to-zero, and above the largest size never
  cheaper per sample than that size: `interpolate_time`). A measured profile also records
  the whole model's forward+backward against the sum of its units (`Profile.whole_model`);
  that ratio multiplies every unit time, because timing units one by one adds launch and
  synchronisation work the model does not do (0.51-0.95 on an H100, see
  benchmarks/results/h100/README.md) or misses glue code and the loss (ratio > 1).
- **roofline**: any other target. Time = max(FLOPs / achievable FLOP/s, bytes moved /
  achievable bandwidth) per direction, the same roofline the analytic profiler uses per op
  (here on the unit's totals, so slightly optimistic where a unit mixes compute- and
  memory-bound ops; the FLOPs of fused attention kernels at the GPU's attention rate, the rest
  at its GEMM rate). Achievable rates are the GPU spec's peak times its efficiencies
  (planner/hardware.py); `calibrate` replaces the matmul efficiency by the one a measured
  profile from that GPU achieved.

Contention (`slowdown`, the cluster's `compute_slowdown`): a profile is measured by one
process alone, but in a run every device of a node computes at once. GPUs are separate
chips (slowdown 1); gloo processes on one CPU share its cores, caches and memory bandwidth,
and `planner profile-cluster` measures by how much a fixed mix of matrix products and
elementwise work slows down when all of them run it together. Unit times are multiplied
by that ratio.

Zero bubble's weight-gradient pass (`weight_gradient_share`): the share of a unit's backward
that its weight GEMMs take, from the profile's ops at the GPU's rates: for a GPT block of
width 4096 on an H100 0.42 at 2048 tokens, 0.28 at 8192 and 0.12 at 32768, where attention's
backward (no W, and at attention's lower rate) dominates; 0.5 for an output head; 0 for
norms and embeddings, whose weight gradients are elementwise or a scatter (a norm's is a
reduction over the tokens: a third of its small backward, measured on CPU, left out).
benchmarks/zero_bubble_split.py times torch's B and W per unit on CPU: GPT blocks 0.43-0.46
measured against 0.45 predicted at 128 tokens, 0.28-0.29 against 0.27 at 1024; the MoE
example's layers, whose experts' grouped GEMMs the op graph does not list (counted from the
layer's expert FLOPs), 0.45 against 0.43.

What the split costs (`split_backward`): torch runs zero bubble's B and W as two autograd
passes (`stage_backward_input`, then `stage_backward_weight` once per parameter group), and
they may together cost more than one backward. A measured profile times them on its device
(`UnitCosts.backward_input_time_s`, `backward_weight_time_s`); where it did, a split stage's
backward is the unit's backward times (B + W) / backward, and W's share is the measured W / (B + W)
in place of the GEMMs'. Measured on this project's 2-core CPU (benchmarks/zero_bubble_split.py),
B + W over one backward: a GPT block of width 64 at 32 tokens 1.9x; of width 256, 1.10x at 128
tokens and 1.04x at 1024; a small Hugging Face Llama's layers 2.2x; ResNet's units together 1.16x.
Priced per unit, a stage of several units pays a little more than that, torch's traversals growing
with the stage's graph: 8 of those width-64 blocks in one stage 2.4x, against 1.9x for one.
Analytic profiles price the split as free.

Optimizer step (`optimizer_s_per_param`): a measured profile records one AdamW step over the
whole model on its device; on that device a rank's step costs its share of it. Otherwise
the step is memory-bound: AdamW streams weights, gradients, fp32 master weights and both
moments in and the updated ones out, about 2 x 16 bytes per parameter, at the achievable
memory bandwidth.

Tensor parallelism (`tp_time_s`) divides the work of the ops the intra-op solver shards by
the TP degree; the rest of the unit (norms, residual adds, elementwise glue) stays
replicated unless sequence parallelism shards it along the sequence too (Korthikanti et
al. 2022, section 4.2.2). The split uses the FLOP share of the sharded ops, which
undercounts the replicated elementwise time of a transformer block by a few percent.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, replace

from planner.hardware import CONVOLUTION, GEMM, GPUS, GPUSpec
from planner.profile_schema import Profile, Unit

OPTIMIZER_TRAFFIC_BYTES_PER_PARAM = 32
"""AdamW's memory traffic per parameter: weights, gradients, master weights, two moments in; updated ones out."""


def interpolate(points: dict[int, float], x: float) -> float:
    """Piecewise-linear value at x from {size: value}; proportional when one point is known."""
    sizes = sorted(points)
    if len(sizes) == 1:
        return points[sizes[0]] * x / sizes[0]
    if x in points:
        return points[int(x)]
    i = min(max(bisect_left(sizes, x), 1), len(sizes) - 1)
    lo, hi = sizes[i - 1], sizes[i]
    value = points[lo] + (points[hi] - points[lo]) * (x - lo) / (hi - lo)
    # Extrapolating below the smallest size must not go negative; above, linear is fine.
    return max(value, points[sizes[0]] * x / sizes[0] if x < sizes[0] else 0.0)


def interpolate_time(points: dict[int, float], x: float) -> float:
    """`interpolate` for a time, where above the largest profiled size a micro-batch is never
    cheaper per sample than at that size. Linear extrapolation from the two largest sizes
    assumes their marginal cost continues, which fails where those sizes are bound by kernel
    launches rather than by the GPU's work (GPT-2-medium in bf16 on an H200: 40 ms at
    micro-batch 1 and 45 ms at 8, so linear gives 53 ms at 16 where 110 ms was measured)."""
    value = interpolate(points, x)
    top = max(points)
    return max(value, points[top] * x / top) if x > top else value


def same_rates(a: GPUSpec, b: GPUSpec) -> bool:
    """Whether two specs time every kernel alike: equal but for memory size and links."""
    return replace(a, memory_bytes=b.memory_bytes, intra_node_bandwidth_bytes_per_s=b.intra_node_bandwidth_bytes_per_s,
                   inter_node_bandwidth_bytes_per_s=b.inter_node_bandwidth_bytes_per_s,
                   nvls_all_reduce_bytes_per_s=b.nvls_all_reduce_bytes_per_s) == b


def profile_matches(profile: Profile, gpu: GPUSpec, dtype: str) -> bool:
    """Whether the profile's times are the target's own (module docstring, "profiled"), else it is priced by roofline."""
    if profile.dtype != dtype:
        return False
    if profile.mode == "analytic":
        # An analytic profile's times are the rates of the spec it was made for: a cluster file's
        # overrides of them (its attention kernel, a calibrated matmul rate) make another GPU, priced
        # by roofline; of its memory or links, not. A profile without its spec (before 2026-11-30)
        # was made for the preset of its name.
        made_for = profile.analytic_gpu() if profile.target_gpu_spec else GPUS.get(gpu.name, gpu)
        return profile.target_gpu == gpu.name and same_rates(made_for, gpu)
    if profile.device == "cpu":
        return gpu.name == "cpu"
    # Measured on CUDA: the device name ("NVIDIA H100 80GB HBM3") must name the target.
    name = profile.device_name.lower()
    family, _, size = gpu.name.partition("-")
    return family in name and (not size or size.replace("gb", "") in name)


def calibrate(gpu: GPUSpec, measured: Profile) -> GPUSpec:
    """The spec with the matmul efficiency a measured profile on this GPU achieved.

    Achieved rate = total FLOPs / total time over all units at the largest micro-batch size
    (the most compute-bound); its ratio to the dense peak becomes `matmul_efficiency`.
    """
    mbs = max(measured.micro_batch_sizes)
    flops = sum(u.costs[mbs].forward_flops + u.costs[mbs].backward_flops for u in measured.units)
    time_s = sum(u.costs[mbs].forward_time_s + u.costs[mbs].backward_time_s for u in measured.units)
    efficiency = flops / time_s / gpu.peak_flops[measured.dtype]
    return replace(gpu, matmul_efficiency=min(max(efficiency, 0.01), 1.0))


@dataclass(frozen=True)
class UnitTime:
    forward_s: float
    """Forward time of one micro-batch."""
    backward_s: float
    """Backward time (input and weight gradients) of one micro-batch."""

    @property
    def total_s(self) -> float:
        return self.forward_s + self.backward_s


class ComputeModel:
    """Unit times for one profile on one target GPU and dtype."""

    def __init__(self, profile: Profile, gpu: GPUSpec, dtype: str | None = None, use_whole_model_ratio: bool = True,
                 slowdown: float = 1.0):
        self.profile, self.gpu = profile, gpu
        self.slowdown = slowdown
        """Multiplies every time: the node's compute contention (module docstring)."""
        self.dtype = dtype or profile.dtype
        self.source = "profiled" if profile_matches(profile, gpu, self.dtype) else "roofline"
        ratios = {b: w.ratio for b, w in profile.whole_model.items() if w.ratio > 0}
        self._ratios = ratios if (use_whole_model_ratio and ratios and self.source == "profiled") else {}
        self._cache: dict[tuple[int, float], UnitTime] = {}

    def whole_model_ratio(self, micro_batch_size: float) -> float:
        if not self._ratios:
            return 1.0
        sizes = sorted(self._ratios)
        x = min(max(micro_batch_size, sizes[0]), sizes[-1])  # ratios do not extrapolate
        return interpolate(self._ratios, x) if len(sizes) > 1 else self._ratios[sizes[0]]

    def unit_time(self, unit: Unit, micro_batch_size: float) -> UnitTime:
        key = (unit.index, micro_batch_size)
        if key not in self._cache:
            t = self._unit_time(unit, micro_batch_size)
            self._cache[key] = UnitTime(t.forward_s * self.slowdown, t.backward_s * self.slowdown)
        return self._cache[key]

    def _unit_time(self, unit: Unit, b: float) -> UnitTime:
        costs = unit.costs
        if self.source == "profiled":
            ratio = self.whole_model_ratio(b)
            fwd = interpolate_time({k: c.forward_time_s for k, c in costs.items()}, b)
            bwd = interpolate_time({k: c.backward_time_s for k, c in costs.items()}, b)
            return UnitTime(fwd * ratio, bwd * ratio)
        def time_s(pass_: str) -> float:
            # FLOPs and bytes are linear in the micro-batch size (plus a constant for weights).
            def at(field: str) -> float:
                return interpolate({k: getattr(c, f"{pass_}_{field}") for k, c in costs.items()}, b)

            return max(self.flops_time_s(at("flops"), at("attention_flops"), at("convolution_flops"),
                                         at("causal_attention_flops"), backward=pass_ == "backward"),
                       at("memory_traffic_bytes") / self.gpu.achievable_bandwidth)

        return UnitTime(time_s("forward"), time_s("backward"))

    def flops_time_s(self, flops: float, attention_flops: float = 0.0, convolution_flops: float = 0.0,
                     causal_attention_flops: float = 0.0, backward: bool = False) -> float:
        """Seconds of `flops` on this GPU, of which `attention_flops` run in fused attention kernels
        (`causal_attention_flops` of them under a causal mask; in the `backward` pass or the forward)
        and `convolution_flops` in convolutions, each at its own rate (planner/hardware.py)."""
        gpu, dtype = self.gpu, self.dtype
        return ((flops - attention_flops - convolution_flops) / gpu.kernel_flops(dtype, GEMM)
                + convolution_flops / gpu.kernel_flops(dtype, CONVOLUTION)
                + gpu.attention_time_s(attention_flops - causal_attention_flops, dtype, backward)
                + gpu.attention_time_s(causal_attention_flops, dtype, backward, causal=True))

    def optimizer_s_per_param(self) -> float:
        """Seconds of one AdamW step per parameter (module docstring), contention included."""
        measured = self.profile.optimizer_step_s
        if self.source == "profiled" and measured and self.profile.model.num_parameters:
            return measured / self.profile.model.num_parameters * self.slowdown
        return OPTIMIZER_TRAFFIC_BYTES_PER_PARAM / self.gpu.achievable_bandwidth * self.slowdown

    def weight_gradient_share(self, unit: Unit) -> float:
        """Share of the unit's backward spent on weight gradients: zero bubble's W (module docstring).

        A linear's or convolution's weight gradient is one GEMM as large as its forward (Qi et
        al. 2023, section 2: T_W = T_F's GEMMs); the rest of the backward is input gradients,
        fused attention's backward (none of it W) and elementwise work. Priced as the time of
        those GEMMs (a MoE layer's experts' too) at the GPU's GEMM rate over the backward's
        compute time (attention at its own rate), at the smallest profiled micro-batch size (the
        share hardly moves with it). At most a half: a later stage's every weighted op also makes
        its input's gradient, a GEMM as large (only the first stage's first op does not, and the
        first stage's split moves nothing: planner/cost/schedules.py)."""
        smallest = min(unit.costs)
        costs = unit.costs[smallest]
        linears = sum(op.forward_flops for op in unit.ops if op.weight_shape and op.kind == "linear")
        # A MoE layer's experts run grouped GEMMs the op graph does not list: their forward FLOPs.
        linears += sum(layer.costs[smallest].expert_forward_flops for layer in unit.moe if smallest in layer.costs)
        convolutions = sum(op.forward_flops for op in unit.ops if op.weight_shape and op.kind == "conv")
        weights_s = self.flops_time_s(linears + convolutions, convolution_flops=convolutions)
        backward_s = self.flops_time_s(costs.backward_flops, costs.backward_attention_flops, costs.backward_convolution_flops,
                                       costs.backward_causal_attention_flops, backward=True)
        return min(weights_s / backward_s, 0.5) if backward_s > 0 else 0.0

    def split_backward(self, unit: Unit, micro_batch_size: float) -> tuple[float, float] | None:
        """(B + W over the whole backward, W's share of B + W) at this micro-batch size, as measured
        on this device (module docstring); None where the profile is not this device's or did not
        run the unit split."""
        if self.source != "profiled":
            return None
        points = {k: c for k, c in unit.costs.items()
                  if c.backward_input_time_s is not None and c.backward_weight_time_s is not None}
        if not points:
            return None
        b = micro_batch_size
        whole = interpolate_time({k: c.backward_time_s for k, c in points.items()}, b)
        inputs = interpolate_time({k: c.backward_input_time_s or 0.0 for k, c in points.items()}, b)
        weights = interpolate_time({k: c.backward_weight_time_s or 0.0 for k, c in points.items()}, b)
        if whole <= 0 or inputs + weights <= 0:
            return None
        return (inputs + weights) / whole, weights / (inputs + weights)

    def forward_flops(self, unit: Unit, micro_batch_size: float) -> float:
        return interpolate({k: c.forward_flops for k, c in unit.costs.items()}, micro_batch_size)

    def backward_flops(self, unit: Unit, micro_batch_size: float) -> float:
        return interpolate({k: c.backward_flops for k, c in unit.costs.items()}, micro_batch_size)


def sharded_flop_fraction(unit: Unit, sharded_ops: set[str]) -> float:
    """Share of the unit's forward FLOPs done by the ops the TP plan shards."""
    total = sum(op.forward_flops for op in unit.ops)
    smallest = min(unit.costs)
    unit_flops = max(unit.costs[smallest].forward_flops, total, 1)
    return sum(op.forward_flops for op in unit.ops if op.name in sharded_ops) / unit_flops


def tp_time_s(time_s: float, sharded_fraction: float, tp_degree: int, sequence_parallel: bool) -> float:
    """A unit's time per GPU under TP: sharded work / tp, the rest / tp only with SP."""
    rest = (1.0 - sharded_fraction) / (tp_degree if sequence_parallel else 1)
    return time_s * (sharded_fraction / tp_degree + rest)
