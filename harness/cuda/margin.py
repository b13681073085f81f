"""The safety margin a card prediction carries: how far real cards have measured above what was
predicted for them, so that "fits" means "fits, even if this prediction is as far off as the
worst one checked on a card".

An under-prediction is the worst error a planner can make: "fits" then runs out of memory. The
misses seen on cards are mostly constant amounts (library workspaces and kernel-internal
buffers the trace does not see), not proportions, so the margin has both parts: the largest
miss in bytes, and the largest miss in proportion on trials big enough that a constant is
small beside them. A budget is judged at ``usable(budget)``: the budget less whichever part is
larger there.

The figures come from re-predicting the recorded card runs with today's code
(``python scripts/gpu_check.py --repredict SUMMARY.json``, docs/gpu-validation.md); they are
updated when a run is added or the estimator changes what it predicts for one. Standard
library only: the sweep layer judges budgets with it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from harness.units import format_bytes


@dataclass(frozen=True)
class Margin:
    """What the card runs support (``usable``, ``text``)."""

    miss_bytes: int  # the largest device figure a card measured above its prediction, bytes
    miss_fraction: float  # the same in proportion, over trials of at least LARGE_TRIAL bytes
    low: float  # the lowest device predicted / measured over the trained trials
    high: float  # the highest
    trials: int  # how many trained trials these come from
    source: str  # which runs (docs/gpu-validation.md)

    def usable(self, budget: float) -> float:
        """The most a prediction may reach and still fit ``budget``: ``budget`` less the larger
        of the two misses (the proportional one taken of what would fit)."""
        return min(budget - self.miss_bytes, budget / (1 + self.miss_fraction))

    def of(self, budget: float) -> float:
        """The margin held back from ``budget``, bytes."""
        return budget - self.usable(budget)

    def text(self) -> str:
        """``predictions on cards have been within -4.0 %..+1.0 % (...)``: under each table
        that judges fits."""
        return (
            f"predictions on cards have been within {self.low - 1:+.1%}..{self.high - 1:+.1%} "
            f"of what they measured ({self.trials} trials, {self.source}); fits holds back "
            f"the larger of {format_bytes(self.miss_bytes, short=True)} and {self.miss_fraction:.1%}"
        )


def derive(trials: list[dict[str, Any]], source: str) -> Margin:
    """The margin a re-predicted card run supports (``gpu_check.py --repredict --format json``'s
    ``trials``): the largest device miss in bytes over every trained trial, the largest in
    proportion over the large ones, and the range of predicted / measured."""
    scored = [t for t in trials if t.get("device_ratio")]
    if not scored:
        raise ValueError("no trained trial with a device figure to derive a margin from")
    misses = [t["peak_device_bytes"] - t["predicted_device_bytes"] for t in scored]
    large = [t for t in scored if t["peak_device_bytes"] >= LARGE_TRIAL]
    fraction = max((1 / t["device_ratio"] - 1 for t in large), default=0.0)
    ratios = [t["device_ratio"] for t in scored]
    return Margin(
        miss_bytes=max(0, math.ceil(max(misses))),
        miss_fraction=round(max(0.0, fraction), 4),
        low=round(min(ratios), 3),
        high=round(max(ratios), 3),
        trials=len(scored),
        source=source,
    )


# A trial whose device figure is at least this is big enough that its miss in proportion says
# something beyond a constant: the three 10 GiB allocator trials of the H200 run.
LARGE_TRIAL = 4 * 2**30

# docs/gpu-validation/h200-2026-12-04-repredicted.json, derived by ``derive`` (a test holds the
# two equal): the largest miss in bytes is the allocator trial under max_split_size_mb:128
# (346 MiB), in proportion the same trial (3.0 %); the lowest ratio the small gpt's 0.946 (78 MiB
# of kernel buffers the trace does not see, gpu-validation.md), the highest fsdp:1's 1.171 (a
# communicator of one charged as any communicator).
CARD_MARGIN = Margin(
    miss_bytes=362_610_688,
    miss_fraction=0.0299,
    low=0.946,
    high=1.171,
    trials=32,
    source="one H200, torch 2.11, 2026-12-04",
)
