"""One trial's training objects, built by ONE function for training and for the estimate alike.

``build_setup`` turns a ``TrialConfig`` into everything a training step needs: device and ranks,
precision, the strategies, the model they changed, the optimizer, how a step is split into
micro-batches and how gradients are zeroed. The training loop and the fake-tensor estimate both
call it and both step through ``Setup.train_step``, so what runs is what is predicted by
construction, not by keeping two copies in step.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from harness.strategies import build_strategies
from harness.strategies.base import Strategy, TrialContext
from harness.trial.config import TrialConfig
from harness.trial.distributed import Ranks
from harness.trial.optim import build_optimizer
from harness.trial.precision import Precision
from harness.workloads import build_model
from harness.workloads.convert import convert
from harness.workloads.loss import cross_entropy
from harness.workloads.tensors import DataInfo, SplitData

# Strategies that cannot run on fake tensors and change no tensor's size: the estimate leaves
# them out (``compile`` is predicted eagerly, which is also what the memory window measures).
EAGER_ONLY = ("compile",)


@dataclass(frozen=True)
class Setup:
    config: TrialConfig
    device: torch.device
    ranks: Ranks
    precision: Precision
    strategies: tuple[Strategy, ...]
    context: TrialContext
    model: nn.Module
    optimizer: torch.optim.Optimizer
    micro_batches: int  # per optimizer step (accumulate:K)
    set_to_none: bool  # how zero_grad frees gradients (keep_grads: in place)
    samples_per_step: int  # this rank's samples (tokens for sequence models) per step
    num_params: int  # trainable parameters as built
    # What the trial reports about its setup (MLflow tags): optimizer name, throughput unit,
    # world size, and what strategies did (checkpoint segments, pruned parameters, ...).
    info: dict[str, Any]

    def prepare_batch(self, x: torch.Tensor) -> torch.Tensor:
        """An input batch as the strategies want it on the device (memory format, dtype)."""
        for strategy in self.strategies:
            x = strategy.prepare_batch(x)
        return x

    def to_device(
        self, batch: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's slice of a global batch, on the device, prepared."""
        x, y = (self.ranks.shard(t).to(self.device, non_blocking=True) for t in batch)
        return self.prepare_batch(x), y

    def train_step(
        self,
        x: torch.Tensor,
        y: torch.Tensor,
        on_micro_batch: Callable[[], None] | None = None,
    ) -> torch.Tensor:
        """One optimizer step over ``micro_batches`` forward+backward passes; the summed loss.

        ``on_micro_batch`` runs after each backward (the memory window resets its per-module
        statistics there).
        """
        self.optimizer.zero_grad(set_to_none=self.set_to_none)
        total = torch.zeros((), device=self.device)
        for x_part, y_part in zip(
            x.chunk(self.micro_batches), y.chunk(self.micro_batches), strict=True
        ):
            with contextlib.ExitStack() as stack:
                for strategy in self.strategies:
                    stack.enter_context(strategy.step_context())
                with self.precision.autocast():
                    loss = cross_entropy(self.model(x_part), y_part) / self.micro_batches
                self.precision.backward(loss)
            if on_micro_batch is not None:
                on_micro_batch()
            total += loss.detach().float()
        self.precision.step(self.optimizer)
        return total


def build_setup(
    config: TrialConfig,
    device: torch.device,
    ranks: Ranks,
    data_info: DataInfo,
    data: SplitData | None,
) -> Setup:
    """Build the model on ``device``, let each strategy change it in list order, swap the
    optimizer where a strategy says so, and build that with ``foreach`` fixed.

    ``data`` is None when estimating on fake tensors: then there is no data, no GradScaler
    (its inf check reads values) and no ``EAGER_ONLY`` strategy.
    """
    estimating = data is None
    strategies = tuple(
        strategy
        for strategy in build_strategies(config.strategy)
        if not (estimating and strategy.name in EAGER_ONLY)
    )
    precision = Precision(config.dtype, device, scaler=not estimating)
    context = TrialContext(device, config.dtype, config.model_family, data, config.batch_size)
    model = convert(
        build_model(config.model_family, config.knobs, data_info, config.python_path), device
    )
    for strategy in strategies:
        model = strategy.prepare_model(model, context)
    optimizer_spec = dict(config.optimizer)
    for strategy in strategies:
        optimizer_spec = strategy.optimizer(optimizer_spec, context)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = build_optimizer(optimizer_spec, trainable)
    tokens = data_info.tokens_per_sample
    info = {
        **context.notes,
        "optimizer": optimizer_spec["name"],
        "throughput_unit": "tokens/s" if tokens > 1 else "samples/s",
        "world_size": ranks.size,
    }
    return Setup(
        config=config,
        device=device,
        ranks=ranks,
        precision=precision,
        strategies=strategies,
        context=context,
        model=model,
        optimizer=optimizer,
        micro_batches=math.prod(s.micro_batches() for s in strategies),
        set_to_none=all(s.zero_grad_set_to_none() for s in strategies),
        samples_per_step=config.batch_size // ranks.size * tokens,
        num_params=sum(p.numel() for p in trainable),
        info=info,
    )
