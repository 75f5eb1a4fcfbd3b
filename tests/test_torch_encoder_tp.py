"""Tensor parallelism on a model built from torch's own nn.TransformerEncoderLayer.

The layer keeps linear1 and linear2 as its own children beside its norms and its attention
(nn.MultiheadAttention), and adds the MLP's output to the residual stream inside itself. So the
owner of the column/row pair is the whole layer:
- without sequence parallelism the norms and the attention run before linear1 and see whole
  activations: their gradients are not summed over the TP ranks (runtime/apply_tp.py
  `_keep_sandwiched`; the runtime used to refuse the plan at its first forward);
- under sequence parallelism the layer would all-gather the residual stream and add the
  rowwise output's sequence shard to it, so the solver leaves such units replicated
  (planner/solver/intra_op.py `_sequence_parallel_blocked`).
"""

from __future__ import annotations

import pytest

from planner.cluster import make_cluster
from planner.profiler import profile_model
from planner.solver.solve import Pins, solve

MODEL = '''
import torch
import torch.nn.functional as F
from torch import nn


class Net(nn.Module):
    def __init__(self, vocab=256, d=64, heads=4, layers=2, ff=128):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList([nn.TransformerEncoderLayer(d, heads, ff, dropout=0.0, batch_first=True,
                                                                norm_first=True) for _ in range(layers)])
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, x):
        h = self.embed(x)
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1], device=x.device)
        for layer in self.layers:
            h = layer(h, src_mask=mask, is_causal=True)
        return self.head(self.norm(h))


def build_model(**kw):
    return Net(**kw)


def make_batch(batch_size, vocab=256, seq_len=32, **_):
    t = torch.randint(vocab, (batch_size, seq_len + 1))
    return t[:, :-1], t[:, 1:]


def loss_fn(out, y):
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
'''


@pytest.fixture(scope="module")
def encoder_profile(tmp_path_factory):
    path = tmp_path_factory.mktemp("encoder") / "encoder.py"
    path.write_text(MODEL)
    return profile_model(str(path), {}, [1, 2], device="cpu", repeats=1, warmup=0)


def _sharded(plan) -> dict[str, str]:
    return {k: v for s in plan.stages for k, v in s.tp_plan.items() if v != "replicate"}


def test_sequence_parallelism_leaves_a_layer_owning_its_linears_replicated(encoder_profile):
    with_sp = solve(encoder_profile, make_cluster(2, gpu="cpu"), 4, Pins(tp=2, sequence_parallel=True))
    without = solve(encoder_profile, make_cluster(2, gpu="cpu"), 4, Pins(tp=2, sequence_parallel=False))
    assert not [n for n in _sharded(with_sp) if n.startswith("layers.")]
    assert _sharded(without)["layers.0.linear1"] == "colwise" and _sharded(without)["layers.0.linear2"] == "rowwise"


VIT = '''
import torch
from torch import nn


class Block(nn.Module):
    """As torchvision's ViT encoder block: nn.MultiheadAttention, and the MLP a child of its own."""

    def __init__(self, d, heads, ff):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)
        # No bias: its key part gets no gradient in exact arithmetic, and Adam moves it by rounding
        # noise alone (tests/test_runtime_parity.py `check_parity`).
        self.attn = nn.MultiheadAttention(d, heads, bias=False, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, ff), nn.GELU(), nn.Linear(ff, d))

    def forward(self, x):
        y = self.ln_1(x)
        y, _ = self.attn(y, y, y, need_weights=False)
        x = x + y
        return x + self.mlp(self.ln_2(x))


class Net(nn.Module):
    def __init__(self, d=32, heads=4, layers=2, ff=64, classes=10, patches=8):
        super().__init__()
        self.proj = nn.Linear(12, d)
        self.class_token = nn.Parameter(torch.randn(1, 1, d) * 0.02)  # the root's own, as torchvision's ViT
        self.blocks = nn.ModuleList([Block(d, heads, ff) for _ in range(layers)])
        self.norm, self.head = nn.LayerNorm(d), nn.Linear(d, classes)

    def forward(self, x):
        h = self.proj(x)
        h = torch.cat([self.class_token.expand(h.shape[0], -1, -1), h], dim=1)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h[:, 0]))


def build_model(**kw):
    return Net(**kw)


def make_batch(batch_size, patches=8, **_):
    return torch.randn(batch_size, patches, 12), torch.randint(10, (batch_size,))
'''


@pytest.fixture(scope="module")
def vit_profile(tmp_path_factory):
    path = tmp_path_factory.mktemp("vit") / "vit.py"
    path.write_text(VIT)
    return profile_model(str(path), {}, [1, 2], device="cpu", repeats=1, warmup=0)


def test_torchs_multihead_attention_stays_whole_and_keeps_sequence_parallelism_out(vit_profile):
    # Its projections are its own parameters inside F.multi_head_attention_forward: recorded as
    # one attention that projects inside (profile_schema.OpNode.projections_inside), replicated,
    # and under sequence parallelism it would see only its rank's tokens.
    block = next(u for u in vit_profile.units if u.name == "blocks.0")
    assert [(op.name, op.kind, op.projections_inside) for op in block.ops if op.kind == "attention"] == [
        ("attention_1", "attention", True)]
    with_sp = solve(vit_profile, make_cluster(2, gpu="cpu"), 4, Pins(tp=2, sequence_parallel=True))
    without = solve(vit_profile, make_cluster(2, gpu="cpu"), 4, Pins(tp=2, sequence_parallel=False))
    assert not [n for n in _sharded(with_sp) if n.startswith("blocks.")]
    assert _sharded(without)["blocks.0.mlp.0"] == "colwise" and _sharded(without)["blocks.0.mlp.2"] == "rowwise"
    assert not [n for n in _sharded(without) if ".attn" in n]


def test_a_model_whose_root_holds_parameters_is_planned_without_a_pipeline(vit_profile):
    # torchvision's ViT keeps its class token on the root: no pipeline stage could own it.
    from planner.errors import PlannerError

    assert vit_profile.model.root_parameters == ["class_token"]
    free = solve(vit_profile, make_cluster(2, gpu="cpu"), 4, Pins())
    assert free.layout.pp_degree == 1
    with pytest.raises(PlannerError, match=r"--pp 2: parameters \['class_token'\] belong to the model root"):
        solve(vit_profile, make_cluster(2, gpu="cpu"), 4, Pins(pp=2))


@pytest.mark.slow
@pytest.mark.parametrize("model", ["encoder_profile", "vit_profile"])
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_tp_plan_trains_like_one_process(model, sequence_parallel, request, tmp_path):
    from tests.test_runtime_parity import check_parity

    profile = request.getfixturevalue(model)
    plan = solve(profile, make_cluster(2, gpu="cpu"), 4, Pins(tp=2, sequence_parallel=sequence_parallel))
    assert plan.layout.sequence_parallel is sequence_parallel and _sharded(plan)
    check_parity(plan, tmp_path)
