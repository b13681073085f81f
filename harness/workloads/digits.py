"""scikit-learn's bundled 8x8 digits, read straight from the CSV file the package ships.

Reading the file (rather than importing scikit-learn) keeps the trial layer on torch + stdlib;
scikit-learn need only be installed, which the project's dependencies guarantee.
"""

from __future__ import annotations

import csv
import gzip
import importlib.util
from pathlib import Path
from typing import Any

import torch

from harness.contract import DEFAULT_TEST_FRACTION
from harness.workloads.tensors import DataInfo, SplitData, split

NUM_CLASSES = 10


def digits_csv_path() -> Path:
    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "dataset 'digits' needs scikit-learn installed (it ships the digits file): "
            "pip install scikit-learn"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / "datasets" / "data" / "digits.csv.gz"
    if not path.exists():
        raise FileNotFoundError(f"scikit-learn's digits file is missing: {path}")
    return path


def describe(options: dict[str, Any]) -> DataInfo:
    return DataInfo((1, 8, 8), NUM_CLASSES)


def load(options: dict[str, Any], seed: int) -> SplitData:
    with gzip.open(digits_csv_path(), "rt") as handle:
        rows = [[int(v) for v in row] for row in csv.reader(handle) if row]
    table = torch.tensor(rows, dtype=torch.float32)
    images = (table[:, :64] / 16.0).reshape(-1, 1, 8, 8)
    labels = table[:, 64].long()
    return split(
        images, labels, NUM_CLASSES, options.get("test_fraction", DEFAULT_TEST_FRACTION), seed
    )
