"""Tensor parallelism from a stage's `tp_plan` with DTensor's parallelize_module.

The plan names each module's style (planner/solver/intra_op.py). A column-parallel module
whose output no row-parallel sibling consumes (a vocabulary-sharded output head, a sharded
embedding) gathers its output back (`output_layouts=Replicate()`), and a row-parallel module
without a column-parallel sibling slices its replicated input (`input_layouts=Replicate()`):
the plan is per module, the layouts between modules are the runtime's to make consistent.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from planner.errors import PlannerError


def _parent(name: str) -> str:
    return name.rpartition(".")[0]


def apply_tp(module: nn.Module, tp_mesh: DeviceMesh, tp_plan: dict[str, str], sequence_parallel: bool) -> None:
    if not tp_plan or tp_mesh.size() == 1:
        return
    if sequence_parallel:
        raise PlannerError("This runtime does not run sequence parallelism yet.", "Re-solve with --no-sequence-parallel.")
    present = dict(module.named_modules())
    styles = {}
    for name, style in tp_plan.items():
        if name not in present:
            continue  # another stage's module
        siblings = {n: s for n, s in tp_plan.items() if _parent(n) == _parent(name) and n != name}
        if style == "colwise":
            paired = "rowwise" in siblings.values()
            styles[name] = ColwiseParallel() if paired else ColwiseParallel(output_layouts=Replicate())
        elif style == "rowwise":
            paired = "colwise" in siblings.values()
            styles[name] = RowwiseParallel() if paired else RowwiseParallel(input_layouts=Replicate())
        elif style == "replicate":
            continue
        else:
            raise PlannerError(f"tp_plan style {style!r} for {name} is not runnable here.", "Use colwise, rowwise or replicate.")
    parallelize_module(module, tp_mesh, styles)
