"""Trial outcomes: every trial ends with exactly one status (design notes §3)."""

from __future__ import annotations

from enum import Enum
from typing import Any


class Status(str, Enum):
    OK = "ok"
    OOM = "oom"
    INFEASIBLE = "infeasible"
    TIMEOUT = "timeout"
    CRASH = "crash"
    DIVERGED = "diverged"
    SKIPPED = "skipped"

    def __str__(self) -> str:
        return self.value


def failure_result(trial_key: str, status: Status, reason: str) -> dict[str, Any]:
    """The result of a trial that measured nothing (crashed, timed out, killed)."""
    return {
        "trial_key": trial_key,
        "status": status.value,
        "failure_reason": reason,
        "metrics": {},
        "loss_history": [],
        "info": {},
    }


class TrialFailure(Exception):
    """Raised inside a trial to end it early with a non-``ok`` status the sweep records."""

    def __init__(self, status: Status, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason
