"""Trial outcomes: every trial ends with exactly one status (design notes §3)."""

from __future__ import annotations

from enum import Enum


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


class TrialFailure(Exception):
    """Raised inside a trial to end it early with a non-``ok`` status the sweep records."""

    def __init__(self, status: Status, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason
