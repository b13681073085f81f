"""The strategy interface: a few hooks into the training loop, each a no-op by default.

A strategy overrides only the hooks it needs, so strategies compose by being applied in order
(the order of the spec's list). The loop calls the hooks at these points:

1. ``environment()`` - before anything touches CUDA (allocator settings).
2. ``prepare_model(model, ctx)`` - after the model is built and moved to the device, before
   the optimizer exists (checkpointing, low-precision parameters, pruning, compilation).
3. ``optimizer(spec, ctx)`` - may replace the optimizer spec (sgd, adafactor, ...).
4. ``prepare_batch(x)`` - each floating-point tensor of a batch, once on the device (memory
   format, dtype).
5. ``micro_batches()`` / ``zero_grad_set_to_none()`` / ``step_context()`` - how a step runs.
6. ``after_training(model, ctx)`` - extra measurements on the trained model (metrics dict).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn


class StrategyError(ValueError):
    """A strategy cannot apply to this model (no blocks to checkpoint, ...): the trial ends
    before it trains, with this message, and the estimate says so in its row."""


@dataclass
class TrialContext:
    """What strategies may need to know about the trial they change."""

    device: torch.device
    dtype: str  # the grid's dtype axis: fp32 | bf16 | fp16 (autocast)
    family: str
    data: Any  # harness.workloads.tensors.SplitData (CPU tensors); None while estimating
    batch_size: int
    task: Any = None  # harness.workloads.task.Task: how the model is called and scored
    notes: dict[str, Any] = field(default_factory=dict)

    @property
    def estimating(self) -> bool:
        """True when the step runs on fake tensors to predict memory (no data, no peers)."""
        return self.data is None


class Strategy:
    name = "base"

    def __init__(self, arg: str | None = None) -> None:
        self.arg = arg

    def environment(self) -> dict[str, str]:
        return {}

    def prepare_model(self, model: nn.Module, ctx: TrialContext) -> nn.Module:
        return model

    def optimizer(self, spec: dict[str, Any], ctx: TrialContext) -> dict[str, Any]:
        return spec

    def prepare_batch(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def micro_batches(self) -> int:
        return 1

    def zero_grad_set_to_none(self) -> bool:
        return True

    def step_context(self) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()

    def after_training(self, model: nn.Module, ctx: TrialContext) -> dict[str, float]:
        return {}
