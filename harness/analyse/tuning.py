"""Whether a trial's accuracy may say more about its learning rate than about its strategy.

An optimizer swap (``sgd``, ``adafactor``, ...) trains at one learning rate, its own default or
the one given, never tuned by the sweep; where its accuracy falls clearly below what the
sweep's own optimizer reached, the gap may be that learning rate's, not the optimizer's. The
report says so beside such a trial instead of letting the gap read as the strategy's cost.
"""

from __future__ import annotations

import math

import pandas as pd

from harness.strategies import STRATEGIES
from harness.strategies.combination import recorded_names

# An accuracy this far below the best trial without an optimizer swap is flagged.
GAP = 0.05


def optimizer_swap(strategy: object) -> str | None:
    """The optimizer strategy of a recorded strategy string, if it has one."""
    names = recorded_names(strategy)
    return next((n for n in names if n in STRATEGIES and STRATEGIES[n].group == "optimizer"), None)


def tuning_note(row: pd.Series, frame: pd.DataFrame) -> str | None:
    """One phrase for a trial whose optimizer swap's accuracy is more than ``GAP`` below the
    best accuracy of the sweep's trials that kept the spec's optimizer; else None."""
    swap = optimizer_swap(row.get("strategy"))
    accuracy = _number(row.get("accuracy"))
    if swap is None or "accuracy" not in frame or accuracy is None:
        return None
    kept = frame[frame["strategy"].map(optimizer_swap).isna() & frame["status"].eq("ok")]
    best = _number(kept["accuracy"].max()) if not kept.empty else None
    if best is None or accuracy >= best - GAP:
        return None
    lr = _number(row.get("lr"))
    at = f" at lr {lr:g}" if lr is not None else ""
    return (
        f"accuracy may be a tuning artifact: {swap} trained{at}, untuned, {best - accuracy:.3f} "
        f"below the spec's optimizer; try {swap}:LR with other rates"
    )


def _number(value: object) -> float | None:
    """``value`` as a finite float, else None (a missing accuracy or lr)."""
    try:
        number = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None
