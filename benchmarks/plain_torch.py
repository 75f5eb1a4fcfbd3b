"""The baselines of benchmarks/runtime_overhead.py: one layout written directly against torch.

Started by torchrun (one process per rank, gloo on CPU); what a user would write by hand
without the planner, for the same model, batch, micro-batching and optimizer:

- `dp`: `DistributedDataParallel` over all ranks, gradient accumulation over the
  micro-batches with `no_sync()` on all but the last, AdamW.
- `pp`: `torch.distributed.pipelining` with `Schedule1F1B` over hand-made stage modules
  (`nn.Sequential` of the model's units at the given cuts: exact for chain models such as
  examples/gpt.py), AdamW.

Step time is measured as runtime/train.py measures it (from zero_grad to the end of the
optimizer step, batch drawn before) and written as JSON by rank 0.

    torchrun --nproc-per-node 2 benchmarks/plain_torch.py dp --model-file examples/gpt.py \
        -a n_layers=4 --global-batch 16 --micro-batch 2 --steps 10 --output plain.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from planner.model_file import load_model_file, parse_model_args

WARMUP_STEPS = 1  # as runtime/metrics.py


def _batch(mf, global_batch: int, seed: int, step: int):
    torch.manual_seed(seed * 100_003 + step)  # the same data as runtime/train.py's batch_for_step
    return mf.make_batch(global_batch)


def run_dp(mf, args) -> list[float]:
    from torch.nn.parallel import DistributedDataParallel

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)
    model = DistributedDataParallel(mf.build_model())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    local = args.global_batch // world
    m = local // args.micro_batch
    times = []
    for step in range(args.steps):
        inputs, targets = _batch(mf, args.global_batch, args.seed, step)
        inputs, targets = inputs[rank * local:(rank + 1) * local], targets[rank * local:(rank + 1) * local]
        start = time.perf_counter()
        optimizer.zero_grad()
        for k in range(m):
            lo, hi = k * args.micro_batch, (k + 1) * args.micro_batch
            with model.no_sync() if k < m - 1 else contextlib.nullcontext():
                (mf.loss(model(inputs[lo:hi]), targets[lo:hi]) / m).backward()
        optimizer.step()
        times.append(time.perf_counter() - start)
    return times


def run_pp(mf, args) -> list[float]:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)
    model = mf.build_model()
    units = args.units.split(",")
    cuts = [int(c) for c in args.cuts.split(",")]
    stage_module = nn.Sequential(*(model.get_submodule(u) for u in units[cuts[rank]:cuts[rank + 1]]))
    m = args.global_batch // args.micro_batch
    stage = PipelineStage(stage_module, rank, world, torch.device("cpu"))
    schedule = Schedule1F1B(stage, m, loss_fn=mf.loss)
    optimizer = torch.optim.AdamW(stage_module.parameters(), lr=1e-3)
    times = []
    for step in range(args.steps):
        inputs, targets = _batch(mf, args.global_batch, args.seed, step)
        start = time.perf_counter()
        optimizer.zero_grad()
        if rank == 0:
            schedule.step(inputs)
        elif rank == world - 1:
            schedule.step(target=targets, losses=[])
        else:
            schedule.step()
        optimizer.step()
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("layout", choices=("dp", "pp"))
    parser.add_argument("--model-file", required=True)
    parser.add_argument("-a", "--model-arg", action="append", default=[])
    parser.add_argument("--global-batch", type=int, required=True)
    parser.add_argument("--micro-batch", type=int, required=True)
    parser.add_argument("--units", default="", help="pp: the model's units in order, comma-separated")
    parser.add_argument("--cuts", default="", help="pp: stage boundaries as unit indices, e.g. 0,3,7")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        mf = load_model_file(args.model_file, parse_model_args(args.model_arg))
        times = (run_dp if args.layout == "dp" else run_pp)(mf, args)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    if int(__import__("os").environ.get("RANK", 0)) == 0:
        after = times[WARMUP_STEPS:] or times
        Path(args.output).write_text(json.dumps({"step_times_s": times, "median_iteration_time_s": statistics.median(after)}))


if __name__ == "__main__":
    main()
