"""Unit discovery, cut crossings and op graphs on the bundled examples and a Hugging Face model."""

from __future__ import annotations

import pytest
import torch

from conftest import EXAMPLES
from planner.profiler import profile_model


def analytic(name: str, sizes=(1,), **args):
    return profile_model(str(EXAMPLES / name), args, list(sizes), device="meta", gpu="h100-80gb")


def test_gpt_units():
    prof = analytic("gpt.py", n_layers=3)
    assert prof.unit_names() == ["embed", "blocks.0", "blocks.1", "blocks.2", "norm", "head"]
    assert prof.model.sequence_length == 32
    assert len({u.fingerprint for u in prof.units[1:4]}) == 1  # identical blocks share one fingerprint


def test_llama_units():
    prof = analytic("llama.py", n_layers=2)
    assert prof.unit_names() == ["embed", "layers.0", "layers.1", "norm", "output"]


def test_cnn_units():
    prof = analytic("cnn.py")
    assert prof.unit_names() == ["blocks.0", "blocks.1", "blocks.2", "classifier"]


def test_hugging_face_model_units_unchanged():
    pytest.importorskip("transformers")
    prof = analytic("hf_llama.py", sizes=(1, 2), n_layers=2)
    names = prof.unit_names()
    assert names[0] == "model.embed_tokens" and names[-1] == "lm_head"
    assert [n for n in names if n.startswith("model.layers.")] == ["model.layers.0", "model.layers.1"]
    assert "model.norm" in names
    # The rotary cos/sin made once at the top are handed to every layer: they cross every cut
    # between layers, beside the hidden state.
    between_layers = prof.cuts[names.index("model.layers.0")]
    assert len(between_layers.tensors) >= 2
    assert any(t.producer == "model.rotary_emb" for t in between_layers.tensors)


def test_unet_skip_crossings():
    """Every skip tensor crosses each cut between its producer and its consumer, with its bytes."""
    prof = analytic("unet.py", sizes=(1, 2))
    names = prof.unit_names()
    assert names[0] == "stem" and names[-1] == "head"
    downs = [n for n in names if n.startswith("down.")]
    ups = [n for n in names if n.startswith("up.")]
    assert len(downs) == len(ups) >= 2
    mid = names.index("mid")
    crossing = prof.cuts[mid - 1]  # the cut just before the bottleneck
    producers = sorted(t.producer for t in crossing.tensors)
    # The stem's output and every down block's output are still waiting for their up block.
    assert set(["stem"] + downs) <= set(producers)
    for t in crossing.tensors:
        assert t.bytes[2] == 2 * t.bytes[1]  # activations scale with the micro-batch
        assert t.bytes[1] == 4 * eval("*".join(map(str, t.shape[1])))  # float32
    # After the last up block consumed its skip, only the main path crosses.
    last_cut = prof.cuts[-1]
    assert [t.producer for t in last_cut.tensors] == [names[-2]]


@pytest.mark.parametrize("name", ["gpt.py", "llama.py"])
def test_analytic_and_measured_agree_on_flops_and_bytes(name):
    measured = profile_model(str(EXAMPLES / name), {"n_layers": 2}, [2], device="cpu", repeats=1, warmup=0)
    # Meta priced for this CPU: the same kernels (a GPU target keeps what its fused kernels keep: test_profile_norms.py)
    meta = profile_model(str(EXAMPLES / name), {"n_layers": 2}, [2], device="meta", gpu="cpu")
    assert measured.model.fingerprint == meta.model.fingerprint
    for m, a in zip(measured.units, meta.units):
        cm, ca = m.costs[2], a.costs[2]
        assert (cm.forward_flops, cm.backward_flops) == (ca.forward_flops, ca.backward_flops), m.name
        assert (cm.output_bytes, cm.input_bytes, m.parameter_bytes) == (ca.output_bytes, ca.input_bytes, a.parameter_bytes)
        # Flash attention on meta also saves its RNG state (a few scalars): allow 1%.
        assert ca.saved_bytes == pytest.approx(cm.saved_bytes, rel=0.01), m.name
    assert [c.bytes for c in measured.cuts] == [c.bytes for c in meta.cuts]


def test_gpt_block_op_graph():
    prof = analytic("gpt.py", n_layers=1)
    ops = {op.name: op for op in prof.units[1].ops}
    assert {"attn.wq", "attn.wk", "attn.wv", "attn.wo", "mlp.fc_in", "mlp.fc_out", "attention_1"} <= set(ops)
    assert ops["attn.wq"].inputs == ["input"]
    assert ops["attention_1"].inputs == ["attn.wk", "attn.wq", "attn.wv"]
    assert ops["attn.wo"].inputs == ["attention_1"]
    assert ops["mlp.fc_in"].inputs == ["attn.wo", "input"]  # the residual stream
    assert ops["mlp.fc_out"].inputs == ["mlp.fc_in"]
    d, ff, s = 64, 256, 32
    assert ops["mlp.fc_in"].weight_shape == [ff, d]
    assert ops["mlp.fc_in"].forward_flops == 2 * s * d * ff


def test_gpt3_175b_profiles_analytically():
    """The 175B model never materialises; the parameter count matches the paper's 175B."""
    prof = analytic("gpt.py", n_layers=96, d_model=12288, n_heads=96, d_ff=49152, vocab_size=51200, seq_len=2048)
    assert len(prof.units) == 96 + 3
    assert 174e9 < prof.model.num_parameters < 176e9
    block = prof.units[1].costs[1]
    # Per layer per sequence: 24 s h^2 (1 + s / 6h) FLOPs forward (Narayanan et al. 2021, eq. 3 / 3).
    s, h = 2048, 12288
    assert block.forward_flops == pytest.approx(24 * s * h * h * (1 + s / (6 * h)), rel=0.01)


def test_spans_of_units_called_more_than_once():
    from planner.units import repeated_spans

    assert repeated_spans([0, 1, 2, 3], 4) == []
    assert repeated_spans([0, 1, 1, 2, 3], 4) == [(1, 2)]  # in a row (Gemma 3's rotary): with the next unit
    assert repeated_spans([0, 1, 2, 1, 3, 4], 5) == [(1, 3)]  # again after unit 2: through the unit after that
    assert repeated_spans([0, 1, 2, 2], 3) == []  # the last unit: no cut after it anyway


TWICE = '''
import torch
import torch.nn.functional as F
from torch import nn


class Rotary(nn.Module):
    """No parameters, called twice in a row with another base (as Gemma 3's rotary embedding)."""

    def forward(self, x, base):
        positions = torch.arange(x.shape[1], dtype=x.dtype)
        return torch.cos(positions[:, None] / base), torch.sin(positions[:, None] / base)


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x, angles):
        cos, sin = angles
        return x + torch.tanh(self.fc(x * cos + sin))


class Model(nn.Module):
    def __init__(self, vocab=32, d=16, n=4):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.rotary = Rotary()
        self.blocks = nn.ModuleList(Block(d) for _ in range(n))
        self.head = nn.Linear(d, vocab)

    def forward(self, idx):
        x = self.embed(idx)
        local, wide = self.rotary(x, 10.0), self.rotary(x, 1000.0)
        for i, block in enumerate(self.blocks):
            x = block(x, local if i % 2 else wide)
        return self.head(x)


def build_model(**_):
    return Model()


def make_batch(batch_size, **_):
    x = torch.randint(32, (batch_size, 9))
    return x[:, :-1], x[:, 1:]


def loss_fn(out, y):
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
'''


@pytest.mark.slow
def test_a_unit_called_twice_in_a_row_stays_with_the_next_in_a_pipeline(write_model, tmp_path):
    """The pipeline holds a unit called more than once with the unit after it (`repeated_spans`):
    a pp 2 plan of such a model trains like one process, where the runtime refused it before."""
    from planner.cluster import make_cluster
    from planner.solver.solve import Pins, solve
    from tests.test_runtime_parity import check_parity

    profile = profile_model(str(write_model(TWICE)), {}, [1, 2], device="cpu", repeats=1, warmup=0)
    assert ["rotary", "blocks.0"] in profile.model.unsplit_units
    plan = solve(profile, make_cluster(2, gpu="cpu"), 4, Pins(pp=2, schedule="1f1b"))
    assert [k for k, stage in enumerate(plan.stages) for u in stage.units if u in ("rotary", "blocks.0")] in ([0, 0], [1, 1])
    check_parity(plan, tmp_path)


class _Block(torch.nn.Module):
    """A block returning a tuple: a new hidden state, its input passed through, and a constant."""

    runs = 0

    def __init__(self, width: int = 8):
        super().__init__()
        self.linear = torch.nn.Linear(width, width)

    def forward(self, h, mask=None, scale: float = 1.0):
        type(self).runs += 1
        out = self.linear(h) * scale
        for i in range(h.shape[1]):  # a Python loop over the sequence, as a scan is written
            out[:, i] = out[:, i] + (mask[i] if mask is not None else 0)
        return out, h, 3


class _Twins(torch.nn.Module):
    """Four identical blocks; glue that updates a block's output in place and leaks nothing."""

    def __init__(self, leak: bool = False):
        super().__init__()
        self.embed = torch.nn.Embedding(16, 8)
        self.blocks = torch.nn.ModuleList(_Block() for _ in range(4))
        self.head = torch.nn.Linear(8, 16)
        self.register_buffer("scale", torch.full((8,), 2.0))  # read by the glue: not a leak
        self.leak = leak
        self.stash: list = []
        if leak:
            for block in self.blocks:  # a hook collecting what each block computed, as router logits are
                block.linear.register_forward_hook(lambda m, a, out: self.stash.append(out))

    def forward(self, ids):
        mask = torch.arange(ids.shape[1], device=ids.device).float()  # known values: the same object each call
        h = self.embed(ids) * self.scale
        self.stash.clear()
        for block in self.blocks:
            h, before, _ = block(h, mask, scale=0.5)
            h.add_(before)
        out = self.head(h)
        return out + sum(s.sum() for s in self.stash) if self.leak else out


def _same_trace(a, b) -> None:
    key = lambda t: (t.producer, t.ordinal, t.shape, t.dtype, t.bytes, sorted(t.consumers))  # noqa: E731
    assert a.units == b.units and a.joined == b.joined and a.float_fed == b.float_fed
    assert a.repeated_calls == b.repeated_calls and a.unused == b.unused
    assert sorted(map(key, a.tensors)) == sorted(map(key, b.tensors))
    shapes = lambda trace: {n: [tuple(x.shape) for x in torch.utils._pytree.tree_leaves(v) if isinstance(x, torch.Tensor)]  # noqa: E731
                            for n, v in trace.unit_inputs.items()}
    assert shapes(a) == shapes(b)


@pytest.mark.parametrize("leak", [False, True])
def test_twin_units_are_replayed_without_changing_the_trace(leak):
    """A unit called like an earlier twin returns that call's outputs without running
    (planner/units.py `_Replays`): the trace (units, tensors and their consumers, unit inputs) is the
    one running every unit gives; a passed-through input stays the same tensor, and glue may update
    an output in place. A twin whose hook lets a tensor out to the glue makes the trace run again
    without replays, which gives the same trace."""
    from planner.meta_values import KnownValues
    from planner.units import trace_on_meta, trace_units

    torch.manual_seed(0)
    with torch.device("meta"):
        model = _Twins(leak)
    ids = torch.randint(0, 16, (2, 5))
    _Block.runs = 0
    replayed = trace_on_meta(model, (ids,))
    runs = _Block.runs
    _Block.runs = 0
    with KnownValues() as values:
        plain = trace_units(model, values.to_meta((ids,)), replay=False)
    assert _Block.runs == 4
    assert runs == (4 + 1 if leak else 1)  # with a leak: one replayed run, then all four again
    _same_trace(replayed, plain)
    assert len(replayed.units) == 6


def test_replayed_units_keep_the_counts_the_profile_reports():
    """A Hugging Face Llama's layers are replayed in an analytic profile; its count of attention
    calls (what context parallelism needs) and its units' costs are those of running every layer."""
    pytest.importorskip("transformers")
    import planner.units as units

    replayed = analytic("hf_llama.py", n_layers=3)
    defaults = units._trace_once.__defaults__
    units._trace_once.__defaults__ = (False,)
    try:
        plain = analytic("hf_llama.py", n_layers=3)
    finally:
        units._trace_once.__defaults__ = defaults
    assert replayed.model.attention_calls == plain.model.attention_calls == 3
    assert replayed.model_dump(exclude={"created_at"}) == plain.model_dump(exclude={"created_at"})
