"""Pictures of a trial's memory timeline (``harness.meters.timeline``'s JSON): stacked bytes by
category over the memory window's ops, with phases as bands and the peak marked; PNG
(matplotlib) and HTML (plotly) in the same colours (``harness.analyse.style``), ticks in binary
units, legends outside the data."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pandas as pd

from harness.analyse.style import (
    BREAKDOWN_COLOURS,
    BREAKDOWN_LABELS,
    PEAK,
    PHASE_COLOURS,
    PHASE_LABELS,
    byte_label,
    group_colour,
    linear_byte_ticks,
)
from harness.units import format_bytes

Y_TITLE = "memory held by tensors"


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


def peak_of(frame: pd.DataFrame, data: dict[str, Any]) -> tuple[float, float] | None:
    """``(op, total bytes)`` of the window's peak sample, or None when it has none."""
    peak = data.get("peak_index")
    if peak is None or frame.empty:
        return None
    return float(frame["op"][peak]), float(frame["total"][peak])


def byte_axis_top(highest: float) -> float:
    return highest * 1.08 if highest > 0 else 2.0**20


def timeline_png(timelines: list[tuple[str, dict[str, Any]]], path: Path, title: str) -> Path:
    """One timeline: stacked areas by category over the window's ops, phases as bands, the
    peak marked. Several: each one's total (solid) and activations (dashed), overlaid."""
    figure = timeline_matplotlib(timelines, title)
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path


def timeline_matplotlib(timelines: list[tuple[str, dict[str, Any]]], title: str) -> Any:
    """The matplotlib figure of ``timeline_png``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch
    from matplotlib.ticker import FixedLocator, FuncFormatter

    figure, axis = plt.subplots(figsize=(11, 4.2))
    highest = 0.0
    if len(timelines) == 1:
        label, data = timelines[0]
        frame = timeline_frame(data)
        seen: list[str] = []
        for phase, start, end in phase_runs(frame):
            axis.axvspan(start, end, color=PHASE_COLOURS[phase], lw=0)
            seen += [phase] if phase not in seen else []
        stacks = [frame[c] for c in data["categories"]]
        axis.stackplot(
            frame["op"],
            stacks,
            labels=[BREAKDOWN_LABELS[c] for c in data["categories"]],
            colors=[BREAKDOWN_COLOURS[c] for c in data["categories"]],
            step="post",
        )
        highest = float(frame["total"].max()) if len(frame) else 0.0
        if "reserved" in frame:
            axis.step(frame["op"], frame["reserved"], where="post", color="k", lw=1,
                      label="reserved (CUDA)")  # fmt: skip
            highest = max(highest, float(frame["reserved"].max()))
        peak = peak_of(frame, data)
        if peak is not None:
            x, y = peak
            axis.axvline(x, color=PEAK, lw=1, ls="--", label=f"peak {format_bytes(y)}")
            axis.plot([x], [y], marker="v", color=PEAK, markersize=7, ls="none")
        handles, labels = axis.get_legend_handles_labels()
        handles += [Patch(color=PHASE_COLOURS[p]) for p in seen]
        labels += [f"phase: {PHASE_LABELS[p]}" for p in seen]
        axis.legend(handles, labels, fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1),
                    frameon=False)  # fmt: skip
    else:
        for index, (label, data) in enumerate(timelines):
            colour = group_colour(index)
            frame = timeline_frame(data)
            axis.step(frame["op"], frame["total"], where="post", color=colour,
                      label=f"{label}: total")  # fmt: skip
            axis.step(frame["op"], frame["activation"], where="post", color=colour,
                      ls="--", label=f"{label}: activations")  # fmt: skip
            peak = peak_of(frame, data)
            if peak is not None:
                axis.plot([peak[0]], [peak[1]], marker="v", color=colour, markersize=7,
                          ls="none", label=f"{label}: peak {format_bytes(peak[1])}")  # fmt: skip
            highest = max(highest, float(frame["total"].max()) if len(frame) else 0.0)
        axis.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1), frameon=False)
    top = byte_axis_top(highest)
    axis.set_ylim(0, top)
    axis.yaxis.set_major_locator(FixedLocator(linear_byte_ticks(0, top)))
    axis.yaxis.set_major_formatter(FuncFormatter(lambda v, _: byte_label(v)))
    axis.set_xlabel("op in the memory window")
    axis.set_ylabel(Y_TITLE)
    axis.set_title(title, fontsize=10)
    axis.margins(x=0)
    # Fixed margins rather than tight_layout: a sweep draws one per trial, and the layout pass
    # costs as much as the drawing. The legend sits right of the axes.
    right = 0.80 if len(timelines) == 1 else 0.66
    figure.subplots_adjust(left=0.08, right=right, bottom=0.12)
    return figure


def timeline_figure(label: str, data: dict[str, Any]) -> Any:
    """The interactive version of one timeline, for the HTML report: the same colours, phase
    bands (in the legend too) and peak marker as the PNG."""
    import plotly.graph_objects as go

    frame = timeline_frame(data)
    figure = go.Figure()
    seen: set[str] = set()
    for phase, start, end in phase_runs(frame):
        figure.add_vrect(
            x0=start, x1=end, fillcolor=PHASE_COLOURS[phase], opacity=1, line_width=0,
            layer="below", name=f"phase: {PHASE_LABELS[phase]}", legendgroup=f"phase {phase}",
            showlegend=phase not in seen,
        )  # fmt: skip
        seen.add(phase)
    for category in data["categories"]:
        colour = BREAKDOWN_COLOURS[category]
        figure.add_trace(
            go.Scatter(
                x=frame["op"],
                y=frame[category],
                name=BREAKDOWN_LABELS[category],
                stackgroup="memory",
                line={"color": colour, "width": 0.5},
                fillcolor=colour,
                line_shape="hv",
                customdata=list(
                    zip(frame["phase"], map(format_bytes, frame[category]), strict=True)
                ),
                hovertemplate="op %{x} (%{customdata[0]})<br>"
                + BREAKDOWN_LABELS[category]
                + ": %{customdata[1]}<extra></extra>",
            )
        )
    peak = peak_of(frame, data)
    highest = float(frame["total"].max()) if len(frame) else 0.0
    if peak is not None:
        x, y = peak
        figure.add_vline(
            x=x, line_dash="dash", line_color=PEAK, line_width=1,
            name=f"peak {format_bytes(y)}", showlegend=True,
            annotation_text=f"peak {format_bytes(y)}", annotation_font_color=PEAK,
            annotation_position="top right",
        )  # fmt: skip
    top = byte_axis_top(highest)
    ticks = linear_byte_ticks(0, top)
    figure.update_layout(
        title=f"Memory timeline: {label}",
        xaxis_title="op in the memory window",
        yaxis={
            "title": Y_TITLE,
            "range": [0, top],
            "tickvals": ticks,
            "ticktext": [byte_label(t) for t in ticks],
        },
        height=400,
        margin={"t": 40, "b": 40},
        legend={"font": {"size": 10}, "tracegroupgap": 2},
    )
    return figure
