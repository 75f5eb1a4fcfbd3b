"""The published JSON schemas match the code, and hand-written plans are checked without a model."""

from __future__ import annotations

import json

import pytest

from conftest import ROOT
from planner.cluster_schema import ClusterFile
from planner.errors import PlannerError
from planner.metrics_schema import Metrics
from planner.plan import Plan, load_plan, parse_plan, stage_ranks
from planner.profile_schema import Profile

SCHEMAS = [("plan", Plan), ("profile", Profile), ("metrics", Metrics), ("cluster", ClusterFile)]


@pytest.mark.parametrize("kind,model", SCHEMAS)
def test_published_schema_is_current(kind, model):
    published = json.loads((ROOT / "schemas" / f"{kind}.schema.json").read_text())
    assert published == model.model_json_schema(), f"run `planner schema {kind} -o schemas/{kind}.schema.json`"


@pytest.mark.parametrize("kind,model", SCHEMAS)
def test_schema_verb_prints_each_published_schema(kind, model):
    from typer.testing import CliRunner

    from planner.cli import app

    done = CliRunner().invoke(app, ["schema", kind])
    assert done.exit_code == 0 and json.loads(done.stdout) == model.model_json_schema()


@pytest.mark.parametrize("module", ["planner.metrics_schema", "planner.cluster_schema"])
def test_every_field_is_documented(module):
    # Each field of these files says what it holds and in which unit (its docstring is its description).
    import importlib

    from pydantic import BaseModel

    mod = importlib.import_module(module)
    models = [m for m in vars(mod).values() if isinstance(m, type) and issubclass(m, BaseModel) and m.__module__ == module]
    assert models and [f"{m.__name__}.{n}" for m in models for n, f in m.model_fields.items() if not f.description] == []


def hand_plan(**layout) -> dict:
    lay = dict(pp_degree=2, dp_degree=2, tp_degree=1, schedule="1f1b") | layout
    world = lay["pp_degree"] * lay["dp_degree"] * lay["tp_degree"]
    stages = lay["pp_degree"] * lay.get("virtual_stages", 1)
    units = [f"blocks.{i}" for i in range(stages)]
    plan = dict(
        model=dict(file="examples/gpt.py", args={"n_layers": stages}),
        cluster=dict(gpus_per_node=world, gpu="cpu"),
        batch=dict(global_batch_size=8 * lay["dp_degree"], micro_batch_size=2, num_microbatches=4),
        layout=lay,
        stages=[],
    )
    from planner.plan import Layout

    layout_model = Layout(**lay)
    plan["stages"] = [dict(units=[u], ranks=stage_ranks(layout_model, i)) for i, u in enumerate(units)]
    return plan


def test_rank_grid_puts_tp_innermost():
    plan = parse_plan(hand_plan(pp_degree=2, dp_degree=2, tp_degree=2))
    assert [s.ranks for s in plan.stages] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    inter = parse_plan(hand_plan(pp_degree=2, dp_degree=1, virtual_stages=2, schedule="interleaved-1f1b"))
    assert [s.ranks for s in inter.stages] == [[0], [1], [0], [1]]  # looping placement


@pytest.mark.parametrize(
    "change,message",
    [
        (lambda p: p["batch"].update(global_batch_size=7), "global_batch_size"),
        (lambda p: p["cluster"].update(gpus_per_node=3), "cluster devices"),
        (lambda p: p["stages"].pop(), "stages listed"),
        (lambda p: p["stages"][0].update(ranks=[5]), "ranks"),
        (lambda p: p["layout"].update(schedule="pipedream"), "schedule"),
        (lambda p: p["stages"][1].update(units=["blocks.0"]), "more than one stage"),
        (lambda p: p["layout"].update(p2p_scatter_gather=True), "p2p_scatter_gather needs"),
    ],
)
def test_inconsistent_plans_are_refused_with_the_reason(change, message):
    plan = hand_plan()
    change(plan)
    with pytest.raises(PlannerError, match=message):
        parse_plan(plan)


def test_corrupt_plan_file(tmp_path):
    path = tmp_path / "plan.json"
    path.write_text('{"layout": ')
    with pytest.raises(PlannerError, match="not valid JSON"):
        load_plan(path)
    path.write_text(json.dumps(hand_plan()))
    assert load_plan(path).layout.pp_degree == 2
