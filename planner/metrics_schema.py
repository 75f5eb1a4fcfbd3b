"""The metrics file: what one run of a plan measured, held against the plan by `planner validate`.

The runtime builds a `Metrics` (runtime/metrics.py `build_metrics`) and rank 0 writes it with
`model_dump_json` (`planner run PLAN --output FILE`); `load_metrics` reads it back. It lives
here, not in runtime/, so that `planner validate` reads it without importing the training
code. Times are seconds, memory bytes. `planner schema metrics` prints its JSON schema.

Files written before `schema_version` existed are version 1; fields added since (the plan
fingerprint, the pipeline timeline, the CPU thread count, per-stage times, the tensor peak)
default to "not recorded", so those files still load.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from planner.errors import PlannerError
from planner.plan import Prediction, Schedule

METRICS_SCHEMA_VERSION = 1


class _Model(BaseModel):
    # NaN and infinities are written as JSON's NaN/Infinity (as json.dumps did), not as null: a
    # diverged loss must read back as the float it was.
    model_config = ConfigDict(use_attribute_docstrings=True, extra="forbid", ser_json_inf_nan="constants")


class StageTime(_Model):
    """One pipeline stage's compute per micro-batch, mean over the timed steps."""

    forward_s: float = Field(ge=0)
    """Forward of one micro-batch (the last stage's includes the loss), seconds."""
    backward_s: float = Field(ge=0)
    """Backward of one micro-batch (zero-bubble: input- and weight-gradient halves together), seconds."""


class TimelineEvent(_Model):
    """One pipeline action of the last step, as it ran."""

    rank: int = Field(ge=0)
    """Pipeline rank that ran it."""
    chunk: int = Field(ge=0)
    """Global stage index (lives on pipeline rank chunk % num_ranks)."""
    microbatch: int = Field(ge=0)
    """Micro-batch index, 0-based."""
    kind: Literal["F", "BW", "B", "W"]
    """F forward, BW full backward, B input gradient, W weight gradient (planner/cost/simulator.py)."""
    start_s: float
    """Start, seconds after the step's first action started (wall clock)."""
    end_s: float
    """End, seconds after the step's first action started."""


class MeasuredTimeline(_Model):
    """The last step's actions of one pipeline (data- and tensor-parallel rank 0), for a measured Gantt."""

    schedule: Schedule
    """The plan's pipeline schedule."""
    num_ranks: int = Field(gt=0)
    """Pipeline ranks (the plan's pp_degree)."""
    events: list[TimelineEvent]
    """Every rank's actions; ranks on one machine share its clock, across nodes as well as their clocks agree."""


class Metrics(_Model):
    """A metrics file (`planner run PLAN --output FILE`)."""

    schema_version: int = METRICS_SCHEMA_VERSION
    """Bumped when a field changes meaning."""
    losses: list[float]
    """Training loss of every step: the mean over the global batch."""
    step_times_s: list[float]
    """Wall time of every step, seconds (rank 0's)."""
    median_iteration_time_s: float
    """Median step time after the warm-up step (runtime/metrics.py WARMUP_STEPS) and, on CPU when
    later steps follow it, the step whose tensor peak was measured under the profiler, seconds."""
    samples_per_s: float
    """global_batch_size / median_iteration_time_s."""
    peak_memory_bytes: list[int]
    """Per rank: CUDA's max_memory_allocated, or on CPU the process's resident set (interpreter included)."""
    peak_tensor_bytes: list[int] | None = None
    """Per rank: peak bytes of the rank's tensors during the first step after the warm-up, the
    quantity the plan's memory model predicts (runtime/metrics.py `TensorPeakMeter`: CUDA's
    max_memory_allocated over that step; on CPU torch's profiler memory events over it plus the
    bytes live at its start). None when not measured (turned off with runtime/train.py
    `train(..., measure_tensor_peak=False)`, a run of fewer than two steps, or an older run)."""
    stage_times_s: dict[int, StageTime] = {}
    """Per stage index (JSON keys are strings): the slowest of the ranks holding it. Empty in runs
    older than per-stage timing."""
    timeline: MeasuredTimeline | None = None
    """The last step's pipeline actions; None when the plan is not pipelined (or the run is older)."""
    world_size: int = Field(gt=0)
    """Processes the run used."""
    cpu_threads: int | None = None
    """On CPU, torch threads per process; None on CUDA (or in older runs)."""
    prediction: Prediction | None = None
    """The plan's prediction as the run read it; None for a hand-written plan."""
    plan_sha256: str | None = None
    """Fingerprint of the plan that ran (planner/validate.py plan_digest); `planner validate`
    refuses another plan's metrics. None in older runs (then the prediction and world size are compared)."""
    plan: str | None = None
    """The plan file as given to the runtime."""
    reference: bool = False
    """A one-process run without parallelism (`--reference`)."""

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.model_dump_json(indent=1))
        return path


def load_metrics(path: str | Path) -> Metrics:
    """Read and validate a metrics file; every problem is a PlannerError naming the field."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise PlannerError(f"Metrics file {path} does not exist.", "Create one with `planner run PLAN --output FILE`.") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise PlannerError(f"Metrics file {path} is not valid JSON ({exc}).", "Re-run the plan.") from None
    if not isinstance(data, dict) or "median_iteration_time_s" not in data:
        raise PlannerError(f"{path} is not a metrics file from `planner run`.", "Pass the file written by --output.")
    if data.get("schema_version", METRICS_SCHEMA_VERSION) != METRICS_SCHEMA_VERSION:
        raise PlannerError(f"Metrics file {path} has schema version {data.get('schema_version')}; this planner reads "
                           f"{METRICS_SCHEMA_VERSION}.", "Re-run the plan with this version's `planner run`.")
    try:
        return Metrics.model_validate(data)
    except ValidationError as exc:
        lines = [f"  {'.'.join(str(p) for p in err['loc']) or '(metrics)'}: {err['msg']}" for err in exc.errors()]
        raise PlannerError(f"Metrics file {path} does not match the schema:\n" + "\n".join(lines),
                           "Re-run the plan with `planner run PLAN --output FILE` (fields: `planner schema metrics`).") from None
