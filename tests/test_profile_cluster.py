"""planner profile-cluster: fits, failure reports, and two gloo processes writing a usable cluster file."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from planner.cluster import load_cluster
from planner.cluster_fit import fit, fit_cluster
from planner.cluster_probe import _launch, failure_summary
from planner.cluster_worker import _operation, reduce_scatter_by_all_to_all
from planner.cost.collectives import CollectiveModel, Group
from planner.errors import PlannerError

ROOT = Path(__file__).resolve().parents[1]
SIZES = [2**k for k in range(12, 22)]


def test_fit_recovers_latency_and_bandwidth():
    got = fit(SIZES, [20e-6 + s / 2e9 for s in SIZES], 1.0)
    # Exact data: least squares recovers both numbers to rounding.
    assert got["latency_s"] == pytest.approx(20e-6, rel=1e-6) and got["bandwidth_bytes_per_s"] == pytest.approx(2e9, rel=1e-6)


def test_fit_is_in_terms_of_ring_traffic():
    got = fit(SIZES, [20e-6 + 0.5 * s / 2e9 for s in SIZES], 0.5)  # a 2-rank all-gather moves half the message
    assert got["bandwidth_bytes_per_s"] == pytest.approx(2e9, rel=1e-6)


def test_fit_ignores_outliers():
    times = [20e-6 + s / 2e9 for s in SIZES]
    times[0] *= 30  # a descheduled rank
    times[5] *= 5
    got = fit(SIZES, times, 1.0)
    assert got["latency_s"] == pytest.approx(20e-6, rel=1e-3) and got["bandwidth_bytes_per_s"] == pytest.approx(2e9, rel=1e-3)


def test_fit_stays_positive_on_noise():
    got = fit([4096, 8192, 16384, 32768], [3e-3, 1e-3, 2e-3, 1.5e-3], 1.0)
    assert got["latency_s"] > 0 and got["bandwidth_bytes_per_s"] > 0


def test_fit_cluster_across_nodes_sets_the_inter_node_link():
    line = lambda a, b: [[s, a + s / b] for s in SIZES]  # noqa: E731
    raw = {"world_size": 4, "num_nodes": 2, "backend": "gloo", "gpu": "cpu", "methods": {},
           "measurements": {"all_reduce": line(1e-4, 1e9), "p2p": line(1e-5, 4e9), "p2p_inter_node": line(3e-5, 1e9)}}
    c = fit_cluster(raw)
    assert (c.num_nodes, c.gpus_per_node) == (2, 2)
    assert c.intra_node.latency_s == pytest.approx(1e-5) and c.inter_node.bandwidth_bytes_per_s == pytest.approx(1e9)
    # The all-reduce was measured across both nodes: it must not price a group inside one.
    assert "fitted" not in CollectiveModel(c).algorithm_times("all_reduce", 1e6, Group(2, 1))


@pytest.mark.parametrize("measured,kept", [(1.3, 1.3), (0.97, 1.0)])  # timing noise below 1 is not a speed-up
def test_fit_cluster_keeps_the_measured_compute_slowdown(measured, kept):
    line = lambda a, b: [[s, a + s / b] for s in SIZES]  # noqa: E731
    raw = {"world_size": 2, "num_nodes": 1, "backend": "gloo", "gpu": "cpu", "methods": {}, "compute_slowdown": measured,
           "measurements": {"all_reduce": line(1e-4, 1e9), "p2p": line(1e-5, 4e9)}}
    assert fit_cluster(raw).compute_slowdown == kept


def test_pipeline_overhead_inverts_the_cost_models_price_of_the_probe():
    # The probe's 1F1B step (m micro-batches, stages computing ~nothing) is priced as 2 m p2p
    # hops of stage 0 plus (m + 1) overheads; the overhead is what makes the two equal.
    from planner.cluster_fit import overhead_from_step

    assert overhead_from_step(0.01, 1e-4, 8) == pytest.approx((0.01 - 16e-4) / 9)
    assert overhead_from_step(1e-3, 1e-4, 8) == 0.0  # hops alone exceed the step: never below zero


class _NoReduceScatter:
    """A 2-rank stand-in for torch.distributed without reduce_scatter_tensor; every rank holds the same x."""

    def reduce_scatter_tensor(self, out, x):
        raise RuntimeError("not supported by this backend")

    def all_to_all_single(self, out, x):  # rank 0 receives block 0 of both ranks
        shard = x.numel() // 2
        out.copy_(torch.cat([x[:shard], x[:shard]]))


def test_reduce_scatter_falls_back_to_all_to_all_and_a_local_sum():
    x = torch.arange(8, dtype=torch.float32)
    fn, method = _operation(_NoReduceScatter(), torch, "reduce_scatter", x, 2, 0, 2, None)
    assert method == "all_to_all_single + local sum"
    fn()  # runs without the missing call
    out = torch.empty(4)
    reduce_scatter_by_all_to_all(_NoReduceScatter(), torch, out, x, torch.empty_like(x))
    assert torch.equal(out, 2 * x[:4])  # rank 0's reduce-scatter output: block 0 summed over both ranks


def test_dead_rank_is_named():
    stderr = "...\nprofile-cluster error (rank 1): RuntimeError: Connection closed by peer\nTraceback ...\nRoot Cause\n rank : 1\n"
    assert failure_summary(stderr, 1) == "Rank 1 failed: RuntimeError: Connection closed by peer"
    assert failure_summary("Root Cause (first observed failure):\n  rank      : 3\n  Signal 9 (SIGKILL) received", 1) \
        == "Rank 3 failed (killed by SIGKILL); the measurement was stopped."


def test_hung_job_is_killed_and_reported(tmp_path):
    (tmp_path / "rank1").write_text("all_gather 65536 B")
    with pytest.raises(PlannerError, match=r"did not finish within 1 s \(last seen: rank1: all_gather 65536 B\)"):
        _launch([sys.executable, "-c", "import time; time.sleep(60)"], 1.0, tmp_path)


def test_failed_job_is_reported():
    with pytest.raises(PlannerError, match="Rank 0 failed: ValueError: boom"):
        _launch([sys.executable, "-c", "import sys; print('profile-cluster error (rank 0): ValueError: boom', file=sys.stderr);"
                 " sys.exit(1)"], 30.0, ROOT)


def _profile_cluster(out, budget: str, repeats: str):
    """`planner profile-cluster` on 2 gloo processes into `out`; the cluster file it wrote."""
    done = subprocess.run([sys.executable, "-m", "planner.cli", "profile-cluster", "--nproc", "2", "--max-bytes", "262144",
                           "--time-budget", budget, "--repeats", repeats, "--backend", "gloo", "--timeout", "100", "-o", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return load_cluster(out)


@pytest.mark.slow
def test_profile_cluster_writes_a_cluster_the_solver_reads(tmp_path):
    cluster = _profile_cluster(tmp_path / "c.yaml", "4", "3")
    assert cluster.world_size == 2 and cluster.num_nodes == 1 and cluster.gpu.name == "cpu"
    for kind in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p"):
        fitted = cluster.fitted[kind]
        for key in ("latency_s", "bandwidth_bytes_per_s"):
            assert math.isfinite(fitted[key]) and fitted[key] > 0
        assert fitted["num_ranks"] == 2 and len(fitted["points"]) >= 2 and fitted["method"]
    assert cluster.intra_node.latency_s == cluster.fitted["p2p"]["latency_s"]
    # torch's 1F1B over two near-empty stages: bookkeeping and p2p waits per micro-batch, under a second.
    assert 0 < cluster.pipeline_overhead_s < 1.0
    # The collective model now prices a 2-rank all-reduce from the measurement, and expert
    # parallelism's all-to-all (recorded against the whole tensor, as the model prices it).
    for kind in ("all_reduce", "all_to_all"):
        assert CollectiveModel(cluster).algorithm_times(kind, 1e6, Group(2, 1)).keys() == {"fitted"}


def test_profile_cluster_needs_two_processes():
    done = subprocess.run([sys.executable, "-m", "planner.cli", "profile-cluster", "--nproc", "1"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "at least 2" in done.stderr


def test_profile_cluster_rejects_an_unknown_backend():
    done = subprocess.run([sys.executable, "-m", "planner.cli", "profile-cluster", "--backend", "mpi"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "Unknown --backend" in done.stderr


@pytest.mark.slow
def test_a_spent_time_budget_still_fits_every_collective(tmp_path):
    # A loaded machine can spend a collective's share of the budget on its first size; a fit needs
    # two, so each is measured at two sizes at least (CI once lost all_reduce so, with 4 s shared by 5).
    fitted = _profile_cluster(tmp_path / "c.yaml", "0.000001", "1").fitted
    for kind in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p"):
        assert len(fitted[kind]["points"]) == 2, (kind, fitted.get(kind))
