"""A pipeline stage that runs single forward and backward actions with point-to-point messages.

torch.distributed.pipelining runs a whole batch per `step` call, with fixed peers, and cannot
express what two of our executors need: a stage whose peer changes per micro-batch (PipeDream's
replicated stages, runtime/pp_replicated.py) and a schedule that never flushes, where one step's
forwards run while the previous step's backwards drain, on other weights (PipeDream-2BW,
runtime/pp_async.py). This class is the piece both need, written in torch's style: the stage
module is a `make_stage` product (runtime/pp_split.py, the model's own forward replayed for the
stage's units), a micro-batch's forward receives its inputs from the peer that ran it on the
previous stage and sends its outputs on, its backward receives the output gradients and sends
the input gradients back; `dist.isend` / `dist.irecv` (gloo on CPU, NCCL on GPU).

Shapes. A tensor crossing a cut has one shape and dtype for every micro-batch (static shapes),
but not always the trace's: tensor parallelism with sequence parallelism, autocast, or glue
that branches on values change them. So, as torch's stages do with their first step's
metadata inference, the first activation sent under each key to each peer goes with a header
(its dtype and shape); the receiver keeps it for every later micro-batch from that peer (a
replicated stage hears from several). Gradients have the shapes and
dtypes of the activations they belong to, which the receiving stage produced itself.

Order. Sends never block (waited for in `finish`); between two ranks, the messages in one
direction are of one kind (activations forward, gradients back) and posted in the same order
on both sides, so receives match sends in order. The executors prove their schedules free of
deadlock.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from runtime.pp_split import restore_output, stage_spec

HEADER = 10
"""int64 words of a shape header: dtype code, rank, and up to 8 sizes."""
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.bool,
          torch.uint8, torch.int8, torch.float8_e4m3fn, torch.float8_e5m2]
"""Dtypes a header can name, by position."""


class P2PStage:
    """One rank's stage module and the messages of its micro-batches (module docstring).

    `send_peer(i)` / `recv_peer(i)`: the rank running micro-batch i on the next / previous
    stage. `loss_fn(output, targets)` on the last stage; its loss is divided by `scale` (the
    micro-batches of a step) before the backward."""

    def __init__(self, module: nn.Module, stage: int, num_stages: int, device: torch.device,
                 send_peer: Callable[[int], int], recv_peer: Callable[[int], int], loss_fn, scale: int):
        self.module, self.stage, self.device, self.loss_fn, self.scale = module, stage, device, loss_fn, scale
        self.send_peer, self.recv_peer = send_peer, recv_peer
        self.last = stage == num_stages - 1
        spec = stage_spec(module)
        self.in_keys, self.out_keys = spec.in_keys, spec.out_keys
        self._received: dict[tuple[Any, int], tuple[torch.dtype, tuple[int, ...]]] = {}
        """Dtype and shape of each (input key, source rank), from its first header."""
        self._headed: set[tuple[Any, int]] = set()
        """(Output key, destination rank) pairs whose header was sent."""
        self._pending: list = []
        self._inputs: dict[int, tuple] = {}
        self._outputs: dict[int, Any] = {}
        """Per micro-batch in flight: the last stage's scaled loss, else the stage's output tensors."""

    def _irecv(self, buffer: torch.Tensor, src: int) -> torch.Tensor:
        work = dist.irecv(buffer, src)
        assert work is not None, "irecv without a work handle: this rank is not in the default group"
        work.wait()
        return buffer

    def _recv_activations(self, src: int) -> list[torch.Tensor]:
        out = []
        for key in self.in_keys:
            if (key, src) not in self._received:
                header = self._irecv(torch.empty(HEADER, dtype=torch.int64, device=self.device), src).tolist()
                self._received[key, src] = (DTYPES[header[0]], tuple(header[2:2 + header[1]]))
            dtype, shape = self._received[key, src]
            out.append(self._irecv(torch.empty(shape, dtype=dtype, device=self.device), src))
        return out

    def _send(self, t: torch.Tensor, dst: int) -> None:
        t = t.detach().contiguous()
        self._pending.append(dist.isend(t, dst))

    def _send_activations(self, output, dst: int) -> None:
        for key, t in zip(self.out_keys, output, strict=True):
            if (key, dst) not in self._headed:
                if t.dim() > HEADER - 2 or t.dtype not in DTYPES:
                    raise TypeError(f"Stage {self.stage} sends {key} as {t.dtype} {tuple(t.shape)}: a header names "
                                    f"up to {HEADER - 2} dimensions of {DTYPES}.")
                sizes = list(t.shape) + [0] * (HEADER - 2 - t.dim())
                self._send(torch.tensor([DTYPES.index(t.dtype), t.dim(), *sizes], dtype=torch.int64,
                                        device=self.device), dst)
                self._headed.add((key, dst))
            self._send(t, dst)

    def forward(self, microbatch: int, inputs: tuple, targets) -> torch.Tensor | None:
        """Forward of `microbatch`; on the last stage its loss / scale (for the report), else None."""
        if self.stage == 0:
            args = inputs
        else:
            received = self._recv_activations(self.recv_peer(microbatch))
            args = tuple(t.requires_grad_(True) if t.is_floating_point() else t for t in received)
        output = self.module(*args)
        self._inputs[microbatch] = args
        if self.last:
            loss = self.loss_fn(restore_output(self.module, output), targets) / self.scale
            self._outputs[microbatch] = loss
            return loss.detach()
        self._outputs[microbatch] = output
        self._send_activations(output, self.send_peer(microbatch))
        return None

    def backward(self, microbatch: int) -> None:
        """Backward of `microbatch`: its output gradients received (or its loss), its input gradients sent."""
        output, args = self._outputs.pop(microbatch), self._inputs.pop(microbatch)
        if self.last:
            torch.autograd.backward(output)
        else:
            src = self.send_peer(microbatch)
            pairs = [(t, self._irecv(torch.empty_like(t), src)) for t in output if t.is_floating_point()]
            pairs = [(t, g) for t, g in pairs if t.requires_grad]
            if pairs:
                torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])
        if self.stage > 0:
            dst = self.recv_peer(microbatch)
            for t in args:
                if t.is_floating_point():
                    self._send(t.grad if t.grad is not None else torch.zeros_like(t), dst)

    def finish(self) -> None:
        """Wait for the sends posted so far (their buffers must live until then)."""
        for work in self._pending:
            work.wait()
        self._pending = []
