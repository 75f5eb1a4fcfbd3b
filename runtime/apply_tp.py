"""Tensor (and sequence) parallelism from a stage's `tp_plan` with DTensor's parallelize_module.

The plan names each module's style (planner/solver/intra_op.py). A column-parallel module
whose output no row-parallel sibling consumes (a vocabulary-sharded output head, a sharded
embedding) gathers its output back (`output_layouts=Replicate()`), and a row-parallel module
without a column-parallel sibling slices its replicated input (`input_layouts=Replicate()`):
the plan is per module, the layouts between modules are the runtime's to make consistent.

Sequence parallelism (`layout.sequence_parallel`; Korthikanti et al. 2022, "Reducing
Activation Recomputation in Large Transformer Models", section 4.2.2) keeps the activations
*between* the column/row sandwiches sharded along the sequence (dim 1), as the intra-op
solver's boundary layout S assumes:

- the *SP region* is every unit of the stage that holds a column/row pair (or a module the
  plan styles `sequence_parallel`); a replicated activation entering the region is cut to
  this rank's sequence chunk, and one leaving it is all-gathered back;
- the module that owns a column/row pair (`attn`, `mlp`, Hugging Face's `self_attn`, ...)
  all-gathers its first input (g in the paper) and the row-parallel module reduce-scatters
  its output (g-bar) instead of all-reducing it; in backward these swap, as DTensor derives;
- every other module with parameters in the region (the norms) runs on the local sequence
  chunk with replicated weights (torch's `SequenceParallel`), whose gradients DTensor sums
  over the TP group. That is exact for modules that act on each position alone (norms,
  per-token linears), which is what a transformer block has outside its sandwiches.

The sequence length must divide by the TP degree. Attention code must take the sequence
length from its input's shape and split heads with `view(b, s, -1, head_dim)`, as the
examples and Hugging Face's Llama do: the owner of a pair sees the full sequence.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import (
    DTensor,
    Replicate,
    Shard,
    distribute_module,
    distribute_tensor,
)
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from planner.errors import PlannerError
from planner.plan import Plan
from planner.profiler.opgraph import linear_weight_orientation
from runtime.build import retie, tied_groups

SEQUENCE_DIM = 1  # (batch, sequence, features) activations, as every example model has


def _parent(name: str) -> str:
    return name.rpartition(".")[0]


def _in_unit(name: str, unit: str) -> bool:
    return name == unit or name.startswith(unit + ".")


def apply_tp(module: nn.Module, tp_mesh: DeviceMesh, tp_plan: Mapping[str, str], sequence_parallel: bool,
             units: list[str] | None = None, copy_outputs: Sequence[str] = (),
             feeds: Mapping[str, Sequence[str]] | None = None) -> None:
    """Shard `module` (a whole model or one stage of it) over `tp_mesh` as `tp_plan` says.

    `units` are the stage's units in execution order (needed for sequence parallelism only);
    `copy_outputs` the sharded modules whose output the model writes in place (the plan's
    `Stage.tp_copy_outputs`: `_copy_local_outputs`); `feeds` the plan's `Stage.tp_feeds`, the
    rowwise modules that read column-sharded features and the colwise modules those come from,
    by data flow. Without sequence parallelism they are the pairs: a colwise module listed keeps
    its output sharded and the rowwise one reads it so, wherever they sit (BERT's
    `intermediate.dense` and `output.dense`). Without `feeds`, and under sequence parallelism
    (whose gathers and scatters sit at a pair's parent), a pair is a colwise and a rowwise
    module under one parent (`_paired_owners`).
    """
    if not tp_plan or tp_mesh.size() == 1:
        return
    present = dict(module.named_modules())
    missing = sorted(n for n in tp_plan if n not in present)
    if missing:  # check_tp_plan refuses these before launch; a caller that skipped it hears it here
        raise PlannerError(f"tp_plan names modules this stage does not have: {missing[:5]}.",
                           "Name modules by their FQN from the model root (see check_tp_plan).")
    pairs = _paired_owners(tp_plan, units)
    linked = None if feeds is None or sequence_parallel else set(feeds) | {c for cs in feeds.values() for c in cs}
    if sequence_parallel:
        if units is None:
            raise PlannerError("Sequence parallelism needs the stage's units.", "Pass units= to apply_tp.")
        region = [u for u in units if u in present and any(_in_unit(n, u) for n in pairs | _explicit_sp(tp_plan))]
    else:
        region = []
    styles: dict[str, ParallelStyle] = {}
    moe_in_region = [b for b in _moe_blocks(present) if any(_in_unit(b, u) for u in region)]
    token_gathered: list[str] = []  # sharded alone inside an MoE block under SP: gather its tokens first
    for name, style in tp_plan.items():
        in_region = any(_in_unit(name, u) for u in region)
        paired = _parent(name) in pairs if linked is None else name in linked
        # An MoE block runs on this rank's tokens (`_moe_block_parameters`): a module it holds
        # sharded outside a pair (Qwen2-MoE's shared_expert_gate, rowwise) gathers every rank's
        # tokens, as a pair's owner does, and hands back its own tokens' outputs.
        alone_in_block = in_region and not paired and style in ("colwise", "rowwise") and \
            any(_in_unit(name, b) for b in moe_in_region)
        if alone_in_block:
            token_gathered.append(name)
        structural = style in ("colwise", "rowwise") and not isinstance(present[name], (nn.Linear, nn.Embedding))
        colwise, rowwise = (_StructuralColwise, _StructuralRowwise) if structural else (ColwiseParallel, RowwiseParallel)
        tokens = Shard(SEQUENCE_DIM)  # the token-sharded styles pick the dim by the output's rank
        if style == "colwise":
            # Paired: the owner hands it the full sequence (SP) or it is already replicated.
            if paired:
                styles[name] = colwise()
            elif alone_in_block:
                styles[name] = _TOKEN_SHARDED[colwise](output_layouts=tokens)
            else:
                styles[name] = colwise(output_layouts=Replicate())
        elif style == "rowwise":
            if paired:
                styles[name] = _TOKEN_SHARDED[rowwise](output_layouts=tokens) if in_region else rowwise()
            elif alone_in_block:
                styles[name] = _TOKEN_SHARDED[rowwise](input_layouts=Replicate(), output_layouts=tokens)
            else:
                styles[name] = rowwise(input_layouts=Replicate())
        elif style == "sequence_parallel":
            styles[name] = SequenceParallel(sequence_dim=SEQUENCE_DIM)
        elif style != "replicate":
            raise PlannerError(f"tp_plan style {style!r} for {name} is not runnable here.",
                               "Use colwise, rowwise, sequence_parallel or replicate.")
    moe_local = _moe_block_parameters(module, region, tp_plan, pairs) if region else []
    if region:
        styles.update(_implicit_sequence_parallel(present, region, tp_plan, pairs))
    tied = tied_groups(module)
    per_head = _per_head_parameters(present, pairs, tp_plan, tp_mesh.size())
    parallelize_module(module, tp_mesh, styles)
    for owner, names in per_head.items():
        _shard_per_head(present[owner], names, tp_mesh)
    retie(module, tied)  # each style registered a DTensor of its own: one again (runtime/build.py)
    sharded = [n for n, st in styles.items() if isinstance(st, (ColwiseParallel, RowwiseParallel))]
    if any(getattr(m, "inplace", False) is True for m in module.modules()):
        _copy_local_outputs(present, sharded)  # an in-place module may follow any of them
    else:
        _copy_local_outputs(present, sorted(set(sharded) & set(copy_outputs)))
    # Read by sum_partial_gradients. (torch types nn.Module.__setattr__ for tensors and modules only.)
    module._tp_partial_gradients = _sandwiched_parameters(module, present, tp_plan, pairs) + moe_local  # type: ignore[assignment]
    if region:
        for owner in sorted(pairs):
            if any(_in_unit(owner, u) for u in region):
                _gather_first_input(present[owner], tp_mesh)
        for name in token_gathered:  # before the style's own input hook, which takes it as replicated
            _gather_first_input(present[name], tp_mesh, prepend=True)
        local_blocks = sorted(moe_in_region)
        for block in local_blocks:  # its local tokens as a plain tensor (`_moe_block_parameters`)
            present[block].register_forward_pre_hook(_first_input_hook(_to_local), with_kwargs=True)
        module._sp_moe_blocks = local_blocks  # type: ignore[assignment]  # read by runtime/apply_ep.py
        _mark_region_boundaries(present, [u for u in units or () if u in present], set(region), tp_mesh)


def _per_head_parameters(present: dict, pairs: set[str], tp_plan: Mapping[str, str], tp: int) -> dict[str, list[str]]:
    """Per pair owner, its own parameters (not its children's) with a row per attention head:
    dim 0 is the head count of a colwise child (its output features over the owner's `head_dim`),
    as gpt-oss's `sinks`, a learned logit per query head that the attention appends to each
    head's scores. The colwise projections leave each rank its heads, so such a parameter must
    hold the same heads (`_shard_per_head`); replicated, its length would not match the local
    heads (seen: gpt-oss under tp2 failed at `torch.cat([attn_weights, sinks])`)."""
    found: dict[str, list[str]] = {}
    for owner in sorted(pairs):
        module = present[owner]
        head_dim = getattr(module, "head_dim", None)
        if not isinstance(head_dim, int) or head_dim <= 0:
            continue
        heads = set()
        for name, child in module.named_children():
            if tp_plan.get(f"{owner}.{name}" if owner else name) == "colwise" and hasattr(child, "weight"):
                width = child.weight.shape[0 if isinstance(child, nn.Linear) else _out_dim(child)]
                if width % head_dim == 0:
                    heads.add(width // head_dim)
        names = [n for n, p in module.named_parameters(recurse=False)
                 if p.dim() >= 1 and p.shape[0] in heads and p.shape[0] % tp == 0]
        if names:
            found[owner] = names
    return found


def _shard_per_head(module: nn.Module, names: list[str], mesh: DeviceMesh) -> None:
    """Shard `names` (`_per_head_parameters`) by rows over the TP mesh, and hand the module's
    forward this rank's rows as a plain tensor: the attention code mixes the parameter with the
    local activations, which a DTensor would refuse. The parameter stays a DTensor (the optimizer,
    FSDP2 and the checkpoint see one tensor of the whole shape); `to_local` is differentiable, so
    its gradient reaches this rank's rows whole (each head lives on one rank). Under FSDP2 the
    tensor swapped is the unsharded one FSDP registered for the forward; the forward hook puts back
    whatever was there."""
    for name in names:
        _shard_parameter(module, name, mesh, Shard(0), 0)
    held: dict[str, Any] = {}

    def to_local(mod, args):
        for name in names:
            held[name] = mod._parameters[name]
            mod._parameters[name] = held[name].to_local()

    def restore(mod, args, out):
        for name in names:
            mod._parameters[name] = held.pop(name)

    module.register_forward_pre_hook(to_local)
    module.register_forward_hook(restore)


def _sharded_weight_dim(module: nn.Module, style: str | None) -> int | None:
    """The dim of `module.weight` a style shards (None: kept whole): colwise the output features,
    rowwise the input features, of an embedding its rows (rowwise) or columns (colwise)."""
    if style not in ("colwise", "rowwise"):
        return None
    if isinstance(module, nn.Embedding):
        return 0 if style == "rowwise" else 1
    out = 0 if isinstance(module, nn.Linear) else _out_dim(module)
    return out if style == "colwise" else 1 - out


def _tie_problems(plan: Plan, model: nn.Module) -> list[str]:
    """The tied weights whose holders the plan shards along different dims (runtime/build.py `retie`);
    holders outside every unit, which the forward never calls, are left out."""
    styles = {name: style for stage in plan.stages for name, style in stage.tp_plan.items()}
    units = [u for stage in plan.stages for u in stage.units]
    modules = dict(model.named_modules())
    problems = []
    for group in tied_groups(model):
        dims = {}
        for name in group:
            owner, _, attr = name.rpartition(".")
            if owner in modules and attr == "weight" and any(_in_unit(owner, u) for u in units):
                dims[name] = _sharded_weight_dim(modules[owner], styles.get(owner))
        if len(set(dims.values())) > 1:
            problems.append("the tied weights " + ", ".join(f"{n} ({'whole' if d is None else f'dim {d} sharded'})"
                                                            for n, d in dims.items()) + " are sharded differently")
    return problems


def _copy_local_outputs(present: dict, names: list[str]) -> None:
    """A sharded module's local output is a view DTensor's `to_local` made inside a custom
    Function, and autograd forbids writing into such a view in place: a model with in-place
    modules (VGG's `ReLU(inplace=True)` after a colwise Linear) gets copies of every sharded
    output, other models of those the profile saw written (Falcon's `mlp_output +=
    attention_output`). A copy per call: the copy reads and writes the output once, which on a
    GPU is a sizeable share of a small projection's time, so it is made only where needed."""
    def copy(mod, args, out):
        return out.clone() if isinstance(out, torch.Tensor) and not isinstance(out, DTensor) else None

    for name in names:
        present[name].register_forward_hook(copy)


def _sandwiched_parameters(root: nn.Module, present: dict, tp_plan: Mapping[str, str], pairs: set[str]) -> list[str]:
    """FQNs of parameters inside a column/row pair that the plan does not shard (Qwen3's q_norm
    and k_norm, RMSNorms over each head of the colwise q and k projections).

    Between the colwise and the rowwise module every activation is split over the TP ranks (by
    heads or features), so such a parameter, replicated, sees only this rank's share: its
    gradient is the sum of the ranks' gradients (`sum_partial_gradients`). Which modules of the
    pair's owner run there is known only by running it: the owner may also hold modules that
    run before the colwise module or after the rowwise one and see the whole activation (torch's
    nn.TransformerEncoderLayer keeps its norms and attention beside linear1 and linear2). These
    are all listed here; at the first forward `_keep_sandwiched` drops those that ran outside,
    whose gradients are already whole."""
    styled = {name for name, style in tp_plan.items() if style in ("colwise", "rowwise")}
    found = []
    for owner in sorted(pairs):
        children = [(f"{owner}.{n}", m) for n, m in present[owner].named_modules() if n]
        inside = [(fqn, m) for fqn, m in children
                  if not any(_in_unit(fqn, s) for s in styled) and any(True for _ in m.parameters(recurse=False))]
        if inside:
            _keep_sandwiched(root, present, owner, tp_plan, inside)
            found += [f"{fqn}.{p}" for fqn, m in inside for p, _ in m.named_parameters(recurse=False)]
    return found


def _keep_sandwiched(root: nn.Module, present: dict, owner: str, tp_plan: Mapping[str, str], inside: list) -> None:
    """At the owner's first forward: keep in `root._tp_partial_gradients` the parameters of the
    modules of `inside` that ran after a colwise module with no rowwise one since, and before a
    rowwise module (q_norm between q_proj and o_proj); drop the others (a norm before the pair,
    or between one pair's rowwise module and the next pair's colwise one)."""
    sharded = [n for n in sorted(present) if n.startswith(owner + ".") and tp_plan.get(n) in ("colwise", "rowwise")]
    seen: list[str] = []
    handles: list[torch.utils.hooks.RemovableHandle] = []

    def note(name):
        def hook(mod, args):
            seen.append(name)
        return hook

    def between(at: int) -> bool:
        before = [tp_plan[n] for n in seen[:at] if n in sharded]
        return bool(before) and before[-1] == "colwise" and any(tp_plan.get(n) == "rowwise" for n in seen[at + 1:])

    def keep(mod, args, out):
        for handle in handles:
            handle.remove()
        outside = {f"{fqn}.{p}" for fqn, m in inside if fqn not in seen or not between(seen.index(fqn))
                   for p, _ in m.named_parameters(recurse=False)}
        root._tp_partial_gradients = [f for f in root._tp_partial_gradients if f not in outside]

    for name in [*sharded, *(fqn for fqn, _ in inside)]:
        handles.append(present[name].register_forward_pre_hook(note(name)))
    handles.append(present[owner].register_forward_hook(keep))


def sum_partial_gradients(modules: list[nn.Module], tp_group) -> None:
    """Sum over the TP group the gradients of the parameters `apply_tp` found inside a column/row
    pair (see `_sandwiched_parameters`). After backward, before clipping and the optimizer step.
    Under FSDP a gradient is this rank's shard of the dp group, the same index range on every TP
    rank, so summing the local shards is exact."""
    import torch.distributed as dist

    for module in modules:
        for fqn in getattr(module, "_tp_partial_gradients", ()):
            grad = module.get_parameter(fqn).grad
            if grad is not None:
                dist.all_reduce(grad.to_local() if isinstance(grad, DTensor) else grad, group=tp_group)


def check_tp_plan(plan: Plan, model: nn.Module) -> None:
    """Refuse, before launch, a tp_plan naming modules the model lacks, outside its stage, or of a kind
    the styles cannot shard (colwise/rowwise take nn.Linear, nn.Embedding and linears by structure,
    such as Hugging Face's Conv1D: `linear_weight_orientation`)."""
    modules = dict(model.named_modules())
    problems = []
    if not plan.layout.sequence_parallel and any(s == "sequence_parallel" for st in plan.stages for s in st.tp_plan.values()):
        problems.append("modules are styled `sequence_parallel` but layout.sequence_parallel is false")
    for k, stage in enumerate(plan.stages):
        for name, style in stage.tp_plan.items():
            if name not in modules:
                problems.append(f"stage {k}: {name!r} is not a module of the model")
            elif not any(_in_unit(name, u) for u in stage.units):
                problems.append(f"stage {k}: {name!r} is outside the stage's units")
            elif style in ("colwise", "rowwise") and not isinstance(modules[name], (nn.Linear, nn.Embedding)) \
                    and linear_weight_orientation(modules[name]) is None:
                problems.append(f"stage {k}: {name!r} is a {type(modules[name]).__name__}; {style} shards nn.Linear, "
                                "nn.Embedding and modules that multiply their input by their own 2-D weight only")
    if not problems:
        problems = _tie_problems(plan, model)
    if problems:
        raise PlannerError("The plan's tp_plan does not fit the model: " + "; ".join(problems[:5])
                           + (f" (and {len(problems) - 5} more)" if len(problems) > 5 else "") + ".",
                           "Name modules by their FQN from the model root, as `planner show` lists them; re-solve "
                           "the plan for this model.")


# torch's ColwiseParallel/RowwiseParallel refuse any module but nn.Linear and nn.Embedding
# (`_apply` dispatches on the class). These two keep their input/output handling and change only
# which weight dim they shard, so a linear by structure works whichever way it stores its weight:
# Hugging Face's Conv1D (GPT-2) keeps it [in, out] and computes `addmm(bias, x, weight)`. The
# orientation is asked of the module itself (`linear_weight_orientation`: one meta forward, the
# same test the profiler applies), not of the plan, whose styles are DTensor's names, nor of
# the weight's shape, which a square projection leaves undecided.
def _out_dim(module: nn.Module) -> int:
    """The weight dim holding output features: 1 for [in, out] (x @ W), 0 for [out, in] (x @ W^T)."""
    in_out = linear_weight_orientation(module)
    if in_out is None:
        raise PlannerError(f"{type(module).__name__} is not a linear by structure, so it cannot be sharded.",
                           "Style it `replicate` (check_tp_plan refuses such plans before launch).")
    return 1 if in_out else 0


def _shard_parameter(module: nn.Module, name: str, mesh: DeviceMesh, placement, src_data_rank) -> None:
    param = module._parameters[name]
    assert param is not None, f"{name} is a declared parameter of {type(module).__name__}"
    module.register_parameter(name, nn.Parameter(distribute_tensor(param, mesh, [placement], src_data_rank=src_data_rank),
                                                 requires_grad=param.requires_grad))


class _StructuralColwise(ColwiseParallel):
    """ColwiseParallel for a linear by structure: weight sharded on its output dim, bias Shard(0)."""

    def _partition_structural_fn(self, name, module, mesh):
        _shard_parameter(module, "weight", mesh, Shard(_out_dim(module)), self.src_data_rank)
        if module._parameters.get("bias") is not None:
            _shard_parameter(module, "bias", mesh, Shard(0), self.src_data_rank)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(module, device_mesh, self._partition_structural_fn,
                                 partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
                                 partial(self._prepare_output_fn, self.output_layouts, self.use_local_output))


class _StructuralRowwise(RowwiseParallel):
    """RowwiseParallel for a linear by structure: weight sharded on its input dim, bias replicated
    (DTensor adds it once to the partial sum, as for nn.Linear)."""

    def _partition_structural_fn(self, name, module, mesh):
        _shard_parameter(module, "weight", mesh, Shard(1 - _out_dim(module)), self.src_data_rank)
        if module._parameters.get("bias") is not None:
            _shard_parameter(module, "bias", mesh, Replicate(), self.src_data_rank)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        self.desired_input_layouts = (Shard(-1),)  # the input's features, as for nn.Linear
        return distribute_module(module, device_mesh, self._partition_structural_fn,
                                 partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
                                 partial(self._prepare_output_fn, self.output_layouts, self.use_local_output))


def _token_dim(x) -> int:
    """The dim of a sequence-parallel activation that holds the tokens: the sequence dim of a
    (batch, sequence, features) one, dim 0 of (tokens, features) (an MoE block flattens its tokens
    before its shared expert: Qwen2-MoE's; sharding dim 1 there would split the features)."""
    return 0 if x.ndim == 2 else SEQUENCE_DIM


class _TokenShardedOutput:
    """The output sharded along the tokens (`_token_dim`) rather than a fixed dim (ColwiseParallel's
    and RowwiseParallel's `_prepare_output_fn` are the same redistribute and `to_local`)."""

    @staticmethod
    def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
        return RowwiseParallel._prepare_output_fn((Shard(_token_dim(outputs)),), use_local_output, mod, outputs,
                                                  device_mesh)


class _TokenColwise(_TokenShardedOutput, ColwiseParallel):
    pass


class _TokenStructuralColwise(_TokenShardedOutput, _StructuralColwise):
    pass


class _TokenRowwise(_TokenShardedOutput, RowwiseParallel):
    pass


class _TokenStructuralRowwise(_TokenShardedOutput, _StructuralRowwise):
    pass


_TOKEN_SHARDED: dict[type, Any] = {ColwiseParallel: _TokenColwise, _StructuralColwise: _TokenStructuralColwise,
                  RowwiseParallel: _TokenRowwise, _StructuralRowwise: _TokenStructuralRowwise}
"""Each style with its output reduce-scattered (rowwise) or cut (colwise) along the tokens: a
pair's rowwise inside the sequence-parallel region, and a module sharded alone in an MoE block."""


def _paired_owners(plan: Mapping[str, str], units: list[str] | None = None) -> set[str]:
    """Modules whose children include both a colwise and a rowwise module (a Megatron sandwich).

    The owner must lie inside a unit: units that are themselves Linears or Embeddings (GPT's
    `head`, Llama's `embed` and `output`) are siblings under the root (or under a container such
    as Hugging Face's `transformer`), and a vocabulary-parallel embedding beside a sharded output
    head is not a sandwich: each gathers its own output."""
    styles_under: dict[str, set[str]] = {}
    for name, style in plan.items():
        styles_under.setdefault(_parent(name), set()).add(style)
    inside = (lambda owner: owner != "") if units is None else (lambda owner: any(_in_unit(owner, u) for u in units))
    return {owner for owner, styles in styles_under.items() if {"colwise", "rowwise"} <= styles and inside(owner)}


def _explicit_sp(plan: Mapping[str, str]) -> set[str]:
    return {n for n, s in plan.items() if s == "sequence_parallel"}


def _moe_blocks(present: dict) -> set[str]:
    """FQNs of the modules that call an experts module (its parent: planner/moe.py `find_experts`)."""
    from planner.moe import find_experts

    return {_parent(name) for name in find_experts(present[""])}


def _moe_block_parameters(module: nn.Module, region: list[str], plan: Mapping[str, str], pairs: set[str]) -> list[str]:
    """Under sequence parallelism, the parameters of an MoE block's modules (the router) that
    the plan leaves unsharded (unstyled or `replicate`) outside a column/row pair, its experts
    excepted.

    The block runs on this rank's tokens (its input stays sequence-sharded), but it flattens
    them to [T, D], whose dim 1 is features, so SequenceParallel (sequence dim 1) cannot wrap
    these modules. They run with plain replicated weights on the local tokens, which is exact
    for per-token maths, and their gradients are summed over the TP group after backward
    (`sum_partial_gradients`), as SequenceParallel's would be. The experts are expert
    parallelism's (runtime/apply_ep.py `apply_moe_sequence_parallel`)."""
    from planner.moe import find_experts

    present = dict(module.named_modules())
    skip = {name for name, style in plan.items() if style != "replicate"} | pairs | set(find_experts(module))
    found = []
    for block in sorted(b for b in _moe_blocks(present) if any(_in_unit(b, u) for u in region)):
        for name, mod in present.items():
            if _in_unit(name, block) and not any(_in_unit(name, c) for c in skip):
                found += [f"{name}.{p}" for p, _ in mod.named_parameters(recurse=False)]
    return found


def _implicit_sequence_parallel(present: dict, region: list[str], plan: Mapping[str, str], pairs: set[str]) -> dict:
    """SequenceParallel for every other parameter-owning module in the region (the norms), except
    inside an MoE block (`_moe_block_parameters`). Each hands back its local chunk, as the
    rowwise outputs do, so that the residual stream stays plain local tensors: Gemma 2 and 3
    norm the attention's and the MLP's outputs before adding them to the residual, and a
    DTensor there met a plain tensor in the add. (A pair's owner gathers a plain input as well:
    `_gather_first_input`.)"""
    covered = set(plan) | pairs | _moe_blocks(present)
    out = {}
    for name, mod in present.items():
        if not any(_in_unit(name, u) for u in region) or not any(True for _ in mod.parameters(recurse=False)):
            continue
        if any(_in_unit(name, c) for c in covered):
            continue
        out[name] = SequenceParallel(sequence_dim=SEQUENCE_DIM, use_local_output=True)
    return out


def _first_input_hook(convert):
    """A forward pre-hook applying `convert` to the module's first argument, positional or keyword."""
    def hook(mod, args, kwargs):
        if args:
            return (convert(args[0]), *args[1:]), kwargs
        name = next(iter(inspect.signature(mod.forward).parameters))
        if name in kwargs:
            kwargs = {**kwargs, name: convert(kwargs[name])}
        return args, kwargs
    return hook


def _to_local(x):
    """A sequence-sharded DTensor's local chunk (its backward puts the chunk's gradient back in place)."""
    return x.to_local() if isinstance(x, DTensor) else x


def _gather_first_input(owner: nn.Module, mesh: DeviceMesh, prepend: bool = False) -> None:
    """All-gather the sequence before a column/row pair. The result stays a Replicate DTensor
    (torchtitan does the same) so that backward sums the colwise input gradients as one
    Partial and reduce-scatters them once, rather than all-reducing each."""
    def convert(x):
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, mesh, (Shard(_token_dim(x)),), run_check=False)
        return x.redistribute(mesh, (Replicate(),))
    owner.register_forward_pre_hook(_first_input_hook(convert), with_kwargs=True, prepend=prepend)


def _mark_region_boundaries(present: dict, units: list[str], region: set[str], mesh: DeviceMesh) -> None:
    """Cut activations entering the region to this rank's sequence chunk; gather those leaving it.

    Going through DTensor keeps the gradients right: the cut's backward all-gathers the
    gradient (every rank's replicated producer needs all of it), the gather's backward cuts it.
    """
    tp_degree = mesh.size()

    def enter(x):
        if isinstance(x, DTensor):
            return x.redistribute(mesh, (Shard(SEQUENCE_DIM),)).to_local()
        if x.dim() <= SEQUENCE_DIM or x.shape[SEQUENCE_DIM] % tp_degree:
            raise PlannerError(f"Sequence parallelism splits dim {SEQUENCE_DIM} of a {tuple(x.shape)} activation "
                               f"over {tp_degree} ranks, which does not divide it.",
                               "Use a sequence length divisible by tp_degree, or turn sequence_parallel off.")
        full = DTensor.from_local(x, mesh, (Replicate(),), run_check=False)
        return full.redistribute(mesh, (Shard(SEQUENCE_DIM),)).to_local()

    def leave(x):
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, mesh, (Shard(SEQUENCE_DIM),), run_check=False)
        return x.redistribute(mesh, (Replicate(),)).to_local()

    for i, unit in enumerate(units):
        if unit not in region:
            continue
        if i == 0 or units[i - 1] not in region:
            present[unit].register_forward_pre_hook(_first_input_hook(enter), with_kwargs=True)
        if i == len(units) - 1 or units[i + 1] not in region:
            present[unit].register_forward_hook(lambda mod, args, out: _map_first(out, leave))


def _map_first(out, fn):
    """Apply `fn` to a unit's output tensor (or the first element of a tuple output)."""
    if isinstance(out, tuple):
        return (fn(out[0]), *out[1:])
    return fn(out)
