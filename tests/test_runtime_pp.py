"""Pipeline parallelism (runtime/apply_pp.py, runtime/pp_split.py): parity with one process.

Two levels:
- in-process: the stage modules of a plan, chained by hand, give the whole model's output
  bit for bit (the same kernels on the same values in the same order, so exact equality is
  the right test), keep the model's parameter names, and carry every skip connection across
  the cuts (U-Net), including tensors a stage only passes on;
- spawned gloo ranks (`python -m runtime` under torchrun against `--reference`, the
  harness of test_runtime_parity.py): 3 AdamW steps match the one-process run. Its
  tolerances (losses 1e-5 relative, parameters 1e-4 absolute) are explained there: a
  pipeline sums micro-batch gradients one micro-batch at a time and scales by 1/m after,
  the reference back-propagates the whole batch's mean, so the sums differ in order
  (~1e-7 relative), and AdamW's 1/sqrt(v) amplifies that for near-zero gradients. A wrong
  cut, a lost skip gradient or an unscaled gradient misses by far more (one update is ~lr).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from planner.errors import PlannerError
from planner.model_file import load_model_file
from planner.units import trace_units
from tests.runtime_plans import GPT_ARGS, GPT_UNITS, make_plan

SEED = 0
UNET_ARGS = dict(image_size=16, base_width=4, depth=3)
UNET_UNITS = ["stem", "down.0", "down.1", "down.2", "mid", "up.0", "up.1", "up.2", "head"]
CNN_ARGS = dict(image_size=16, widths="4,8")
CNN_UNITS = ["blocks.0", "blocks.1", "classifier"]
# A Hugging Face Llama, unchanged: its forward's glue (position ids, causal mask, the rotary
# unit's cos/sin) makes tensors that every later stage consumes.
HF_ARGS = dict(n_layers=2, d_model=32, n_heads=4, n_kv_heads=2, d_ff=64, vocab_size=64, seq_len=16)
HF_UNITS = ["model.embed_tokens", "model.rotary_emb", "model.layers.0", "model.layers.1", "model.norm", "lm_head"]


def _plan(model: str = "gpt", **kwargs):
    args = {"gpt": GPT_ARGS, "unet": UNET_ARGS, "cnn": CNN_ARGS, "hf_llama": HF_ARGS}[model]
    units = {"gpt": GPT_UNITS, "unet": UNET_UNITS, "cnn": CNN_UNITS, "hf_llama": HF_UNITS}[model]
    return make_plan(model=model, args=args, units=units, **kwargs)


def _materialize(module: nn.Module, mf):
    """Initialised as runtime/build.py does for the reference: values by FQN, whatever the cut."""
    from runtime.build import init_mode, materialize

    with torch.device("meta"):
        mode = init_mode(mf.build_model())
    return materialize(module, SEED, torch.device("cpu"), mode, mf)


def _model_file(plan):
    return load_model_file(plan.model.file, plan.model.args)


def _batch(mf, plan, step: int):
    torch.manual_seed(SEED * 100_003 + step)
    inputs, targets = mf.make_batch(plan.batch.global_batch_size)
    return (inputs if isinstance(inputs, tuple) else (inputs,)), targets


# --- in-process: cutting ------------------------------------------------------------------


def _chain(plan, mf, inputs):
    """Every stage of `plan` (all pp ranks) built here and run one after another."""
    from runtime.apply_pp import build_stage_modules
    from runtime.pp_split import set_example_microbatch

    with torch.device("meta"):
        meta = mf.build_model()
    chunks = sorted(c for r in range(plan.layout.pp_degree) for c in build_stage_modules(meta, plan, r, inputs))
    out = inputs
    for _, module in chunks:
        _materialize(module, mf)
        set_example_microbatch(module, inputs)
        out = module(*out)
        out = out if isinstance(out, tuple) else (out,)
    return chunks, out[0]


@pytest.mark.parametrize("model,kwargs", [
    ("gpt", dict(pp=2, cuts=[0, 2, len(GPT_UNITS)])),
    ("unet", dict(pp=2, cuts=[0, 4, 9])),
    ("unet", dict(pp=2, v=2, schedule="interleaved-1f1b", cuts=[0, 2, 4, 7, 9])),  # the stem's output crosses 3 cuts
    ("cnn", dict(pp=2)),
    ("hf_llama", dict(pp=2, v=2, schedule="interleaved-1f1b", cuts=[0, 1, 2, 3, 6])),
])
def test_chained_stages_equal_the_model(model, kwargs):
    plan = _plan(model, **kwargs)
    mf = _model_file(plan)
    inputs, _ = _batch(mf, plan, 0)
    with torch.device("meta"):
        full = mf.build_model()
    _materialize(full, mf)
    chunks, out = _chain(plan, mf, inputs)
    ref = full(*inputs)
    # Same kernels in the same order: exact.
    assert torch.equal(getattr(out, "logits", out), getattr(ref, "logits", ref))
    names = [n for _, m in chunks for n, _ in m.named_parameters()]
    assert sorted(names) == sorted(n for n, _ in full.named_parameters())  # original FQNs, each once


# A stage after the first replays the earlier stages' glue each micro-batch; it reuses what that
# glue returned the first time while the glue reads the same things (runtime/pp_flow.py
# `GlueReplay`). The glue here branches on the values of a tensor the stage receives.
STEERED_NET = """
import torch
import torch.nn.functional as F
from torch import nn

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.a, self.b = nn.Embedding(16, 8), nn.Linear(8, 8), nn.Linear(8, 16)

    def forward(self, tokens):
        pos = tokens % 4
        h = self.emb(tokens)
        shift = 2.0 if bool((pos == 3).any()) else 1.0  # stage 0's glue, read in stage 1's replay
        h = self.a(h)
        h = h * shift + pos.unsqueeze(-1).float()  # stage 1's own glue: the stage receives pos
        return self.b(h)

def build_model():
    return Net()

def make_batch(batch_size, **_):
    return torch.randint(16, (batch_size, 4)), torch.randint(16, (batch_size, 4))

def loss_fn(out, y):
    return F.cross_entropy(out.reshape(-1, 16), y.reshape(-1))
"""


def test_a_later_stage_reuses_its_earlier_glue_while_it_reads_the_same_values(write_model):
    plan = make_plan(pp=2, units=["emb", "a", "b"], args={}, cuts=[0, 2, 3])
    plan.model.file = str(write_model(STEERED_NET, "steered.py"))
    mf = _model_file(plan)
    with torch.device("meta"):
        full = mf.build_model()
    _materialize(full, mf)
    ones = torch.ones(2, 4, dtype=torch.long)  # pos 1 everywhere: shift 1
    chunks, out = _chain(plan, mf, (ones,))
    assert torch.equal(out, full(ones))
    (_, first), (_, last) = chunks
    replay = last._pp_stage.glue
    for tokens in (ones + 4, ones * 3, torch.tensor([[3, 1, 2, 7], [0, 5, 9, 11]])):  # shift 1, 2, 2
        got = last(*first(tokens))
        assert torch.equal(got, full(tokens)), tokens
    # The second batch reads the same values (pos is 1 everywhere again): its glue came from the
    # record; the third's pos differs, so the glue ran again and reuse stopped for good.
    assert replay.reused > 0 and not replay.usable


def test_hf_llama_stage_reuses_its_earlier_glue():
    plan = _plan("hf_llama", pp=2, cuts=[0, 3, 6])
    mf = _model_file(plan)
    with torch.device("meta"):
        full = mf.build_model()
    _materialize(full, mf)
    inputs, _ = _batch(mf, plan, 0)
    chunks, _ = _chain(plan, mf, inputs)
    (_, first), (_, last) = chunks
    for step in (1, 2):
        batch, _ = _batch(mf, plan, step)
        out = last(*first(*batch))
        assert torch.equal(out[0] if isinstance(out, tuple) else out, full(*batch).logits)
    replay = last._pp_stage.glue
    assert replay.usable and replay.reused >= 2 * len(replay.ops) > 0  # the mask code, from the record


def test_unet_crossing_sets_include_skips():
    from runtime.pp_flow import trace_layout

    plan = _plan("unet", pp=2, v=2, schedule="interleaved-1f1b", cuts=[0, 2, 4, 7, 9])
    mf = _model_file(plan)
    with torch.device("meta"):
        meta = mf.build_model()
    layout = trace_layout(meta, plan, (torch.zeros(1, 3, 16, 16, device="meta"),))
    # Keys are (unit index, ordinal): stem 0, down.i 1 + i, up.1 6. The stem's output is up.2's skip.
    assert layout.crossings == [[(0.0, 0), (1.0, 0)], [(0.0, 0), (1.0, 0), (2.0, 0), (3.0, 0)], [(0.0, 0), (6.0, 0)]]
    # The planner's own trace (planner/units.py) counts the same tensors per cut.
    traced = trace_units(meta, (torch.zeros(1, 3, 16, 16, device="meta"),))
    assert [len(traced.crossings(c)) for c in (1, 3, 6)] == [len(c) for c in layout.crossings]


def test_root_owned_parameters_are_refused():
    from runtime.apply_pp import build_stage_modules

    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))
            self.scale = nn.Parameter(torch.ones(4))

        def forward(self, x):
            return self.blocks[1](self.blocks[0](x) * self.scale)

    plan = make_plan(pp=2, units=["blocks.0", "blocks.1"])
    with pytest.raises(PlannerError, match="belong to the model root"):
        build_stage_modules(Scaled(), plan, 0, (torch.zeros(1, 4),))


# --- spawned ranks: training parity through `python -m runtime` ---------------------------
# GPT under every schedule, non-uniform cuts, PP x TP (with and without SP), PP x DP and
# recompute are in test_runtime_parity.py / test_runtime_tp.py; these are the cases that
# exercise the cutting beyond a chain, and the layouts those files do not have.

CASES = {
    "unet-pp2-1f1b": dict(model="unet", pp=2, m=2, cuts=[0, 4, 9]),  # four skips cross the cut
    "unet-pp2-interleaved-v2": dict(model="unet", pp=2, v=2, schedule="interleaved-1f1b", m=2, cuts=[0, 2, 4, 7, 9]),
    "unet-pp2-zero-bubble": dict(model="unet", pp=2, schedule="zero-bubble", m=2, cuts=[0, 4, 9]),
    "cnn-pp2-gpipe": dict(model="cnn", pp=2, schedule="gpipe", m=2),
    "gpt-pp2-zero-bubble-v2": dict(pp=2, schedule="zero-bubble", v=2, m=4),
    "gpt-pp2xdp2-zero3": dict(pp=2, dp=2, zero=3, m=2),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_pp_parity(case, tmp_path):
    from tests.test_runtime_parity import check_parity

    kwargs = dict(CASES[case])
    check_parity(_plan(kwargs.pop("model", "gpt"), **kwargs), tmp_path)
