"""The seed article's CNN: conv-ReLU-maxpool twice, then a linear head. Size knob: ``width``.

Each conv-ReLU-maxpool is one entry of ``blocks`` (what checkpointing and pruning work on).
"""

from __future__ import annotations

from torch import nn

from harness.workloads.tensors import DataInfo


class SmallCNN(nn.Module):
    def __init__(self, in_channels: int, height: int, width_px: int, num_classes: int, width: int):
        super().__init__()
        self.blocks = nn.ModuleList(
            [
                nn.Sequential(
                    nn.Conv2d(in_channels, width, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2)
                ),
                nn.Sequential(
                    nn.Conv2d(width, 2 * width, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2)
                ),
            ]
        )
        self.head = nn.Linear(2 * width * (height // 4) * (width_px // 4), num_classes)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x.flatten(1))


def build(data: DataInfo, width: int = 16) -> nn.Module:
    if len(data.input_shape) != 3:
        raise ValueError(f"cnn needs image inputs (C, H, W); the dataset gives {data.input_shape}")
    channels, height, width_px = data.input_shape
    if height < 4 or width_px < 4:
        raise ValueError(f"cnn needs images of at least 4x4 pixels; got {height}x{width_px}")
    return SmallCNN(channels, height, width_px, data.num_classes, width)
