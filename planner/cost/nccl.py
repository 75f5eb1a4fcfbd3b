"""NCCL's own cost model of its collectives: the algorithms and protocols it can run, each timed as
its tuner times them to choose one (NVIDIA/nccl src/graph/tuning.cc, `ncclTopoTuneModel` and
`ncclTopoGetAlgoTime`, constants of NCCL 2.28, the release torch ships in 2026).

A call of M bytes costs `latency + M / algorithm_bandwidth` for each (algorithm, protocol) NCCL
enables for it, and NCCL runs the cheapest:

- algorithms: the ring for every collective (one ring per NIC across nodes, every rank of the
  group on each); for all-reduce also the tree (a chain inside each node, a double binary tree
  across nodes) and, inside a node whose NVSwitch reduces, NVLink SHARP (NVLS, planner/hardware.py
  `NVLS_ALL_REDUCE_ALGBW`, timed from nccl-tests' figures rather than the tuner's estimate); for
  all-gather and reduce-scatter with one GPU per node, PAT (NCCL >= 2.23). NCCL has no recursive
  doubling or halving, and no hierarchical all-gather or reduce-scatter (planner/cost/collectives.py
  keeps those textbook algorithms for gloo).
- protocols: Simple (the link's full rate; per hop 3.4 us on NVLink, 14 us on the network), LL128
  (0.92 of it, 1.9 / 4.0 us a hop: NVLink systems only, which the presets are) and LL (half the rate
  and at most `LL_MAX_BUSBW`, 0.6 / 2.7 us a hop), so small messages take LL and large ones Simple.

Bandwidth. The tuner's bus bandwidth is its topology search's channels times their rate; the model
takes the busbw the preset links reach (planner/cluster.py: the intra-node link inside a node,
min(NVLink, g x NIC) across nodes, g GPUs of the group per node), which benchmarks/results/
nccl_bus_bandwidth.csv checks against nccl-tests. The algorithm bandwidth is the bus bandwidth
times n / nsteps for the ring (nsteps: 2 (n-1) all-reduce, n-1 all-gather / reduce-scatter, n
broadcast) and 0.5 for the tree after its own factors (0.92; LL 1/3.8; LL128 7/9 in a node, 120/128
across), the tree's times `TREE_CORRECTION` by message size.

Latency: a base per algorithm and protocol, then per hop: the ring pays (nsteps - inter) hops at the
intra-node latency (across nodes at least the network post overhead, 1 us, 3 us for Simple) and
`inter` hops at the network's (2 (N-1) for all-reduce, N-1 otherwise, N nodes); the tree
2 ((g-1) intra + log2 N inter); with one GPU per node the network hops take the tree's latency.

Left out, as they need the topology search's channel count: the per-channel caps on the LL128 and
tree bandwidths and the ring's 1.4x latency "plateau" for large multi-node all-reduces; the
x86 host is taken as Intel (DGX H100/B200; DGX A100's AMD hosts get a 2 us network overhead and
LL caps 22.5 / 19 GB/s across nodes). CollNet (SHARP in the network switches) is not modelled.
"""

from __future__ import annotations

import math

PROTOCOLS = ("LL", "LL128", "Simple")
BASE_LATENCY_US = {"tree": (6.8, 14.0, 8.4), "ring": (6.6, 14.0, 8.4), "pat": (8.0, 8.0, 8.0)}
"""`baseLatencies`, per protocol (LL, LL128, Simple)."""
HOP_LATENCY_US = {
    "nvlink": {"tree": (0.6, 1.25, 4.0), "ring": (0.6, 1.9, 3.4), "pat": (0.0, 0.0, 4.0)},
    "net": {"tree": (5.0, 8.5, 14.0), "ring": (2.7, 4.0, 14.0), "pat": (0.0, 0.0, 14.0)},
}
"""`hwLatencies`, per hop and protocol."""
NVLS_LATENCY_S = 25e-6
"""The NVLink SHARP all-reduce's latency (`hwLatencies`, NVLink, NVLS, Simple: 25 us in NCCL 2.21
to 2.28); its rate is nccl-tests' (planner/hardware.py `NVLS_ALL_REDUCE_ALGBW`)."""
NET_OVERHEAD_US = 1.0
"""`getNetOverhead` on an Intel x86 host (AMD: 2.0); three times that for Simple."""
LL_MAX_BUSBW_GB_S = {"ampere": 87.7, "hopper": 141.0, "blackwell": 282.0}
"""`llMaxBws`: the LL protocol's bus bandwidth cap inside a node, by GPU generation."""
LL_MAX_BUSBW_ACROSS_GB_S = (39.0, 20.4)
"""`llMaxBws` across nodes (Intel hosts): on two nodes, on more."""
TREE_CORRECTION = (
    (1.0, 1.0, 1.0, 1.0, .9, .8, .7, .7, .7, .7, .6, .5, .4, .4, .5, .6, .7, .8, .9, 1.0, 1.0, 1.0, 1.0),
    (1.0, 1.0, 1.0, 1.0, 1.0, .9, .8, .8, .8, .7, .6, .6, .6, .6, .6, .6, .8, .9, .9, .9, .9, 1.0, 1.0),
    (.9, .9, .9, .9, .9, .9, .9, .8, .7, .6, .6, .5, .5, .5, .5, .6, .7, .8, .7, .7, .8, .9, .9),
)
"""`treeCorrectionFactor`: the tree's bandwidth at 64 B x 2^i, per protocol ("trees are not
perfectly sticking to the model for medium sizes")."""
US = 1e-6


def generation(gpu_name: str) -> str:
    """NCCL's compute-capability class of a preset (its LL cap inside a node)."""
    name = gpu_name.lower()
    return "blackwell" if name.startswith("b") else "hopper" if name.startswith("h") else "ampere"


def _ll_cap(nodes: int, gpu_name: str) -> float:
    if nodes == 1:
        return LL_MAX_BUSBW_GB_S[generation(gpu_name)] * 1e9
    return LL_MAX_BUSBW_ACROSS_GB_S[0 if nodes == 2 else 1] * 1e9


def _steps(kind: str, n: int, nodes: int) -> tuple[int, int]:
    """(ring steps, of them across nodes)."""
    if kind == "all_reduce":
        return 2 * (n - 1), (2 * (nodes - 1) if nodes > 1 else 0)
    if kind in ("all_gather", "reduce_scatter"):
        return n - 1, nodes - 1
    return n, (nodes if nodes > 1 else 0)  # broadcast


def tuned_times(kind: str, n: int, nodes: int, nbytes: float, busbw: float, gpu_name: str) -> dict[str, float]:
    """Seconds of every (algorithm, protocol) NCCL enables for `kind` on n ranks over `nodes` nodes
    (evenly), M = `nbytes`, the Simple ring's bus bandwidth `busbw` (bytes/s), keyed
    "<algorithm>_<protocol>" (module docstring). Broadcast, all-gather, reduce-scatter, all-reduce."""
    per_node = max(n // nodes, 1)
    ll_cap = _ll_cap(nodes, gpu_name)
    hop = "nvlink" if nodes == 1 else "net"
    times: dict[str, float] = {}
    nsteps, inter_steps = _steps(kind, n, nodes)
    for p, protocol in enumerate(PROTOCOLS):
        bus = {"LL": min(ll_cap, 0.5 * busbw), "LL128": 0.92 * busbw, "Simple": busbw}[protocol]
        intra = HOP_LATENCY_US["nvlink"]["ring"][p]
        inter = HOP_LATENCY_US["net"]["tree" if per_node == 1 else "ring"][p] if nodes > 1 else 0.0
        if kind == "broadcast":  # a hop a step, Simple's at the tree's hop latency (channels not the ring's)
            latency = BASE_LATENCY_US["ring"][p] + nsteps * HOP_LATENCY_US[hop]["tree" if protocol == "Simple" else "ring"][p]
        else:
            if nodes > 1:
                intra = max(intra, NET_OVERHEAD_US * (3 if protocol == "Simple" else 1))
            latency = BASE_LATENCY_US["ring"][p] + (nsteps - inter_steps) * intra + inter_steps * inter
        times[f"ring_{protocol}"] = latency * US + nbytes / (bus * n / nsteps)
        if kind == "all_reduce":
            tree_bus = 0.92 * busbw * {"LL": 1 / 3.8, "LL128": 7 / 9 if nodes == 1 else 120 / 128, "Simple": 1.0}[protocol]
            if protocol == "LL":
                tree_bus = min(tree_bus, ll_cap)
            size_class = int(math.log2(max(nbytes, 64) / 64))
            if size_class < len(TREE_CORRECTION[p]):
                tree_bus *= TREE_CORRECTION[p][size_class]
            tree_inter = HOP_LATENCY_US["net"]["tree"][p]
            tree_latency = BASE_LATENCY_US["tree"][p] + 2 * ((per_node - 1) * HOP_LATENCY_US["nvlink"]["tree"][p]
                                                           + math.floor(math.log2(nodes)) * tree_inter)
            times[f"tree_{protocol}"] = tree_latency * US + nbytes / (0.5 * tree_bus)
    if kind in ("all_gather", "reduce_scatter") and nodes > 1 and per_node == 1:
        # PAT (NCCL >= 2.23), Simple only: a logarithmic schedule with a linear remainder.
        tree_inter = HOP_LATENCY_US["net"]["tree"][2]
        latency = BASE_LATENCY_US["pat"][2] + math.floor(math.log2(nodes)) * tree_inter / 3.5 + n * 2.8
        times["pat_Simple"] = latency * US + nbytes / (0.75 * busbw)  # no bus-to-algorithm ratio for PAT
    return times
