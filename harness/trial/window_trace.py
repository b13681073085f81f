"""What one memory window of a prediction ran, before any card's figures are drawn from it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from harness.meters.op_costs import StepCosts
from harness.trial.config import TrialConfig


@dataclass(frozen=True)
class WindowTrace:
    """What one memory window ran, before any device's figures are drawn from it: the same
    trace gives every card that runs the same step its prediction (``Predictor.on_card``)."""

    config: TrialConfig
    samples: int  # per step, every rank's
    throughput_unit: str
    costs: StepCosts
    peak: float  # by tensor accounting
    breakdown: dict[str, float]
    history: list[tuple[int, int]]  # allocation events before the window (CUDA targets)
    events: list[tuple[int, int]]  # the window's
    num_params: float
    num_params_total: float
    num_params_nf4: float
    model_state: float
    totals: Any
    # The block each event belongs to (``tag_blocks``: empty otherwise), for ``harness.trial.depth``.
    history_tags: list[int] = field(default_factory=list)
    event_tags: list[int] = field(default_factory=list)
