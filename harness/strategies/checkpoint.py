"""``checkpoint[:K]``: activation recomputation over the model's repeated blocks.

Only each segment's input is kept from the forward pass; the segment's inside is recomputed in
backward (``torch.utils.checkpoint``, non-reentrant). Segments of K blocks store n/K inputs and
recompute K blocks at a time, so K = sqrt(n) gives Chen et al.'s O(sqrt n) activation memory.

The blocks are ``model.blocks`` (an ``nn.ModuleList``; the built-in cnn, mlp and gpt have one)
or a torchvision ResNet's four stages.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from harness.strategies.base import Strategy, TrialContext


class CheckpointedSegment(nn.Module):
    def __init__(self, modules: list[nn.Module]) -> None:
        super().__init__()
        self.segment = nn.ModuleList(modules)

    def run(self, x: torch.Tensor) -> torch.Tensor:
        for module in self.segment:
            x = module(x)
        return x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.run, x, use_reentrant=False)


def block_sites(model: nn.Module) -> list[tuple[Any, Any]]:
    """(container, key) of each repeated block, in execution order."""
    blocks = getattr(model, "blocks", None)
    if isinstance(blocks, nn.ModuleList) and len(blocks):
        return [(blocks, index) for index in range(len(blocks))]
    if all(hasattr(model, f"layer{i}") for i in range(1, 5)):  # torchvision ResNet stages
        return [(model, f"layer{i}") for i in range(1, 5)]
    raise ValueError(
        f"checkpoint: no repeated blocks found in {type(model).__name__}; "
        "expose them as `model.blocks` (an nn.ModuleList run in order)"
    )


def _get(container: Any, key: Any) -> nn.Module:
    return container[key] if isinstance(key, int) else getattr(container, key)


def _set(container: Any, key: Any, module: nn.Module) -> None:
    if isinstance(key, int):
        container[key] = module
    else:
        setattr(container, key, module)


def checkpoint_blocks(model: nn.Module, per_segment: int) -> int:
    """Wrap consecutive blocks into checkpointed segments; returns the number of segments."""
    sites = block_sites(model)
    segments = 0
    for start in range(0, len(sites), per_segment):
        group = sites[start : start + per_segment]
        modules = [_get(container, key) for container, key in group]
        _set(*group[0], CheckpointedSegment(modules))
        for container, key in group[1:]:
            _set(container, key, nn.Identity())
        segments += 1
    return segments


class Checkpoint(Strategy):
    name = "checkpoint"

    def prepare_model(self, model: nn.Module, ctx: TrialContext) -> nn.Module:
        segments = checkpoint_blocks(model, int(self.arg) if self.arg else 1)
        ctx.notes["checkpoint_segments"] = segments
        return model
