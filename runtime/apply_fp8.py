"""FP8 linears: torchao Float8 training (tensorwise dynamic scaling) when the plan asks for it.

`apply_float8(module, plan, device)` swaps the eligible `nn.Linear`s of a model (or of a
pipeline stage cut from it, which keeps the model's FQNs) for torchao's `Float8Linear`
(`torchao.float8.convert_to_float8_training`). Eligible is torchtitan's filter
(torchtitan/components/quantization/utils.py `module_filter_fn`): an `nn.Linear` whose weight
dims are both multiples of 16, minus the filtered FQNs; as torchtitan's Llama 3 configs filter
`output` (its vocabulary head), we filter the model's last unit when it is a linear itself
(planner/cost/fp8.py `output_head` finds the same unit in a profile, so the planner prices the
linears this converts). A linear whose weight is tied to another module's (GPT-2's head and
embedding) is left alone too: FSDP's FP8 all-gather wraps the weight in a new parameter, which
would untie it.

Order (runtime/train.py): after materialising, before TP, recomputation and FSDP, as torchtitan
converts its model before `parallelize` (torchtitan/train.py: the model converters run, then
the parallelize function). Each later step needs the swap done:
- TP: `ColwiseParallel` / `RowwiseParallel` then shard the `Float8Linear`'s weight as a DTensor,
  and torchao's casts take the amax over the DTensor (a reduction over the TP group), so every
  rank scales by the whole tensor's amax, as one process would;
- FSDP2 FP8 all-gather: the weight must already be torchao's `WeightWithDynamicFloat8CastTensor`
  when `fully_shard` runs, because FSDP2 calls that subclass's `fsdp_pre_all_gather` (cast the
  1/dp shard to FP8) and `fsdp_post_all_gather` hooks; a plain weight would be gathered in
  high precision;
- recomputation wraps the converted modules, so a recomputed forward replays the casts.
It comes after materialising because `Float8Linear.from_float` keeps the module's parameter
objects, so the initial values are the reference's, set by FQN (runtime/build.py).

FSDP FP8 all-gather is on when the plan shards with FSDP (zero_stage >= 1, dp_degree > 1); it
needs tensorwise scaling, torchao's default recipe (torchao/float8/config.py). The weight's amax
is all-reduced over dp before the cast, so the gathered FP8 weight is the one a single process
would make. torchao's optional `precompute_float8_dynamic_scale_for_fsdp` (one all-reduce for
all weights' amaxes after each optimizer step, instead of one per weight) is not used yet.

Numerics. Dynamic scaling takes an activation's amax over the tensor on the rank, so under data
parallelism each replica scales its own slice of the batch: an FP8 run is not bit-equal to one
process on the whole global batch, only to one process on each replica's slice (what
tests/test_fp8.py checks); TP scales by the whole tensor (DTensor amax). The one-process
reference run (`--reference`) stays bf16.

Speed. In eager mode each converted linear adds separate kernels for the amax reductions and
the casts of its input, weight and output gradient: on an H200 a GPT 1.3B step took 1.29 s with
eager FP8 linears against 0.65 s in bf16 (benchmarks/results/h200/README.md). torchao and
torchtitan run Float8 training under `torch.compile`, which fuses the casts with their amaxes;
on CUDA every converted linear is compiled here in place (`nn.Module.compile`; the linears share
compiled graphs by input shape). Compilation happens in the first steps, which the run's
median step time leaves out.

Devices. FP8 GEMMs (`torch._scaled_mm`) need CUDA with compute capability 8.9 or newer (Ada,
Hopper and later), as torchtitan's converter checks (`has_cuda_capability(8, 9)`).
`check_float8_device` refuses anything else; `planner run` calls it before launch
(runtime/launch.py `precheck`). `emulate=True` (torchao's `Float8LinearConfig(emulate=True)`:
the same casts and scales, the GEMM done in high precision on the dequantised FP8 values) runs
the FP8 numerics on CPU; it is an internal switch for tests, not a plan field or a CLI flag.
"""

from __future__ import annotations

from collections import Counter
from functools import partial

import torch
from torch import nn

from planner.errors import PlannerError
from planner.plan import Plan

FP8_ALIGNMENT = 16
"""Both weight dims of a converted linear are multiples of this (planner/cost/fp8.py)."""
MIN_CAPABILITY = (8, 9)
"""CUDA compute capability of the first GPUs with FP8 tensor cores (Ada, Hopper)."""
_FIX = "Run a bfloat16 plan here (set training.float8 to false, or re-solve without FP8), or run this plan on H100/H200-class GPUs."


def check_float8_device(plan: Plan, device: torch.device | None = None) -> None:
    """Refuse an FP8 plan on a device that cannot run FP8 GEMMs (module docstring, Devices).
    `device`: where the ranks will run; None means this machine's first CUDA device, if any."""
    if not plan.training.float8:
        return
    if (device is not None and device.type != "cuda") or not torch.cuda.is_available():
        raise PlannerError("This plan trains its linears in FP8 (training.float8), which needs a CUDA GPU of compute "
                           f"capability {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} or newer; there is none here.", _FIX)
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_CAPABILITY:
        raise PlannerError(f"This plan trains its linears in FP8 (training.float8), but {torch.cuda.get_device_name(device)} "
                           f"has compute capability {capability[0]}.{capability[1]}; FP8 GEMMs need "
                           f"{MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} or newer.", _FIX)
    _torchao_float8()


def _torchao_float8():
    try:
        import torchao.float8 as float8
    except ImportError as exc:
        raise PlannerError(f"This plan trains its linears in FP8, which needs torchao ({exc}).",
                           "pip install 'torchao>=0.18', or run a bfloat16 plan.") from exc
    return float8


def skipped_fqns(module: nn.Module, plan: Plan) -> tuple[str, ...]:
    """FQNs left in bf16 by name: the output head (the last unit, when it is one linear) and
    linears whose weight is tied to another module's (module docstring)."""
    head = plan.stages[-1].units[-1]
    held = dict(module.named_modules())
    skip = [head] if head not in held or (isinstance(held[head], nn.Linear) and not list(held[head].children())) else []
    owners = Counter(id(p) for _, p in module.named_parameters(remove_duplicate=False))
    skip += [name for name, m in held.items()
             if isinstance(m, nn.Linear) and owners[id(m.weight)] > 1 and name not in skip]
    return tuple(skip)


def float8_filter(module: nn.Module, fqn: str, skip: tuple[str, ...]) -> bool:
    """torchtitan's `module_filter_fn`: an nn.Linear with both weight dims multiples of 16, not
    skipped. A skip entry matches its module and everything under it (torchtitan matches
    substrings; a whole-name match cannot catch `attn.heads` with `head`)."""
    if not isinstance(module, nn.Linear):
        return False
    out_features, in_features = module.weight.shape
    if out_features % FP8_ALIGNMENT or in_features % FP8_ALIGNMENT:
        return False
    return not any(fqn == s or fqn.startswith(s + ".") for s in skip)


def float8_config(plan: Plan, emulate: bool = False):
    """torchao's tensorwise dynamic recipe, with FSDP FP8 all-gather where FSDP shards."""
    float8 = _torchao_float8()
    gather = plan.layout.zero_stage >= 1 and plan.layout.dp_degree > 1
    return float8.Float8LinearConfig(enable_fsdp_float8_all_gather=gather, emulate=emulate)


def apply_float8(module: nn.Module, plan: Plan, device: torch.device, emulate: bool = False) -> list[str]:
    """Convert `module`'s eligible linears in place when the plan asks for FP8; returns their
    FQNs (empty for a bf16 plan). `emulate` is for tests on CPU (module docstring)."""
    if not plan.training.float8:
        return []
    if not emulate:
        check_float8_device(plan, device)
    float8 = _torchao_float8()
    float8.convert_to_float8_training(module, module_filter_fn=partial(float8_filter, skip=skipped_fqns(module, plan)),
                                      config=float8_config(plan, emulate))
    converted = [(name, m) for name, m in module.named_modules() if isinstance(m, float8.float8_linear.Float8Linear)]
    if device.type == "cuda":
        for _, linear in converted:
            linear.compile()  # the casts and amaxes fused (module docstring, "Speed")
    return [name for name, _ in converted]
