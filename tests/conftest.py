"""Shared fixtures: paths of the bundled examples and a writer for throwaway model files."""

from __future__ import annotations

import os
import tempfile
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"

# Spawned ranks and the test process itself stay on one thread each: the machine has 2 cores.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Solved tensor-parallel ILPs are kept on disk (planner/solver/intra_op.py `CACHE_ENV`): the tests
# keep theirs in a folder of this session, so a run never reads answers a previous one stored.
os.environ.setdefault("PLANNER_CACHE_DIR", tempfile.mkdtemp(prefix="planner-cache-"))


@pytest.fixture
def write_model(tmp_path):
    """Write a model file from source text and return its path."""

    def write(source: str, name: str = "model.py") -> Path:
        path = tmp_path / name
        path.write_text(textwrap.dedent(source))
        return path

    return write

# Property tests draw the same examples on every CI run (a failure there is reproducible);
# locally they explore new ones. Neither has a per-example deadline: tests assert behaviour, not
# timings, and hypothesis's default 200 ms failed test_replication's brute force at 402 ms on a
# loaded 2-core machine (a fresh clone's `make test`, 2026-11-30).
from hypothesis import settings as _hypothesis_settings  # noqa: E402

_hypothesis_settings.register_profile("ci", derandomize=True, deadline=None)
_hypothesis_settings.register_profile("local", deadline=None)
_hypothesis_settings.load_profile("ci" if os.environ.get("CI") else "local")
