"""Waiting for a condition that only re-checking can show.

Neither an Optuna storage, an MLflow store, a Slurm queue nor a Ray cluster notifies anyone
of a change: a sweep that waits for other workers, a launcher that follows its jobs and a
start that races others to create a storage all re-read until what they wait for holds. This
is the one place that re-reads on a clock, so every such wait has a condition, an interval
and (where giving up is right) a limit that its error names.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


class WaitTimeout(TimeoutError):
    """``until`` gave up: the message names what was awaited and the limit that was hit."""


def until(
    condition: Callable[[], T],
    every_s: float,
    limit_s: float | None = None,
    what: str = "the condition",
) -> T:
    """``condition()``'s first truthy value, checked now and then every ``every_s`` seconds.

    ``limit_s``: give up after that long (``WaitTimeout`` naming ``what`` and the limit);
    None waits as long as it takes (the caller's condition must then be able to end, e.g.
    workers that end or are found dead).
    """
    deadline = None if limit_s is None else time.monotonic() + limit_s
    while True:
        value = condition()
        if value:
            return value
        if deadline is None:
            time.sleep(every_s)
            continue
        left = deadline - time.monotonic()
        if left <= 0:
            raise WaitTimeout(f"gave up waiting for {what} after {limit_s:g} s")
        time.sleep(min(every_s, left))  # the last check falls on the limit itself
