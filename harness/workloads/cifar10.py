"""CIFAR-10: torchvision downloads and verifies the archive; we read its on-disk batches.

The on-disk format (``cifar-10-batches-py/data_batch_{1..5}``, ``test_batch``: pickled dicts of
``data`` uint8 N x 3072 and ``labels``) is read here directly, so the loading code is testable on
small files written in the same format. CIFAR-10's own train/test split is the held-out split.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import torch

from harness.workloads.tensors import INPUTS, TARGETS, DataInfo, SplitData

FOLDER = "cifar-10-batches-py"
TRAIN_FILES = tuple(f"data_batch_{i}" for i in range(1, 6))
TEST_FILE = "test_batch"
NUM_CLASSES = 10
# Per-channel statistics of the training set, the usual normalisation.
MEAN = (0.4914, 0.4822, 0.4465)
STD = (0.2470, 0.2435, 0.2616)


def _read_batch(path: Path) -> tuple[torch.Tensor, torch.Tensor]:
    with path.open("rb") as handle:
        entry = pickle.load(handle, encoding="latin1")
    data = torch.as_tensor(entry["data"], dtype=torch.uint8).reshape(-1, 3, 32, 32)
    labels = torch.as_tensor(entry.get("labels", entry.get("fine_labels")), dtype=torch.long)
    return data, labels


def _normalise(images: torch.Tensor) -> torch.Tensor:
    mean = torch.tensor(MEAN).view(1, 3, 1, 1)
    std = torch.tensor(STD).view(1, 3, 1, 1)
    return (images.float() / 255.0 - mean) / std


def ensure_downloaded(root: Path, download: bool) -> Path:
    folder = root / FOLDER
    if all((folder / name).exists() for name in (*TRAIN_FILES, TEST_FILE)):
        return folder
    if not download:
        raise FileNotFoundError(
            f"CIFAR-10 not found under {folder}; set data.download: true (needs internet) "
            "or place the extracted cifar-10-batches-py folder there"
        )
    from torchvision.datasets import CIFAR10

    CIFAR10(root=str(root), train=True, download=True)  # downloads, checks md5, extracts
    return folder


def describe(options: dict[str, Any]) -> DataInfo:
    return DataInfo((3, 32, 32), NUM_CLASSES)


def load(options: dict[str, Any], seed: int) -> SplitData:
    folder = ensure_downloaded(
        Path(options.get("data_dir") or "data"), bool(options.get("download"))
    )
    train = [_read_batch(folder / name) for name in TRAIN_FILES]
    test_x, test_y = _read_batch(folder / TEST_FILE)
    train_x = torch.cat([x for x, _ in train])
    train_y = torch.cat([y for _, y in train])
    return SplitData(
        {INPUTS: _normalise(train_x), TARGETS: train_y},
        {INPUTS: _normalise(test_x), TARGETS: test_y},
        NUM_CLASSES,
    )
