"""Any torchvision classification model, by name, as a model file (random weights, no download).

    planner profile examples/torchvision_model.py -a name=convnext_tiny -a image_size=224 --device meta --gpu h100-80gb

`name` is any of `torchvision.models.list_models(torchvision.models)` (resnet50, efficientnet_b0,
vit_b_16, swin_t, densenet121, regnet_y_400mf, ...). Dropout and stochastic depth are set to 0
unless `random=True`, so that every layout of a plan trains to the same losses as one process
(torchvision's EfficientNet, Swin and ConvNeXt draw random numbers in training). A model with
batch norm normalises over each micro-batch: layouts match one process at the same micro-batch
size. Needs torchvision built for the installed torch (`pip install torchvision`; for the CPU
build of torch, from https://download.pytorch.org/whl/cpu).
"""

from __future__ import annotations

import torch

try:
    import torchvision
except ImportError as exc:  # the planner reports it with this file's name
    raise ImportError("examples/torchvision_model.py needs torchvision (pip install torchvision, built for your torch)") from exc


def build_model(name: str = "resnet50", num_classes: int = 1000, image_size: int = 224, random: bool = False, **_):
    extra = {"image_size": image_size} if name.startswith("vit_") else {}
    if name in ("googlenet", "inception_v3"):
        extra |= {"aux_logits": False, "init_weights": True}
    model = torchvision.models.get_model(name, weights=None, num_classes=num_classes, **extra)
    if not random:
        for module in model.modules():
            if isinstance(module, torch.nn.Dropout) or type(module).__name__ == "StochasticDepth":
                module.p = 0.0
    return model


def make_batch(batch_size: int, image_size: int = 224, num_classes: int = 1000, **_):
    return torch.randn(batch_size, 3, image_size, image_size), torch.randint(num_classes, (batch_size,))
