"""``accumulate:K``: each optimizer step runs K micro-batches of batch/K (same effective batch).

Only one micro-batch's activations live at a time, so activation memory falls to ~1/K; the
gradients accumulate in place. The loop does the splitting; this strategy only says K.
"""

from harness.strategies.base import Strategy


class Accumulate(Strategy):
    name = "accumulate"

    def micro_batches(self) -> int:
        return int(self.arg or 1)
