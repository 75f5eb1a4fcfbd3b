"""CUDA autocast's casts, applied where torch's autocast cannot act: on meta tensors.

Why this exists. This planner's runtime trains a 16-bit plan as `torch.autocast` does
(runtime/train.py `_autocast`): fp32 parameters, each forward under autocast to bf16/fp16. What
a GPU then keeps for backward is not what a model converted to 16 bits keeps: the residual
stream stays fp32 (it starts at fp32 embeddings and adds promote), norms and softmaxes run in
fp32, and every weight's 16-bit copy is saved for backward. On an H200 a GPT block kept 1.25x
the activations per sample of the 16-bit model plus its weights' 16-bit copies
(benchmarks/results/h200/README.md). An analytic profile traces the model on the meta device,
and autocast leaves meta tensors alone: its kernels cast only tensors of their own device
(`is_autocast_eligible` in aten/src/ATen/autocast_mode.h), and no autocast key exists for meta.
So `EmulatedAutocast` applies the same policy at the Python level, as a `TorchFunctionMode`:
each call of an op in autocast's lists has its floating tensor arguments cast first, and
autograd records the casts as it does under autocast, so the saved tensors, the memory traffic
of the casts and the dtypes of everything downstream come out as on the GPU.

The policy is CUDA's, from aten/src/ATen/autocast_mode.cpp (`TORCH_LIBRARY_IMPL(aten,
AutocastCUDA, m)`; the same lists as the "Autocast Op Reference" of torch.amp's documentation):
- `lower_precision_fp`: matrix products, convolutions, `linear`, `einsum`, `prelu`,
  `scaled_dot_product_attention`: floating arguments cast to the 16-bit type;
- `fp32`: pointwise transcendentals, `pow`, norms (`layer_norm`, `group_norm`), the losses:
  16-bit floating arguments cast to fp32;
- `fp32_set_opt_dtype` (`softmax`, `log_softmax`, `sum`, `prod`, `cumsum`, `cumprod`, vector and
  matrix norms): run with `dtype=float32` unless the caller gave a dtype;
- `promote`: floating arguments cast to the widest floating type among them.
Anything else runs on what it is given (GELU on a bf16 linear output stays bf16; an embedding
of fp32 weights gives fp32). Model code that turns autocast off for a block (`torch.autocast(
device_type=x.device.type, enabled=False)`, planner/meta_values.py `meta_autocast`) turns the
emulation off there too.

The cache is autocast's: a cast of an fp32 leaf that requires grad (a parameter) to the 16-bit
type is made once per region and reused (`cached_cast`); a region is one `EmulatedAutocast`
context, as one `torch.autocast` context is one forward of the runtime.

Where this is coarser than autocast: autocast acts on aten operators, so it also casts inside
composite Python functions; a function mode sees the call the model makes. Composites whose
parts autocast would cast are listed by what their parts do: `cross_entropy` (log_softmax and
nll_loss, fp32), `normalize` (norm, fp32), `multi_head_attention_forward` (linear and attention
products, 16-bit; its softmax would run in fp32 under autocast when weights are returned, and
here runs in 16 bits).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map

from planner.meta_values import autocast_disabled, leaves

LOWER = "lower_precision_fp"
FP32 = "fp32"
FP32_OPT_DTYPE = "fp32_set_opt_dtype"
PROMOTE = "promote"

T = torch.Tensor


def _table(lower, fp32, opt_dtype, promote) -> dict:
    return {**{f: LOWER for f in lower}, **{f: FP32 for f in fp32}, **{f: FP32_OPT_DTYPE for f in opt_dtype},
            **{f: PROMOTE for f in promote}}


_LOSSES = [F.poisson_nll_loss, F.cosine_embedding_loss, F.nll_loss, F.hinge_embedding_loss, F.kl_div, F.l1_loss,
           F.smooth_l1_loss, F.huber_loss, F.mse_loss, F.margin_ranking_loss, F.multilabel_margin_loss,
           F.soft_margin_loss, F.triplet_margin_loss, F.multi_margin_loss, F.binary_cross_entropy_with_logits,
           F.cross_entropy]
_PRODUCTS = [F.linear, torch.matmul, T.matmul, T.__matmul__, T.__rmatmul__, torch.mm, T.mm, torch.bmm, T.bmm,
             torch.baddbmm, T.baddbmm, torch.addmm, T.addmm, torch.addbmm, T.addbmm, torch.einsum,
             F.conv1d, F.conv2d, F.conv3d, F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d, F.conv_tbc,
             F.prelu, torch.prelu, F.scaled_dot_product_attention, F.multi_head_attention_forward]

CUDA_POLICY = _table(
    lower=[*_PRODUCTS, torch.mv, T.mv, torch.addmv, T.addmv, torch.addr, T.addr, torch.chain_matmul,
           torch.linalg.multi_dot],
    fp32=[torch.acos, T.acos, torch.asin, T.asin, torch.cosh, T.cosh, torch.erfinv, T.erfinv, torch.exp, T.exp,
          torch.expm1, T.expm1, torch.log, T.log, torch.log10, T.log10, torch.log2, T.log2, torch.log1p, T.log1p,
          torch.reciprocal, T.reciprocal, torch.rsqrt, T.rsqrt, torch.sinh, T.sinh, torch.tan, T.tan,
          torch.pow, T.pow, T.__pow__, T.__rpow__, F.softplus, F.layer_norm, torch.layer_norm, F.group_norm,
          torch.group_norm, F.cosine_similarity, torch.cosine_similarity, *_LOSSES, torch.dist, T.dist, F.pdist,
          torch.cdist, torch.renorm, T.renorm, torch.logsumexp, T.logsumexp, torch.norm, T.norm, F.normalize],
    opt_dtype=[torch.prod, T.prod, F.softmax, torch.softmax, T.softmax, F.log_softmax, torch.log_softmax,
               T.log_softmax, torch.cumprod, T.cumprod, torch.cumsum, T.cumsum, torch.linalg.vector_norm,
               torch.linalg.matrix_norm, torch.sum, T.sum],
    promote=[torch.addcdiv, T.addcdiv, torch.addcmul, T.addcmul, torch.atan2, T.atan2, F.bilinear, torch.cross,
             T.cross, torch.linalg.cross, torch.dot, T.dot, F.grid_sample, T.index_put, T.index_put_,
             torch.tensordot, torch.scatter_add, T.scatter_add],
)
"""Python entry point -> CUDA autocast policy (`TORCH_LIBRARY_IMPL(aten, AutocastCUDA, m)`)."""

CPU_POLICY = _table(
    lower=_PRODUCTS,
    fp32=[F.avg_pool3d, F.binary_cross_entropy, F.grid_sample, torch.polar, torch.prod, T.prod, torch.quantile,
          T.quantile, torch.nanquantile, T.nanquantile, torch.stft, T.stft, torch.cdist, torch.trace, T.trace,
          torch.view_as_complex, F.max_pool3d, F.max_unpool2d, F.max_unpool3d, F.adaptive_avg_pool3d,
          *_LOSSES, F.ctc_loss, torch.cholesky_inverse, torch.cholesky_solve, torch.inverse, T.inverse,
          torch.pinverse, torch.linalg.inv, torch.linalg.solve, torch.linalg.cholesky, torch.linalg.svd,
          torch.linalg.svdvals, torch.linalg.eig, torch.linalg.eigh, torch.linalg.eigvals, torch.linalg.eigvalsh,
          torch.linalg.qr, torch.linalg.lstsq, torch.linalg.cond, torch.linalg.matrix_rank, torch.fft.fft,
          torch.fft.ifft, torch.fft.fft2, torch.fft.ifft2, torch.fft.fftn, torch.fft.ifftn, torch.fft.rfft,
          torch.fft.irfft, torch.fft.rfft2, torch.fft.irfft2, torch.fft.rfftn, torch.fft.irfftn, torch.fft.hfft,
          torch.fft.ihfft],
    opt_dtype=[],
    promote=[torch.stack, torch.cat, torch.index_copy, T.index_copy],
)
"""The same for CPU autocast (`TORCH_LIBRARY_IMPL(aten, AutocastCPU, m)`): what a measured CPU
profile's meta trace applies, and what the tests hold the emulation to against torch's own."""

_SIXTEEN = (torch.bfloat16, torch.float16)


class EmulatedAutocast(TorchFunctionMode):
    """Autocast to `dtype` (bf16 or fp16) with `policy` (CUDA's or CPU's) on tensors of any device
    (module docstring). One context is one autocast region: weight casts are cached within it."""

    def __init__(self, dtype: torch.dtype, policy: dict = CUDA_POLICY):
        super().__init__()
        if dtype not in _SIXTEEN:
            raise ValueError(f"autocast casts to bfloat16 or float16, not {dtype}")
        self.dtype, self.policy = dtype, policy
        self._cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def __exit__(self, *exc):
        self._cache.clear()
        return super().__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        policy = None if autocast_disabled() else self.policy.get(func)
        if policy == LOWER:
            args, kwargs = tree_map(self._to_lower, (args, kwargs))
        elif policy == FP32:
            args, kwargs = tree_map(_to_fp32, (args, kwargs))
        elif policy == FP32_OPT_DTYPE:
            first = next((t for t in leaves(args) if isinstance(t, torch.Tensor)), None)
            if first is not None and first.dtype in _SIXTEEN and kwargs.get("dtype") is None:
                kwargs = {**kwargs, "dtype": torch.float32}
        elif policy == PROMOTE:
            floats = [t.dtype for t in leaves((args, kwargs)) if isinstance(t, torch.Tensor) and t.is_floating_point()]
            if len(set(floats)) > 1:  # widest: most bits, fp32 over a 16-bit type
                widest = max(floats, key=lambda d: torch.finfo(d).bits)
                args, kwargs = tree_map(lambda t: _cast(t, widest), (args, kwargs))
        return func(*args, **kwargs)

    def _to_lower(self, t):
        if not _eligible(t):
            return t
        if t.dtype == torch.float32 and t.is_leaf and t.requires_grad and t._base is None:
            held = self._cache.get(id(t))
            if held is None or held[0] is not t:  # ids are reused after a tensor dies; keep it alive with its cast
                held = self._cache[id(t)] = (t, t.to(self.dtype))
            return held[1]
        return t.to(self.dtype)


def _eligible(t) -> bool:
    """Autocast casts floating tensors other than float64 (`cached_cast`)."""
    return isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64


def _to_fp32(t):
    return t.to(torch.float32) if _eligible(t) and t.dtype in _SIXTEEN else t


def _cast(t, dtype):
    return t.to(dtype) if _eligible(t) and t.dtype != dtype else t
