"""Cluster measurements -> a cluster: each collective's timings fitted as

    time = latency_s + traffic / bandwidth_bytes_per_s

by least squares (robust to a shared machine's outliers, `fit`), where traffic is the ring
algorithm's bytes per rank (2(n-1)/n M for all-reduce, (n-1)/n M for all-gather and
reduce-scatter, (n-1)/n^2 M for all-to-all of a whole tensor M, M for p2p;
planner/cost/collectives.py). `fit_cluster` turns a finished
measurement (planner/cluster_worker.py) into a Cluster: the GPU preset, the intra-node link
from the p2p fit, a `fitted` section (each fit with its raw [bytes, seconds] points) that the
collective model uses for groups inside a node, the node's compute contention and the
pipeline overhead (`overhead_from_step`).
"""

from __future__ import annotations

from planner.cost.collectives import RING_TRAFFIC

TRAFFIC = {**RING_TRAFFIC, "p2p_inter_node": RING_TRAFFIC["p2p"]}
"""Ring bytes per rank as a fraction of the message (collectives.RING_TRAFFIC; the inter-node
ping-pong is a p2p)."""

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
