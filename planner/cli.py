"""The `planner` command line: one verb per arrow of the design.

    planner profile MODEL_FILE   -> profile.json
    planner solve --profile P --gpus N --global-batch B   -> plan.json
    planner run PLAN -o M        -> metrics.json (torchrun; --reference: one process)
    planner validate PLAN M      predicted against measured, term by term
    planner show FILE            tables for a profile or a plan (--gantt for a plan's schedule)
    planner profile-cluster      -> cluster.yaml (collectives measured on this node)
    planner export PLAN          a plan as Megatron-LM, torchtitan, DeepSpeed or Accelerate configuration
    planner price                an engine's configuration priced beside the best plan
    planner schema KIND          the JSON schema of a plan, profile, metrics or cluster file

Every verb is a thin layer over a Python function. User mistakes raise PlannerError, which
is printed as one paragraph with a non-zero exit; `--debug` shows the traceback instead.
Heavy imports (torch) happen inside the verbs so that `planner --help` is instant.
"""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

from planner.errors import PlannerError


def _hide_flag_types(params) -> None:
    """typer 0.29's rich help prints every option's type, a flag's too (`--resume <bool>`, as if
    it took a value): `TyperOption.display_type_rich` shows the metavar when one is set, else
    `<type>`. An empty metavar on each flag shows nothing; click never prints a flag's metavar."""
    for param in params:
        if isinstance(param, typer.core.TyperOption) and param.is_flag and param.metavar is None:
            param.metavar = ""


class _FlagHelpMixin:
    """A command or group whose flags, `--help` included, show no type in `--help`."""

    params: list  # click's Command sets it

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        _hide_flag_types(self.params)

    def get_help_option(self, ctx):
        option = super().get_help_option(ctx)  # made on first use (and cached) by click
        _hide_flag_types([option])
        return option


class _Command(_FlagHelpMixin, typer.core.TyperCommand):
    """A verb (`planner VERB`)."""


class _Group(_FlagHelpMixin, typer.core.TyperGroup):
    """The `planner` command itself, holding the verbs."""


class _Typer(typer.Typer):
    """Every verb a `_Command` unless it names its own class."""

    def command(self, *args, cls=None, **kwargs):
        return super().command(*args, cls=cls or _Command, **kwargs)


app = _Typer(cls=_Group, add_completion=False, no_args_is_help=True, help="Auto-parallelism planner for PyTorch.")
# Off a terminal rich assumes 80 columns, which folds every table; logs and CI get room.
_WIDTH = None if sys.stdout.isatty() else 160
console = Console(width=_WIDTH)
err_console = Console(stderr=True, width=_WIDTH)
_state = {"debug": False}


@app.callback()
def _main(debug: bool = typer.Option(False, "--debug", help="Show Python tracebacks on errors, and debug logs.")) -> None:
    _state["debug"] = debug
    _configure_logging(debug)


def _configure_logging(debug: bool) -> None:
    """Python logging for the CLI. `--debug`: the planner's and runtime's DEBUG lines (profiling
    step times, launch commands, torchrun's own lines) on stderr. Otherwise logging keeps Python's
    default (WARNING and above, bare messages), so nothing the CLI prints changes."""
    import logging

    if not debug:
        # transformers imports torchao when it is installed; torchao then logs "Failed to load
        # .../torchao/_C_mxfp8..." for kernels built for another Python or CUDA, and torch's
        # _pytree logs two Enum-registration deprecations: harmless import-time messages of an
        # optional package, printed on every `planner profile --hf-config`. --debug keeps them.
        for name in ("torchao", "torch.utils._pytree"):
            logging.getLogger(name).setLevel(logging.ERROR)
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    for name in ("planner", "runtime"):
        logger = logging.getLogger(name)
        logger.setLevel(logging.DEBUG)
        if not logger.handlers:  # once per process: tests run the app many times in one
            logger.addHandler(handler)


def _int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise PlannerError(f"Expected comma-separated integers, got {text!r}.", "Example: --micro-batch-sizes 1,2,4") from None
    if not values or min(values) < 1:
        raise PlannerError(f"Expected positive integers, got {text!r}.", "Example: --micro-batch-sizes 1,2,4")
    return values


def check_output_path(path: Path | str | None, option: str, directory: bool = False) -> None:
    """Refuse, before any work, an output the command could not write at the end: a directory
    where a file goes (or a file where a directory goes), or a folder that cannot be created or
    written. The folder is created now (it would be at the end); a test file is written in it
    and removed, which answers for permissions, read-only file systems and running as root alike."""
    import tempfile

    if path is None:
        return
    path = Path(path).expanduser()
    if directory and path.exists() and not path.is_dir():
        raise PlannerError(f"{option} {path} is a file, not a directory.", f"Pass a directory for {option}.")
    if not directory and path.is_dir():
        raise PlannerError(f"{option} {path} is a directory.", f"Pass a file path for {option}, e.g. {path / 'out.json'}.")
    folder = path if directory else path.parent
    existing = next((a for a in (folder, *folder.parents) if a.exists()), None)
    if existing is not None and not existing.is_dir():
        raise PlannerError(f"{option} {path} cannot be written: {existing} is a file, so no folder can be made in it.",
                           f"Choose a {option} in a folder you can write to.")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise PlannerError(f"{option} {path} cannot be written: {reason} ({exc.filename or folder}).",
                           f"Choose a {option} in a folder you can write to.") from None
    if not directory and path.exists() and not os.access(path, os.W_OK):
        raise PlannerError(f"{option} {path} exists and is not writable.", f"Choose another {option}, or make the file writable.")


def default_profile_path(model_file: str, device: str, gpu: str | None, dtype: str) -> Path:
    """runs/profiles/<model>-<device>-<dtype>.json: under `runs/`, which a checkout ignores, so a
    profile made inside it never lands beside (or over) the shipped ones in `profiles/`."""
    where = f"meta-{gpu}" if device == "meta" else device
    return Path("runs") / "profiles" / f"{Path(model_file).stem}-{where}-{dtype}.json"


def _model_source(model_file: str | None, args: dict, hf_config: Path | None, seq_len: int | None) -> tuple[str, dict]:
    """The model file and its arguments: the user's, or planner/hf_config_model.py for --hf-config."""
    if (model_file is None) == (hf_config is None):
        raise PlannerError("Give a model file or --hf-config" + (", not both." if model_file else "."),
                           "e.g. planner profile examples/gpt.py, or planner profile --hf-config examples/hf/llama3-8b.json")
    if hf_config is None:
        assert model_file is not None, "exactly one of the two (checked above)"
        if seq_len is not None:
            raise PlannerError("--seq-len goes with --hf-config.", "For a model file, pass its own argument (-a seq_len=N).")
        return model_file, args
    import planner.hf_config_model as hf
    from planner.hf_config_model import load_config

    load_config(str(hf_config), **args)  # refuse a bad path or a misspelt field before any work
    extra = {"seq_len": seq_len} if seq_len is not None else {}
    return hf.__file__, {"config": str(hf_config.expanduser().resolve()), **extra, **args}


@app.command()
def profile(
    model_file: Optional[str] = typer.Argument(None, help="Python file defining build_model and make_batch (or --hf-config)."),
    model_arg: list[str] = typer.Option([], "--model-arg", "-a", help="KEY=VALUE passed to build_model (repeatable); "
                                        "with --hf-config, a config field to override."),
    hf_config: Optional[Path] = typer.Option(None, "--hf-config", help="A Hugging Face config.json (or its folder): "
                                             "profile AutoModelForCausalLM.from_config of it, no model file needed."),
    seq_len: Optional[int] = typer.Option(None, "--seq-len", help="With --hf-config: tokens per sample (default "
                                          "min(2048, the config's context))."),
    micro_batch_sizes: str = typer.Option("1", help="Comma-separated micro-batch sizes to profile."),
    device: str = typer.Option("cpu", help="cpu or cuda (measured), or meta (analytic)."),
    gpu: Optional[str] = typer.Option(None, help="GPU spec for analytic times: a preset (a100-40gb, a100-80gb, h100-80gb, "
                                      "h200, b200, b300) or a cluster file whose GPU it takes (its overrides of a preset's rates)."),
    dtype: Optional[str] = typer.Option(None, help="float32, bfloat16 or float16; default: bfloat16 for a GPU "
                                        "(--device cuda, or --device meta for a GPU spec), float32 on CPU."),
    precision: str = typer.Option("autocast", help="16-bit dtypes: autocast computes as `planner run` trains (fp32 "
                                  "weights, each forward under autocast; emulated on meta), pure as the model converted "
                                  "to the 16-bit type (Megatron-LM, DeepSpeed bf16, FSDP2 mixed precision)."),
    repeats: int = typer.Option(10, help="Timed passes over the units (round-robin; a trimmed mean is kept)."),
    fusion: str = typer.Option("none", help="Memory traffic as eager PyTorch runs it (none), or with pointwise and "
                               "softmax/dropout chains fused as torch.compile or Megatron-LM's kernels do (elementwise)."),
    threads: int = typer.Option(1, "--threads", help="CPU: torch threads while measuring. A plan solved from the profile "
                                "runs each process with as many; the default 1 suits one process per core."),
    output: Optional[Path] = typer.Option(None, "--output", "-o", help="Where to write the profile JSON."),
) -> None:
    """Measure (or estimate) every unit of a model: time, FLOPs, bytes, cut crossings."""
    from rich.progress import Progress

    from planner.model_file import parse_model_args
    from planner.profiler import profile_model
    from planner.report import print_profile

    args = parse_model_args(model_arg)
    model_file, args = _model_source(model_file, args, hf_config, seq_len)
    sizes = _int_list(micro_batch_sizes)
    spec = None
    if gpu is not None:
        spec = _analytic_gpu(gpu)  # reject unknown names and bad cluster files before any work
        if device != "meta":
            console.print(f"note: --gpu {gpu} only sets analytic times; with --device {device} times are measured.")
    if dtype is None:
        dtype, target = _default_dtype(device, spec)
        if dtype != "float32":
            console.print(f"note: {target} is profiled in {dtype} ({precision}), as GPUs train; --dtype float32 for float32.")
    check_output_path(output or default_profile_path("model", device, None, dtype), "--output")  # before any work
    with Progress(console=err_console, transient=True) as bar:
        task = bar.add_task("profiling", total=None)

        def step(what: str, done: int, total: int) -> None:
            bar.update(task, description=f"profiling {what}", completed=done, total=total)

        result = profile_model(model_file, args, sizes, device=device, gpu=spec, dtype=dtype, repeats=repeats, progress=step,
                               fusion=fusion, threads=threads, precision=precision)
    named = str(hf_config or model_file)
    if hf_config is not None and hf_config.suffix:  # a config file: its stem, or its folder's name for a config.json
        named = str(hf_config.parent if hf_config.stem == "config" else hf_config.parent / hf_config.stem)
    path = result.save(output or default_profile_path(named, device, result.target_gpu, dtype))
    print_profile(result, console=console)
    console.print(f"wrote {path}")


def _default_dtype(device: str, spec) -> tuple[str, str]:
    """`planner profile` without --dtype: (dtype, what is profiled). A GPU trains in 16 bits (mixed
    precision: fp32 weights, bf16 compute, as `planner run` trains), so a GPU target gets bfloat16
    (float16 where the GPU has no bf16: CUDA before compute capability 8.0; float32 for an analytic
    spec whose bf16 peak is not above its fp32 one, as the cpu preset's); a CPU float32. An analytic
    profile without --gpu prices the h100-80gb (planner/profiler `profile_model`)."""
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            return "float32", "cpu"  # the profiler refuses --device cuda here, with its own message
        name = torch.cuda.get_device_name()
        return ("bfloat16" if torch.cuda.is_bf16_supported() else "float16"), name
    if device == "meta":
        from planner.hardware import DEFAULT_ANALYTIC_GPU, get_gpu

        spec = spec or get_gpu(DEFAULT_ANALYTIC_GPU)
        fast = spec.peak_flops.get("bfloat16", 0.0) > spec.peak_flops.get("float32", 0.0)  # tensor cores (not the cpu preset)
        return ("bfloat16" if fast else "float32"), spec.name
    return "float32", device


def _analytic_gpu(gpu: str):
    """`planner profile --gpu`: a preset's spec, or the GPU of a cluster file (a path to YAML or JSON)."""
    from planner.hardware import GPUS, get_gpu

    if gpu in GPUS or not (gpu.endswith((".yaml", ".yml", ".json")) or Path(gpu).is_file()):
        return get_gpu(gpu)
    from planner.cluster import load_cluster

    return load_cluster(gpu).gpu


@app.command()
def show(
    file: Path = typer.Argument(..., help="A profile or plan JSON."),
    micro_batch_size: Optional[int] = typer.Option(None, "--micro-batch", help="Profiles: which profiled micro-batch size to show."),
    csv: Optional[Path] = typer.Option(None, help="Profiles: also write the per-unit table as CSV here."),
    gantt: Optional[Path] = typer.Option(None, help="Plans: draw the simulated schedule as a PNG here."),
    all_stages: bool = typer.Option(False, "--all-stages", help="Plans: list every stage (chunk); past 24 the middle "
                                    "ones are elided."),
) -> None:
    """Print a profile (per unit, totals, share of time) or a plan (layout, stages, breakdown, alternatives)."""
    import json

    check_output_path(csv, "--csv")
    check_output_path(gantt, "--gantt")

    try:
        data = json.loads(file.read_text()) if file.is_file() else None
    except (json.JSONDecodeError, UnicodeDecodeError):
        data = None  # the loaders below give the precise message
    if isinstance(data, dict) and "layout" in data:
        from planner.plan import load_plan
        from planner.plan_report import draw_plan_gantt, print_plan

        plan = load_plan(file)
        print_plan(plan, console=console, all_stages=all_stages)
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
    profile_arg: Optional[Path] = typer.Argument(None, metavar="PROFILE", help="Profile JSON from `planner profile` "
                                                 "(or --profile)."),
    profile_opt: Optional[Path] = typer.Option(None, "--profile", "-p", help="Profile JSON from `planner profile`."),
    global_batch: int = typer.Option(..., "--global-batch", "-b", help="Samples per optimizer step."),
    gpus: Optional[int] = typer.Option(None, "--gpus", help="Number of GPUs (with a preset GPU)."),
    gpus_per_node: Optional[int] = typer.Option(None, "--gpus-per-node", help="GPUs per node (default min(gpus, 8))."),
    gpu: Optional[str] = typer.Option(None, "--gpu", help="GPU preset: a100-40gb, a100-80gb, h100-80gb, h200, b200, b300, cpu."),
    cluster: Optional[Path] = typer.Option(None, "--cluster", help="Cluster file (YAML/JSON) instead of --gpus."),
    pp: Optional[int] = typer.Option(None, "--pp", help="Pin the pipeline-parallel degree."),
    tp: Optional[int] = typer.Option(None, "--tp", help="Pin the tensor-parallel degree."),
    dp: Optional[int] = typer.Option(None, "--dp", help="Pin the data-parallel degree."),
    micro_batch: Optional[int] = typer.Option(None, "--micro-batch", help="Pin the micro-batch size."),
    schedule: Optional[str] = typer.Option(None, "--schedule", help="Pin: gpipe, 1f1b, interleaved-1f1b, zero-bubble "
                                           "(pipedream-2bw with --allow-async)."),
    virtual_stages: Optional[int] = typer.Option(None, "--virtual-stages", help="Pin chunks per pipeline rank."),
    recompute: Optional[str] = typer.Option(None, "--recompute", help="Pin every unit's mode: none, selective (the attention core, as Megatron-LM), "
                                                        "op (torchtitan's op-level: matmul outputs kept), full."),
    zero: Optional[int] = typer.Option(None, "--zero", help="Pin the ZeRO stage (0-3)."),
    sequence_parallel: Optional[bool] = typer.Option(None, "--sequence-parallel/--no-sequence-parallel", help="Pin sequence parallelism."),
    ep: Optional[int] = typer.Option(None, "--ep", help="Pin the expert-parallel degree (MoE models; divides the experts and dp)."),
    expert_tp: Optional[int] = typer.Option(None, "--expert-tp", help="Pin expert tensor parallelism (MoE models): each "
                                            "expert split over the TP group; 1 or --tp, without sequence parallelism. "
                                            "Never searched (default 1)."),
    moe_imbalance: float = typer.Option(1.0, "--moe-imbalance", help="MoE routing: the busiest EP rank's tokens over the "
                                        "balanced share (1.0 = balanced; the profile reports the measured spread)."),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="Training dtype (default: the profile's)."),
    cp: Optional[int] = typer.Option(None, "--cp", help="Pin the context-parallel degree (sequences split over cp of "
                                     "the dp ranks; 2 x cp must divide the sequence)."),
    cp_algorithm: Optional[str] = typer.Option(None, "--cp-algorithm", help="Pin how CP attention reaches the other "
                                               "ranks' K/V: all-gather (Llama 3) or ring (K/V blocks passed around, "
                                               "overlapped); default: the cheaper."),
    shard_degree: Optional[int] = typer.Option(None, "--shard-degree", help="Pin hybrid sharding (HSDP): ZeRO states "
                                               "sharded over groups of this many dp ranks, replicated across groups."),
    offload: Optional[bool] = typer.Option(None, "--offload/--no-offload", help="--offload: let the search keep model "
                                           "states in host memory and step the optimizer on the CPU (ZeRO-Offload) where "
                                           "that fits or is faster; --no-offload (default) never."),
    fp8: bool = typer.Option(False, "--fp8", help="Run the linears in FP8 (torchao Float8 training, bf16 otherwise; "
                             "H100/H200): priced at the FP8 rate and recorded in the plan."),
    allow_async: bool = typer.Option(False, "--allow-async", help="Also consider the asynchronous pipedream-2bw schedule "
                                     "(no pipeline bubble, one extra weight copy per stage): it changes the optimisation, "
                                     "W(t+1) = W(t) - lr grad f(W(t-1)), and the plan says so."),
    allow_replication: bool = typer.Option(False, "--allow-replication", help="Also consider PipeDream's per-stage "
                                           "replication (each stage on its own number of GPUs, micro-batches round-robin "
                                           "over a stage's replicas, as its data parallelism: tp 1, ZeRO 0): the plan's notes say whether it won."),
    top: int = typer.Option(3, "--top", help="Keep the K best configurations in the plan."),
    output: Path = typer.Option(Path("plan.json"), "--output", "-o", help="Where to write the plan."),
    allow_device_mismatch: bool = typer.Option(False, "--allow-device-mismatch", help="Solve with a profile whose times "
                                               "come from another device than the cluster's GPU (the plan says so)."),
) -> None:
    """Find the fastest plan that fits and write it as a plan file."""
    from planner.plan_report import print_plan
    from planner.profile_schema import load_profile
    from planner.solver.plan_builder import device_mismatch
    from planner.solver.pricing import default_workers
    from planner.solver.solve import Pins
    from planner.solver.solve import solve as solve_plan

    if top < 1:
        raise PlannerError(f"--top must be at least 1 (got {top}).", "--top K keeps the K best configurations; 1 keeps the best alone.")
    if (profile_arg is None) == (profile_opt is None):
        raise PlannerError("The profile was given twice, as an argument and as --profile." if profile_arg else
                           "No profile given: pass it as an argument or as --profile.",
                           "e.g. planner solve runs/profiles/gpt-cpu-float32.json --gpus 8 --global-batch 64")
    profile_file = profile_arg or profile_opt
    assert profile_file is not None, "exactly one of the two (checked above)"
    check_output_path(output, "--output")
    prof = load_profile(profile_file)
    if gpu is None and cluster is None and gpus is not None:
        gpu = _profile_gpu(prof)  # the device whose times the profile holds, rather than a fixed preset
    clus = load_cluster_args(cluster, gpus, gpus_per_node, gpu)
    mismatch = device_mismatch(prof, clus)
    if mismatch and not allow_device_mismatch:
        raise PlannerError(f"Device mismatch: {mismatch}, not the cluster's.",
                           f"Profile for the cluster's GPU (--device meta --gpu {clus.gpu.name}, or measured on it), solve for "
                           f"the profile's device (--gpu {_profile_gpu(prof)}), or pass --allow-device-mismatch to accept it.")
    if dtype is not None and dtype not in ("float32", "bfloat16", "float16"):
        raise PlannerError(f"Unknown --dtype {dtype!r}.", "Use float32, bfloat16 or float16.")
    pins = Pins(pp, tp, dp, micro_batch, schedule, virtual_stages, recompute, zero, sequence_parallel, ep, shard_degree,
                cp=cp, expert_tp=expert_tp, cp_algorithm=cp_algorithm)
    with err_console.status("solving"):
        plan = solve_plan(prof, clus, global_batch, pins, top_k=max(top, 1), dtype=dtype, profile_path=str(profile_file),
                          moe_imbalance=moe_imbalance, float8=fp8, allow_offload=bool(offload), allow_async=allow_async,
                          allow_replication=allow_replication, workers=default_workers())
    plan.save(output)
    print_plan(plan, console=console)
    console.print(f"wrote {output}")


def _profile_gpu(prof) -> str:
    """The GPU preset a profile's times belong to (a measured CUDA GPU matched as profile-cluster does)."""
    from planner.cluster_probe import GPU_NAMES
    from planner.solver.plan_builder import profile_times_device

    name = profile_times_device(prof)
    if prof.device == "cuda":
        return next((preset for key, preset in GPU_NAMES if key in name.lower()), "a100-80gb")
    return name


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
    resume: bool = typer.Option(False, "--resume", help="Start from the newest complete step in --checkpoint-dir (any plan)."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Start fresh in a --checkpoint-dir that holds a checkpoint "
                                   "(its steps are deleted once this run's step is saved)."),
) -> None:
    """Execute a plan with torchrun (gloo on CPU, NCCL on GPUs) and record what happened."""
    from runtime.launch import (
        run_plan,  # planner never imports runtime's training code at import time
    )

    if steps < 1:
        raise PlannerError(f"--steps must be positive (got {steps}).", "Run at least one step.")
    ran = run_plan(str(plan_file), str(model_file) if model_file else None, steps, seed, lr,
             str(output) if output else None, reference, timeout_s=timeout,
             checkpoint_dir=str(checkpoint_dir) if checkpoint_dir else None, resume=resume, overwrite=overwrite)
    if output and ran:  # a plan over several nodes prints their commands and runs nothing here
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

    check_output_path(gantt, "--gantt")
    plan = load_plan(plan_file)
    print_comparison(compare(plan, metrics_file, plan_file), console=console)
    if gantt:
        console.print(f"wrote {draw_validation_gantt(plan, metrics_file, gantt)}")


@app.command()
def schema(
    kind: str = typer.Argument(..., help="plan, profile, metrics or cluster"),
    output: Optional[Path] = typer.Option(None, "--output", "-o", help="Write here instead of printing."),
) -> None:
    """Print the JSON schema of plan, profile, metrics or cluster files (published in schemas/)."""
    import json

    from pydantic import BaseModel

    from planner.cluster_schema import ClusterFile
    from planner.metrics_schema import Metrics
    from planner.plan import Plan
    from planner.profile_schema import Profile

    models: dict[str, type[BaseModel]] = {"plan": Plan, "profile": Profile, "metrics": Metrics, "cluster": ClusterFile}
    if kind not in models:
        raise PlannerError(f"Unknown schema {kind!r}.", f"Use `planner schema KIND` with KIND one of {', '.join(models)}.")
    text = json.dumps(models[kind].model_json_schema(), indent=1) + "\n"
    if output:
        output.write_text(text)
    else:
        sys.stdout.write(text)


from planner.cluster_probe import profile_cluster_command as _pcc  # noqa: E402  (typer reads its signature; no torch import)


@functools.wraps(_pcc)
def _profile_cluster(*args, **kwargs):
    check_output_path(kwargs.get("output"), "--output")  # before measuring, not after
    return _pcc(*args, **kwargs)


app.command("profile-cluster", help=_pcc.__doc__)(_profile_cluster)


@app.command("export")
def export_command(
    plan_file: Path = typer.Argument(..., help="Plan JSON (from planner solve)."),
    to: str = typer.Option(..., "--to", help="torchtitan, megatron, deepspeed or accelerate."),
    output: Optional[Path] = typer.Option(None, "--output", "-o", help="Write here instead of printing."),
    profile_file: Optional[Path] = typer.Option(None, "--profile", "-p", help="Profile to price what the engine cannot "
                                                "express (default: the plan's)."),
) -> None:
    """Write a plan as an engine's configuration (planner/engines/); warn, with the price, where it cannot say it all."""
    from planner.engines import export_plan, precision_note
    from planner.plan import load_plan
    from planner.profile_schema import load_profile

    check_output_path(output, "--output")
    plan = load_plan(plan_file)
    path = profile_file or (Path(plan.profile) if plan.profile else None)
    prof = load_profile(path) if path is not None and path.is_file() else None
    result = export_plan(plan, to, prof)
    from rich.markup import escape

    for warning in result.warnings:
        err_console.print(f"[yellow]warning:[/] {escape(warning)}", highlight=False)
    if prof is not None and (precision := precision_note(to, prof)) is not None:  # the profile, not the plan
        err_console.print(f"note: {escape(precision)}", highlight=False)
    if output:
        output.write_text(result.text)
        console.print(f"wrote {output}")
    else:
        sys.stdout.write(result.text)


@app.command("price")
def price_command(
    from_file: Path = typer.Option(..., "--from", help="Megatron-LM arguments (.txt/.sh), torchtitan .toml, DeepSpeed .json "
                                   "or Accelerate .yaml."),
    profile_file: Path = typer.Option(..., "--profile", "-p", help="Profile JSON of the model."),
    engine: Optional[str] = typer.Option(None, "--engine", help="The file's engine (default: from its suffix and content)."),
    global_batch: Optional[int] = typer.Option(None, "--global-batch", "-b", help="Samples per step, where the file has none."),
    gpus: Optional[int] = typer.Option(None, "--gpus", help="Number of GPUs (with a preset GPU)."),
    gpus_per_node: Optional[int] = typer.Option(None, "--gpus-per-node", help="GPUs per node (default min(gpus, 8))."),
    gpu: Optional[str] = typer.Option(None, "--gpu", help="GPU preset (default: the profile's)."),
    cluster: Optional[Path] = typer.Option(None, "--cluster", help="Cluster file (YAML/JSON) instead of --gpus."),
    output: Optional[Path] = typer.Option(None, "--output", "-o", help="Also write the priced configuration as a plan."),
) -> None:
    """Price an existing engine configuration exactly and set it beside the best plan for the same model and cluster."""
    from planner.engines import as_the_engine_runs, check_engine_heads, guess_engine, read_config
    from planner.engines.pricing import compare
    from planner.profile_schema import load_profile

    check_output_path(output, "--output")
    prof = load_profile(profile_file)
    if gpu is None and cluster is None and gpus is not None:
        gpu = _profile_gpu(prof)
    clus = load_cluster_args(cluster, gpus, gpus_per_node, gpu)
    layout = read_config(from_file, engine)
    engine = engine or guess_engine(from_file, from_file.read_text())
    check_engine_heads(engine, prof, layout.tp_degree)
    with err_console.status("pricing"):
        prof, clus, engine_notes = as_the_engine_runs(prof, clus, engine)
        result = compare(prof, clus, layout, global_batch, profile_path=str(profile_file))
    for note in [*layout.notes, *engine_notes]:
        console.print(f"note: {note}")
    for line in result.lines():
        console.print(line, highlight=False)
    if output:
        result.theirs.save(output)
        console.print(f"wrote {output}")


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
        # A click usage error: click's, or typer's own copy of them (typer >= 0.20, typer._click).
        show, exit_code = getattr(exc, "show", None), getattr(exc, "exit_code", None)
        if callable(show) and isinstance(exit_code, int):
            show()
            sys.exit(exit_code)
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
