"""The training loss every workload shares: cross-entropy over classes or over next tokens."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def cross_entropy(
    logits: torch.Tensor, targets: torch.Tensor, reduction: str = "mean"
) -> torch.Tensor:
    """Classification ([B, C] vs [B]) and next-token ([B, T, V] vs [B, T]) alike, in fp32."""
    return F.cross_entropy(logits.flatten(0, -2).float(), targets.flatten(), reduction=reduction)
