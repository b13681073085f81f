"""The strategy interface: a few hooks into the training loop, each a no-op by default.

A strategy overrides only the hooks it needs, so strategies compose by being applied in order
(the order of the spec's list). The loop calls the hooks at these points:

1. ``environment()`` - before anything touches CUDA (allocator settings).
2. ``prepare_model(model, ctx)`` - after the model is built and moved to the device, before
   the optimizer exists (checkpointing, low-precision parameters, pruning, compilation).
   ``prepare_task(task, model, ctx)`` - then: may replace how the model is called and what its
   loss is (``chunked_ce``'s loss over chunks of tokens).
   ``shard_options()`` - asked before that: arguments other strategies add to FSDP's
   ``fully_shard`` (``fsdp_mixed``'s mixed-precision policy, ``fsdp_offload``'s CPU offload).
3. ``optimizer(settings, ctx)`` - may replace the optimizer settings (sgd, adafactor, ...).
4. ``prepare_batch(x)`` - each floating-point tensor of a batch, once on the device (memory
   format, dtype).
5. ``micro_batches()`` / ``zero_grad_set_to_none()`` / ``step_context()`` /
   ``batch_context(batch)`` - how a step runs.
6. ``after_training(model, ctx)`` - extra measurements on the trained model (metrics dict).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from harness.strategies.layout import Layout
from harness.strategies.settings import LoraSettings, OptimizerSettings


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
    lora: LoraSettings = field(default_factory=LoraSettings)  # train.lora (lora, qlora read it)
    # What the strategies' shard_options() asked of fully_shard (fsdp reads it).
    shard_options: dict[str, Any] = field(default_factory=dict)
    # How a strategy builds new modules (adapters): as the model was built, so while estimating
    # for real with the large tensors on meta (harness.trial.fake.construct_on_meta).
    construction: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext
    notes: dict[str, Any] = field(default_factory=dict)
    # How the trial's ranks are arranged, and their device mesh once a strategy built it
    # (``harness.strategies.mesh``): a torch DeviceMesh.
    layout: Layout = field(default_factory=Layout)
    mesh: Any = None
    submeshes: dict[str, Any] = field(default_factory=dict)  # flattened ones, made once
    rank: int = 0  # this process's rank in the trial (the estimator's: the role it predicts)
    pipeline_micro_batches: int = 1  # pp:N's micro-batches per step (accumulate:K, else 2N)
    # The names of every strategy of the trial (``float8`` gathers fp8 weights under fsdp only).
    combination: tuple[str, ...] = ()

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

    def load_libraries(self) -> None:
        """Import the libraries ``prepare_model`` imports, ahead of it: the estimator calls this
        before it enters its fake world, where tensors a library makes at import time (peft's
        default arguments) would be counted as the step's."""

    def prepare_model(self, model: nn.Module, ctx: TrialContext) -> nn.Module:
        return model

    def prepare_task(self, task: Any, model: nn.Module, ctx: TrialContext) -> Any:
        """The task the step runs (``harness.workloads.task.Task``), after ``prepare_model``."""
        return task

    def shard_options(self, ctx: TrialContext) -> dict[str, Any]:
        return {}

    def optimizer(self, settings: OptimizerSettings, ctx: TrialContext) -> OptimizerSettings:
        return settings

    def prepare_batch(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def micro_batches(self) -> int:
        return 1

    def zero_grad_set_to_none(self) -> bool:
        return True

    def step_context(self) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()

    def batch_context(
        self, batch: dict[str, torch.Tensor]
    ) -> contextlib.AbstractContextManager[Any]:
        """Entered around one micro-batch's forward and backward, with that micro-batch (a
        dict the strategy may change in place: ``cp`` splits its sequences)."""
        return contextlib.nullcontext()

    def after_training(self, model: nn.Module, ctx: TrialContext) -> dict[str, float]:
        return {}
