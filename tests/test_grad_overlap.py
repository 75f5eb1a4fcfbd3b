"""ZeRO 0's overlapped gradient averaging (runtime/apply_dp.py `GradientReducer`) against the
synchronous `average_gradients`: the same averages, bit for bit up to summation order, with
buckets launched while the backward runs. Whole runs under it: tests/test_runtime_parity.py
(every ZeRO 0 layout with dp > 1 takes this path)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from tests.ranks import free_port


def _entry(rank: int, world: int, port: int, scaling: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        _stages(rank) if scaling == "stages-scaled-apart" else _worker(rank, world, scaling)
    finally:
        dist.destroy_process_group()
    os._exit(0)  # as runtime/__main__.py: gloo may abort at interpreter teardown


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(*[nn.Linear(16, 16) for _ in range(6)])
        self.unused = nn.Linear(4, 4)  # no micro-batch reaches it: no gradient, no step
        self.by_hand = nn.Parameter(torch.ones(16))  # its gradient set without a hook (zero-bubble's W step)

    def forward(self, x):
        return self.layers(x) * self.by_hand.detach()


def _model() -> nn.Module:
    torch.manual_seed(0)
    return _Net()


def _backward(model: nn.Module, rank: int, m: int, scale: float) -> None:
    """m micro-batches, rank-dependent data; the loss divided by m unless the caller scales after."""
    for k in range(m):
        torch.manual_seed(100 * rank + k)
        x = torch.randn(8, 16)
        model(x).pow(2).mean().mul(scale).backward()
    model.by_hand.grad = torch.full((16,), float(rank + 1))


def _check(reference: nn.Module, overlapped: nn.Module) -> None:
    for (name, a), b in zip(reference.named_parameters(), overlapped.parameters(), strict=True):
        if a.grad is None:
            assert b.grad is None, name
            continue
        # Summation order only (flat buckets of different sizes): a few ulps of O(1) values.
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-6, atol=1e-7, msg=name)


def _worker(rank: int, world: int, scaling: str) -> None:
    from runtime.apply_dp import GradientReducer, average_gradients

    m = 3
    reference, overlapped = _model(), _model()
    _backward(reference, rank, m, 1 / m)
    average_gradients([reference], dist.group.WORLD)
    # 600 bytes: a bucket per one or two Linears, so most buckets go out during the backward.
    reducer = GradientReducer([overlapped], dist.group.WORLD, bucket_bytes=600)
    assert len(reducer.buckets) > 3
    for step in range(2):  # a second step reuses the hooks, with rebuilt buckets
        overlapped.zero_grad(set_to_none=True)
        reducer.start_step(m)
        after = scaling == "scaled-after-backward"
        _backward(overlapped, rank, m, 1.0 if after else 1 / m)
        if after:  # the pipeline path: gradients divided by m after the backward (torch's scale_grads)
            hooked = [p for p in overlapped.parameters() if p.grad is not None and p is not overlapped.by_hand]
            for p in hooked:
                p.grad.div_(m)
            reducer.note_scaled(hooked, 1 / m)
        # From the second step the buckets follow the first step's ready order, so they go out
        # from the hooks, before the backward ended (the first-built order starts with `by_hand`).
        assert reducer.hidden_launches > (3 if step else -1)
        reducer.finish()
        _check(reference, overlapped)


def _stages(rank: int) -> None:
    """Two stages on one rank, as interleaved 1F1B holds them: the later stage's backward ends
    first and torch divides its gradients by m at once, while the earlier stage's last backward
    is still to come; one bucket holds both, so it goes out with one stage divided and one not."""
    from runtime.apply_dp import GradientReducer, average_gradients

    m = 3

    def stages() -> list[nn.Module]:
        torch.manual_seed(0)
        return [nn.Linear(16, 16), nn.Linear(16, 16)]

    def run(pair: list[nn.Module], reducer=None) -> None:
        early, late = pair
        for k in range(m):
            torch.manual_seed(100 * rank + k)
            x = torch.randn(8, 16)
            late(x).pow(2).mean().backward()
        late.weight.grad.div_(m)
        late.bias.grad.div_(m)
        if reducer is not None:
            reducer.note_scaled(late.parameters(), 1 / m)
        for k in range(m):
            torch.manual_seed(200 * rank + k)
            early(torch.randn(8, 16)).pow(2).mean().div(m).backward()

    reference, overlapped = stages(), stages()
    run(reference)
    average_gradients(reference, dist.group.WORLD)
    reducer = GradientReducer(overlapped, dist.group.WORLD)  # the default 25 MiB: one bucket for both
    assert len(reducer.buckets) == 1
    reducer.start_step(m)
    run(overlapped, reducer)
    assert reducer.hidden_launches == 1  # sent from the earlier stage's last hook
    reducer.finish()
    for a, b in zip(reference, overlapped, strict=True):
        _check(a, b)


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("scaling", ["scaled-in-loss", "scaled-after-backward", "stages-scaled-apart"])
def test_overlapped_reduction_equals_the_synchronous_one(scaling):
    mp.spawn(_entry, args=(2, free_port(), scaling), nprocs=2, join=True)
