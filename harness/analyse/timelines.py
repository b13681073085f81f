"""Pictures of a trial's memory timeline (``harness.meters.timeline``'s JSON): stacked bytes by
category over the memory window's ops, with phases as bands; PNG (matplotlib) and HTML (plotly)
in the breakdown's colours."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pandas as pd

from harness.analyse.style import (
    BREAKDOWN_COLOURS,
    BREAKDOWN_LABELS,
    PEAK,
    PHASE_COLOURS,
    group_colour,
)
from harness.units import format_bytes


def timeline_frame(data: dict[str, Any]) -> pd.DataFrame:
    """One row per sample: op index, phase name, micro-batch, bytes per category and total."""
    frame = pd.DataFrame(data["samples"])
    frame["phase"] = [data["phases"][i] for i in frame["phase"]]
    return frame


def phase_runs(frame: pd.DataFrame) -> list[tuple[str, float, float]]:
    """``(phase, first op, last op)`` for each stretch of consecutive samples in one phase."""
    runs: list[tuple[str, float, float]] = []
    ops, phases = frame["op"].tolist(), frame["phase"].tolist()
    for index, (op, phase) in enumerate(zip(ops, phases, strict=True)):
        end = ops[index + 1] if index + 1 < len(ops) else op
        if runs and runs[-1][0] == phase:
            runs[-1] = (phase, runs[-1][1], end)
        else:
            runs.append((phase, op, end))
    return runs


def timeline_png(timelines: list[tuple[str, dict[str, Any]]], path: Path, title: str) -> Path:
    """One timeline: stacked areas by category over the window's ops, phases as bands, the
    peak marked. Several: each one's total (solid) and activations (dashed), overlaid."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(11, 4.2))
    if len(timelines) == 1:
        label, data = timelines[0]
        frame = timeline_frame(data)
        for phase, start, end in phase_runs(frame):
            axis.axvspan(start, end, color=PHASE_COLOURS[phase], lw=0)
        stacks = [frame[c] / 2**20 for c in data["categories"]]
        axis.stackplot(
            frame["op"],
            stacks,
            labels=[BREAKDOWN_LABELS[c] for c in data["categories"]],
            colors=[BREAKDOWN_COLOURS[c] for c in data["categories"]],
            step="post",
            alpha=0.85,
        )
        if "reserved" in frame:
            axis.step(frame["op"], frame["reserved"] / 2**20, where="post", color="k", lw=1,
                      label="reserved (CUDA)")  # fmt: skip
        peak = data["peak_index"]
        if peak is not None:
            x, y = frame["op"][peak], frame["total"][peak] / 2**20
            axis.axvline(x, color=PEAK, lw=1, ls="--")
            axis.annotate(f"peak {format_bytes(frame['total'][peak])}", (x, y),
                          textcoords="offset points", xytext=(4, 4), color=PEAK,
                          fontsize=8)  # fmt: skip
        handles, labels = axis.get_legend_handles_labels()
        handles += [matplotlib.patches.Patch(color=c) for c in PHASE_COLOURS.values()]
        labels += list(PHASE_COLOURS)
        axis.legend(handles, labels, fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
    else:
        for index, (label, data) in enumerate(timelines):
            colour = group_colour(index)
            frame = timeline_frame(data)
            axis.step(frame["op"], frame["total"] / 2**20, where="post", color=colour,
                      label=f"{label}: total")  # fmt: skip
            axis.step(frame["op"], frame["activation"] / 2**20, where="post", color=colour,
                      ls="--", label=f"{label}: activations")  # fmt: skip
        axis.legend(fontsize=8, loc="upper left")
    axis.set_xlabel("op in the memory window")
    axis.set_ylabel("MiB held by tensors")
    axis.set_title(title)
    axis.margins(x=0)
    # Fixed margins rather than tight_layout: a sweep draws one per trial, and the layout pass
    # costs as much as the drawing.
    figure.subplots_adjust(left=0.06, right=0.84 if len(timelines) == 1 else 0.98, bottom=0.12)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path


def timeline_figure(label: str, data: dict[str, Any]) -> Any:
    """The interactive version of one timeline, for the HTML report."""
    import plotly.graph_objects as go

    frame = timeline_frame(data)
    figure = go.Figure()
    for phase, start, end in phase_runs(frame):
        figure.add_vrect(x0=start, x1=end, fillcolor=PHASE_COLOURS[phase], line_width=0,
                         layer="below")  # fmt: skip
    for category in data["categories"]:
        figure.add_trace(
            go.Scatter(
                x=frame["op"],
                y=frame[category] / 2**20,
                name=BREAKDOWN_LABELS[category],
                stackgroup="memory",
                line={"color": BREAKDOWN_COLOURS[category]},
                line_shape="hv",
                customdata=frame["phase"],
                hovertemplate="op %{x} (%{customdata})<br>%{y:.3f} MiB<extra></extra>",
            )
        )
    figure.update_layout(
        title=f"Memory timeline: {label}",
        xaxis_title="op in the memory window",
        yaxis_title="MiB held by tensors",
        height=340,
        margin={"t": 40, "b": 40},
    )
    return figure
