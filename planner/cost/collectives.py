"""Collective and point-to-point times: alpha-beta models per algorithm, cheapest wins.

A message of M bytes over a link of latency alpha and bandwidth beta (per GPU, per
direction) costs alpha + M / beta. For a group of n ranks (Thakur, Rabenseifner and Gropp
2005, "Optimization of Collective Communication Operations in MPICH", section 4; the NCCL
documentation for ring and tree):

    all-reduce     ring                     2(n-1) alpha + 2(n-1)/n M / beta
                   recursive halving-doubling (Rabenseifner: reduce-scatter by halving,
                                            all-gather by doubling)
                                            2 log2(n) alpha + 2(n-1)/n M / beta
                   tree (pipelined reduce + broadcast, NCCL's double binary tree)
                                            2 log2(n) alpha + 2 M / beta
    all-gather /   ring                     (n-1) alpha + (n-1)/n M / beta
    reduce-scatter recursive doubling/halving  log2(n) alpha + (n-1)/n M / beta
    broadcast      pipelined ring           (n-1) alpha + M / beta
                   binomial tree            log2(n) (alpha + M / beta)
    all-to-all     pairwise exchange        (n-1) alpha + (n-1)/n^2 M / beta
    p2p                                     alpha + M / beta

M is the full (unsharded) tensor: the all-gather's output, the reduce-scatter's input.
log2 is rounded up for group sizes that are not powers of two.

Placement decides the link: a group inside one node uses the intra-node link; a group
spread over several nodes is priced two ways and the cheaper is used: flat (the algorithms
above on the inter-node link, the slowest hop paces a ring) and hierarchical (all-reduce:
reduce-scatter inside each node, all-reduce of the 1/g shard across nodes with every GPU
using its own NIC, all-gather inside the node; all-gather and reduce-scatter likewise in
two levels). A cluster measured by `planner profile-cluster` carries fitted latency and
bandwidth per collective (in terms of the ring's per-rank traffic); those replace the
alpha-beta terms for groups inside one node.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from planner.cluster import Cluster, Link

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all")


@dataclass(frozen=True)
class Group:
    size: int
    """Ranks in the group."""
    num_nodes: int
    """Nodes the group spans (its ranks spread evenly over them)."""

    @property
    def per_node(self) -> int:
        return max(self.size // self.num_nodes, 1)


def group_placement(cluster: Cluster, size: int, stride: int) -> Group:
    """The group of ranks r0, r0 + stride, ..., r0 + (size-1) stride (nodes hold consecutive ranks)."""
    if size <= 1:
        return Group(1, 1)
    # The group starting at rank 0 (the (pp, dp, tp) grid makes every group of a kind alike).
    nodes = len({(i * stride) // cluster.gpus_per_node for i in range(size)})
    return Group(size, nodes)


def _log2(n: int) -> int:
    return max(math.ceil(math.log2(n)), 1) if n > 1 else 0


def _flat(kind: str, n: int, nbytes: float, link: Link) -> dict[str, float]:
    """Every algorithm's time for one flat group on one link."""
    if n <= 1:
        return {"none": 0.0}
    a, b, lg = link.latency_s, link.bandwidth_bytes_per_s, _log2(n)
    if kind == "all_reduce":
        return {
            "ring": 2 * (n - 1) * a + 2 * (n - 1) / n * nbytes / b,
            "halving_doubling": 2 * lg * a + 2 * (n - 1) / n * nbytes / b,
            "tree": 2 * lg * a + 2 * nbytes / b,
        }
    if kind in ("all_gather", "reduce_scatter"):
        return {"ring": (n - 1) * a + (n - 1) / n * nbytes / b, "recursive": lg * a + (n - 1) / n * nbytes / b}
    if kind == "broadcast":
        return {"ring": (n - 1) * a + nbytes / b, "tree": lg * (a + nbytes / b)}
    if kind == "all_to_all":
        return {"pairwise": (n - 1) * a + (n - 1) / n**2 * nbytes / b}
    raise ValueError(f"unknown collective {kind!r}; use one of {KINDS}")


RING_TRAFFIC = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
                "reduce_scatter": lambda n: (n - 1) / n, "broadcast": lambda n: 1.0, "all_to_all": lambda n: (n - 1) / n**2}


class CollectiveModel:
    """Times of collectives and p2p on one cluster."""

    def __init__(self, cluster: Cluster):
        self.cluster = cluster

    def algorithm_times(self, kind: str, nbytes: float, group: Group) -> dict[str, float]:
        if group.size <= 1 or nbytes <= 0:
            return {"none": 0.0}
        c = self.cluster
        if group.num_nodes <= 1:
            fit = c.fitted.get(kind)
            if fit:
                traffic = RING_TRAFFIC[kind](group.size) * nbytes
                return {"fitted": float(fit["latency_s"]) + traffic / float(fit["bandwidth_bytes_per_s"])}
            return _flat(kind, group.size, nbytes, c.intra_node)
        times = {f"flat_{k}": v for k, v in _flat(kind, group.size, nbytes, c.inter_node).items()}
        g, nodes = group.per_node, group.num_nodes
        inside = lambda k, m: min(_flat(k, g, m, c.intra_node).values())  # noqa: E731
        across = lambda k, m: min(_flat(k, nodes, m, c.inter_node).values())  # noqa: E731
        if kind == "all_reduce":
            times["hierarchical"] = inside("reduce_scatter", nbytes) + across("all_reduce", nbytes / g) + inside("all_gather", nbytes)
        elif kind in ("all_gather", "reduce_scatter"):
            times["hierarchical"] = across(kind, nbytes / g) + inside(kind, nbytes)
        elif kind == "broadcast":
            times["hierarchical"] = across("broadcast", nbytes) + inside("broadcast", nbytes)
        return times

    def _best(self, kind: str, nbytes: float, group: Group) -> float:
        return min(self.algorithm_times(kind, nbytes, group).values())

    def all_reduce_s(self, nbytes: float, group: Group) -> float:
        return self._best("all_reduce", nbytes, group)

    def all_gather_s(self, nbytes: float, group: Group) -> float:
        return self._best("all_gather", nbytes, group)

    def reduce_scatter_s(self, nbytes: float, group: Group) -> float:
        return self._best("reduce_scatter", nbytes, group)

    def broadcast_s(self, nbytes: float, group: Group) -> float:
        return self._best("broadcast", nbytes, group)

    def all_to_all_s(self, nbytes: float, group: Group) -> float:
        return self._best("all_to_all", nbytes, group)

    def p2p_s(self, nbytes: float, same_node: bool = True) -> float:
        if nbytes <= 0:
            return 0.0
        fit = self.cluster.fitted.get("p2p") if same_node else None
        if fit:
            return float(fit["latency_s"]) + nbytes / float(fit["bandwidth_bytes_per_s"])
        link = self.cluster.intra_node if same_node else self.cluster.inter_node
        return link.latency_s + nbytes / link.bandwidth_bytes_per_s

    def for_group(self, group: Group) -> "GroupCollectives":
        return GroupCollectives(self, group)


@dataclass(frozen=True)
class GroupCollectives:
    """Collectives bound to one group (the intra-op solver's TPCollectives)."""

    model: CollectiveModel
    group: Group

    def all_reduce_s(self, nbytes: float) -> float:
        return self.model.all_reduce_s(nbytes, self.group)

    def all_gather_s(self, nbytes: float) -> float:
        return self.model.all_gather_s(nbytes, self.group)

    def reduce_scatter_s(self, nbytes: float) -> float:
        return self.model.reduce_scatter_s(nbytes, self.group)

    def all_to_all_s(self, nbytes: float) -> float:
        return self.model.all_to_all_s(nbytes, self.group)
