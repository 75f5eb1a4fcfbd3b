"""Memory per GPU: model states (parameters, gradients, optimizer) and activations.

Model states (Rajbhandari et al. 2020, "ZeRO", section 3.1): mixed-precision Adam keeps,
per parameter, 2 bytes of 16-bit weights, 2 bytes of 16-bit gradients and 12 bytes of
optimizer state (fp32 master weight, momentum, variance): 16 bytes. Plain float32 Adam keeps
4 + 4 + 8 = 16 bytes as well. ZeRO stage 1 divides the optimizer state by the data-parallel
degree, stage 2 also the gradients, stage 3 (FSDP) also the weights. Tensor parallelism
divides the states of the parameters it shards by the TP degree.

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
"""

from __future__ import annotations

from dataclasses import dataclass

# Korthikanti et al. 2022, section 4.1: five boundary-shaped 16-bit tensors (10·s·b·h bytes)
# of a transformer layer stay replicated under tensor parallelism without SP.
REPLICATED_BOUNDARY_COPIES = 5
# Bytes of model state per parameter for Adam: (weights, gradients, optimizer state).
STATE_BYTES = {
    "mixed": (2, 2, 12),  # 16-bit weights and grads; fp32 master, m, v
    "float32": (4, 4, 8),  # fp32 weights and grads; m, v
}


@dataclass(frozen=True)
class ModelStateBytes:
    weights: float
    """Parameter bytes held per GPU."""
    gradients: float
    """Gradient bytes held per GPU."""
    optimizer: float
    """Optimizer state bytes per GPU (master weights and Adam moments)."""

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer


def model_state_bytes(num_parameters: float, dtype: str, zero_stage: int, dp_degree: int) -> ModelStateBytes:
    """Model states of `num_parameters` (already divided by TP where sharded) on one GPU."""
    weights, grads, optimizer = STATE_BYTES["float32" if dtype == "float32" else "mixed"]
    n = num_parameters
    return ModelStateBytes(
        weights=n * weights / (dp_degree if zero_stage >= 3 else 1),
        gradients=n * grads / (dp_degree if zero_stage >= 2 else 1),
        optimizer=n * optimizer / (dp_degree if zero_stage >= 1 else 1),
    )


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
) -> ActivationBytes:
    """One unit's activation memory for one micro-batch (module docstring)."""
    t = tp_degree if sharded else 1
    sp = sequence_parallel and sharded
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
