"""Optimizer strategies: swap the trial's optimizer, keeping its weight decay and foreach, and
its lr unless the strategy's argument gives one (``sgd_momentum:0.05``).

The optimizer's persistent state is a fixed number of bytes per parameter (fp32): plain SGD 0,
SGD with momentum 4, AdamW 8, Adafactor only a row and a column vector per weight matrix,
8-bit AdamW ~2. Making the optimizer a strategy lets one grid compare them against the same
baseline, alone or combined with the other memory techniques.
"""

from __future__ import annotations

from harness.strategies.base import Strategy, TrialContext
from harness.strategies.settings import OptimizerSettings


class OptimizerStrategy(Strategy):
    """Replaces the optimizer with ``optimizer_name`` (and ``momentum`` for SGD), at the
    argument's learning rate when one is given."""

    optimizer_name = "adam"
    momentum: float | None = None

    def optimizer(self, settings: OptimizerSettings, ctx: TrialContext) -> OptimizerSettings:
        lr = float(self.arg) if self.arg else None
        return settings.swapped(self.optimizer_name, self.momentum, lr)


class Sgd(OptimizerStrategy):
    name = optimizer_name = "sgd"
    momentum = 0.0


class SgdMomentum(OptimizerStrategy):
    name = "sgd_momentum"
    optimizer_name = "sgd"
    momentum = 0.9


class AdamW(OptimizerStrategy):
    name = optimizer_name = "adamw"


class Adafactor(OptimizerStrategy):
    name = optimizer_name = "adafactor"


class Adam8bit(OptimizerStrategy):
    """torchao's AdamW8bit; torchao is imported only when this optimizer is built."""

    name = optimizer_name = "adam8bit"
