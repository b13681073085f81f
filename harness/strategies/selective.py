"""``sac``: selective activation checkpointing, the middle point between ``none`` and
``checkpoint``.

Each repeated block runs under ``torch.utils.checkpoint`` as with ``checkpoint``, but with
PyTorch's own policy API (``create_selective_checkpoint_contexts``): the outputs of the
expensive ops (matrix multiplies, attention, convolutions) are saved in forward, and only the
cheap ones (norms, activations, element-wise arithmetic, softmax outside fused attention) are
recomputed in backward. So activation memory falls less than with full recomputation, and so
does the extra compute: each block's matmuls run once, not twice.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from harness.strategies.checkpoint import SAC, Checkpoint

_aten = torch.ops.aten
SAVED_OPS = frozenset(
    op
    for op in (
        _aten.mm.default,
        _aten.addmm.default,
        _aten.bmm.default,
        _aten.baddbmm.default,
        _aten.convolution.default,
        _aten._scaled_dot_product_flash_attention.default,
        _aten._scaled_dot_product_flash_attention_for_cpu.default,
        _aten._scaled_dot_product_efficient_attention.default,
        _aten._scaled_dot_product_cudnn_attention.default,
    )
)


def save_matmuls(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """The policy: keep what is expensive to recompute, recompute the rest."""
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def sac_options() -> dict[str, Any]:
    """``torch.utils.checkpoint.checkpoint``'s arguments for the policy."""
    return {"context_fn": functools.partial(create_selective_checkpoint_contexts, save_matmuls)}


class SelectiveCheckpoint(Checkpoint):
    """``sac``; ``sac:auto``: every block under the policy except the fewest recomputed in full
    that bring the predicted peak within the budget."""

    name = "sac"
    rest_mode = SAC

    def checkpoint_options(self) -> dict[str, Any]:
        return sac_options()

    def sac_options(self) -> dict[str, Any]:
        return sac_options()
