"""The strategy interface: a few hooks into the training loop, each a no-op by default.

A strategy overrides only the hooks it needs, so strategies compose by being applied in order.
"""

from __future__ import annotations

from torch import nn


class Strategy:
    name = "base"

    def __init__(self, arg: str | None = None) -> None:
        self.arg = arg

    def prepare_model(self, model: nn.Module) -> nn.Module:
        """Change or wrap the model before the optimizer is built (e.g. checkpointing)."""
        return model

    def micro_batches(self) -> int:
        """How many micro-batches one optimizer step is split into (gradient accumulation)."""
        return 1
