"""Build the model a rank needs: checked against the plan, initialised like the reference.

Initialisation must be identical to the one-process reference under the same seed, yet a
rank should not have to hold the whole model. Two ways, chosen per model (`init_mode`):

- `per-module` (used when every module that owns parameters or buffers has
  `reset_parameters()`, as torch's own layers do): the model is built on the meta device,
  each rank materialises only its units (`to_empty`), and every module is re-initialised
  from a generator seeded by (seed, its FQN). The reference does exactly the same on the
  whole model, so the numbers agree whatever the plan, and no rank ever holds more than
  its stage.
- `full` (anything else, e.g. Hugging Face layers with hand-written init): every rank
  builds the whole model on the CPU under `torch.manual_seed(seed)` and copies the tensors
  it holds by name; this needs host memory for the whole model once. Also every model with
  a frozen parameter (requires_grad=False): frozen weights are what the model file made them
  (pretrained values it loaded, a base model under adapters), and the trainable ones beside
  them are often initialised by their wrapper, not by their own layer (peft's LoRA: lora_B
  zeros, so the wrapped model starts as the base model), which per-module resets would undo.

A weight tied across pipeline stages (runtime/pp_split.py `CrossStageTie`) is one object in
the reference, reset by every module holding it, so it ends with the value of the last of
them in `named_modules()` order. A stage without that module resets a copy of it from the
same seed (`_reset_tied_copies`), so every stage's copy starts at the reference's value.
('full' mode copies by name from the whole model, where the names are tied already.)
"""

from __future__ import annotations

import copy
import zlib

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from planner.errors import PlannerError
from planner.model_file import ModelFile
from planner.plan import Plan
from planner.units import model_fingerprint, trace_on_meta


def build_meta_model(model_file: ModelFile) -> nn.Module:
    return model_file.build_on_meta()


def as_tuple(inputs) -> tuple:
    return inputs if isinstance(inputs, tuple) else (inputs,)


def trace(model: nn.Module, model_file: ModelFile):
    """The unit trace of one meta forward (units in execution order, crossing tensors)."""
    inputs, _ = model_file.make_batch(1)
    return trace_on_meta(model, as_tuple(inputs))


def check_fingerprint(plan: Plan, model: nn.Module, model_file: ModelFile):
    """The model's unit trace; refuses a model the plan was not made for."""
    traced = trace(model, model_file)
    units = traced.units
    planned = [u for s in plan.stages for u in s.units]
    if planned != units:
        missing = [u for u in units if u not in planned]
        extra = [u for u in planned if u not in units]
        raise PlannerError(
            f"The plan's stages do not match the model's units: missing {missing[:5]}, unknown {extra[:5]}"
            + ("" if missing or extra else " (order differs)") + ".",
            "Re-solve the plan for this model (planner profile, then planner solve).",
        )
    if plan.model.fingerprint and plan.model.fingerprint != model_fingerprint(model, units):
        raise PlannerError(
            "The model does not match the plan's fingerprint: the model file or its arguments changed since the plan was made.",
            "Re-profile and re-solve, or pass the model arguments the plan names.",
        )
    return traced


def init_mode(model: nn.Module) -> str:
    if any(not p.requires_grad for p in model.parameters()):
        return "full"  # frozen weights keep what the model file gave them (module docstring)
    for module in model.modules():
        owns = any(True for _ in module.parameters(recurse=False)) or any(True for _ in module.buffers(recurse=False))
        if owns and not hasattr(module, "reset_parameters"):
            return "full"
    return "per-module"


def _seed_for(seed: int, name: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63)


def tied_groups(model: nn.Module) -> list[list[str]]:
    """Names of parameters that are one object (tied weights: GPT-2's wte and lm_head), per object."""
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return [group for group in names.values() if len(group) > 1]


def retie(model: nn.Module, groups: list[list[str]]) -> None:
    """Make each group one parameter object again. `to_empty` (off the meta device) gives every
    module a new tensor of its own, and so does each TP style (`parallelize_module` registers a
    DTensor per module), so tied weights would silently train as two.

    The object kept is the group's first DTensor, else its first parameter. The plan shards every
    holder of a tied weight alike (planner/solver/costs.py `tie_pins`: along the vocabulary, an
    embedding rowwise and a linear head colwise, as Megatron-LM's `VocabParallelEmbedding` with
    its column-parallel output layer); a holder the forward never calls and the plan does not
    style takes the sharded one too (T5's `shared`, reached through the tied `embed_tokens`).
    Holders sharded otherwise are refused (runtime/apply_tp.py `check_tp_plan` refuses them, and
    unstyled holders the forward calls, before launch)."""
    for group in groups:
        params = {name: model.get_parameter(name) for name in group}
        shared = next((p for p in params.values() if isinstance(p, DTensor)), params[group[0]])
        for name, held in params.items():
            if held is shared:
                continue
            if isinstance(held, DTensor) and held.placements != getattr(shared, "placements", None):
                raise PlannerError(f"tp_plan shards the tied parameters {group[0]} and {name} differently.",
                                   "Shard every holder of a tied weight along the same dim (an embedding rowwise "
                                   "with a linear head colwise), or none; re-solve the plan.")
            owner, _, attr = name.rpartition(".")
            setattr(model.get_submodule(owner) if owner else model, attr, shared)


def materialize(model: nn.Module, seed: int, device: torch.device, mode: str, model_file: ModelFile) -> nn.Module:
    """Real tensors for every parameter and buffer `model` holds (the whole model, or a pipeline
    stage cut from it with the same FQNs), initialised as the module docstring says; in place."""
    full = None
    if mode == "full":
        torch.manual_seed(seed)
        full = model_file.build_model()
    tied = tied_groups(model)
    model.to_empty(device=device)
    retie(model, tied)
    with torch.no_grad():
        if full is not None:
            # Non-persistent buffers (rotary inv_freq) are not in state_dict(): copy by name instead.
            values = {**dict(full.named_parameters(remove_duplicate=False)), **dict(full.named_buffers())}
            for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
                tensor.copy_(values[name])
        else:
            for name, module in model.named_modules():
                if hasattr(module, "reset_parameters"):
                    torch.manual_seed(_seed_for(seed, name))
                    module.reset_parameters()
            _reset_tied_copies(model, seed, device, model_file)
    return model


def _reset_tied_copies(model: nn.Module, seed: int, device: torch.device, model_file: ModelFile) -> None:
    """Give `model`'s tied parameters the value the whole model's last resetting module gives
    them, where `model` (a pipeline stage) does not hold that module (module docstring)."""
    whole = build_meta_model(model_file)
    last: dict[int, tuple[str, str]] = {}  # parameter -> (module, attribute) of the last reset_parameters() reaching it
    for name, module in whole.named_modules():
        if hasattr(module, "reset_parameters"):
            for attr, p in module.named_parameters(recurse=False):
                last[id(p)] = (name, attr)
    held = dict(model.named_parameters(remove_duplicate=False))
    for group in tied_groups(whole):
        here = [n for n in group if n in held]
        owner, attr = last.get(id(whole.get_parameter(group[0])), ("", ""))
        fqn = f"{owner}.{attr}" if owner else attr
        if not here or not attr or fqn in held:
            continue  # not held here, or reset by its last module here already
        module = copy.deepcopy(whole.get_submodule(owner)).to_empty(device=device)
        torch.manual_seed(_seed_for(seed, owner))
        # `last` holds modules with reset_parameters only; torch types nn.Module.__getattr__ as Tensor | Module.
        module.reset_parameters()  # type: ignore[operator]
        for n in here:
            held[n].copy_(getattr(module, attr))
