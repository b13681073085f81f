"""``none``: plain training, the baseline."""

from harness.strategies.base import Strategy


class NoStrategy(Strategy):
    name = "none"
