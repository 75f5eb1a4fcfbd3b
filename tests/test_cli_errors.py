"""Bad input to `planner profile` gets one clear paragraph and a non-zero exit, no traceback."""

from __future__ import annotations

import subprocess
import sys

import pytest

GOOD = """
import torch
from torch import nn

def build_model(width=8, **_):
    return nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 2))

def make_batch(batch_size, width=8, **_):
    return torch.randn(batch_size, width), torch.randint(2, (batch_size,))
"""

RAISES = """
import torch
from torch import nn

class Broken(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x.view(3, -1, 7)  # wrong on purpose

def build_model(**_):
    return Broken()

def make_batch(batch_size, **_):
    return torch.randn(batch_size, 4), torch.randint(4, (batch_size,))
"""

STRICT_ARGS = """
import torch
from torch import nn

def build_model(width=8):
    return nn.Sequential(nn.Linear(width, width), nn.Linear(width, 2))

def make_batch(batch_size, **_):
    return torch.randn(batch_size, 8), torch.randint(2, (batch_size,))
"""

HUGE = """
import torch
from torch import nn

def build_model(**_):
    # 2**36 float32 parameters = 256 GiB: more than this machine has.
    return nn.Sequential(nn.Embedding(2**18, 2**18), nn.Linear(2**18, 2))

def make_batch(batch_size, **_):
    return torch.randint(2**18, (batch_size, 1)), torch.randint(2, (batch_size, 1))
"""


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "planner.cli", *args], capture_output=True, text=True, timeout=120
    )


def assert_clean_error(result: subprocess.CompletedProcess, *needles: str) -> None:
    assert result.returncode != 0
    assert "Traceback" not in result.stderr + result.stdout
    text = " ".join((result.stderr + result.stdout).split())  # rich folds long lines
    for needle in needles:
        assert needle in text, text


def test_missing_file(tmp_path):
    assert_clean_error(run_cli("profile", str(tmp_path / "nope.py")), "does not exist")


def test_file_without_build_model(write_model):
    path = write_model("import torch\n\ndef make_batch(batch_size):\n    return None\n")
    assert_clean_error(run_cli("profile", str(path)), "does not define build_model")


def test_exception_in_user_code_points_to_their_line(write_model):
    path = write_model(RAISES)
    result = run_cli("profile", str(path))
    line = path.read_text().splitlines().index("        return x.view(3, -1, 7)  # wrong on purpose") + 1
    assert_clean_error(result, "RuntimeError", f"{path}:{line}", "in forward")


def test_debug_shows_the_traceback(write_model):
    result = run_cli("--debug", "profile", str(write_model(RAISES)))
    assert result.returncode != 0 and "Traceback" in result.stderr


@pytest.mark.parametrize("arg", ["width", "=3", "2x=1"])
def test_malformed_model_arg(write_model, arg):
    assert_clean_error(run_cli("profile", str(write_model(GOOD)), "--model-arg", arg), "Malformed --model-arg")


def test_unknown_model_arg(write_model):
    result = run_cli("profile", str(write_model(STRICT_ARGS)), "--model-arg", "depth=3")
    assert_clean_error(result, "rejected the model arguments", "depth")


def test_model_too_large_for_device_suggests_meta(write_model):
    assert_clean_error(run_cli("profile", str(write_model(HUGE)), "--device", "cpu"), "--device meta")


def test_unknown_gpu(write_model):
    assert_clean_error(run_cli("profile", str(write_model(GOOD)), "--device", "meta", "--gpu", "v100"), "Unknown GPU", "h100-80gb")


def test_cuda_without_gpu(write_model):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert_clean_error(run_cli("profile", str(write_model(GOOD)), "--device", "cuda"), "no CUDA GPU")


@pytest.mark.parametrize("returned,needles", [
    ("{'x': torch.randn(batch_size, 8)}, torch.randint(2, (batch_size,))", ("inputs as a dict (x)", "positional arguments")),
    ("torch.randn(batch_size, 8)", ("returned Tensor, not (inputs, targets)",)),
    ("(torch.randn(batch_size, 8), None, None)", ("returned tuple of 3 items",)),
])
def test_a_batch_not_shaped_as_the_contract_says_is_named(write_model, returned, needles):
    """make_batch returns (inputs, targets), inputs a tensor or a tuple of positional arguments:
    anything else is named before any work, not found failing deep inside the model."""
    source = GOOD.replace("return torch.randn(batch_size, width), torch.randint(2, (batch_size,))", f"return {returned}")
    assert_clean_error(run_cli("profile", str(write_model(source))), "make_batch()", *needles)


def test_good_file_profiles_and_shows(write_model, tmp_path):
    out = tmp_path / "p.json"
    result = run_cli("profile", str(write_model(GOOD)), "-a", "width=16", "--micro-batch-sizes", "1,2", "-o", str(out), "--repeats", "1")
    assert result.returncode == 0, result.stderr
    shown = run_cli("show", str(out), "--csv", str(tmp_path / "p.csv"), "--micro-batch", "2")
    assert shown.returncode == 0, shown.stderr
    import pandas as pd

    frame = pd.read_csv(tmp_path / "p.csv")
    assert list(frame.unit.astype(str)) == ["0", "1", "2"]
    assert frame.params.sum() == 16 * 16 + 16 + 16 * 2 + 2
