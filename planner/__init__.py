"""Auto-parallelism planner for PyTorch.

    planner.profile(...)  -> Profile     measure every unit of a model
    planner.solve(...)    -> Plan        choose the fastest layout that fits
    runtime.launch.run_plan("plan.json")  execute a plan with torchrun (`planner run`)

Importing `planner` does not import torch; the verbs that need it import it themselves.
"""

__version__ = "0.1.0"


def profile(*args, **kwargs):
    """See `planner.profiler.profile_model`."""
    from planner.profiler import profile_model

    return profile_model(*args, **kwargs)


def solve(*args, **kwargs):
    """See `planner.solver.solve.solve` (profile, cluster, global batch, pins) -> Plan."""
    from planner.solver.solve import solve as solve_plan

    return solve_plan(*args, **kwargs)
