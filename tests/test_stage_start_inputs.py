"""A unit keeps for backward what its inputs' requires_grad makes it keep: inside a stage, as in
the model's own forward (Hugging Face's rotary cos and sin are made under no_grad); as a
pipeline stage's first unit, every received floating input requires grad, so it keeps more
(planner/profiler/measure.py `_fresh_inputs`, `UnitCosts.stage_start_saved_bytes`)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from planner.cluster import make_cluster
from planner.profiler import profile_model
from planner.profiler.counters import SavedBytes
from planner.solver.solve import Pins, even_block_cuts, search
from tests.conftest import EXAMPLES

pytest.importorskip("transformers")

ARGS = dict(n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, d_ff=128, vocab_size=128, seq_len=32)


def _example():
    spec = importlib.util.spec_from_file_location("hf_llama_example", EXAMPLES / "hf_llama.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _saved_in_model(layer_index: int, all_inputs_grad: bool) -> int:
    """Bytes the decoder layer saves for backward in the whole model's forward on CPU (parameters
    excluded); with `all_inputs_grad` its floating inputs are made to require grad first, as a
    pipeline stage's receive does."""
    example = _example()
    torch.manual_seed(0)
    model = example.build_model(**ARGS)
    tokens, _ = example.make_batch(2, **ARGS)
    layer = model.model.layers[layer_index]
    saved = SavedBytes(exclude=list(model.parameters()))  # distinct storages, as the profiler counts
    counted = {"on": False}

    def pack(t):
        return saved.pack(t) if counted["on"] else t

    def pre(module, args, kwargs):
        counted["on"] = True
        if all_inputs_grad:
            lift = lambda x: x.detach().requires_grad_(True).clone() if torch.is_tensor(x) and x.is_floating_point() else x  # noqa: E731
            return torch.utils._pytree.tree_map(lift, (args, kwargs))
        return None

    def post(module, args, kwargs, output):
        counted["on"] = False

    hooks = [layer.register_forward_pre_hook(pre, with_kwargs=True), layer.register_forward_hook(post, with_kwargs=True)]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(tokens)
    for h in hooks:
        h.remove()
    return saved.bytes


@pytest.fixture(scope="module")
def profile():
    return profile_model(str(EXAMPLES / "hf_llama.py"), ARGS, [2], device="cpu", repeats=1, warmup=0)


def test_a_decoder_layer_keeps_what_it_keeps_in_the_model(profile):
    layer = next(u for u in profile.units if u.name.endswith("layers.1"))
    costs = layer.costs[2]
    assert costs.stage_start_saved_bytes is not None and costs.stage_start_saved_bytes > costs.saved_bytes
    assert costs.saved_bytes == _saved_in_model(1, all_inputs_grad=False)
    assert costs.stage_start_saved_bytes == _saved_in_model(1, all_inputs_grad=True)
    # The embedding takes token ids: nothing to tell apart.
    assert profile.units[0].costs[2].stage_start_saved_bytes is None


def test_a_later_stage_holds_its_first_units_extra(profile):
    # The stage DP's cut follows the measured (load-dependent) unit times and may leave the second
    # stage only the norm and head, which take nothing extra: the layers are split evenly instead,
    # so the second stage starts at a decoder layer.
    result = search(profile, make_cluster(2, gpu="cpu"), 8, Pins(pp=2, dp=1, tp=1, micro_batch_size=2, schedule="1f1b",
                                                                 recompute="none"), keep=1, cuts=even_block_cuts(profile))
    best = result.ranked[0]
    cfg = best.config
    table = result.costs.table(cfg.tp, cfg.sequence_parallel, cfg.micro_batch_size)
    (_, cut), (start, _) = best.bounds
    assert start == cut and table.stage_start_saved is not None and table.stage_start_saved[start] > 0
    # The second stage's activations term carries its first unit's extra, once per micro-batch in flight.
    activations = best.memory_terms[1]["activations"]
    stored = float(table.activations["none"][start:].sum())
    assert activations == pytest.approx(stored + float(table.stage_start_saved[start]), rel=1e-9)
