"""In-memory datasets as tensors: a train/held-out split and a seeded batch iterator.

Everything the trial needs is small enough to live on the device, so throughput measures the
model, not a data loader (design notes §7).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DataInfo:
    """What a model builder needs to know about the data."""

    input_shape: tuple[int, ...]  # per sample, e.g. (1, 8, 8); (seq_len,) for token ids
    num_classes: int  # classes, or the vocabulary size for next-token prediction
    tokens_per_sample: int = 1  # > 1: one label per token, throughput in tokens/s


@dataclass
class SplitData:
    train_x: torch.Tensor
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor
    num_classes: int

    @property
    def info(self) -> DataInfo:
        per_sample = self.train_y[0].numel() if self.train_y.dim() > 1 else 1
        return DataInfo(tuple(self.train_x.shape[1:]), self.num_classes, per_sample)


def split(
    x: torch.Tensor, y: torch.Tensor, num_classes: int, test_fraction: float, seed: int
) -> SplitData:
    """Seeded shuffle, then hold out the last ``test_fraction`` of samples for evaluation."""
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    n_test = max(1, round(len(x) * test_fraction))
    test, train = order[:n_test], order[n_test:]
    return SplitData(x[train], y[train], x[test], y[test], num_classes)


def batches(
    x: torch.Tensor, y: torch.Tensor, batch_size: int, seed: int
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Endless epochs of shuffled full batches (the ragged tail is dropped so memory stays constant)."""
    if batch_size > len(x):
        raise ValueError(
            f"batch_size {batch_size} is larger than the training split ({len(x)} samples)"
        )
    generator = torch.Generator().manual_seed(seed)
    while True:
        order = torch.randperm(len(x), generator=generator).to(x.device)
        for start in range(0, len(x) - batch_size + 1, batch_size):
            index = order[start : start + batch_size]
            yield x[index], y[index]


def steps_per_epoch(num_samples: int, batch_size: int) -> int:
    return max(1, num_samples // batch_size)
