"""The (pp, dp, tp) device mesh and the process groups beside it, built once. tp is innermost,
as planner/plan.py's rank_of says. Expert layers see dp (dp x tp with sequence parallelism)
as (edp, ep) (`build_ep_mesh`); hybrid sharding sees it as (dp_replicate, dp_shard)
(`build_fsdp_mesh`); context parallelism as (dp_outer, cp) (`build_cp_mesh`)."""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from planner.plan import Plan


def build_mesh(plan: Plan, device_type: str) -> DeviceMesh:
    lay = plan.layout
    return init_device_mesh(device_type, (lay.pp_degree, lay.dp_degree, lay.tp_degree), mesh_dim_names=("pp", "dp", "tp"))


def build_ep_mesh(mesh: DeviceMesh, ep_degree: int, fold_tp: bool = False) -> DeviceMesh | None:
    """The view of the mesh for expert layers (planner/plan.py `Layout.ep_degree`), with axes
    "edp" and "ep", ep innermost; None without expert parallelism. Same ranks as `mesh`, new
    groups for the two axes.

    - Unfolded, (pp, edp, ep, tp): dp = edp x ep, so an EP group is ep consecutive dp indices
      (ranks `tp_degree` apart), the tp ranks beside it dispatch the same tokens in their own
      groups, and the edp ranks beside it hold the same experts.
    - `fold_tp` (sequence parallelism: each TP rank holds its own tokens), (edp, ep): the
      (dp, tp) ranks of a stage flattened (tp innermost, as planner/plan.py's rank_of) and viewed
      as dp x tp = edp x ep, so an EP group is ep consecutive ranks, spanning the tp ranks
      first (inside a node), and edp = dp x tp / ep ranks hold the same experts (Megatron-Core's
      parallel folding: Liu et al. 2025, "MoE Parallel Folding", arXiv:2504.14960)."""
    if ep_degree == 1:
        return None
    if fold_tp:
        flat = mesh["dp", "tp"]._flatten("dp_tp")
        return flat._unflatten(0, (flat.size() // ep_degree, ep_degree), ("edp", "ep"))
    dp_degree = mesh["dp"].size()
    return mesh._unflatten("dp", (dp_degree // ep_degree, ep_degree), ("edp", "ep"))


def build_cp_mesh(mesh: DeviceMesh, cp_degree: int) -> DeviceMesh | None:
    """The (pp, dp_outer, cp, tp) view of the mesh for context parallelism (planner/plan.py
    `Layout.cp_degree`): dp = dp_outer x cp with cp innermost, as `build_ep_mesh` folds EP, so a
    CP group is cp consecutive dp indices (ranks `tp_degree` apart) holding the same samples, and
    this rank's position in it (`["cp"].get_local_rank()`, = dp index % cp) picks its sequence
    chunks (runtime/apply_cp.py). Same ranks as `mesh`; None without context parallelism."""
    if cp_degree == 1:
        return None
    dp_degree = mesh["dp"].size()
    return mesh._unflatten("dp", (dp_degree // cp_degree, cp_degree), ("dp_outer", "cp"))


def build_fsdp_mesh(mesh: DeviceMesh, shard_degree: int | None) -> DeviceMesh:
    """The mesh FSDP2 shards over (planner/plan.py `Layout.shard_degree`): the 1D dp mesh, or for
    hybrid sharding (1 < shard_degree < dp) the 2D (dp_replicate, dp_shard) view of dp with the
    shard axis innermost, so a shard group is `shard_degree` consecutive dp indices (the nearest
    ranks: one node when shard_degree x tp fits in it) and the replica groups run across them.
    `fully_shard` reads a 2D mesh as (replicate on dim 0, shard on dim 1): HSDP
    (https://docs.pytorch.org/docs/stable/distributed.fsdp.fully_shard.html, `mesh`).
    Same ranks as `mesh`; build it once (new process groups) and pass it to every stage chunk."""
    dp_degree = mesh["dp"].size()
    if shard_degree is None or shard_degree == dp_degree:
        return mesh["dp"]
    hsdp = mesh._unflatten("dp", (dp_degree // shard_degree, shard_degree), ("dp_replicate", "dp_shard"))
    return hsdp["dp_replicate", "dp_shard"]


def build_tie_groups(mesh: DeviceMesh, pp_ranks_per_tie: list[tuple[int, ...]]) -> list[object]:
    """Per weight tied across stages: this rank's "embedding group" (Megatron-LM's name), the
    ranks with its dp and tp coordinates on the pipeline ranks `pp_ranks` holding a copy; None
    where this rank holds none or the copies are all on one pipeline rank (nothing to reduce).

    Every rank creates every group (`new_group` is collective over the whole world), in the
    same order, one per (dp, tp) coordinate.
    """
    grid = mesh.mesh  # global ranks, shape (pp, dp, tp)
    me = dist.get_rank()
    out = []
    for pp_ranks in pp_ranks_per_tie:
        mine = None
        if len(pp_ranks) > 1:
            for d in range(grid.shape[1]):
                for t in range(grid.shape[2]):
                    ranks = [int(grid[p, d, t]) for p in pp_ranks]
                    group = dist.new_group(ranks)
                    if me in ranks:
                        mine = group
        out.append(mine)
    return out


def build_replica_groups(stage_replicas: list[int]) -> list[object]:
    """Per stage of a replicated pipeline (planner/plan.py `Layout.stage_replicas`): the process
    group of its replicas, r_s consecutive ranks, which sum the stage's gradients
    (runtime/pp_replicated.py); None for a stage of one rank. Every rank creates every group
    (`new_group` is collective over the world), in stage order."""
    groups: list[object] = []
    first = 0
    for replicas in stage_replicas:
        ranks = list(range(first, first + replicas))
        groups.append(dist.new_group(ranks) if replicas > 1 else None)
        first += replicas
    return groups


def build_replicated_tie_groups(stage_replicas: list[int], stages_per_tie: list[tuple[int, ...]]) -> list[object]:
    """Per weight tied across the stages of a replicated pipeline (runtime/pp_replicated.py): the
    process group of every replica of every stage holding a copy (`stages_per_tie`), which sums
    the copies' gradients in one all-reduce; None where this rank holds no copy. Every rank
    creates every group (`new_group` is collective over the world), in tie order."""
    firsts = [sum(stage_replicas[:s]) for s in range(len(stage_replicas))]
    me, out = dist.get_rank(), []
    for stages in stages_per_tie:
        ranks = [r for s in stages for r in range(firsts[s], firsts[s] + stage_replicas[s])]
        group = dist.new_group(ranks)
        out.append(group if me in ranks else None)
    return out
