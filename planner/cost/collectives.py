"""Collective and point-to-point times: the library's algorithms, cheapest wins.

Which algorithms a group can run depends on the library the cluster's processes use
(`Cluster.backend`): NCCL on GPUs, gloo on the CPU preset.

NCCL (GPU clusters): the algorithms and protocols NCCL has, each timed as its own tuner times
them (planner/cost/nccl.py: rings and trees in the LL, LL128 and Simple protocols, NVLink SHARP,
PAT; NCCL 2.28's constants). Across nodes NCCL does not run one ring over the network links. It
builds one ring per NIC ("channel"), each through every rank of the group (nccl/src/graph/
tuning.cc; the NCCL 2.4 blog post "Massively Scale Your Deep Learning Training with NCCL 2.4",
Jeaugey 2019), so a node's g GPUs of the group push the ring's traffic through g NICs at once,
while the node's other GPUs run their own groups' collectives (the other data-parallel groups,
one per tensor/pipeline coordinate) on their own NICs: eight GPUs share a node's network links
evenly, and a group holding g of them gets g of the links. The rings' bus bandwidth is
therefore min(beta_nvl, g beta_net) across nodes (beta_net: the preset's inter-node link, one
NIC per GPU), beta_nvl inside a node. The ring pays a latency per rank (2 (n-1) hops for an
all-reduce), so over thousands of ranks the tree, logarithmic in the nodes, wins the all-reduces
of small and medium messages; all-gather and reduce-scatter have no tree (PAT only with one GPU
per node), so theirs stays linear in the ranks. Inside a node whose NVSwitch reduces (NVLink
SHARP: H100, H200), the all-reduce may take NVLS: each GPU sends its M bytes to the switch once
and reads the sum once, at the rate nccl-tests measure (`GPUSpec.nvls_all_reduce_bytes_per_s`,
planner/hardware.py `NVLS_ALL_REDUCE_ALGBW`): 25 us + M / nvls_rate, about 1.3x the ring on 8
GPUs. benchmarks/results/nccl_bus_bandwidth.csv checks the bus bandwidths this predicts against
published nccl-tests figures. All-to-all is grouped sends to every peer (nccl-tests
alltoall_perf), not a tuned collective:

    all-to-all     (n-1) alpha_net + max((g-1)/n^2 M / beta_nvl, (n-g)/n^2 M / beta_net)
                   (in a node: the pairwise exchange below on NVLink)

gloo (the CPU preset): alpha-beta models of the textbook algorithms. A message of M bytes over
a link of latency alpha and bandwidth beta (per process, per direction) costs alpha + M / beta.
For a group of n ranks, with lg = ceil(log2 n) (Thakur, Rabenseifner and Gropp 2005,
"Optimization of Collective Communication Operations in MPICH", IJHPCA 19(1), section 4):

    all-reduce     ring                     2(n-1) alpha + 2(n-1)/n M / beta
                   recursive doubling       lg alpha + lg M / beta      (short messages)
                   Rabenseifner (reduce-scatter by recursive halving, all-gather by
                   recursive doubling)      2 lg alpha + 2(n-1)/n M / beta
                   tree (reduce up a binary tree, broadcast down, pipelined)
                                            2 lg alpha + 2 M / beta
    all-gather /   ring                     (n-1) alpha + (n-1)/n M / beta
    reduce-scatter recursive doubling / halving (Bruck for n not a power of two)
                                            lg alpha + (n-1)/n M / beta
    broadcast      pipelined ring           (n-1) alpha + M / beta
                   binomial tree            lg (alpha + M / beta)
    all-to-all     pairwise exchange        (n-1) alpha + (n-1)/n^2 M / beta
    p2p                                     alpha + M / beta

The ring moves each rank's bytes over n-1 (twice for all-reduce) steps, so it pays the most
latency terms and the fewest bytes; recursive doubling the reverse. Which is cheapest therefore
switches from the latency-optimal algorithm to the bandwidth-optimal one as M grows. A group
spread over several nodes is priced flat (the algorithms above on the inter-node link, whose
slowest hop paces the whole ring) and hierarchical (all-reduce: reduce-scatter inside each node
over g = size / nodes ranks, all-reduce of the 1/g shard across nodes, all-gather inside the
node; all-gather and reduce-scatter likewise in two levels; broadcast across then within).

M is the full (unsharded) tensor: the all-gather's output, the reduce-scatter's input, the
all-to-all's whole tensor (every rank holds M/n and keeps 1/n of it). A p2p message costs the
link's alpha + M / beta under either library.

A cluster measured by `planner profile-cluster` carries a fitted latency and bandwidth per
collective, in terms of the ring's per-rank traffic (2(n-1)/n M for all-reduce, (n-1)/n M
for all-gather and reduce-scatter, M for p2p). Those replace the models above for groups
inside one node. A fit made with k ranks (`num_ranks`) is applied to a group of n by scaling
its latency by the ring's step count, (n-1)/(k-1); fits made across several nodes
(`num_nodes` > 1) are not used.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from planner.cluster import Cluster, Link
from planner.cost.nccl import NVLS_LATENCY_S, tuned_times

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all")

RING_TRAFFIC = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "all_to_all": lambda n: (n - 1) / n**2,
    "p2p": lambda n: 1.0,
}
"""Bytes each rank sends in the ring algorithm, as a fraction of M (the fits' x axis)."""


@dataclass(frozen=True)
class Group:
    """Where a process group's ranks sit."""

    size: int
    """Ranks in the group."""
    num_nodes: int
    """Nodes the group spans (its ranks spread evenly over them)."""

    @property
    def per_node(self) -> int:
        """Ranks of the group on each node it spans."""
        return max(self.size // self.num_nodes, 1)


def group_placement(cluster: Cluster, size: int, stride: int) -> Group:
    """The group of ranks r0, r0 + stride, ..., r0 + (size-1) stride (nodes hold consecutive ranks).

    Every group of one kind in the (pp, dp, tp) rank grid is placed alike, so the group
    starting at rank 0 stands for all of them.
    """
    if size <= 1:
        return Group(1, 1)
    if stride < 1 or (size - 1) * stride >= cluster.world_size:
        raise ValueError(f"a group of {size} ranks {stride} apart does not fit in {cluster.world_size} ranks")
    nodes = len({(i * stride) // cluster.gpus_per_node for i in range(size)})
    return Group(size, nodes)


def _log2(n: int) -> int:
    return math.ceil(math.log2(n)) if n > 1 else 0


def flat_times(kind: str, n: int, nbytes: float, link: Link) -> dict[str, float]:
    """Every algorithm's time for a group of `n` ranks all on `link` (module docstring)."""
    if kind not in KINDS:
        raise ValueError(f"unknown collective {kind!r}; use one of {KINDS}")
    if n <= 1 or nbytes <= 0:
        return {"none": 0.0}
    a, b, lg = link.latency_s, link.bandwidth_bytes_per_s, _log2(n)
    if kind == "all_reduce":
        return {
            "ring": 2 * (n - 1) * a + 2 * (n - 1) / n * nbytes / b,
            "recursive_doubling": lg * (a + nbytes / b),
            "halving_doubling": 2 * lg * a + 2 * (n - 1) / n * nbytes / b,
            "tree": 2 * lg * a + 2 * nbytes / b,
        }
    if kind in ("all_gather", "reduce_scatter"):
        return {"ring": (n - 1) * a + (n - 1) / n * nbytes / b, "recursive": lg * a + (n - 1) / n * nbytes / b}
    if kind == "broadcast":
        return {"ring": (n - 1) * a + nbytes / b, "tree": lg * (a + nbytes / b)}
    return {"pairwise": (n - 1) * a + (n - 1) / n**2 * nbytes / b}


def grouped_all_to_all_s(group: Group, nbytes: float, intra: Link, inter: Link) -> float:
    """NCCL's all-to-all across nodes: grouped sends to every peer at once (module docstring).

    Each rank holds M/n and keeps 1/n of it; of the rest, the share bound for its node's g - 1
    other ranks crosses NVLink, the share bound for the n - g remote ranks leaves through the
    GPU's own NIC, both at once."""
    n, g = group.size, group.per_node
    per_rank = nbytes / n
    return (n - 1) * inter.latency_s + max((g - 1) / n * per_rank / intra.bandwidth_bytes_per_s,
                                           (n - g) / n * per_rank / inter.bandwidth_bytes_per_s)


class CollectiveModel:
    """Times of collectives and p2p on one cluster; the public methods return the cheapest algorithm's."""

    def __init__(self, cluster: Cluster):
        self.cluster = cluster

    def _fitted_s(self, kind: str, nbytes: float, size: int) -> float | None:
        """Time from a profile-cluster fit, or None when the cluster has none for `kind`."""
        fit = self.cluster.fitted.get(kind)
        if not fit or int(fit.get("num_nodes", 1)) > 1:  # a fit made across nodes says nothing about one node
            return None
        measured = int(fit.get("num_ranks", size))
        steps = (size - 1) / (measured - 1) if measured > 1 and kind != "p2p" else 1.0
        return steps * float(fit["latency_s"]) + RING_TRAFFIC[kind](size) * nbytes / float(fit["bandwidth_bytes_per_s"])

    def algorithm_times(self, kind: str, nbytes: float, group: Group) -> dict[str, float]:
        """Every applicable algorithm's time in seconds, by name (for explanations and tests)."""
        if kind not in KINDS:
            raise ValueError(f"unknown collective {kind!r}; use one of {KINDS}")
        if group.size <= 1 or nbytes <= 0:
            return {"none": 0.0}
        c = self.cluster
        g, nodes = group.per_node, group.num_nodes
        if nodes <= 1:
            fitted = self._fitted_s(kind, nbytes, group.size)
            if fitted is not None:
                return {"fitted": fitted}
        if c.backend == "nccl":  # NCCL's algorithms and protocols, as its tuner prices them
            if kind == "all_to_all":  # grouped sends, not a tuned collective
                return {"grouped_p2p": grouped_all_to_all_s(group, nbytes, c.intra_node, c.inter_node)} if nodes > 1 \
                    else flat_times(kind, group.size, nbytes, c.intra_node)
            busbw = c.intra_node.bandwidth_bytes_per_s if nodes <= 1 else \
                min(c.intra_node.bandwidth_bytes_per_s, g * c.inter_node.bandwidth_bytes_per_s)
            times = tuned_times(kind, group.size, nodes, nbytes, busbw, c.gpu.name)
            if kind == "all_reduce" and nodes <= 1 and c.gpu.nvls_all_reduce_bytes_per_s:
                times["nvls"] = NVLS_LATENCY_S + nbytes / c.gpu.nvls_all_reduce_bytes_per_s
            return times
        if nodes <= 1:
            return flat_times(kind, group.size, nbytes, c.intra_node)
        times = {f"flat_{k}": v for k, v in flat_times(kind, group.size, nbytes, c.inter_node).items()}

        def inside(k: str, m: float) -> float:
            fitted = self._fitted_s(k, m, g) if g > 1 else None
            return fitted if fitted is not None else min(flat_times(k, g, m, c.intra_node).values())

        def across(k: str, m: float) -> float:
            return min(flat_times(k, nodes, m, c.inter_node).values())

        if kind == "all_reduce":
            times["hierarchical"] = inside("reduce_scatter", nbytes) + across("all_reduce", nbytes / g) + inside("all_gather", nbytes)
        elif kind == "all_gather":  # gather the node's shards across nodes, then the node's full blocks inside
            times["hierarchical"] = across("all_gather", nbytes / g) + inside("all_gather", nbytes)
        elif kind == "reduce_scatter":  # the mirror image: inside first, then across on 1/g
            times["hierarchical"] = inside("reduce_scatter", nbytes) + across("reduce_scatter", nbytes / g)
        elif kind == "broadcast":
            times["hierarchical"] = across("broadcast", nbytes) + inside("broadcast", nbytes)
        return times

    def best_algorithm(self, kind: str, nbytes: float, group: Group) -> tuple[str, float]:
        """(name, seconds) of the cheapest algorithm."""
        times = self.algorithm_times(kind, nbytes, group)
        name = min(times, key=times.__getitem__)
        return name, times[name]

    def _best(self, kind: str, nbytes: float, group: Group) -> float:
        return min(self.algorithm_times(kind, nbytes, group).values())

    def all_reduce_s(self, nbytes: float, group: Group) -> float:
        return self._best("all_reduce", nbytes, group)

    def all_gather_s(self, nbytes: float, group: Group) -> float:
        """`nbytes` is the gathered (output) size."""
        return self._best("all_gather", nbytes, group)

    def reduce_scatter_s(self, nbytes: float, group: Group) -> float:
        """`nbytes` is the input (unscattered) size."""
        return self._best("reduce_scatter", nbytes, group)

    def broadcast_s(self, nbytes: float, group: Group) -> float:
        return self._best("broadcast", nbytes, group)

    def all_to_all_s(self, nbytes: float, group: Group) -> float:
        """`nbytes` is the whole tensor (each rank holds 1/size of it)."""
        return self._best("all_to_all", nbytes, group)

    def p2p_s(self, nbytes: float, same_node: bool = True) -> float:
        """One message between two ranks."""
        if nbytes <= 0:
            return 0.0
        fitted = self._fitted_s("p2p", nbytes, 2) if same_node else None
        if fitted is not None:
            return fitted
        link = self.cluster.intra_node if same_node else self.cluster.inter_node
        return link.latency_s + nbytes / link.bandwidth_bytes_per_s

    def for_group(self, group: Group) -> "GroupCollectives":
        return GroupCollectives(self, group)


@dataclass(frozen=True)
class GroupCollectives:
    """Collectives bound to one group (the intra-op solver's TPCollectives)."""

    model: CollectiveModel
    """The cluster's collective model."""
    group: Group
    """The group every call is priced for."""

    def all_reduce_s(self, nbytes: float) -> float:
        return self.model.all_reduce_s(nbytes, self.group)

    def all_gather_s(self, nbytes: float) -> float:
        return self.model.all_gather_s(nbytes, self.group)

    def reduce_scatter_s(self, nbytes: float) -> float:
        return self.model.reduce_scatter_s(nbytes, self.group)

    def all_to_all_s(self, nbytes: float) -> float:
        return self.model.all_to_all_s(nbytes, self.group)
