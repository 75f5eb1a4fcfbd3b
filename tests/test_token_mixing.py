"""Units that move information between tokens outside attention (planner/profiler/token_mixing.py):
the probe on small modules, measured and on the meta device, and what the solver does with it
on the Hugging Face models that have such units (RWKV's token shift, RecurrentGemma's recurrence):
sequence parallelism keeps them whole, and context parallelism is refused."""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from planner.errors import PlannerError
from planner.profiler.token_mixing import ProbeWeights, mixes_tokens_on_meta, mixes_tokens_outside_attention

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


class _WrittenOutAttention(_Attention):
    """The same block with attention written out, as Megatron-LM ran it and Hugging Face's eager
    attention does: scores, a causal mask, a softmax, dropout on the probabilities, a product."""

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, s, 3, self.heads, d // self.heads).transpose(1, 3).unbind(2)
        scores = torch.matmul(q, k.transpose(-1, -2)) / (d // self.heads) ** 0.5
        scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
        attended = F.dropout(scores.softmax(-1), 0.1, training=self.training) @ v
        x = x + self.out(attended.transpose(1, 2).reshape(b, s, d))
        return x + self.mlp(x)


class _LinearAttention(_Attention):
    """Causal linear attention: (q k^T, masked) v with no softmax, a recurrence over the sequence."""

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, s, 3, self.heads, d // self.heads).transpose(1, 3).unbind(2)
        scores = torch.matmul(q, k.transpose(-1, -2)) * torch.ones(s, s).tril()
        return x + self.out((scores @ v).transpose(1, 2).reshape(b, s, d))


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


MODULES = [(_Attention, False), (_WrittenOutAttention, False), (lambda: nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 16)), False),
           (_LinearAttention, True), (_TokenShift, True), (_CausalConv, True)]


@pytest.mark.parametrize("make, mixes", MODULES)
def test_the_probe_finds_tokens_meeting_outside_attention(make, mixes):
    """Attention's own mixing does not count, fused or written out (the probe answers each query
    with its own value); a product over the sequence with no softmax after it does; dropout draws
    the same masks in both runs; a constant added to a token would vanish in the norm, and a zero
    output projection would hide the shift at init, so neither hides it."""
    module = make().train()
    x = torch.randn(2, SEQ, 16)
    assert mixes_tokens_outside_attention(module, (x,), {}, SEQ) is mixes
    name = next(iter(inspect.signature(module.forward).parameters))
    assert mixes_tokens_outside_attention(module, (), {name: x}, SEQ) is mixes  # the input passed by name


@pytest.mark.parametrize("make, mixes", MODULES)
def test_the_probe_on_the_meta_device_agrees(make, mixes):
    """An analytic profile's units have no values: the probe runs them on a few tokens with
    weights of its own, and must answer as the probe with values does."""
    with torch.device("meta"):
        module = make().train()
    assert mixes_tokens_on_meta(module, (torch.empty(2, SEQ * 4, 16, device="meta"),), {}, SEQ * 4) is mixes


class _AllExperts(nn.Module):
    """Every token through every expert at once, by one batched product over the experts' stacked
    weights (as Hugging Face's grouped_mm experts multiply), summed."""

    def __init__(self, experts: int, width: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(experts, width, width))

    def forward(self, x):
        b, s, d = x.shape
        return x + torch.bmm(x.reshape(1, b * s, d).expand(self.weight.shape[0], -1, -1), self.weight.transpose(1, 2)).sum(0).view(b, s, d)


def test_the_probe_on_meta_holds_no_large_weight_nor_multiplies_by_one():
    """At a 70B model's width a block's weights are gigabytes: the probe's are views of one vector
    each, its linears multiply by factors of rank 32, and a product over 64 experts' stacked
    weights (17 GB in float32) by one such product, so a block of width 8192 is probed in well
    under a second with almost no memory."""
    with torch.device("meta"):
        block = _WrittenOutAttention(width=8192, heads=64)
        block.mlp = nn.Sequential(nn.Linear(8192, 28672), nn.GELU(), nn.Linear(28672, 8192), _AllExperts(64, 8192))
    probe = ProbeWeights(block, torch.Generator().manual_seed(0))
    held = sum(w.untyped_storage().nbytes() for w in probe.weights.values())
    assert held < 2**20, held
    assert probe.weights["mlp.0.weight"].shape == (28672, 8192)
    assert mixes_tokens_on_meta(block, (torch.empty(1, 4096, 8192, device="meta"),), {}, 4096) is False


def test_the_probe_answers_none_where_it_cannot_run():
    block = _TokenShift()
    assert mixes_tokens_outside_attention(block, (torch.randn(2, SEQ, 16, device="meta"),), {}, SEQ) is None
    assert mixes_tokens_outside_attention(block, (torch.randn(2, SEQ, 16),), {}, None) is None  # no sequence known
    assert mixes_tokens_outside_attention(nn.Embedding(10, 16), (torch.zeros(2, SEQ, dtype=torch.long),), {}, SEQ) is None


RWKV = dict(hidden_size=64, attention_hidden_size=64, intermediate_size=128)
RECURRENT_GEMMA = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                       lru_width=64, block_types=["recurrent", "attention"], attention_window_size=16)


@pytest.mark.slow
@pytest.mark.parametrize("model_type, sizes, device", [("rwkv", RWKV, "cpu"), ("recurrent_gemma", RECURRENT_GEMMA, "cpu"),
                                                       ("recurrent_gemma", RECURRENT_GEMMA, "meta")])
def test_units_that_mix_tokens_stay_whole_under_sequence_parallelism(model_type, sizes, device, tmp_path):
    """RWKV's blocks shift each token into the next; RecurrentGemma's recurrent blocks run a
    recurrence over the sequence. Their tp2 plans with sequence parallelism failed at the first
    forward (a DTensor met RWKV's time-mix weights; torch's SequenceParallel dropped the RG-LRU's
    second argument), and a split sequence would have cut the shift and the recurrence at the
    ranks' boundary. Profiles mark those units, measured or analytic (whose plan failed the same
    way before the probe ran on meta); SP keeps them whole and the plan trains like one process;
    context parallelism is refused, naming them."""
    import planner.hf_config_model as hf
    from planner.cluster import make_cluster
    from planner.profiler import profile_model
    from planner.solver.solve import Pins, solve
    from tests.test_hf_models import _default_config
    from tests.test_runtime_parity import check_parity

    args = _default_config(model_type, tmp_path, seq_len=32, num_hidden_layers=2, vocab_size=256, **sizes)
    how = dict(device="cpu", repeats=1, warmup=0) if device == "cpu" else dict(device="meta", gpu="cpu")
    profile = profile_model(hf.__file__, args, [1, 2], **how)
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


MODEL_WITH_A_UNIT_THE_PROBE_CANNOT_RUN = """
import torch
import torch.nn.functional as F
from torch import nn

class Block(nn.Module):
    def __init__(self, width=64):
        super().__init__()
        self.proj = nn.Linear(width, width)
        self.table = nn.Parameter(torch.empty(20000, 16384))  # 1.2 GiB in float32

    def forward(self, x):
        w = self.table.view(-1)[: x.shape[-1]]  # a view the probe's weights cannot give without a dense copy
        return x + self.proj(x) * w

class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(32, 64)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(64, 32)

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)

def build_model():
    return Model()

def make_batch(batch_size):
    return torch.randint(0, 32, (batch_size, 16)), torch.randint(0, 32, (batch_size, 16))

def loss_fn(output, targets):
    return F.cross_entropy(output.flatten(0, 1), targets.flatten())
"""


def test_an_analytic_profile_says_which_units_the_probe_could_not_run(write_model):
    """A unit whose code asks for more than the probe's weights give (here a 1.2 GiB view made
    dense) is not known to keep its tokens apart: the profile says so, naming it and what to do."""
    from planner.profiler import profile_model

    profile = profile_model(str(write_model(MODEL_WITH_A_UNIT_THE_PROBE_CANNOT_RUN)), device="meta", gpu="cpu")
    assert [u.mixes_tokens for u in profile.units] == [None, None, None, False]
    note = next(n for n in profile.notes if "is not known" in n)
    assert note.endswith("blocks.0, blocks.1") and "without --sequence-parallel" in note


@pytest.mark.slow
def test_written_out_attention_keeps_sequence_parallelism(tmp_path):
    """A measured profile of a GPT whose attention is written out (scores, softmax, product, as
    Megatron-LM ran it) marked every block as mixing tokens, so SP kept them all whole and CP was
    refused for the wrong reason. Now every linear is sharded and the plan trains like one process."""
    from pathlib import Path

    from planner.cluster import make_cluster
    from planner.profiler import profile_model
    from planner.solver.solve import Pins, solve
    from tests.test_runtime_parity import check_parity

    gpt = Path(__file__).resolve().parents[1] / "examples" / "gpt.py"
    args = dict(n_layers=2, d_model=64, n_heads=4, d_ff=128, vocab_size=128, seq_len=32, attention="math")
    profile = profile_model(str(gpt), args, [1, 2], device="cpu", repeats=1, warmup=0)
    assert [u.mixes_tokens for u in profile.units if u.name.startswith("blocks.")] == [False, False]
    plan = solve(profile, make_cluster(2, gpu="cpu"), 4, Pins(tp=2, sequence_parallel=True))
    assert not [n for n in plan.search.notes if "keeps its unit whole" in n], plan.search.notes
    check_parity(plan, tmp_path)
