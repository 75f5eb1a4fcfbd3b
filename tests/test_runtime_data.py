"""A model file feeds real data through `get_batch(step, batch_size)`; plans keep parity on it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT
from tests.runtime_plans import make_plan
from tests.test_runtime_parity import check_parity

BASE = '''
import torch
from torch import nn

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        for b in self.blocks:
            x = torch.tanh(b(x))
        return self.head(x)

def build_model(**_):
    return Net()

def make_batch(batch_size, **_):
    return torch.randn(batch_size, 8), torch.randint(4, (batch_size,))
'''

# A fixed "dataset" (its own generator: independent of the runtime's seeding), read in order by step.
WITH_DATA = BASE + '''
DATA = torch.randn(64, 8, generator=torch.Generator().manual_seed(1234))
LABELS = (DATA[:, 0] > 0).long() + 2 * (DATA[:, 1] > 0).long()

def get_batch(step, batch_size, **_):
    idx = (torch.arange(batch_size) + step * batch_size) % len(DATA)
    return DATA[idx], LABELS[idx]
'''

UNITS = ["blocks.0", "blocks.1", "head"]


def _plan(path, **kwargs):
    plan = make_plan(units=UNITS, args={}, **kwargs)
    plan.model.file = str(path)
    return plan


@pytest.mark.slow
def test_get_batch_feeds_training_with_parity(tmp_path, write_model):
    check_parity(_plan(write_model(WITH_DATA, "data.py"), dp=2), tmp_path)


def test_get_batch_is_used_instead_of_make_batch(tmp_path, write_model):
    losses = []
    for source, name in ((WITH_DATA, "data.py"), (BASE, "base.py")):
        plan = _plan(write_model(source, name)).save(tmp_path / f"{name}.json")
        out = tmp_path / f"{name}.metrics.json"
        done = subprocess.run([sys.executable, "-m", "runtime", str(plan), "--reference", "--steps", "2", "--output", str(out)],
                              cwd=ROOT, capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert done.returncode == 0, done.stderr[-2000:]
        losses.append(json.loads(out.read_text())["losses"])
    assert losses[0] != losses[1]  # same model and seed: only the data differs
