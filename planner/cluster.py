"""A cluster: nodes x GPUs per node, one GPU spec, and the links between GPUs.

Presets come from planner/hardware.py (`make_cluster(gpus, gpus_per_node, gpu)`); files in
YAML or JSON (`load_cluster`) describe or override them, and `planner profile-cluster`
writes one from measurements. Link latencies of the presets are typical published values:
NVLink/NVSwitch about 3 us per hop for small NCCL messages and InfiniBand about 5 us
(NCCL tests on DGX A100/H100 report 5-10 us for 8-byte all-reduces in a node and 10-20 us
across nodes; per step of a ring that is a few us). The CPU preset stands for gloo over
loopback on one machine: ~2 GB/s and ~50 us per message are rough defaults, measured
clusters (`planner profile-cluster`) replace them.

File format (YAML or JSON):

    name: my-cluster            # optional
    gpu: a100-80gb              # a preset, or {preset: a100-80gb, memory_bytes: ..., peak_flops: {...}, ...}
    num_nodes: 4
    gpus_per_node: 8
    intra_node: {bandwidth_bytes_per_s: 3.0e11, latency_s: 3.0e-6}   # optional, else from the preset
    inter_node: {bandwidth_bytes_per_s: 2.5e10, latency_s: 5.0e-6}
    fitted: {all_reduce: {latency_s: ..., bandwidth_bytes_per_s: ...}, ...}   # written by profile-cluster

A file may instead list `nodes: [{gpu: a100-80gb, count: 2, gpus_per_node: 8}, ...]`;
nodes of different GPU types are parsed and rejected (not supported yet).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

from planner.errors import PlannerError
from planner.hardware import GPUSpec, get_gpu

# Per-message latency of one hop, seconds (module docstring).
NVLINK_LATENCY_S = 3e-6
NETWORK_LATENCY_S = 5e-6
GLOO_LATENCY_S = 50e-6


@dataclass(frozen=True)
class Link:
    bandwidth_bytes_per_s: float
    """Per GPU, per direction."""
    latency_s: float
    """Fixed cost of one message."""


@dataclass(frozen=True)
class Cluster:
    name: str
    """Preset name or file stem."""
    gpu: GPUSpec
    """The accelerator every node has."""
    num_nodes: int
    """Nodes."""
    gpus_per_node: int
    """GPUs (or gloo processes) per node."""
    intra_node: Link
    """Between GPUs of one node."""
    inter_node: Link
    """Between GPUs of different nodes."""
    fitted: dict = field(default_factory=dict, hash=False, compare=False)
    """Per-collective fits from `planner profile-cluster` (used for groups inside one node)."""

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.gpus_per_node

    def to_ref(self) -> dict:
        return {"name": self.name, "num_nodes": self.num_nodes, "gpus_per_node": self.gpus_per_node, "gpu": self.gpu.name}


def _default_links(gpu: GPUSpec) -> tuple[Link, Link]:
    latency = GLOO_LATENCY_S if gpu.name == "cpu" else NVLINK_LATENCY_S
    inter = GLOO_LATENCY_S if gpu.name == "cpu" else NETWORK_LATENCY_S
    return Link(gpu.intra_node_bandwidth_bytes_per_s, latency), Link(gpu.inter_node_bandwidth_bytes_per_s, inter)


def make_cluster(gpus: int, gpus_per_node: int | None = None, gpu: str = "a100-80gb") -> Cluster:
    """A cluster of `gpus` preset GPUs, `gpus_per_node` per node (default min(gpus, 8); cpu: all)."""
    spec = get_gpu(gpu)
    if gpus < 1:
        raise PlannerError(f"--gpus must be positive (got {gpus}).", "Pass the number of GPUs to plan for.")
    per_node = gpus_per_node or (gpus if spec.name == "cpu" else min(gpus, 8))
    if per_node < 1 or gpus % per_node:
        raise PlannerError(
            f"{gpus} GPUs do not split into nodes of {per_node}.",
            "Make --gpus a multiple of --gpus-per-node.",
        )
    intra, inter = _default_links(spec)
    return Cluster(f"{spec.name}x{gpus}", spec, gpus // per_node, per_node, intra, inter)


def _positive(value, what: str, source: str) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise PlannerError(f"{source}: {what} must be a number (got {value!r}).", "Fix the cluster file.") from None
    if not number > 0:
        raise PlannerError(f"{source}: {what} must be positive (got {value!r}).", "Fix the cluster file.")
    return number


def _gpu_from(entry, source: str) -> GPUSpec:
    if isinstance(entry, str):
        return get_gpu(entry)
    if isinstance(entry, dict) and "preset" in entry:
        spec = get_gpu(entry["preset"])
        known = {f.name for f in fields(GPUSpec)} - {"name"}
        unknown = set(entry) - known - {"preset", "name"}
        if unknown:
            raise PlannerError(f"{source}: unknown GPU fields {sorted(unknown)}.", f"Known fields: {sorted(known)}.")
        overrides = {k: v for k, v in entry.items() if k in known}
        return replace(spec, name=entry.get("name", spec.name), **overrides)
    raise PlannerError(f"{source}: `gpu` must be a preset name or {{preset: NAME, ...overrides}}.", "Example: gpu: a100-80gb")


def _link(entry, default: Link, what: str, source: str) -> Link:
    if entry is None:
        return default
    if not isinstance(entry, dict):
        raise PlannerError(f"{source}: `{what}` must be a mapping.", "Example: {bandwidth_bytes_per_s: 3.0e11, latency_s: 3.0e-6}")
    return Link(
        _positive(entry.get("bandwidth_bytes_per_s", default.bandwidth_bytes_per_s), f"{what}.bandwidth_bytes_per_s", source),
        _positive(entry.get("latency_s", default.latency_s), f"{what}.latency_s", source),
    )


def parse_cluster(data, source: str = "cluster") -> Cluster:
    if not isinstance(data, dict):
        raise PlannerError(f"{source} is not a cluster description (expected a mapping).", "See planner/cluster.py for the format.")
    if "nodes" in data:
        nodes = data["nodes"]
        if not isinstance(nodes, list) or not nodes or not all(isinstance(n, dict) and "gpu" in n for n in nodes):
            raise PlannerError(f"{source}: `nodes` must be a list of {{gpu, count, gpus_per_node}}.", "Fix the cluster file.")
        kinds = {(_gpu_from(n["gpu"], source).name, int(n.get("gpus_per_node", 8))) for n in nodes}
        if len(kinds) > 1:
            raise PlannerError(
                f"{source} mixes node types {sorted(kinds)}: heterogeneous clusters are not supported yet.",
                "Plan for one node type at a time (a cluster file with a single `gpu`).",
            )
        (gpu_name, per_node), = kinds
        data = {**{k: v for k, v in data.items() if k != "nodes"}, "gpu": nodes[0]["gpu"],
                "num_nodes": sum(int(n.get("count", 1)) for n in nodes), "gpus_per_node": per_node}
    if "gpu" not in data:
        raise PlannerError(f"{source}: missing `gpu`.", "Add e.g. `gpu: a100-80gb`.")
    gpu = _gpu_from(data["gpu"], source)
    num_nodes = int(_positive(data.get("num_nodes", 1), "num_nodes", source))
    per_node = int(_positive(data.get("gpus_per_node", 8), "gpus_per_node", source))
    intra, inter = _default_links(gpu)
    fitted = data.get("fitted") or {}
    if not isinstance(fitted, dict):
        raise PlannerError(f"{source}: `fitted` must be a mapping.", "Re-create the file with `planner profile-cluster`.")
    return Cluster(
        name=str(data.get("name", Path(source).stem)),
        gpu=gpu,
        num_nodes=num_nodes,
        gpus_per_node=per_node,
        intra_node=_link(data.get("intra_node"), intra, "intra_node", source),
        inter_node=_link(data.get("inter_node"), inter, "inter_node", source),
        fitted=fitted,
    )


def load_cluster(path: str | Path) -> Cluster:
    path = Path(path)
    if not path.is_file():
        raise PlannerError(f"Cluster file {path} does not exist.", "Write one (see planner/cluster.py) or use --gpus N --gpu NAME.")
    text = path.read_text()
    try:
        if path.suffix == ".json":
            data = json.loads(text)
        else:
            import yaml

            data = yaml.safe_load(text)
    except Exception as exc:  # yaml and json raise their own error types
        raise PlannerError(f"Cluster file {path} cannot be parsed ({exc}).", "Fix its YAML/JSON syntax.") from None
    return parse_cluster(data, str(path))


def cluster_data(cluster: Cluster) -> dict:
    preset = get_gpu(cluster.gpu.name) if cluster.gpu.name in _preset_names() else None
    gpu: object = cluster.gpu.name
    if preset is None or preset != cluster.gpu:
        gpu = {"preset": preset.name if preset else "cpu", **{k: v for k, v in asdict(cluster.gpu).items()}}
    return {
        "name": cluster.name,
        "gpu": gpu,
        "num_nodes": cluster.num_nodes,
        "gpus_per_node": cluster.gpus_per_node,
        "intra_node": asdict(cluster.intra_node),
        "inter_node": asdict(cluster.inter_node),
        **({"fitted": cluster.fitted} if cluster.fitted else {}),
    }


def _preset_names() -> set[str]:
    from planner.hardware import GPUS

    return set(GPUS)


def save_cluster(cluster: Cluster, path: str | Path) -> Path:
    import yaml

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(cluster_data(cluster), sort_keys=False))
    return path
