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

from harness.strategies.base import Strategy, TrialContext
from harness.strategies.settings import LoraSettings
from harness.trial.config import TrialConfig
from harness.trial.distributed import Ranks
from harness.trial.fake import construct_on_meta
from harness.trial.optim import build_optimizer
from harness.trial.precision import Precision
from harness.workloads import build_workload, without_weights
from harness.workloads.convert import convert
from harness.workloads.task import Task
from harness.workloads.tensors import Batch, DataInfo, SplitData, chunks


@dataclass(frozen=True)
class Setup:
    config: TrialConfig
    device: torch.device
    ranks: Ranks
    precision: Precision
    strategies: tuple[Strategy, ...]
    context: TrialContext
    model: nn.Module  # as the strategies left it (checkpointed, wrapped, compiled, ...)
    task: Task  # how it is called on a batch and what its loss is
    optimizer: torch.optim.Optimizer
    micro_batches: int  # per optimizer step (accumulate:K)
    set_to_none: bool  # how zero_grad frees gradients (keep_grads: in place)
    samples_per_step: int  # this rank's samples (tokens for sequence models) per step
    num_params: int  # trainable parameters as built
    num_params_total: int  # all parameters, frozen ones (a LoRA base) included
    # What the trial reports about its setup (MLflow tags): optimizer name, throughput unit,
    # world size, and what strategies did (checkpoint segments, pruned parameters, ...).
    info: dict[str, Any]

    @property
    def micro_batch_size(self) -> int:
        """Samples one forward pass of this rank takes in training (what is known to fit)."""
        return max(1, self.config.batch_size // self.ranks.batch_parts // self.micro_batches)

    def prepare_batch(self, batch: Batch) -> Batch:
        """A batch as the strategies want it on the device: each floating-point tensor (the
        inputs; labels and token ids are integers) in their memory format and dtype."""
        prepared = dict(batch)
        for name, tensor in batch.items():
            if tensor.is_floating_point():
                for strategy in self.strategies:
                    tensor = strategy.prepare_batch(tensor)
                prepared[name] = tensor
        return prepared

    def to_device(self, batch: Batch) -> Batch:
        """This rank's slice of a global batch, on the device, prepared."""
        moved = {
            k: self.ranks.shard(t).to(self.device, non_blocking=True) for k, t in batch.items()
        }
        return self.prepare_batch(moved)

    def train_step(
        self, batch: Batch, on_micro_batch: Callable[[], None] | None = None
    ) -> torch.Tensor:
        """One optimizer step over ``micro_batches`` forward+backward passes; the summed loss.

        What the task keeps of a forward (a script's ``outputs``) lives until its backward is
        done. ``on_micro_batch`` runs after each backward (the memory window resets its
        per-module statistics there).
        """
        self.optimizer.zero_grad(set_to_none=self.set_to_none)
        if self.task.runs_step:  # a pipeline stage: its schedule runs forwards and backwards
            with contextlib.ExitStack() as stack:
                for strategy in self.strategies:
                    stack.enter_context(strategy.step_context())
                with self.precision.autocast():
                    total = self.task.step(batch)
            if on_micro_batch is not None:
                on_micro_batch()
            self.precision.step(self.optimizer)
            return total
        total = torch.zeros((), device=self.device)
        for part in chunks(batch, self.micro_batches):
            with contextlib.ExitStack() as stack:
                for strategy in self.strategies:
                    stack.enter_context(strategy.step_context())
                    stack.enter_context(strategy.batch_context(part))
                with self.precision.autocast():
                    loss, kept = self.task.forward(self.model, part)
                    loss = loss / self.micro_batches
                self.precision.backward(loss)
            del kept
            if on_micro_batch is not None:
                on_micro_batch()
            total += loss.detach().float()
        self.precision.step(self.optimizer)
        return total


def applying_order(strategies: tuple[Strategy, ...]) -> list[Strategy]:
    """The order strategies change the model in: the spec's, except that the layouts that split
    the model itself come first, as they must (a pipeline stage is cut from the whole model,
    then its blocks split over tensor ranks, then sharded by FSDP): ``pp``, ``tp``, ``cp``; then
    ``float8``, whose fp8 layers FSDP and recomputation must see (torchtitan's order)."""
    first = ("pp", "tp", "cp", "float8")
    return sorted(
        strategies,
        key=lambda s: first.index(s.name) if s.name in first else len(first),
    )


def build_setup(
    config: TrialConfig,
    device: torch.device,
    ranks: Ranks,
    data_info: DataInfo,
    data: SplitData | None,
    built: tuple[Strategy, ...] | None = None,
) -> Setup:
    """Build the model on ``device``, let each strategy change it in list order, swap the
    optimizer where a strategy says so, and build that with ``foreach`` fixed.

    ``data`` is None when estimating on fake tensors: then there is no data, no GradScaler
    (its inf check reads values) and no strategy the registry marks ``eager_only``.
    ``built``: the trial's strategy objects (``Combination.build``), when its caller already
    holds them (a trial builds them once, for its environment, prediction and training); a
    strategy's hooks set whatever state they keep afresh on each model they are applied to.
    """
    estimating = data is None
    terms = config.strategy.terms
    strategies = tuple(
        strategy
        for term, strategy in zip(terms, built or config.strategy.build(), strict=True)
        if not (estimating and term.info.eager_only)
    )
    precision = Precision(config.dtype, device, scaler=not estimating)
    # The estimate builds the model for real with its large tensors on meta (harness.trial.fake)
    # and convert() makes them fake: constructors that read values see the real ones. It builds
    # from the config alone: pretrained weights' values change no byte, and are not read.
    knobs = without_weights(config.knobs) if estimating else config.knobs
    with construct_on_meta() if estimating else contextlib.nullcontext():
        workload = build_workload(
            config.model_family, knobs, data_info, config.python_path, config.model_loss
        )
    context = TrialContext(
        device,
        config.dtype,
        config.model_family,
        data,
        config.batch_size,
        workload.task,
        lora=config.lora or LoraSettings(),
        construction=construct_on_meta if estimating else contextlib.nullcontext,
        layout=config.strategy.layout,
        rank=ranks.rank,
        pipeline_micro_batches=config.strategy.pipeline_micro_batches,
        combination=tuple(config.strategy.names),
    )
    for strategy in strategies:
        context.shard_options.update(strategy.shard_options(context))
    model = convert(workload.model, device, materialize_meta=estimating)
    for strategy in applying_order(strategies):
        model = strategy.prepare_model(model, context)
    task = workload.task
    for strategy in strategies:
        task = strategy.prepare_task(task, model, context)
    optimizer_settings = config.optimizer
    for strategy in strategies:
        optimizer_settings = strategy.optimizer(optimizer_settings, context)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = build_optimizer(optimizer_settings, trainable)
    tokens = data_info.tokens_per_sample
    info = {
        **workload.notes,
        **context.notes,
        # What trained, which an optimizer strategy may have changed (``sgd_momentum:0.05``).
        "optimizer": optimizer_settings.name,
        "lr": optimizer_settings.lr,
        "momentum": optimizer_settings.momentum,
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
        task=task,
        optimizer=optimizer,
        # A pipeline splits the batch into its micro-batches itself (accumulate:K's K).
        micro_batches=1 if task.runs_step else math.prod(s.micro_batches() for s in strategies),
        set_to_none=all(s.zero_grad_set_to_none() for s in strategies),
        # This rank's share: each sample counted once over all ranks (a tensor-parallel pair
        # trains on the same samples).
        samples_per_step=config.batch_size * tokens // ranks.size,
        num_params=sum(p.numel() for p in trainable),
        num_params_total=sum(p.numel() for p in model.parameters()),
        info=info,
    )
