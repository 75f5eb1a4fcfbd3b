"""A cluster: nodes x GPUs per node, one GPU spec, and the links between GPUs.

Presets come from planner/hardware.py (`make_cluster(gpus, gpus_per_node, gpu)`); files in
YAML or JSON (`load_cluster`) describe or override them, and `planner profile-cluster`
writes one from measurements. Link bandwidths are the GPU preset's (NVLink per GPU per
direction inside a node, one NIC per GPU across nodes). Link latencies are typical
published values, per message: what a point-to-point send and NCCL's all-to-all (grouped
sends) pay, and gloo's collectives per step. NCCL's collectives take NCCL's own per-hop
latencies by protocol instead (planner/cost/nccl.py):

- NVLink/NVSwitch ~3 us: NCCL tests on DGX A100/H100 report 5-10 us for a small
  all-reduce inside a node, a few us of which is per-step link latency.
- InfiniBand ~5 us: small-message RDMA latency is 1-2 us, and NCCL's per-step cost across
  nodes (proxy thread, network plugin) is about 5 us; 10-20 us small all-reduces across
  nodes are typical in nccl-tests results.
- CPU preset (gloo over loopback TCP on one machine): ~2 GB/s and ~50 us per message are
  rough defaults, not measurements; `planner profile-cluster` replaces them.

Achievable bandwidth. A preset link carries what collectives reach, not the wire rate:
public nccl-tests results (all_reduce_perf bus bandwidth, the ring's per-rank rate) on 8
A100-SXM GPUs over NVLink 3 / NVSwitch (300 GB/s per direction) report about 200-235 GB/s
(NVIDIA/nccl-tests issues #149 and #178), so NVLink links get `NVLINK_EFFICIENCY` 0.75 of
the data-sheet rate; across nodes, HDR InfiniBand reached 85-96 of 100 GB/s per node
(nccl-tests issue #119), so network links get `NETWORK_EFFICIENCY` 0.9. A measured cluster
(`planner profile-cluster`) replaces both with its fits.

File format (YAML or JSON; profiles/clusters/ holds one file per preset):

    name: my-cluster            # optional, else the file stem
    gpu: a100-80gb              # a preset, or {preset: a100-80gb, memory_bytes: ..., peak_flops: {...}, ...}
    num_nodes: 4
    gpus_per_node: 8
    intra_node: {bandwidth_bytes_per_s: 3.0e11, latency_s: 3.0e-6}   # optional, else from the preset
    inter_node: {bandwidth_bytes_per_s: 2.5e10, latency_s: 5.0e-6}
    fitted: {all_reduce: {latency_s: ..., bandwidth_bytes_per_s: ...}, ...}   # written by profile-cluster
    compute_slowdown: 1.3       # optional (CPU): compute time with every process busy / one alone
    pipeline_overhead_s: 8.0e-4 # optional: what a pipelined micro-batch costs a stage beyond compute and bytes

A file may instead list `nodes: [{gpu: a100-80gb, count: 2, gpus_per_node: 8}, ...]`;
nodes of different GPU types are parsed and rejected (not supported yet). The file's schema
(`ClusterFile`, each field's meaning and bounds, the error messages) is planner/cluster_schema.py;
`planner schema cluster` prints it as JSON schema.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from planner.errors import PlannerError
from planner.hardware import GPUS, GPUSpec, get_gpu

if TYPE_CHECKING:  # the schema is imported where a file is read: `planner solve --gpus` reads none
    from planner.cluster_schema import GPUOverride, LinkFile, NodeGroup

# Per-message latency of one hop, seconds (module docstring).
NVLINK_LATENCY_S = 3e-6
NETWORK_LATENCY_S = 5e-6
GLOO_LATENCY_S = 50e-6
# Share of the data-sheet link bandwidth collectives reach (module docstring).
NVLINK_EFFICIENCY = 0.75
NETWORK_EFFICIENCY = 0.9


@dataclass(frozen=True)
class Link:
    """One kind of connection between two GPUs, alpha-beta style."""

    bandwidth_bytes_per_s: float
    """Per GPU, per direction."""
    latency_s: float
    """Fixed cost of one message (p2p, all-to-all; a ring step of gloo's collectives)."""


@dataclass(frozen=True)
class Cluster:
    """Identical nodes of identical GPUs."""

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
    fitted: dict[str, dict] = field(default_factory=dict, hash=False, compare=False)
    """Per-collective fits from `planner profile-cluster`, e.g. `{"all_reduce": {"latency_s",
    "bandwidth_bytes_per_s", "num_ranks", "points"}}`; used for groups inside one node."""
    compute_slowdown: float = 1.0
    """How much slower a device computes while every device of its node computes at once than
    alone. 1 for GPUs (each is its own chip). Processes sharing a CPU share its cores, caches
    and memory bandwidth (on a 2-vCPU VM, possibly one physical core): `planner profile-cluster`
    measures it on gloo, and the cost model multiplies profiled compute times by it, since a
    profile is measured by one process alone."""
    pipeline_overhead_s: float = 0.0
    """Time one micro-batch costs each pipeline stage (forward and backward together) beyond its
    compute and the bytes it sends: the schedule's bookkeeping, posting and waiting on p2p
    operations, waking the receiver. `planner profile-cluster` measures it by running torch's
    1F1B schedule over two stages that compute next to nothing (0.8 ms on gloo on a 2-vCPU
    VM, more than a stage of a small model computes); presets leave it 0."""

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.gpus_per_node

    @property
    def backend(self) -> str:
        """The collective library its processes use: gloo on the CPU preset, NCCL on GPUs (as `planner run` launches them)."""
        return "gloo" if self.gpu.name == "cpu" else "nccl"

    def to_ref(self) -> dict:
        """The plan file's ClusterRef."""
        return {"name": self.name, "num_nodes": self.num_nodes, "gpus_per_node": self.gpus_per_node, "gpu": self.gpu.name}


def default_links(gpu: GPUSpec) -> tuple[Link, Link]:
    """(intra-node, inter-node) links of a preset GPU (latencies: module docstring)."""
    if gpu.name == "cpu":
        return (Link(gpu.intra_node_bandwidth_bytes_per_s, GLOO_LATENCY_S), Link(gpu.inter_node_bandwidth_bytes_per_s, GLOO_LATENCY_S))
    return (Link(gpu.intra_node_bandwidth_bytes_per_s * NVLINK_EFFICIENCY, NVLINK_LATENCY_S),
            Link(gpu.inter_node_bandwidth_bytes_per_s * NETWORK_EFFICIENCY, NETWORK_LATENCY_S))


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
    intra, inter = default_links(spec)
    return Cluster(f"{spec.name}x{gpus}", spec, gpus // per_node, per_node, intra, inter)


def _gpu_spec(entry: str | GPUOverride) -> GPUSpec:
    if isinstance(entry, str):
        return get_gpu(entry)
    spec = get_gpu(entry.preset)
    overrides = entry.model_dump(exclude_none=True, exclude={"preset", "name", "peak_flops"})
    if entry.peak_flops:
        overrides["peak_flops"] = {**spec.peak_flops, **entry.peak_flops}
    return replace(spec, name=entry.name or spec.name, **overrides)


def _link(entry: LinkFile | None, default: Link) -> Link:
    if entry is None:
        return default
    return Link(entry.bandwidth_bytes_per_s or default.bandwidth_bytes_per_s, entry.latency_s or default.latency_s)


def _one_node_type(nodes: list[NodeGroup], source: str) -> tuple[GPUSpec, int, int]:
    """(gpu, num_nodes, gpus_per_node) of a `nodes` list, or the heterogeneity error."""
    kinds = [(_gpu_spec(n.gpu), n.gpus_per_node) for n in nodes]
    if any(kind != kinds[0] for kind in kinds):  # GPUSpec holds a dict: compare, do not hash
        described = sorted({f"{per_node} x {spec.name}" for spec, per_node in kinds})
        raise PlannerError(
            f"{source} mixes node types ({', '.join(described)}): heterogeneous clusters are not supported yet.",
            "Plan for one node type at a time (a cluster file with a single `gpu`).",
        )
    return kinds[0][0], sum(n.count for n in nodes), kinds[0][1]


def parse_cluster(data, source: str = "cluster") -> Cluster:
    """A Cluster from a parsed YAML/JSON mapping; `source` names it in errors."""
    from planner.cluster_schema import validate_cluster_file

    form = validate_cluster_file(data, source)
    if form.nodes is not None:
        gpu, num_nodes, gpus_per_node = _one_node_type(form.nodes, source)
    else:
        assert form.gpu is not None, "ClusterFile._one_form refuses a file with neither gpu nor nodes"
        gpu, num_nodes, gpus_per_node = _gpu_spec(form.gpu), form.num_nodes, form.gpus_per_node
    intra, inter = default_links(gpu)  # overridden GPU bandwidths carry into the default links
    return Cluster(
        name=form.name or Path(source).stem,
        gpu=gpu,
        num_nodes=num_nodes,
        gpus_per_node=gpus_per_node,
        intra_node=_link(form.intra_node, intra),
        inter_node=_link(form.inter_node, inter),
        fitted={kind: fit.model_dump(exclude_unset=True) for kind, fit in form.fitted.items()},
        compute_slowdown=form.compute_slowdown,
        pipeline_overhead_s=form.pipeline_overhead_s,
    )


def load_cluster(path: str | Path) -> Cluster:
    """Read a cluster file (YAML, or JSON by its `.json` suffix)."""
    path = Path(path)
    if not path.is_file():
        raise PlannerError(f"Cluster file {path} does not exist.", "Write one (see profiles/clusters/) or use --gpus N --gpu NAME.")
    try:
        text = path.read_text()
        if path.suffix == ".json":
            data = json.loads(text)
        else:
            import yaml

            data = yaml.safe_load(text)
    except Exception as exc:  # yaml, json and decoding raise their own error types
        raise PlannerError(f"Cluster file {path} cannot be parsed ({exc}).", "Fix its YAML/JSON syntax.") from None
    return parse_cluster(data, str(path))


def cluster_data(cluster: Cluster) -> dict:
    """The file form: a preset GPU by name, a modified one as {preset, changed fields}."""
    preset = GPUS.get(cluster.gpu.name)
    if preset == cluster.gpu:
        gpu: object = cluster.gpu.name
    else:
        base = preset or GPUS["cpu"]  # a renamed GPU is written out in full on top of any preset
        changed = {k: v for k, v in asdict(cluster.gpu).items() if k != "name" and (preset is None or getattr(base, k) != v)}
        gpu = {"preset": base.name, **({"name": cluster.gpu.name} if preset is None else {}), **changed}
    return {
        "name": cluster.name,
        "gpu": gpu,
        "num_nodes": cluster.num_nodes,
        "gpus_per_node": cluster.gpus_per_node,
        "intra_node": asdict(cluster.intra_node),
        "inter_node": asdict(cluster.inter_node),
        **({"fitted": cluster.fitted} if cluster.fitted else {}),
        **({"compute_slowdown": cluster.compute_slowdown} if cluster.compute_slowdown != 1.0 else {}),
        **({"pipeline_overhead_s": cluster.pipeline_overhead_s} if cluster.pipeline_overhead_s else {}),
    }


def save_cluster(cluster: Cluster, path: str | Path) -> Path:
    """Write `cluster` as YAML (read back by `load_cluster`)."""
    import yaml

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(cluster_data(cluster), sort_keys=False))
    return path
