"""Registries of model families and datasets.

The registries themselves are plain data (no torch import), so the sweep layer can validate a spec
against them without loading model code; ``build_model`` / ``load_dataset`` import the one module
they need. Adding a family or dataset: one module plus one entry here.
"""

from __future__ import annotations

import importlib
import sys
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Knob:
    """One size knob of a model family: a positive integer, optionally from a fixed set."""

    name: str
    doc: str
    choices: tuple[int, ...] = ()


@dataclass(frozen=True)
class Family:
    name: str
    doc: str
    builder: str  # "module:function" taking (knobs..., data=DataInfo)
    knobs: tuple[Knob, ...]
    defaults: dict[str, int] = field(default_factory=dict)

    @property
    def knob_names(self) -> list[str]:
        return [k.name for k in self.knobs]


@dataclass(frozen=True)
class DatasetInfo:
    name: str
    doc: str
    loader: str  # "module:function" taking (options, seed) -> SplitData
    options: tuple[str, ...] = ()


FAMILIES: dict[str, Family] = {
    "cnn": Family(
        "cnn",
        "the seed article's CNN: two conv+ReLU+maxpool blocks, then a linear head",
        "harness.workloads.cnn:build",
        (Knob("width", "channels of the first conv block (the second has 2x)"),),
        {"width": 16},
    ),
    "mlp": Family(
        "mlp",
        "flatten, then `depth` hidden Linear+ReLU layers of `width` units, then a linear head",
        "harness.workloads.mlp:build",
        (Knob("width", "units per hidden layer"), Knob("depth", "number of hidden layers")),
        {"width": 128, "depth": 2},
    ),
    "resnet": Family(
        "resnet",
        "torchvision ResNet (18/34/50/101/152), stem adapted to the dataset's channels",
        "harness.workloads.resnet:build",
        (Knob("depth", "ResNet depth", (18, 34, 50, 101, 152)),),
        {"depth": 18},
    ),
}

DATASETS: dict[str, DatasetInfo] = {
    "digits": DatasetInfo(
        "digits",
        "scikit-learn's bundled 8x8 handwritten digits (1,797 images, 10 classes); offline",
        "harness.workloads.digits:load",
        ("test_fraction",),
    ),
    "cifar10": DatasetInfo(
        "cifar10",
        "CIFAR-10 (50,000 + 10,000 32x32 colour images, its own test split held out); "
        "downloaded by torchvision into data_dir",
        "harness.workloads.cifar10:load",
        ("data_dir", "download"),
    ),
    "synthetic": DatasetInfo(
        "synthetic",
        "random tensors of a given shape and class count, for pure memory/speed runs",
        "harness.workloads.synthetic:load",
        ("shape", "num_classes", "num_samples", "test_fraction"),
    ),
}


def is_user_family(name: str) -> bool:
    """User model code is named ``package.module:attribute``."""
    module, sep, attr = name.partition(":")
    return bool(sep and module and attr)


def resolve(path: str, python_path: list[str] | None = None) -> Any:
    """Import ``module:attr``; ``python_path`` entries are tried first (user code next to a spec)."""
    for entry in reversed(python_path or []):
        if entry not in sys.path:
            sys.path.insert(0, entry)
    module_name, _, attr = path.partition(":")
    module = importlib.import_module(module_name)
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ImportError(f"module {module_name!r} has no attribute {attr!r}") from None


def build_model(
    family: str, knobs: dict[str, Any], data: Any, python_path: list[str] | None = None
) -> Any:
    """Build the family's ``nn.Module`` for the dataset described by ``data`` (a ``DataInfo``).

    A user family ``module:attr`` is called as ``attr(data=DataInfo, **knobs)``.
    """
    if family in FAMILIES:
        builder = resolve(FAMILIES[family].builder)
        return builder(data, **{**FAMILIES[family].defaults, **knobs})
    if is_user_family(family):
        return resolve(family, python_path)(data=data, **knobs)
    raise ValueError(f"unknown model family {family!r}")


def load_dataset(name: str, options: dict[str, Any], seed: int) -> Any:
    """Load the dataset's train/held-out ``SplitData`` on the CPU."""
    if name not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}; allowed: {', '.join(DATASETS)}")
    return resolve(DATASETS[name].loader)(options, seed)
