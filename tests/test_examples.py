"""The bundled example model files: the contract, reproducible init, training step, causality, structure."""

from __future__ import annotations

import copy
import importlib.util
from types import ModuleType

import pytest
import torch
from torch import nn

from conftest import EXAMPLES

NAMES = ["gpt", "llama", "cnn", "unet", "hf_llama"]
LANGUAGE_MODELS = ["gpt", "llama", "hf_llama"]


def load(name: str) -> ModuleType:
    if name == "hf_llama":
        pytest.importorskip("transformers")
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build(example: ModuleType, seed: int = 0, **args) -> nn.Module:
    torch.manual_seed(seed)
    return example.build_model(**args)


def logits(output) -> torch.Tensor:
    return getattr(output, "logits", output)


@pytest.mark.parametrize("name", NAMES)
def test_builds_and_runs_on_meta(name):
    example = load(name)
    with torch.device("meta"):
        model = example.build_model(unused_arg=1)  # unknown keys are ignored
    cpu = build(example)
    meta_shapes = {n: p.shape for n, p in model.named_parameters()}
    assert meta_shapes and all(p.is_meta for p in model.parameters())
    assert meta_shapes == {n: p.shape for n, p in cpu.named_parameters()}
    inputs, targets = example.make_batch(2, unused_arg=1)
    meta_inputs = tuple(t.to("meta") for t in inputs) if isinstance(inputs, tuple) else inputs.to("meta")
    out = logits(model(*(meta_inputs if isinstance(meta_inputs, tuple) else (meta_inputs,))))
    assert out.is_meta and out.shape == logits(cpu(inputs)).shape


@pytest.mark.parametrize("name", NAMES)
def test_init_is_reproducible(name):
    example = load(name)
    a, b, c = build(example, seed=1).state_dict(), build(example, seed=1).state_dict(), build(example, seed=2).state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)  # the init draws from torch's RNG
    torch.manual_seed(3)
    x1, y1 = example.make_batch(2)
    torch.manual_seed(3)
    x2, y2 = example.make_batch(2)
    assert torch.equal(x1, x2) and torch.equal(y1, y2)


@pytest.mark.parametrize("name", NAMES)
def test_training_step_reaches_every_parameter(name):
    example = load(name)
    model = build(example)
    inputs, targets = example.make_batch(2)
    loss = example.loss_fn(model(inputs), targets)
    assert loss.dim() == 0 and torch.isfinite(loss)
    loss.backward()
    for pname, p in model.named_parameters():
        assert p.grad is not None, f"{pname} got no gradient"
        assert torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, pname


@pytest.mark.parametrize("name", LANGUAGE_MODELS)
def test_language_models_are_causal(name):
    example = load(name)
    model = build(example, vocab_size=64)
    tokens, _ = example.make_batch(2, vocab_size=64)
    with torch.no_grad():
        base = logits(model(tokens))
        last = tokens.clone()
        last[:, -1] = (last[:, -1] + 1) % 64
        first = tokens.clone()
        first[:, 0] = (first[:, 0] + 1) % 64
        changed_last, changed_first = logits(model(last)), logits(model(first))
    torch.testing.assert_close(changed_last[:, :-1], base[:, :-1], rtol=0, atol=1e-5)
    assert not torch.allclose(changed_last[:, -1], base[:, -1])
    assert not torch.allclose(changed_first[:, -1], base[:, -1])  # attention does mix positions


def shard_attention(attn: nn.Module, names: tuple[str, str, str, str], rank: int, world: int) -> nn.Module:
    """What ColwiseParallel on q/k/v and RowwiseParallel on o leave on one rank, without DTensor."""
    local = copy.deepcopy(attn)
    for name in names[:3]:
        full: nn.Linear = getattr(attn, name)
        rows = full.out_features // world
        part = nn.Linear(full.in_features, rows, bias=full.bias is not None)
        part.load_state_dict({k: v[rank * rows : (rank + 1) * rows] for k, v in full.state_dict().items()})
        setattr(local, name, part)
    full = getattr(attn, names[3])
    cols = full.in_features // world
    part = nn.Linear(cols, full.out_features, bias=full.bias is not None)
    state = {"weight": full.weight[:, rank * cols : (rank + 1) * cols]}
    if full.bias is not None:
        state["bias"] = full.bias if rank == 0 else torch.zeros_like(full.bias)
    part.load_state_dict(state)
    setattr(local, names[3], part)
    return local


@pytest.mark.parametrize(("name", "args", "path"), [
    ("gpt", {}, "blocks.0.attn"),
    ("llama", {"n_heads": 8, "n_kv_heads": 2}, "layers.0.attention"),
])
def test_attention_works_with_sharded_heads(name, args, path):
    """Head reshapes infer the local head count, so a sum over head-sharded ranks equals the full attention."""
    example = load(name)
    attn = build(example, **args).get_submodule(path)
    x = torch.randn(2, 32, 64)
    with torch.no_grad():
        full = attn(x)
        sharded = sum(shard_attention(attn, ("wq", "wk", "wv", "wo"), r, 2)(x) for r in range(2))
    torch.testing.assert_close(sharded, full, rtol=1e-4, atol=1e-5)


def test_llama_grouped_query_shapes():
    model = build(load("llama"), d_model=64, n_heads=8, n_kv_heads=2)
    attn = model.layers[0].attention
    head_dim = 64 // 8
    assert attn.wq.out_features == 8 * head_dim and attn.wo.in_features == 8 * head_dim
    assert attn.wk.out_features == attn.wv.out_features == 2 * head_dim
    assert not any(k.endswith("inv_freq") for k in model.state_dict())  # non-persistent
    assert [n for n, _ in model.named_children()] == ["embed", "layers", "norm", "output"]


def test_llama_rope_scores_depend_on_relative_position():
    example = load("llama")
    attn = build(example, n_layers=1).layers[0].attention
    cos, sin = attn.rotary(8, torch.float32)
    q, k = torch.randn(attn.head_dim), torch.randn(attn.head_dim)

    def score(m: int, n: int) -> torch.Tensor:
        rq = q * cos[m] + example.rotate_half(q) * sin[m]
        rk = k * cos[n] + example.rotate_half(k) * sin[n]
        return rq @ rk

    torch.testing.assert_close(score(5, 2), score(3, 0))
    torch.testing.assert_close(score(6, 6), q @ k)
    assert not torch.allclose(score(5, 2), score(2, 2))


def test_llama_rope_refills_after_to_empty():
    example = load("llama")
    reference = build(example, n_layers=1)
    with torch.device("meta"):
        model = example.build_model(n_layers=1)
    model.to_empty(device="cpu")
    for module in model.modules():
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()
    torch.testing.assert_close(model.layers[0].attention.inv_freq, reference.layers[0].attention.inv_freq)


@pytest.mark.parametrize("args", [{}, {"image_size": 16, "depth": 2, "base_width": 4, "num_classes": 3}])
def test_unet_keeps_the_input_resolution(args):
    example = load("unet")
    model = build(example, **args)
    images, targets = example.make_batch(2, **args)
    out = model(images)
    assert out.shape == (2, args.get("num_classes", 4), *images.shape[-2:])
    assert targets.shape == (2, *images.shape[-2:])
    assert len(model.down) == len(model.up) == args.get("depth", 3)


def test_unet_skips_carry_information():
    """With the bottleneck silenced, the output still depends on the image: only through the skips."""
    model = build(load("unet"))
    with torch.no_grad():
        for p in model.mid.parameters():
            p.zero_()
        a, b = model(torch.randn(1, 3, 32, 32)), model(torch.randn(1, 3, 32, 32))
    assert not torch.allclose(a, b)


@pytest.mark.parametrize("widths", ["8,16", [8, 16], (8, 16)])
def test_cnn_widths_forms(widths):
    example = load("cnn")
    model = build(example, widths=widths, image_size=16)
    assert [b.conv2.out_channels for b in model.blocks] == [8, 16]
    images, _ = example.make_batch(2, image_size=16)
    assert model(images).shape == (2, 10)
