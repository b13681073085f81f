"""``timm``: any timm image model by name, untrained (``pretrained=False``).

``timm.create_model(name, num_classes=..., in_chans=..., img_size=...)`` with the dataset's
classes, channels and image size (many timm models fix their input size when built, so it
comes from the data); every other knob is a ``create_model`` keyword (``depth: 4``,
``drop_path_rate: 0.1``, ``patch_size: 4``). timm is imported here only, when a ``timm``
trial builds its model.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from harness.workloads.tensors import DataInfo


def build(data: DataInfo, name: str, **kwargs: Any) -> nn.Module:
    try:
        import timm
    except ImportError as error:
        raise RuntimeError(
            f"model family timm needs timm (pip install 'harness[models]'): {error}"
        ) from None
    if len(data.input_shape) != 3:
        raise ValueError(f"timm models need images (C, H, W); the dataset gives {data.input_shape}")
    channels, height, width = data.input_shape
    size = height if height == width else (height, width)
    args = {"pretrained": False, "num_classes": data.num_classes, "in_chans": channels, **kwargs}
    try:
        return timm.create_model(name, img_size=size, **args)
    except TypeError as error:
        if "img_size" not in str(error):
            raise
        return timm.create_model(name, **args)  # a model that takes any input size
