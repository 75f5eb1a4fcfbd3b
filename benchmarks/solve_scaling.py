"""How long `planner solve` takes: GPT-3 175B on 8 to 12,288 A100-80GB GPUs, 24 to 192 layers,
Megatron-Turing NLG 530B on 2,240, and the Qwen3-235B-A22B mixture of experts on 256 H100s
(expert parallelism in the space).

Profiles are analytic (meta device, A100-80GB roofline, bf16, micro-batch sizes 1, 2, 4; the MoE
from its Hugging Face config on an H100 roofline at micro-batch 1, sequence 4096), made
once and written to a temporary folder; each row times the whole `planner solve` process
(start-up, loading the profile, the search, writing and printing the plan), the median of
`REPEATS` runs, and records the search's own time, counts and phases from the plan's `search`
section. Goals (issue #17, on the project's 2-core machine): 175B on 64 GPUs under 1 s, on 1024
under 2 s, 530B on 2240 under 5 s, 192 layers on 512 under 10 s, the 235B MoE on 256 H100s under
10 s.
Writes benchmarks/results/solve_scaling.{csv,png}.

What changed in the search for these numbers (issue #17, Speed; same plans as before on every
row, iteration times equal up to float rounding, ~1e-15 relative):
- the bounds phase is vectorised (planner/solver/bounds.py `TimeBound.many`): the terms of the
  time bound are computed once per (table, ZeRO stage, dp, hybrid shard, offload, pp) and the
  closed forms for all configurations in one numpy pass; the memory bound once per setting
  it reads (`TimeBound.memory_bytes`). The MoE row's bounds went from ~6 s to ~0.8 s.
- `stage_arrays` (ZeRO 2/3 traffic per unit, model states) is memoised per table and
  data-parallel setting (`Environment.memo`), shared by the bounds and the DP.
- the inter-op DP (planner/solver/inter_op.py `_min_sum_cuts`) carries one band-wide slice
  instead of the whole table and scans each stage's ranges by length up to the longest one a
  bottleneck admits (`_by_length`); the incumbent (min-sum cuts) and the first bottleneck
  candidate share one DP pass; stage times are looked up in one numpy gather.
- the price of the DP's cuts (planner/solver/search.py `_price`) sums per-stage terms with
  prefix sums over all stages at once instead of per stage; a configuration whose stage cost
  table's least bottleneck already takes it past the k-th best time skips the DP
  (`_bottleneck_bound_s`, an exact bound, proven in its docstring).
The committed CSV was measured with the machine's load average near 5 (2 cores, five jobs):
its seconds are about 2.5-3x a quiet run's. Old and new search run alternately at the same
load (in-process, same rows, same plans) took, old -> new: 175B on 64 GPUs 11.7 -> 7.8-9.2 s,
on 512 14.3-22.8 -> 8.4 s, on 1024 12.3-14.8 -> 8.9-10.2 s, 530B on 2240 4.6-8.4 -> 3.2-3.6 s,
192 layers on 512 7.9-11.0 -> 6.9-7.2 s, the MoE 22.7-26.7 -> 10.3-13.8 s.

This round (2026-11-24; the space now also holds ring vs all-gather CP and the op-level
recomputation mode per unit): configurations priced on both cores (planner/solver/pricing.py),
CP tables once per distinct unit, the ILP disk cache off (`PLANNER_CACHE_DIR=` when this was
run: a first solve; a repeated "what if" skips the ILPs). 175B on 64 GPUs 2.3 s, on 1024 3.7 s
(goals 1 s and 2 s: not met), 530B on 2240 1.7 s, 192 layers on 512 4.0 s, the MoE 3.0 s (met).

This round (2026-11-26): the bound knows that units come whole (planner/solver/bounds.py B*: the
least slowest chunk of any cut into S contiguous chunks, by bisection), so 98 units in 8
stages cannot all take the mean. That whole bound is computed lazily: every configuration gets
a weaker one once per cost table (no B*, no ZeRO 2/3 traffic per unit), and the whole bound is
computed a batch at a time, in that order, only for those the pricing reaches; they are priced
in ascending order of the whole bound (planner/solver/pricing.py `refined_order`). ZeRO's
per-unit collectives and the pipeline hops are priced once per distinct parameter count or cut
size. In-process on a quiet machine, one core, before -> after: 175B on 64 GPUs 4.0 -> 3.0 s
(490 -> 282 DPs run), on 1024 10.1 -> 4.5 s (bounds phase 6.3 -> 1.0 s), 192 layers on 512
10.3 -> 4.1 s (139 -> 103 DPs); same plans. The committed CSV (`planner solve` processes, both
cores) with the code before this round run right after it on the same machine: 175B x64
4.02 -> 2.92 s, x1024 10.43 -> 4.96 s, 192 layers x512 10.48 -> 4.37 s. This machine was about
twice as slow as when the previous CSV was measured (that code gave 2.3, 3.7 and 4.0 s then):
compare within a run. Goals (1 s for 175B x64, 2 s for x1024) still unmet; 530B x2240, 192L
x512 and the MoE rows meet theirs. Then zero bubble with fewer micro-batches than stages (played
in the simulator) got the first micro-batch's critical path as its bound (every forward, then
every input-gradient backward): on 12,288 GPUs 4,991 -> 2,425 DPs run (in-process, one core,
15.8 s; not in the CSV above, which was measured before it).
This round (2026-11-26, second session): a tighter exact bound (planner/solver/bounds.py). The
start terms of the chunks (ZeRO 2's exposed reduce-scatter at each chunk's start, for one) are
counted at distinct units; the busiest rank holds at least ceil(n / p) units; and memory by
rank (z*): ranks holding more micro-batches in flight hold fewer units or recompute, so the
busiest rank's time rises above the mean, found by a linear relaxation per rank solved at its
vertices. DPs run, before -> after: 175B on 64 GPUs 294 -> 83, on 512 552 -> 201, on 1024
495 -> 298, 192 layers on 512 103 -> 63, 12,288 GPUs 2,425 -> 1,942. Also CP's cost tables share
the plain table at micro-batch b / cp (72 builds instead of 402 on 64 GPUs) and units with at
most 64 tensor-parallel assignments are solved by pricing each one instead of starting CBC (12
of the 18 ILPs). The committed CSV, against the previous one on this machine (`planner solve`
processes, both cores): 175B x64 3.07 -> 2.08 s, x512 4.73 -> 2.87 s, x1024 4.55 -> 3.21 s,
x12288 12.1 -> 9.3 s, 192 layers x512 4.35 -> 3.29 s, 530B 2.47 -> 1.85 s, the MoE 2.59 ->
2.19 s; same plans and iteration times on every row. Goals for 175B (1 s on 64, 2 s on 1024)
still not met: about 0.35 s of each solve is imports and 0.13 s printing the plan, and the DPs
that remain are configurations whose best cuts really are within a few percent of the best.
This round (2026-11-26, third session): the Python work per configuration went (planner/solver/solve.py
`ConfigBlock`, `_Fitting`): configurations are enumerated as blocks (one per tp, pp, dp, cp,
micro-batch and sp) of groups (CP algorithm, ep, ZeRO stage, shard degree, offload) times
schedules; the memory bound is taken once per group and the weak time bound per group and
schedule (`TimeBound.weak_many`, `group_columns`), so a Config is made only for those refined or
priced; the model states of the bound come from the table's parameter sums (tables of another
micro-batch or CP degree share them); `dp_tail_s` and `_price` sum chunks and stages with prefix
sums and reduceat instead of loops. Same plans, counts and iteration times on every row (the
in-process search on 175B x8 ... x1024 and x12,288 compared top-k, cuts and counts with the code
before). The old and new code run one after the other (`planner solve` processes, both cores,
median of 3): 175B x64 1.78 -> 1.63 s, x1024 3.04 -> 2.70 s, 192 layers x512 3.10 -> 2.28 s. The
committed CSV against the previous one: x64 2.08 -> 1.72 s, x1024 3.21 -> 2.67 s, the MoE 2.19 ->
1.32 s, 12,288 GPUs 9.27 -> 8.62 s. Goals for 175B (1 s on 64 GPUs, 2 s on 1024) still not met:
of the x64 process, start-up and imports take about 0.4 s (pydantic's schemas, numpy, typer,
rich), printing and writing the plan 0.1 s, and the search about 1.1 s on two cores: 0.2 s of
cost tables and TP ILPs, 0.2 s of bounds, 0.25 s refining 1,024 configurations to the whole
bound and 85 inter-op DPs at about 5 ms each. (The MoE row's iteration time moved +15% since the
previous CSV: attention on H100 is now priced at FlashAttention-2's rate, not from this round.)
This round (2026-11-27): (1) a unit's TP layout is priced for every assignment at once in numpy
(planner/solver/intra_op.py `_by_table`, exact, up to 2^20 assignments; a GPT block has 13,122)
instead of starting CBC for it (~50 ms a unit, six units on 64 GPUs), and pulp is imported
only when a unit is larger; (2) z* counts whole units (planner/solver/bounds.py
`_memory_rank_s`: a rank holds at most the floor of the relaxation's count), DPs run 175B x64
85 -> 61, x1024 298 -> 287, 192 layers 63 -> 54, 530B 138 -> 77, the MoE 29 -> 16, same top 3 on
every row; (3) the timed processes run byte-compiled code (below). The machine ran about 2.5x
slower than for the previous CSV (the same 96-layer profile took 12.4 s, then 4.9 s), so the
CSV's seconds are not comparable with it; the code before this round (061b005) and after, run
alternately on it (`planner solve` processes, both byte-compiled, median of 5): 175B x64 2.95 ->
2.53 s, x1024 5.20 -> 4.74 s. Then (4) `_unit_terms` shares its unit groupings across a model's
tables (474 np.unique passes on 64 GPUs become 2) and the bound's optimizer term is read once per
table; with those, later the same day and slower still: x64 4.00 -> 3.24 s (median of 5), x1024
6.33 -> 5.63 s (median of 9; fastest 5.89 -> 4.53 s). The CSV predates (4). Goals for 175B (1 s
on 64 GPUs, 2 s on 1024) still not met.
This round (2026-11-27, second session): plans, not speed. With v > 1 chunks per rank the DP's
cuts are leveled across the pipeline ranks and a rank whose chunks overflow it together has its
recomputation modes chosen together (planner/solver/inter_op.py `level_ranks`, search.py
`_refit_ranks`; benchmarks/virtual_stage_cuts.py). Faster plans on three rows: 175B x1024
16.603 -> 16.597 s (zero bubble v13), x12,288 5.833 -> 5.813 s (v9, and 2,083 -> 1,808 DPs: the
better plans lower the cap sooner), the MoE 18.376 -> 18.350 s. The cost, in-process on one
core, old (40b19ec) and new code alternately, fastest of 3: 175B x64 1.39 -> 1.61 s, x1024 3.18
-> 3.88 s, 192 layers 2.41 -> 2.54 s, 530B 1.36 -> 1.47 s, the MoE 0.81 -> 0.79 s: the leveled
and refitted cuts are priced beside the DP's. The machine ran about 1.3x faster than for the
previous CSV (the 96-layer profile took 9.3 s, then 12.4 s). Goals for 175B (1 s on 64 GPUs,
2 s on 1024) still not met.
This round (2026-11-28): tighter exact bounds, so fewer configurations reach the DP, same
layouts and iteration times on every row (planner/solver/bounds.py): the pigeonhole bound on
the busiest rank over the k p + 1 slowest units (96 blocks and a head on 8 ranks: 12 blocks and
the head on one rank); B* with each chunk's start term (ZeRO 3's exposed gather); the first and
last units in z* on the ranks every cut puts them (the loss with the last); for zero bubble and
interleaved 1F1B the step's gradient reduction and gather after the pipeline (`_tail_s`, the
whole model's collectives' bandwidth and bucket latencies, concave in the bytes); B* and z*
only where the rest of the bound is below the k-th best time so far; and the first 8
configurations priced in process before the workers fork (planner/solver/pricing.py). DPs run,
before -> after: 175B x64 60 -> 25, x512 199 -> 11, x1024 278 -> 57, x12,288 1,808 -> 120,
24 layers x512 137 -> 11, 192 layers 53 -> 9, 530B 77 -> 25, the MoE 13 -> 10. The machine ran
slower than for the previous CSV, so the code before this round (2a4e784) and after ran
alternately (`planner solve` processes, byte-compiled, default two workers, median of 5, 3 for
x12,288): 175B x64 2.85 -> 2.44 s, x1024 5.22 -> 3.54 s, x12,288 20.2 -> 5.2 s, 192 layers x512
4.72 -> 3.62 s, 530B 3.46 -> 2.61 s, the MoE 2.29 -> 2.48 s (ranges overlap: 2.10-2.80 and
2.35-2.69). Goals for 175B (1 s on 64 GPUs, 2 s on 1024) still not met; on 64 GPUs about 0.5 s
of the process is imports and 0.1-0.2 s printing the plan, and the search's weak bounds over
14,037 configurations, the whole bounds of the ~1,000 that reach them and the tables take
about as long as the 25 DPs.
This round (2026-11-28, second session): before the first configuration's turn the search had
refined several batches of 256 bounds with no cap yet (3 on 64 GPUs, 6 on 1024, 13 on 12,288),
computing B* and z* for all of them; now a scout prices the three with the least refined bounds
first (planner/solver/pricing.py `Scout`), so later batches compute those only below the cap,
and the refinement stops once the next weak bound reaches it. The weak bound's optimizer term
needs no Config for a dense model and its unit terms come once per table. Same layouts and
iteration times on every row; DPs run 57 -> 58 (x1024), 9 -> 12 (192 layers), 25 -> 28 (530B),
120 -> 123 (x12,288): the scouts not otherwise priced. The machine ran slower than for the
previous CSV (175B x64 2.59 -> 3.07 s in the CSV), so the code before (51b644a) and after ran
alternately (`planner solve` processes, median of 5): 175B x64 3.18 -> 3.03 s, x1024 4.12 ->
3.59 s, x12,288 6.21 -> 5.72 s; in-process on one core, the x12,288 search 6.1 -> 4.5 s (pricing
phase 3.0 -> 2.0 s). Goals for 175B (1 s on 64 GPUs, 2 s on 1024) still not met.
This round (2026-11-28, third session): the search is split across the two cores
(planner/solver/solve.py `split_blocks`, planner/solver/pricing.py `run_split`): its blocks are
dealt to two processes by family (tp, sp, micro-batch), each builds its own tables and bounds
and prices in bound order under one shared cap (`SharedTopK`), and a process whose part is done
prices configurations the other hands it (`Helpers`: the configurations worth a DP gather in the
best layouts' family, one part's). Before, only the pricing after the first 8 configurations
ran on both cores. Same top 3 on every row (exact ties ranked in enumeration order); the
configurations priced vary by a few from run to run (which process's cap falls first). The
machine ran fast today (x64 took 0.97 s with the code before, against 3.07 s in the previous
CSV). The code before (4fdde9c) and after, alternately (`planner solve` processes, median of
5, 3 for x12,288): 175B x64 0.99 -> 0.79 s, x1024 1.20 -> 0.93 s, x12,288 1.81 -> 1.33 s. In this
CSV every goal is met: 175B on 64 GPUs 0.76 s (1 s), on 1024 0.95 s (2 s), 530B on 2240 0.71 s
(5 s), 192 layers on 512 1.04 s (10 s), the MoE 0.68 s (10 s); on the slow days of the earlier
sessions the same code would take about 2.5-3x as long.
`solve_cached_s`: the same command with the ILP disk cache on (the default; the runs after the
first read the ILPs from it, as a user's repeated "what if" does).

    python benchmarks/solve_scaling.py [--rows 96x64,192x512]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd

from planner.plan import load_plan
from planner.profiler import profile_model

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
GPT3 = dict(d_model=12288, n_heads=96, d_ff=49152, vocab_size=51200, seq_len=2048)
MT_NLG = dict(n_layers=105, d_model=20480, n_heads=128, d_ff=81920, vocab_size=51200, seq_len=2048)  # Smith et al. 2022
QWEN3_MOE = dict(n_layers=94, config=str(ROOT / "examples" / "hf" / "qwen3-235b-a22b.json"), seq_len=4096)
REPEATS = 3
# (name, model args, GPUs, global batch)
CASES = [(f"gpt3-{n}l", dict(GPT3, n_layers=n), gpus, 1536) for n, gpus in
         [(96, 8), (96, 64), (96, 512), (96, 1024), (24, 512), (192, 512)]] + [
    ("mt-nlg-530b", MT_NLG, 2240, 1920),
    ("gpt3-96l", dict(GPT3, n_layers=96), 12288, 6144),
    ("qwen3-235b-a22b-moe", QWEN3_MOE, 256, 2048),
]


def _profile(name: str, args: dict):
    """(profile, GPU preset) of a row's model."""
    if "config" in args:  # a Hugging Face config (planner profile --hf-config)
        import planner.hf_config_model as hf

        model_args = {k: v for k, v in args.items() if k != "n_layers"}
        return profile_model(hf.__file__, model_args, [1], device="meta", gpu="h100-80gb", dtype="bfloat16",
                             precision="pure"), "h100-80gb"
    return profile_model("examples/gpt.py", args, [1, 2, 4], device="meta", gpu="a100-80gb", dtype="bfloat16",
                         precision="pure"), "a100-80gb"


def run(name: str, args: dict, gpus: int, batch: int, profiles: dict, folder: Path) -> dict:
    key = (name, args["n_layers"])
    if key not in profiles:
        started = time.perf_counter()
        prof, gpu = _profile(name, args)
        path = folder / f"{name}-{args['n_layers']}.json"
        path.write_text(prof.model_dump_json())
        profiles[key] = (path, gpu, time.perf_counter() - started)
    path, gpu, profile_s = profiles[key]
    plan_path = folder / "plan.json"
    command = [str(Path(sys.executable).parent / "planner"), "solve", "-p", str(path), "--gpus", str(gpus), "--gpu", gpu,
               "-b", str(batch), "-o", str(plan_path)]
    failed = None

    def median_wall(cache_dir: str) -> float:
        nonlocal failed
        walls = []
        for _ in range(REPEATS):
            plan_path.unlink(missing_ok=True)
            started = time.perf_counter()
            done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT,
                                  env={**os.environ, "PLANNER_CACHE_DIR": cache_dir})
            walls.append(time.perf_counter() - started)
            if done.returncode:
                failed = " ".join(done.stderr.split())[-300:]
        return statistics.median(walls)

    cached = median_wall(str(folder / f"ilp-cache-{name}-{gpus}"))  # first run fills it, the others read it
    row = {"model": name, "n_layers": args["n_layers"], "gpus": gpus, "global_batch": batch,
           "solve_s": median_wall(""), "solve_cached_s": cached, "profile_s": profile_s}
    if failed:  # a cluster too small for the model is an answer too, and timed
        return dict(row, layout=f"no plan: {failed}")
    plan = load_plan(plan_path)
    lay, search = plan.layout, plan.search
    return dict(
        row,
        search_s=search.solve_time_s,
        **{f"{phase}_s": seconds for phase, seconds in (search.phase_times_s or {}).items()},
        candidates=search.candidates, pruned_by_memory=search.pruned_by_memory_bound,
        pruned_by_time=search.pruned_by_time_bound, candidates_evaluated=search.candidates_evaluated,
        layout=f"pp{lay.pp_degree} dp{lay.dp_degree} tp{lay.tp_degree}{' sp' if lay.sequence_parallel else ''} "
               f"{f'ep{lay.ep_degree} ' if lay.ep_degree > 1 else ''}"
               f"zero{lay.zero_stage} {lay.schedule} v{lay.virtual_stages} mbs{plan.batch.micro_batch_size}",
        recompute=",".join(sorted({s.recompute for s in plan.stages})),
        iteration_s=plan.prediction.iteration_time_s, mfu=plan.prediction.mfu,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", help="only these LAYERSxGPUS rows, comma-separated (the CSV is not written)")
    only = parser.parse_args().rows
    wanted = {tuple(map(int, r.split("x"))) for r in only.split(",")} if only else None
    # Byte-compiled, as an installed package is (pip compiles at install; an editable install
    # writes the .pyc on its first run): with PYTHONDONTWRITEBYTECODE set, as on the project's
    # machine, every `planner solve` process would otherwise compile planner/ from source again,
    # about 0.15-0.3 s of each timing that no user's second run pays.
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(ROOT / "planner")], check=True, stdout=subprocess.DEVNULL)
    profiles: dict = {}
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for name, args, gpus, batch in CASES:
            if wanted is None or (args["n_layers"], gpus) in wanted:
                rows.append(run(name, args, gpus, batch, profiles, Path(folder)))
                print(rows[-1], flush=True)
    if wanted is not None:
        return
    frame = pd.DataFrame(rows)
    RESULTS.mkdir(parents=True, exist_ok=True)
    frame.to_csv(RESULTS / "solve_scaling.csv", index=False)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sweep = frame[(frame.model == "gpt3-96l")].dropna(subset=["solve_s"])
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(sweep["gpus"], sweep["solve_s"], "o-", label="planner solve process")
    if "search_s" in sweep:
        ax.plot(sweep["gpus"], sweep["search_s"], "s--", label="search alone")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("A100-80GB GPUs (8 per node)")
    ax.set_ylabel("seconds (median of 3)")
    ax.set_title("planner solve, GPT-3 175B")
    ax.legend()
    fig.tight_layout()
    fig.savefig(RESULTS / "solve_scaling.png", dpi=120)


if __name__ == "__main__":
    main()
