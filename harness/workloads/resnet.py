"""torchvision's ResNets, with the stem taking the dataset's channel count. Size knob: ``depth``."""

from __future__ import annotations

from torch import nn
from torchvision import models

from harness.workloads.tensors import DataInfo

_CONSTRUCTORS = {
    18: models.resnet18,
    34: models.resnet34,
    50: models.resnet50,
    101: models.resnet101,
    152: models.resnet152,
}


def build(data: DataInfo, depth: int = 18) -> nn.Module:
    if depth not in _CONSTRUCTORS:
        raise ValueError(f"resnet depth must be one of {sorted(_CONSTRUCTORS)}; got {depth}")
    if len(data.input_shape) != 3:
        raise ValueError(
            f"resnet needs image inputs (C, H, W); the dataset gives {data.input_shape}"
        )
    model = _CONSTRUCTORS[depth](weights=None, num_classes=data.num_classes)
    channels = data.input_shape[0]
    if channels != 3:
        old = model.conv1
        model.conv1 = nn.Conv2d(
            channels, old.out_channels, old.kernel_size, old.stride, old.padding, bias=False
        )
    return model
