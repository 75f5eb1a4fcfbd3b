"""A unit's backward working set (planner/profiler/counters.py `LiveBytes`,
`UnitCosts.backward_working_bytes`): what its backward holds at once beyond what it saved, counted
alike on every device, and held by the memory model at a stage's backward moment, apart from the
loss's moment (planner/solver/search.py `StageBuffers.working`)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from planner.cluster import make_cluster
from planner.profiler import profile_model
from planner.profiler.counters import LiveBytes
from planner.solver.solve import Pins, solve
from tests.conftest import EXAMPLES

GPT = dict(n_layers=4, d_model=64, n_heads=4, d_ff=256, vocab_size=128, seq_len=32)


def _working(module: nn.Module, x: torch.Tensor) -> int:
    counter = LiveBytes(exclude=list(module.parameters()))
    with torch.autograd.graph.saved_tensors_hooks(lambda t: (counter.watch(t), t)[1], lambda t: t):
        y = module(x)
    grad = torch.ones_like(y)  # handed to the backward, not its own
    with counter:
        y.backward(grad)
    return counter.peak


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_a_linear_s_backward_holds_its_gradients(device):
    # addmm's backward: the input's gradient (8 x 64), the weight's (256 x 64) and the bias's (256).
    linear = nn.Linear(64, 256, device=device)
    x = torch.randn(8, 64, device=device, requires_grad=True)
    assert _working(linear, x) == 4 * (8 * 64 + 256 * 64 + 256)


def test_released_activations_are_given_back():
    # Two linears: the second's saved input (the first's output) is released once its backward
    # is done, before the first's backward makes its gradients; the peak is not the sum of all.
    net = nn.Sequential(nn.Linear(64, 512), nn.Linear(512, 64))
    x = torch.randn(64, 64, requires_grad=True)
    hidden_grad, grads = 4 * 64 * 512, 4 * sum(p.numel() for p in net.parameters())
    peak = _working(net, x)
    assert peak < hidden_grad + grads + 4 * 64 * 64  # never everything at once
    assert peak >= 4 * (512 * 64 + 64) + hidden_grad  # the second linear's gradients and its input's


def test_profiles_count_it_alike_on_cpu_and_meta():
    measured = profile_model(str(EXAMPLES / "gpt.py"), GPT, [2], device="cpu", repeats=1)
    analytic = profile_model(str(EXAMPLES / "gpt.py"), GPT, [2], device="meta", gpu="cpu", dtype="float32")
    for m, a in zip(measured.units[:-1], analytic.units[:-1], strict=True):
        for field in ("backward_working_bytes", "backward_working_held_bytes"):
            w_m, w_a = getattr(m.costs[2], field), getattr(a.costs[2], field)
            assert w_m is not None and w_a is not None
            assert w_m == pytest.approx(w_a, rel=0.02), (m.name, field)
    # The head's backward starts from the loss: meta's cross-entropy backward makes one more
    # logits-sized temporary than CPU's kernel does (the safe side).
    assert analytic.units[-1].costs[2].backward_working_bytes >= measured.units[-1].costs[2].backward_working_bytes
    block = next(u for u in analytic.units if u.name == "blocks.0").costs[2]
    # The MLP's hidden gradient (2 x 32 x 256 fp32) is part of a block's working set, with its
    # gradients or without; the new gradients make the first backward's larger.
    assert block.backward_working_held_bytes >= 4 * 2 * 32 * 256
    assert block.backward_working_bytes > block.backward_working_held_bytes


def test_a_pipeline_stage_holds_the_working_set_at_its_backward():
    profile = profile_model(str(EXAMPLES / "gpt.py"), GPT, [2], device="meta", gpu="cpu", dtype="float32")
    blocks = max(u.costs[2].backward_working_held_bytes for u in profile.units if u.name.startswith("blocks"))
    plan = solve(profile, make_cluster(2, gpu="cpu"), 8, Pins(pp=2, dp=1, tp=1, micro_batch_size=2, schedule="1f1b",
                                                               recompute="none"))
    first, last = plan.prediction.memory_terms_bytes
    assert first["loss"] == 0
    # The first stage's peak: a block's backward on top of its in-flight micro-batches (the
    # gradients held: the working set without the new gradients, which add into them).
    assert first["gradients"] > 0 and first["transient"] >= blocks
    # The last stage holds the larger of its two moments: the loss, or a block's working set after it.
    loss_moment = last["loss"] > 0
    assert loss_moment or last["transient"] >= blocks
    without = [u.model_copy(update={"costs": {k: c.model_copy(update={"backward_working_bytes": None,
                                                                        "backward_working_held_bytes": None})
                                               for k, c in u.costs.items()}}) for u in profile.units]
    n0, n = len(plan.stages[0].units), len(profile.units)
    older = solve(profile.model_copy(update={"units": without}), make_cluster(2, gpu="cpu"), 8,
                  Pins(pp=2, dp=1, tp=1, micro_batch_size=2, schedule="1f1b", recompute="none"),
                  cuts=lambda chunks: ((0, n0), (n0, n)))
    assert plan.prediction.peak_memory_bytes[0] - older.prediction.peak_memory_bytes[0] == pytest.approx(
        first["transient"] - older.prediction.memory_terms_bytes[0]["transient"])
    assert plan.prediction.peak_memory_bytes[0] > older.prediction.peak_memory_bytes[0]


def test_a_sparse_gradient_and_a_storage_less_tensor_are_counted_or_passed_over():
    # nn.Embedding(sparse=True) makes a sparse COO gradient, which has no storage of its own: its
    # indices and values are counted. A profile of such a model must not fail.
    embedding = nn.Embedding(100, 16, sparse=True)
    x = torch.randint(0, 100, (4, 8))
    counter = LiveBytes(exclude=list(embedding.parameters()))
    y = embedding(x)
    grad = torch.ones_like(y)
    with counter:
        y.backward(grad)
    assert counter.peak >= 4 * 8 * 16 * 4  # the gradient's values, one row per looked-up index
    assert counter.peak_without([embedding.weight.grad]) < counter.peak
