"""The (pp, dp, tp) device mesh, built once. tp is innermost, as planner/plan.py's rank_of says."""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from planner.plan import Plan


def build_mesh(plan: Plan, device_type: str) -> DeviceMesh:
    lay = plan.layout
    return init_device_mesh(device_type, (lay.pp_degree, lay.dp_degree, lay.tp_degree), mesh_dim_names=("pp", "dp", "tp"))
