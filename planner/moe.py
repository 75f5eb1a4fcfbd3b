"""Mixture-of-experts layers, recognised by structure and data flow, never by class name.

An *experts module* (`find_experts`) meets the contract that Hugging Face transformers 5.x's
`Qwen3MoeExperts` / `MixtralExperts` and examples/moe.py's `Experts` meet:
- the module owns all its parameters (no submodule has any), at least one, and every one has
  the same leading dim E >= 2, the number of experts: expert e's weights are `p[e]` for every
  parameter p;
- `forward(hidden_states [T, D], top_k_index [T, k], top_k_weights [T, k]) -> [T, D]`, each
  token's output the `top_k_weights`-weighted sum of its experts' outputs, expert e computed
  from the slices `p[e]` alone (so a module over a slice of the experts computes those);
- an integer attribute `num_experts`, if it has one, is E. A forward whose index and weights
  have defaults (GPT-OSS's `forward(hidden_states, router_indices=None, routing_weights=None)`)
  qualifies only with that attribute: three positional parameters alone say little.
runtime/apply_ep.py shards such modules; the profiler records them (`recognise_moe`).

The rest of the MoE layer is found around the experts module, in its parent (the *layer*), by
the data flow of one forward (`_Provenance` tags every tensor with the modules it came from):
- the **router** is the outermost module of the layer, outside the experts, that the experts'
  `top_k_index` comes from and their `hidden_states` do not, with an output whose last dim is E
  and a parameter with one dim E and one dim D (a Linear d_model -> E, or a module holding such
  a weight: Mixtral's and Qwen3-MoE's `gate`, examples/moe.py's `router`);
- a **shared expert** (DeepSeekMoE, Dai et al. 2024, section 3.2; Qwen2/3-MoE) is a direct child
  of the layer, outside the experts and the router, with at least two weight matrices, an
  output whose last dim is D that flows into the layer's output, and nothing upstream of the
  experts' inputs (which rules out a norm or an attention before the experts). A gate that
  scales it (Qwen2-MoE's `shared_expert_gate`, D -> 1) is not one: its output is 1 wide.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakTensorKeyDictionary


def _forward_arguments(module: nn.Module) -> list[inspect.Parameter] | None:
    """The positional parameters of the module class's forward, past `self` (None: no signature)."""
    try:
        params = inspect.signature(type(module).forward).parameters.values()
    except (TypeError, ValueError):
        return None
    return [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)][1:]


def experts_inputs(module: nn.Module, args: tuple, kwargs: dict) -> tuple | None:
    """(hidden_states, top_k_index, top_k_weights) of one call of an experts module, bound by
    its forward's own parameter names (GPT-OSS passes the last two by keyword, as
    `router_indices=` and `routing_weights=`); None when the call does not give all three."""
    names = [p.name for p in _forward_arguments(module) or []]
    bound = dict(zip(names, args, strict=False)) | {k: v for k, v in kwargs.items() if k in names}
    if len(names) != 3 or any(bound.get(n) is None for n in names):
        return None
    return tuple(bound[n] for n in names)


def with_top_k_index(module: nn.Module, args: tuple, kwargs: dict, index: torch.Tensor) -> tuple[tuple, dict] | None:
    """(args, kwargs) of a call of an experts module with its top_k_index replaced by `index`,
    wherever the call passed it (by position or by its forward's own name); None when the call
    does not give all three inputs (`experts_inputs`)."""
    if experts_inputs(module, args, kwargs) is None:
        return None
    name = [p.name for p in _forward_arguments(module) or []][1]
    if name in kwargs:
        return args, {**kwargs, name: index}
    return (*args[:1], index, *args[2:]), kwargs


def find_experts(model: nn.Module) -> dict[str, nn.Module]:
    """FQN -> experts module, by the structure the module docstring states."""
    found = {}
    for name, module in model.named_modules():
        own = list(module.parameters(recurse=False))
        if not own or len(own) != len(list(module.parameters())):
            continue
        if any(p.dim() < 2 for p in own) or len({p.shape[0] for p in own}) != 1 or own[0].shape[0] < 2:
            continue
        positional = _forward_arguments(module)
        if positional is None:
            continue
        required = [p for p in positional if p.default is p.empty]
        if len(positional) == 3 and (len(required) == 3 or getattr(module, "num_experts", None) == own[0].shape[0]):
            found[name] = module
    return found


def num_experts(module: nn.Module) -> int:
    """E, the leading dim every parameter of an experts module shares."""
    return next(module.parameters()).shape[0]


def expert_hidden_dim(experts: nn.Module, model_dim: int) -> int:
    """Width of one expert's intermediate layer: the smallest dim other than `model_dim` among
    the per-expert matrices (`p[e]` of every parameter with 2 dims past E). A SwiGLU expert
    stored as gate_up [2F, D] and down [D, F] gives F, stored transposed (GPT-OSS: [D, 2F],
    [F, D]) F too; a plain MLP's up [F, D] and down [D, F] give F. When F == D the down
    projection [D, D] shows it."""
    widths = []
    for p in experts.parameters():
        if p.dim() != 3:
            continue
        rows, cols = p.shape[1:]
        others = [d for d in (rows, cols) if d != model_dim] or [model_dim]
        widths.append(min(others))
    return min(widths) if widths else model_dim


def balanced_routing(tokens: int, top_k: int, num_experts: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """A top_k_index [T, k] that routes perfectly evenly: token t's j-th choice is expert
    (t*k + j) mod E, so every expert receives floor or ceil of T*k/E copies and a token's k
    experts are distinct (k <= E)."""
    flat = torch.arange(tokens * top_k, device=device) % num_experts
    return flat.view(tokens, top_k)


def routing_spread(top_k_index: torch.Tensor, num_experts: int) -> float:
    """max over experts of token copies received / mean copies per expert (1.0 = balanced).
    Entries outside [0, E) (a dropped token) count for no expert."""
    flat = top_k_index.reshape(-1)
    counts = torch.bincount(flat[(flat >= 0) & (flat < num_experts)], minlength=num_experts)
    mean = flat.numel() / num_experts
    return float(counts.max()) / mean if mean else 0.0


@dataclass
class ExpertsCall:
    """The inputs one call of an experts module received (the first call, if several)."""

    hidden_states: torch.Tensor
    """[T, D] tokens entering the experts (or [..., D]: T is the product of the leading dims)."""
    top_k_index: torch.Tensor
    """[T, k] the experts each token goes to."""
    top_k_weights: torch.Tensor
    """[T, k] each token's weights for its experts."""

    @property
    def tokens(self) -> int:
        return self.hidden_states.numel() // self.model_dim

    @property
    def top_k(self) -> int:
        return int(self.top_k_index.shape[-1])

    @property
    def model_dim(self) -> int:
        return int(self.hidden_states.shape[-1])


@dataclass
class MoEStructure:
    """One MoE layer found inside a module; paths relative to that module."""

    experts: str
    """Path of the experts module."""
    router: str | None
    """Path of the router (module docstring), None when no module qualifies."""
    shared_experts: list[str] = field(default_factory=list)
    """Paths of the shared experts (module docstring)."""
    call: ExpertsCall | None = None
    """What the experts received in the recognising forward (None: never called)."""


def _tensors(obj) -> list[torch.Tensor]:
    return [t for t in tree_flatten(obj)[0] if isinstance(t, torch.Tensor)]


class _Provenance(TorchDispatchMode):
    """Tags every tensor with the modules (`tag`) it was computed from, through every aten op."""

    def __init__(self):
        super().__init__()
        self.sources = WeakTensorKeyDictionary()

    def of(self, obj) -> frozenset[str]:
        return frozenset().union(*(self.sources.get(t, frozenset()) for t in _tensors(obj)))

    def tag(self, obj, name: str) -> None:
        for t in _tensors(obj):
            self.sources[t] = self.sources.get(t, frozenset()) | {name}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        came = self.of((args, kwargs))
        if came:
            for t in _tensors(out):
                self.sources[t] = self.sources.get(t, frozenset()) | came
        return out


@dataclass
class _Seen:
    """What the recognising forward saw of the module's descendants."""

    outputs: dict[str, list[torch.Size]] = field(default_factory=dict)
    """module path -> shapes of its output tensors (first call)."""
    output_sources: dict[str, frozenset[str]] = field(default_factory=dict)
    """module path -> the modules its output (first call) was computed from, itself included."""
    calls: dict[str, ExpertsCall] = field(default_factory=dict)
    """experts path -> its first call's inputs."""
    provenance: _Provenance = field(default_factory=_Provenance)


def _watch(module: nn.Module, experts: dict[str, nn.Module], seen: _Seen) -> list:
    """Hooks recording every descendant's output (tagged with its path) and each experts call."""
    handles = []
    for name, sub in module.named_modules():
        def after(_m, _args, out, name=name):
            seen.provenance.tag(out, name)
            seen.outputs.setdefault(name, [t.shape for t in _tensors(out)])
            seen.output_sources.setdefault(name, seen.provenance.of(out))

        handles.append(sub.register_forward_hook(after))
    for name, sub in experts.items():
        def before(m, args, kwargs, name=name):
            inputs = experts_inputs(m, args, kwargs)
            if name not in seen.calls and inputs is not None:
                seen.calls[name] = ExpertsCall(*inputs)

        handles.append(sub.register_forward_pre_hook(before, with_kwargs=True))
    return handles


def recognise_moe(module: nn.Module, args: tuple, kwargs: dict) -> list[MoEStructure]:
    """The MoE layers inside `module` (module docstring), found by running `module(*args,
    **kwargs)` once without gradients; [] without running it when it holds no experts module.
    Run it under whatever modes the module's forward needs (planner/meta_values.py on meta)."""
    experts = find_experts(module)
    if not experts:
        return []
    seen = _Seen()
    handles = _watch(module, experts, seen)
    try:
        with torch.no_grad(), seen.provenance:
            module(*args, **kwargs)
    finally:
        for h in handles:
            h.remove()
    return [_structure(module, name, seen) for name in experts]


def _parent(path: str) -> str:
    return path.rpartition(".")[0]


def _inside(path: str, ancestor: str) -> bool:
    return ancestor == "" or path == ancestor or path.startswith(ancestor + ".")


def _structure(module: nn.Module, name: str, seen: _Seen) -> MoEStructure:
    call = seen.calls.get(name)
    if call is None:
        return MoEStructure(experts=name, router=None)
    modules = dict(module.named_modules())
    layer = _parent(name)
    width, dim = num_experts(modules[name]), call.model_dim
    return MoEStructure(
        experts=name,
        router=_router(modules, seen, layer, name, width, dim),
        shared_experts=_shared_experts(modules, seen, layer, name, dim),
        call=call,
    )


def _holds_router_weight(sub: nn.Module, width: int, dim: int) -> bool:
    return any(p.dim() == 2 and sorted(p.shape) == sorted((width, dim)) for p in sub.parameters())


def _router(modules: dict, seen: _Seen, layer: str, experts: str, width: int, dim: int) -> str | None:
    call = seen.calls[experts]
    tokens_from = seen.provenance.of(call.hidden_states)  # a norm or an MLP before the experts
    candidates = [
        path for path in seen.provenance.of(call.top_k_index)
        if path != layer and _inside(path, layer) and not _inside(path, experts) and path not in tokens_from
        and any(len(s) and s[-1] == width for s in seen.outputs.get(path, []))
        and _holds_router_weight(modules[path], width, dim)
    ]
    return min(candidates, key=lambda p: (p.count("."), p)) if candidates else None


def _shared_experts(modules: dict, seen: _Seen, layer: str, experts: str, dim: int) -> list[str]:
    call = seen.calls[experts]
    upstream = seen.provenance.of((call.hidden_states, call.top_k_index, call.top_k_weights))
    layer_output = seen.output_sources.get(layer, frozenset())
    shared = []
    for path, sub in modules.items():
        if path in (experts, layer) or _parent(path) != layer or path in upstream or path not in layer_output:
            continue
        matrices = [p for p in sub.parameters() if p.dim() >= 2]
        shapes = seen.outputs.get(path, [])
        if len(matrices) >= 2 and len(shapes) == 1 and len(shapes[0]) and shapes[0][-1] == dim:
            shared.append(path)
    return shared

