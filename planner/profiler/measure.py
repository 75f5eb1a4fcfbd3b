"""Costs of one unit at one micro-batch size, measured or analytic.

Each unit is run alone on the inputs it received in a full forward pass (captured by
`planner.units.trace_units`), as a pipeline stage would run it: floating inputs require
grad, so backward computes input gradients too (every stage but the first must send them).

A *counting* pass runs once under the counters (FLOPs, memory traffic, saved bytes, and in
analytic mode the roofline time); timing runs without them, so the counters' Python overhead
never enters a measured time. On CUDA each phase is bracketed by CUDA events and synchronised.

Timing goes round-robin (`time_round_robin`): every pass runs every unit at every size, and
the whole model, once; each keeps the trimmed mean (`typical_s`) over the passes after warm-up. Timing one unit's
repeats back to back would let a burst of load from elsewhere (a second or so on a shared
machine) inflate a few units' every sample and leave the rest alone; spread over passes, a
burst costs each unit at most a sample or two. A unit also runs after the others, as in a
forward pass, not with its own weights still in cache from its previous repeat.

Why a trimmed mean and not the median: a training step is a sum of many unit times, so it
tracks their means, and timing noise is skewed to the right (on the 2-core VM these
benchmarks ran on, a small unit's median was 3-9% below its mean); trimming a tenth of the
samples at each end keeps a one-off spike (25x a unit's time was seen) from deciding a figure.
"""

from __future__ import annotations

import time
import warnings
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

from planner.cost.fp8 import FP8_ALIGNMENT
from planner.hardware import GPUSpec
from planner.profile_schema import UnitCosts
from planner.profiler.counters import (
    LiveBytes,
    MetaAttentionMode,
    OpCostMode,
    SavedBytes,
    flop_counter,
    tensor_bytes,
    tensors_in,
)
from planner.units import copy_state


def _fresh_inputs(args, kwargs, every_float: bool = False):
    """Detached copies of the captured inputs; those that required grad in the model's own
    forward require grad (hidden states do; Hugging Face's rotary cos and sin, made under
    no_grad from buffers, and the batch do not), or with `every_float` every floating one, as a
    pipeline stage's first unit receives them (runtime/pp_p2p.py and torch's PipelineStage mark
    each received floating tensor so).

    A floating input is a clone (of a leaf that requires grad, where it does), not the leaf
    itself: inside the model every activation is the output of an op, and a unit may modify its input in place
    (torchvision's ResNet cuts a unit `relu = nn.ReLU(inplace=True)` out of its stem), which
    autograd refuses on a leaf. The clone also keeps the captured inputs unchanged from one
    run to the next, as a fresh copy of an object the forward updates does (a key/value cache:
    planner/units.py `copy_state`). It is made here, outside the counters and the timers."""

    def fresh(x):
        if isinstance(x, torch.Tensor):
            wanted = x.is_floating_point() and (every_float or x.requires_grad)
            x = x.detach()
            if x.is_floating_point():
                x = (x.requires_grad_(True) if wanted else x).clone()
            return x
        return copy_state(x)

    return tree_map(fresh, (args, kwargs))


def _all_floats_need_grad(args, kwargs) -> bool:
    """Whether every floating input already required grad in the model (then a stage's first
    unit saves what the unit does inside a stage)."""
    return all(t.requires_grad for t in tree_flatten((args, kwargs))[0]
               if isinstance(t, torch.Tensor) and t.is_floating_point())


def _grad_targets(output):
    """Outputs that need a gradient, each paired with a gradient of ones."""
    outs = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
    return outs, [torch.ones_like(t) for t in outs]


class _Timer:
    """Wall time on CPU; CUDA events with synchronisation on GPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def time(self, fn):
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            result = fn()
            end.record()
            torch.cuda.synchronize()
            return result, start.elapsed_time(end) / 1e3
        begin = time.perf_counter()
        result = fn()
        return result, time.perf_counter() - begin


def typical_s(samples: list[float], trim: float = 0.1) -> float:
    """Mean of the samples without the `trim` share (at least one, from five samples on) at each end."""
    ordered = sorted(samples)
    k = max(int(trim * len(ordered)), 1) if len(ordered) >= 5 else 0
    kept = ordered[k:len(ordered) - k]
    return sum(kept) / len(kept)


class _Float8Saved(torch.autograd.Function):
    """A linear that keeps for backward what torchao's Float8Linear keeps under torch.compile:
    its input cast to FP8 (1 byte per element) and its weight parameter itself. Checked on CPU
    (tests/test_fp8_memory.py): with the partitioner torch.compile uses
    (`min_cut_rematerialization_partition`), a compiled Float8Linear (tensorwise scaling) saves
    the FP8 input, its scale and the fp32 weight, where an eager `F.linear` under autocast saves
    a 16-bit copy of the input and of the weight. Forward only: it exists to be counted."""

    @staticmethod
    def forward(ctx, input, weight, bias):
        ctx.save_for_backward(input.to(torch.float8_e4m3fn), weight)
        return F.linear(input, weight, bias)

    @staticmethod
    def backward(ctx, *grads):
        raise NotImplementedError("counts saved bytes only (planner/profiler/measure.py `Float8Saves`)")


class Float8Saves(TorchFunctionMode):
    """Runs every `F.linear` of an nn.Parameter weight torchao would convert (2-d, both dims
    multiples of 16) as `_Float8Saved`, so that a forward's saved tensors are those of the FP8
    plan the runtime compiles (runtime/apply_fp8.py). Enter it inside the precision context:
    the linear's own compute still sees autocast."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear and len(args) >= 2 and isinstance(args[1], nn.Parameter) and _converts(args[1]):
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            return _Float8Saved.apply(args[0], args[1], bias)
        return func(*args, **kwargs)


def _converts(weight: torch.Tensor) -> bool:
    """A weight torchao's converter takes: 2-d, both dims multiples of FP8_ALIGNMENT (planner/cost/fp8.py `is_convertible`)."""
    return weight.dim() == 2 and not weight.shape[0] % FP8_ALIGNMENT and not weight.shape[1] % FP8_ALIGNMENT


def has_fp8_linears(module: nn.Module) -> bool:
    """Whether `Float8Saves` would change anything in `module`: an nn.Linear torchao converts."""
    return any(isinstance(m, nn.Linear) and _converts(m.weight) for m in module.modules())


def unit_costs(
    module: nn.Module,
    args: tuple,
    kwargs: dict,
    *,
    analytic_gpu: GPUSpec | None,
    dtype: str,
    fusion: str = "none",
    precision=nullcontext,
    loss=None,
    fp8: bool = True,
) -> UnitCosts:
    """Count one unit's forward and backward; analytic mode also prices them on `analytic_gpu`.
    Measured times start at zero and come from `time_round_robin` over a `UnitJob`.
    `precision`: a context factory entered around the forward (autocast, `mixed_precision`).
    `loss`: for the last unit, a function of its output giving the training loss; its forward and
    backward are counted with the unit's (time, FLOPs, traffic; backward starts from the loss),
    its saved tensors are not (the memory model prices the loss's own: planner/cost/memory.py
    `loss_bytes`). `fp8`: when the unit has linears torchao converts, one more forward counts what
    it saves with them in FP8 (`Float8Saves`, `UnitCosts.fp8_saved_bytes`). The backward runs
    under `LiveBytes`, whose peak is the unit's backward working set (`UnitCosts.backward_working_bytes`)."""
    params = list(module.parameters())
    meta = analytic_gpu is not None
    attention_mode = MetaAttentionMode(gpu_kernels=analytic_gpu.name != "cpu") if analytic_gpu is not None else nullcontext()

    a, kw = _fresh_inputs(args, kwargs)
    fwd_ops, fwd_flops = OpCostMode(analytic_gpu, dtype, fusion), flop_counter()
    working = LiveBytes(exclude=params)  # the backward's working set; the saved tensors' releases count

    def note_saved(t: torch.Tensor) -> None:
        fwd_ops.note_saved(t)
        working.watch(t)

    saved = SavedBytes(exclude=params, on_save=note_saved)
    with attention_mode, fwd_flops, fwd_ops, precision():
        with saved.hooks():
            out = module(*a, **kw)
        with SavedBytes(on_save=fwd_ops.note_saved).hooks():  # noted for fusion, not counted as the unit's
            value = loss(out) if loss is not None else None
    saved_inputs, saved_outputs = saved.bytes_of(tensors_in((a, kw))), saved.bytes_of(tensors_in(out))
    outs, grads = ([value], [None]) if value is not None else _grad_targets(out)
    bwd_ops, bwd_flops = OpCostMode(analytic_gpu, dtype, fusion), flop_counter()
    if outs:
        with bwd_flops, bwd_ops, working:
            torch.autograd.backward(outs, grads)
    # With the gradients already held (a later micro-batch), the backward adds into them: its
    # working set is then the rest (accumulation's temporary is the memory model's own term).
    working_held = working.peak_without([p.grad for p in params if p.grad is not None])
    for p in params:
        p.grad = None

    def saved_by_a_forward(inputs, mode=nullcontext()) -> int:
        """What one more forward on `inputs` keeps, under `mode`: counted, never run backward."""
        a, kw = inputs
        counted = SavedBytes(exclude=params, keep=False)
        with attention_mode, precision(), mode, counted.hooks():
            module(*a, **kw)
        counted.release()
        return counted.bytes

    # As a stage's first unit, every received floating input requires grad.
    stage_start_saved = None if _all_floats_need_grad(args, kwargs) else \
        saved_by_a_forward(_fresh_inputs(args, kwargs, every_float=True))
    fp8_saved = saved_by_a_forward(_fresh_inputs(args, kwargs), Float8Saves()) \
        if fp8 and has_fp8_linears(module) else None
    return UnitCosts(
        forward_time_s=fwd_ops.totals.roofline_time_s if meta else 0.0,
        backward_time_s=bwd_ops.totals.roofline_time_s if meta else 0.0,
        forward_flops=fwd_flops.get_total_flops(),
        backward_flops=bwd_flops.get_total_flops(),
        forward_memory_traffic_bytes=fwd_ops.totals.traffic_bytes,
        backward_memory_traffic_bytes=bwd_ops.totals.traffic_bytes,
        input_bytes=tensor_bytes((args, kwargs)),
        output_bytes=tensor_bytes(out),
        saved_bytes=saved.bytes,
        saved_input_bytes=saved_inputs,
        saved_output_bytes=saved_outputs,
        fp8_saved_bytes=fp8_saved,
        stage_start_saved_bytes=stage_start_saved,
        backward_working_bytes=max(working.peak, 0),
        backward_working_held_bytes=max(working_held, 0),
        forward_attention_flops=fwd_ops.totals.attention_flops,
        backward_attention_flops=bwd_ops.totals.attention_flops,
        forward_causal_attention_flops=fwd_ops.totals.causal_attention_flops,
        backward_causal_attention_flops=bwd_ops.totals.causal_attention_flops,
        forward_convolution_flops=fwd_ops.totals.convolution_flops,
        backward_convolution_flops=bwd_ops.totals.convolution_flops,
    )


class UnitJob:
    """One unit at one micro-batch size: forward then backward on fresh copies of its inputs.
    Keeps every forward and backward time, and CUDA's peak memory of its first timed run.
    `precision` is entered around each forward, as the runtime enters autocast around each
    micro-batch's (autocast's cache of weights cast to 16 bits lasts one such region).

    Where some input takes a gradient, each run then does a second forward and its backward
    split as zero bubble splits it on a stage after the first: torch's `stage_backward_input` (B),
    then `stage_backward_weight` (W) with the graph retained, as runtime/apply_pp.py calls them.
    Their times are kept apart (`UnitCosts.backward_input_time_s`, `backward_weight_time_s`): the
    split is not free, and how dear it is depends on the device and the unit's graph."""

    def __init__(self, module: nn.Module, args: tuple, kwargs: dict, precision=nullcontext):
        self.module, self.args, self.kwargs, self.precision = module, args, kwargs, precision
        self.params = list(module.parameters())
        device = next((p.device for p in self.params), None) or next(
            (t.device for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)), torch.device("cpu"))
        self.timer, self.cuda = _Timer(device), device.type == "cuda"
        self.forward_s: list[float] = []
        self.backward_s: list[float] = []
        self.backward_input_s: list[float] = []
        self.backward_weight_s: list[float] = []
        self.split_error: str | None = None
        """Why the split run failed, where it did (the profile's notes say so)."""
        self.splits = any(t.is_floating_point() and t.requires_grad for t in tree_flatten((args, kwargs))[0]
                          if isinstance(t, torch.Tensor))
        self.peak_memory_bytes: int | None = None
        """CUDA only: peak allocated bytes above the baseline during the first kept run."""

    def run(self, keep: bool) -> None:
        for p in self.params:
            p.grad = None
        a, kw = _fresh_inputs(self.args, self.kwargs)
        first = keep and not self.forward_s
        if self.cuda and first:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            baseline = torch.cuda.memory_allocated()
        out, fwd_s = self.timer.time(lambda: self._forward(a, kw))
        outs, grads = _grad_targets(out)
        _, bwd_s = self.timer.time(lambda: torch.autograd.backward(outs, grads) if outs else None)
        if self.cuda and first:
            self.peak_memory_bytes = torch.cuda.max_memory_allocated() - baseline
        out = outs = grads = None  # release the graph before the next run
        for p in self.params:
            p.grad = None
        if keep:
            self.forward_s.append(fwd_s)
            self.backward_s.append(bwd_s)
        if self.splits:
            try:
                self._run_split(keep)
            except Exception as exc:  # noqa: BLE001 (a note in the profile; the split is then priced as free)
                self.splits, self.backward_input_s, self.backward_weight_s = False, [], []
                self.split_error = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"

    def _run_split(self, keep: bool) -> None:
        """One forward, then its backward as B and W apart (the class docstring)."""
        from torch.distributed.pipelining import stage as torch_stage  # the functions the runtime's stages call

        a, kw = _fresh_inputs(self.args, self.kwargs)
        inputs = [t for t in tree_flatten((a, kw))[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        outs, grads = _grad_targets(self._forward(a, kw))
        if not outs:
            return
        # As runtime/pp_split.py `_sendable` hands a zero-bubble stage's outputs to torch: copies,
        # which B then detaches in place.
        outs = [t.clone(memory_format=torch.contiguous_format) for t in outs]
        with warnings.catch_warnings():  # B sets .grad on the inputs, here clones (`_fresh_inputs`), as torch's stage does
            warnings.filterwarnings("ignore", message="The .grad attribute of a Tensor that is not a leaf")
            (_, groups), input_s = self.timer.time(
                lambda: torch_stage.stage_backward_input(outs, grads, inputs, iter(self.params)))
        _, weight_s = self.timer.time(lambda: torch_stage.stage_backward_weight(iter(self.params), groups, retain_graph=True))
        outs = grads = groups = None
        for p in self.params:
            p.grad = None
        if keep:
            self.backward_input_s.append(input_s)
            self.backward_weight_s.append(weight_s)

    def split_backward(self) -> tuple[float, float] | tuple[None, None]:
        """Typical (B, W) seconds; None where the unit was not run split."""
        if not self.backward_input_s:
            return None, None
        return typical_s(self.backward_input_s), typical_s(self.backward_weight_s)

    def _forward(self, args, kwargs):
        with self.precision():
            return self.module(*args, **kwargs)

    def typical(self) -> tuple[float, float]:
        return typical_s(self.forward_s), typical_s(self.backward_s)


class TimedCall:
    """A call timed as a whole (the whole model's forward + loss + backward, an optimizer step),
    with `reset` before and after each run (e.g. dropping the gradients it made)."""

    def __init__(self, fn, device: torch.device, reset=lambda: None):
        self.fn, self.reset, self.timer = fn, reset, _Timer(device)
        self.seconds: list[float] = []

    def run(self, keep: bool) -> None:
        self.reset()
        _, seconds = self.timer.time(self.fn)
        self.reset()
        if keep:
            self.seconds.append(seconds)

    def typical(self) -> float:
        return typical_s(self.seconds)


def fp32_logits(output):
    """The model output as the loss sees it, in the profile as in the runtime (runtime/train.py):
    16-bit logits in fp32, a tensor or a model output object's (Hugging Face's) `logits`."""
    if isinstance(output, torch.Tensor):
        return output.float() if output.is_floating_point() else output
    logits = getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor) and logits.is_floating_point() and logits.dtype != torch.float32:
        output.logits = logits.float()
    return output


def whole_model_job(model: nn.Module, inputs: tuple, targets, loss, precision=nullcontext) -> TimedCall:
    """Forward + loss + backward of the whole model on one batch, the forward and the loss under
    `precision` with 16-bit logits taken to fp32 first, as runtime/train.py runs a micro-batch."""

    def step():
        with precision():
            loss(fp32_logits(model(*inputs)), targets).backward()

    return TimedCall(step, next(model.parameters()).device, reset=lambda: model.zero_grad(set_to_none=True))


def time_round_robin(jobs: list, warmup: int, repeats: int, progress=None) -> None:
    """`warmup` then `repeats` passes, each running every job once (see the module docstring)."""
    for i in range(warmup + repeats):
        for job in jobs:
            job.run(keep=i >= warmup)
        if progress:
            progress(i + 1, warmup + repeats)


def optimizer_step_time(model: nn.Module, warmup: int = 2, repeats: int = 5) -> float:
    """Time (`typical_s`) of one AdamW step over all of `model`'s parameters, as the runtime takes it.

    The runtime keeps fp32 master weights whatever the compute dtype (autocast), so the step
    runs on fp32 copies of the parameters with random gradients, on their device, with
    torch's default implementation for that device (foreach on CUDA, a per-tensor loop on
    CPU: per-tensor overhead included, which is what makes a CPU step slower than its bytes).
    """
    params = [torch.nn.Parameter(p.detach().float().clone()) for p in model.parameters() if p.requires_grad]
    if not params:
        return 0.0
    for p in params:
        p.grad = torch.randn_like(p)
    step = TimedCall(torch.optim.AdamW(params).step, params[0].device)
    time_round_robin([step], warmup, repeats)
    return step.typical()
