"""PipeDream stage replication against uniform stages and the best 1F1B plan, predicted.

Model: VGG-16 (examples/vgg.py, torchvision's layout, 224x224 images, 1000 classes), PipeDream's
own image model: its convolutions are heavy in compute and light in weights, its classifier
the reverse (~120 M of its 138 M parameters), the case per-stage replication is for.
Profiled analytically on the meta device (H100 roofline, bf16), global batch 256.

Clusters: 4 and 8 H100s in one node (NVLink), and 4 and 8 H100s one per node over 25 Gb/s
Ethernet (PipeDream's setting, where data parallelism's all-reduce of the classifier is slow).

Rows per cluster (`method`):
- `pipedream`: PipeDream's partitioner with per-stage replication (planner/solver/replication.py),
  priced as a synchronous 1F1B-RR step (`step_time_s`), the best profiled micro-batch size;
- `uniform`: G stages of one GPU each, equal unit counts, the same 1F1B-RR pricing (replicas 1);
- `best-1f1b`: the search's best plan with the 1f1b schedule pinned (any pp, dp, tp, ZeRO,
  recomputation: planner/solver/solve.py), its predicted step;
- `best-any-schedule`: the search's free best (zero bubble and interleaving allowed), for reference
  (the replicated pipeline is priced as 1F1B-RR, so `best-1f1b` is the like-for-like baseline).
- async rows: `benchmarks/pipedream_async.py`'s `async_rows()` when that file exists (another
  helper's: PipeDream-2BW's predicted speed-up and memory); see `ASYNC ROWS` below.

Writes benchmarks/results/pipedream.{csv,png}.

    python benchmarks/pipedream.py
"""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

import pandas as pd

from planner.cluster import Cluster, Link, make_cluster
from planner.cost.compute import ComputeModel
from planner.errors import PlannerError
from planner.profiler import profile_model
from planner.solver.costs import UnitCosts
from planner.solver.replication import evaluate, replica_memory_bytes, step_time_s
from planner.solver.replication_search import micro_batch_sizes, replication_problem, search_replicated
from planner.solver.search import Environment
from planner.solver.solve import MEMORY_FRACTION, Pins, _environment, solve

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
GLOBAL_BATCH = 256
MICRO_BATCHES = [8, 16, 32]
ETHERNET = Link(25e9 / 8 * 0.8, 20e-6)
"""25 Gb/s Ethernet at 80% of the wire rate, 20 us per message (TCP)."""


def clusters() -> list[tuple[str, Cluster]]:
    out = []
    for gpus in (4, 8):
        out.append((f"{gpus}xH100 NVLink", make_cluster(gpus, gpus, "h100-80gb")))
        out.append((f"{gpus}xH100 25GbE", dataclasses.replace(make_cluster(gpus, 1, "h100-80gb"), inter_node=ETHERNET)))
    return out


def _environment_for(profile, cluster: Cluster) -> Environment:
    compute = ComputeModel(profile, cluster.gpu, "bfloat16", slowdown=cluster.compute_slowdown)
    return _environment(cluster, compute, "bfloat16", Pins(), MEMORY_FRACTION)


def _tables(profile, cluster: Cluster) -> dict:
    from planner.cost.collectives import CollectiveModel, group_placement

    compute = ComputeModel(profile, cluster.gpu, "bfloat16", slowdown=cluster.compute_slowdown)
    coll = CollectiveModel(cluster)
    costs = UnitCosts(profile, compute, lambda t: coll.for_group(group_placement(cluster, t, 1)), "bfloat16")
    return {b: costs.table(1, False, b) for b in micro_batch_sizes(GLOBAL_BATCH, MICRO_BATCHES)}


def uniform_row(tables: dict, env: Environment, gpus: int) -> dict:
    """G stages, one GPU each, equal unit counts; the fastest micro-batch size that fits."""
    best: dict = {}
    for b, table in tables.items():
        m = GLOBAL_BATCH // b
        problem = replication_problem(table, env, gpus, m, b)
        units = problem.num_units
        edges = [round(k * units / gpus) for k in range(gpus + 1)]
        bounds, replicas = tuple(zip(edges[:-1], edges[1:], strict=True)), (1,) * gpus
        if evaluate(problem, bounds, replicas).bottleneck_s == float("inf"):
            continue  # a stage does not fit
        seconds = step_time_s(problem, bounds, replicas)
        if not best or seconds < best["step_time_s"]:
            memory = max(replica_memory_bytes(problem, evaluate(problem, bounds, replicas)))
            best = {"method": "uniform", "step_time_s": seconds, "micro_batch_size": b, "replicas": list(replicas),
                    "stage_units": [j - i for i, j in bounds], "peak_memory_gib": memory / 2**30}
    return best


def main() -> pd.DataFrame:
    profile = profile_model(str(ROOT / "examples" / "vgg.py"), {"image_size": 224, "num_classes": 1000, "dropout": 0.0},
                            MICRO_BATCHES, device="meta", gpu="h100-80gb", dtype="bfloat16",
                            precision="pure")
    rows = []
    for name, cluster in clusters():
        env, tables, gpus = _environment_for(profile, cluster), _tables(profile, cluster), cluster.world_size
        base = {"cluster": name, "gpus": gpus, "global_batch": GLOBAL_BATCH}
        choice = search_replicated(tables, env, gpus, GLOBAL_BATCH)
        if choice is not None:
            rows.append({**base, "method": "pipedream", "step_time_s": choice.step_time_s,
                         "micro_batch_size": choice.micro_batch_size, "replicas": list(choice.stages.replicas),
                         "stage_units": [j - i for i, j in choice.stages.bounds],
                         "peak_memory_gib": max(choice.memory_bytes) / 2**30})
        if (uniform := uniform_row(tables, env, gpus)):
            rows.append({**base, **uniform})
        try:
            plan = solve(profile, cluster, GLOBAL_BATCH, Pins(schedule="1f1b"), top_k=1)
            assert plan.prediction is not None, "a solved plan carries its prediction"
            lay = plan.layout
            rows.append({**base, "method": "best-1f1b", "step_time_s": plan.prediction.iteration_time_s,
                         "micro_batch_size": plan.batch.micro_batch_size,
                         "replicas": [lay.dp_degree * lay.tp_degree] * lay.pp_degree,
                         "stage_units": [len(s.units) for s in plan.stages],
                         "peak_memory_gib": max(plan.prediction.peak_memory_bytes) / 2**30,
                         "layout": f"pp{lay.pp_degree} dp{lay.dp_degree} tp{lay.tp_degree} zero{lay.zero_stage}"})
        except PlannerError as error:
            rows.append({**base, "method": "best-1f1b", "layout": f"no plan: {error.message[:80]}"})
        free = solve(profile, cluster, GLOBAL_BATCH, top_k=1)  # any synchronous schedule (zero bubble included)
        assert free.prediction is not None, "a solved plan carries its prediction"
        rows.append({**base, "method": "best-any-schedule", "step_time_s": free.prediction.iteration_time_s,
                     "micro_batch_size": free.batch.micro_batch_size,
                     "peak_memory_gib": max(free.prediction.peak_memory_bytes) / 2**30,
                     "layout": f"pp{free.layout.pp_degree} dp{free.layout.dp_degree} tp{free.layout.tp_degree} "
                               f"zero{free.layout.zero_stage} {free.layout.schedule}"})
        for row in rows[-4:]:
            print({k: row.get(k) for k in ("cluster", "method", "step_time_s", "replicas", "stage_units", "layout")}, flush=True)
    rows += async_rows()
    frame = pd.DataFrame(rows)
    RESULTS.mkdir(parents=True, exist_ok=True)
    frame.to_csv(RESULTS / "pipedream.csv", index=False)
    _plot(frame)
    return frame


def async_rows() -> list[dict]:
    """ASYNC ROWS: PipeDream-2BW's predicted speed-up over 1F1B and its memory cost, from
    benchmarks/pipedream_async.py's `async_rows()` (another helper's) when it exists; none otherwise."""
    path = ROOT / "benchmarks" / "pipedream_async.py"
    if not path.is_file():
        print("benchmarks/pipedream_async.py not found: no async rows", flush=True)
        return []
    spec = importlib.util.spec_from_file_location("pipedream_async", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    table = pd.DataFrame(module.async_rows())  # its own columns (model, gpus, one_f_one_b_s, pipedream_2bw_s, ...)
    return [{"method": "pipedream-2bw (async)", **row} for row in table.to_dict("records")]


def _plot(frame: pd.DataFrame) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sync = frame[frame["method"].isin(["pipedream", "uniform", "best-1f1b", "best-any-schedule"])].dropna(subset=["step_time_s"])
    table = sync.pivot_table(index="cluster", columns="method", values="step_time_s", sort=False) * 1e3
    ax = table.plot.bar(figsize=(8, 4), rot=0)
    ax.set_ylabel("predicted step time (ms)")
    ax.set_title(f"VGG-16, global batch {GLOBAL_BATCH}, bf16: stage replication vs uniform stages vs best 1F1B plan")
    plt.tight_layout()
    plt.savefig(RESULTS / "pipedream.png", dpi=120)
    plt.close()


if __name__ == "__main__":
    print(main().to_string())
