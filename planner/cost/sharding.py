"""Hybrid sharding (HSDP) and CPU offload, priced per optimizer step. Pure functions, no torch.

Hybrid sharding (planner/plan.py `Layout.shard_degree`; Zhao et al. 2023, "PyTorch FSDP",
hybrid sharding). dp = r x s ranks: s = shard_degree consecutive dp indices shard the model
states, r = dp / s such groups replicate them. Per reduction of G gradient bytes (the stage's
whole gradient on one GPU, after TP) and per gather of P parameter bytes:

    reduce-scatter   inside the shard group, s ranks, input G           (on the shard link)
    all-reduce       across the replica group, r ranks, the G / s shard  (on the replica link)
    all-gather       inside the shard group, s ranks, output P           (on the shard link)

each priced with the alpha-beta algorithms of planner/cost/collectives.py `flat_times`,
cheapest algorithm taken. Against sharding over all dp ranks, the all-gathers (ZeRO-3: two per
micro-batch) stay on the shard group's link, and only G / s bytes per GPU cross the replica
link, each GPU of a node on its own NIC (one replica group per shard index). The model states
per GPU are planner/cost/memory.py `model_state_bytes` with dp replaced by s.

A shard group is s dp indices, tp ranks apart (planner/plan.py rank_of: tp innermost), so it
spans s x tp consecutive ranks: inside one node when s x tp divides the GPUs per node; its
replica group runs s x tp ranks apart, inside one node only when the whole dp x tp block is
(`hsdp_links`).

CPU offload (planner/plan.py `Training.offload`; Ren et al. 2021, "ZeRO-Offload", USENIX ATC;
FSDP2's `CPUOffloadPolicy`): the sharded states live in host memory. Per step and GPU: every
all-gather first copies the GPU's parameter shard host-to-device, every gradient reduction
copies the GPU's gradient shard device-to-host, and the AdamW step runs on the host CPU over
the shard (`offload_step_cost`). FSDP2 copies the stored dtype: this runtime keeps float32
parameters under autocast (runtime/train.py), 4 bytes per element each way; ZeRO-Offload's own
design moves 16-bit copies (2 bytes).
"""

from __future__ import annotations

from dataclasses import dataclass

from planner.cluster import Link
from planner.cost.collectives import flat_times
from planner.cost.memory import ModelStateBytes, model_state_bytes

PCIE_X16_EFFECTIVE_BYTES_PER_S = {"gen4": 25e9, "gen5": 50e9}
"""Host<->device bytes per second per direction of a PCIe x16 link, as a copy from pinned memory
achieves it. Raw rates (PCI-SIG): Gen4 16 GT/s x 16 lanes x 128/130 = 31.5 GB/s, Gen5 twice that,
63 GB/s; packet (TLP/DLLP) overhead leaves ~80% of it to data, the rate CUDA's bandwidthTest
reports for pinned copies (~25 GB/s on A100 PCIe Gen4 hosts, ~50 GB/s on H100 Gen5 hosts). A
stated assumption: pass a measured value where there is one."""

CPU_ADAM_S_PER_PARAMETER = 0.22 / 1e9
"""Seconds of one AdamW step per parameter on a whole host CPU: Ren et al. 2021 (ZeRO-Offload),
Table 3, DeepSpeed's vectorised CPU-Adam takes about 0.22 s for 1 billion parameters on the
two-socket Xeon host of a DGX-2 (5-6x faster than PyTorch's CPU Adam, the paper's
comparison). Roofline check: an fp32 Adam step reads and writes weight, momentum and variance
and reads the gradient, ~26-34 bytes per parameter, which over such a host's ~200 GB/s of memory
bandwidth is ~0.15 s per billion: the optimizer is memory-bound, so hosts with other
memory bandwidths scale it by their ratio."""


@dataclass(frozen=True)
class HSDPStepComm:
    """Hybrid sharding's data-parallel collectives over one optimizer step, on one GPU, in seconds."""

    reduce_scatter_s: float
    """Gradient reduce-scatters inside the shard group (all of the step's reductions)."""
    all_reduce_s: float
    """All-reduces of the 1/shard_degree gradient shard across the replica group (all reductions)."""
    all_gather_s: float
    """Parameter all-gathers inside the shard group (all of the step's gathers)."""

    @property
    def total_s(self) -> float:
        """Sum of the terms, none overlapped with compute (planner/cost/overlap.py decides what hides)."""
        return self.reduce_scatter_s + self.all_reduce_s + self.all_gather_s


@dataclass(frozen=True)
class OffloadStepCost:
    """CPU offload's extra work over one optimizer step, on one GPU."""

    host_to_device_bytes: float
    """Parameter shards copied to the GPU (one per all-gather)."""
    device_to_host_bytes: float
    """Gradient shards copied to the host (one per reduction)."""
    host_to_device_s: float
    """`host_to_device_bytes` over the PCIe rate."""
    device_to_host_s: float
    """`device_to_host_bytes` over the PCIe rate (the other direction of the full-duplex link)."""
    cpu_optimizer_s: float
    """The AdamW step over this GPU's parameter shard on its share of the host CPU."""
    gpu_bytes_saved: ModelStateBytes
    """Model-state bytes per GPU that live in host memory instead (`offloaded_state_bytes`)."""

    @property
    def pcie_s(self) -> float:
        """Both directions' copies, unoverlapped: FSDP2 issues them at different moments (before a
        gather, after a reduction), so they rarely share the link's two directions."""
        return self.host_to_device_s + self.device_to_host_s


def _cheapest(kind: str, n: int, nbytes: float, link: Link) -> float:
    return min(flat_times(kind, n, nbytes, link).values())


def fsdp_collective_counts(zero_stage: int, num_microbatches: int) -> tuple[int, int]:
    """(gradient reductions, parameter all-gathers) per step of one non-pipelined FSDP2 stage, as
    runtime/train.py runs it: ZeRO-1 reduces once after the last micro-batch, ZeRO 2-3 every
    micro-batch; ZeRO-3 gathers before each forward and each backward, ZeRO 1-2 once per step
    (parameters stay gathered until the last backward)."""
    if zero_stage not in (1, 2, 3):
        raise ValueError(f"zero_stage {zero_stage}: FSDP counts exist for ZeRO 1-3 only")
    reductions = num_microbatches if zero_stage >= 2 else 1
    gathers = 2 * num_microbatches if zero_stage == 3 else 1
    return reductions, gathers


def hsdp_links(intra: Link, inter: Link, shard_degree: int, dp_degree: int, tp_degree: int,
               gpus_per_node: int) -> tuple[Link, Link]:
    """(shard-group link, replica-group link) for hybrid sharding (module docstring): the intra-node
    link where the group's ranks share a node, else the inter-node one."""
    if shard_degree < 1 or dp_degree % shard_degree:
        raise ValueError(f"shard_degree {shard_degree} must divide dp_degree {dp_degree}")
    shard_span, dp_span = shard_degree * tp_degree, dp_degree * tp_degree
    shard_link = intra if gpus_per_node % shard_span == 0 else inter
    replica_link = intra if gpus_per_node % dp_span == 0 else inter
    return shard_link, replica_link


def hsdp_step_comm(param_bytes: float, grad_bytes: float, shard_degree: int, replica_degree: int,
                   num_reductions: int, num_gathers: int, shard_link: Link, replica_link: Link) -> HSDPStepComm:
    """HSDP's collectives per step (module docstring). `param_bytes`, `grad_bytes`: the whole
    (unsharded) parameters and gradient of the stage on one GPU, in the dtypes gathered and
    reduced; counts from `fsdp_collective_counts`."""
    if shard_degree < 1 or replica_degree < 1:
        raise ValueError(f"shard_degree {shard_degree} and replica_degree {replica_degree} must be at least 1")
    return HSDPStepComm(
        reduce_scatter_s=num_reductions * _cheapest("reduce_scatter", shard_degree, grad_bytes, shard_link),
        all_reduce_s=num_reductions * _cheapest("all_reduce", replica_degree, grad_bytes / shard_degree, replica_link),
        all_gather_s=num_gathers * _cheapest("all_gather", shard_degree, param_bytes, shard_link),
    )


def hsdp_model_state_bytes(num_parameters: float, dtype: str, zero_stage: int, shard_degree: int) -> ModelStateBytes:
    """Model states per GPU under hybrid sharding: ZeRO's division by the shard group's size, not
    by dp (the replicas hold copies). `num_parameters` already divided by TP where sharded."""
    return model_state_bytes(num_parameters, dtype, zero_stage, shard_degree)


def offloaded_state_bytes(num_parameters: float, dtype: str, zero_stage: int, shard_degree: int) -> ModelStateBytes:
    """The model states per GPU that CPU offload keeps in host memory. ZeRO-3: all of them (the
    GPU holds gathered parameters and unreduced gradients only transiently, planner/cost/memory.py's
    communication term). ZeRO 1-2: gradients and optimizer state; the weights stay, since this
    runtime keeps them gathered on the GPU from the first forward to the last backward."""
    held = model_state_bytes(num_parameters, dtype, zero_stage, shard_degree)
    return held if zero_stage >= 3 else ModelStateBytes(weights=0.0, gradients=held.gradients, optimizer=held.optimizer)


def offload_step_cost(num_parameters: float, dtype: str, zero_stage: int, shard_degree: int,
                      num_reductions: int, num_gathers: int, transfer_bytes_per_parameter: float = 4.0,
                      pcie_bytes_per_s: float = PCIE_X16_EFFECTIVE_BYTES_PER_S["gen4"],
                      cpu_adam_s_per_parameter: float = CPU_ADAM_S_PER_PARAMETER,
                      gpus_per_host: int = 1) -> OffloadStepCost:
    """CPU offload per step and GPU (module docstring). The GPU holds a 1/shard_degree shard of
    `num_parameters` (already divided by TP; shard_degree: `Layout.shard_degree` under HSDP, else
    dp_degree, 1 on a single GPU): each gather copies that shard in, each reduction
    copies its gradient shard out, `transfer_bytes_per_parameter` bytes per element each way.
    `gpus_per_host` GPUs share the host CPU (and its memory bandwidth, which bounds CPU-Adam), so
    each runs its optimizer step at 1/gpus_per_host of the host's rate."""
    if min(shard_degree, gpus_per_host) < 1 or pcie_bytes_per_s <= 0:
        raise ValueError("shard_degree and gpus_per_host must be at least 1 and the PCIe rate positive")
    shard_bytes = num_parameters / shard_degree * transfer_bytes_per_parameter
    h2d, d2h = num_gathers * shard_bytes, num_reductions * shard_bytes
    return OffloadStepCost(
        host_to_device_bytes=h2d,
        device_to_host_bytes=d2h,
        host_to_device_s=h2d / pcie_bytes_per_s,
        device_to_host_s=d2h / pcie_bytes_per_s,
        cpu_optimizer_s=num_parameters / shard_degree * cpu_adam_s_per_parameter * gpus_per_host,
        gpu_bytes_saved=offloaded_state_bytes(num_parameters, dtype, zero_stage, shard_degree),
    )
