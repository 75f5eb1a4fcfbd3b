"""`planner profile`: measure every unit of a model, or estimate it analytically.

    profile = profile_model("examples/gpt.py", {"n_layers": 4}, [1, 2], device="cpu")

Steps: build the model on the meta device (free, any size) and trace one forward per
micro-batch size to find the units in execution order and the tensors crossing each cut
(planner/units.py). Then, per unit and micro-batch size, count and time it
(planner/profiler/measure.py): on `cpu`/`cuda` with real kernels on a materialised model,
on `meta` analytically from a GPU spec's roofline. Identical units (same fingerprint and
input shapes) are counted once in analytic mode, which is what lets a 96-layer 175B model
profile in seconds; measured mode times every unit, since real units differ by noise and
placement.

A unit holding a mixture-of-experts layer also gets its record (`Unit.moe`): the experts,
router and shared experts found by structure, and the experts' own costs under balanced
routing (planner/profiler/moe.py).

On CPU the profile runs with `threads` torch threads (default 1) and records the number; the
plan carries it to the run, whose every process computes with as many (runtime/train.py), so
the times the solver used and the times the run sees come from the same kernels.
"""

from __future__ import annotations

import datetime as _dt
import logging
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import asdict, dataclass
from functools import partial
from typing import Literal, cast

import torch
from torch.utils._pytree import tree_flatten, tree_map

import planner
from planner.errors import PlannerError
from planner.hardware import DEFAULT_ANALYTIC_GPU, GPUSpec, get_gpu
from planner.meta_values import KnownValues
from planner.model_file import ModelFile, load_model_file, user_code_error
from planner.profile_schema import (
    CrossingTensor,
    Cut,
    ModelInfo,
    Profile,
    Unit,
    UnitCosts,
    WholeModel,
    collapsed_names,
)
from planner.profiler.autocast import CPU_POLICY, CUDA_POLICY, EmulatedAutocast
from planner.profiler.counters import FUSIONS, MetaAttentionMode, SequenceSplitChecks, sequence_length, tensor_bytes
from planner.profiler.measure import (
    UnitJob,
    optimizer_step_time,
    time_round_robin,
    unit_costs,
    whole_model_job,
)
from planner.profiler.moe import MoECount, balanced_experts, count_moe, moe_records
from planner.profiler.opgraph import record_unit
from planner.profiler.token_mixing import mixes_tokens_on_meta, mixes_tokens_outside_attention, probed_input
from planner.units import (
    UnitTrace,
    model_fingerprint,
    owned_parameters,
    tied_units,
    trace_units,
    unit_fingerprints,
)

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEVICES = ("cpu", "cuda", "meta")


PRECISIONS = ("autocast", "pure")
"""How a 16-bit profile computes (`Profile.precision`)."""


@dataclass(frozen=True)
class RunAs:
    """How the profile runs the model (`mixed_precision`)."""

    param_dtype: torch.dtype
    """The parameters' dtype (and the floating inputs')."""
    on_device: Callable[[], AbstractContextManager]
    """A context entered around each forward on the profiled device."""
    on_meta: Callable[[], AbstractContextManager]
    """The same on the meta device (traces, analytic counts)."""


def mixed_precision(device: str, torch_dtype: torch.dtype, precision: str = "autocast") -> RunAs:
    """How the profile runs the model.

    `autocast`, as this planner's runtime trains (runtime/train.py `_autocast`): fp32 parameters,
    each forward under autocast to the 16-bit type, so the times include autocast's casts (each
    weight cast once per forward) and the saved activations are the ones training keeps: fp32
    where autocast keeps fp32 (norms, the residual stream that starts at fp32 embeddings), the
    16-bit weight copies saved for backward. On the meta device, where torch's autocast does not
    act, planner/profiler/autocast.py applies CUDA's policy. `pure`: the model converted to the
    16-bit type, as Megatron-LM, DeepSpeed's bf16 and FSDP2's MixedPrecisionPolicy compute."""
    if torch_dtype == torch.float32 or precision == "pure":
        return RunAs(torch_dtype, nullcontext, nullcontext)
    kind = torch.device(device).type
    emulated = partial(EmulatedAutocast, torch_dtype, CPU_POLICY if kind == "cpu" else CUDA_POLICY)
    if device == "meta":
        return RunAs(torch.float32, emulated, emulated)
    return RunAs(torch.float32, lambda: torch.autocast(kind, dtype=torch_dtype), emulated)


def _to(obj, device, dtype):
    def move(x):
        if isinstance(x, torch.Tensor):
            return x.to(device=device, dtype=dtype if x.is_floating_point() else x.dtype)
        return x

    return tree_map(move, obj)


def _as_tuple(inputs) -> tuple:
    return inputs if isinstance(inputs, tuple) else (inputs,)


def _signature(module_fp: str, args, kwargs) -> tuple:
    leaves = tree_flatten((args, kwargs))[0]
    return (module_fp,) + tuple((tuple(x.shape), x.dtype, x.requires_grad) if isinstance(x, torch.Tensor) else repr(x)
                                for x in leaves)


def _trace(mf: ModelFile, model, inputs, where: str, values: KnownValues | None = None, precision=nullcontext) -> UnitTrace:
    length = sequence_length(inputs)
    checks = SequenceSplitChecks(length, values) if length is not None else nullcontext()
    try:
        with values or nullcontext(), MetaAttentionMode(), precision(), checks:
            trace = trace_units(model, inputs)
    except PlannerError:
        raise
    except Exception as exc:
        raise user_code_error(mf.path, f"running the model's forward {where}", exc) from exc
    if isinstance(checks, SequenceSplitChecks):
        trace.cp_obstacles, trace.attention_calls = checks.obstacles, checks.attention_calls
    return trace


@contextmanager
def cpu_threads(threads: int | None):
    """torch's intra-op thread count set to `threads` for the block (None: left as it is)."""
    if threads is None:
        yield
        return
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def _check_fits(device: str, parameter_bytes: int) -> None:
    """Refuse before materialising a model that cannot fit (params, grads, activations)."""
    if device == "cuda":
        available = torch.cuda.mem_get_info()[0]
    else:
        import psutil

        available = psutil.virtual_memory().available
    needed = 3 * parameter_bytes  # parameters + gradients + a margin for activations
    if needed > available:
        raise PlannerError(
            f"The model has {parameter_bytes / 2**30:.1f} GiB of parameters; measuring it on {device} needs "
            f"about {needed / 2**30:.1f} GiB and {available / 2**30:.1f} GiB is free.",
            "Profile it analytically instead: --device meta --gpu h100-80gb (no memory needed).",
        )


def profile_model(
    model_file: str,
    model_args: dict | None = None,
    micro_batch_sizes: Sequence[int] = (1,),
    device: str = "cpu",
    gpu: str | GPUSpec | None = None,
    dtype: str = "float32",
    warmup: int = 2,
    repeats: int = 5,
    seed: int = 0,
    progress: Callable[[str, int, int], None] | None = None,
    fusion: str = "none",
    threads: int | None = 1,
    precision: str = "autocast",
) -> Profile:
    """Profile a model file; see the module docstring. `gpu`: the spec (a preset's name, or a
    cluster's GPUSpec) whose rates give analytic times. `fusion` (planner/profiler/counters.py):
    how the memory traffic, hence analytic times, assume kernels are fused. `threads`: torch
    threads while measuring on CPU (None: as many as torch uses now). `precision`: how a 16-bit
    profile computes (`mixed_precision`): `autocast`, as `planner run` trains, or `pure`, as
    Megatron-LM, DeepSpeed and FSDP2's mixed precision do."""
    threads = torch.get_num_threads() if threads is None else threads
    if device == "cpu" and threads < 1:
        raise PlannerError(f"--threads must be at least 1 (got {threads}).", "Use 1, as each process of a CPU run computes with one thread by default.")
    if repeats < 1 or warmup < 0:
        raise PlannerError(f"--repeats must be at least 1 (got {repeats}) and warm-up at least 0 (got {warmup}).", "Use e.g. --repeats 10.")
    with cpu_threads(threads if device == "cpu" else None):
        return _profile_model(model_file, model_args, micro_batch_sizes, device, gpu, dtype, warmup, repeats, seed, progress, fusion,
                              threads, precision)


def _profile_model(model_file, model_args, micro_batch_sizes, device, gpu, dtype, warmup, repeats, seed, progress, fusion,
                   threads: int | None, precision: str) -> Profile:
    """The steps: check the options, build on meta, trace, count (and time), record op graphs."""
    sizes = _check_options(device, dtype, fusion, micro_batch_sizes, precision)
    analytic_gpu = (gpu if isinstance(gpu, GPUSpec) else get_gpu(gpu or DEFAULT_ANALYTIC_GPU)) if device == "meta" else None
    torch_dtype = DTYPES[dtype]
    run_as = mixed_precision(device, torch_dtype, precision)
    mf = load_model_file(model_file, model_args)
    meta_model = _build_meta_model(mf, run_as.param_dtype)

    # One KnownValues for every meta run of this profile: the shadows of the batch and of the
    # tensors the trace made stay attached to the unit inputs it recorded (planner/meta_values.py).
    values = KnownValues(seed=seed)
    batches = {b: mf.make_batch(b) for b in sizes}
    _check_batch_scales(mf, batches)
    with _logged_step("tracing the units"):
        model, traces, unit_inputs, meta_traced = _traces(mf, meta_model, batches, device, seed, values, run_as)
    trace = traces[sizes[0]]
    units = trace.units
    if not units:
        raise PlannerError("The model's forward called none of its submodules, so it has nowhere to cut.", "Put the layers in submodules (e.g. an nn.ModuleList of blocks).")
    fingerprints = unit_fingerprints(meta_model, units)
    owned = owned_parameters(meta_model, units)

    modules = dict(model.named_modules())
    log.debug("%d units, %d distinct; micro-batch sizes %s", len(units), len(set(fingerprints.values())), sizes)
    with values, _logged_step("counting the units"):
        forward_in = run_as.on_meta if device == "meta" else run_as.on_device
        losses = _Losses(mf, batches, values, run_as.param_dtype) if device == "meta" else None
        # On meta the routing would be a draw from sampled router logits: count units balanced.
        with balanced_experts(model, values) if device == "meta" else nullcontext():
            costs, jobs = _count_units(mf, modules, units, fingerprints, unit_inputs, analytic_gpu, dtype, fusion, progress,
                                       forward_in, losses)
        moe = _count_moe(mf, modules, units, fingerprints, unit_inputs, analytic_gpu, dtype, fusion, values, forward_in)
    whole: dict[int, WholeModel] = {}
    optimizer_s = None
    if device != "meta":
        with _logged_step(f"timing {len(jobs) + len(moe.jobs)} unit jobs and the whole model"):
            whole = _time_units(mf, model, batches, costs, jobs, units, device, run_as, warmup, repeats, progress,
                                extra_jobs=list(moe.jobs.values()))
        optimizer_s = optimizer_step_time(model)

    mixing: dict[str, bool | None] = {}
    length = sequence_length(batches[sizes[0]][0])
    with _logged_step("checking which units mix tokens outside attention"):
        for name in units:
            if fingerprints[name] not in mixing:
                args, kwargs = unit_inputs[sizes[0]][name]
                mixing[fingerprints[name]] = (
                    mixes_tokens_on_meta(modules[name], args, kwargs, length, values.exact) if device == "meta"
                    else mixes_tokens_outside_attention(modules[name], args, kwargs, length, run_as.on_device))
    unprobed = [name for name in units if mixing.get(fingerprints[name]) is None
                and probed_input(unit_inputs[sizes[0]][name][0], unit_inputs[sizes[0]][name][1], length) is not None]
    graph_modules = dict(meta_model.named_modules()) if meta_traced else modules
    with values, _logged_step("recording the op graphs"), balanced_experts(graph_modules[""], values) if meta_traced else nullcontext():
        # Recorded on meta for a GPU: with the GPU's fused kernels, as its units were counted.
        gpu_kernels = device.startswith("cuda") or (analytic_gpu is not None and analytic_gpu.name != "cpu")
        op_graphs = _op_graphs(mf, graph_modules, units, fingerprints, trace,
                               run_as.on_meta if meta_traced else run_as.on_device, gpu_kernels=gpu_kernels)

    element = torch.empty((), dtype=torch_dtype).element_size()
    return Profile(
        tool_version=planner.__version__,
        created_at=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        mode="analytic" if device == "meta" else "measured",
        device=device,
        device_name=_device_name(device, analytic_gpu),
        target_gpu=analytic_gpu.name if analytic_gpu else None,
        target_gpu_spec=asdict(analytic_gpu) if analytic_gpu else None,
        dtype=dtype,
        torch_version=torch.__version__,
        model=_model_info(mf, str(model_file), meta_model, units, owned, traces, sizes[0], batches[sizes[0]], element,
                          [name for name in units if mixing.get(fingerprints[name])]),
        micro_batch_sizes=sizes,
        units=[_unit_record(i, name, modules[name], fingerprints[name], owned.get(name, []), costs[name],
                            *op_graphs[fingerprints[name]], moe_records(moe, name, element), element,
                            float_fed=i in trace.float_fed, mixes_tokens=mixing.get(fingerprints[name]))
               for i, name in enumerate(units)],
        cuts=_cut_records(traces, sizes),
        whole_model=whole,
        optimizer_step_s=optimizer_s,
        fusion=fusion,
        precision=None if torch_dtype == torch.float32 else cast(Literal["autocast", "pure"], precision),
        notes=_notes(trace, owned, values, meta_traced) + ([] if losses is None or losses.counted else [LOSS_NOT_COUNTED])
        + ([UNPROBED + ", ".join(unprobed)] if unprobed else [])
        + _split_notes(jobs) + _slow_backward_notes(units, fingerprints, costs, sizes[0]),
        cpu_threads=threads if device == "cpu" else None,
    )


@contextmanager
def _logged_step(what: str):
    """Log at DEBUG how long a step of the profile took (`planner --debug profile`)."""
    start = time.perf_counter()
    yield
    log.debug("%s: %.2f s", what, time.perf_counter() - start)


def _build_meta_model(mf: ModelFile, torch_dtype: torch.dtype) -> torch.nn.Module:
    """The model on the meta device (free at any size) in the profile's dtype; refuses a
    build_model that returns no module or one with nothing to train."""
    meta_model = mf.build_on_meta()
    if not isinstance(meta_model, torch.nn.Module):
        raise PlannerError(f"build_model() in {mf.path} returned {type(meta_model).__name__}, not a torch.nn.Module.")
    if not any(True for _ in meta_model.parameters()):
        raise PlannerError(f"build_model() in {mf.path} returned a model with no parameters: there is nothing to train "
                           "or to split.", "Return the model with its layers (nn.Linear, nn.Embedding, ...) as submodules.")
    return meta_model.to(torch_dtype)


def _trainable(params: list) -> int:
    """Elements of the trainable parameters among (name, parameter) pairs. Frozen ones
    (requires_grad=False as built: LoRA's base weights) have no gradient or optimizer state; the
    cost model needs the trainable share (profile_schema.Unit)."""
    return sum(p.numel() for _, p in params if p.requires_grad)


def _model_info(mf: ModelFile, file: str, meta_model: torch.nn.Module, units: list[str], owned: dict, traces: dict[int, UnitTrace],
                first_size: int, first_batch, element: int, mixing: Sequence[str] = ()) -> ModelInfo:
    """The profile's model record: its source (`file` as the user named it), sizes and structure;
    `first_batch` is make_batch(first_size); `mixing`: the units that mix tokens outside attention
    (`Unit.mixes_tokens`), each an obstacle to context parallelism."""
    total_params = sum(p.numel() for ps in owned.values() for _, p in ps)
    return ModelInfo(
        file=file,
        args=dict(mf.model_args),
        fingerprint=model_fingerprint(meta_model, units),
        source_sha256=mf.source_sha256(),
        num_parameters=total_params,
        parameter_bytes=total_params * element,
        trainable_parameter_bytes=sum(_trainable(ps) for ps in owned.values()) * element,
        sequence_length=sequence_length(first_batch[0]),
        input_bytes_per_sample=tensor_bytes(first_batch[0]) / first_size,  # make_batch(first_size)
        target_bytes_per_sample=tensor_bytes(first_batch[1]) / first_size,
        cp_obstacles=list(dict.fromkeys([*(o for t in traces.values() for o in t.cp_obstacles),
                                         *(f"{name} mixes tokens outside attention" for name in mixing)])),
        attention_calls=next(iter(traces.values())).attention_calls if traces else None,
        tied_parameters=[list(g) for g in tied_units(meta_model, units)],
        root_parameters=[name for name, _ in owned.get("", [])],
        unsplit_units=[list(run) for run in sorted({run for t in traces.values() for run in t.joined})],
    )


def _unit_record(index: int, name: str, module: torch.nn.Module, fingerprint: str, owned: list, costs: dict[int, UnitCosts],
                 ops: list, saved_regions: list, moe, element: int, float_fed: bool = True,
                 mixes_tokens: bool | None = None) -> Unit:
    """One unit's profile record; `owned`: the (name, parameter) pairs it holds."""
    num_parameters = sum(p.numel() for _, p in owned)
    return Unit(
        index=index,
        name=name,
        kind=type(module).__name__,
        fingerprint=fingerprint,
        num_parameters=num_parameters,
        parameter_bytes=num_parameters * element,
        trainable_parameter_bytes=_trainable(owned) * element,
        buffer_bytes=sum(b.numel() * b.element_size() for b in module.buffers()),
        costs=costs,
        ops=ops,
        saved_regions=saved_regions,
        float_fed=float_fed,
        moe=moe,
        mixes_tokens=mixes_tokens,
    )


def _check_batch_scales(mf: ModelFile, batches: dict) -> None:
    """Refuse a make_batch whose batch does not grow with batch_size: every micro-batch size
    would then profile the same work (identical FLOPs), and the plan's batch arithmetic would
    be wrong. With one size profiled, make_batch is called once more at twice it (the RNG
    state is restored, so the profile's batches do not change)."""
    sizes = sorted(batches)
    if len(sizes) == 1:
        extra = 2 * sizes[0]
        with torch.random.fork_rng(devices=[]):
            batches = {**batches, extra: mf.make_batch(extra)}
        sizes.append(extra)

    def leading(batch) -> list:  # every tensor of (inputs, targets), nested containers included
        return [int(x.shape[0]) for x in tree_flatten(batch)[0] if isinstance(x, torch.Tensor) and x.dim() > 0]

    dims = {b: leading(batches[b]) for b in sizes}
    scales = any(all(dims[b][k] == b for b in sizes) for k in range(min((len(d) for d in dims.values()), default=0)))
    if not scales:
        shown = ", ".join(f"make_batch({b}) -> leading dims {dims[b]}" for b in sizes)
        raise PlannerError(f"make_batch(batch_size) in {mf.path} does not follow batch_size: {shown}. Every micro-batch size "
                           "would profile the same work.",
                           "Return inputs and targets whose first dimension is batch_size (samples along dim 0).")


def _check_options(device: str, dtype: str, fusion: str, micro_batch_sizes, precision: str = "autocast") -> list[int]:
    """Refuse bad options before any work; the micro-batch sizes, sorted and unique."""
    if precision not in PRECISIONS:
        raise PlannerError(f"Unknown precision {precision!r}.", f"Use one of {', '.join(PRECISIONS)}: autocast as "
                           "`planner run` trains (fp32 weights, 16-bit compute), pure as Megatron-LM and FSDP2 do.")
    if device not in DEVICES:
        raise PlannerError(f"Unknown device {device!r}.", f"Use one of {', '.join(DEVICES)}.")
    if dtype not in DTYPES:
        raise PlannerError(f"Unknown dtype {dtype!r}.", f"Use one of {', '.join(DTYPES)}.")
    if fusion not in FUSIONS:
        raise PlannerError(f"Unknown fusion {fusion!r}.", f"Use one of {', '.join(FUSIONS)}.")
    if device == "cuda" and not torch.cuda.is_available():
        raise PlannerError("--device cuda was asked for but this machine has no CUDA GPU.", "Use --device cpu, or --device meta for an analytic profile.")
    sizes = sorted(set(int(b) for b in micro_batch_sizes))
    if not sizes or sizes[0] < 1:
        raise PlannerError(f"Micro-batch sizes must be positive integers, got {list(micro_batch_sizes)}.")
    return sizes


def _traces(mf: ModelFile, meta_model, batches: dict, device: str, seed: int, values: KnownValues, run_as: RunAs):
    """The model the units are counted on, one unit trace per micro-batch size, the inputs
    of each unit (per size) to count and time it with, and whether the traces ran on the
    meta device.

    The trace runs on the meta device (free for any model size). A measured profile then
    builds the real model and traces it again, for unit inputs holding real data. When the
    meta trace fails (a data-dependent operation planner/meta_values.py cannot answer, or a
    kernel with no meta implementation) and the model is measured anyway, the real traces
    serve for everything.
    """
    meta_error = None
    traces = {}
    try:
        traces = {b: _trace(mf, meta_model, values.to_meta(_as_tuple(batch[0]), run_as.param_dtype), "on the meta device", values,
                            run_as.on_meta)
                  for b, batch in batches.items()}
    except PlannerError as exc:  # a data-dependent operation, or a kernel the meta device lacks
        if device == "meta":
            raise
        log.debug("the meta-device trace failed, tracing the real model instead: %s", exc.message)
        meta_error = exc
    if device == "meta":
        return meta_model, traces, {b: t.unit_inputs for b, t in traces.items()}, True
    param_dtype, precision = run_as.param_dtype, run_as.on_device
    _check_fits(device, sum(p.numel() for p in meta_model.parameters()) * torch.empty((), dtype=param_dtype).element_size())
    torch.manual_seed(seed)
    try:
        with torch.device(device):
            model = mf.build_model()
        model = model.to(param_dtype)
    except torch.OutOfMemoryError as exc:
        raise PlannerError(f"Out of memory building the model on {device}.", "Use --device meta for an analytic profile.") from exc
    with precision():
        real = {b: _trace(mf, model, _to(_as_tuple(batch[0]), device, param_dtype), f"on {device}") for b, batch in batches.items()}
    unit_inputs = {b: t.unit_inputs for b, t in real.items()}
    if meta_error is not None:
        return model, real, unit_inputs, False
    return model, traces, unit_inputs, True  # cuts and op graphs from the meta trace


class _Losses:
    """The training loss as a function of the last unit's output, per micro-batch size (analytic
    profiles: `unit_costs(loss=...)` counts it with the last unit). `counted` turns False when the
    model's loss does not take that output (glue after the last unit), and the profile says so."""

    def __init__(self, mf: ModelFile, batches: dict, values: KnownValues, dtype):
        self.mf, self.counted = mf, True
        self.targets = {b: values.to_meta(batch[1], dtype) for b, batch in batches.items()}

    def at(self, b: int):
        def loss(output):
            try:
                value = self.mf.loss(output, self.targets[b])
            except Exception as exc:
                raise _LossDoesNotFit() from exc
            if not isinstance(value, torch.Tensor) or value.numel() != 1 or not value.requires_grad:
                raise _LossDoesNotFit()
            return value

        return loss


class _LossDoesNotFit(Exception):
    """The model's loss function did not give a scalar to train from on the last unit's output."""


UNPROBED = ("whether these units move information between tokens outside attention is not known (the probe could not "
            "run them, planner/profiler/token_mixing.py), so sequence parallelism may split them; if one holds a "
            "recurrence, a token shift or a convolution over the sequence, solve without --sequence-parallel and --cp: ")
LOSS_NOT_COUNTED = ("the loss function does not take the last unit's output (the model's forward does more after it), "
                    "so the loss's time is not in the last unit's")


def _count_units(mf, modules, units, fingerprints, unit_inputs, analytic_gpu, dtype, fusion, progress, precision=nullcontext,
                 losses: _Losses | None = None):
    """FLOPs, bytes (and analytic times) of every unit at every size; the measured jobs to time.

    Identical units (same fingerprint and input shapes) are counted once in analytic mode. With
    `losses` (analytic profiles), the last unit's counts include the loss's forward and backward
    (`unit_costs`): a measured profile's whole-model ratio holds it instead."""
    sizes = sorted(unit_inputs)
    costs: dict[str, dict[int, UnitCosts]] = {u: {} for u in units}
    cache: dict[tuple, UnitCosts] = {}
    jobs: dict[tuple[str, int], UnitJob] = {}
    steps, done = len(units) * len(sizes), 0
    for b in sizes:
        for name in units:
            args, kwargs = unit_inputs[b][name]
            loss = losses.at(b) if losses is not None and losses.counted and name == units[-1] else None
            key = (_signature(fingerprints[name], args, kwargs), loss is not None)
            if analytic_gpu is not None and key in cache:
                costs[name][b] = cache[key]
            else:
                try:
                    try:
                        counted = unit_costs(modules[name], args, kwargs, analytic_gpu=analytic_gpu, dtype=dtype,
                                             fusion=fusion, precision=precision, loss=loss)
                    except _LossDoesNotFit:
                        assert losses is not None
                        losses.counted = False
                        key = (key[0], False)
                        counted = unit_costs(modules[name], args, kwargs, analytic_gpu=analytic_gpu, dtype=dtype,
                                             fusion=fusion, precision=precision)
                    costs[name][b] = cache[key] = counted
                except torch.OutOfMemoryError as exc:
                    raise PlannerError(f"Out of memory profiling unit {name} at micro-batch {b}.", "Use smaller --micro-batch-sizes, or --device meta.") from exc
                except PlannerError:
                    raise
                except Exception as exc:
                    raise user_code_error(mf.path, f"running unit {name} alone", exc) from exc
                if analytic_gpu is None:
                    jobs[name, b] = UnitJob(modules[name], args, kwargs, precision)
            done += 1
            if progress:
                progress(f"counting {name} @ micro-batch {b}", done, steps)
    return costs, jobs


def _count_moe(mf, modules, units, fingerprints, unit_inputs, analytic_gpu, dtype, fusion, values, precision=nullcontext) -> MoECount:
    """Every unit's mixture-of-experts layers, counted (planner/profiler/moe.py)."""
    try:
        return count_moe(modules, units, fingerprints, unit_inputs, _signature, analytic_gpu=analytic_gpu, dtype=dtype,
                         fusion=fusion, values=values, precision=precision)
    except torch.OutOfMemoryError as exc:
        raise PlannerError("Out of memory counting the experts of the MoE layers.", "Use smaller --micro-batch-sizes, or --device meta.") from exc
    except PlannerError:
        raise
    except Exception as exc:
        raise user_code_error(mf.path, "running the experts of an MoE layer alone", exc) from exc


def _time_units(mf, model, batches, costs, jobs, units, device, run_as, warmup, repeats, progress,
                extra_jobs=()) -> dict[int, WholeModel]:
    """Time every unit, the `extra_jobs` (the MoE layers' experts) and the whole model round-robin
    (fills `costs` in place); the whole-model records. `run_as`: `mixed_precision`'s answer."""
    param_dtype, precision = run_as.param_dtype, run_as.on_device
    wholes = {b: whole_model_job(model, _to(_as_tuple(batch[0]), device, param_dtype), _to(batch[1], device, param_dtype), mf.loss,
                                 precision) for b, batch in batches.items()}
    try:
        time_round_robin([*jobs.values(), *extra_jobs, *wholes.values()], warmup, repeats,
                         progress=(lambda i, n: progress(f"timing pass {i}/{n}", i, n)) if progress else None)
    except torch.OutOfMemoryError as exc:
        raise PlannerError(f"Out of memory timing the units on {device}.", "Use smaller --micro-batch-sizes, or --device meta.") from exc
    except Exception as exc:
        raise user_code_error(mf.path, "timing the units and the whole model", exc) from exc
    for (name, b), job in jobs.items():
        forward_s, backward_s = job.typical()
        input_s, weight_s = job.split_backward()
        costs[name][b] = costs[name][b].model_copy(update={"forward_time_s": forward_s, "backward_time_s": backward_s,
                                                           "backward_input_time_s": input_s,
                                                           "backward_weight_time_s": weight_s,
                                                           "peak_memory_bytes": job.peak_memory_bytes})
    whole = {}
    for b, job in wholes.items():
        units_s = sum(costs[u][b].forward_time_s + costs[u][b].backward_time_s for u in units)
        whole[b] = WholeModel(forward_backward_time_s=job.typical(), sum_of_units_time_s=units_s,
                              ratio=job.typical() / units_s if units_s else 0.0)
    return whole


def _cut_records(traces: dict[int, UnitTrace], sizes: list[int]) -> list[Cut]:
    """For every possible cut, the tensors crossing it, with their bytes at each size."""
    trace = traces[sizes[0]]
    cuts = []
    for c in range(len(trace.units) - 1):
        per_size = {b: traces[b].crossings(c) for b in sizes}
        tensors = [
            CrossingTensor(
                producer=trace.position_name(t.producer),
                consumers=sorted({trace.position_name(q) for q in t.consumers}),
                dtype=t.dtype,
                shape={b: per_size[b][i].shape for b in sizes},
                bytes={b: per_size[b][i].bytes for b in sizes},
            )
            for i, t in enumerate(per_size[sizes[0]])
        ]
        cuts.append(Cut(after_index=c, after=trace.units[c], tensors=tensors, bytes={b: sum(t.bytes for t in per_size[b]) for b in sizes}))
    return cuts


def _op_graphs(mf, modules, units, fingerprints, trace: UnitTrace, precision=nullcontext,
               gpu_kernels: bool = False) -> dict[str, tuple[list, list]]:
    """Each distinct unit's matmul-like ops, for the intra-op solver, and its saved regions
    (`record_unit`; recorded once per fingerprint)."""
    op_graphs: dict[str, tuple[list, list]] = {}
    for name in units:
        if fingerprints[name] not in op_graphs:
            args, kwargs = trace.unit_inputs[name]
            try:
                with MetaAttentionMode(gpu_kernels=gpu_kernels):
                    op_graphs[fingerprints[name]] = record_unit(modules[name], args, kwargs, precision)
            except Exception as exc:
                raise user_code_error(mf.path, f"recording the op graph of unit {name}", exc) from exc
    return op_graphs


SLOW_BACKWARD = 20.0
"""Backward over forward time past which a unit's backward is named in the profile's notes. A
unit of matrix products runs its backward in about twice its forward's time (three with
attention's recomputed scores); an embedding's backward, which writes the whole table's
gradient, can take 15-30 times its forward, but it has no FLOPs and is not named."""


def _slow_backward_notes(units: list[str], fingerprints: dict, costs: dict, size: int) -> list[str]:
    """A note naming units whose backward takes more than SLOW_BACKWARD times their forward: a
    Python loop over the sequence that reads one step of a tensor at a time (`x[:, :, i]`) is the
    usual cause. Autograd gives each step's read a gradient the size of the whole tensor
    (select_backward) and adds them up: a scan over 4096 tokens of Jamba's (1, 8192, 4096, 16)
    state writes terabytes (25 s per layer on an H100, 200 times its forward). That is what eager
    PyTorch runs; where the model has fused kernels for its scan on GPUs (Mamba's mamba-ssm and
    causal-conv1d), it does not run this code there, and the plan is priced for code it will not run."""
    slow, seen = [], set()
    for name in units:
        cost = costs[name][size]
        if fingerprints[name] in seen or not cost.forward_flops or cost.backward_time_s <= SLOW_BACKWARD * cost.forward_time_s:
            continue
        seen.add(fingerprints[name])
        slow.append(f"{name} ({cost.backward_time_s:.3g} s against {cost.forward_time_s:.3g} s)")
    if not slow:
        return []
    return [f"these units' backward takes more than {SLOW_BACKWARD:g} times their forward at micro-batch {size}, each "
            f"named once for its kind: {'; '.join(slow)}. The usual cause is a Python loop over the sequence that reads "
            "one step of a tensor at a time: autograd writes a gradient the size of the whole tensor for every step. If "
            "the model has fused kernels for this loop on GPUs (a Mamba layer's mamba-ssm and causal-conv1d), it runs "
            "them there instead, and these times are not theirs: measure a profile on a GPU with them installed "
            "(--device cuda)"]


def _split_notes(jobs: dict) -> list[str]:
    """A note naming the units whose backward torch's zero-bubble functions could not split
    (planner/profiler/measure.py `UnitJob`): their split is priced as free."""
    failed = {name: job.split_error for (name, _), job in jobs.items() if job.split_error}
    if not failed:
        return []
    return ["zero bubble's split backward (torch's stage_backward_input, then stage_backward_weight) failed on "
            + "; ".join(f"{name} ({error})" for name, error in failed.items()) + ": priced as one backward there"]


def _notes(trace: UnitTrace, owned, values: KnownValues, meta_traced: bool) -> list[str]:
    notes = []
    if trace.unused:
        notes.append(f"modules never called in forward (left out of the units): {', '.join(collapsed_names(trace.unused, trace.units))}")
    if trace.repeated_calls:
        notes.append(f"units called more than once (a pipeline stage holds each with the units up to its last call): "
                     f"{', '.join(trace.repeated_calls)}")
    if owned.get(""):
        held = collapsed_names([n for n, _ in owned[""]], trace.units, "parameters")
        notes.append(f"parameters held outside every unit: {', '.join(held)}")
    if not meta_traced:
        notes.append("the meta-device trace could not answer a data-dependent operation; units were traced on the real model")
    if values.sampled_decisions:
        where = "; ".join(f"aten.{op} at {line.splitlines()[0]} ({n}x)" for (op, line), n in sorted(values.sampled_decisions.items()))
        notes.append("control flow on the meta device followed values sampled in place of parameter-dependent data "
                     f"(balanced routing for a router): {where}")
    return notes


def _device_name(device: str, gpu) -> str:
    if device == "meta":
        return f"analytic:{gpu.name}"
    if device == "cuda":
        return torch.cuda.get_device_name()
    import platform

    return platform.processor() or platform.machine() or "cpu"
