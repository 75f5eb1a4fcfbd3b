"""Loading a model file: the contract between a user's model and the planner.

A model file is a Python file that defines

    build_model(**model_args) -> torch.nn.Module       # built on the meta device (`ModelFile.build_on_meta`)
    make_batch(batch_size, **model_args) -> (inputs, targets)
    loss_fn(output, targets) -> torch.Tensor           # optional; default cross-entropy

`--model-arg KEY=VALUE` on the CLI becomes `model_args` (see `parse_model_args`). Anything
the user's code raises is re-raised as a `PlannerError` that names the user's file and
line, because a traceback into the planner's internals tells them nothing.

This module does not import torch at import time: `planner solve` must start fast.
"""

from __future__ import annotations

import hashlib
import importlib.util
import sys
import traceback
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

from planner.errors import PlannerError

REQUIRED = ("build_model", "make_batch")


def parse_model_args(pairs: list[str] | tuple[str, ...] | None) -> dict[str, Any]:
    """Parse `KEY=VALUE` strings; values become int, float or bool where they read as one."""
    args: dict[str, Any] = {}
    for pair in pairs or ():
        key, sep, raw = pair.partition("=")
        key = key.strip()
        if not sep or not all(part.isidentifier() for part in key.split(".")):
            raise PlannerError(
                f"Malformed --model-arg {pair!r}: expected KEY=VALUE with KEY a Python identifier (or, for a "
                "nested Hugging Face config field, dotted identifiers: text_config.num_hidden_layers).",
                "Example: --model-arg n_layers=4 --model-arg d_model=256",
            )
        args[key] = parse_value(raw.strip())
    return args


def parse_value(raw: str) -> Any:
    """'4' -> 4, '1e-3' -> 0.001, 'true' -> True; anything else stays a string."""
    lowered = raw.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    for kind in (int, float):
        try:
            return kind(raw)
        except ValueError:
            pass
    return raw


@dataclass
class ModelFile:
    """A loaded model file and the arguments its functions are called with."""

    path: Path
    """Absolute path of the user's file."""
    module: ModuleType
    """The imported module."""
    model_args: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments passed to `build_model` and `make_batch`."""

    def build_model(self):
        """The user's model, made ready for training (see `for_training`)."""
        return for_training(call_user(self, "build_model", **self.model_args))

    def build_on_meta(self):
        """The user's model with its parameters and buffers on the meta device (no memory, any size).

        Built under `torch.device("meta")`, as the contract asks. A constructor that computes its
        architecture with tensors and reads them back (torchvision's RegNet derives its widths
        from `torch.arange(...).tolist()`) cannot run so: every tensor is then a meta tensor, and
        meta tensors hold no values. It is built again with only its parameters and buffers sent
        to meta as each module registers them (`parameters_on_meta`), its arithmetic on the CPU.
        If that fails too, the first error is the one reported."""
        import torch

        try:
            with torch.device("meta"):
                return self.build_model()
        except PlannerError as first:
            try:
                with parameters_on_meta():
                    return self.build_model()
            except PlannerError:
                raise first from None

    def make_batch(self, batch_size: int):
        """(inputs, targets) from the user's make_batch, its shape checked (`check_batch`)."""
        return check_batch(call_user(self, "make_batch", batch_size, **self.model_args), self.path)

    def loss(self, output, targets):
        if hasattr(self.module, "loss_fn"):
            return call_user(self, "loss_fn", output, targets)
        return default_loss_fn(output, targets)

    @property
    def has_loss_fn(self) -> bool:
        return hasattr(self.module, "loss_fn")

    def source_sha256(self) -> str:
        return hashlib.sha256(self.path.read_bytes()).hexdigest()


def load_model_file(path: str | Path, model_args: dict[str, Any] | None = None) -> ModelFile:
    """Import a model file and check it defines the contract's functions."""
    path = Path(path).expanduser().resolve()
    if not path.is_file():
        raise PlannerError(
            f"Model file {path} does not exist.",
            "Pass the path of a Python file that defines build_model(**args) and "
            "make_batch(batch_size, **args); see examples/gpt.py.",
        )
    name = "planner_user_model_" + hashlib.sha1(str(path).encode()).hexdigest()[:12]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise PlannerError(f"Cannot import {path}: it is not a Python source file.")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickling look modules up by name
    try:
        spec.loader.exec_module(module)
    except Exception as exc:  # the user's code: report their line, not ours
        sys.modules.pop(name, None)
        raise user_code_error(path, "importing the model file", exc) from exc
    missing = [fn for fn in REQUIRED if not callable(getattr(module, fn, None))]
    if missing:
        raise PlannerError(
            f"Model file {path} does not define {' and '.join(missing)}.",
            "A model file must define build_model(**model_args) -> nn.Module and "
            "make_batch(batch_size, **model_args) -> (inputs, targets); loss_fn(output, "
            "targets) is optional. See examples/gpt.py.",
        )
    check_model_args(path, module, dict(model_args or {}))
    return ModelFile(path=path, module=module, model_args=dict(model_args or {}))


def check_model_args(path: Path, module: ModuleType, model_args: dict[str, Any]) -> None:
    """Refuse a --model-arg that no function of the model file would read.

    `build_model`, `make_batch` (and `get_batch`, if defined) are all called with every
    argument. A key is accepted when one of them names it as a parameter, or takes
    `**kwargs` under a name that does not start with `_` (it forwards them, e.g. to a config
    class). `**_` (or `**_anything`) discards extras by convention, so a key only such a
    function would swallow is a typo, refused with the closest known name: `n_layerz=2` for
    examples/gpt.py. A function without `**` must name every key (Python would refuse it).
    """
    import difflib
    import inspect

    if not model_args:
        return
    named: set[str] = set()
    forwards, closed = [], []
    for fn_name in (*REQUIRED, "get_batch"):
        fn = getattr(module, fn_name, None)
        if not callable(fn):
            continue
        try:
            params = list(inspect.signature(fn).parameters.values())
        except (TypeError, ValueError):  # a builtin or C function: nothing to check against
            return
        if fn_name in ("make_batch", "get_batch"):
            params = params[1:] if fn_name == "make_batch" else params[2:]  # (batch_size,) / (step, batch_size)
        own = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
        named |= own
        var = next((p.name for p in params if p.kind == p.VAR_KEYWORD), None)
        if var is None:
            closed.append((fn_name, own))
        elif not var.startswith("_"):
            forwards.append(fn_name)
    for key in sorted(model_args):
        refused_by = [fn_name for fn_name, own in closed if key not in own]
        if refused_by or (key not in named and not forwards):
            close = difflib.get_close_matches(key, sorted(named), n=1)
            where = (f"{' and '.join(f'{f}()' for f in refused_by)} in {path} rejected the model arguments: "
                     f"no parameter named {key}" if refused_by
                     else f"Unknown --model-arg {key}: no function in {path} names it (their **_ would discard it)")
            raise PlannerError(
                where + "." + (f" Did you mean {close[0]}?" if close else ""),
                f"Known model arguments: {', '.join(sorted(named)) or 'none'}.",
            )


def check_batch(batch, path: Path):
    """`batch` if it is (inputs, targets) with inputs a tensor or a tuple of positional arguments
    (the model is called as model(*inputs)); a PlannerError saying what to return otherwise.

    A Hugging Face user's habit is a dict of keyword arguments, which the model would receive
    whole as its first argument and fail on deep inside (an embedding's indices a dict): it is
    refused here with the tuple to write instead."""
    if not isinstance(batch, (tuple, list)) or len(batch) != 2:
        raise PlannerError(
            f"make_batch() in {path} returned {type(batch).__name__}"
            + (f" of {len(batch)} items" if isinstance(batch, (tuple, list)) else "") + ", not (inputs, targets).",
            "Return a pair: the model's inputs (a tensor, or a tuple of its forward's positional arguments) "
            "and the targets loss_fn compares its output with.",
        )
    inputs = batch[0]
    if isinstance(inputs, dict):
        raise PlannerError(
            f"make_batch() in {path} returned its inputs as a dict ({', '.join(map(str, list(inputs)[:4]))}); "
            "the planner calls the model as model(*inputs), with positional arguments.",
            "Return a tuple in the order of the forward's parameters, None for one you skip "
            "(a Hugging Face T5: (input_ids, None, decoder_input_ids)), and compute the loss in loss_fn "
            "from the output and the targets.",
        )
    return batch


def for_training(model):
    """Turn off inference-only state a model may carry into training.

    A key/value cache (the `use_cache` flag of a model's `config`, on by default in every
    Hugging Face causal LM) makes each forward append to tensors kept from the previous
    one: running a unit twice then backpropagates through a freed graph, and a pipeline
    stage would carry the cache across micro-batches. Training never reads it, so it is
    off for every model that has the flag, whatever its class, and in every submodule that
    keeps a config of its own (an encoder-decoder's decoder stack reads a copy of the model's
    config: Hugging Face's T5).
    """
    modules = getattr(model, "modules", None)  # nn.Module.modules, without importing torch here
    for module in modules() if callable(modules) else [model]:
        config = getattr(module, "config", None)
        if config is not None and getattr(config, "use_cache", False):
            config.use_cache = False
    return model


@contextmanager
def parameters_on_meta():
    """While it lasts, a parameter or buffer a module registers lands on the meta device; other
    tensors are made where they would be (`ModelFile.build_on_meta`). Each one is made and
    initialised on the CPU first, so this costs the largest one's memory at a time and the
    initialisation's time: a fallback, not the way to build a model of billions of parameters.
    (What accelerate's `init_empty_weights` does; written here rather than depend on accelerate.)"""
    import torch
    from torch import nn

    register_parameter, register_buffer = nn.Module.register_parameter, nn.Module.register_buffer

    def to_meta_parameter(module, name, param):
        if param is not None and type(param) is nn.Parameter and not param.is_meta:
            param = nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)
        register_parameter(module, name, param)

    def to_meta_buffer(module, name, tensor, persistent=True):
        if isinstance(tensor, torch.Tensor) and not tensor.is_meta:
            tensor = tensor.to("meta")
        register_buffer(module, name, tensor, persistent)

    nn.Module.register_parameter, nn.Module.register_buffer = to_meta_parameter, to_meta_buffer
    try:
        yield
    finally:
        nn.Module.register_parameter, nn.Module.register_buffer = register_parameter, register_buffer


def call_user(model_file: ModelFile, fn_name: str, *args, **kwargs):
    """Call one of the user's functions; their exceptions become PlannerErrors."""
    fn: Callable = getattr(model_file.module, fn_name)
    try:
        return fn(*args, **kwargs)
    except TypeError as exc:
        if "unexpected keyword argument" in str(exc) and _raised_at_call(exc, fn):
            raise PlannerError(
                f"{fn_name}() in {model_file.path} rejected the model arguments: {exc}.",
                f"Check the --model-arg names (given: {sorted(model_file.model_args) or 'none'}), "
                f"or let {fn_name} accept **kwargs.",
            ) from exc
        raise user_code_error(model_file.path, f"calling {fn_name}()", exc) from exc
    except PlannerError:
        raise
    except Exception as exc:
        raise user_code_error(model_file.path, f"calling {fn_name}()", exc) from exc


def _raised_at_call(exc: BaseException, fn: Callable) -> bool:
    """True when the TypeError came from binding the arguments, not from inside `fn`."""
    frames = traceback.extract_tb(exc.__traceback__)
    code = getattr(fn, "__code__", None)
    return code is None or all(f.filename != code.co_filename for f in frames)


def user_code_error(path: Path, doing: str, exc: BaseException) -> PlannerError:
    """A PlannerError pointing at the deepest frame of the user's file in `exc`'s traceback."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if Path(f.filename) == path]
    where = f"{path}:{frames[-1].lineno} (in {frames[-1].name})" if frames else str(path)
    line = f"\n    {frames[-1].line}" if frames and frames[-1].line else ""
    return PlannerError(
        f"The model code raised {type(exc).__name__} while {doing}, at {where}:{line}\n"
        f"    {type(exc).__name__}: {exc}",
        "Fix the model file (run with --debug for the full traceback).",
    )


def default_loss_fn(output, targets):
    """Cross-entropy; a (..., classes) output against (...) targets is flattened first."""
    import torch.nn.functional as F

    output = getattr(output, "logits", output)
    if output.dim() > 2 and output.dim() == targets.dim() + 1 and output.shape[:-1] == targets.shape:
        return F.cross_entropy(output.flatten(0, -2), targets.flatten())
    return F.cross_entropy(output, targets)
