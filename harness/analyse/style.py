"""How pictures look, the same in PNG (matplotlib) and HTML (plotly): a breakdown category, a
group or a phase of the memory window has one colour and one label everywhere, and a memory
axis has the same ticks (binary units through ``harness.units.format_bytes``) in both."""

from __future__ import annotations

import math

from harness.metrics import BREAKDOWN_CATEGORIES
from harness.units import format_bytes, format_quantity

BREAKDOWN_LABELS: dict[str, str] = dict(
    zip(
        BREAKDOWN_CATEGORIES,
        ("parameters", "gradients", "optimizer state", "activations", "other"),
        strict=True,
    )
)
# Saturated, colour-blind-safe (Okabe-Ito) for the five categories; drawn opaque in both
# libraries so a category looks the same over any phase band.
BREAKDOWN_COLOURS: dict[str, str] = dict(
    zip(BREAKDOWN_CATEGORIES, ("#0072B2", "#E69F00", "#009E73", "#D55E00", "#8C8C8C"), strict=True)
)
# Bands behind a memory timeline: the phase each op ran in. Pale tints, none of them a tint of
# a category's colour, so a band never reads as a category.
PHASE_COLOURS = {
    "forward": "#E4ECF7",
    "backward": "#EFE3F3",
    "recompute": "#FBE3E3",
    "optimizer": "#FFF3C9",
}
PHASE_LABELS = {
    "forward": "forward",
    "backward": "backward",
    "recompute": "recomputation",
    "optimizer": "optimizer step",
}
# One colour per group (strategy, dtype, ...) or per overlaid trial.
GROUP_COLOURS = (
    "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd",
    "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf",
)  # fmt: skip
NOT_FEASIBLE = "#6e6e6e"  # trials that did not fit, failed or went over budget
# Marker per reason a trial is not on a front, in the strip under a Pareto panel:
# (matplotlib marker, plotly symbol).
NOT_FEASIBLE_MARKERS = {
    "over budget": ("^", "triangle-up"),
    "oom": ("X", "x"),
    "infeasible": ("v", "triangle-down"),
}
OTHER_FAILURE_MARKER = ("s", "square")
PEAK = "#C00000"  # the line marking a timeline's peak
BUDGET = "#000000"  # the memory budget's line


def group_colour(index: int) -> str:
    return GROUP_COLOURS[index % len(GROUP_COLOURS)]


def not_feasible_marker(kind: str) -> tuple[str, str]:
    return NOT_FEASIBLE_MARKERS.get(kind, OTHER_FAILURE_MARKER)


def byte_label(value: float) -> str:
    """A memory tick: ``256 KiB``, ``1.5 MiB``, ``0``."""
    return "0" if value == 0 else format_bytes(value, short=True)


def rate_label(value: float) -> str:
    """A throughput tick, its unit named on the axis: ``2.60k``, ``500``."""
    return format_quantity(value)


def _nice_step(span: float, bins: int) -> float:
    raw = span / bins
    magnitude = 10 ** math.floor(math.log10(raw))
    return next(m * magnitude for m in (1, 2, 2.5, 5, 10) if m * magnitude >= raw * (1 - 1e-9))


def linear_byte_ticks(low: float, high: float, bins: int = 5) -> list[float]:
    """Evenly spaced ticks in ``[low, high]`` at round numbers of the unit ``high`` is shown in
    (KiB, MiB, GiB, ...): ``0, 512 KiB, 1 MiB, 1.5 MiB``."""
    if not (math.isfinite(low) and math.isfinite(high)) or high <= low:
        return [low] if math.isfinite(low) else []
    unit = 1024 ** max(0, math.floor(math.log(max(high, 1), 1024)))
    step = _nice_step((high - low) / unit, bins) * unit
    first = math.ceil(low / step - 1e-9)
    ticks = []
    index = first
    while index * step <= high * (1 + 1e-9):
        ticks.append(index * step)
        index += 1
    return ticks


def byte_ticks(low: float, high: float, log: bool) -> list[float]:
    """Tick positions for a memory axis spanning ``[low, high]`` bytes. Log: powers of two
    (``256 KiB, 512 KiB, 1 MiB``), every 2nd/5th/10th one when the span is wide; a log axis
    over less than a factor of 4 gets the linear ticks."""
    if not log or high < 4 * low:
        return linear_byte_ticks(low, high)
    first, last = math.ceil(math.log2(low)), math.floor(math.log2(high))
    stride = next(s for s in (1, 2, 5, 10, 20) if (last - first) / s <= 7)
    return [2.0**e for e in range(first, last + 1) if e % stride == 0]
