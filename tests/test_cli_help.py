"""`planner VERB --help` for every verb: flags show no type (typer 0.29 printed `<bool>` for each,
as if a flag took a value; planner/cli.py `_hide_flag_types`), options that take a value still do."""

from __future__ import annotations

import pytest
import typer.main
from typer.testing import CliRunner

from planner.cli import app

VERBS = sorted(typer.main.get_command(app).commands)  # type: ignore[attr-defined]  # a group: the app has verbs


def _help(*verb: str) -> str:
    result = CliRunner().invoke(app, [*verb, "--help"], terminal_width=200)
    assert result.exit_code == 0, result.output
    return result.output


def test_every_verb_is_checked():
    # The verb list comes from the app itself: a verb added later is checked without editing this test.
    assert {"profile", "solve", "show", "run", "validate", "export"} <= set(VERBS)


@pytest.mark.parametrize("verb", ["", *VERBS])
def test_help_shows_no_flag_type(verb):
    text = _help(*([verb] if verb else []))
    assert "<bool>" not in text
    assert "--help" in text


def test_flags_listed_and_value_options_keep_their_type():
    text = _help("run")
    for flag in ("--reference", "--resume", "--overwrite"):
        line = next(row for row in text.splitlines() if flag in row)
        assert "<" not in line, line  # a flag takes no value: no type shown
    steps = next(row for row in text.splitlines() if "--steps" in row)
    assert "<int>" in steps, steps


def test_every_flag_of_every_verb_has_no_display_type():
    # What the help panel prints in the type column (typer.rich_utils), checked on the parameters
    # themselves: the text above folds long option names (--sequence-parallel) at 80 columns.
    group = typer.main.get_command(app)
    ctx = group.make_context("planner", [], resilient_parsing=True)
    checked = set()
    for verb in VERBS:
        command = group.commands[verb]  # type: ignore[attr-defined]
        sub = command.make_context(verb, [], parent=ctx, resilient_parsing=True)
        for param in command.get_params(sub):
            if not isinstance(param, typer.core.TyperOption):
                continue
            shown = param.display_type_rich(sub)
            if param.is_flag:
                assert not shown, (verb, param.name, shown)
                checked.add(param.name)
            else:
                assert shown, (verb, param.name)
    assert {"sequence_parallel", "reference", "resume"} <= checked
