"""``chunked_ce[:C]``: a causal LM's loss that never holds the whole ``[batch, seq, vocab]``
logits, and ``fused_ce``: Liger's fused linear cross-entropy, its CUDA kernel.

With a large vocabulary the logits, their fp32 copy (the loss upcasts them) and their gradient
are a step's largest tensors: 2 x 4096 tokens x 128k vocabulary is 4 GiB per fp32 copy. The
chunked loss takes the model's last hidden states instead, splits its tokens into C chunks and
computes each chunk's output projection and cross-entropy under non-reentrant checkpointing: the
forward keeps no chunk's logits, and the backward recomputes one chunk's at a time, so at most
1/C of them (and of their gradient) is ever alive. The loss is the sum of the chunks' summed
losses over the count of labelled tokens: the plain step's mean, to float rounding.

How it reaches the model without changing its code: the output head's ``forward`` is replaced
on the instance (the module, its parameters, ties and hooks stay as they are). While the task
has handed it the step's labels, it computes the chunked loss, keeps it for the task and
returns an empty ``[..., 0]`` tensor as the "logits" (so a Hugging Face model's own code after
its head runs on nothing and computes no loss: it is called without labels); otherwise it is the
plain head (evaluation, accuracy). The ``ChunkedLoss`` task wraps the model's own task to do the
handing over. torchtune's chunked output loss and Apple's cut cross-entropy follow the same idea.

Where the head is: a Hugging Face model's ``get_output_embeddings()``, else a ``Linear``
attribute ``lm_head``, ``head`` or ``output`` of the model (or of the model a wrapper holds).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from harness.strategies.base import Strategy, StrategyError, TrialContext
from harness.workloads.hf import HuggingFace
from harness.workloads.libraries import import_library
from harness.workloads.task import IGNORE, Logits, Task, UserModel, is_causal_lm
from harness.workloads.tensors import TARGETS, Batch

# Vocabulary entries per chunk the default aims at: 8 chunks for Llama 3's 128k, as torchtune.
VOCAB_PER_CHUNK = 16384
HEAD_NAMES = ("lm_head", "head", "output")


def default_chunks(vocab: int) -> int:
    """At least 2 (one chunk would still hold all logits in backward), ~16k entries each."""
    return max(2, math.ceil(vocab / VOCAB_PER_CHUNK))


def output_head(model: nn.Module) -> nn.Linear | None:
    """The model's output projection over the vocabulary, where it can be found."""
    found: Any = None
    getter = getattr(model, "get_output_embeddings", None)
    if callable(getter):
        found = getter()
    for holder in (model, getattr(model, "module", None), getattr(model, "_orig_mod", None)):
        if found is None and holder is not None:
            found = next(
                (
                    getattr(holder, n)
                    for n in HEAD_NAMES
                    if isinstance(getattr(holder, n, None), nn.Linear)
                ),
                None,
            )
    return found if isinstance(found, nn.Linear) else None


def _chunk_loss(
    hidden: torch.Tensor, labels: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """One chunk's summed cross-entropy, its logits upcast to fp32 as the plain loss does."""
    logits = F.linear(hidden, weight, bias)
    return F.cross_entropy(logits.float(), labels, ignore_index=IGNORE, reduction="sum")


def chunked_cross_entropy(
    hidden: torch.Tensor, labels: torch.Tensor, head: nn.Linear, chunks: int
) -> torch.Tensor:
    """Mean cross-entropy of ``head(hidden)`` against ``labels`` (``IGNORE`` left out), each of
    ``chunks`` token chunks checkpointed: no chunk's logits outlive its own forward."""
    flat = hidden.reshape(-1, hidden.shape[-1])
    targets = labels.reshape(-1)
    size = math.ceil(flat.shape[0] / chunks)
    total = sum(
        checkpoint(_chunk_loss, part, part_labels, head.weight, head.bias, use_reentrant=False)
        for part, part_labels in zip(flat.split(size), targets.split(size), strict=True)
    )
    assert isinstance(total, torch.Tensor)
    return total / (targets != IGNORE).sum().clamp(min=1)


# How the head computes the loss: (hidden states, aligned labels, the head) -> mean loss.
HeadLoss = Callable[[torch.Tensor, torch.Tensor, nn.Linear], torch.Tensor]


class _HeadState:
    """What the task hands the head for one forward (labels) and takes back (the loss)."""

    def __init__(self, head: nn.Linear, loss: HeadLoss) -> None:
        self.head, self.compute = head, loss
        self.plain = type(head).forward
        self.labels: torch.Tensor | None = None
        self.loss: torch.Tensor | None = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.labels is None:  # evaluation, accuracy: the plain head
            return self.plain(self.head, hidden)
        labels, self.labels = self.labels, None
        self.loss = self.compute(hidden, labels, self.head)
        return hidden.new_empty(*hidden.shape[:-1], 0)


class ChunkedLoss(Task):
    """The model's own task, with the training loss taken from the chunked head: the model is
    called as for inference (no labels), the head computes the loss from the labels the task
    handed it. Evaluation and accuracy are the inner task's, on the plain head."""

    def __init__(self, inner: Task, state: _HeadState, causal_shift: bool) -> None:
        self.inner, self.state, self.causal_shift = inner, state, causal_shift

    @property
    def causal(self) -> bool:
        """Always a language model (chunked_ce refuses any other task): the eval curve's
        perplexity reads this, as it reads a Hugging Face task's own."""
        return True

    def labels(self, batch: Batch) -> torch.Tensor:
        """Aligned with the hidden states: the next token at each position (a Hugging Face
        causal LM's labels are its inputs, shifted here as its own loss shifts them)."""
        if isinstance(self.inner, HuggingFace):
            labels = self.inner.inputs(batch, labels=True)["labels"]
        elif TARGETS in batch:
            return batch[TARGETS]
        else:
            labels = batch["labels"]
        if not self.causal_shift:
            return labels
        return F.pad(labels, (0, 1), value=IGNORE)[..., 1:]

    def outputs(self, model: nn.Module, batch: Batch) -> Any:
        return self.inner.outputs(model, batch)

    def forward(self, model: nn.Module, batch: Batch) -> tuple[torch.Tensor, Any]:
        self.state.labels = self.labels(batch)
        try:
            self.inner.outputs(model, batch)
        finally:
            self.state.labels = None
        loss, self.state.loss = self.state.loss, None
        if loss is None:
            raise StrategyError(
                "chunked_ce: the model's forward never called its output head "
                f"{type(self.state.head).__name__}"
            )
        return loss, None

    def score(self, model: nn.Module, batch: Batch) -> tuple[int, float, int]:
        return self.inner.score(model, batch)


class ChunkedCrossEntropy(Strategy):
    name = "chunked_ce"

    def prepare_model(self, model: nn.Module, ctx: TrialContext) -> nn.Module:
        task = ctx.task
        if isinstance(task, HuggingFace) and not task.causal:
            raise StrategyError(
                f"chunked_ce: for causal language models (this hf task: {task.task})"
            )
        if not isinstance(task, Logits | HuggingFace | UserModel):
            raise StrategyError(f"chunked_ce: cannot take the loss of a {type(task).__name__} task")
        if isinstance(task, UserModel) and task.loss is not None:
            raise StrategyError("chunked_ce: the model has a loss of its own (model.loss)")
        config = getattr(model, "config", None)
        if getattr(config, "final_logit_softcapping", None):
            raise StrategyError(
                "chunked_ce: the model soft-caps its logits (final_logit_softcapping), which "
                "the chunked loss does not apply"
            )
        head = output_head(model)
        if head is None:
            raise StrategyError(
                f"chunked_ce: no output head found in {type(model).__name__} (looked for "
                f"get_output_embeddings() and a Linear named {', '.join(HEAD_NAMES)})"
            )
        state = _HeadState(head, self.head_loss(head, ctx))
        head.forward = state.forward  # type: ignore[method-assign]
        shift = isinstance(task, HuggingFace) or (
            isinstance(task, UserModel) and is_causal_lm(model)
        )
        self.task_for_model = ChunkedLoss(task, state, causal_shift=shift)
        return model

    def head_loss(self, head: nn.Linear, ctx: TrialContext) -> HeadLoss:
        """The loss the head computes: over checkpointed chunks of tokens."""
        chunks = int(self.arg) if self.arg else default_chunks(head.out_features)
        ctx.notes["loss_chunks"] = chunks
        return lambda hidden, labels, head: chunked_cross_entropy(hidden, labels, head, chunks)

    def prepare_task(self, task: Task, model: nn.Module, ctx: TrialContext) -> Task:
        return self.task_for_model


class FusedCrossEntropy(ChunkedCrossEntropy):
    """Liger's ``LigerFusedLinearCrossEntropyLoss``: the projection and the loss in one Triton
    kernel that writes the hidden states' gradient as it goes, chunk by chunk, on CUDA."""

    name = "fused_ce"

    def prepare_model(self, model: nn.Module, ctx: TrialContext) -> nn.Module:
        if ctx.device.type != "cuda":
            raise StrategyError(
                f"fused_ce: Liger's fused kernel runs on CUDA only (this trial: "
                f"{ctx.device.type}); use chunked_ce"
            )
        return super().prepare_model(model, ctx)

    def head_loss(self, head: nn.Linear, ctx: TrialContext) -> HeadLoss:
        """Liger's kernel over every token at once (it chunks inside)."""
        fused = _liger().LigerFusedLinearCrossEntropyLoss(ignore_index=IGNORE)

        def loss(hidden: torch.Tensor, labels: torch.Tensor, head: nn.Linear) -> torch.Tensor:
            flat = hidden.reshape(-1, hidden.shape[-1])
            return fused(head.weight, flat, labels.reshape(-1), head.bias)

        return loss


def _liger() -> Any:
    # An optional package, not installed by make.
    return import_library(
        "liger_kernel.transformers", "fused_ce", "pip install liger-kernel", StrategyError
    )
