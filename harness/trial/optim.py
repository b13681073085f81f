"""Optimizers by name, with ``foreach``/``fused`` set explicitly.

PyTorch picks ``foreach`` by device (on for CUDA, off for CPU), which changes the step's
temporary memory; fixing it makes CPU and GPU runs (and predictions) mean the same thing.
Where an optimizer has no such switch (torchao's 8-bit AdamW compiles its own step) there is
nothing to fix. The settings and their defaults are ``harness.strategies.settings``'s.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from harness.compat.internals import disable_current_modes
from harness.contract import OPTIMIZERS
from harness.strategies.settings import OptimizerSettings
from harness.workloads.libraries import import_library


def build_optimizer(
    settings: OptimizerSettings, params: Iterable[torch.nn.Parameter]
) -> torch.optim.Optimizer:
    name, lr, weight_decay, foreach = (
        settings.name,
        settings.lr,
        settings.weight_decay,
        settings.foreach,
    )
    if name == "adam":
        return torch.optim.Adam(
            params, lr=lr, weight_decay=weight_decay, foreach=foreach, fused=False
        )
    if name == "adamw":
        return torch.optim.AdamW(
            params, lr=lr, weight_decay=weight_decay, foreach=foreach, fused=False
        )
    if name == "sgd":
        return torch.optim.SGD(
            params,
            lr=lr,
            momentum=settings.momentum,
            weight_decay=weight_decay,
            foreach=foreach,
            fused=False,
        )
    if name == "adafactor":
        # Adafactor has a foreach implementation but no fused one.
        return torch.optim.Adafactor(params, lr=lr, weight_decay=weight_decay, foreach=foreach)
    if name == "adam8bit":
        return adamw_8bit(params, lr=lr, weight_decay=weight_decay)
    raise ValueError(f"unknown optimizer {name!r}; allowed: {', '.join(OPTIMIZERS)}")


def adamw_8bit(
    params: Iterable[torch.nn.Parameter], lr: float, weight_decay: float
) -> torch.optim.Optimizer:
    """torchao's AdamW with 8-bit blockwise-quantized moments, imported only when asked for.

    torchao is a dependency of harness but may be missing on a bare GPU box that has only
    PyTorch: a trial that asks for it there fails with a message that says how to get it. Its step is built per parameter
    with ``torch.compile(fullgraph=True)``, so it needs a working compiler for the device (a
    C++ compiler on CPU, Triton on CUDA) and its first step takes seconds (tens of seconds on
    a cold compile cache).

    ``fullgraph=True`` refuses to run while a Python ``TorchDispatchMode`` is active, and the
    memory window's tensor accounting (``MemTracker``) is one. So the step runs with such
    modes suspended. Nothing measurable is lost: the state is updated in place (its storages
    stay the ones the tracker registered), and the compiled kernels' scratch buffers are
    allocated below the dispatcher, where the tracker cannot see them anyway (on CUDA the
    allocator's own counters still do).
    """
    AdamW8bit = import_library("torchao.optim", "adam8bit", "pip install torchao").AdamW8bit

    class AdamW8bitUntracked(AdamW8bit):
        def step(self, closure: Any = None) -> Any:
            with disable_current_modes():
                return super().step(closure)

    # torchao's default weight decay is 1e-2: pass the trial's own value so adam8bit differs
    # from adamw only in how the moments are stored.
    return AdamW8bitUntracked(params, lr=lr, weight_decay=weight_decay)
