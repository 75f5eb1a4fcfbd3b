"""The cluster file's schema: what `load_cluster` (planner/cluster.py) accepts, checked by pydantic.

The file form (YAML or JSON) is described in planner/cluster.py's docstring and published by
`planner schema cluster`; planner/cluster.py turns a validated `ClusterFile` into a `Cluster`.
Every problem becomes one PlannerError that names each bad field (`validate_cluster_file`).

Numbers go through `_number` rather than pydantic's float: YAML reads `1e10` (no dot) as a
string, which float() accepts, and a boolean is refused rather than read as 0 or 1.
"""

from __future__ import annotations

import math
from dataclasses import fields
from types import UnionType
from typing import Annotated, Union, get_args, get_origin

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    model_validator,
)
from pydantic_core import PydanticCustomError

from planner.errors import PlannerError
from planner.hardware import ALIASES, GPUS, GPUSpec

HINT = "Fix the cluster file (format: planner/cluster.py, examples: profiles/clusters/)."


def _number(value, least: str = "positive") -> float:
    if isinstance(value, bool):
        raise PydanticCustomError("not_a_number", "must be a number (got a boolean)")
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise PydanticCustomError("not_a_number", "must be a number (got {value})", {"value": repr(value)}) from None
    if not ((number >= 0 if least == "0 or positive" else number > 0) and math.isfinite(number)):
        raise PydanticCustomError("out_of_range", "must be {least} and finite (got {value})", {"least": least, "value": repr(value)})
    return number


def _count(value) -> int:
    """A positive whole number (2.0 is accepted, 2.5 is not)."""
    number = _number(value)
    if number != int(number):
        raise PydanticCustomError("out_of_range", "must be a whole number (got {value})", {"value": repr(value)})
    return int(number)


def _slowdown(value) -> float:
    number = _number(value)
    if number < 1.0:
        raise PydanticCustomError("out_of_range", "must be at least 1 (got {value}): sharing a node never speeds a device up",
                                  {"value": repr(value)})
    return number


def _known_gpu(name: str) -> str:
    if ALIASES.get(name.lower(), name.lower()) not in GPUS:
        raise PydanticCustomError("unknown_gpu", "Unknown GPU {name}.", {"name": repr(name)})
    return name


Positive = Annotated[float, Field(gt=0), BeforeValidator(_number)]
NonNegative = Annotated[float, Field(ge=0), BeforeValidator(lambda v: _number(v, "0 or positive"))]
Count = Annotated[int, Field(gt=0), BeforeValidator(_count)]
Slowdown = Annotated[float, Field(ge=1), BeforeValidator(_slowdown)]
GPUName = Annotated[str, AfterValidator(_known_gpu), Field(examples=sorted(GPUS))]
"""A preset of planner/hardware.py (case-insensitive; a few aliases)."""
Name = Annotated[str, Field(coerce_numbers_to_str=True)]  # `name: 2024` is a name, as before the schema


class _Model(BaseModel):
    model_config = ConfigDict(use_attribute_docstrings=True, extra="forbid")


class GPUOverride(_Model):
    """A preset GPU with some of its numbers replaced (planner/hardware.py GPUSpec)."""

    preset: GPUName
    """The GPU whose other numbers are kept."""
    name: Name | None = None
    """Name of the modified GPU (default: the preset's)."""
    peak_flops: dict[str, Positive] | None = Field(default=None, min_length=1)
    """Dense peak FLOP/s per dtype name, merged over the preset's."""
    memory_bytes: Count | None = None
    """Device memory, bytes."""
    memory_bandwidth_bytes_per_s: Positive | None = None
    """HBM bandwidth, bytes/s."""
    intra_node_bandwidth_bytes_per_s: Positive | None = None
    """NVLink/NVSwitch bandwidth per GPU per direction, bytes/s (the default intra-node link follows it)."""
    inter_node_bandwidth_bytes_per_s: Positive | None = None
    """Network bandwidth per GPU per direction, bytes/s (the default inter-node link follows it)."""
    nvls_all_reduce_bytes_per_s: Positive | None = None
    """Bytes all-reduced per second by NCCL's NVLink SHARP inside a node (default: the preset's)."""
    matmul_efficiency: Positive | None = None
    """Fraction of peak FLOP/s a transformer block's matrix products sustain."""
    memory_efficiency: Positive | None = None
    """Fraction of peak memory bandwidth streaming kernels reach."""
    attention_efficiency: Positive | None = None
    """Fraction of the dense peak a fused attention kernel's forward sustains without a mask
    (default: the preset's; a stack running FlashAttention-3 or cuDNN's attention sets its own)."""
    attention_backward_ratio: Positive | None = None
    """With attention_efficiency: the backward's rate over the forward's, in FlashAttention's count."""
    attention_causal_ratio: Positive | None = None
    """With attention_efficiency: a causal kernel's rate over the unmasked one's, in FlashAttention's count."""
    kernel_overhead_s: Positive | None = None
    """Fixed cost per kernel, seconds."""
    fp8_relative_efficiency: Positive | None = None
    """An FP8 GEMM's fraction of the FP8 peak over a bf16 GEMM's of the bf16 peak (default: the preset's)."""


assert set(GPUOverride.model_fields) == {f.name for f in fields(GPUSpec)} | {"preset"}, "GPUOverride must follow GPUSpec"


def _gpu_tag(value) -> str | None:
    return "preset-name" if isinstance(value, str) else "preset-override" if isinstance(value, dict) else None


GPUEntry = Annotated[
    Union[Annotated[GPUName, Tag("preset-name")], Annotated[GPUOverride, Tag("preset-override")]],
    Discriminator(_gpu_tag, custom_error_type="gpu_entry", custom_error_message="must be a preset name or a mapping"),
]
"""`gpu: NAME` or `gpu: {preset: NAME, <GPUSpec field>: value, ...}`."""
_TAGS = {"preset-name", "preset-override"}  # discriminator tags pydantic puts in error locations


class LinkFile(_Model):
    """A link between two GPUs; a number left out keeps the GPU preset's."""

    bandwidth_bytes_per_s: Positive | None = None
    """Per GPU, per direction, bytes/s."""
    latency_s: Positive | None = None
    """Fixed cost of one message (p2p, all-to-all; a ring step of gloo's collectives; NCCL's collectives use NCCL's own), seconds."""


class CollectiveFit(_Model):
    """One collective's alpha-beta fit from `planner profile-cluster` (planner/cluster_probe.py)."""

    latency_s: Positive
    """Fixed cost of one operation, seconds."""
    bandwidth_bytes_per_s: Positive
    """Bytes each rank moves per second once the latency is paid."""
    num_ranks: Count | None = None
    """Processes the collective was measured over."""
    num_nodes: Count | None = None
    """Nodes those processes spanned (a fit across nodes is not used inside one)."""
    method: str | None = None
    """The torch.distributed call that was timed."""
    points: list[list[float]] = []
    """The measurements: [message bytes, seconds] pairs."""


class NodeGroup(_Model):
    """Nodes of one type, in a `nodes` list."""

    gpu: GPUEntry
    """The nodes' GPU."""
    count: Count = 1
    """Nodes of this type."""
    gpus_per_node: Count = 8
    """GPUs per node."""


class ClusterFile(_Model):
    """A cluster file (YAML or JSON); format and examples: planner/cluster.py, profiles/clusters/."""

    name: Name | None = None
    """Cluster name (default: the file's stem)."""
    gpu: GPUEntry | None = None
    """Every node's GPU: a preset name or {preset, overrides}. Required unless `nodes` is given."""
    num_nodes: Count = 1
    """Nodes."""
    gpus_per_node: Count = 8
    """GPUs (or gloo processes) per node."""
    intra_node: LinkFile | None = None
    """Between GPUs of one node (default: the GPU preset's NVLink at NVLINK_EFFICIENCY, NVLINK_LATENCY_S)."""
    inter_node: LinkFile | None = None
    """Between GPUs of different nodes (default: the preset's network at NETWORK_EFFICIENCY, NETWORK_LATENCY_S)."""
    fitted: dict[str, CollectiveFit] = {}
    """Per-collective fits by name (all_reduce, all_gather, p2p, ...), written by `planner profile-cluster`."""
    nodes: list[NodeGroup] | None = Field(default=None, min_length=1)
    """Instead of gpu/num_nodes/gpus_per_node: node groups (all of one type; mixed types are refused)."""
    compute_slowdown: Slowdown = 1.0
    """Compute time with every device of a node busy / one alone (CPU; see Cluster.compute_slowdown)."""
    pipeline_overhead_s: NonNegative = 0.0
    """What a pipelined micro-batch costs a stage beyond compute and bytes, seconds (see Cluster)."""

    @model_validator(mode="after")
    def _one_form(self) -> "ClusterFile":
        if self.nodes is not None and self.model_fields_set & {"gpu", "num_nodes", "gpus_per_node"}:
            raise PydanticCustomError("both_forms", "give either `nodes` or `gpu`/`num_nodes`/`gpus_per_node`, not both.")
        if self.nodes is None and self.gpu is None:
            raise PydanticCustomError("missing_gpu", "missing `gpu`.")
        return self


# What a container holds, for the message when it holds something else: by pydantic's error
# type, or more precisely by the field's name.
_STRUCTURE = {"model_type": "a mapping", "model_attributes_type": "a mapping", "dict_type": "a mapping", "list_type": "a list",
              "too_short": "non-empty", "gpu_entry": "a preset name or a mapping"}
_SHAPES = {"gpu": "a preset name or {preset: NAME, ...overrides}", "peak_flops": "a mapping of dtype names to FLOP/s",
           "intra_node": "a mapping {bandwidth_bytes_per_s, latency_s}", "inter_node": "a mapping {bandwidth_bytes_per_s, latency_s}",
           "fitted": "a mapping of collective names to fits (re-create it with `planner profile-cluster`)",
           "nodes": "a non-empty list of {gpu, count, gpus_per_node}", "points": "a list of [bytes, seconds] pairs"}
_EXAMPLEHINTS = {"gpu": "Example: gpu: a100-80gb", "peak_flops": "Example: {bfloat16: 3.12e14}",
                  "missing_gpu": "Add e.g. `gpu: a100-80gb`."}


def _where(loc) -> str:
    """`nodes[0].gpu.peak_flops` from pydantic's location tuple (discriminator tags dropped)."""
    text = ""
    for key in loc:
        if key in _TAGS:
            continue
        text += f"[{key}]" if isinstance(key, int) else f".{key}" if text else str(key)
    return text


def _unwrap(tp, want) -> object | None:
    """The first type inside Annotated/Union/Optional `tp` that `want` accepts, or None."""
    if get_origin(tp) is Annotated:
        return _unwrap(get_args(tp)[0], want)
    if get_origin(tp) in (Union, UnionType):
        return next((t for t in (_unwrap(a, want) for a in get_args(tp)) if t is not None), None)
    return tp if want(tp) else None


def _model_at(loc) -> type[BaseModel] | None:
    """The model a location of the file lands in (for the known-fields hint)."""
    def is_model(tp):
        return isinstance(tp, type) and issubclass(tp, BaseModel)

    def model_in(tp) -> type[BaseModel] | None:
        found = _unwrap(tp, is_model)
        return found if isinstance(found, type) and issubclass(found, BaseModel) else None

    tp: object = ClusterFile
    for key in loc:
        model = model_in(tp)
        if model is not None and key in model.model_fields:
            tp = model.model_fields[key].annotation
        elif key not in _TAGS:  # a key of a mapping or an index of a list
            tp = get_args(_unwrap(tp, lambda t: get_origin(t) in (dict, list)))[-1]
    return model_in(tp)


def _explain(exc: ValidationError, source: str) -> PlannerError:
    """One PlannerError listing every problem of a cluster file, each naming its field."""
    problems: list[str] = []
    hints: list[str] = []
    unknown: dict[tuple, list[str]] = {}
    for err in exc.errors():
        loc, kind = tuple(err["loc"]), err["type"]
        where = _where(loc)
        last = str(next((k for k in reversed(loc) if k not in _TAGS), ""))  # the field's name, for _SHAPES
        if kind == "extra_forbidden":
            unknown.setdefault(loc[:-1], []).append(str(loc[-1]))
            continue
        if kind in ("not_a_number", "out_of_range"):
            problems.append(f"{where} {err['msg']}")
            hints.append(HINT)
        elif kind == "unknown_gpu":
            problems.append(f"{where}: {err['msg']}")
            hints.append(f"Known GPUs: {', '.join(sorted(GPUS))}.")
        elif kind == "missing":
            problems.append(f"missing `{where}`.")
            hints.append(HINT)
        elif not loc:  # the model validator's own messages
            problems.append(err["msg"])
            hints.append(_EXAMPLEHINTS.get(kind, HINT))
        elif kind in _STRUCTURE:
            problems.append(f"`{where}` must be {_SHAPES.get(last, _STRUCTURE[kind])}.")
            hints.append(_EXAMPLEHINTS.get(last, HINT))
        else:
            problems.append(f"{where}: {err['msg']}")
            hints.append(HINT)
    for parent, keys in unknown.items():
        model = _model_at(parent)
        problems.append(f"unknown {_where(parent) + ' ' if parent else ''}fields {sorted(keys)}.")
        hints.append(f"Known fields: {sorted(model.model_fields) if model else '(see `planner schema cluster`)'}.")
    hint = "\n".join(dict.fromkeys(hints))
    if len(problems) == 1:
        return PlannerError(f"{source}: {problems[0]}", hint)
    return PlannerError(f"{source}:\n" + "\n".join(f"  {p}" for p in problems), hint)


def validate_cluster_file(data, source: str) -> ClusterFile:
    """A parsed YAML/JSON value as a ClusterFile, or a PlannerError naming `source` and every bad field."""
    if not isinstance(data, dict):
        raise PlannerError(f"{source} is not a cluster description (expected a mapping).", HINT)
    try:
        return ClusterFile.model_validate(data)
    except ValidationError as exc:
        raise _explain(exc, source) from None
