"""Units that move information between tokens outside fused attention (planner/profiler/opgraph.py
`mixes_tokens_outside_attention`): the probe on small modules, and what the solver does with it
on the Hugging Face models that have such units (RWKV's token shift, RecurrentGemma's recurrence):
sequence parallelism keeps them whole, and context parallelism is refused."""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from planner.errors import PlannerError
from planner.profiler.opgraph import mixes_tokens_outside_attention

SEQ = 8


class _Attention(nn.Module):
    """Per-token projections around fused causal attention: tokens meet only inside SDPA."""

    def __init__(self, width: int = 16, heads: int = 4):
        super().__init__()
        self.heads, self.qkv, self.out = heads, nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.norm, self.mlp = nn.LayerNorm(width), nn.Sequential(nn.Linear(width, 32), nn.GELU(), nn.Linear(32, width))

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, s, 3, self.heads, d // self.heads).transpose(1, 3).unbind(2)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, d)
        x = x + F.dropout(self.out(attended), 0.1, training=self.training)
        return x + self.mlp(x)


class _TokenShift(nn.Module):
    """RWKV's time mix in small: each token mixed with the one before it, after a norm over the
    features, through an output projection initialised to zero (as RWKV's are)."""

    def __init__(self, width: int = 16):
        super().__init__()
        self.norm, self.mix, self.out = nn.LayerNorm(width), nn.Parameter(torch.full((width,), 0.5)), nn.Linear(width, width)
        nn.init.zeros_(self.out.weight)

    def forward(self, x):
        h = self.norm(x)
        shifted = F.pad(h, (0, 0, 1, -1))
        return x + self.out(h * self.mix + shifted * (1 - self.mix))


class _CausalConv(nn.Module):
    """Mamba's short convolution along the sequence."""

    def __init__(self, width: int = 16):
        super().__init__()
        self.conv = nn.Conv1d(width, width, 4, groups=width, padding=3)

    def forward(self, x):
        return x + self.conv(x.transpose(1, 2))[..., :x.shape[1]].transpose(1, 2)


@pytest.mark.parametrize("module, mixes", [(_Attention(), False), (nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 16)), False),
                                           (_TokenShift(), True), (_CausalConv(), True)])
def test_the_probe_finds_tokens_meeting_outside_attention(module, mixes):
    """Attention's own mixing does not count (the probe answers each query with its own value);
    dropout draws the same masks in both runs; a constant added to a token would vanish in the
    norm, and a zero output projection would hide the shift at init, so neither hides it."""
    module.train()
    x = torch.randn(2, SEQ, 16)
    assert mixes_tokens_outside_attention(module, (x,), {}, SEQ) is mixes
    name = next(iter(inspect.signature(module.forward).parameters))
    assert mixes_tokens_outside_attention(module, (), {name: x}, SEQ) is mixes  # the input passed by name


def test_the_probe_answers_none_where_it_cannot_run():
    block = _TokenShift()
    assert mixes_tokens_outside_attention(block, (torch.randn(2, SEQ, 16, device="meta"),), {}, SEQ) is None
    assert mixes_tokens_outside_attention(block, (torch.randn(2, SEQ, 16),), {}, None) is None  # no sequence known
    assert mixes_tokens_outside_attention(nn.Embedding(10, 16), (torch.zeros(2, SEQ, dtype=torch.long),), {}, SEQ) is None


@pytest.mark.slow
@pytest.mark.parametrize("model_type, sizes", [
    ("rwkv", dict(hidden_size=64, attention_hidden_size=64, intermediate_size=128)),
    ("recurrent_gemma", dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                             lru_width=64, block_types=["recurrent", "attention"], attention_window_size=16)),
])
def test_units_that_mix_tokens_stay_whole_under_sequence_parallelism(model_type, sizes, tmp_path):
    """RWKV's blocks shift each token into the next; RecurrentGemma's recurrent blocks run a
    recurrence over the sequence. Their tp2 plans with sequence parallelism failed at the first
    forward (a DTensor met RWKV's time-mix weights; torch's SequenceParallel dropped the RG-LRU's
    second argument), and a split sequence would have cut the shift and the recurrence at the
    ranks' boundary. Measured profiles mark those units; SP keeps them whole and the plan trains
    like one process; context parallelism is refused, naming them."""
    import planner.hf_config_model as hf
    from planner.cluster import make_cluster
    from planner.profiler import profile_model
    from planner.solver.solve import Pins, solve
    from tests.test_hf_models import _default_config
    from tests.test_runtime_parity import check_parity

    args = _default_config(model_type, tmp_path, seq_len=32, num_hidden_layers=2, vocab_size=256, **sizes)
    profile = profile_model(hf.__file__, args, [1, 2], device="cpu", repeats=1, warmup=0)
    mixing = [u.name for u in profile.units if u.mixes_tokens]
    assert mixing and all(".layers." in n or ".blocks." in n for n in mixing)
    assert all(u.mixes_tokens is False for u in profile.units if u.kind.endswith("Norm") or u.name.endswith("head"))
    assert all(f"{n} mixes tokens outside attention" in profile.model.cp_obstacles for n in mixing)
    plan = solve(profile, make_cluster(2, gpu="cpu"), 4, Pins(tp=2, sequence_parallel=True))
    kept = [n for n in plan.search.notes if "sequence parallelism keeps its unit whole" in n]
    assert kept, plan.search.notes
    check_parity(plan, tmp_path)
    # RWKV has no attention at all, which is refused first; RecurrentGemma's local attention is SDPA.
    why = "mixes tokens outside attention" if profile.model.attention_calls else "calls no F.scaled_dot_product_attention"
    with pytest.raises(PlannerError, match=why):
        solve(profile, make_cluster(2, gpu="cpu"), 4, Pins(cp=2))
