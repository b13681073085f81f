"""Held-out accuracy and loss of a trained model (per token for sequence models)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

from harness.workloads.task import Task
from harness.workloads.tensors import Batch, num_samples, take

EVAL_BATCH = 512  # at most this many held-out samples per forward pass


@torch.no_grad()
def evaluate(
    model: torch.nn.Module,
    task: Task,
    test: Batch,
    device: torch.device,
    autocast: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext,
    prepare_batch: Callable[[Batch], Batch] = lambda batch: batch,
    batch_size: int = EVAL_BATCH,
) -> dict[str, float]:
    """``accuracy`` and mean ``eval_loss`` over the held-out split as the task scores them, in
    the trial's autocast dtype and with its strategies' batch preparation, ``batch_size``
    samples (at most ``EVAL_BATCH``) per forward: no larger than what the trial trained on, so
    evaluation cannot run out of memory where training fitted."""
    step = max(1, min(batch_size, EVAL_BATCH))
    was_training = model.training
    model.eval()
    correct, loss_sum, count = 0, 0.0, 0
    for start in range(0, num_samples(test), step):
        part = take(test, slice(start, start + step))
        batch = prepare_batch({name: t.to(device) for name, t in part.items()})
        with autocast():
            hits, loss, counted = task.score(model, batch)
        correct, loss_sum, count = correct + hits, loss_sum + loss, count + counted
    model.train(was_training)
    return {"accuracy": correct / count, "eval_loss": loss_sum / count}
