"""How a model trains on a batch: what it is called with, what its loss is, how it is scored.

A ``Workload`` is a model and its ``Task``. The training step, the memory window, the held-out
evaluation and the estimator all go through ``Task.forward`` and ``Task.score``, so no loop
knows which family it runs: the built-in families return logits for ``x``; a Hugging Face model
takes named inputs and labels and returns its own loss; a user's model may do either.
"""

from __future__ import annotations

from dataclasses import dataclass, field
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

    # A task whose ``step`` runs a whole optimizer step's forwards and backwards itself (a
    # pipeline's schedule): the loop calls it instead of ``forward`` and ``backward``.
    runs_step = False

    def step(self, batch: Batch) -> torch.Tensor:
        """The step's mean loss over its micro-batches."""
        raise NotImplementedError

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


IGNORE = -100  # the label value that takes no part in loss or accuracy (PyTorch's, HF's)


def field_of(outputs: Any, name: str) -> Any:
    """``outputs.loss`` / ``outputs["logits"]``: a dict or a ``ModelOutput`` alike; None if
    absent (a plain tensor of logits has neither)."""
    if isinstance(outputs, torch.Tensor):
        return None
    if isinstance(outputs, dict):
        return outputs.get(name)
    return getattr(outputs, name, None)


def logits_of(outputs: Any) -> torch.Tensor:
    if isinstance(outputs, torch.Tensor):
        return outputs
    logits = field_of(outputs, "logits")
    if logits is None:
        raise ValueError(
            f"the model returned {type(outputs).__name__} without logits: return a tensor of "
            "logits, or a dict / ModelOutput with 'logits' (and 'loss')"
        )
    return logits


def count_correct(logits: torch.Tensor, labels: torch.Tensor, shift: bool) -> tuple[int, int]:
    """(correct argmax predictions, predictions counted): per position for sequences (the
    logits at t predict the label at t+1 when ``shift``), where the label is not ``IGNORE``."""
    if shift:
        logits, labels = logits[:, :-1], labels[:, 1:]
    valid = labels != IGNORE
    hits = (logits.argmax(dim=-1) == labels) & valid
    return int(hits.sum().item()), int(valid.sum().item())


def is_causal_lm(model: nn.Module) -> bool:
    """A Hugging Face causal LM (its labels are the inputs; it shifts them itself)."""
    model = getattr(model, "_orig_mod", model)  # torch.compile
    model = getattr(model, "module", model) if hasattr(model, "no_sync") else model  # DDP
    return type(model).__name__.endswith(("ForCausalLM", "LMHeadModel"))


class UserModel(Task):
    """A user's model, in whichever form it comes.

    Calls: ``model(x)`` on the built-in datasets' ``x``/``y`` batches; ``model(**batch)`` on
    named batches (a user's data, with ``labels`` among them, so a Hugging Face model computes
    its own loss). Outputs: a tensor of logits, or a dict / ``ModelOutput`` with ``loss`` and/or
    ``logits``. Loss: the user's ``loss(outputs, batch)`` if the spec names one, else the
    outputs' ``loss``, else cross-entropy of the logits against ``y`` (or ``labels``), position
    by position, ignoring -100. Accuracy: argmax of the logits against the same labels (shifted
    by one for a Hugging Face causal LM). Outputs other than a plain tensor stay alive until
    backward is done, as in the user's own loop.
    """

    def __init__(self, loss: Any = None) -> None:
        self.loss = loss

    def outputs(self, model: nn.Module, batch: Batch) -> Any:
        if INPUTS in batch:
            return model(batch[INPUTS])
        return model(**{k: v for k, v in batch.items() if k not in ("labels", TARGETS)})

    def _forward(self, model: nn.Module, batch: Batch) -> Any:
        return model(batch[INPUTS]) if INPUTS in batch else model(**batch)

    def _loss(self, outputs: Any, batch: Batch) -> torch.Tensor:
        if self.loss is not None:
            return self.loss(outputs, batch)
        own = field_of(outputs, "loss")
        if own is not None:
            return own
        return cross_entropy(logits_of(outputs), labels_of(batch))

    def forward(self, model: nn.Module, batch: Batch) -> tuple[torch.Tensor, Any]:
        outputs = self._forward(model, batch)
        return self._loss(outputs, batch), None if isinstance(outputs, torch.Tensor) else outputs

    def score(self, model: nn.Module, batch: Batch) -> tuple[int, float, int]:
        outputs = self._forward(model, batch)
        correct, count = count_correct(logits_of(outputs), labels_of(batch), is_causal_lm(model))
        return correct, float(self._loss(outputs, batch).item()) * count, count


def labels_of(batch: Batch) -> torch.Tensor:
    for name in (TARGETS, "labels"):
        if name in batch:
            return batch[name]
    raise ValueError(f"the batch has no labels ('{TARGETS}' or 'labels'): fields {sorted(batch)}")


@dataclass(frozen=True)
class Workload:
    """A built model and the task it trains on; ``notes`` are what the family reports about
    the build (recorded as the trial's tags)."""

    model: nn.Module
    task: Task
    notes: dict[str, Any] = field(default_factory=dict)
