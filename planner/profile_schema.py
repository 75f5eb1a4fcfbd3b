"""The profile file: everything the solver ever learns about a model.

`planner profile` writes it, `planner solve` reads it without importing torch. Measured and
analytic profiles share this one schema; `mode` says which produced it. Times are seconds,
sizes bytes, FLOPs counted as multiply-add = 2 FLOPs (torch's FlopCounterMode convention).
Per-micro-batch numbers are keyed by the micro-batch size (JSON keys are strings; pydantic
turns them back into ints).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from planner.errors import PlannerError

PROFILE_SCHEMA_VERSION = 1

OP_CHECKS = 2
"""Revision of what the op graphs record about how a unit uses each projection's output
(`OpNode.output_split_on_features`, `output_reduced_on_features`, `output_heads_fixed`,
`output_written_in_place`: 1 since 2026-11-26; 2, `output_heads_fixed` also for a view into
more than two dims, BLOOM's (heads, 3, head_dim)). A profile written before reads as an older
revision (0 before the field existed): its flags may be false where the model needs them, and
the solver refuses it tensor parallelism (planner/solver/solve.py `tp_refusal`) rather than
shard a fused or normalised projection."""


def collapsed_names(unused: list[str], used: list[str], noun: str = "modules") -> list[str]:
    """Uncalled modules (or their parameters) by their shallowest ancestor that holds no called
    unit, with how many it stands for: a text-only batch leaves a vision-language model's whole
    vision tower uncalled, `model.vision_tower (87 modules)` rather than its 87 names."""
    groups: dict[str, int] = {}
    for name in unused:
        parts = name.split(".")
        for depth in range(1, len(parts) + 1):
            prefix = ".".join(parts[:depth])
            if not any(u == prefix or u.startswith(prefix + ".") for u in used):
                groups[prefix] = groups.get(prefix, 0) + 1
                break
    return [f"{prefix} ({n} {noun})" if n > 1 else prefix for prefix, n in groups.items()]


class _Model(BaseModel):
    model_config = ConfigDict(use_attribute_docstrings=True, extra="forbid")


class UnitCosts(_Model):
    """One unit at one micro-batch size."""

    forward_time_s: float
    """Forward time: trimmed mean of timed repeats (measured; planner/profiler/measure.py) or the roofline sum over ops (analytic)."""
    backward_time_s: float
    """Backward time, same method, for gradients of inputs and parameters."""
    backward_input_time_s: float | None = None
    """Measured only: zero bubble's B on a stage after the first, the input gradients alone, timed
    with torch's `stage_backward_input` as the runtime runs it (planner/profiler/measure.py
    `UnitJob`). None: analytic, a unit none of whose inputs takes a gradient (it never runs
    split), or a profile written before it was recorded."""
    backward_weight_time_s: float | None = None
    """Measured only: zero bubble's W after that B, the weight gradients, timed with torch's
    `stage_backward_weight`. B + W may cost more than `backward_time_s`: on a CPU twice as much for
    a small transformer block, torch walking the autograd graph in Python and differentiating each
    parameter group in a call of its own (planner/cost/compute.py `split_backward`)."""
    forward_flops: int
    """Forward FLOPs (FlopCounterMode)."""
    backward_flops: int
    """Backward FLOPs (FlopCounterMode)."""
    forward_memory_traffic_bytes: int
    """Bytes read and written by the forward's kernels, unfused (roofline memory term)."""
    backward_memory_traffic_bytes: int
    """Bytes read and written by the backward's kernels, unfused."""
    input_bytes: int
    """Bytes of the activations the unit receives."""
    output_bytes: int
    """Bytes of the activations the unit returns."""
    saved_bytes: int
    """Bytes the forward keeps for backward (saved-tensor hooks; parameters excluded), its inputs
    requiring grad as in the model's own forward (planner/profiler/measure.py `_fresh_inputs`)."""
    stage_start_saved_bytes: int | None = None
    """`saved_bytes` where every floating input requires grad, as the first unit of a pipeline
    stage receives them (runtime/pp_p2p.py and torch's PipelineStage mark each so): more where an
    input made without grad (Hugging Face's rotary cos and sin) is then multiplied with one that
    has it. None: the same as `saved_bytes` (every floating input requires grad in the model too),
    or a profile written before it was recorded, whose `saved_bytes` were counted so."""
    saved_input_bytes: int | None = None
    """Of `saved_bytes`, the unit's own inputs (a convolution or an embedding keeps the tensor it
    was given): when the unit takes the batch, the batch already holds them (planner/solver/search.py
    `StageBuffers.batch_saved`). None in profiles written before it was recorded (read as 0)."""
    saved_output_bytes: int | None = None
    """Of `saved_bytes`, the unit's own outputs (an in-place ReLU keeps the tensor it returns):
    when the next unit keeps that tensor as its input, it is one tensor, not two
    (planner/solver/costs.py `UnitCostTable.boundary_saved`). None in profiles written before
    it was recorded (read as 0)."""
    peak_memory_bytes: int | None = None
    """Peak allocated memory above the baseline during forward+backward (CUDA only)."""
    backward_working_bytes: int | None = None
    """The most bytes the unit's backward holds at once beyond what it saved and the output
    gradient it is handed: the gradients flowing through it, their temporaries and its
    parameters' gradients as it makes them (planner/profiler/counters.py `LiveBytes`; on meta
    tensors, what the same code allocates on the target device). The memory model holds it at a
    stage's backward moment (planner/solver/search.py). For the last unit, its backward starts
    from the loss. Counted with no gradient held before (a step's first backward). None in
    profiles written before it was recorded (read as 0)."""
    backward_working_held_bytes: int | None = None
    """The same where the parameters' gradients are already held (a later micro-batch's backward,
    which adds into them): the peak without the new gradients' storages, which can come at
    another moment (`LiveBytes.peak_without`). None: not recorded (read as
    `backward_working_bytes`)."""
    fp8_saved_bytes: int | None = None
    """`saved_bytes` when the unit's linears run in FP8 as the runtime runs them (torchao's
    Float8Linear, compiled): each keeps its input in FP8, 1 byte per element, and no 16-bit copy
    of its input or weight (planner/profiler/measure.py `Float8Saves`). None: the unit has no
    linear torchao converts, or the profile predates this field; read `saved_bytes` then."""
    forward_attention_flops: int = 0
    """Of `forward_flops`, those of fused attention kernels (planner/profiler/counters.py
    `ATTENTION_OPS`), which run at their own rate (planner/hardware.py `attention_efficiency`)."""
    backward_attention_flops: int = 0
    """Of `backward_flops`, likewise."""
    forward_causal_attention_flops: int = 0
    """Of `forward_attention_flops`, those of kernels under a causal mask (`is_causal`), which skip
    the masked tiles (planner/hardware.py `GPUSpec.attention_time_s`). 0 in a profile that
    predates this field: its attention is priced unmasked."""
    backward_causal_attention_flops: int = 0
    """Of `backward_attention_flops`, likewise."""
    forward_convolution_flops: int = 0
    """Of `forward_flops`, those of convolutions (planner/profiler/counters.py `CONVOLUTION_OPS`),
    which run at their own rate in float32 (planner/hardware.py `achievable_convolution_flops`)."""
    backward_convolution_flops: int = 0
    """Of `backward_flops`, likewise."""


class OpNode(_Model):
    """A matmul-like op inside a unit, as the intra-op (tensor parallel) solver sees it."""

    name: str
    """Unique within the unit: the module path relative to the unit, or `kind_N` for functions."""
    kind: Literal["linear", "embedding", "matmul", "attention", "conv"]
    """What the op computes."""
    module: str | None = None
    """Module path relative to the unit (for ops that are modules), e.g. `attn.wq`."""
    weight_shape: list[int] | None = None
    """Parameter shape as stored (Linear: [out, in]; Embedding: [num, dim]; see `weight_in_out`)."""
    weight_in_out: bool = False
    """A `linear` whose weight is stored [in, out] and multiplied as `x @ weight` (Hugging Face's
    `Conv1D` in GPT-2: `addmm(bias, x, weight)`); false for nn.Linear's [out, in]."""
    fused_attention_input: bool = False
    """A `linear` whose one output feeds more than one of an attention's query, key and value
    (GPT-2's fused `c_attn`): its columns are [q | k | v], so a contiguous column shard is not
    whole heads and the solver keeps it replicated."""
    output_split_on_features: bool = False
    """A `linear` whose output its unit splits along the output features (Phi-3's and GLM's fused
    `gate_up_proj` chunked into gate and up, Mamba's `in_proj` into x and z): a contiguous column
    shard would give a rank part of each piece, not whole pieces, so the solver keeps it
    replicated (as `fused_attention_input`)."""
    output_reduced_on_features: bool = False
    """A `linear` whose output its unit reduces over the output features (OLMo 2's q_norm and
    k_norm, RMSNorms over all of q's features before the heads are split): each rank would
    normalise its own shard, so the solver never leaves it column-sharded. Also set where the
    reduced tensor combines several ops' outputs (BitNet's norm of act(gate) * up), and on an
    `attention` whose output the unit reduces over all heads' features (BitNet's attn_sub_norm):
    its heads are then never sharded."""
    output_heads_fixed: bool = False
    """A `linear` whose output its unit views into heads with the number of heads written out
    (OPT's `view(bsz, -1, num_heads, head_dim)`) rather than inferred (`view(b, s, -1, head_dim)`):
    column-sharded, the view would fold the rank's features into the sequence and train to other
    losses without an error, so the solver keeps it replicated."""
    output_heads: int | None = None
    """A `linear` whose output its unit views into heads with their number inferred
    (`view(b, s, -1, head_dim)`): that number (0: two views that disagree; None: no such view, or a
    profile from before this field). Each head's block of features is contiguous, so a column
    shard over tp ranks holds whole heads where tp divides it, whatever a head's block holds:
    DeepSeek-V3's kv_b_proj gives each head its k and v (256 features, not q's 192), so its
    head count is not its features over q's head dim."""
    output_written_in_place: bool = False
    """A `linear` or `embedding` whose output (or a view of it) its unit then writes in place
    (Falcon's `mlp_output += attention_output`). Sharded, the module hands back DTensor's local
    view, which autograd forbids writing, so the plan lists it in `Stage.tp_copy_outputs` and
    the runtime hands back a copy."""
    projections_inside: bool = False
    """An `attention` that makes its q, k, v and output projections itself, from parameters of its
    own inside one function (torch's nn.MultiheadAttention, through
    F.multi_head_attention_forward): the runtime cannot shard them, so it stays replicated, and
    under sequence parallelism it would see only its rank's tokens, so the unit gets none
    (planner/solver/intra_op.py `_sequence_parallel_blocked`)."""
    has_bias: bool = False
    """Whether the module has a bias."""
    input_shape: list[int]
    """Shape of the first input, at the smallest profiled micro-batch size."""
    output_shape: list[int]
    """Output shape, at the smallest profiled micro-batch size."""
    forward_flops: int
    """Forward FLOPs, at the smallest profiled micro-batch size."""
    inputs: list[str]
    """Ops whose outputs flow into this op's inputs (through non-matmul ops); `input` for the unit's input."""


class SavedRegion(_Model):
    """What a unit saves for backward that was computed from the same matmul-like ops: the part
    of its saved bytes a tensor-parallel layout splits or not (planner/solver/costs.py
    `split_saved_share`). A saved tensor made from the output of a column-sharded linear alone is
    split over the TP ranks; one that mixes in the unit's input (a residual stream) is whole."""

    ops: list[str]
    """The ops (`OpNode.name`, or `input` for the unit's input) its tensors were computed from:
    the tags of planner/profiler/opgraph.py, through every non-matmul op. Empty: made from
    neither (a constant)."""
    bytes: int
    """Bytes saved in this region, distinct storages, at the smallest profiled micro-batch size
    (as `OpNode` shapes are)."""


class MoECosts(_Model):
    """One MoE layer's experts at one micro-batch size, under balanced routing: the experts
    module run alone (planner/profiler/moe.py) on the tokens it received in the unit's forward,
    with a routing that sends every expert the same number of token copies (planner/moe.py
    `balanced_routing`), so each number is what the cost model's balanced case assumes. They are
    a part of the unit's `UnitCosts`, not an addition to them."""

    tokens: int
    """T, the tokens entering the layer in one micro-batch (the experts' `hidden_states` rows)."""
    expert_forward_flops: int
    """FLOPs of the experts' forward for T*top_k token copies (FlopCounterMode: multiply-add = 2).
    For SwiGLU experts, 3 matmuls of model_dim x expert_hidden_dim per copy: 6*D*F*T*k."""
    expert_backward_flops: int
    """FLOPs of the experts' backward (input, routing-weight and expert-weight gradients)."""
    expert_forward_time_s: float
    """Seconds of the unit's forward spent in the experts module: the experts alone, timed the way
    units are (trimmed mean of round-robin repeats, planner/profiler/measure.py) in measured
    profiles; the roofline sum over their ops on the target GPU in analytic ones."""
    expert_backward_time_s: float
    """Seconds of the experts' backward, same method."""
    expert_saved_bytes: int
    """Bytes the experts module saves for backward (saved-tensor hooks; parameters excluded)."""
    dispatch_bytes: int
    """Bytes of the token copies one all-to-all dispatch moves if every copy leaves its rank:
    T * top_k * model_dim * bytes per element of the hidden states. The combine moves as many."""


class MoELayer(_Model):
    """A mixture-of-experts layer inside a unit, recognised by structure and data flow
    (planner/moe.py). The unit's own totals (`num_parameters`, `costs`) include it; this record
    says which part of them is the experts'."""

    experts: str
    """Path of the experts module relative to the unit, e.g. `mlp.experts`: the module holding
    every expert's weights batched along a leading expert dim (planner/moe.py `find_experts`)."""
    router: str | None
    """Path relative to the unit of the router (gate) producing the per-expert logits [T, E] the
    experts' top_k_index comes from; None when no module qualifies (e.g. a router weight held by
    the layer itself)."""
    shared_experts: list[str] = []
    """Paths relative to the unit of the shared (always-on) experts: dense MLPs beside the experts
    whose output is added to theirs (DeepSeekMoE, Qwen2/3-MoE)."""
    num_experts: int
    """E, the number of routed experts."""
    top_k: int
    """k, experts per token (the last dim of the experts' top_k_index [T, k])."""
    model_dim: int
    """D, the width of the tokens entering the experts (hidden size)."""
    expert_hidden_dim: int
    """F, the width of one expert's intermediate layer (planner/moe.py `expert_hidden_dim`)."""
    expert_parameters: int
    """Parameters (elements) of all E experts together."""
    expert_parameter_bytes: int
    """Bytes of those parameters in the profiled dtype."""
    expert_trainable_parameter_bytes: int
    """Bytes (profiled dtype) of those that train (requires_grad as built)."""
    costs: dict[int, MoECosts]
    """The experts' costs per micro-batch size, like `Unit.costs`."""
    routing_spread: float | None = None
    """Measured profiles: max over experts of the token copies it received / the mean over experts,
    in the profiled forward at the largest micro-batch size (1.0 = perfectly balanced; the
    freshly initialised router's, not a trained one's). None in analytic profiles, whose routing
    is sampled (planner/meta_values.py)."""


class Unit(_Model):
    """A pipeline unit: a module where a stage may begin or end."""

    index: int
    """Position in execution order."""
    name: str
    """Fully qualified module name, e.g. `blocks.3`."""
    kind: str
    """Module class name."""
    fingerprint: str
    """Structural hash (classes, parameter shapes); identical blocks share it."""
    num_parameters: int
    """Parameters owned by the unit (shared parameters counted in the first unit using them)."""
    parameter_bytes: int
    """Bytes of those parameters in the profiled dtype."""
    trainable_parameter_bytes: int | None = None
    """Bytes (profiled dtype) of those parameters that train: requires_grad as the model file
    builds them. Only these hold gradients and optimizer state, and only their gradients are
    reduced over data parallelism; the rest (`parameter_bytes - trainable_parameter_bytes`, e.g. a
    LoRA model's frozen base weights) are held, gathered and sent like any weight but never
    updated. Absent in profiles written before it: read as `parameter_bytes` (all train)."""
    buffer_bytes: int = 0
    """Bytes of registered buffers."""
    costs: dict[int, UnitCosts]
    """Costs per micro-batch size."""
    ops: list[OpNode] = []
    """Matmul-like ops and their data flow, for the intra-op solver."""
    saved_regions: list[SavedRegion] | None = None
    """What the unit saves for backward, by the ops it was computed from. None in profiles
    written before 2026-11-28 (the cost model then splits all but its boundary copies)."""
    float_fed: bool | None = None
    """Whether the unit consumes a floating-point tensor (an embedding of token ids does not). A
    pipeline stage after the first holding a trained unit that does not runs its whole backward
    at once under zero bubble (runtime/pp_split.py `needs_full_backward`). None in profiles
    written before 2026-11-28: read as fed one."""
    moe: list[MoELayer] = []
    """The mixture-of-experts layers inside the unit, in the order of their experts modules;
    empty for a dense unit (and in profiles written before MoE layers were recorded)."""
    mixes_tokens: bool | None = None
    """Whether the unit moves information between tokens other than through attention (a token
    shift, a recurrence or convolution over the sequence; planner/profiler/token_mixing.py):
    sequence parallelism keeps such a unit whole and the model gets no context parallelism. Found
    by running the unit, in an analytic profile on a few tokens with weights of the probe's own;
    None where not known (units fed no (batch, sequence) activation, a unit whose weights the probe
    could not make, analytic profiles before 2026-11-30, any profile before 2026-11-29)."""

    @model_validator(mode="after")
    def _all_trainable_when_absent(self) -> Unit:
        if self.trainable_parameter_bytes is None:
            self.trainable_parameter_bytes = self.parameter_bytes
        return self


class CrossingTensor(_Model):
    """One tensor that crosses a cut: produced before it, consumed after it."""

    producer: str
    """The unit (or `input`, or `glue:after:<unit>`) that made it."""
    consumers: list[str]
    """Units after the cut that use it."""
    dtype: str
    """Element type."""
    shape: dict[int, list[int]]
    """Shape per micro-batch size."""
    bytes: dict[int, int]
    """Bytes per micro-batch size."""


class Cut(_Model):
    """The boundary after unit `after_index`: what a pipeline sends if it cuts here."""

    after_index: int
    """Cut between unit `after_index` and `after_index + 1`."""
    after: str
    """Name of the unit before the cut."""
    tensors: list[CrossingTensor]
    """Every tensor that crosses (skip connections included)."""
    bytes: dict[int, int]
    """Total crossing bytes per micro-batch size."""


class WholeModel(_Model):
    """One forward+backward of the whole model, against the sum of its units."""

    forward_backward_time_s: float
    """Time of model forward, loss and backward together."""
    sum_of_units_time_s: float
    """Sum over units of forward + backward time."""
    ratio: float
    """whole / sum of units: > 1 means the per-unit view misses work (glue, loss)."""


class ModelInfo(_Model):
    file: str
    """Path of the model file as given."""
    args: dict[str, int | float | bool | str | list | None]
    """Model arguments."""
    fingerprint: str
    """Structural hash of the whole model."""
    source_sha256: str
    """Hash of the model file's text."""
    num_parameters: int
    """All parameters, shared ones once."""
    parameter_bytes: int
    """All parameter bytes in the profiled dtype."""
    trainable_parameter_bytes: int | None = None
    """The trainable ones among them (the units' `trainable_parameter_bytes` summed); absent in
    profiles written before it: read as `parameter_bytes`."""
    sequence_length: int | None = None
    """Tokens per sample when the input is a (batch, sequence) token tensor."""
    input_bytes_per_sample: float | None = None
    """Bytes of one sample's inputs as the model file's make_batch returns them: a rank running
    the first stage holds its micro-batches' inputs through the step (runtime/train.py
    `_local_batch`). None in profiles written before it was recorded (counted as 0)."""
    target_bytes_per_sample: float | None = None
    """The same for the targets, which the rank running the last stage holds."""
    cp_obstacles: list[str] = []
    """What in the forward a sequence split over context-parallel ranks cannot follow, and where: a
    scan along the sequence (OPT counts its positions with a cumsum of its attention mask), an
    attention mask other than plain causal (a sliding window). The solver offers such a model no
    CP (planner/cost/cp.py `cp_refusal`). Empty in profiles written before it was recorded; the
    runtime refuses either under CP as well."""
    attention_calls: int | None = None
    """Calls to F.scaled_dot_product_attention in one forward, the attention context parallelism
    gathers keys for: 0 (attention computed as materialised scores, Gemma 2's softcapped eager
    attention) gets no CP. None where not counted (no token sequence; profiles written before)."""
    tied_parameters: list[list[str]] = []
    """Groups of units sharing a parameter (e.g. tied embeddings)."""
    root_parameters: list[str] = []
    """Parameters no unit holds, the model root's own (torchvision's ViT keeps its class token and
    position embedding so): no pipeline stage can own them (runtime/pp_split.py
    `check_splittable`), so the solver plans such a model with pp 1. Empty in profiles written
    before it was recorded (the runtime still refuses the pipeline)."""
    unsplit_units: list[list[str]] = []
    """Runs of units [first, last] that no pipeline cut may split: a tensor made where the tracer
    cannot see it (a `torch.vmap` result) is sent by the stage that first uses it
    (planner/units.py `joined_units`)."""

    @model_validator(mode="after")
    def _all_trainable_when_absent(self) -> ModelInfo:
        if self.trainable_parameter_bytes is None:
            self.trainable_parameter_bytes = self.parameter_bytes
        return self


class Profile(_Model):
    """A profile file."""

    schema_version: int = PROFILE_SCHEMA_VERSION
    """Bumped when a field changes meaning."""
    tool_version: str
    """planner version that wrote it."""
    created_at: str
    """ISO time."""
    mode: Literal["measured", "analytic"]
    """`measured` ran kernels; `analytic` used meta tensors and a GPU spec's roofline."""
    device: str
    """`cpu`, `cuda` or `meta`."""
    device_name: str
    """The processor or GPU model (analytic: `analytic:<gpu>`)."""
    target_gpu: str | None = None
    """GPU spec whose rates produced analytic times."""
    target_gpu_spec: dict[str, Any] | None = None
    """Analytic: that spec's every field (planner/hardware.py `GPUSpec`), so that a cluster whose
    GPU has the same rates prices with the profile's per-op times, and one with other rates (a
    cluster file's overrides) by roofline (planner/cost/compute.py). None: a profile written before
    2026-11-30, matched by its preset's name."""
    dtype: str
    """Parameter and activation dtype."""
    torch_version: str
    """torch.__version__ when profiled."""
    model: ModelInfo
    micro_batch_sizes: list[int]
    """Micro-batch sizes profiled."""
    units: list[Unit]
    cuts: list[Cut]
    """len(units) - 1 cuts, in order."""
    whole_model: dict[int, WholeModel] = {}
    """Whole-model check per micro-batch size (measured mode)."""
    fusion: Literal["none", "elementwise"] = "none"
    """How memory traffic counts kernels: `none`, each op its own (eager PyTorch); `elementwise`,
    pointwise and row-wise chains fused (torch.compile, Megatron-LM's fused kernels)."""
    precision: Literal["autocast", "pure"] | None = None
    """How a 16-bit profile computed (planner/profiler `mixed_precision`): `autocast`, fp32 weights
    with each forward under autocast, as `planner run` trains (on the meta device with CUDA's
    policy applied by planner/profiler/autocast.py); `pure`, the model converted to the 16-bit
    type, as Megatron-LM, DeepSpeed's bf16 and FSDP2's mixed precision compute. None for float32,
    and in profiles written before this was recorded, which were `pure` when analytic and
    `autocast` when measured on a GPU (`computes_as`)."""
    optimizer_step_s: float | None = None
    """One AdamW step over every parameter in fp32 (the runtime's master weights), measured on
    the device (measured mode); the cost model prices a rank's step as its share of it."""
    cpu_threads: int | None = Field(default=None, gt=0)
    """Measured on CPU: torch threads the times were measured with; a plan solved from this
    profile runs every process with as many."""
    notes: list[str] = []
    """Anything the profiler noticed (glue code, unused modules)."""
    op_checks: int = OP_CHECKS
    """`OP_CHECKS` of the profiler that wrote it (0: before the field existed)."""

    def analytic_gpu(self):
        """The GPUSpec an analytic profile's times were computed with (`target_gpu_spec`; a profile
        written before it was recorded: its preset's; None for a measured profile). Fields this
        version does not know are left out, ones it has that the file lacks take their defaults."""
        from dataclasses import fields

        from planner.hardware import GPUS, GPUSpec

        if self.mode != "analytic":
            return None
        if not self.target_gpu_spec:
            return GPUS.get(self.target_gpu or "h100-80gb")
        known = {f.name for f in fields(GPUSpec)}
        return GPUSpec(**{k: v for k, v in self.target_gpu_spec.items() if k in known})

    def computes_as(self) -> str | None:
        """`precision`, or for a profile that did not record it, what its profiler did."""
        if self.precision is not None or self.dtype == "float32":
            return self.precision
        return "pure" if self.mode == "analytic" else "autocast"

    def unit_names(self) -> list[str]:
        return [u.name for u in self.units]

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.model_dump_json(indent=1))
        return path


def load_profile(path: str | Path) -> Profile:
    """Read and validate a profile file; a corrupt or foreign file gets a clear error."""
    path = Path(path)
    if not path.is_file():
        raise PlannerError(f"Profile {path} does not exist.", "Create one with `planner profile MODEL_FILE`.")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise PlannerError(f"Profile {path} is not valid JSON ({exc}).", "Re-create it with `planner profile`.") from exc
    if not isinstance(data, dict) or "units" not in data:
        raise PlannerError(f"{path} is not a profile file (no `units`).", "Pass a file written by `planner profile`.")
    if data.get("schema_version") != PROFILE_SCHEMA_VERSION:
        raise PlannerError(
            f"Profile {path} has schema version {data.get('schema_version')}, this planner reads {PROFILE_SCHEMA_VERSION}.",
            "Re-create it with this version's `planner profile`.",
        )
    data.setdefault("op_checks", 0)  # written before the op graphs' output checks
    try:
        return Profile.model_validate(data)
    except ValidationError as exc:
        raise PlannerError(f"Profile {path} does not match the schema:\n{exc}", "Re-create it with `planner profile`.") from exc
