"""VGG (Simonyan & Zisserman 2015, "Very Deep Convolutional Networks for Large-Scale Image
Recognition"), VGG-16 being PipeDream's (Narayanan et al. 2019) image model, built as torchvision
builds it.

torchvision's wheel on PyPI is linked against the CUDA build of torch and does not import
beside the CPU build this project pins, so the network is written out here with torchvision's
module names and init (`torchvision.models.vgg`): `features` is one nn.Sequential of every
convolution, ReLU(inplace=True) and max-pool, then an adaptive average pool to 7x7 and a
three-layer classifier with dropout. (examples/cnn.py is a small VGG-style model cut into
blocks; this one keeps torchvision's layout.)

Model args (all optional): depth=16 (11, 13, 16 or 19: the paper's configurations A, B, D, E),
num_classes=10, image_size=32, in_channels=3, batch_norm=False (True: torchvision's vgg16_bn),
width=64 (channels of the first convolutions, doubled at each later pool up to 8x; 64 is the
paper's), hidden=4096 (the classifier's width), pool_size=7 (the average pool's output side;
at 32x32 input the features are 1x1 and the pool repeats them 49 times, as torchvision does),
dropout=0.5 (0.0 makes a training step deterministic, e.g. for parity tests).

Structure (the planner's units: every layer of `features`, avgpool, every layer of
`classifier`: torchvision's VGG has no repeated list of blocks, so the planner opens its
top-level Sequentials, and a pipeline may cut between any two layers, as PipeDream's does):
    features.{i: Conv2d | [BatchNorm2d] | ReLU | MaxPool2d}   classifier.{0, 3, 6: Linear}
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# convolution widths in units of `width`, "M" a 2x2 max-pool (the paper's Table 1)
CONFIGS = {
    11: [1, "M", 2, "M", 4, 4, "M", 8, 8, "M", 8, 8, "M"],
    13: [1, 1, "M", 2, 2, "M", 4, 4, "M", 8, 8, "M", 8, 8, "M"],
    16: [1, 1, "M", 2, 2, "M", 4, 4, 4, "M", 8, 8, 8, "M", 8, 8, 8, "M"],
    19: [1, 1, "M", 2, 2, "M", 4, 4, 4, 4, "M", 8, 8, 8, 8, "M", 8, 8, 8, 8, "M"],
}


def make_features(config: list, in_channels: int, width: int, batch_norm: bool) -> nn.Sequential:
    layers: list[nn.Module] = []
    for v in config:
        if v == "M":
            layers.append(nn.MaxPool2d(kernel_size=2, stride=2))
            continue
        conv = nn.Conv2d(in_channels, v * width, kernel_size=3, padding=1)
        layers += [conv, nn.BatchNorm2d(v * width), nn.ReLU(inplace=True)] if batch_norm else [conv, nn.ReLU(inplace=True)]
        in_channels = v * width
    return nn.Sequential(*layers)


class VGG(nn.Module):
    def __init__(self, features: nn.Sequential, out_channels: int, num_classes: int, hidden: int, pool_size: int,
                 dropout: float) -> None:
        super().__init__()
        self.features = features
        self.avgpool = nn.AdaptiveAvgPool2d((pool_size, pool_size))
        self.classifier = nn.Sequential(
            nn.Linear(out_channels * pool_size * pool_size, hidden),
            nn.ReLU(True),
            nn.Dropout(p=dropout),
            nn.Linear(hidden, hidden),
            nn.ReLU(True),
            nn.Dropout(p=dropout),
            nn.Linear(hidden, num_classes),
        )
        # torchvision's init
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
                nn.init.constant_(m.bias, 0)
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.constant_(m.weight, 1)
                nn.init.constant_(m.bias, 0)
            elif isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, 0, 0.01)
                nn.init.constant_(m.bias, 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.avgpool(self.features(x))
        return self.classifier(torch.flatten(x, 1))


def build_model(depth: int = 16, num_classes: int = 10, in_channels: int = 3, batch_norm: bool = False, width: int = 64,
                hidden: int = 4096, pool_size: int = 7, dropout: float = 0.5, **_) -> VGG:
    if int(depth) not in CONFIGS:
        raise ValueError(f"depth={depth}: use one of {sorted(CONFIGS)}")
    features = make_features(CONFIGS[int(depth)], in_channels, width, batch_norm)
    return VGG(features, 8 * width, num_classes, hidden, pool_size, dropout)


def make_batch(batch_size: int, image_size: int = 32, in_channels: int = 3, num_classes: int = 10, **_
               ) -> tuple[torch.Tensor, torch.Tensor]:
    if image_size % 32:
        raise ValueError(f"image_size={image_size}: VGG halves the resolution five times; use a multiple of 32")
    images = torch.randn(batch_size, in_channels, image_size, image_size)
    return images, torch.randint(num_classes, (batch_size,))


def loss_fn(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output, targets)
