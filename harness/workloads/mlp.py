"""A plain multi-layer perceptron over flattened inputs. Size knobs: ``width`` and ``depth``."""

from __future__ import annotations

import math

from torch import nn

from harness.workloads.tensors import DataInfo


def build(data: DataInfo, width: int = 128, depth: int = 2) -> nn.Module:
    layers: list[nn.Module] = [nn.Flatten()]
    features = math.prod(data.input_shape)
    for _ in range(depth):
        layers += [nn.Linear(features, width), nn.ReLU()]
        features = width
    layers.append(nn.Linear(features, data.num_classes))
    return nn.Sequential(*layers)
