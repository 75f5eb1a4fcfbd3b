"""`planner profile-cluster`: measure collectives on the real backend and write a cluster file.

The command starts itself under torchrun (`python -m torch.distributed.run --standalone
--nproc-per-node N -m planner.cluster_probe ...`; NCCL when CUDA is available, else gloo,
or `--backend`). Every rank times all-reduce, all-gather (`all_gather_into_tensor`, else the
list form), reduce-scatter (`reduce_scatter_tensor`; where the backend lacks it, as older
gloo does, an `all_to_all_single` followed by a local sum of the n received blocks, which
moves the same (n-1)/n M bytes per rank as the ring reduce-scatter; the file's `method`
field says which ran) and point-to-point (rank 0 <-> 1 ping-pong, halved), for message
sizes doubling from `--min-bytes` to `--max-bytes`: two warm-up calls, then the median of
`--repeats` timed calls, each after a barrier; the slowest rank's median is kept. A
collective's sweep stops early once its share of `--time-budget` is spent. Rank 0 shows a
progress bar, fits

    time = latency_s + traffic / bandwidth_bytes_per_s

by least squares, where traffic is the ring algorithm's bytes per rank (2(n-1)/n M for
all-reduce, (n-1)/n M for all-gather and reduce-scatter, M for p2p;
planner/cost/collectives.py), and writes a cluster YAML: the GPU preset (`cpu` on gloo, the
detected CUDA GPU otherwise), the intra-node link from the p2p fit and a `fitted` section
(each fit with its raw [bytes, seconds] points) that the collective model uses for groups
inside a node. On gloo it also measures the node's compute contention
(`compute_slowdown`, planner/cluster.py): each rank's time for a fixed mix of matrix
products and elementwise work run alone, then by all ranks at once. With two ranks or more it
also measures what a pipelined micro-batch costs beyond compute and bytes
(`pipeline_overhead_s`, `pipeline_overhead`). `--threads` sets the torch threads of every
process (as `planner profile --threads`; use the same number). The parent process reads the
file back with `load_cluster`.

It measures the node it runs on. Across nodes, start the worker under torchrun yourself
(`torchrun --nnodes K --nproc-per-node G --rdzv-backend c10d --rdzv-endpoint HOST:PORT
-m planner.cluster_probe --output FILE`): it then also times p2p between rank 0 and the
first rank of the second node and sets `inter_node` from it; collective fits made across
nodes are recorded with their `num_nodes` and not used for in-node groups.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import typer

from planner.errors import PlannerError
from planner.launcher import failure_summary as launcher_failure_summary
from planner.launcher import launch, torchrun_command

TRAFFIC = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
           "reduce_scatter": lambda n: (n - 1) / n, "p2p": lambda n: 1.0, "p2p_inter_node": lambda n: 1.0}
"""Ring bytes per rank as a fraction of the message (the same table as collectives.RING_TRAFFIC)."""

GPU_NAMES = (("h200", "h200"), ("h100", "h100-80gb"), ("a100-sxm4-40gb", "a100-40gb"), ("a100-pcie-40gb", "a100-40gb"),
             ("a100", "a100-80gb"))
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
    with tempfile.TemporaryDirectory(prefix="profile-cluster-") as status_dir, \
            tempfile.TemporaryDirectory(prefix="profile-cluster-logs-") as log_dir:
        program = ["-m", "planner.cluster_probe", "--output", str(output), "--min-bytes", str(min_bytes),
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
    def last_seen() -> str:
        where = "; ".join(f"{p.stem}: {p.read_text().strip()}" for p in sorted(status_dir.glob("rank*"))) or "no rank started"
        return f" (last seen: {where})"

    launch(command, {**os.environ, "OMP_NUM_THREADS": str(threads)}, timeout_s, what="Measuring", log_dir=log_dir,
           stopped="the measurement was stopped", progress=last_seen,
           timeout_hint="A rank is hung or the backend cannot connect; lower --max-bytes or raise --timeout.",
           kept=lambda: "Nothing was written: the cluster file is written when the measurement finishes.")


def failure_summary(stderr: str, code: int) -> str:
    """Which rank failed first, and why (planner/launcher.py's summary, worded for a measurement)."""
    return launcher_failure_summary(stderr, code, "the measurement was stopped")


def fit(sizes: list[int], times: list[float], traffic_factor: float) -> dict:
    """Least-squares latency + traffic / bandwidth, robust to outliers and kept positive.

    Timings on a shared machine have outliers (a descheduled rank makes one size 10x
    slower). A Theil-Sen line (median of the pairwise slopes; Sen 1968) marks as outliers
    the points more than 3x the median residual away from it; least squares is fitted to
    the others. If the slope or the intercept is still not positive, the latency is the
    smallest messages' time and the bandwidth the least-squares slope through it (at worst
    the largest message's rate).
    """
    import numpy as np

    x = np.array(sizes, dtype=float) * traffic_factor
    t = np.array(times, dtype=float)
    i, j = np.triu_indices(len(x), k=1)
    pairwise = (t[j] - t[i]) / (x[j] - x[i])
    robust_slope = float(np.median(pairwise[np.isfinite(pairwise)])) if len(pairwise) else 0.0
    residual = np.abs(t - robust_slope * x - np.median(t - robust_slope * x))
    keep = residual <= 3 * np.median(residual) + 1e-9 * t.max()
    x, t = x[keep], t[keep]
    slope, intercept = np.polyfit(x, t, 1) if len(x) >= 2 else (0.0, 0.0)
    if slope <= 0 or intercept <= 0:
        intercept = float(np.median(t[: min(2, len(t))]))
        excess = np.clip(t - intercept, 0.0, None)
        slope = float((x * excess).sum() / (x**2).sum())
        if slope <= 0:
            slope = float(t[-1] / x[-1])
    return {"latency_s": float(intercept), "bandwidth_bytes_per_s": float(1.0 / slope)}


def fit_cluster(raw: dict):
    """The Cluster of a finished measurement (`raw`: world_size, num_nodes, backend, gpu, measurements, methods)."""
    from dataclasses import replace

    from planner.cluster import Link, make_cluster

    n, nodes = raw["world_size"], raw.get("num_nodes", 1)
    fitted = {}
    for kind, points in raw["measurements"].items():
        if len(points) >= 2:
            ranks = 2 if kind.startswith("p2p") else n
            fitted[kind] = {**fit([p[0] for p in points], [p[1] for p in points], TRAFFIC[kind](ranks)),
                            "num_ranks": ranks, "num_nodes": 2 if kind == "p2p_inter_node" else nodes,
                            "method": raw["methods"].get(kind, kind), "points": points}
    base = make_cluster(n, n // nodes, raw["gpu"])
    link = fitted.get("p2p") or fitted.get("all_reduce")
    intra = Link(link["bandwidth_bytes_per_s"], link["latency_s"]) if link else base.intra_node
    inter = fitted.get("p2p_inter_node")
    return replace(base, name=f"measured-{raw['backend']}-{n}", intra_node=intra,
                   inter_node=Link(inter["bandwidth_bytes_per_s"], inter["latency_s"]) if inter else base.inter_node,
                   fitted=fitted, compute_slowdown=max(1.0, float(raw.get("compute_slowdown", 1.0))),
                   pipeline_overhead_s=max(0.0, float(raw.get("pipeline_overhead_s", 0.0))))


def overhead_from_step(step_s: float, hop_s: float, microbatches: int) -> float:
    """The pipeline overhead that makes the cost model's price of the probe's step equal to it.

    The model prices a 1F1B step over two stages computing ~nothing as m x (stage 0's two p2p
    hops + o) + (m + 1) x o (m + p - 1 stage periods; the last stage sends nothing), so
    o = (step - 2 m hop) / (m + 1), never below 0.
    """
    return max(0.0, (step_s - 2 * microbatches * hop_s) / (microbatches + 1))


def compute_slowdown(dist, torch, rank: int, n: int, window_s: float = 0.2, rounds: int = 5) -> float:
    """Median over ranks of (rate of a fixed workload alone) / (rate with all ranks running it).

    The workload mixes a matrix product (compute-bound) with elementwise work over its output
    (memory-bound), as a layer does. Each rank counts how many times it completes it in a
    fixed window: alone while the others wait at a barrier, then all at once, every rank for
    the whole window, so that the contention lasts as long as the measurement (timing a fixed
    number of repeats instead lets the first rank to finish leave the others less contended).
    The alone and together windows alternate for `rounds` rounds and each rank keeps the
    median round's ratio: on a shared machine, load from elsewhere comes in bursts of a second
    or so, and one burst landing on a single window would otherwise decide the figure.
    """
    a, w = torch.randn(256, 512), torch.randn(512, 512)

    def work() -> None:
        torch.nn.functional.gelu(torch.nn.functional.linear(a, w)).sum()

    def rate() -> float:
        work()
        done, start = 0, time.perf_counter()
        while time.perf_counter() - start < window_s:
            work()
            done += 1
        return done / (time.perf_counter() - start)

    ratios = []
    for _ in range(rounds):
        alone = 0.0
        for r in range(n):
            dist.barrier()
            if rank == r:
                alone = rate()
        dist.barrier()
        ratios.append(alone / rate())
    everyone = [None] * n
    dist.all_gather_object(everyone, statistics.median(ratios))
    return statistics.median(everyone)


def pipeline_overhead(dist, torch, rank: int, device, sync, microbatches: int = 8, steps: int = 30) -> float:
    """`pipeline_overhead_s`: torch's Schedule1F1B over two stages that compute next to nothing.

    Ranks 0 and 1 run it (what the runtime runs; a 16x16 Linear on one 16-wide sample per
    micro-batch) and then ping-pong that micro-batch's activation to time one p2p hop of it;
    `overhead_from_step` takes the hops the cost model prices on their own out of the step.
    Medians after warm-up; the other ranks wait; every rank returns the larger of ranks 0
    and 1's figures.
    """
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    group = dist.new_group([0, 1])
    value = torch.zeros(1, dtype=torch.float64, device=device)
    if rank < 2:
        stage = PipelineStage(torch.nn.Linear(16, 16).to(device), rank, 2, device, group=group)
        schedule = Schedule1F1B(stage, microbatches, loss_fn=lambda out, target: (out - target).pow(2).mean())
        batch = torch.randn(microbatches, 16, device=device)
        times = []
        for _ in range(steps + 3):
            dist.barrier(group=group)
            start = time.perf_counter()
            if rank == 0:
                schedule.step(batch)
            else:
                schedule.step(target=batch, losses=[])
            sync()
            times.append(time.perf_counter() - start)
        message, hops = batch[:1].clone(), []
        for _ in range(steps + 3):
            start = time.perf_counter()
            _ping_pong(dist, message, rank, 1)
            sync()
            hops.append((time.perf_counter() - start) / 2)
        value += overhead_from_step(statistics.median(times[3:]), statistics.median(hops[3:]), microbatches)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)  # the larger of ranks 0 and 1's, to every rank
    dist.destroy_process_group(group)
    return float(value)


def _worker(args) -> None:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    backend = args.backend if args.backend != "auto" else ("nccl" if torch.cuda.is_available() else "gloo")
    local = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local) if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, timeout=timedelta(seconds=args.op_timeout))
    rank, n = dist.get_rank(), dist.get_world_size()
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", n))
    sync = torch.cuda.synchronize if backend == "nccl" else (lambda: None)
    status = Path(args.status_dir) / f"rank{rank}" if args.status_dir else None

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
        value = torch.tensor([statistics.median(samples)], dtype=torch.float64, device=device)
        dist.all_reduce(value, op=dist.ReduceOp.MAX)  # the slowest rank decides
        return float(value)

    if status:
        status.write_text("compute contention")
    slowdown = compute_slowdown(dist, torch, rank, n) if backend == "gloo" else 1.0
    if status:
        status.write_text("pipeline overhead")
    overhead = pipeline_overhead(dist, torch, rank, device, sync) if n > 1 else 0.0
    sizes = [args.min_bytes * 2**k for k in range(64) if args.min_bytes * 2**k <= args.max_bytes]
    kinds = ["all_reduce", "all_gather", "reduce_scatter"] + (["p2p"] if per_node > 1 else []) \
        + (["p2p_inter_node"] if per_node < n else [])
    results: dict[str, list] = {k: [] for k in kinds}
    methods: dict[str, str] = {}
    bar, task = _progress_bar(len(kinds) * len(sizes)) if rank == 0 else (None, None)
    for kind in kinds:
        started = time.perf_counter()
        for nbytes in sizes:
            if status:
                status.write_text(f"{kind} {nbytes} B")
            numel = max(nbytes // 4, n)
            numel -= numel % n
            x = torch.ones(numel, device=device)
            fn, methods[kind] = _operation(dist, torch, kind, x, n, rank, per_node, methods.get(kind))
            t = timed(fn)
            results[kind].append([numel * 4, t / 2 if kind.startswith("p2p") else t])
            if bar:
                bar.update(task, advance=1, description=f"{kind:>15} {numel * 4:>10} B {t * 1e3:9.3f} ms")
            budget_left = torch.tensor([float(time.perf_counter() - started < args.time_budget / len(kinds))], device=device)
            dist.all_reduce(budget_left, op=dist.ReduceOp.MIN)  # all ranks stop together
            if not budget_left.item():
                break
        if bar:
            bar.update(task, advance=len(sizes) - len(results[kind]))  # sizes skipped by the time budget
    if rank == 0:
        bar.stop()
        gpu = "cpu"
        if backend == "nccl":
            name = torch.cuda.get_device_name().lower()
            gpu = next((preset for key, preset in GPU_NAMES if key in name), None)
            if gpu is None:
                print(f"profile-cluster: no preset for {name!r}; writing a100-80gb numbers, edit `gpu:` in the file",
                      file=sys.stderr)
                gpu = "a100-80gb"
        from planner.cluster import save_cluster

        raw = {"world_size": n, "num_nodes": n // per_node, "backend": backend, "gpu": gpu, "measurements": results,
               "methods": methods, "compute_slowdown": slowdown,
               "pipeline_overhead_s": overhead}
        save_cluster(fit_cluster(raw), args.output)
    dist.destroy_process_group()


def _operation(dist, torch, kind: str, x, n: int, rank: int, per_node: int, method: str | None):
    """(callable, method name) for one collective on tensor `x` (M = x's bytes)."""
    shard = x.numel() // n
    if kind == "all_reduce":
        return (lambda: dist.all_reduce(x)), "all_reduce"
    if kind == "all_gather":
        out, parts = torch.empty(x.numel(), device=x.device), [torch.empty(shard, device=x.device) for _ in range(n)]
        if method in (None, "all_gather_into_tensor") and _works(lambda: dist.all_gather_into_tensor(out, x[:shard])):
            return (lambda: dist.all_gather_into_tensor(out, x[:shard])), "all_gather_into_tensor"
        return (lambda: dist.all_gather(parts, x[:shard])), "all_gather (list)"
    if kind == "reduce_scatter":
        out, exchanged = torch.empty(shard, device=x.device), torch.empty_like(x)
        if method in (None, "reduce_scatter_tensor") and _works(lambda: dist.reduce_scatter_tensor(out, x)):
            return (lambda: dist.reduce_scatter_tensor(out, x)), "reduce_scatter_tensor"
        return (lambda: reduce_scatter_by_all_to_all(dist, torch, out, x, exchanged)), "all_to_all_single + local sum"
    peer = 1 if kind == "p2p" else per_node
    return (lambda: _ping_pong(dist, x, rank, peer)), f"send/recv ping-pong rank 0 <-> {peer}, halved"


def reduce_scatter_by_all_to_all(dist, torch, out, x, exchanged) -> None:
    """reduce_scatter_tensor(out, x) for backends without it: block j of every rank goes to
    rank j (the same (n-1)/n M bytes per rank as a ring reduce-scatter), which sums them."""
    dist.all_to_all_single(exchanged, x)
    torch.sum(exchanged.view(-1, out.numel()), dim=0, out=out)


def _works(fn) -> bool:
    """Whether the backend implements a call (both ranks fail alike when it does not)."""
    try:
        fn()
        return True
    except (RuntimeError, NotImplementedError, ValueError):
        return False


def _ping_pong(dist, x, rank: int, peer: int) -> None:
    if rank == 0:
        dist.send(x, peer)
        dist.recv(x, peer)
    elif rank == peer:
        dist.recv(x, 0)
        dist.send(x, 0)


def _progress_bar(total: int):
    """A started rich progress bar and its task (rank 0 only)."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    bar = Progress(TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn())
    task = bar.add_task("profile-cluster", total=total)
    bar.start()
    return bar, task


def _main() -> None:
    parser = argparse.ArgumentParser(description="profile-cluster worker (start it under torchrun)")
    parser.add_argument("--output", default="profiles/clusters/measured.yaml")
    parser.add_argument("--min-bytes", type=int, default=4096)
    parser.add_argument("--max-bytes", type=int, default=16 * 2**20)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--time-budget", type=float, default=60.0)
    parser.add_argument("--backend", default="auto", choices=("auto", "nccl", "gloo"))
    parser.add_argument("--op-timeout", type=float, default=300.0)
    parser.add_argument("--status-dir", default=None)
    args = parser.parse_args()
    try:
        _worker(args)
    except Exception as exc:  # one line the launcher can quote, then torchrun's own report
        print(f"profile-cluster error (rank {os.environ.get('RANK', '?')}): {type(exc).__name__}: {exc}".splitlines()[0],
              file=sys.stderr, flush=True)
        raise
    # The file is written and the process group destroyed: skip the interpreter's teardown,
    # where gloo ranks occasionally abort (see runtime/__main__.py).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    _main()
