"""``timm``: any timm image model by name, untrained or from a local weights file.

``timm.create_model(name, num_classes=..., in_chans=..., img_size=...)`` with the dataset's
classes, channels and image size (many timm models fix their input size when built, so it
comes from the data); every other knob is a ``create_model`` keyword (``depth: 4``,
``drop_path_rate: 0.1``, ``patch_size: 4``). ``pretrained: true`` with ``pretrained_file:
PATH`` (relative to the spec) loads that file the way timm itself does,
``pretrained_cfg_overlay=dict(file=PATH)``: timm re-initialises the classifier when the
dataset's class count differs from the architecture's pretrained config (1000 for ImageNet
models) and adapts the first convolution to the dataset's channels. timm is imported here
only, when a ``timm`` trial builds its model.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from harness.workloads import find_file
from harness.workloads.libraries import import_library
from harness.workloads.tensors import DataInfo


def weights_args(kwargs: dict[str, Any], search: list[str]) -> dict[str, Any]:
    """``create_model``'s pretrained keywords for ``pretrained`` / ``pretrained_file`` (taken
    out of ``kwargs``): without a file, no weights (timm would otherwise download them)."""
    pretrained = bool(kwargs.pop("pretrained", False))
    file = kwargs.pop("pretrained_file", None)
    if not pretrained:
        return {"pretrained": False}
    if file is None:
        raise ValueError("pretrained: true needs pretrained_file (a timm weights file)")
    path = find_file(str(file), search, "timm pretrained_file")
    return {"pretrained": True, "pretrained_cfg_overlay": {"file": path}}


def build(
    data: DataInfo, name: str, python_path: list[str] | None = None, **kwargs: Any
) -> nn.Module:
    timm = import_library("timm", "model family timm")
    if len(data.input_shape) != 3:
        raise ValueError(f"timm models need images (C, H, W); the dataset gives {data.input_shape}")
    channels, height, width = data.input_shape
    size = height if height == width else (height, width)
    weights = weights_args(kwargs, python_path or [])
    args = {**weights, "num_classes": data.num_classes, "in_chans": channels, **kwargs}
    try:
        return timm.create_model(name, img_size=size, **args)
    except TypeError as error:
        if "img_size" not in str(error):
            raise
        return timm.create_model(name, **args)  # a model that takes any input size
