"""What one trial reports: exactly one ``Status``, its metrics, its loss curve and
what it learned about itself. Standard library only: the sweep layer reads it too.

The trial writes it as ``result.json``; the launcher adds how long the process ran and how often
it was launched; the sweep records it. A trial that measured nothing (crashed, timed out,
killed) still gets one, with a ``failure_reason``.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any


class Status(StrEnum):
    OK = "ok"
    OOM = "oom"
    INFEASIBLE = "infeasible"
    TIMEOUT = "timeout"
    CRASH = "crash"
    DIVERGED = "diverged"


# A trial ended so may succeed when launched again (limits.retries).
RETRYABLE = (Status.CRASH, Status.TIMEOUT)
# Statuses whose trial still says something about memory (a real or predicted peak).
OVER_BUDGET = (Status.OOM, Status.INFEASIBLE)


@dataclass
class TrialResult:
    trial_key: str
    status: Status
    failure_reason: str = ""
    metrics: dict[str, float] = field(default_factory=dict)
    loss_history: list[float] = field(default_factory=list)
    # train.budget.eval_every: each held-out evaluation during training, {"step": ..., metric: ...}.
    eval_history: list[dict[str, float]] = field(default_factory=list)
    # What the trial found about itself (device, torch version, strategy notes): MLflow tags.
    info: dict[str, Any] = field(default_factory=dict)
    # Set by the launcher: the trial process's wall time, and how many launches it took.
    wall_time_s: float | None = None
    attempts: int = 1

    @classmethod
    def failure(cls, trial_key: str, status: Status, reason: str) -> TrialResult:
        """The result of a trial that measured nothing."""
        return cls(trial_key, status, reason)

    def to_json(self) -> str:
        data = asdict(self)
        data["status"] = self.status.value
        return json.dumps(data, indent=1)

    @classmethod
    def from_json(cls, text: str) -> TrialResult:
        data = json.loads(text)
        data["status"] = Status(data["status"])
        return cls(**data)


class TrialFailure(Exception):
    """Raised inside a trial to end it early with a non-``ok`` status the sweep records."""

    def __init__(self, status: Status, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason
