"""VGG-style image classifier (Simonyan & Zisserman 2015, "Very Deep Convolutional Networks"), without BatchNorm or dropout.

Each stage is two 3x3 convolutions with ReLU followed by a 2x2 max-pool; a two-layer MLP classifies.

Model args (all optional): image_size=32, in_channels=3, widths="16,32,64" (a comma string or a
list/tuple of ints, one per stage), num_classes=10. image_size must be divisible by 2**len(widths).

Structure (the planner's units are blocks.0 .. blocks.N-1, classifier):
    blocks.i.{conv1, relu1, conv2, relu2, pool}   classifier.{0: Flatten, 1: Linear, 2: ReLU, 3: Linear}
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn


def parse_widths(widths: str | int | Sequence[int]) -> list[int]:
    if isinstance(widths, int):
        return [widths]
    if isinstance(widths, str):
        return [int(w) for w in widths.replace(" ", "").split(",") if w]
    return [int(w) for w in widths]


class ConvBlock(nn.Module):
    def __init__(self, in_channels: int, out_channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, kernel_size=3, padding=1)
        self.relu1 = nn.ReLU()
        self.conv2 = nn.Conv2d(out_channels, out_channels, kernel_size=3, padding=1)
        self.relu2 = nn.ReLU()
        self.pool = nn.MaxPool2d(2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.pool(self.relu2(self.conv2(self.relu1(self.conv1(x)))))


class VGG(nn.Module):
    def __init__(self, image_size: int, in_channels: int, widths: list[int], num_classes: int) -> None:
        super().__init__()
        if not widths or image_size % 2 ** len(widths):
            raise ValueError(f"image_size={image_size} must be divisible by 2**len(widths) (widths={widths})")
        channels = [in_channels, *widths]
        self.blocks = nn.ModuleList(ConvBlock(c_in, c_out) for c_in, c_out in zip(channels, channels[1:]))
        side = image_size // 2 ** len(widths)
        hidden = 4 * widths[-1]
        self.classifier = nn.Sequential(
            nn.Flatten(),
            nn.Linear(widths[-1] * side * side, hidden),
            nn.ReLU(),
            nn.Linear(hidden, num_classes),
        )

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = images
        for block in self.blocks:
            x = block(x)
        return self.classifier(x)


def build_model(
    image_size: int = 32, in_channels: int = 3, widths: str | Sequence[int] = "16,32,64", num_classes: int = 10, **_
) -> VGG:
    return VGG(image_size, in_channels, parse_widths(widths), num_classes)


def make_batch(
    batch_size: int, image_size: int = 32, in_channels: int = 3, num_classes: int = 10, **_
) -> tuple[torch.Tensor, torch.Tensor]:
    images = torch.randn(batch_size, in_channels, image_size, image_size)
    return images, torch.randint(num_classes, (batch_size,))


def loss_fn(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output, targets)
