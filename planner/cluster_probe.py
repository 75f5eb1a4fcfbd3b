"""`planner profile-cluster`: measure collectives on the real backend and write a cluster file.

The command starts itself under torchrun (`--nproc N` processes on this node; gloo on CPU,
NCCL on GPUs). Every rank times all-reduce, all-gather and point-to-point (rank 0 <-> 1,
ping-pong halved) for message sizes doubling from `--min-bytes` to `--max-bytes`: two
warm-up calls, then the median of `--repeats`, a barrier before each. A collective's sweep
stops early once the time budget is spent. Rank 0 fits

    time = latency_s + traffic / bandwidth_bytes_per_s

by least squares, where traffic is the ring algorithm's bytes per rank (2(n-1)/n M for
all-reduce, (n-1)/n M for all-gather, M for p2p; planner/cost/collectives.py), and writes a
cluster YAML whose `fitted` section the collective model uses for groups inside the node.
gloo has no reduce-scatter, so its fit is taken from the all-gather's (the same ring
traffic; NCCL measures it directly). It measures the node it runs on: for several nodes,
run it under torchrun across them and set `inter_node` from the result by hand.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import typer

from planner.errors import PlannerError

TRAFFIC = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
           "reduce_scatter": lambda n: (n - 1) / n, "p2p": lambda n: 1.0}


def profile_cluster_command(
    nproc: int = typer.Option(2, "--nproc", help="Processes (GPUs) on this node."),
    output: Path = typer.Option(Path("profiles/clusters/measured.yaml"), "--output", "-o", help="Cluster file to write."),
    min_bytes: int = typer.Option(4096, "--min-bytes", help="Smallest message."),
    max_bytes: int = typer.Option(16 * 2**20, "--max-bytes", help="Largest message."),
    repeats: int = typer.Option(5, "--repeats", help="Timed calls per size (median kept)."),
    time_budget_s: float = typer.Option(60.0, "--time-budget", help="Seconds of measuring per collective, at most."),
    timeout_s: float = typer.Option(600.0, "--timeout", help="Wall-clock limit of the whole job."),
) -> None:
    """Measure all-reduce, all-gather and p2p on this node and fit a cluster file."""
    if nproc < 2:
        raise PlannerError("--nproc must be at least 2 (collectives need a group).", "Pass --nproc 2 or more.")
    if not 0 < min_bytes <= max_bytes:
        raise PlannerError("Need 0 < --min-bytes <= --max-bytes.", "Example: --min-bytes 4096 --max-bytes 16777216")
    raw = output.with_suffix(".raw.json")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
               "-m", "planner.cluster_probe", "--raw", str(raw), "--min-bytes", str(min_bytes), "--max-bytes", str(max_bytes),
               "--repeats", str(repeats), "--time-budget", str(time_budget_s)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    try:
        done = subprocess.run(command, env=env, timeout=timeout_s, stderr=subprocess.PIPE, text=True)
    except subprocess.TimeoutExpired:
        raise PlannerError(f"Measuring did not finish within {timeout_s:.0f} s.", "Lower --max-bytes or --time-budget.") from None
    if done.returncode != 0:
        from runtime.launch import failure_summary

        raise PlannerError(failure_summary(done.stderr, done.returncode), "Check that the backend works on this node.")
    cluster = fit_cluster(json.loads(raw.read_text()))
    from planner.cluster import save_cluster

    save_cluster(cluster, output)
    raw.unlink(missing_ok=True)
    for kind, fit in cluster.fitted.items():
        print(f"{kind:>15}: latency {fit['latency_s'] * 1e6:8.1f} us, bandwidth {fit['bandwidth_bytes_per_s'] / 1e9:7.3f} GB/s")
    print(f"wrote {output}")


def fit(sizes: list[int], times: list[float], traffic_factor: float) -> dict:
    """Least-squares latency + traffic / bandwidth, both kept positive.

    Timings on a busy machine are noisy and can make the plain fit's slope negative; then
    the latency is the smallest messages' time and the bandwidth the least-squares slope
    through it (and at worst the largest message's average rate).
    """
    import numpy as np

    traffic = np.array(sizes, dtype=float) * traffic_factor
    t = np.array(times)
    slope, intercept = np.polyfit(traffic, t, 1)
    if slope <= 0 or intercept <= 0:
        intercept = float(np.median(t[: min(2, len(t))]))
        excess = np.clip(t - intercept, 0.0, None)
        slope = float((traffic * excess).sum() / (traffic**2).sum())
        if slope <= 0:
            slope = float(t[-1] / traffic[-1])
    return {"latency_s": float(intercept), "bandwidth_bytes_per_s": float(1.0 / slope)}


def fit_cluster(raw: dict):
    from planner.cluster import Link, make_cluster
    from dataclasses import replace

    n = raw["world_size"]
    fitted = {}
    for kind, points in raw["measurements"].items():
        if len(points) >= 2:
            fitted[kind] = {**fit([p[0] for p in points], [p[1] for p in points], TRAFFIC[kind](n)), "points": points}
    if "reduce_scatter" not in fitted and "all_gather" in fitted:
        fitted["reduce_scatter"] = {**fitted["all_gather"], "note": "taken from all_gather (gloo has no reduce-scatter)"}
    base = make_cluster(n, n, raw["gpu"])
    link = fitted.get("p2p", fitted.get("all_reduce"))
    intra = Link(link["bandwidth_bytes_per_s"], link["latency_s"]) if link else base.intra_node
    return replace(base, name=f"measured-{raw['backend']}-{n}", intra_node=intra,
                   fitted={k: {kk: vv for kk, vv in v.items()} for k, v in fitted.items()})


def _worker(args) -> None:
    import torch
    import torch.distributed as dist

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(device)
    dist.init_process_group(backend)
    rank, n = dist.get_rank(), dist.get_world_size()
    sync = torch.cuda.synchronize if backend == "nccl" else (lambda: None)

    def timed(fn) -> float:
        for _ in range(2):
            fn()
        sync()
        samples = []
        for _ in range(args.repeats):
            dist.barrier()
            start = time.perf_counter()
            fn()
            sync()
            samples.append(time.perf_counter() - start)
        value = torch.tensor([statistics.median(samples)], dtype=torch.float64)
        dist.all_reduce(value, op=dist.ReduceOp.MAX)  # the slowest rank decides
        return float(value)

    sizes = []
    size = args.min_bytes
    while size <= args.max_bytes:
        sizes.append(size)
        size *= 2
    kinds = ["all_reduce", "all_gather", "p2p"] + (["reduce_scatter"] if backend == "nccl" else [])
    results: dict[str, list] = {k: [] for k in kinds}
    for kind in kinds:
        started = time.perf_counter()
        for nbytes in sizes:
            numel = max(nbytes // 4, n)
            numel -= numel % n
            x = torch.ones(numel, device=device)
            if kind == "all_reduce":
                fn = lambda: dist.all_reduce(x)  # noqa: E731
            elif kind == "all_gather":
                parts = [torch.empty(numel // n, device=device) for _ in range(n)]
                fn = lambda: dist.all_gather(parts, x[: numel // n])  # noqa: E731
            elif kind == "reduce_scatter":
                out = torch.empty(numel // n, device=device)
                fn = lambda: dist.reduce_scatter_tensor(out, x)  # noqa: E731
            else:
                fn = lambda: _ping_pong(dist, x, rank)  # noqa: E731
            t = timed(fn)
            results[kind].append([numel * 4, t / 2 if kind == "p2p" else t])
            if rank == 0:
                print(f"  {kind:>15} {numel * 4:>10} B  {t * 1e3:9.3f} ms", flush=True)
            budget_left = torch.tensor([float(time.perf_counter() - started < args.time_budget)])
            dist.all_reduce(budget_left, op=dist.ReduceOp.MIN)  # all ranks stop together
            if not budget_left.item():
                break
    if rank == 0:
        gpu = "cpu"
        if backend == "nccl":
            name = torch.cuda.get_device_name().lower()
            gpu = "h100-80gb" if "h100" in name else "h200" if "h200" in name else "a100-80gb" if "a100" in name else "a100-80gb"
        Path(args.raw).parent.mkdir(parents=True, exist_ok=True)
        Path(args.raw).write_text(json.dumps({"world_size": n, "backend": backend, "gpu": gpu, "measurements": results}))
    dist.destroy_process_group()


def _ping_pong(dist, x, rank: int) -> None:
    if rank == 0:
        dist.send(x, 1)
        dist.recv(x, 1)
    elif rank == 1:
        dist.recv(x, 0)
        dist.send(x, 0)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--raw", required=True)
    parser.add_argument("--min-bytes", type=int, default=4096)
    parser.add_argument("--max-bytes", type=int, default=16 * 2**20)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--time-budget", type=float, default=60.0)
    _worker(parser.parse_args())
