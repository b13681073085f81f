"""torchvision's ResNets, with the stem taking the dataset's channel count. Size knob: ``depth``."""

from __future__ import annotations

from typing import cast

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
        # A Conv2d's kernel_size, stride and padding are pairs (torch types those of every
        # convolution as tuple[int, ...]).
        model.conv1 = nn.Conv2d(
            channels,
            old.out_channels,
            cast(tuple[int, int], old.kernel_size),
            cast(tuple[int, int], old.stride),
            cast(tuple[int, int] | str, old.padding),
            bias=False,
        )
    return model
