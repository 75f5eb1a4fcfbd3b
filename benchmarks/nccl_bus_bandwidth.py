"""Bus bandwidth the collective model predicts beside published nccl-tests figures.

nccl-tests reports `busbw` = (bytes a rank moves in the ring algorithm) / time, i.e.
2 (n-1)/n M / t for all-reduce (nccl-tests doc/PERFORMANCE.md): on a flat system it is the
speed of the bottleneck link whatever n is. For each published figure below, the model's
best algorithm (planner/cost/collectives.py, preset links of planner/cluster.py) is timed on
a large message (8 GiB, where latency no longer matters) and converted the same way; a row
measured without NVLink SHARP (NCCL_ALGO=RING) is priced without it. Writes
benchmarks/results/nccl_bus_bandwidth.csv.

    python benchmarks/nccl_bus_bandwidth.py
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from planner.cluster import make_cluster
from planner.cost.collectives import RING_TRAFFIC, CollectiveModel, group_placement

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
MESSAGE_BYTES = 8 * 1024**3

# (system, gpu preset, GPUs, collective, published busbw GB/s low, high, algorithm NCCL used, source)
PUBLISHED = [
    ("8x A100 SXM, NVLink 3 / NVSwitch", "a100-80gb", 8, "all_reduce", 200, 235, "ring",
     "NVIDIA/nccl-tests issues #149 and #178 (as cited in planner/cluster.py)"),
    ("DGX A100 nodes, 8x HDR 200 Gb/s IB each (multi-node)", "a100-80gb", 32, "all_reduce", 192, 192, "ring",
     "NVIDIA/nccl issue #812, NVIDIA's comment: 'On an Nvidia DGX-A100 system we have 8x200Gbit/s IB cards "
     "and we measure 192GB/s AllReduce BusBW'"),
    ("8x H100 SXM, NVLink 4 / NVSwitch, NCCL_ALGO=RING", "h100-80gb", 8, "all_reduce", 365, 370, "ring",
     "NVIDIA/nccl issue #1455 (ring busbw 365-370 GB/s, 2 to 8 GPUs); NVIDIA/nccl-tests issue #212 "
     "(sjeaugey: ~370 GB/s effective NVLink bandwidth, line rate 450 less ~20% protocol overhead)"),
    ("8x H100 SXM, NVLink 4, all-gather (no NVLink SHARP)", "h100-80gb", 8, "all_gather", 365, 370, "ring",
     "NVIDIA/nccl-tests issue #212 (sjeaugey: the 370 GB/s shows as busbw in non-allreduce operations)"),
    ("8x H100 SXM, NVLink 4, default (NVLink SHARP)", "h100-80gb", 8, "all_reduce", 480, 480, "nvls",
     "NVIDIA/nccl-tests issue #212 (sjeaugey: peak busbw ~480 GB/s on 8 GPUs with NVLS)"),
    ("8x H200 SXM, NVLink 4, default (NVLink SHARP)", "h200", 8, "all_reduce", 475, 475, "nvls",
     "NVIDIA/nccl-tests issue #272 (peak busbw 475 GB/s, NCCL 2.20.3)"),
    # One user's H100 cluster at 4 to 128 nodes (32 to 1024 GPUs): the reduce-scatter's bus
    # bandwidth falls as the ring grows (its latency terms grow with the ranks). Message size not
    # stated; the model is timed at MESSAGE_BYTES like every row.
    *[(f"H100 nodes x {n // 8}, reduce-scatter across nodes", "h100-80gb", n, "reduce_scatter", busbw, busbw, "ring",
       "NVIDIA/nccl issue #1229 (user measurement: busbw 360, 345, 320, 300, 280, 260 GB/s at 4, 8, 16, 32, 64, "
       "128 nodes; NCCL rings across nodes)")
      for n, busbw in [(32, 360), (64, 345), (128, 320), (256, 300), (512, 280), (1024, 260)]],
]


def main() -> pd.DataFrame:
    rows = []
    for system, gpu, n, kind, low, high, nccl_algorithm, source in PUBLISHED:
        cluster = make_cluster(n, 8, gpu)
        model = CollectiveModel(cluster)
        group = group_placement(cluster, n, 1)
        times = model.algorithm_times(kind, MESSAGE_BYTES, group)
        if nccl_algorithm != "nvls":  # a run without NVLink SHARP (NCCL_ALGO=RING, or a collective it does not speed up)
            times.pop("nvls", None)
        algorithm = min(times, key=times.__getitem__)
        seconds = times[algorithm]
        busbw = RING_TRAFFIC[kind](n) * MESSAGE_BYTES / seconds / 1e9
        mid = (low + high) / 2
        rows.append({"system": system, "gpu": gpu, "gpus": n, "nodes": group.num_nodes, "collective": kind,
                     "published_busbw_gb_s_low": low, "published_busbw_gb_s_high": high, "nccl_algorithm": nccl_algorithm,
                     "model_algorithm": algorithm, "model_busbw_gb_s": round(busbw, 1), "error_vs_mid": busbw / mid - 1,
                     "source": source})
        print(f"{system:>55}  published {low}-{high} GB/s  model {busbw:6.1f} GB/s ({algorithm})  {busbw / mid - 1:+.0%}")
    frame = pd.DataFrame(rows)
    RESULTS.mkdir(parents=True, exist_ok=True)
    frame.to_csv(RESULTS / "nccl_bus_bandwidth.csv", index=False)
    return frame


if __name__ == "__main__":
    main()
