"""Memory per GPU: model states (parameters, gradients, optimizer) and activations.

Model states (Rajbhandari et al. 2020, "ZeRO", section 3.1): mixed-precision Adam keeps,
per parameter, 2 bytes of 16-bit weights, 2 bytes of 16-bit gradients and 12 bytes of
optimizer state (fp32 master weight, momentum, variance): 16 bytes. Plain float32 Adam keeps
4 + 4 + 8 = 16 bytes as well. ZeRO stage 1 divides the optimizer state by the data-parallel
degree, stage 2 also the gradients, stage 3 (FSDP) also the weights. Tensor parallelism
divides the states of the parameters it shards by the TP degree. Which bytes are which depends
on the stack (`Precision`): the planner's runtime trains a 16-bit plan under autocast over
fp32 parameters (4 + 4 + 8), Megatron-LM in bf16 keeps an fp32 gradient buffer (2 + 4 + 12);
so ZeRO shards different amounts, and gathers and reductions move different bytes.

Activations of one unit for one micro-batch (Korthikanti et al. 2022, "Reducing Activation
Recomputation in Large Transformer Models", section 4). Their GPT layer keeps
s·b·h·(34 + 5·a·s/h) bytes: 10·s·b·h of it in tensors of the layer's boundary shape that
tensor parallelism replicates (the two LayerNorm inputs, the QKV and MLP inputs, two
dropout masks: five boundary-sized 16-bit tensors), 24·s·b·h inside the TP region, and
5·a·s²·b of attention scores. We take the profiled saved bytes A of the unit and its
output (boundary) bytes X and split the same way:

    replicated R = min(A, 5·X)         sharded  A - R (divided by t)
    none:       R + (A - R)/t          with sequence parallel: A/t
    selective:  as none, minus the attention-score bytes / t (they are recomputed)
    full:       the unit's input only (I, or I/t with SP); the recomputation briefly
                rebuilds one unit's activations (a transient, added once per stage)

On Korthikanti's own accounting (A = 34sbh + 5as²b, X = 2sbh) this gives exactly the
paper's Table 2: sbh(10 + 24/t + 5as/(ht)) with TP, sbh(34 + 5as/h)/t with TP+SP, 34sbh/t
with selective recomputation and SP, and 2sbh with full recomputation. A fused attention
kernel (scaled_dot_product_attention's flash / memory-efficient paths) keeps no scores, so
the profiled A of our examples has no 5as²b term and selective recomputation saves nothing
there, as it should. A unit the TP plan leaves replicated keeps all of A on every GPU.

A stage's peak (`stage_memory`) names every term. The bytes held at the moment of the peak are
the model states plus one of two phases, whichever is larger:

    forward/backward:  parameters + gradients held + optimizer state
                       + in-flight micro-batches x stored activations (less what is a view of
                         the batch: the first unit's saved inputs, `batch_views`)
                       + transient (full recomputation rebuilding one unit; with gradients
                         held, accumulation's fresh copy of the largest one, `accumulation_bytes`;
                         and the backward working set of the stage's largest: the gradients
                         flowing through a unit, their temporaries and its fresh parameter
                         gradients, measured per unit as the profile's
                         `backward_working_bytes`; its moment, a unit's backward, comes after
                         the loss is freed, so the stage holding the loss holds the larger of
                         the two; without it a pipeline's first stage was 4-10% under its
                         measured peak on CPU, the peak coming in a block's backward)
                       + communication (the pipeline's receive buffers, one per micro-batch
                         for the input activations and for the output gradients, as torch's
                         PipelineStage allocates them once and keeps them;
                         FSDP2's gathered parameters: ZeRO 3 two consecutive units' whole parameters and
                         one unit's unsharded gradients, ZeRO 1-2 the sharded copy beside the
                         gathered parameters; on a pipeline's last stage, with torch before 2.10,
                         the outputs its schedule keeps, m x the model output: `pipeline_keeps_outputs`)
    optimizer step:    parameters + gradients + optimizer state
                       + transient (AdamW's temporaries, `optimizer_transient_bytes`), or, if
                         larger, communication (ZeRO 0 with dp > 1: the flat bucket the gradients are
                         all-reduced in, runtime/apply_dp.py, one gradient-sized copy; the
                         receive buffers and kept outputs above; FSDP2 has resharded)
    both phases:       + batch (the rank's micro-batches' inputs on the first stage, their targets
                         on the last, loaded before the step and held to its end: `batch_bytes`)

Those are the planner's runtime's (torch.distributed.pipelining, FSDP2, torch.optim.AdamW with
foreach kernels). The search prices another engine's habits where they differ
(planner/solver/search.py `Environment`): a fused AdamW steps in place, with no temporaries
(Megatron-LM, DeepSpeed, torchtitan), and a pipeline that sends and receives one micro-batch
at a time (Megatron-LM, DeepSpeed) holds the outgoing activation and its gradient, not a
buffer per micro-batch.

The loss (`loss_bytes`), on the stage holding the model's last unit. Outside every unit, so
no unit's saved bytes count it, and for a language model's vocabulary it is large: the runtime
takes the model output to fp32 and the loss keeps, per micro-batch until its backward, the
fp32 log-softmax of it (a softmax cross-entropy is assumed: the loss of every example here and
of the language models people train); its backward then makes two more fp32 tensors of that
size (the gradient arriving at the log-softmax and the one it returns) while the model output
itself is still held (the runtime's reference to it, or torch's schedule's kept outputs):
N = output elements, in_flight x 4N + 8N + the output's own bytes, in_flight the losses
waiting for their backward (`loss_in_flight`). On one H200 this was the rest of the measured
peak: GPT-2-medium in bf16 at micro-batch 8, 14.28 GiB predicted without it against 19.71 GiB
measured, 19.65 GiB with it (benchmarks/results/h200/README.md).

Asynchronous pipelining (PipeDream-2BW, Narayanan et al. 2021, arXiv 2006.09503, section 3.1;
planner/plan.py `Schedule`) keeps a second version of each stage's trained weights, the one
the current batch runs on, beside the one the optimizer updates: `stashed_weight_bytes`, one
more copy of the weights as the stage holds them (16-bit under mixed precision, fp32 in
float32; sharded as the weights are under ZeRO 3). Frozen weights never change and need none.
`StageMemory.stashed_weights` names it; it is held in both phases.

Gradients are held at the activation peak only when some micro-batch's backward ran before the
last forward of the peak (as in 1F1B's steady state or gradient accumulation); zero_grad frees
them at the step's start, so with all forwards before the first backward (GPipe, 1F1B with m <=
in flight, one micro-batch without a pipeline: planner/cost/schedules.py `forwards_first`) the
activation peak has none. Fragmentation is
the caching allocator's loss above the tensors (PyTorch's allocator typically loses 5-10%):
`FRAGMENTATION_ALLOWANCE` of the tensor bytes on GPUs, none on CPU where the measured peak
counts tensors only. `StageMemory.tensor_bytes` (without it) is what a run's measured tensor
peak is held against; `total` (with it) is what must fit on the device.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Generic, TypeVar

import numpy as np

Amount = TypeVar("Amount", float, "np.ndarray")
"""A number of parameters or bytes, or an array of them: the state formulas are elementwise,
so the search prices every unit at once (planner/solver/search.py)."""

# Korthikanti et al. 2022, section 4.1: five boundary-shaped 16-bit tensors (10·s·b·h bytes)
# of a transformer layer stay replicated under tensor parallelism without SP.
REPLICATED_BOUNDARY_COPIES = 5
# Share of the tensor bytes the caching allocator loses to fragmentation (a stated allowance,
# the upper end of the 5-10% PyTorch's allocator typically loses on long runs).
FRAGMENTATION_ALLOWANCE = 0.10
DTYPE_SIZES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class Precision:
    """How a training stack holds and moves the model, in bytes per parameter element. Stacks
    that all "train in bf16" differ here, and the difference is memory and data-parallel traffic:

    - `param_bytes`: the weights the forward reads, which ZeRO 3 all-gathers and ZeRO 1-2 gather
      after the step. 4 for this planner's runtime (fp32 parameters, each forward under
      autocast: runtime/train.py `_autocast`; FSDP2 without a MixedPrecisionPolicy gathers them
      as stored) and for Accelerate's DDP (native AMP); 2 where the model is converted
      (Megatron-LM, DeepSpeed) or FSDP casts its gathers (`param_dtype`: torchtitan,
      llm-foundry).
    - `grad_bytes`: the gradients held unsharded until their reduction. 4 for Megatron-LM in
      bf16, which accumulates into an fp32 `main_grad` buffer (megatron/training/arguments.py
      sets `accumulate_allreduce_grads_in_fp32` for bf16 unless `--grad-reduce-in-bf16`;
      param_and_grad_buffer.py makes the buffer fp32).
    - `reduce_bytes`: each gradient element as the data-parallel reduction moves it. Megatron-LM
      reduces its buffer's dtype; FSDP2 casts to its `reduce_dtype` (torchtitan's
      `mixed_precision_reduce`, float32 by default), FSDP1 likewise (llm-foundry's PURE: bf16);
      DeepSpeed its `communication_data_type` (the model's dtype by default).
    - the optimizer state: Adam's fp32 moments (8), and an fp32 master copy (4) where the
      weights are 16-bit.

    Summed, 16 bytes a parameter in the usual cases and 18 for Megatron-LM's bf16; sharded
    differently by ZeRO (`model_state_bytes`)."""

    param_bytes: int
    grad_bytes: int
    reduce_bytes: int

    @property
    def optimizer_bytes(self) -> int:
        return 8 + (4 if self.param_bytes < 4 else 0)

    @property
    def state(self) -> tuple[int, int, int]:
        """(weights, gradients, optimizer state) bytes per parameter."""
        return self.param_bytes, self.grad_bytes, self.optimizer_bytes

    @classmethod
    def of(cls, dtype: "str | Precision", param: str | None = None, grad: str | None = None,
           reduce: str | None = None) -> "Precision":
        """A dtype's default (fp32 throughout; a 16-bit type for weights, gradients and their
        reduction, as the ZeRO paper counts it), or a stack's: `param`, `grad`, `reduce` name the
        dtypes that differ (each defaults to the one before it)."""
        if isinstance(dtype, Precision):
            return dtype
        if dtype not in DTYPE_SIZES or any(d is not None and d not in DTYPE_SIZES for d in (param, grad, reduce)):
            raise ValueError(f"unknown dtype among {dtype!r}, {param!r}, {grad!r}, {reduce!r}; "
                             f"use one of {', '.join(DTYPE_SIZES)}")
        param_bytes = DTYPE_SIZES[param or dtype]
        grad_bytes = DTYPE_SIZES[grad] if grad else param_bytes
        return cls(param_bytes, grad_bytes, DTYPE_SIZES[reduce] if reduce else grad_bytes)


GRAD_ACCUMULATION = ("autograd", "buffer", "fused")
"""How a stack adds one micro-batch's gradients to the step's (`accumulation_pass_bytes`)."""


def accumulation_pass_bytes(mode: str, precision: Precision, num_microbatches: int) -> float:
    """Bytes per trainable parameter (as the GPU holds it) that adding one micro-batch's gradients
    into the step's moves at memory bandwidth, averaged over the step's micro-batches: a pass on
    the compute stream that the profiled backward (each unit run from no gradient) does not hold.

    - "autograd": torch's AccumulateGrad keeps the first micro-batch's gradient as made and adds
      each later one in place (read the new, read and write the held: 3 x `grad_bytes`), so
      (m - 1) / m of a pass per micro-batch. The planner's runtime (DDP's and FSDP2's
      no-sync accumulation), Megatron-LM 2021's local DDP without contiguous buffers
      (megatron/model/distributed.py at SC21: `param.main_grad = param.grad`), DeepSpeed's
      fp16 and fp32 engines.
    - "buffer": a separate accumulator every micro-batch, the new gradient read in the weights'
      dtype, the buffer read and written in `grad_bytes`: Megatron-LM's `main_grad.add_(grad)`
      hook (param_and_grad_buffer.py; before 2022 megatron/model/distributed.py
      `_make_param_hook`) without gradient-accumulation fusion, DeepSpeed's BF16_Optimizer
      (bf16_optimizer.py `update_hp_grads` after each micro-batch's backward).
    - "fused": the weight-gradient GEMM accumulates into the buffer itself (Megatron-Core's
      `--gradient-accumulation-fusion`, on by default): no pass."""
    if mode not in GRAD_ACCUMULATION:
        raise ValueError(f"unknown gradient accumulation {mode!r}; use one of {', '.join(GRAD_ACCUMULATION)}")
    if mode == "fused" or num_microbatches < 1:
        return 0.0
    if mode == "buffer":
        return float(precision.param_bytes + 2 * precision.grad_bytes)
    return 3.0 * precision.grad_bytes * (num_microbatches - 1) / num_microbatches


# Bytes of model state per parameter for Adam: (weights, gradients, optimizer state).
STATE_BYTES = {
    "mixed": Precision.of("bfloat16").state,  # 16-bit weights and grads; fp32 master, m, v
    "float32": Precision.of("float32").state,  # fp32 weights and grads; m, v
}


@dataclass(frozen=True)
class ModelStateBytes(Generic[Amount]):
    weights: Amount
    """Parameter bytes held per GPU."""
    gradients: Amount
    """Gradient bytes held per GPU."""
    optimizer: Amount
    """Optimizer state bytes per GPU (master weights and Adam moments)."""

    @property
    def total(self) -> Amount:
        return self.weights + self.gradients + self.optimizer


def model_state_bytes(num_parameters: Amount, dtype: str | Precision, zero_stage: int,
                      dp_degree: int) -> ModelStateBytes[Amount]:
    """Model states of `num_parameters` (already divided by TP where sharded) on one GPU;
    `dtype`: the run's dtype (its default `Precision`) or the stack's `Precision`."""
    weights, grads, optimizer = Precision.of(dtype).state
    n = num_parameters
    return ModelStateBytes(
        weights=n * weights / (dp_degree if zero_stage >= 3 else 1),
        gradients=n * grads / (dp_degree if zero_stage >= 2 else 1),
        optimizer=n * optimizer / (dp_degree if zero_stage >= 1 else 1),
    )


TERMS = ("parameters", "gradients", "optimizer_state", "activations", "transient", "communication", "loss", "batch",
         "fragmentation")
"""`StageMemory.terms`' names, in order (PipeDream-2BW's plans add "stashed_weights")."""


@dataclass(frozen=True)
class ActivationBytes:
    stored: float
    """Bytes kept per micro-batch in flight until its backward."""
    transient: float
    """Extra bytes needed briefly (full recomputation rebuilding one unit's activations)."""


def unit_activation_bytes(
    saved_bytes: float,
    output_bytes: float,
    input_bytes: float,
    attention_score_bytes: float,
    tp_degree: int,
    sequence_parallel: bool,
    recompute: str,
    sharded: bool = True,
    split_share: float | None = None,
) -> ActivationBytes:
    """One unit's activation memory for one micro-batch (module docstring). `split_share`: the
    share of `saved_bytes` the TP layout splits, where the profile says which ops each saved
    tensor comes from (planner/solver/costs.py `split_saved_share`); None: all but
    `REPLICATED_BOUNDARY_COPIES` boundary-shaped tensors, a Megatron layer's split."""
    t = tp_degree if sharded else 1
    sp = sequence_parallel and sharded
    if split_share is not None:
        kept = saved_bytes * ((1 - split_share) + split_share / t)
    else:
        replicated = min(saved_bytes, REPLICATED_BOUNDARY_COPIES * output_bytes)
        inner = saved_bytes - replicated
        kept = replicated / (t if sp else 1) + inner / t
    if recompute == "none":
        return ActivationBytes(kept, 0.0)
    if recompute == "selective":
        return ActivationBytes(max(kept - attention_score_bytes / t, 0.0), 0.0)
    if recompute == "full":
        return ActivationBytes(input_bytes / (t if sp else 1), kept)
    raise ValueError(f"unknown recompute {recompute!r}; use none, selective or full")


def op_activation_bytes(kept_bytes: float, input_bytes: float, saved_outputs: float, tp_degree: int,
                        sequence_parallel: bool, sharded: bool = True) -> ActivationBytes:
    """A unit under op-level selective checkpointing (torchtitan's selective_ac_option "op"):
    its input (sharded over tp under SP) and the saved ops' outputs (`saved_outputs`, per GPU:
    planner/solver/costs.py `op_checkpoint_terms`) are kept, never more than without
    recomputation (`kept_bytes`, the "none" figure); what it does not keep is rebuilt for a while
    in its backward (transient)."""
    t = tp_degree if sharded and sequence_parallel else 1
    stored = min(input_bytes / t + saved_outputs, kept_bytes)
    return ActivationBytes(stored, max(kept_bytes - stored, 0.0))


def korthikanti_layer_bytes(s: int, b: int, h: int, a: int, t: int = 1, sp: bool = False, recompute: str = "none") -> float:
    """Table 2 of Korthikanti et al. 2022: activation bytes of one GPT layer (16-bit)."""
    sbh = s * b * h
    if recompute == "full":
        # Table 2 lists 2sbh; with SP the checkpointed layer input is itself sequence-sharded.
        return 2 * sbh / t if sp else 2 * sbh
    scores = 5 * a * s / h
    if recompute == "selective":
        return sbh * 34 / t if sp else sbh * (10 + 24 / t)
    return sbh * (34 + scores) / t if sp else sbh * (10 + 24 / t + scores / t)


LOSS_KERNELS = ("eager", "fused", "compiled")
"""How a stack computes the cross-entropy, for its memory (`loss_bytes`)."""


def loss_bytes(output_bytes: float, output_element_bytes: int, in_flight: float, kernel: str = "eager") -> float:
    """The loss's bytes at its peak on the last stage (module docstring, "The loss"):
    `output_bytes` of one micro-batch's model output in elements of `output_element_bytes`,
    `in_flight` micro-batches whose loss waits for its backward. `kernel` (`LOSS_KERNELS`):
    - "eager", as the planner's runtime runs it: the fp32 log-softmax kept, two fp32 tensors of
      its backward, and the output;
    - "fused": a fused cross-entropy that writes the gradient in place of the logits, so only the
      output itself is held (flash-attn's `CrossEntropyLoss(inplace_backward=True)`, which
      llm-foundry's `loss_fn: fused_crossentropy` runs; Megatron-LM's vocab-parallel
      cross-entropy, which turns its saved softmax into the gradient in place, on a logits
      shard of 1/tp);
    - "compiled": torch.compile's cross-entropy (torchtitan compiles its loss since 2025,
      components/loss.py `build_cross_entropy_loss`): inductor keeps the output and a log-sum-exp
      per row, and its backward makes the gradient in the output's dtype in fused kernels, the
      fp32 upcast and softmax never materialised: the output and its gradient, 2 x the output's
      bytes (measured on CPU at 4.2-4.8 bytes per logit for a bf16 output, against 14 eager:
      tests/test_memory_measured.py)."""
    if kernel not in LOSS_KERNELS:
        raise ValueError(f"loss kernel {kernel!r} is not one of {LOSS_KERNELS}")
    if kernel == "fused":
        return output_bytes
    if kernel == "compiled":
        return 2 * output_bytes
    elements = output_bytes / output_element_bytes
    return in_flight * 4 * elements + 8 * elements + output_bytes


def loss_in_flight(schedule: str, pp: int, num_microbatches: int) -> int:
    """Micro-batches whose loss waits for its backward on the last stage. GPipe runs every
    forward first (m); the other schedules run a last-stage micro-batch's backward right after
    its forward, the last chunk of an interleaved or zero-bubble rank included (its forwards
    come after the warm-up's, which are of earlier chunks): one. Without a pipeline the runtime
    runs each micro-batch's forward and backward in turn: one."""
    return num_microbatches if (schedule == "gpipe" and pp > 1) else 1


@dataclass(frozen=True)
class StageMemory:
    """One stage's (or pipeline rank's) peak bytes per GPU, term by term (module docstring)."""

    parameters: float
    """Parameter bytes held (after TP and ZeRO-3 sharding)."""
    gradients: float
    """Gradient bytes held at the peak (0 when the peak comes before any backward)."""
    optimizer_state: float
    """Optimizer state bytes (master weights and Adam moments, after ZeRO sharding)."""
    activations: float
    """In-flight micro-batches x stored activation bytes of one micro-batch (0 when the
    optimizer step's phase is the peak)."""
    transient: float
    """Bytes needed briefly at the peak: full recomputation rebuilding one unit's activations, or
    the optimizer step's temporaries when that phase is the peak."""
    communication: float
    """Communication buffers at the peak: pipeline receive buffers and kept outputs, FSDP's gathered
    parameters and unsharded gradients, or ZeRO 0's gradient bucket."""
    fragmentation: float
    """The allocator's stated allowance above the tensors (`FRAGMENTATION_ALLOWANCE`; 0 on CPU)."""
    stashed_weights: float = 0.0
    """PipeDream-2BW's second weight version (`stashed_weight_bytes`); 0 for synchronous schedules."""
    loss: float = 0.0
    """The loss's bytes on the last stage (`loss_bytes`; 0 elsewhere and in the optimizer step's phase)."""
    batch: float = 0.0
    """The rank's share of the step's batch (`batch_bytes`), held in both phases."""

    @property
    def tensor_bytes(self) -> float:
        """The tensors alone: what a run's measured tensor peak is held against."""
        return (self.parameters + self.gradients + self.optimizer_state + self.activations + self.transient
                + self.communication + self.stashed_weights + self.loss + self.batch)

    @property
    def total(self) -> float:
        """What must fit on the device: the tensors and the fragmentation allowance."""
        return self.tensor_bytes + self.fragmentation

    def terms(self) -> dict[str, int]:
        """Every term by name, in bytes (the plan's `Prediction.memory_terms_bytes` entry)."""
        terms = {name: int(round(getattr(self, name))) for name in TERMS}
        if self.stashed_weights:  # only asynchronous schedules hold it (older plans' terms unchanged)
            terms["stashed_weights"] = int(round(self.stashed_weights))
        return terms


def stage_memory(num_parameters: float, dtype: str | Precision, zero_stage: int, dp_degree: int, activation_bytes: float,
                 in_flight: float, transient_bytes: float = 0.0, p2p_bytes: float = 0.0,
                 largest_unit_parameters: float = 0.0, largest_unit_pair_parameters: float = 0.0,
                 kept_output_bytes: float = 0.0, largest_parameter: float = 0.0,
                 device: str = "gpu", stashed_parameters: float = 0.0, loss: float = 0.0,
                 forwards_first: bool = False, batch_bytes: float = 0.0, batch_views: float = 0.0,
                 accumulation: float = 0.0, pending_weight_gradients: float = 0.0,
                 last_unit_parameters: float | None = None, last_unit_pair_parameters: float = 0.0,
                 tied_parameters: float = 0.0, backward_working: float = 0.0,
                 backward_working_held: float | None = None) -> StageMemory:
    """Peak memory of one stage on one GPU (module docstring), every term named.

    `num_parameters`: per GPU after TP (tied copies included); `activation_bytes`: stored bytes
    of one micro-batch (`unit_activation_bytes(...).stored` summed over the stage's units);
    `in_flight`: peak micro-batches held (planner/cost/schedules.py `in_flight_microbatches`);
    `transient_bytes`: the largest `unit_activation_bytes(...).transient` of the stage;
    `p2p_bytes`: the pipeline's receive buffers the stage holds: torch's schedule keeps one per
    micro-batch for the stage's input activations (all but the first stage) and one for its
    output gradients (all but the last), m x (incoming + outgoing cut bytes) (`p2p_buffer_bytes`);
    `largest_unit_parameters`: the stage's largest unit (per GPU after TP), whose gradients FSDP
    holds unsharded before its reduce-scatter; `largest_unit_pair_parameters`: the largest sum
    of two consecutive units, gathered at once (a unit and the one FSDP prefetches);
    `kept_output_bytes`: pipeline outputs the schedule keeps to the step's
    end (torch's `return_outputs`, on the last stage: m x the model output's bytes);
    `largest_parameter`: elements of the stage's largest parameter tensor per GPU (the CPU
    optimizer's transient, `optimizer_transient_bytes`);
    `device`: "cpu" leaves the fragmentation allowance out and steps AdamW tensor by tensor;
    `stashed_parameters`: under PipeDream-2BW the trained parameters per GPU after TP whose
    older version the stage keeps (`stashed_weight_bytes`), 0 otherwise;
    `loss`: on the last stage, the loss's bytes (`loss_bytes`), held in the forward/backward phase;
    `forwards_first`: every forward of the activations' peak precedes the rank's first backward, so
    no gradient is held then (planner/cost/schedules.py `forwards_first`);
    `batch_bytes`: the rank's share of the step's batch (`batch_bytes`), held through both phases;
    `batch_views`: of the in-flight activations, the inputs the first unit saves where they are
    views of the batch, counted once, in `batch_bytes` (at most m micro-batches' of them);
    `accumulation`: gradient accumulation's transient (`accumulation_bytes`), where gradients are held;
    `pending_weight_gradients`: the output gradients zero bubble keeps for the weight passes waiting
    at the peak (planner/cost/schedules.py `PeakState.pending` x the stage's weight ops' output
    gradients of one micro-batch), counted with the activations;
    `last_unit_parameters`, `last_unit_pair_parameters`: under ZeRO 3, on the stage holding the
    loss, the last unit's parameters and its pair with the one FSDP prefetches before it: while
    the loss is held FSDP has gathered those only, and by the time it gathers the stage's largest
    pair the loss is freed, so the two are not summed (the larger moment is the peak);
    `tied_parameters`: under ZeRO 3, the stage's parameters of units sharing a weight, one FSDP
    group held through the backward (`gathered_bytes`; the other arguments then leave them out);
    `backward_working`: the largest backward working set of the stage's units, one micro-batch
    (`UnitCosts.backward_working_bytes`), counted as transient at a unit's backward, a moment
    apart from the loss's (the larger moment is the peak, as for ZeRO 3's gathered pairs);
    `backward_working_held`: the same where gradients are held (`backward_working_held_bytes`;
    None: `backward_working`).
    """
    states = model_state_bytes(num_parameters, dtype, zero_stage, dp_degree)
    gathered = gathered_bytes(num_parameters, largest_unit_parameters, largest_unit_pair_parameters, dtype, zero_stage,
                              dp_degree, tied_parameters=tied_parameters)
    working = backward_working if forwards_first or backward_working_held is None else backward_working_held
    if loss:
        with_loss = gathered
        if zero_stage >= 3 and last_unit_parameters is not None:
            with_loss = min(gathered_bytes(num_parameters, last_unit_parameters, last_unit_pair_parameters, dtype,
                                           zero_stage, dp_degree, tied_parameters=tied_parameters), gathered)
        if loss + with_loss >= gathered + working:
            gathered, working = with_loss, 0.0
        else:  # the peak comes at a unit's backward, with the largest pair, the loss freed
            loss = 0.0
    bucket = gradient_bucket_bytes(states.gradients, zero_stage, dp_degree)
    grads_at_peak = 0.0 if forwards_first else states.gradients
    communication = p2p_bytes + gathered + kept_output_bytes
    in_flight_bytes = in_flight * activation_bytes - batch_views + pending_weight_gradients
    transient_bytes = transient_bytes + (0.0 if forwards_first else accumulation) + working
    forward_backward = grads_at_peak + in_flight_bytes + transient_bytes + communication + loss
    # The bucket is copied back and freed before the optimizer runs: the larger of the two.
    shards = dp_degree if zero_stage >= 1 else 1
    step_transient = optimizer_transient_bytes(num_parameters / shards, largest_parameter / shards, device)
    step_extra = max(bucket, step_transient)
    # FSDP has resharded after the last backward: no gathered parameters in this phase.
    optimizer_step = states.gradients + step_extra + p2p_bytes + kept_output_bytes
    if forward_backward >= optimizer_step:
        gradients, activations, transient = grads_at_peak, in_flight_bytes, transient_bytes
    else:
        gradients, activations, loss = states.gradients, 0.0, 0.0
        transient = step_transient if step_transient >= bucket else 0.0
        communication = (bucket if bucket > step_transient else 0.0) + p2p_bytes + kept_output_bytes
    stashed = stashed_weight_bytes(stashed_parameters, dtype, zero_stage, dp_degree)
    tensors = (states.weights + states.optimizer + gradients + activations + transient + communication + stashed + loss
               + batch_bytes)
    return StageMemory(parameters=states.weights, gradients=gradients, optimizer_state=states.optimizer,
                       activations=activations, transient=transient, communication=communication,
                       fragmentation=0.0 if device == "cpu" else FRAGMENTATION_ALLOWANCE * tensors,
                       stashed_weights=stashed, loss=loss, batch=batch_bytes)


@dataclass(frozen=True)
class LiveParameters:
    """What DeepSpeed's ZeRO 3 holds gathered, in elements per GPU (deepspeed/runtime/zero/
    config.py, defaults; partitioned_param_coordinator.py). It gathers each submodule's own
    parameters as the submodule runs, prefetching the next ones up to `prefetch`
    (stage3_prefetch_bucket_size), and releases them after use unless fewer than `max_live`
    (stage3_max_live_parameters) are resident; gradients are copied into a reduce bucket of
    `reduce_bucket` elements (reduce_bucket_size) and reduce-scattered when it fills. So it never
    holds two whole units as FSDP does: at least the largest parameter (its submodule runs with it
    whole) and the prefetch, at most `max_live` beyond that, and the largest parameter's gradient
    beside the bucket."""

    max_live: float = 1e9
    prefetch: float = 5e7
    reduce_bucket: float = 5e8


def gathered_bytes(num_parameters: Amount, largest_unit_parameters: Amount, largest_unit_pair_parameters: Amount,
                   dtype: str | Precision, zero_stage: int, dp_degree: int, offload: bool = False,
                   tied_parameters: Amount | float = 0.0, copy_out: bool = True,
                   live: LiveParameters | None = None, largest_parameter: Amount | float = 0.0) -> Amount:
    """FSDP2's gathered parameters beside a stage's sharded model states, per GPU, held through
    forward and backward (the runtime runs ZeRO 1-3 as FSDP2 when dp > 1; elementwise, so the
    search passes arrays of stage ranges):

    - ZeRO 3: two consecutive units' whole parameters (a unit and the one FSDP prefetches), the
      largest pair of the stage (`largest_unit_pair_parameters`, 0 for a one-unit stage), or, if
      more, two copies of the largest unit: FSDP2 all-gathers a unit into one flat buffer and
      copies it out into the unit's parameters before freeing it (torch 2.13
      `foreach_all_gather_copy_out`); and one unit's unsharded gradients before its
      reduce-scatter (the largest unit). A unit with experts is two FSDP groups, the experts
      sharded on their own (runtime/apply_dp.py): the search passes the largest group as the
      largest unit, and as a pair a unit whole with the unit before it less its experts, which
      is what FSDP has prefetched while the experts' backward runs (measured on a two-layer
      Mixtral under ZeRO 3 on CPU: the peak came in layer 1's experts' backward, holding layer 1
      whole and layer 0's attention, and the experts' gradients). Units sharing a weight (a tied
      embedding and output head in one stage) are one FSDP group, gathered from the backward of
      the last of them to that of the first, with its gradients: `tied_parameters` (their
      parameters in the stage, copies included) are held whole throughout, beside the pairs, and
      twice while FSDP copies the group out of its all-gather buffer (measured on BERT, whose
      tied embeddings and MLM head stay gathered through its encoder's backward). A tie split
      over stages leaves each unit a group of its own. Where the gathered parameters are views
      of the all-gather's buffer (`copy_out` False: FSDP1's flat parameters, DeepSpeed) there is
      no second copy of a unit. DeepSpeed's ZeRO 3 (`live`) holds what `LiveParameters` says,
      never more than the above: `largest_parameter` is the range's largest parameter tensor.
    - ZeRO 1-2: the gathered parameters are `parameters` (runtime/train.py reshards after the
      last backward); FSDP2 keeps the sharded copy beside them, 1/dp of the weights. With
      offload that copy is on the host.

    Parameters are per GPU after TP."""
    weight_bytes, grad_bytes, _ = Precision.of(dtype).state
    if zero_stage == 0 or dp_degree <= 1:
        return 0.0 * num_parameters
    if zero_stage >= 3:
        copies = 2 if copy_out else 1
        weights = np.maximum(np.maximum(largest_unit_pair_parameters, copies * largest_unit_parameters) + tied_parameters,
                             copies * tied_parameters)
        grads = largest_unit_parameters + tied_parameters
        if live is not None:
            weights = np.minimum(weights, np.maximum(largest_parameter + live.prefetch, live.max_live))
            grads = np.minimum(grads, largest_parameter + live.reduce_bucket)
        return weight_bytes * weights + grad_bytes * grads
    return 0.0 * num_parameters if offload else weight_bytes * num_parameters / dp_degree


def gradient_bucket_bytes(gradient_bytes: Amount, zero_stage: int, dp_degree: int) -> Amount:
    """ZeRO 0's flat all-reduce bucket (runtime/apply_dp.py): one copy of the stage's gradients,
    held in the optimizer step's phase when dp > 1."""
    return gradient_bytes if zero_stage == 0 and dp_degree > 1 else 0.0 * gradient_bytes


def kept_output_bytes(num_microbatches: int, output_bytes: float, pp_degree: int) -> float:
    """The outputs torch's pipeline schedule keeps to the step's end on the last stage where it
    keeps them (`pipeline_keeps_outputs`): one model output per micro-batch; none without a pipeline."""
    return num_microbatches * output_bytes if pp_degree > 1 else 0.0


def accumulation_bytes(largest_trained_parameter: Amount, dtype: str | Precision) -> Amount:
    """The transient of gradient accumulation: a later micro-batch's backward makes each
    parameter's gradient anew and adds it to the one held (autograd's AccumulateGrad), so for a
    moment the largest trained parameter's gradient is there twice (`largest_trained_parameter`:
    its elements per GPU). Measured on examples/resnet.py's ResNet-18 on CPU: +140 KiB with the
    gradients held against none, its largest weight's gradient 144 KiB. Without ZeRO or with
    ZeRO 1 only: under ZeRO 2-3 FSDP2 reduce-scatters each unit's fresh gradients instead
    (`gathered_bytes` holds them)."""
    return largest_trained_parameter * Precision.of(dtype).grad_bytes


def batch_bytes(num_microbatches: int, input_bytes: float, target_bytes: float, first, last) -> np.ndarray:
    """A rank's share of the step's batch, loaded before its first forward and held to the step's
    end (runtime/train.py `_train_step`): its micro-batches' inputs where it runs the first stage,
    their targets where it runs the last (`first`, `last`: booleans, or arrays of them)."""
    return num_microbatches * (np.where(first, input_bytes, 0.0) + np.where(last, target_bytes, 0.0))


@lru_cache(maxsize=1)
def pipeline_keeps_outputs() -> bool:
    """Whether the installed torch's pipeline schedules keep the last stage's outputs to the
    step's end. Before torch 2.10 they always did (pytorch/pytorch#159251); since then `step`
    takes `return_outputs` (pytorch/pytorch#165822), which the runtime sets False
    (runtime/apply_pp.py). Read from the package's version, without importing torch."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        found = re.match(r"(\d+)\.(\d+)", version("torch"))
    except PackageNotFoundError:
        return False
    return found is not None and (int(found.group(1)), int(found.group(2))) < (2, 10)


def stashed_weight_bytes(num_parameters: Amount, dtype: str | Precision, zero_stage: int, dp_degree: int) -> Amount:
    """PipeDream-2BW's second weight version of `num_parameters` trained parameters (after TP) on one
    GPU: one more copy of the weights as held (`ModelStateBytes.weights`: 16-bit under mixed
    precision, sharded over dp under ZeRO 3). Narayanan et al. 2021, arXiv 2006.09503, section 3.1:
    2BW double-buffers the weights (two versions per stage); the optimizer state is not duplicated."""
    return model_state_bytes(num_parameters, dtype, zero_stage, dp_degree).weights


def p2p_buffer_bytes(num_microbatches: int, incoming_cut_bytes: Amount, outgoing_cut_bytes: Amount) -> Amount:
    """Receive buffers of one pipeline stage: torch.distributed.pipelining's PipelineStage makes one
    per micro-batch for its input activations (`_setup_forward_recv_info`) and one for its output
    gradients (`_create_grad_recv_info` per micro-batch) and keeps them across steps. Pass 0 for
    the cut the stage lacks (the first stage's input, the last stage's output)."""
    return num_microbatches * (incoming_cut_bytes + outgoing_cut_bytes)


def optimizer_transient_bytes(updated_parameters: Amount, largest_parameter: Amount, device: str = "gpu") -> Amount:
    """Temporaries of one AdamW step (torch.optim.AdamW, fp32 state) over `updated_parameters`,
    the parameters the rank steps (after ZeRO), the largest of them `largest_parameter` elements
    (after ZeRO: FSDP2 shards every parameter). On GPUs torch steps all parameters at once
    (foreach): `_foreach_sqrt` of the second moments is one fp32 copy of them. On CPU it steps
    tensor by tensor: `exp_avg_sq.sqrt() / c` holds two temporaries of the largest at once."""
    if device == "cpu":
        return 2 * 4 * largest_parameter + 0.0 * updated_parameters
    return 4 * updated_parameters
