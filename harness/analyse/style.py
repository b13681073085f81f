"""How pictures look, the same in PNG (matplotlib) and HTML (plotly): a breakdown category, a
group or a phase of the memory window has one colour and one label everywhere."""

from __future__ import annotations

from harness.metrics import BREAKDOWN_CATEGORIES

BREAKDOWN_LABELS = dict(
    zip(
        BREAKDOWN_CATEGORIES,
        ("parameters", "gradients", "optimizer state", "activations", "other"),
        strict=True,
    )
)
BREAKDOWN_COLOURS = dict(
    zip(BREAKDOWN_CATEGORIES, ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd"), strict=True)
)
# Bands behind a memory timeline: the phase each op ran in.
PHASE_COLOURS = {
    "forward": "#e3eef9",
    "backward": "#fde9d9",
    "recompute": "#f8cfcf",
    "optimizer": "#e2f2dd",
}
# One colour per group (strategy, dtype, ...) or per overlaid trial.
GROUP_COLOURS = (
    "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd",
    "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf",
)  # fmt: skip
NOT_FEASIBLE = "#b0b0b0"  # trials that did not fit, failed or went over budget
PEAK = "#c00000"  # the line marking a timeline's peak


def group_colour(index: int) -> str:
    return GROUP_COLOURS[index % len(GROUP_COLOURS)]
