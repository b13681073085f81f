"""One benchmark figure: a value, the target it is held to, and whether it met it.

Targets missed are reported, never hidden: ``make bench`` fails only when a benchmark errors.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class Figure:
    name: str
    value: float | None
    target: str  # human-readable, e.g. "<= 60 s"
    met: bool | None  # None: no target (reported for information)
    unit: str = ""
    detail: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def at_most(name: str, value: float, limit: float, unit: str, **detail: Any) -> Figure:
    return Figure(name, value, f"<= {limit:g} {unit}".strip(), value <= limit, unit, detail)


def at_least(name: str, value: float, limit: float, unit: str, **detail: Any) -> Figure:
    return Figure(name, value, f">= {limit:g} {unit}".strip(), value >= limit, unit, detail)


def within(name: str, value: float, low: float, high: float, **detail: Any) -> Figure:
    return Figure(name, value, f"{low:g} .. {high:g}", low <= value <= high, "", detail)


def reported(name: str, value: float, unit: str = "", **detail: Any) -> Figure:
    """A figure with no target: measured and shown, for the reader to judge."""
    return Figure(name, value, "reported", None, unit, detail)
