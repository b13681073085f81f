"""Held-out accuracy and loss of a trained model (per token for sequence models)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

from harness.workloads.loss import cross_entropy
from harness.workloads.tensors import SplitData

EVAL_BATCH = 512  # held-out samples per forward pass


@torch.no_grad()
def evaluate(
    model: torch.nn.Module,
    data: SplitData,
    device: torch.device,
    autocast: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext,
    prepare_batch: Callable[[torch.Tensor], torch.Tensor] = lambda x: x,
) -> dict[str, float]:
    """``accuracy`` and mean cross-entropy ``eval_loss`` over the held-out split, in the
    trial's autocast dtype and with its strategies' batch preparation."""
    was_training = model.training
    model.eval()
    correct, loss_sum, count = 0, 0.0, 0
    for start in range(0, len(data.test_x), EVAL_BATCH):
        x = prepare_batch(data.test_x[start : start + EVAL_BATCH].to(device))
        y = data.test_y[start : start + EVAL_BATCH].to(device)
        with autocast():
            logits = model(x)
        loss_sum += cross_entropy(logits, y, reduction="sum").item()
        correct += (logits.argmax(dim=-1) == y).sum().item()
        count += y.numel()
    model.train(was_training)
    return {"accuracy": correct / count, "eval_loss": loss_sum / count}
