"""Random inputs and labels of a chosen shape: measures memory and speed, not learning."""

from __future__ import annotations

from typing import Any

import torch

from harness.contract import DEFAULT_TEST_FRACTION
from harness.workloads.tensors import DataInfo, SplitData, split

DEFAULT_SHAPE = (3, 32, 32)


def describe(options: dict[str, Any]) -> DataInfo:
    return DataInfo(
        tuple(options.get("shape") or DEFAULT_SHAPE), int(options.get("num_classes") or 10)
    )


def load(options: dict[str, Any], seed: int) -> SplitData:
    shape = tuple(options.get("shape") or DEFAULT_SHAPE)
    num_classes = int(options.get("num_classes") or 10)
    num_samples = int(options.get("num_samples") or 2048)
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn((num_samples, *shape), generator=generator)
    y = torch.randint(0, num_classes, (num_samples,), generator=generator)
    return split(x, y, num_classes, options.get("test_fraction", DEFAULT_TEST_FRACTION), seed)
