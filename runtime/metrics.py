"""What a run measures: step times, per-stage forward/backward times, peak memory.

Two peaks are kept. `peak_memory` is what the process costs the machine (CUDA's
max_memory_allocated, on CPU the resident set, interpreter and torch included);
`TensorPeakMeter` is the peak of the tensors alone over one step, which is what the plan's
memory model predicts, so that is what `planner validate` holds against it.

Per-stage times are what `planner validate` holds against the plan's `stage_time_s`
(forward + backward of one micro-batch per stage). A pipelined stage is timed by the
PipelineRunner (runtime/apply_pp.py) around torch's forward/backward chunk calls, so the
schedule's p2p waits are not included; an unpipelined run is timed here around its forward
(loss included) and its backward, synchronising CUDA at both ends (which serialises a
little of what would overlap: a measurement of the stage, not of the step).

The file's schema is planner/metrics_schema.py (`Metrics`): `build_metrics` fills it, and
the final parameters travel beside it in memory (`RunResult`), never in the file.
"""

from __future__ import annotations

import contextlib
import gc
import statistics
import time
import warnings
from collections import defaultdict
from dataclasses import dataclass

import torch

from planner.metrics_schema import MeasuredTimeline, Metrics, StageTime, TimelineEvent
from planner.plan import Schedule

WARMUP_STEPS = 1


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued kernels (CUDA); a no-op on CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timeline_of(per_rank_events: list[list[tuple]], schedule: Schedule, num_ranks: int) -> MeasuredTimeline:
    """The last step's pipeline actions of every pipeline rank as one timeline.

    `per_rank_events[r]`: PipelineRunner.events of pipeline rank r. Times become seconds from
    the first action's start (wall clock, so ranks on one machine line up exactly; across
    nodes, as well as their clocks agree). Read by planner/validate.py's measured Gantt.
    """
    origin = min((e[3] for events in per_rank_events for e in events), default=0.0)
    return MeasuredTimeline(schedule=schedule, num_ranks=num_ranks, events=[
        TimelineEvent(rank=r, chunk=stage, microbatch=mb, kind=kind, start_s=start - origin, end_s=end - origin)
        for r, events in enumerate(per_rank_events) for kind, stage, mb, start, end in events])


class StageTimer:
    """Seconds per micro-batch of each stage's forward and backward, after warm-up steps."""

    def __init__(self, device: torch.device, warmup_steps: int = WARMUP_STEPS) -> None:
        self.device = device
        self.warmup_steps = warmup_steps
        """Steps left out of the means (`TensorPeakMeter.timing_warmup_steps`)."""
        self.step = 0
        self._seconds: dict[tuple[int, str], float] = defaultdict(float)
        self._forwards: dict[int, int] = defaultdict(int)

    def _sync(self) -> None:
        synchronize(self.device)

    @contextlib.contextmanager
    def time(self, stage: int, kind: str):
        """Time one micro-batch's `kind` ("forward" or "backward") of `stage`."""
        self._sync()
        start = time.perf_counter()
        try:
            yield
        finally:
            self._sync()
            if self.step >= self.warmup_steps:
                self._seconds[(stage, kind)] += time.perf_counter() - start
                self._forwards[stage] += kind == "forward"

    def record(self, stage_times: dict[int, dict[str, float]], num_microbatches: int) -> None:
        """Add one step's per-stage sums over its micro-batches (a PipelineRunner's `stage_times`)."""
        if self.step < self.warmup_steps:
            return
        for stage, t in stage_times.items():
            self._seconds[(stage, "forward")] += t["forward_s"]
            self._seconds[(stage, "backward")] += t["backward_s"]
            self._forwards[stage] += num_microbatches

    def summary(self) -> dict[int, dict[str, float]]:
        """{stage: {"forward_s", "backward_s"}} per micro-batch (mean over the timed steps)."""
        out = {}
        for stage, count in self._forwards.items():
            out[stage] = {kind + "_s": self._seconds[(stage, kind)] / count for kind in ("forward", "backward")}
        return out


def merge_stage_times(per_rank: list[dict[int, dict[str, float]]]) -> dict[int, StageTime]:
    """One entry per stage: the slowest of the ranks that hold it (the one the others wait for)."""
    merged: dict[int, dict[str, float]] = {}
    for times in per_rank:
        for stage, t in times.items():
            if stage not in merged or sum(t.values()) > sum(merged[stage].values()):
                merged[stage] = t
    return {s: StageTime(**merged[s]) for s in sorted(merged)}


def peak_memory() -> int:
    """Peak bytes: CUDA's max_memory_allocated, or the process's resident set on CPU."""
    if torch.cuda.is_available():
        return int(torch.cuda.max_memory_allocated())
    import psutil

    return int(psutil.Process().memory_info().rss)


class TensorPeakMeter:
    """Peak bytes of this rank's tensors during one step (the first after the warm-up).

    On CUDA: the caching allocator's max_memory_allocated since `start` (reset there), which
    counts every live tensor, the ones from before the step included.

    On CPU torch keeps no allocator statistics, so the warm-up and the measured step run under
    torch's own profiler with `profile_memory=True`: every allocation and free of the CPU
    allocator is an event with a signed size and a timestamp, and their running sum in time
    order is the live bytes above the profile's start. The peak is the bytes live at the
    profile's start plus the largest running sum inside the measured step (from a marker event
    `start` records). (Chosen over a TorchDispatchMode counting storages: the profiler sees the
    allocator itself, so it also counts what autograd, the optimizer and collectives allocate
    inside C++ kernels, and it costs far less per op.) The bytes live at the start are the
    storages of every tensor the Python heap reaches (parameters, buffers, pipeline receive
    buffers), deduplicated, after a garbage collection. The profile starts a step early
    (`open`, before that step loads its batch) because a block allocated before it has no free
    event (the profiler does not know its size): the previous step's outputs, gradients and
    batch, freed early in the measured step, would otherwise stay counted (the warm-up's batch
    did, until 2026-11-28: two batches of ResNet's images against the one a step holds). Frees
    on threads the profiler does not watch (gloo's workers sometimes release a collective's
    buffer) are handled in `running_peak`.

    `open` comes before the step loads its batch; `start` and `stop` bracket a step's work
    after `zero_grad`. On CPU the profiler slows a step
    of examples/gpt.py (4 layers, d_model 64) by about a fifth (10.7 -> 12.6 ms in one process;
    benchmarks/results/memory_cpu.csv has the noisier figure of whole runs), and `stop` takes
    a quarter of a second after the step's timing; so when later steps follow, the measured
    step is left out of the timings like the warm-up (`timing_warmup_steps`), and
    `train(..., measure_tensor_peak=False)` turns the measurement off.
    """

    MARKER = "TensorPeakMeter.measured_step"

    def __init__(self, device: torch.device, num_steps: int, enabled: bool = True, step: int = WARMUP_STEPS) -> None:
        self.device = device
        self.step = step
        """Which step (0-based, counted from the run's first) is measured."""
        self.enabled = enabled and num_steps > step
        self.peak_bytes: int | None = None
        """The measured peak, None until the measured step stops (or when disabled)."""
        self._num_steps = num_steps
        self._profiler: torch.profiler.profile | None = None
        self._base_bytes = 0

    def timing_warmup_steps(self) -> int:
        """Leading steps the timings skip: the warm-up, and on CPU the measured step when steps
        follow it (a run of WARMUP_STEPS + 1 steps has no other step to time)."""
        measured = self.enabled and self.device.type == "cpu" and self._num_steps > self.step + 1
        return self.step + 1 if measured else WARMUP_STEPS

    def open(self, step: int) -> None:
        """On CPU, at the step before the measured one: start the profile (`start` does it if
        this was not called). Call it before the step allocates anything, its batch included:
        what was live before the profile has no free event and would stay counted."""
        if not self.enabled or self.device.type == "cuda" or step != max(self.step - 1, 0) or self._profiler is not None:
            return
        from torch.profiler import ProfilerActivity, profile

        gc.collect()  # cyclic garbage (a module built for initialisation) is no tensor of the model
        self._base_bytes = live_tensor_bytes(self.device)
        self._profiler = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self._profiler.__enter__()

    def start(self, step: int) -> None:
        if not self.enabled:
            return
        if self.device.type == "cuda":
            if step == self.step:
                synchronize(self.device)
                torch.cuda.reset_peak_memory_stats(self.device)
            return
        self.open(step)
        if step == self.step:
            with torch.profiler.record_function(self.MARKER):
                pass

    def stop(self, step: int) -> None:
        if not self.enabled or step != self.step:
            return
        if self.device.type == "cuda":
            synchronize(self.device)
            self.peak_bytes = int(torch.cuda.max_memory_allocated(self.device))
            return
        prof, self._profiler = self._profiler, None
        assert prof is not None, "start() opened the profiler at the step before the measured one"
        prof.__exit__(None, None, None)
        gc.collect()
        self.peak_bytes = int(self._base_bytes + running_peak(prof, self.MARKER, live_storages(self.device)))


def running_peak(prof, marker: str, reachable: set[int]) -> int:
    """The most bytes allocated during a profile and live at once, from the start of the event
    named `marker` on: the running sum of its allocation events (frees negative) in time order.

    The CPU allocator reports only the threads the profiler watches. A block freed on another
    thread (gloo's workers release a collective's tensors) has no free event: a block with none
    that no Python object reaches after the step (`reachable`: storage addresses) is such a
    short-lived buffer and is left out; a block whose address a later allocation reuses was
    freed before that allocation."""
    from torch._C._profiler import _EventType

    events, since, stack = [], None, list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        stack.extend(node.children)
        if node.tag == _EventType.Allocation and node.extra_fields.device.type == "cpu":
            events.append((node.start_time_ns, node.extra_fields.ptr, node.extra_fields.alloc_size))
        elif node.name == marker:
            since = node.start_time_ns if since is None else min(since, node.start_time_ns)
    events.sort()
    open_blocks: dict[int, int] = {}  # address -> index of its live allocation
    for k, (_, ptr, nbytes) in enumerate(events):
        open_blocks.pop(ptr, None)  # freed by this event, or before this reuse of its address
        if nbytes > 0:
            open_blocks[ptr] = k
    leaked = {k for ptr, k in open_blocks.items() if ptr not in reachable}
    live, peak, open_blocks = 0, None, {}
    sizes: dict[int, int] = {}  # event index -> bytes of the allocation still live
    for k, (start_ns, ptr, nbytes) in enumerate(events):
        if since is not None and start_ns >= since and peak is None:
            peak = live  # the bytes live when the measured step began
        if ptr in open_blocks:  # freed (by an event, or before this reuse of its address)
            live -= sizes.pop(open_blocks.pop(ptr))
        if nbytes > 0 and k not in leaked:
            open_blocks[ptr], sizes[k] = k, nbytes
            live += nbytes
        if peak is not None:
            peak = max(peak, live)
    return live if peak is None else peak


def live_storages(device: torch.device) -> set[int]:
    """Addresses of the storages of every tensor on `device` that Python objects reach."""
    return set(_storages(device))


def live_tensor_bytes(device: torch.device) -> int:
    """Bytes of the distinct storages of every tensor on `device` that Python objects reach."""
    return sum(_storages(device).values())


def _storages(device: torch.device) -> dict[int, int]:
    storages: dict[int, int] = {}
    with warnings.catch_warnings():  # isinstance on deprecated torch aliases warns
        warnings.simplefilter("ignore")
        for obj in gc.get_objects():
            if not isinstance(obj, torch.Tensor) or obj.device.type != device.type:
                continue
            try:  # wrapper subclasses (DTensor) have no storage; their local tensor is counted itself
                storage = obj.untyped_storage()
                address, nbytes = storage.data_ptr(), storage.nbytes()
            except (RuntimeError, NotImplementedError):
                continue
            if address:
                storages[address] = max(storages.get(address, 0), nbytes)
    return storages


@dataclass
class RunResult:
    """What a run returns: its metrics (the file's content) and, beside them, its final parameters."""

    metrics: Metrics
    """Written to `--output` by rank 0."""
    params: dict[str, torch.Tensor]
    """Full (unsharded) final parameters by name for `--save-params` (parity tests); empty on
    ranks that keep none. Never part of the metrics file."""


def build_metrics(plan, losses, times, peaks, stage_times, params, world_size: int,
                  timeline: MeasuredTimeline | None = None, peak_tensor_bytes: list[int | None] | None = None,
                  warmup_steps: int = WARMUP_STEPS) -> RunResult:
    """The run's Metrics from what every rank measured, with the final `params` carried beside them;
    the median step time skips the first `warmup_steps` (`TensorPeakMeter.timing_warmup_steps`)."""
    from planner.validate import plan_digest

    after = times[warmup_steps:] or times[WARMUP_STEPS:] or times
    median = statistics.median(after) if after else float("nan")
    measured = [b for b in peak_tensor_bytes or () if b is not None]  # every rank's, or none
    metrics = Metrics(
        losses=losses,
        step_times_s=times,
        median_iteration_time_s=median,
        samples_per_s=plan.batch.global_batch_size / median,
        peak_memory_bytes=peaks,
        peak_tensor_bytes=measured if peak_tensor_bytes and len(measured) == len(peak_tensor_bytes) else None,
        stage_times_s=stage_times,
        timeline=timeline,
        world_size=world_size,
        cpu_threads=None if torch.cuda.is_available() else torch.get_num_threads(),
        prediction=plan.prediction,
        plan_sha256=plan_digest(plan),  # `planner validate` refuses another plan's metrics
    )
    return RunResult(metrics, params)
