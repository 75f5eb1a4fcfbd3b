"""FP8 linears (torchao Float8 training, tensorwise dynamic scaling): what they save and cost.

A pure price per unit for the solver to compose (`price_fp8_unit`), plus the MFU under both
conventions (`mfu_conventions`). Nothing here imports torch.

Which linears. The runtime (runtime/apply_fp8.py) converts with torchtitan's filter
(torchtitan/components/quantization/utils.py `module_filter_fn`): an `nn.Linear` whose weight
dims are both multiples of 16 (the FP8 tensor cores' alignment; `torch._scaled_mm` refuses
others) and whose FQN is not filtered. torchtitan's Float8 converter filters nothing by default,
but its Llama 3 training configs and float8 docs pass `filter_fqns = ["output"]`, the vocabulary
head: logits are the most precision-sensitive product and the vocabulary is often not a multiple
of 16. We do as those configs do, by structure rather than by name: the model's last unit is
skipped when it is a single linear (`output_head`), and so is a single-linear unit whose weight is
tied to another unit's (`skipped_units`). Ops of kind `linear` that are not
`nn.Linear` modules (a functional `F.linear`, Hugging Face's `Conv1D` stored [in, out]) are not
converted by torchao, so they are not priced either.

GEMMs. A linear of forward FLOPs F (2MKN for M tokens, K in, N out features) runs one GEMM
forward (y = x W^T) and two backward (dx = dy W, dW = dy^T x), each of F FLOPs
(backward = 2x forward: Narayanan et al. 2021, appendix "Floating-point operations"). Each GEMM's saving is F / R_bf16 - F / R_fp8 with
R = the GPU's achievable rate per dtype (planner/hardware.py: R_fp8 / R_bf16 = 2 x
FP8_GEMM_RELATIVE_EFFICIENCY = 1.7 on H100/H200). So FP8 halves matmul time at equal
efficiency, and takes 1 / 1.7 = 0.59 of it at the stated one.

Casts (torchao/float8/float8_linear.py `matmul_with_hp_or_float8_args`, tensorwise dynamic
scaling, `hp_tensor_to_float8_dynamic`): every FP8 operand is made from its bf16 tensor by
an amax pass (read 2 bytes per element, a global reduction that the cast must wait for) and a
scale-and-cast pass (read 2, write 1): 5 bytes of HBM traffic per element and 2 kernels.
  forward:  input x [M, K] and weight W [N, K];
  backward: grad_output dy [M, N] twice (once for dx, once for dW: torchao casts it per
            GEMM) and W again (the high-precision W is what is saved); not x, whose FP8 copy
            and scale the compiled forward saves (Memory, below).
With FSDP FP8 all-gather (torchao `enable_fsdp_float8_all_gather`, fsdp_utils.py
`WeightWithDynamicFloat8CastTensor`) W is cast on its 1/dp shard before the all-gather and the
gathered FP8 weight serves both forward and backward: the weight passes become one pass over
the shard (ZeRO-3 re-gathers for backward and casts its shard again, 1/dp of W, not counted). This is the fused (torch.compile) traffic; eager torchao issues the abs, amax, scale
and cast as separate elementwise kernels, so a run without compile spends more than this
(torchao's README: compile is needed "for competitive performance").
Compiled a block at a time (torchtitan compiles each TransformerBlock, parallelize_llama.py
`apply_compile`), the linears that read one tensor (a block's q, k and v projections; its gate and
up projections) cast it once: their amax, scale and cast are the same operations on the same
input, which AOTAutograd's common-subexpression elimination merges (torch/_functorch/config.py
`cse`, applied by the min-cut partitioner inductor uses; tests/test_fp8.py checks it on CPU).
`price_fp8_unit(shared_input_casts=True)` prices that: one forward cast per input, told apart by
the op graph's sources and the linear's TP style (`Pins.float8_shared_casts`, set for torchtitan
job files with compile and Float8). The planner's runtime compiles each Float8Linear alone
(runtime/apply_fp8.py), so its plans cast per linear.

All-gather. Under FSDP with FP8 all-gather each converted weight travels as 1 byte per element
instead of bf16's 2 (`FP8_ALL_GATHER_BYTES_FACTOR`), and the gathered (unsharded) weight held
between all-gather and reshard is 1 byte per element too. Under TP with sequence parallelism,
torchtitan applies torchao's `Float8ColwiseParallel` and `PrepareFloat8ModuleInput` (torchtitan
9dec370, parallelize_llama.py `apply_tp`), which cast a sequence-sharded input to FP8 and then
all-gather it: those forward all-gathers move 1 byte per element (`Pins.float8_tp_gather`,
planner/solver/intra_op.py `forward_conversion_s`); their backward reduce-scatters, and the
row-parallel outputs' reduce-scatters, stay bf16. The planner's runtime wraps torchao's
`Float8Linear` in plain `ColwiseParallel`, which gathers bf16.

Memory. Compiled, as the runtime and torchtitan run it, a converted linear keeps for backward
its input in FP8 (1 byte per element) and its weight parameter: torch.compile's partitioner
(`min_cut_rematerialization_partition`) saves the smaller FP8 input rather than the bf16 one the
backward would cast again, and `matmul_with_hp_or_float8_args` keeps the high-precision weight
itself, not the 16-bit copy an eager `F.linear` under autocast keeps (checked on CPU,
tests/test_fp8_memory.py). A profile counts what its units save that way
(`UnitCosts.fp8_saved_bytes`, planner/profiler/measure.py `Float8Saves`) and the cost tables
price a converted unit's activations from it (planner/solver/costs.py). On the H200 GPT 1.3B FP8
run (16 x 1) the predicted peak went from +20% to +6% of the measured one
(benchmarks/analytic_memory_vs_h200.py). What FP8 adds besides is transient: the FP8 operands of
the GEMM running now (`cast_transient_bytes`, the largest over the unit's converted linears and
their three GEMMs), freed when it returns.

MFU conventions. Sources differ: torchtitan divides model FLOP/s by the bf16 peak whatever the
precision (torchtitan/tools/utils.py `get_peak_flops`, "hardcoded BF16 type peak flops"), so
FP8 runs can exceed what bf16 could reach; others quote FP8 runs against the FP8 peak. We give
both; the FP8 one credits each FLOP with the peak of the dtype it runs in (FP8 linears at the FP8
peak, the rest at bf16), so a model whose FLOPs all ran in FP8 gets FLOPs / (time x FP8 peak).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from planner.hardware import FP8_DTYPE, GPUSpec
from planner.profile_schema import OpNode, Profile, Unit

FP8_ALIGNMENT = 16
"""Both weight dims of a converted linear are multiples of this (FP8 tensor core alignment)."""
HIGH_PRECISION_BYTES = 2
"""Bytes per element of the bf16 tensors the casts read."""
FP8_BYTES = 1
"""Bytes per element of an FP8 (E4M3 / E5M2) tensor."""
CAST_PASS_BYTES_PER_ELEMENT = 2 * HIGH_PRECISION_BYTES + FP8_BYTES
"""amax pass (read bf16) + scale-and-cast pass (read bf16, write FP8), per element (module docstring)."""
KERNELS_PER_CAST = 2
"""The amax reduction and the scale-and-cast kernel (fused form)."""
FP8_ALL_GATHER_BYTES_FACTOR = FP8_BYTES / HIGH_PRECISION_BYTES
"""FSDP all-gather bytes of a converted weight relative to bf16 (enable_fsdp_float8_all_gather)."""
BASELINE_DTYPE = "bfloat16"
"""FP8 linears replace bf16 ones: FP8 plans are bf16 mixed-precision plans (planner/plan.py)."""


@dataclass(frozen=True)
class LinearShape:
    """One converted linear at a micro-batch size on one TP rank."""

    name: str
    """The op's name in its unit (its module path relative to the unit)."""
    forward_flops: float
    """FLOPs of this rank's forward GEMM (2 M K N, divided by tp when the linear is sharded)."""
    input_elements: float
    """Elements of this rank's input x (M x K; K / tp for a rowwise linear)."""
    grad_output_elements: float
    """Elements of this rank's grad_output dy (M x N; N / tp for a colwise linear)."""
    weight_elements: float
    """Elements of this rank's weight (N x K, divided by tp when sharded)."""


@dataclass(frozen=True)
class Fp8UnitPrice:
    """What running one unit's eligible linears in FP8 changes, per micro-batch, on one GPU."""

    forward_saved_s: float
    """Forward seconds saved: GEMM saving minus cast overhead (negative when casts cost more)."""
    backward_saved_s: float
    """Backward seconds saved, same convention."""
    forward_gemm_saved_s: float
    """Forward GEMM seconds saved (bf16 rate minus FP8 rate), before casts."""
    backward_gemm_saved_s: float
    """Backward GEMM seconds saved (two GEMMs per linear), before casts."""
    forward_cast_s: float
    """Forward cast overhead: amax + cast passes over x (and W) at HBM bandwidth, plus kernel overheads."""
    backward_cast_s: float
    """Backward cast overhead: dy twice, x (and W) again."""
    converted: tuple[str, ...]
    """Ops converted to FP8 (names in the unit)."""
    skipped: tuple[str, ...]
    """Linear ops left in bf16, each with the reason: `name (why)`."""
    fp8_weight_elements: int
    """Weight elements (whole, before FSDP sharding; per TP rank) of the converted linears: their
    FSDP all-gather bytes and gathered-weight memory are `FP8_ALL_GATHER_BYTES_FACTOR` of bf16's."""
    all_gather_bytes_factor: float
    """FSDP all-gather bytes of a converted weight relative to bf16: 0.5 with FP8 all-gather, else 1."""
    cast_transient_bytes: int
    """Largest FP8 operand bytes alive at once (one GEMM's two FP8 inputs), freed after the GEMM."""


def is_convertible(op: OpNode) -> str | None:
    """None when torchao would convert this op; else why not (module docstring, Which linears)."""
    if op.kind != "linear":
        return "not a linear"
    if op.module is None:
        return "not an nn.Linear module"
    if op.weight_in_out:
        return "weight stored [in, out] (Conv1D), not an nn.Linear"
    if not op.weight_shape or len(op.weight_shape) != 2:
        return "no 2-d weight"
    out_features, in_features = op.weight_shape
    if out_features % FP8_ALIGNMENT or in_features % FP8_ALIGNMENT:
        return f"weight {out_features}x{in_features} not a multiple of {FP8_ALIGNMENT}"
    return None


def _single_linear(unit: Unit) -> bool:
    """The unit is one linear module itself (its only op, module path "")."""
    return len(unit.ops) == 1 and unit.ops[0].kind == "linear" and unit.ops[0].module == ""


def output_head(profile: Profile) -> str | None:
    """The unit torchtitan's `filter_fqns = ["output"]` skips, found by structure: the model's
    last unit when it is one linear module itself, e.g. GPT's `head` or a Hugging Face model's
    `lm_head`; None when the last unit is anything else."""
    last = profile.units[-1]
    return last.name if _single_linear(last) else None


def skipped_units(profile: Profile) -> tuple[str, ...]:
    """The `skip_fqns` that match runtime/apply_fp8.py `skipped_fqns`, as far as a profile shows
    them: the output head, and single-linear units whose weight is tied to another unit's
    (`ModelInfo.tied_parameters`; FSDP's FP8 all-gather would untie it)."""
    head = output_head(profile)
    tied = {name for group in profile.model.tied_parameters for name in group}
    names = ([head] if head else []) + [u.name for u in profile.units if u.name in tied and _single_linear(u)]
    return tuple(dict.fromkeys(names))


def _linear_shape(op: OpNode, unit: Unit, micro_batch_size: float, tp_degree: int, style: str | None) -> LinearShape:
    """`style` is the linear's TP style, or None when no TP plan is known: then the GEMM and the
    weight count as 1/tp and the activations whole (an upper bound on the casts)."""
    scale = micro_batch_size / min(unit.costs)  # ops' shapes and FLOPs are at the smallest profiled size
    out_features, in_features = op.weight_shape or (0, 0)
    tokens = math.prod(op.input_shape[:-1]) * scale
    tp = tp_degree if style in ("colwise", "rowwise", None) else 1
    return LinearShape(
        name=op.name,
        forward_flops=op.forward_flops * scale / tp,
        input_elements=tokens * in_features / (tp if style == "rowwise" else 1),
        grad_output_elements=tokens * out_features / (tp if style == "colwise" else 1),
        weight_elements=out_features * in_features / tp,
    )


def _fqn(unit: Unit, op: OpNode) -> str:
    return ".".join(p for p in (unit.name, op.module or "") if p)


def _why_not_converted(unit: Unit, op: OpNode, skip_fqns: tuple[str, ...]) -> str | None:
    """None when the runtime's filter converts this op of `unit` (`is_convertible`, less `skip_fqns`)."""
    why = is_convertible(op)
    fqn = _fqn(unit, op)
    if why is None and any(fqn == s or fqn.startswith(s + ".") for s in skip_fqns):
        why = "filtered (output head)"
    return why


def converted_ops(unit: Unit, skip_fqns: tuple[str, ...] = ()) -> frozenset[str]:
    """The names of the unit's ops torchao converts (`price_fp8_unit`'s `converted`)."""
    return frozenset(op.name for op in unit.ops if op.kind == "linear" and _why_not_converted(unit, op, skip_fqns) is None)


def _cast_s(elements: float, gpu: GPUSpec) -> float:
    """One dynamic tensorwise cast: amax + scale-and-cast passes, and their kernel overheads."""
    return elements * CAST_PASS_BYTES_PER_ELEMENT / gpu.achievable_bandwidth + KERNELS_PER_CAST * gpu.kernel_overhead_s


def price_fp8_unit(unit: Unit, micro_batch_size: float, gpu: GPUSpec, tp_degree: int = 1,
                   fsdp_float8_all_gather_degree: int = 1, skip_fqns: tuple[str, ...] = (),
                   tp_plan: Mapping[str, str] | None = None, shared_input_casts: bool = False) -> Fp8UnitPrice:
    """The seconds FP8 saves on `unit` per micro-batch of `micro_batch_size`, on one GPU of a
    TP group of `tp_degree` (module docstring has the formulas).

    fsdp_float8_all_gather_degree: the dp degree when FSDP all-gathers weights in FP8 (zero
    stage >= 1 and dp > 1), else 1: the weight casts then run once on the 1/dp shard, before
    the all-gather, instead of in forward and backward. skip_fqns: unit-qualified FQNs left in
    bf16 (`output_head`'s unit; a module whose FQN equals one or starts with it plus "."). tp_plan:
    the stage's FQN -> TP style (planner/plan.py `Stage.tp_plan`); without it every linear's GEMM
    and weight count as 1/tp and its activations whole (an upper bound on the casts).
    shared_input_casts: linears reading one input (the same op-graph sources, the same TP style)
    cast it once in forward, as a block compiled whole does (module docstring, Casts).
    Raises PlannerError for a GPU without FP8 (planner/hardware.py)."""
    bf16_rate, fp8_rate = gpu.achievable_flops(BASELINE_DTYPE), gpu.achievable_flops(FP8_DTYPE)
    shapes, skipped, inputs = [], [], []
    for op in unit.ops:
        if op.kind != "linear":
            continue
        fqn = _fqn(unit, op)
        why = _why_not_converted(unit, op, skip_fqns)
        if why is not None:
            skipped.append(f"{op.name} ({why})")
            continue
        style = tp_plan.get(fqn) if tp_plan is not None else None
        if tp_plan is not None and style is None:
            style = "replicate"
        shapes.append(_linear_shape(op, unit, micro_batch_size, tp_degree, style))
        inputs.append((tuple(op.inputs), style))
    gather = fsdp_float8_all_gather_degree > 1
    fwd_gemm = sum(s.forward_flops for s in shapes) * (1 / bf16_rate - 1 / fp8_rate)
    fwd_cast = bwd_cast = 0.0
    transient = 0.0
    cast_inputs: set[tuple] = set()
    for s, source in zip(shapes, inputs, strict=True):
        x, dy, w = s.input_elements, s.grad_output_elements, s.weight_elements
        if not (shared_input_casts and source in cast_inputs):
            fwd_cast += _cast_s(x, gpu)
        cast_inputs.add(source)
        fwd_cast += _cast_s(w / fsdp_float8_all_gather_degree if gather else w, gpu)
        bwd_cast += 2 * _cast_s(dy, gpu) + (0.0 if gather else _cast_s(w, gpu))
        # The two FP8 operands of each GEMM: y = x W^T, dx = dy W, dW = dy^T x.
        transient = max(transient, (x + w) * FP8_BYTES, (dy + w) * FP8_BYTES, (dy + x) * FP8_BYTES)
    bwd_gemm = 2 * fwd_gemm
    return Fp8UnitPrice(
        forward_saved_s=fwd_gemm - fwd_cast,
        backward_saved_s=bwd_gemm - bwd_cast,
        forward_gemm_saved_s=fwd_gemm,
        backward_gemm_saved_s=bwd_gemm,
        forward_cast_s=fwd_cast,
        backward_cast_s=bwd_cast,
        converted=tuple(s.name for s in shapes),
        skipped=tuple(skipped),
        fp8_weight_elements=int(sum(s.weight_elements for s in shapes)),
        all_gather_bytes_factor=FP8_ALL_GATHER_BYTES_FACTOR if gather else 1.0,
        cast_transient_bytes=int(transient),
    )


def fp8_coverage_note(profile: Profile, gpu: GPUSpec, micro_batch_size: float, tp_degree: int = 1,
                      tp_plans: list[Mapping[str, str]] | None = None, shared_input_casts: bool = False) -> str:
    """An FP8 plan's note on what FP8 reaches: the linears converted and their share of the model's
    forward FLOPs (the rest, attention, experts that are not `nn.Linear` modules and the linears
    the filter keeps, stays bf16, each kept linear's reason counted), and, where the casts cost
    more than the FP8 GEMMs save over the model's linears at the plan's micro-batch and TP degree,
    that FP8 slows it down. `tp_plans`: per unit, the module -> TP style of the plan's stage;
    `shared_input_casts` as `price_fp8_unit` takes it (the stack's, `Pins.float8_shared_casts`)."""
    from collections import Counter

    skip = skipped_units(profile)
    converted = total = 0
    fp8_flops = all_flops = saved_s = 0.0
    kept: Counter[str] = Counter()
    for k, unit in enumerate(profile.units):
        all_flops += sum(op.forward_flops for op in unit.ops)
        names = converted_ops(unit, skip)
        for op in unit.ops:
            if op.kind != "linear":
                continue
            total += 1
            if op.name in names:
                converted += 1
                fp8_flops += op.forward_flops
            else:
                why = _why_not_converted(unit, op, skip) or ""
                kept[f"dims not a multiple of {FP8_ALIGNMENT}" if "not a multiple" in why else why] += 1
        if names:
            plan = tp_plans[k] if tp_plans is not None and tp_degree > 1 else None
            styles = {f"{unit.name}.{m}" if m else unit.name: v for m, v in plan.items()} if plan is not None else None
            price = price_fp8_unit(unit, micro_batch_size, gpu, tp_degree, skip_fqns=skip, tp_plan=styles,
                                   shared_input_casts=shared_input_casts)
            saved_s += price.forward_saved_s + price.backward_saved_s
    share = fp8_flops / all_flops if all_flops else 0.0
    note = (f"FP8: {converted} of {total} linears converted (torchao Float8Linear), {share:.0%} of the model's forward "
            f"FLOPs; the rest runs in bf16")
    if kept:
        note += " (linears kept: " + ", ".join(f"{why} x{n}" for why, n in kept.most_common()) + ")"
    if saved_s < 0:
        note += (f". Here the casts cost more than the FP8 GEMMs save ({-saved_s * 1e3:.3g} ms more per micro-batch over "
                 "the model): solve without --fp8")
    return note + "."


def matmul_time_s(flops: float, gpu: GPUSpec, dtype: str) -> float:
    """GEMM seconds for `flops` at the GPU's achievable rate in `dtype` (`float8` for FP8)."""
    return flops / gpu.achievable_flops(dtype)


@dataclass(frozen=True)
class MfuConventions:
    """Model FLOPs utilisation of one run under the two conventions in use (module docstring)."""

    bf16: float
    """Model FLOPs / (time x bf16 dense peak): torchtitan's convention, comparable with bf16 runs."""
    fp8: float
    """Model FLOPs credited at the peak of the dtype they run in: FP8 FLOPs at the FP8 peak, the rest at bf16's."""


def mfu_conventions(model_flops: float, fp8_flops: float, time_s: float, gpu: GPUSpec) -> MfuConventions:
    """MFU of `model_flops` done in `time_s` on one GPU, `fp8_flops` of them in FP8 linears."""
    if time_s <= 0 or not 0 <= fp8_flops <= model_flops:
        raise ValueError(f"need time_s > 0 and 0 <= fp8_flops <= model_flops (got {time_s}, {fp8_flops}, {model_flops})")
    bf16_peak = gpu.peak_flops[BASELINE_DTYPE]
    ideal_s = fp8_flops / gpu.fp8_peak_flops() + (model_flops - fp8_flops) / bf16_peak
    return MfuConventions(bf16=model_flops / (time_s * bf16_peak), fp8=ideal_s / time_s)
