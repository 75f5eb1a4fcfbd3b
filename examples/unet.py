"""A small U-Net for per-pixel segmentation (Ronneberger et al. 2015), without BatchNorm or dropout.

The skip connections cross block boundaries: the top-level forward keeps the stem's and every
down block's output in a Python list, and each up block takes the matching one, so the stem's
output is consumed by the last up block and crosses every pipeline cut in between.

Model args (all optional): image_size=32, in_channels=3, base_width=8, depth=3, num_classes=4.
image_size must be divisible by 2**depth.

Structure (the planner's units are stem, down.0 .. down.D-1, mid, up.0 .. up.D-1, head):
    stem   down.i.{conv, relu, pool}   mid.{0: Conv2d, 1: ReLU}   up.i.{upsample, conv, relu}   head
Channels: stem -> w, down.i -> w*2**(i+1) at 1/2**(i+1) resolution; up.i halves the channels
and doubles the resolution, then concatenates the skip of that resolution.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Down(nn.Module):
    """3x3 conv + ReLU, then halve the resolution."""

    def __init__(self, in_channels: int, out_channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, kernel_size=3, padding=1)
        self.relu = nn.ReLU()
        self.pool = nn.MaxPool2d(2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.pool(self.relu(self.conv(x)))


class Up(nn.Module):
    """Double the resolution (halving the channels), concatenate the skip, 3x3 conv + ReLU."""

    def __init__(self, in_channels: int, out_channels: int) -> None:
        super().__init__()
        self.upsample = nn.ConvTranspose2d(in_channels, out_channels, kernel_size=2, stride=2)
        self.conv = nn.Conv2d(2 * out_channels, out_channels, kernel_size=3, padding=1)
        self.relu = nn.ReLU()

    def forward(self, x: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        x = torch.cat([self.upsample(x), skip], dim=1)
        return self.relu(self.conv(x))


class UNet(nn.Module):
    def __init__(self, image_size: int, in_channels: int, base_width: int, depth: int, num_classes: int) -> None:
        super().__init__()
        if depth < 1 or image_size % 2**depth:
            raise ValueError(f"image_size={image_size} must be divisible by 2**depth (depth={depth} >= 1)")
        widths = [base_width * 2**i for i in range(depth + 1)]  # widths[i]: channels at 1/2**i resolution
        self.stem = nn.Conv2d(in_channels, widths[0], kernel_size=3, padding=1)
        self.down = nn.ModuleList(Down(widths[i], widths[i + 1]) for i in range(depth))
        self.mid = nn.Sequential(nn.Conv2d(widths[depth], widths[depth], kernel_size=3, padding=1), nn.ReLU())
        self.up = nn.ModuleList(Up(widths[i + 1], widths[i]) for i in reversed(range(depth)))
        self.head = nn.Conv2d(widths[0], num_classes, kernel_size=1)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.stem(images)
        skips = [x]
        for block in self.down:
            x = block(x)
            skips.append(x)
        x = self.mid(skips.pop())  # the deepest output feeds the bottleneck, not a skip
        for block in self.up:
            x = block(x, skips.pop())
        return self.head(x)


def build_model(
    image_size: int = 32, in_channels: int = 3, base_width: int = 8, depth: int = 3, num_classes: int = 4, **_
) -> UNet:
    return UNet(image_size, in_channels, base_width, depth, num_classes)


def make_batch(
    batch_size: int, image_size: int = 32, in_channels: int = 3, num_classes: int = 4, **_
) -> tuple[torch.Tensor, torch.Tensor]:
    images = torch.randn(batch_size, in_channels, image_size, image_size)
    return images, torch.randint(num_classes, (batch_size, image_size, image_size))


def loss_fn(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per-pixel cross entropy: (b, classes, H, W) logits against (b, H, W) labels."""
    return F.cross_entropy(output, targets)
