"""Context parallelism (planner/plan.py `Layout.cp_degree`): one sequence split over cp ranks,
attention computed across the split as all-gather CP (planner/cost/cp.py states the design and
its cost; Llama 3 paper, Dubey et al. 2024, section 3.3.2) or as ring attention (`Layout.cp_algorithm`,
runtime/cp_ring.py).

Why not torch's own. `torch.distributed.tensor.experimental.context_parallel` shards buffers
and swaps attention at the aten level, for the flash / memory-efficient / cuDNN SDPA kernels
only (`_context_parallel/_attention.py` registers handlers for
`aten._scaled_dot_product_{flash,efficient,cudnn}_attention`, all CUDA). On CPU, SDPA runs
`aten._scaled_dot_product_flash_attention_for_cpu` (or the math path), which it does not
handle, and gloo has none of the CUDA kernels. So this file writes the missing piece in the
same style, one level up: a `TorchFunctionMode` (`ContextParallel`) that intercepts
`F.scaled_dot_product_attention` while the model runs, so any SDPA kernel computes it.

**Layout** (torch's `_HeadTailLoadBalancer`, the cost model's causal load balancing): the
sequence of T tokens is cut into 2 cp chunks of c = T / (2 cp); rank j of a CP group holds
chunks j and 2 cp - 1 - j, concatenated (`local_positions`). Every rank of a group holds the
same samples (runtime/train.py `_local_batch` cuts them with `shard_batch`).

**Attention** (`ContextParallel._attention`): Q stays local; K and V are all-gathered over the
CP group with functional collectives' autograd all-gather (its backward reduce-scatters dK
and dV with a sum, so each rank receives the gradient every rank's queries sent its keys),
put back in sequence order (`restore_indices`), and SDPA runs on (local Q, whole K/V) with
the causal mask written in global positions: query at position p sees keys at positions
<= p (`causal_mask`). The two chunks of a rank are not contiguous, so no offset `tril` would
do. Grouped-query attention passes through (`enable_gqa`, or K/V already repeated by the
model). Accepted: `is_causal=True`, no mask (bidirectional attention), and an explicit mask
that is plain causal over the local tokens (bool `tril`, or an additive 0 / -inf one); any
other mask cannot be translated to the gathered keys and is refused.

**Ring** (`cp_algorithm = "ring"`, runtime/cp_ring.py): the same checks, then K/V blocks go around
the CP group with point-to-point sends, each overlapped with the attention on the block at hand,
partial results merged by log-sum-exp; nothing of the other ranks' K/V is kept for the backward.
Written by hand for the reason above (torch's ring wraps the CUDA SDPA kernels only); no dropout.

**Positions: the contract.** A model computes its tokens' positions itself (a learned
embedding of `arange(T)`, rotary tables of `arange(T)`, Hugging Face's
`arange(seq_len) + past_seen_tokens`); under CP it sees T / cp tokens and would number them
0..T/cp-1. While the mode is active, a call `torch.arange(n)` / `torch.arange(0, n)` /
`torch.arange(0, n, 1)` with integer arguments and n equal to the local sequence length
returns this rank's global positions instead (same dtype and device as arange would give).
torch's own CP shards precomputed position buffers (`buffers=` of `context_parallel`); the
models here compute positions on the fly, so the arange is where they can be reached without
editing the model. The positions of one sequence are contiguous even where a rank's share of
them is not, so a `torch.diff` along the last dim of a tensor holding this rank's positions
(plus a constant per row) is computed as if they were one run: Hugging Face reads a jump in
`position_ids` as the start of another packed document and would otherwise mask the rank's
second chunk off its first. Positions given as an input need no help (they are sliced with
the sequence). What the contract cannot handle: positions computed any other way (a Python
range, a precomputed table sliced `[:T]`: both give local positions silently); a scan along the
sequence (OPT's `cumsum` of its attention mask numbers its positions), which this mode refuses at
the first forward and the profile records so that the solver offers no CP
(planner/profiler/counters.py `sequence_scan`); an `arange` of the local length that is not a position (a model with another size
equal to T / cp would be miscomputed); attention not computed through
`F.scaled_dot_product_attention` (materialised scores would see local keys only), which the
root module's hook refuses after a forward without an SDPA call (`check_attention_seen`).

**When the mode is active** (`apply_cp`): forward hooks on every module enter it when the
outermost module's forward starts and leave it when that ends, so it covers the forward and
every recomputation of a checkpointed unit in the backward; the loss outside the model runs
without it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed import _functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh
from torch.overrides import TorchFunctionMode

from planner.errors import PlannerError
from planner.plan import Plan
from planner.profiler.counters import SEQUENCE_SCANS, is_plain_causal, sequence_length, sequence_scan
from runtime.cp_ring import Ring, ring_attention
from runtime.recompute import ATTENTION_NAMES

SEQUENCE_DIM = 1  # (batch, sequence, ...) inputs and targets, as the profiler records them
_KV_SEQUENCE_DIM = -2  # SDPA's (batch, heads, sequence, head_dim)


def load_balance_indices(seq_len: int, cp: int) -> torch.Tensor:
    """Sequence positions in CP rank order: rank j's T / cp tokens are entries [j T/cp, (j+1) T/cp),
    chunks j and 2 cp - 1 - j (the same order as torch's `_HeadTailLoadBalancer`)."""
    assert seq_len % (2 * cp) == 0, (seq_len, cp)  # check_cp refuses it before launch
    chunks = torch.arange(seq_len).view(2 * cp, seq_len // (2 * cp))
    heads = torch.arange(cp)
    return torch.stack([chunks[heads], chunks[2 * cp - 1 - heads]], dim=1).reshape(-1)


def restore_indices(seq_len: int, cp: int) -> torch.Tensor:
    """The inverse permutation: `gathered[restore_indices]` puts rank-ordered tokens in sequence order."""
    return torch.argsort(load_balance_indices(seq_len, cp))


def local_positions(seq_len: int, cp: int, cp_rank: int) -> torch.Tensor:
    """Global positions of CP rank `cp_rank`'s tokens, in the order it holds them (increasing)."""
    local = seq_len // cp
    return load_balance_indices(seq_len, cp)[cp_rank * local:(cp_rank + 1) * local]


def shard_sequence(x, seq_len: int, cp: int, cp_rank: int):
    """This CP rank's tokens of `x` when it is a tensor with the sequence (length `seq_len`) on dim 1;
    anything else unchanged (samples without a sequence: every rank of the group needs them whole)."""
    if not isinstance(x, torch.Tensor) or x.dim() < 2 or x.shape[SEQUENCE_DIM] != seq_len:
        return x
    return x.index_select(SEQUENCE_DIM, local_positions(seq_len, cp, cp_rank).to(x.device))


def shard_batch(inputs: tuple, targets, cp: int, cp_rank: int) -> tuple[tuple, object]:
    """A CP group's samples cut to CP rank `cp_rank`'s tokens: every input and target with the
    sequence on dim 1 (runtime/train.py `_local_batch`). The loss over them is the mean over this
    rank's tokens; every rank holds as many, so the dp average of the gradients is the gradient
    of the mean over all tokens."""
    seq_len = sequence_length(inputs)
    assert seq_len is not None, "check_cp refuses a model without a (batch, sequence) token input"
    return tuple(shard_sequence(x, seq_len, cp, cp_rank) for x in inputs), shard_sequence(targets, seq_len, cp, cp_rank)


def causal_mask(q_positions: torch.Tensor, seq_len: int) -> torch.Tensor:
    """(local queries, T keys) bool mask, True where attention is allowed: key position <= query position."""
    return q_positions[:, None] >= torch.arange(seq_len, device=q_positions.device)[None, :]


class ContextParallel(TorchFunctionMode):
    """Active while the model's modules run, in the forward and in recomputation (`apply_cp`): SDPA
    as all-gather or ring CP over `group`, `torch.arange` of the local length as global positions, diffs
    along positions as one run (module docstring). One per run."""

    def __init__(self, group: dist.ProcessGroup, seq_len: int, cp: int, cp_rank: int, device: torch.device,
                 algorithm: str = "all-gather") -> None:
        super().__init__()
        self.group = group
        """The CP group: cp consecutive data-parallel ranks holding the same samples (runtime/mesh.py `build_cp_mesh`)."""
        self.algorithm = algorithm
        """planner/plan.py `Layout.cp_algorithm`: "all-gather" or "ring" (module docstring)."""
        self.ring = Ring(group, cp_rank, cp)
        """The CP group as a ring (runtime/cp_ring.py), for the "ring" algorithm."""
        self.seq_len = seq_len
        """T, the whole sequence."""
        self.positions = local_positions(seq_len, cp, cp_rank).to(device)
        """Global positions of this rank's T / cp tokens."""
        self.restore = restore_indices(seq_len, cp).to(device)
        """Gathered (rank-ordered) tokens -> sequence order."""
        self.mask = causal_mask(self.positions, seq_len)
        """(T / cp, T) causal mask in global positions."""
        self.attention_calls = 0
        """SDPA calls intercepted so far (`check_attention_seen`)."""
        self.depth = 0
        """Module forwards running under the mode (`enter_module`): it is entered at the outermost."""

    def enter_module(self, module, args) -> None:
        """Forward pre-hook (`apply_cp`): enter the mode at the outermost module's forward."""
        if self.depth == 0:
            self.__enter__()
        self.depth += 1

    def exit_module(self, module, args, output) -> None:
        """Forward hook: leave the mode when the outermost module's forward ends. Under pipeline
        parallelism a stage stops its forward at the next stage's first unit (runtime/pp_split.py
        `StopStage`) while its replay mode (runtime/pp_flow.py `Flow`) is above this one on
        torch's function-mode stack: this mode then takes itself off the stack wherever it is
        (`_leave`), not whatever is on top, and a hook of a module stopped before its pre-hook
        ran cannot take the depth below zero."""
        self.depth = max(self.depth - 1, 0)
        if self.depth == 0:
            self._leave()

    def _leave(self) -> None:
        """Pop this mode from torch's function-mode stack, the modes above it kept in order."""
        above = []
        while torch._C._len_torch_function_stack():
            top = torch._C._pop_torch_function_stack()
            if top is self:
                break
            above.append(top)
        for mode in reversed(above):
            torch._C._push_on_torch_function_stack(mode)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            query = args[0] if args else kwargs["query"]
            if query.device.type == "meta":  # a pipeline stage inferring its shapes (runtime/apply_pp.py):
                return func(*args, **kwargs)  # the output has the local queries' shape, nothing to gather
            self.attention_calls += 1
            return self._attention(*args, **kwargs)
        if func is torch.arange and self._is_local_range(args, kwargs):
            dtype = kwargs.get("dtype") or torch.int64
            out = self.positions.to(dtype=dtype, device=kwargs.get("device") or self.positions.device)
            return out.requires_grad_(bool(kwargs.get("requires_grad", False)))
        if func in SEQUENCE_SCANS and not _on_meta(args):  # meta: a stage inferring its shapes
            where = sequence_scan(func, args, kwargs, len(self.positions))
            if where is not None:
                raise PlannerError(
                    f"Context parallelism cannot run this model: it scans along the sequence ({where}), which "
                    "each rank would run over its own tokens alone and train to other losses (positions counted "
                    "from an attention mask restart at 0 on every rank).",
                    "Run the plan with cp_degree 1 (a profile made with this planner records the scan, and "
                    "`planner solve` then offers no CP).")
        if func in (torch.diff, torch.Tensor.diff) and self._is_position_diff(args, kwargs):
            # Positions of one sequence are contiguous even where this rank's share is not: a diff
            # along them (Hugging Face's packed-sequence detection reads a jump as a new document)
            # sees the rank's tokens as one run.
            x = args[0]
            contiguous = x[..., :1] + torch.arange(x.shape[-1], dtype=x.dtype, device=x.device)
            return func(contiguous, *args[1:], **kwargs)
        return func(*args, **kwargs)

    def _is_position_diff(self, args: tuple, kwargs: dict) -> bool:
        """Whether a diff runs along the last dim of a tensor (..., T / cp) holding this rank's global
        positions plus a constant per row."""
        x = args[0]
        if not isinstance(x, torch.Tensor) or x.dim() == 0 or x.shape[-1] != len(self.positions) or x.is_floating_point():
            return False
        n = args[1] if len(args) > 1 else kwargs.get("n", 1)
        dim = args[2] if len(args) > 2 else kwargs.get("dim", -1)
        if n != 1 or dim not in (-1, x.dim() - 1):
            return False
        shift = self.positions.to(x.device) - self.positions[0]
        return bool((x - x[..., :1] == shift).all())

    def _is_local_range(self, args: tuple, kwargs: dict) -> bool:
        """arange(n), arange(0, n) or arange(0, n, 1) with integers and n the local sequence length."""
        if "out" in kwargs or "start" in kwargs or "end" in kwargs or "step" in kwargs:
            return False
        if not args or not all(isinstance(a, int) and not isinstance(a, bool) for a in args):
            return False
        start, end, step = (0, args[0], 1) if len(args) == 1 else (args[0], args[1], args[2] if len(args) == 3 else 1)
        return start == 0 and step == 1 and end == len(self.positions)

    def _attention(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                   enable_gqa=False):
        """SDPA of the local queries over the whole sequence's keys and values, gathered or passed around
        the ring (module docstring, Attention and Ring)."""
        if attn_mask is not None:
            if is_causal or not is_plain_causal(attn_mask):
                raise PlannerError(
                    "Context parallelism met an attention call with an explicit mask other than plain causal "
                    f"(shape {tuple(attn_mask.shape)}, dtype {attn_mask.dtype}): a mask over the local tokens cannot be "
                    "translated to the keys gathered from the other ranks.",
                    "Train without padding/packing masks (is_causal=True), or run the plan with cp_degree 1.")
            is_causal = True
        if query.shape[_KV_SEQUENCE_DIM] != len(self.positions) or key.shape[_KV_SEQUENCE_DIM] != len(self.positions):
            raise PlannerError(
                f"Context parallelism met an attention over {query.shape[_KV_SEQUENCE_DIM]} queries and "
                f"{key.shape[_KV_SEQUENCE_DIM]} keys; this rank holds {len(self.positions)} tokens of each sequence.",
                "Only self-attention over the model's input sequence can be split; run the plan with cp_degree 1.")
        if self.algorithm == "ring":
            if dropout_p > 0:
                raise PlannerError(f"Ring context parallelism met attention dropout {dropout_p}: the ring's hand-written "
                                   "attention applies none.", "Train with attention dropout 0, or set the plan's "
                                   "layout.cp_algorithm to 'all-gather'.")
            return ring_attention(query, key, value, self.ring, is_causal, scale, enable_gqa)
        keys, values = self._gather(key), self._gather(value)
        mask = self.mask if is_causal else None
        return F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, dropout_p=dropout_p, scale=scale,
                                              enable_gqa=enable_gqa)

    def _gather(self, x: torch.Tensor) -> torch.Tensor:
        """(b, h, T / cp, d) -> (b, h, T, d) in sequence order; backward: the reduce-scatter of the gradient.
        Gathered along dim 0 (the functional all-gather's fast path), the sequence moved there first."""
        tokens_first = x.movedim(_KV_SEQUENCE_DIM, 0).contiguous()
        gathered = funcol.all_gather_single_autograd(tokens_first, 0, self.group)
        return gathered.index_select(0, self.restore).movedim(0, _KV_SEQUENCE_DIM)


def _on_meta(args: tuple) -> bool:
    return bool(args) and isinstance(args[0], torch.Tensor) and args[0].device.type == "meta"


def apply_cp(model: nn.Module, cp_mesh: DeviceMesh, inputs: tuple, device: torch.device,
             algorithm: str = "all-gather", require_attention: bool = True) -> ContextParallel:
    """Context parallelism on `model` (a whole model, every other parallelism applied): the
    attention mode over the 1-D CP mesh `cp_mesh` (runtime/mesh.py `build_cp_mesh(...)["cp"]`),
    computing attention by `algorithm` (the plan's `layout.cp_algorithm`),
    for sequences as long as `inputs`' (a sample batch), made active by forward hooks on every
    module while the outermost one runs. Hooks, not a `with` around forward and backward: the
    autograd engine runs the backward with an empty torch-function mode stack, so the
    recomputation of a checkpointed unit (runtime/recompute.py) would replay the attention over
    local keys only; a unit's own hooks fire when it is replayed. The model's root also checks,
    after each forward, that attention went through SDPA (`check_attention_seen`)."""
    length = sequence_length(inputs)
    assert length is not None, "check_cp refuses, before launch, inputs that are not a (batch, sequence) token tensor"
    mode = ContextParallel(cp_mesh.get_group(), length, cp_mesh.size(), cp_mesh.get_local_rank(), device, algorithm)
    for module in model.modules():
        module.register_forward_pre_hook(mode.enter_module)
        # always_call: a recomputation stopped early (checkpoint's early stop raises) still leaves the mode.
        module.register_forward_hook(mode.exit_module, always_call=True)
    if require_attention:  # a pipeline stage without attention modules (only the head, say) has none to check
        model.register_forward_hook(lambda *_: check_attention_seen(mode))
    return mode


def has_attention_modules(model: nn.Module) -> bool:
    """Whether a pipeline stage's chunk holds an attention module (found by name, as
    runtime/recompute.py finds them, with parameters: the stubs of other stages' units have none),
    so that its forward must call SDPA (`check_attention_seen`)."""
    return any(name.rpartition(".")[2] in ATTENTION_NAMES and next(module.parameters(), None) is not None
               for name, module in model.named_modules())


def check_attention_seen(mode: ContextParallel) -> None:
    """After the first forward: a model whose attention bypasses SDPA would attend to local keys only."""
    if mode.attention_calls == 0:
        raise PlannerError(
            "Context parallelism found no call to torch.nn.functional.scaled_dot_product_attention in the model's "
            "forward: attention computed another way (materialised scores) would see only this rank's tokens.",
            "Compute attention with F.scaled_dot_product_attention (e.g. attention='sdpa' or "
            "attn_implementation='sdpa'), or run the plan with cp_degree 1.")


def check_cp(plan: Plan, inputs: tuple) -> None:
    """Before launch: the model's sequence splits into 2 cp chunks and the rest of the layout composes.
    `inputs` is a sample batch's inputs (the model file's make_batch)."""
    from planner.cost.cp import CP_PIPELINE_SCHEDULES, cp_refusal

    cp = plan.layout.cp_degree
    if cp == 1:
        return
    why = cp_refusal(sequence_length(inputs), cp)
    if why is not None:
        raise PlannerError(f"Cannot split the sequence over cp_degree {cp}: {why}.",
                           "Pick a cp_degree with 2 x cp dividing the sequence length (or change seq_len), or cp_degree 1.")
    if plan.layout.pp_degree > 1 and plan.layout.schedule not in CP_PIPELINE_SCHEDULES:
        raise PlannerError(
            f"cp_degree {cp} with pp_degree {plan.layout.pp_degree} runs under the schedules "
            f"{', '.join(CP_PIPELINE_SCHEDULES)}; got {plan.layout.schedule}.",
            f"Use one of {', '.join(CP_PIPELINE_SCHEDULES)}, or cp_degree 1.")
    length = sequence_length(inputs)
    assert length is not None, "cp_refusal refuses a missing sequence length"
    local, tp = length // cp, plan.layout.tp_degree
    if plan.layout.sequence_parallel and local % tp:
        raise PlannerError(f"Sequence parallelism splits each rank's {local} tokens (T / cp) over tp_degree {tp}, "
                           "which does not divide them.", "Pick cp and tp with cp x tp dividing the sequence length.")
