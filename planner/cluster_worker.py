"""The `planner profile-cluster` measurement: one rank of it, started under torchrun by the verb
(planner/cluster_probe.py) or by hand.

Every rank times all-reduce, all-gather (`all_gather_into_tensor`, else the list form),
reduce-scatter (`reduce_scatter_tensor`; where the backend lacks it, as older gloo does, an
`all_to_all_single` followed by a local sum of the n received blocks, which moves the same
(n-1)/n M bytes per rank as the ring reduce-scatter; the file's `method` field says which ran),
all-to-all (`all_to_all_single`, recorded against the whole tensor of all ranks' inputs, as
planner/cost/collectives.py prices it) and point-to-point (rank 0 <-> 1 ping-pong, halved), for message sizes doubling from
`--min-bytes` to `--max-bytes`: two warm-up calls, then the median of `--repeats` timed calls,
each after a barrier; the slowest rank's median is kept. A collective's sweep stops early once
its share of `--time-budget` is spent. Rank 0 shows a progress bar, fits the timings
(planner/cluster_fit.py) and writes the cluster YAML (the GPU preset: `cpu` on gloo, the
detected CUDA GPU otherwise). On gloo it also measures the node's compute contention
(`compute_slowdown`, planner/cluster.py): each rank's time for a fixed mix of matrix products
and elementwise work run alone, then by all ranks at once. With two ranks or more it also
measures what a pipelined micro-batch costs beyond compute and bytes (`pipeline_overhead_s`,
`pipeline_overhead`). The verb's `--threads` sets the torch threads of every process.

It measures the node it runs on. Across nodes, start it under torchrun yourself
(`torchrun --nnodes K --nproc-per-node G --rdzv-backend c10d --rdzv-endpoint HOST:PORT
-m planner.cluster_worker --output FILE`): it then also times p2p between rank 0 and the
first rank of the second node and sets `inter_node` from it; collective fits made across
nodes are recorded with their `num_nodes` and not used for in-node groups.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from planner.cluster_fit import fit_cluster, overhead_from_step
from planner.cluster_probe import GPU_NAMES


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
    everyone: list[float] = [0.0] * n  # filled by every rank's median
    dist.all_gather_object(everyone, statistics.median(ratios))
    return statistics.median(everyone)


def pipeline_overhead(dist, torch, rank: int, device, sync, microbatches: int = 8, steps: int = 30) -> float:
    """`pipeline_overhead_s`: torch's Schedule1F1B over two stages that compute next to nothing.

    Ranks 0 and 1 run it (what the runtime runs; a 16x16 Linear on one 16-wide sample per
    micro-batch) and, after each step, ping-pong that micro-batch's activation to time one p2p
    hop of it; `overhead_from_step` takes the hops the cost model prices on their own out of the
    step. Both are taken at their fastest after warm-up: on a shared machine a busier stretch
    lengthens a hop (a wait for the peer to be scheduled) more than the step, whose hops overlap
    its Python work, so a median of per-step differences still read 0 under a loaded test run
    (twice, 2026-11-28); the fastest step and hop are the least disturbed. The other ranks wait;
    every rank returns the larger of ranks 0 and 1's figures.
    """
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    group = dist.new_group([0, 1])
    value = torch.zeros(1, dtype=torch.float64, device=device)
    if rank < 2:
        stage = PipelineStage(torch.nn.Linear(16, 16).to(device), rank, 2, device, group=group)
        schedule = Schedule1F1B(stage, microbatches, loss_fn=lambda out, target: (out - target).pow(2).mean())
        batch = torch.randn(microbatches, 16, device=device)
        message, steps_s, hops_s = batch[:1].clone(), [], []
        for _ in range(steps + 3):
            dist.barrier(group=group)
            start = time.perf_counter()
            if rank == 0:
                schedule.step(batch)
            else:
                schedule.step(target=batch, losses=[])
            sync()
            steps_s.append(time.perf_counter() - start)
            start = time.perf_counter()
            _ping_pong(dist, message, rank, 1)
            sync()
            hops_s.append((time.perf_counter() - start) / 2)
        value += overhead_from_step(min(steps_s[3:]), min(hops_s[3:]), microbatches)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)  # the larger of ranks 0 and 1's, to every rank
    dist.destroy_process_group(group)
    return float(value)


@dataclass
class _Rank:
    """This rank of the measurement and what its probes share."""

    dist: Any
    """torch.distributed, its process group initialised."""
    torch: Any
    backend: str
    """nccl or gloo."""
    device: Any
    """This rank's torch.device."""
    rank: int
    n: int
    """World size."""
    per_node: int
    """Ranks per node (torchrun's LOCAL_WORLD_SIZE)."""
    status: Path | None
    """A file this rank keeps its current probe in (the launcher quotes it when a rank hangs)."""

    def sync(self) -> None:
        if self.backend == "nccl":
            self.torch.cuda.synchronize()

    def say(self, what: str) -> None:
        if self.status:
            self.status.write_text(what)

    def timed(self, fn, repeats: int) -> float:
        """Seconds of one `fn()` call: two warm-up calls, then the median of `repeats` calls, each
        after a barrier; the slowest rank's median (every rank joins)."""
        for _ in range(2):
            fn()
        self.sync()
        samples = []
        for _ in range(repeats):
            self.dist.barrier()
            start = time.perf_counter()
            fn()
            self.sync()
            samples.append(time.perf_counter() - start)
        value = self.torch.tensor([statistics.median(samples)], dtype=self.torch.float64, device=self.device)
        self.dist.all_reduce(value, op=self.dist.ReduceOp.MAX)  # the slowest rank decides
        return float(value)


def _init(args) -> _Rank:
    """The process group (NCCL when CUDA is available, else gloo, or --backend) and this rank."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    backend = args.backend if args.backend != "auto" else ("nccl" if torch.cuda.is_available() else "gloo")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, timeout=timedelta(seconds=args.op_timeout))
    rank, n = dist.get_rank(), dist.get_world_size()
    status = Path(args.status_dir) / f"rank{rank}" if args.status_dir else None
    return _Rank(dist, torch, backend, device, rank, n, int(os.environ.get("LOCAL_WORLD_SIZE", n)), status)


def _worker(args) -> None:
    """The whole measurement on this rank: contention and pipeline probes, the collective sweeps,
    then rank 0 fits and writes the cluster file."""
    r = _init(args)
    r.say("compute contention")
    slowdown = compute_slowdown(r.dist, r.torch, r.rank, r.n) if r.backend == "gloo" else 1.0
    r.say("pipeline overhead")
    overhead = pipeline_overhead(r.dist, r.torch, r.rank, r.device, r.sync) if r.n > 1 else 0.0
    results, methods = _sweep(r, args)
    if r.rank == 0:
        from planner.cluster import save_cluster

        raw = {"world_size": r.n, "num_nodes": r.n // r.per_node, "backend": r.backend, "gpu": _gpu_preset(r),
               "measurements": results, "methods": methods, "compute_slowdown": slowdown, "pipeline_overhead_s": overhead}
        save_cluster(fit_cluster(raw), args.output)
    r.dist.destroy_process_group()


def _sweep(r: _Rank, args) -> tuple[dict[str, list], dict[str, str]]:
    """Each collective timed at message sizes doubling from --min-bytes to --max-bytes, until its
    share of --time-budget is spent, at two sizes at least (a fit needs two: on a loaded machine the
    first size alone could spend the share, and the collective went unfitted):
    ({kind: [[bytes, seconds], ...]}, {kind: method that ran})."""
    sizes = [args.min_bytes * 2**k for k in range(64) if args.min_bytes * 2**k <= args.max_bytes]
    kinds = ["all_reduce", "all_gather", "reduce_scatter", "all_to_all"] + (["p2p"] if r.per_node > 1 else []) \
        + (["p2p_inter_node"] if r.per_node < r.n else [])
    results: dict[str, list] = {k: [] for k in kinds}
    methods: dict[str, str] = {}
    bar, task = _progress_bar(len(kinds) * len(sizes)) if r.rank == 0 else (None, None)
    for kind in kinds:
        started = time.perf_counter()
        for nbytes in sizes:
            r.say(f"{kind} {nbytes} B")
            numel = max(nbytes // 4, r.n)
            numel -= numel % r.n
            x = r.torch.ones(numel, device=r.device)
            fn, methods[kind] = _operation(r.dist, r.torch, kind, x, r.n, r.rank, r.per_node, methods.get(kind))
            t = r.timed(fn, args.repeats)
            whole = r.n if kind == "all_to_all" else 1  # an all-to-all's M is the whole tensor, n ranks' inputs
            results[kind].append([numel * 4 * whole, t / 2 if kind.startswith("p2p") else t])
            if bar:
                bar.update(task, advance=1, description=f"{kind:>15} {numel * 4:>10} B {t * 1e3:9.3f} ms")
            if len(results[kind]) < 2:  # a fit needs two sizes (planner/cluster_fit.py): measured however long they take
                continue
            budget_left = r.torch.tensor([float(time.perf_counter() - started < args.time_budget / len(kinds))], device=r.device)
            r.dist.all_reduce(budget_left, op=r.dist.ReduceOp.MIN)  # all ranks stop together
            if not budget_left.item():
                break
        if bar:
            bar.update(task, advance=len(sizes) - len(results[kind]))  # sizes skipped by the time budget
    if bar:
        bar.stop()
    return results, methods


def _gpu_preset(r: _Rank) -> str:
    """The GPU preset for the file: `cpu` on gloo, the detected CUDA GPU otherwise (a100-80gb,
    with a warning, for a GPU no preset names)."""
    if r.backend != "nccl":
        return "cpu"
    name = r.torch.cuda.get_device_name().lower()
    preset = next((preset for key, preset in GPU_NAMES if key in name), None)
    if preset is None:
        print(f"profile-cluster: no preset for {name!r}; writing a100-80gb numbers, edit `gpu:` in the file", file=sys.stderr)
    return preset or "a100-80gb"


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
    if kind == "all_to_all":  # expert parallelism's token dispatch (runtime/apply_ep.py)
        received = torch.empty_like(x)
        return (lambda: dist.all_to_all_single(received, x)), "all_to_all_single"
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
