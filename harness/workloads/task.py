"""How a model trains on a batch: what it is called with, what its loss is, how it is scored.

A ``Workload`` is a model and its ``Task``. The training step, the memory window, the held-out
evaluation and the estimator all go through ``Task.forward`` and ``Task.score``, so no loop
knows which family it runs: the built-in families return logits for ``x``; a Hugging Face model
takes named inputs and labels and returns its own loss; a user's model may do either.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from harness.workloads.loss import cross_entropy
from harness.workloads.tensors import INPUTS, TARGETS, Batch


class Task:
    """The contract. ``forward`` returns the training loss and what the step keeps alive until
    after backward (a training script's ``outputs`` variable; None when nothing outlives the
    loss); ``score`` returns (correct predictions, summed loss, predictions counted) with no
    gradients, for held-out accuracy and loss."""

    def outputs(self, model: nn.Module, batch: Batch) -> Any:
        """The model's outputs for a batch: an inference pass."""
        raise NotImplementedError

    def forward(self, model: nn.Module, batch: Batch) -> tuple[torch.Tensor, Any]:
        raise NotImplementedError

    def score(self, model: nn.Module, batch: Batch) -> tuple[int, float, int]:
        raise NotImplementedError


class Logits(Task):
    """``model(x)`` returns logits; cross-entropy against ``y`` (a class per sample, or the next
    token per position). The logits are not kept: the loss's backward needs only its own."""

    def outputs(self, model: nn.Module, batch: Batch) -> Any:
        return model(batch[INPUTS])

    def forward(self, model: nn.Module, batch: Batch) -> tuple[torch.Tensor, Any]:
        return cross_entropy(self.outputs(model, batch), batch[TARGETS]), None

    def score(self, model: nn.Module, batch: Batch) -> tuple[int, float, int]:
        logits, targets = self.outputs(model, batch), batch[TARGETS]
        loss = cross_entropy(logits, targets, reduction="sum").item()
        return int((logits.argmax(dim=-1) == targets).sum().item()), loss, targets.numel()


@dataclass(frozen=True)
class Workload:
    """A built model and the task it trains on."""

    model: nn.Module
    task: Task
