"""`planner --debug` logs the planner's DEBUG lines; without it the CLI prints what it always did,
and the harmless import-time warnings of the optional torchao are not among them."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

MLP = """
import torch
from torch import nn

def build_model(**_):
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))

def make_batch(batch_size, **_):
    return torch.randn(batch_size, 8), torch.randint(4, (batch_size,))
"""


def _profile(path, tmp_path, *flags: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "planner.cli", *flags, "profile", str(path), "--device", "meta", "-o", str(tmp_path / "p.json")]
    return subprocess.run(command, capture_output=True, text=True, timeout=120)


def test_debug_shows_the_profilers_steps_and_the_default_does_not(write_model, tmp_path):
    path = write_model(MLP)
    debug, plain = _profile(path, tmp_path, "--debug"), _profile(path, tmp_path)
    assert debug.returncode == 0 and plain.returncode == 0, debug.stderr + plain.stderr
    assert "DEBUG planner.profiler: counting the units" in debug.stderr
    assert "DEBUG" not in plain.stderr + plain.stdout


@pytest.mark.skipif(importlib.util.find_spec("torchao") is None, reason="the warnings come from importing torchao")
def test_torchao_import_warnings_are_silenced_by_default():
    # What `planner profile --hf-config` triggers through transformers, without the model's cost.
    code = "from planner.cli import _configure_logging; _configure_logging(False); import torchao.float8"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "Failed to load" not in result.stderr and "Enum subclass" not in result.stderr
