"""`planner profile-cluster`: measure collectives on the real backend and write a cluster file.

The verb checks its options, starts the measurement under torchrun (`python -m
torch.distributed.run --standalone --nproc-per-node N -m planner.cluster_worker ...`; NCCL when
CUDA is available, else gloo, or `--backend`) through the one launcher (planner/launcher.py:
a hang, a dead rank or a signal stops the whole job), and reads the file back with
`load_cluster`. What each rank measures: planner/cluster_worker.py; how the timings become
latency and bandwidth: planner/cluster_fit.py. Across nodes, start the worker under torchrun
yourself (planner/cluster_worker.py says how).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import typer

from planner.errors import PlannerError

GPU_NAMES = (("b300", "b300"), ("b200", "b200"), ("h200", "h200"), ("h100", "h100-80gb"), ("a100-sxm4-40gb", "a100-40gb"),
             ("a100-pcie-40gb", "a100-40gb"), ("a100", "a100-80gb"))
"""Substrings of torch.cuda.get_device_name() (lower case) -> GPU preset, first match wins."""

def profile_cluster_command(
    nproc: int = typer.Option(2, "--nproc", help="Processes (GPUs) on this node."),
    output: Path = typer.Option(Path("profiles/clusters/measured-cpu.yaml"), "--output", "-o", help="Cluster file to write."),
    min_bytes: int = typer.Option(4096, "--min-bytes", help="Smallest message, bytes."),
    max_bytes: int = typer.Option(16 * 2**20, "--max-bytes", help="Largest message, bytes."),
    repeats: int = typer.Option(5, "--repeats", help="Timed calls per size (median kept)."),
    time_budget_s: float = typer.Option(60.0, "--time-budget", help="Seconds for the collective sweeps, shared among them "
                                        "(the contention and pipeline probes take a few seconds more)."),
    threads: int = typer.Option(1, "--threads", help="Torch threads per process; use the profile's --threads."),
    backend: str = typer.Option("auto", "--backend", help="auto (nccl if CUDA is available, else gloo), nccl or gloo."),
    timeout_s: float = typer.Option(600.0, "--timeout", help="Wall-clock limit of the whole job, seconds."),
) -> None:
    """Measure all-reduce, all-gather, reduce-scatter and p2p on this node and write a cluster file."""
    if nproc < 2:
        raise PlannerError("--nproc must be at least 2 (collectives need a group).", "Pass --nproc 2 or more.")
    if not 0 < min_bytes <= max_bytes:
        raise PlannerError("Need 0 < --min-bytes <= --max-bytes.", "Example: --min-bytes 4096 --max-bytes 16777216")
    if repeats < 1 or threads < 1 or not time_budget_s > 0 or not timeout_s > 0:
        raise PlannerError("--repeats, --threads, --time-budget and --timeout must be positive.", "Example: --repeats 5 --time-budget 60")
    if backend not in ("auto", "nccl", "gloo"):
        raise PlannerError(f"Unknown --backend {backend!r}.", "Use auto, nccl or gloo.")
    if backend != "gloo":
        import torch

        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if backend == "nccl" and gpus < nproc:
            raise PlannerError(f"--backend nccl needs {nproc} visible GPUs, found {gpus}.", "Lower --nproc or use --backend gloo.")
        backend = "nccl" if gpus >= nproc else "gloo"
    from planner.launcher import torchrun_command  # not at import: the CLI imports this module for every verb

    with tempfile.TemporaryDirectory(prefix="profile-cluster-") as status_dir, \
            tempfile.TemporaryDirectory(prefix="profile-cluster-logs-") as log_dir:
        program = ["-m", "planner.cluster_worker", "--output", str(output), "--min-bytes", str(min_bytes),
                   "--max-bytes", str(max_bytes), "--repeats", str(repeats), "--time-budget", str(time_budget_s),
                   "--backend", backend, "--op-timeout", str(max(30.0, timeout_s / 2)), "--status-dir", status_dir]
        _launch(torchrun_command(nproc, program, log_dir), timeout_s, Path(status_dir), threads, Path(log_dir))
    from planner.cluster import load_cluster

    cluster = load_cluster(output)  # what the solver will read: fails here, not later, if the file is unusable
    for kind, fit in cluster.fitted.items():
        print(f"{kind:>15}: latency {fit['latency_s'] * 1e6:9.1f} us, bandwidth {fit['bandwidth_bytes_per_s'] / 1e9:8.3f} GB/s")
    if cluster.compute_slowdown != 1.0:
        print(f"compute slowdown with all {nproc} processes busy: x{cluster.compute_slowdown:.2f}")
    if cluster.pipeline_overhead_s:
        print(f"pipeline overhead per micro-batch and stage: {cluster.pipeline_overhead_s * 1e6:.0f} us")
    print(f"wrote {output}")


def _launch(command: list[str], timeout_s: float, status_dir: Path, threads: int = 1, log_dir: Path | None = None) -> None:
    """Run the measurement (planner/launcher.py): a hang, a dead rank or a signal becomes a PlannerError."""
    from planner.launcher import launch

    def last_seen() -> str:
        where = "; ".join(f"{p.stem}: {p.read_text().strip()}" for p in sorted(status_dir.glob("rank*"))) or "no rank started"
        return f" (last seen: {where})"

    launch(command, {**os.environ, "OMP_NUM_THREADS": str(threads)}, timeout_s, what="Measuring", log_dir=log_dir,
           stopped="the measurement was stopped", progress=last_seen,
           timeout_hint="A rank is hung or the backend cannot connect; lower --max-bytes or raise --timeout.",
           kept=lambda: "Nothing was written: the cluster file is written when the measurement finishes.")


def failure_summary(stderr: str, code: int) -> str:
    """Which rank failed first, and why (planner/launcher.py's summary, worded for a measurement)."""
    from planner.launcher import failure_summary as launcher_failure_summary

    return launcher_failure_summary(stderr, code, "the measurement was stopped")
