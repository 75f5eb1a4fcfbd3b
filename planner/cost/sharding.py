"""Hybrid sharding (HSDP) and CPU offload: the formulas, and offload's per-step price. No torch.

Hybrid sharding (planner/plan.py `Layout.shard_degree`; Zhao et al. 2023, "PyTorch FSDP",
hybrid sharding). dp = r x s ranks: s = shard_degree consecutive dp indices shard the model
states, r = dp / s such groups replicate them. Per reduction of G gradient bytes (the stage's
whole gradient on one GPU, after TP) and per gather of P parameter bytes:

    reduce-scatter   inside the shard group, s ranks, input G           (on the shard link)
    all-reduce       across the replica group, r ranks, the G / s shard  (on the replica link)
    all-gather       inside the shard group, s ranks, output P           (on the shard link)

Against sharding over all dp ranks, the all-gathers (ZeRO-3: two per micro-batch) stay inside
the shard group, and only G / s bytes per GPU cross the replica group, each GPU of a node on
its own NIC (one replica group per shard index). The model states per GPU are
planner/cost/memory.py `model_state_bytes` with dp replaced by s. The search prices these
collectives with the cluster's collective model on the groups' real placement (a shard group
is s dp indices tp ranks apart, a replica group s x tp ranks apart): planner/solver/
comm_pricing.py `_over_dp` and `_across_replicas`, and the states in planner/solver/search.py
`gpu_state_bytes`. This module keeps what is particular to offload.

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

from planner.cost.memory import ModelStateBytes, Precision, model_state_bytes

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
    """The AdamW step over this GPU's parameter shard on its share of the host CPU. (What offload
    takes off the GPU's memory is `offloaded_state_bytes`, which the memory model subtracts.)"""

    @property
    def pcie_s(self) -> float:
        """Both directions' copies, unoverlapped: FSDP2 issues them at different moments (before a
        gather, after a reduction), so they rarely share the link's two directions."""
        return self.host_to_device_s + self.device_to_host_s


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


def offloaded_state_bytes(num_parameters: float, dtype: str | Precision, zero_stage: int, shard_degree: int,
                          accumulating: bool = False) -> ModelStateBytes:
    """The model states per GPU that CPU offload keeps in host memory. ZeRO-3: all of them (the
    GPU holds gathered parameters and unreduced gradients only transiently, planner/cost/memory.py's
    communication term). ZeRO 1-2: gradients and optimizer state; the weights stay, since this
    runtime keeps them gathered on the GPU from the first forward to the last backward.
    `accumulating` (several micro-batches, or a pipeline): ZeRO 1 syncs on the step's last
    backward only (runtime/train.py; a pipeline's schedules likewise), so FSDP2 accumulates the
    whole gradients on the GPU until that reduce-scatter and only the optimizer state lives on
    the host."""
    held = model_state_bytes(num_parameters, dtype, zero_stage, shard_degree)
    if zero_stage >= 3:
        return held
    gradients = 0.0 if zero_stage == 1 and accumulating else held.gradients
    return ModelStateBytes(weights=0.0, gradients=gradients, optimizer=held.optimizer)


def offload_step_cost(num_parameters: float, shard_degree: int, num_reductions: int, num_gathers: int,
                      transfer_bytes_per_parameter: float = 4.0,
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
    )
