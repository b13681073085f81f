"""A multi-layer perceptron over flattened inputs. Size knobs: ``width`` and ``depth``.

Each hidden Linear+ReLU pair is one entry of ``blocks`` (what checkpointing and structured
pruning work on).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from harness.workloads.tensors import DataInfo


class MLP(nn.Module):
    def __init__(self, in_features: int, width: int, depth: int, num_classes: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList()
        features = in_features
        for _ in range(depth):
            self.blocks.append(nn.Sequential(nn.Linear(features, width), nn.ReLU()))
            features = width
        self.head = nn.Linear(features, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.flatten(1)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def build(data: DataInfo, width: int = 128, depth: int = 2) -> nn.Module:
    return MLP(math.prod(data.input_shape), width, depth, data.num_classes)
