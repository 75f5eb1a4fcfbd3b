"""What a run measures: step times, per-stage forward/backward times, peak memory.

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
import statistics
import time
from collections import defaultdict
from dataclasses import dataclass

import torch

from planner.metrics_schema import MeasuredTimeline, Metrics, StageTime, TimelineEvent

WARMUP_STEPS = 1


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued kernels (CUDA); a no-op on CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timeline_of(per_rank_events: list[list[tuple]], schedule: str, num_ranks: int) -> MeasuredTimeline:
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

    def __init__(self, device: torch.device) -> None:
        self.device = device
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
            if self.step >= WARMUP_STEPS:
                self._seconds[(stage, kind)] += time.perf_counter() - start
                self._forwards[stage] += kind == "forward"

    def record(self, stage_times: dict[int, dict[str, float]], num_microbatches: int) -> None:
        """Add one step's per-stage sums over its micro-batches (a PipelineRunner's `stage_times`)."""
        if self.step < WARMUP_STEPS:
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


@dataclass
class RunResult:
    """What a run returns: its metrics (the file's content) and, beside them, its final parameters."""

    metrics: Metrics
    """Written to `--output` by rank 0."""
    params: dict[str, torch.Tensor]
    """Full (unsharded) final parameters by name for `--save-params` (parity tests); empty on
    ranks that keep none. Never part of the metrics file."""


def build_metrics(plan, losses, times, peaks, stage_times, params, world_size: int,
                  timeline: MeasuredTimeline | None = None) -> RunResult:
    """The run's Metrics from what every rank measured, with the final `params` carried beside them."""
    from planner.validate import plan_digest

    after = times[WARMUP_STEPS:] or times
    median = statistics.median(after) if after else float("nan")
    metrics = Metrics(
        losses=losses,
        step_times_s=times,
        median_iteration_time_s=median,
        samples_per_s=plan.batch.global_batch_size / median,
        peak_memory_bytes=peaks,
        stage_times_s=stage_times,
        timeline=timeline,
        world_size=world_size,
        cpu_threads=None if torch.cuda.is_available() else torch.get_num_threads(),
        prediction=plan.prediction,
        plan_sha256=plan_digest(plan),  # `planner validate` refuses another plan's metrics
    )
    return RunResult(metrics, params)
