"""planner profile-cluster: two gloo processes measure collectives and write a usable cluster file."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest

from planner.cluster import load_cluster
from planner.cluster_probe import fit
from planner.cost.collectives import CollectiveModel, Group
from tests.conftest import ROOT


def test_fit_recovers_latency_and_bandwidth():
    sizes = [2**k for k in range(12, 22)]
    times = [20e-6 + s / 2e9 for s in sizes]
    got = fit(sizes, times, 1.0)
    assert got["latency_s"] == pytest.approx(20e-6, rel=1e-6) and got["bandwidth_bytes_per_s"] == pytest.approx(2e9, rel=1e-6)


def test_fit_stays_positive_on_noise():
    got = fit([4096, 8192, 16384, 32768], [3e-3, 1e-3, 2e-3, 1.5e-3], 1.0)
    assert got["latency_s"] > 0 and got["bandwidth_bytes_per_s"] > 0


@pytest.mark.slow
def test_profile_cluster_writes_a_cluster_the_solver_reads(tmp_path):
    out = tmp_path / "c.yaml"
    done = subprocess.run([sys.executable, "-m", "planner.cli", "profile-cluster", "--nproc", "2", "--max-bytes", "262144",
                           "--time-budget", "3", "--repeats", "3", "-o", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-2000:]
    cluster = load_cluster(out)
    assert cluster.world_size == 2 and cluster.gpu.name == "cpu"
    for kind in ("all_reduce", "all_gather", "reduce_scatter", "p2p"):
        fitted = cluster.fitted[kind]
        assert math.isfinite(fitted["latency_s"]) and fitted["latency_s"] > 0 and fitted["bandwidth_bytes_per_s"] > 0
    # The collective model now prices a 2-rank all-reduce from the measurement.
    assert CollectiveModel(cluster).algorithm_times("all_reduce", 1e6, Group(2, 1)).keys() == {"fitted"}


def test_profile_cluster_needs_two_processes():
    done = subprocess.run([sys.executable, "-m", "planner.cli", "profile-cluster", "--nproc", "1"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "at least 2" in done.stderr
