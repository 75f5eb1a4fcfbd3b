"""The `planner` command line: one verb per arrow of the design.

    planner profile MODEL_FILE   -> profile.json
    planner solve --profile P --gpus N --global-batch B   -> plan.json
    planner show FILE            tables for a profile or a plan (--gantt for a plan's schedule)

Every verb is a thin layer over a Python function. User mistakes raise PlannerError, which
is printed as one paragraph with a non-zero exit; `--debug` shows the traceback instead.
Heavy imports (torch) happen inside the verbs so that `planner --help` is instant.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

from planner.errors import PlannerError

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Auto-parallelism planner for PyTorch.")
# Off a terminal rich assumes 80 columns, which folds every table; logs and CI get room.
_WIDTH = None if sys.stdout.isatty() else 160
console = Console(width=_WIDTH)
err_console = Console(stderr=True, width=_WIDTH)
_state = {"debug": False}


@app.callback()
def _main(debug: bool = typer.Option(False, "--debug", help="Show Python tracebacks on errors.")) -> None:
    _state["debug"] = debug


def _int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise PlannerError(f"Expected comma-separated integers, got {text!r}.", "Example: --micro-batch-sizes 1,2,4") from None
    if not values or min(values) < 1:
        raise PlannerError(f"Expected positive integers, got {text!r}.", "Example: --micro-batch-sizes 1,2,4")
    return values


def default_profile_path(model_file: str, device: str, gpu: str | None, dtype: str) -> Path:
    where = f"meta-{gpu}" if device == "meta" else device
    return Path("profiles") / f"{Path(model_file).stem}-{where}-{dtype}.json"


@app.command()
def profile(
    model_file: str = typer.Argument(..., help="Python file defining build_model and make_batch."),
    model_arg: list[str] = typer.Option([], "--model-arg", "-a", help="KEY=VALUE passed to build_model (repeatable)."),
    micro_batch_sizes: str = typer.Option("1", help="Comma-separated micro-batch sizes to profile."),
    device: str = typer.Option("cpu", help="cpu or cuda (measured), or meta (analytic)."),
    gpu: Optional[str] = typer.Option(None, help="GPU spec for analytic times (a100-40gb, a100-80gb, h100-80gb, h200)."),
    dtype: str = typer.Option("float32", help="float32, bfloat16 or float16."),
    repeats: int = typer.Option(10, help="Timed passes over the units (round-robin; a trimmed mean is kept)."),
    fusion: str = typer.Option("none", help="Memory traffic as eager PyTorch runs it (none), or with pointwise and "
                               "softmax/dropout chains fused as torch.compile or Megatron-LM's kernels do (elementwise)."),
    threads: int = typer.Option(1, "--threads", help="CPU: torch threads while measuring. A plan solved from the profile "
                                "runs each process with as many; the default 1 suits one process per core."),
    output: Optional[Path] = typer.Option(None, "--output", "-o", help="Where to write the profile JSON."),
) -> None:
    """Measure (or estimate) every unit of a model: time, FLOPs, bytes, cut crossings."""
    from rich.progress import Progress

    from planner.hardware import get_gpu
    from planner.model_file import parse_model_args
    from planner.profiler import profile_model
    from planner.report import print_profile

    args = parse_model_args(model_arg)
    sizes = _int_list(micro_batch_sizes)
    if gpu is not None:
        get_gpu(gpu)  # reject unknown names before any work
        if device != "meta":
            console.print(f"note: --gpu {gpu} only sets analytic times; with --device {device} times are measured.")
    with Progress(console=err_console, transient=True) as bar:
        task = bar.add_task("profiling", total=None)

        def step(what: str, done: int, total: int) -> None:
            bar.update(task, description=f"profiling {what}", completed=done, total=total)

        result = profile_model(model_file, args, sizes, device=device, gpu=gpu, dtype=dtype, repeats=repeats, progress=step,
                               fusion=fusion, threads=threads)
    path = result.save(output or default_profile_path(model_file, device, result.target_gpu, dtype))
    print_profile(result, console=console)
    console.print(f"wrote {path}")


@app.command()
def show(
    file: Path = typer.Argument(..., help="A profile or plan JSON."),
    micro_batch_size: Optional[int] = typer.Option(None, "--micro-batch", help="Profiles: which profiled micro-batch size to show."),
    csv: Optional[Path] = typer.Option(None, help="Profiles: also write the per-unit table as CSV here."),
    gantt: Optional[Path] = typer.Option(None, help="Plans: draw the simulated schedule as a PNG here."),
) -> None:
    """Print a profile (per unit, totals, share of time) or a plan (layout, stages, breakdown, alternatives)."""
    import json

    try:
        data = json.loads(file.read_text()) if file.is_file() else None
    except (json.JSONDecodeError, UnicodeDecodeError):
        data = None  # the loaders below give the precise message
    if isinstance(data, dict) and "layout" in data:
        from planner.plan import load_plan
        from planner.plan_report import draw_plan_gantt, print_plan

        plan = load_plan(file)
        print_plan(plan, console=console)
        if gantt:
            console.print(f"wrote {draw_plan_gantt(plan, gantt)}")
        return
    from planner.profile_schema import load_profile
    from planner.report import print_profile, profile_frame

    prof = load_profile(file)
    print_profile(prof, micro_batch_size, console=console)
    if csv:
        csv.parent.mkdir(parents=True, exist_ok=True)
        profile_frame(prof, micro_batch_size).to_csv(csv, index=False)
        console.print(f"wrote {csv}")


def load_cluster_args(cluster: Optional[Path], gpus: Optional[int], gpus_per_node: Optional[int], gpu: Optional[str]):
    """A cluster from `--cluster FILE` or from `--gpus N [--gpus-per-node G] [--gpu NAME]`."""
    from planner.cluster import load_cluster, make_cluster

    if cluster is not None:
        if gpus is not None or gpus_per_node is not None:
            raise PlannerError("Give either --cluster FILE or --gpus N [--gpus-per-node G], not both.", "Drop one of them.")
        return load_cluster(cluster)
    if gpus is None:
        raise PlannerError("No cluster given.", "Pass --gpus N (with --gpu NAME, --gpus-per-node G) or --cluster FILE.")
    return make_cluster(gpus, gpus_per_node, gpu or "a100-80gb")


@app.command()
def solve(
    profile_file: Path = typer.Option(..., "--profile", "-p", help="Profile JSON from `planner profile`."),
    global_batch: int = typer.Option(..., "--global-batch", "-b", help="Samples per optimizer step."),
    gpus: Optional[int] = typer.Option(None, "--gpus", help="Number of GPUs (with a preset GPU)."),
    gpus_per_node: Optional[int] = typer.Option(None, "--gpus-per-node", help="GPUs per node (default min(gpus, 8))."),
    gpu: Optional[str] = typer.Option(None, "--gpu", help="GPU preset: a100-40gb, a100-80gb, h100-80gb, h200, cpu."),
    cluster: Optional[Path] = typer.Option(None, "--cluster", help="Cluster file (YAML/JSON) instead of --gpus."),
    pp: Optional[int] = typer.Option(None, "--pp", help="Pin the pipeline-parallel degree."),
    tp: Optional[int] = typer.Option(None, "--tp", help="Pin the tensor-parallel degree."),
    dp: Optional[int] = typer.Option(None, "--dp", help="Pin the data-parallel degree."),
    micro_batch: Optional[int] = typer.Option(None, "--micro-batch", help="Pin the micro-batch size."),
    schedule: Optional[str] = typer.Option(None, "--schedule", help="Pin: gpipe, 1f1b, interleaved-1f1b, zero-bubble."),
    virtual_stages: Optional[int] = typer.Option(None, "--virtual-stages", help="Pin chunks per pipeline rank."),
    recompute: Optional[str] = typer.Option(None, "--recompute", help="Pin: none, selective, full."),
    zero: Optional[int] = typer.Option(None, "--zero", help="Pin the ZeRO stage (0-3)."),
    sequence_parallel: Optional[bool] = typer.Option(None, "--sequence-parallel/--no-sequence-parallel", help="Pin sequence parallelism."),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="Training dtype (default: the profile's)."),
    top: int = typer.Option(3, "--top", help="Keep the K best configurations in the plan."),
    output: Path = typer.Option(Path("plan.json"), "--output", "-o", help="Where to write the plan."),
) -> None:
    """Find the fastest plan that fits and write it as a plan file."""
    from planner.plan_report import print_plan
    from planner.profile_schema import load_profile
    from planner.solver.solve import Pins, solve as solve_plan

    prof = load_profile(profile_file)
    clus = load_cluster_args(cluster, gpus, gpus_per_node, gpu)
    if dtype is not None and dtype not in ("float32", "bfloat16", "float16"):
        raise PlannerError(f"Unknown --dtype {dtype!r}.", "Use float32, bfloat16 or float16.")
    pins = Pins(pp, tp, dp, micro_batch, schedule, virtual_stages, recompute, zero, sequence_parallel)
    with err_console.status("solving"):
        plan = solve_plan(prof, clus, global_batch, pins, top_k=max(top, 1), dtype=dtype, profile_path=str(profile_file))
    plan.save(output)
    print_plan(plan, console=console)
    console.print(f"wrote {output}")


@app.command()
def run(
    plan_file: Path = typer.Argument(..., help="Plan JSON (from planner solve, or hand-written)."),
    model_file: Optional[Path] = typer.Option(None, "--model-file", help="Model file (default: the plan's)."),
    steps: int = typer.Option(5, "--steps", help="Optimizer steps."),
    seed: int = typer.Option(0, "--seed", help="Seed for initialisation and data."),
    lr: Optional[float] = typer.Option(None, "--lr", help="Learning rate (default: the plan's)."),
    output: Optional[Path] = typer.Option(None, "--output", "-o", help="Metrics JSON."),
    reference: bool = typer.Option(False, "--reference", help="One process, no parallelism (the parity yardstick)."),
    timeout: float = typer.Option(600.0, "--timeout", help="Wall-clock limit of the whole job, seconds."),
    checkpoint_dir: Optional[Path] = typer.Option(None, "--checkpoint-dir", help="Save a checkpoint here at the end."),
    resume: bool = typer.Option(False, "--resume", help="Start from the checkpoint in --checkpoint-dir (any plan)."),
) -> None:
    """Execute a plan with torchrun (gloo on CPU, NCCL on GPUs) and record what happened."""
    from runtime.launch import run_plan  # planner never imports runtime's training code at import time

    if steps < 1:
        raise PlannerError(f"--steps must be positive (got {steps}).", "Run at least one step.")
    run_plan(str(plan_file), str(model_file) if model_file else None, steps, seed, lr,
             str(output) if output else None, reference, timeout_s=timeout,
             checkpoint_dir=str(checkpoint_dir) if checkpoint_dir else None, resume=resume)
    if output:
        console.print(f"wrote {output}")


@app.command()
def validate(
    plan_file: Path = typer.Argument(..., help="The plan that was run."),
    metrics_file: Path = typer.Argument(..., help="Metrics JSON from planner run."),
    gantt: Optional[Path] = typer.Option(None, help="Pipelined runs: draw the predicted and the measured schedule as a PNG here."),
) -> None:
    """Predicted vs measured, with the error of each term."""
    from planner.plan import load_plan
    from planner.validate import compare, draw_validation_gantt, print_comparison

    plan = load_plan(plan_file)
    print_comparison(compare(plan, metrics_file), console=console)
    if gantt:
        console.print(f"wrote {draw_validation_gantt(plan, metrics_file, gantt)}")


@app.command()
def schema(
    kind: str = typer.Argument(..., help="plan or profile"),
    output: Optional[Path] = typer.Option(None, "--output", "-o", help="Write here instead of printing."),
) -> None:
    """Print the JSON schema of plan or profile files."""
    import json

    from planner.plan import Plan
    from planner.profile_schema import Profile

    models = {"plan": Plan, "profile": Profile}
    if kind not in models:
        raise PlannerError(f"Unknown schema {kind!r}.", "Use `planner schema plan` or `planner schema profile`.")
    text = json.dumps(models[kind].model_json_schema(), indent=1) + "\n"
    if output:
        output.write_text(text)
    else:
        sys.stdout.write(text)


from planner.cluster_probe import profile_cluster_command as _pcc  # noqa: E402  (typer reads its signature; no torch import)

app.command("profile-cluster", help=_pcc.__doc__)(_pcc)


def main() -> None:
    """Console-script entry: run the app, turning PlannerErrors into clean messages."""
    debug = "--debug" in sys.argv[1:]
    try:
        code = app(standalone_mode=False)
    except PlannerError as exc:
        exit_code = getattr(exc, "exit_code", 1)  # a job stopped by a signal (128 + it) or by --timeout (launcher.py)
        if debug and exit_code == 1:
            raise
        from rich.markup import escape

        err_console.print(f"[bold red]{'error' if exit_code == 1 else 'stopped'}:[/] {escape(exc.message)}", highlight=False)
        if exc.hint:
            err_console.print(escape(exc.hint), highlight=False)
        sys.exit(exit_code)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except (typer.Abort, KeyboardInterrupt):
        err_console.print("aborted")
        sys.exit(130)
    except Exception as exc:  # click usage errors are handled below; anything else is a bug
        import click

        if isinstance(exc, click.ClickException):
            exc.show()
            sys.exit(exc.exit_code)
        if debug:
            raise
        from rich.markup import escape

        err_console.print(f"[bold red]internal error:[/] {type(exc).__name__}: {escape(str(exc))}\nRe-run with --debug for the traceback and report it.")
        sys.exit(2)
    if isinstance(code, int) and code != 0:  # typer turns Ctrl-C into a returned 130 when not standalone
        if code == 130:
            err_console.print("interrupted (Ctrl-C)")
        sys.exit(code)


if __name__ == "__main__":
    main()
