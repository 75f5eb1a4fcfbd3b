"""Costs of one unit at one micro-batch size, measured or analytic.

Each unit is run alone on the inputs it received in a full forward pass (captured by
`planner.units.trace_units`), as a pipeline stage would run it: floating inputs require
grad, so backward computes input gradients too (every stage but the first must send them).

A *counting* pass runs once under the counters (FLOPs, memory traffic, saved bytes, and in
analytic mode the roofline time); a separate *timing* pass runs without them, so the
counters' Python overhead never enters a measured time. Timing is warm-up then the median
of repeats; on CUDA each phase is bracketed by CUDA events and synchronised.
"""

from __future__ import annotations

import statistics
import time
from contextlib import nullcontext

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from planner.hardware import GPUSpec
from planner.profile_schema import UnitCosts
from planner.profiler.counters import MetaAttentionMode, OpCostMode, SavedBytes, flop_counter


def _fresh_inputs(args, kwargs):
    """Detached copies of the captured inputs; floating ones require grad."""

    def fresh(x):
        if isinstance(x, torch.Tensor):
            x = x.detach()
            if x.is_floating_point():
                x.requires_grad_(True)
        return x

    return tree_map(fresh, (args, kwargs))


def _grad_targets(output):
    """Outputs that need a gradient, each paired with a gradient of ones."""
    outs = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
    return outs, [torch.ones_like(t) for t in outs]


def _nbytes(obj) -> int:
    return sum(t.numel() * t.element_size() for t in tree_flatten(obj)[0] if isinstance(t, torch.Tensor))


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


def unit_costs(
    module: nn.Module,
    args: tuple,
    kwargs: dict,
    *,
    analytic_gpu: GPUSpec | None,
    dtype: str,
    warmup: int = 2,
    repeats: int = 5,
    fusion: str = "none",
) -> UnitCosts:
    """Count and (unless analytic) time one unit's forward and backward."""
    params = list(module.parameters())
    meta = analytic_gpu is not None
    attention_mode = MetaAttentionMode() if meta else nullcontext()

    a, kw = _fresh_inputs(args, kwargs)
    fwd_ops, fwd_flops = OpCostMode(analytic_gpu, dtype, fusion), flop_counter()
    saved = SavedBytes(exclude=params, on_save=fwd_ops.note_saved)
    with attention_mode, saved.hooks(), fwd_flops, fwd_ops:
        out = module(*a, **kw)
    outs, grads = _grad_targets(out)
    bwd_ops, bwd_flops = OpCostMode(analytic_gpu, dtype, fusion), flop_counter()
    if outs:
        with bwd_flops, bwd_ops:
            torch.autograd.backward(outs, grads)
    counts = dict(
        forward_flops=fwd_flops.get_total_flops(),
        backward_flops=bwd_flops.get_total_flops(),
        forward_memory_traffic_bytes=fwd_ops.totals.traffic_bytes,
        backward_memory_traffic_bytes=bwd_ops.totals.traffic_bytes,
        input_bytes=_nbytes((args, kwargs)),
        output_bytes=_nbytes(out),
        saved_bytes=saved.bytes,
    )
    del out, outs, grads
    if meta:
        return UnitCosts(
            forward_time_s=fwd_ops.totals.roofline_time_s,
            backward_time_s=bwd_ops.totals.roofline_time_s,
            **counts,
        )
    forward_s, backward_s, peak = _time_unit(module, args, kwargs, params, warmup, repeats)
    return UnitCosts(forward_time_s=forward_s, backward_time_s=backward_s, peak_memory_bytes=peak, **counts)


def _time_unit(module, args, kwargs, params, warmup: int, repeats: int):
    device = next((p.device for p in params), None) or next(
        (t.device for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)), torch.device("cpu")
    )
    timer = _Timer(device)
    cuda = device.type == "cuda"
    forward_times, backward_times, peak = [], [], None
    for i in range(warmup + repeats):
        for p in params:
            p.grad = None
        a, kw = _fresh_inputs(args, kwargs)
        if cuda and i == warmup:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            baseline = torch.cuda.memory_allocated()
        out, fwd_s = timer.time(lambda: module(*a, **kw))
        outs, grads = _grad_targets(out)
        _, bwd_s = timer.time(lambda: torch.autograd.backward(outs, grads) if outs else None)
        if cuda and i == warmup:
            peak = torch.cuda.max_memory_allocated() - baseline
        del out, outs, grads
        if i >= warmup:
            forward_times.append(fwd_s)
            backward_times.append(bwd_s)
    for p in params:
        p.grad = None
    return statistics.median(forward_times), statistics.median(backward_times), peak


def whole_model_time(model: nn.Module, inputs: tuple, targets, loss, warmup: int = 1, repeats: int = 3) -> float:
    """Median time of forward + loss + backward of the whole model."""
    device = next(model.parameters()).device
    timer = _Timer(device)
    times = []
    for i in range(warmup + repeats):
        model.zero_grad(set_to_none=True)
        _, seconds = timer.time(lambda: loss(model(*inputs), targets).backward())
        if i >= warmup:
            times.append(seconds)
    model.zero_grad(set_to_none=True)
    return statistics.median(times)


def optimizer_step_time(model: nn.Module, warmup: int = 2, repeats: int = 5) -> float:
    """Median time of one AdamW step over all of `model`'s parameters, as the runtime takes it.

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
    optimizer = torch.optim.AdamW(params)
    timer = _Timer(params[0].device)
    times = []
    for i in range(warmup + repeats):
        _, seconds = timer.time(optimizer.step)
        if i >= warmup:
            times.append(seconds)
    return statistics.median(times)
