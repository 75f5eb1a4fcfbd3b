"""ResNet (He et al. 2016, "Deep Residual Learning for Image Recognition"), the image model of
PipeDream (Narayanan et al. 2019) and GPipe (Huang et al. 2019), built as torchvision builds it.

torchvision's wheel on PyPI is linked against the CUDA build of torch and does not import
beside the CPU build this project pins, so the network is written out here with torchvision's
module names, block order and init (`torchvision.models.resnet`, v1.5: the stride of a
down-sampling bottleneck sits on its 3x3 convolution), so that a state_dict loads either way.
Kept as torchvision has it, on purpose: BatchNorm in training mode, and ReLU(inplace=True),
which overwrites the output of the BatchNorm before it, including across a unit boundary.

Model args (all optional): depth=50 (18, 34, 50, 101 or 152), num_classes=10, image_size=64,
in_channels=3, width=64 (channels of the stem and of layer1; each later layer doubles them.
64 is the paper's; a smaller width keeps tests fast), groups=1 and width_per_group=64
(ResNeXt / wide ResNet, as torchvision's), norm="batch" ("group": GroupNorm with 32 groups or
fewer (Wu & He 2018), whose output does not depend on the rest of the batch).
The stem and layers 2-4 halve the resolution five times (224 -> 7, 64 -> 2, 32 -> 1); the
average pool takes whatever is left. BatchNorm in training mode needs more than one value per
channel, so a micro-batch of 1 needs image_size 64 or more (as torchvision's ResNet does).

Structure (the planner's units: conv1, bn1, relu, maxpool, layer1.0 .. layer4.K, avgpool, fc;
layer1 .. layer4 are nn.Sequential of one block class, so each block is a unit):
    layerI.J.{conv1, bn1, conv2, bn2, [conv3, bn3,] relu, [downsample.{0: conv, 1: norm}]}
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

# blocks per layer, as in the paper's Table 1
LAYERS = {18: ("basic", [2, 2, 2, 2]), 34: ("basic", [3, 4, 6, 3]), 50: ("bottleneck", [3, 4, 6, 3]),
          101: ("bottleneck", [3, 4, 23, 3]), 152: ("bottleneck", [3, 8, 36, 3])}


def _norm_layer(norm: str) -> Callable[[int], nn.Module]:
    if norm == "batch":
        return nn.BatchNorm2d
    if norm == "group":
        return lambda channels: nn.GroupNorm(min(32, channels), channels)
    raise ValueError(f"norm={norm!r}: use 'batch' or 'group'")


def conv3x3(in_planes: int, out_planes: int, stride: int = 1, groups: int = 1) -> nn.Conv2d:
    return nn.Conv2d(in_planes, out_planes, kernel_size=3, stride=stride, padding=1, groups=groups, bias=False)


def conv1x1(in_planes: int, out_planes: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(in_planes, out_planes, kernel_size=1, stride=stride, bias=False)


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, inplanes: int, planes: int, stride: int, downsample: nn.Module | None, groups: int,
                 base_width: int, norm_layer: Callable[[int], nn.Module]) -> None:
        super().__init__()
        if groups != 1 or base_width != 64:
            raise ValueError("depth 18 and 34 (BasicBlock) take only groups=1 and width_per_group=64")
        self.conv1 = conv3x3(inplanes, planes, stride)
        self.bn1 = norm_layer(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = conv3x3(planes, planes)
        self.bn2 = norm_layer(planes)
        self.downsample = downsample

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity
        return self.relu(out)


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, inplanes: int, planes: int, stride: int, downsample: nn.Module | None, groups: int,
                 base_width: int, norm_layer: Callable[[int], nn.Module]) -> None:
        super().__init__()
        width = int(planes * (base_width / 64.0)) * groups
        self.conv1 = conv1x1(inplanes, width)
        self.bn1 = norm_layer(width)
        self.conv2 = conv3x3(width, width, stride, groups)
        self.bn2 = norm_layer(width)
        self.conv3 = conv1x1(width, planes * self.expansion)
        self.bn3 = norm_layer(planes * self.expansion)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity
        return self.relu(out)


class ResNet(nn.Module):
    def __init__(self, depth: int, num_classes: int, in_channels: int, width: int, groups: int, width_per_group: int,
                 norm: str) -> None:
        super().__init__()
        if depth not in LAYERS:
            raise ValueError(f"depth={depth}: use one of {sorted(LAYERS)}")
        kind, counts = LAYERS[depth]
        block = BasicBlock if kind == "basic" else Bottleneck
        self._norm_layer = _norm_layer(norm)
        self.inplanes, self.groups, self.base_width = width, groups, width_per_group
        self.conv1 = nn.Conv2d(in_channels, width, kernel_size=7, stride=2, padding=3, bias=False)
        self.bn1 = self._norm_layer(width)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        self.layer1 = self._make_layer(block, width, counts[0])
        self.layer2 = self._make_layer(block, 2 * width, counts[1], stride=2)
        self.layer3 = self._make_layer(block, 4 * width, counts[2], stride=2)
        self.layer4 = self._make_layer(block, 8 * width, counts[3], stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(8 * width * block.expansion, num_classes)
        # torchvision's init (He et al. 2015 for the convolutions, identity norms)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, (nn.BatchNorm2d, nn.GroupNorm)):
                nn.init.constant_(m.weight, 1)
                nn.init.constant_(m.bias, 0)

    def _make_layer(self, block, planes: int, blocks: int, stride: int = 1) -> nn.Sequential:
        downsample = None
        if stride != 1 or self.inplanes != planes * block.expansion:
            downsample = nn.Sequential(conv1x1(self.inplanes, planes * block.expansion, stride),
                                       self._norm_layer(planes * block.expansion))
        layers = [block(self.inplanes, planes, stride, downsample, self.groups, self.base_width, self._norm_layer)]
        self.inplanes = planes * block.expansion
        layers += [block(self.inplanes, planes, 1, None, self.groups, self.base_width, self._norm_layer)
                   for _ in range(1, blocks)]
        return nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        x = torch.flatten(self.avgpool(x), 1)
        return self.fc(x)


def build_model(depth: int = 50, num_classes: int = 10, in_channels: int = 3, width: int = 64, groups: int = 1,
                width_per_group: int = 64, norm: str = "batch", **_) -> ResNet:
    return ResNet(int(depth), num_classes, in_channels, width, groups, width_per_group, norm)


def make_batch(batch_size: int, image_size: int = 64, in_channels: int = 3, num_classes: int = 10, **_
               ) -> tuple[torch.Tensor, torch.Tensor]:
    images = torch.randn(batch_size, in_channels, image_size, image_size)
    return images, torch.randint(num_classes, (batch_size,))


def loss_fn(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output, targets)
