"""Optimizers by name, with ``foreach``/``fused`` set explicitly.

PyTorch picks ``foreach`` by device (on for CUDA, off for CPU), which changes the step's
temporary memory; fixing it makes CPU and GPU runs (and predictions) mean the same thing.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

OPTIMIZERS = ("adam", "adamw", "sgd")


def build_optimizer(
    spec: dict[str, Any], params: Iterable[torch.nn.Parameter]
) -> torch.optim.Optimizer:
    name = spec.get("name", "adam")
    lr = float(spec.get("lr", 1e-3))
    weight_decay = float(spec.get("weight_decay", 0.0))
    foreach = bool(spec.get("foreach", False))
    if name == "adam":
        return torch.optim.Adam(
            params, lr=lr, weight_decay=weight_decay, foreach=foreach, fused=False
        )
    if name == "adamw":
        return torch.optim.AdamW(
            params, lr=lr, weight_decay=weight_decay, foreach=foreach, fused=False
        )
    if name == "sgd":
        momentum = float(spec.get("momentum", 0.0))
        return torch.optim.SGD(
            params,
            lr=lr,
            momentum=momentum,
            weight_decay=weight_decay,
            foreach=foreach,
            fused=False,
        )
    raise ValueError(f"unknown optimizer {name!r}; allowed: {', '.join(OPTIMIZERS)}")
