"""Pictures of a sweep: Pareto projections and memory breakdowns, as PNG and interactive HTML.

PNG (matplotlib, headless ``Agg``) for reports and MLflow's artifact view; HTML (plotly, with
plotly.js embedded so the file opens offline) where hovering a point shows the trial's config.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from harness.pareto import MEMORY, Objective, ParetoAnalysis, non_dominated
from harness.units import format_bytes

BREAKDOWN = {
    "mem_param_bytes": "parameters",
    "mem_grad_bytes": "gradients",
    "mem_optim_bytes": "optimizer state",
    "mem_activation_bytes": "activations",
    "mem_other_bytes": "other",
}
CONFIG = ["model_size", "batch_size", "dtype", "strategy"]
GREY = "#b0b0b0"


def config_label(row: pd.Series) -> str:
    return " ".join(str(row[c]) for c in CONFIG if c in row.index)


def projections(analysis: ParetoAnalysis) -> list[Objective]:
    """The objectives plotted against memory (memory vs throughput, memory vs accuracy, ...)."""
    return [o for o in analysis.objectives if o.metric != MEMORY]


def step_front(group: pd.DataFrame, x: Objective, y: Objective) -> tuple[np.ndarray, np.ndarray]:
    """The group's 2-D front in this projection, sorted by memory, for a step line."""
    front = group[non_dominated(group, [x, y])].sort_values(x.metric)
    return front[x.metric].to_numpy(float), front[y.metric].to_numpy(float)


def groups_of(frame: pd.DataFrame, analysis: ParetoAnalysis) -> list[tuple[str, pd.DataFrame]]:
    if analysis.by is None:
        return [("all", frame)]
    return [(str(name), members) for name, members in frame.groupby(analysis.by, sort=True)]


def infeasible_memory(frame: pd.DataFrame) -> pd.Series:
    """Where to draw a trial that did not fit: its measured peak, else its prediction."""
    peak = frame[MEMORY] if MEMORY in frame else pd.Series(np.nan, index=frame.index)
    if "predicted_peak_bytes" in frame:
        peak = peak.fillna(frame["predicted_peak_bytes"])
    return peak


def pareto_png(frame: pd.DataFrame, analysis: ParetoAnalysis, path: Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = Objective(MEMORY, "minimize")
    panels = projections(analysis)
    figure, axes = plt.subplots(1, max(1, len(panels)), figsize=(6.5 * max(1, len(panels)), 5))
    axes = np.atleast_1d(axes)
    feasible = analysis.feasible
    out = frame[~feasible]
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for axis, y in zip(axes, panels, strict=False):
        for index, (name, members) in enumerate(groups_of(frame, analysis)):
            usable = members[feasible.loc[members.index]]
            colour = colours[index % len(colours)]
            axis.scatter(usable[x.metric], usable[y.metric], color=colour, s=22, alpha=0.7)
            if not usable.empty:
                xs, ys = step_front(usable, x, y)
                where = "post" if y.maximise else "pre"
                axis.step(xs, ys, where=where, color=colour, label=f"{name} front")
        if not out.empty:
            axis.scatter(
                infeasible_memory(out),
                out[y.metric].fillna(0.0) if y.metric in out else np.zeros(len(out)),
                color=GREY,
                marker="x",
                label="not feasible (oom / infeasible / failed / over budget)",
            )
        if analysis.budget:
            axis.axvline(analysis.budget, color="black", linestyle="--", linewidth=1)
            axis.annotate(
                f"budget {format_bytes(analysis.budget)}",
                (analysis.budget, axis.get_ylim()[1]),
                rotation=90,
                va="top",
                ha="right",
                fontsize=8,
            )
        axis.set_xscale("log")
        axis.set_xlabel("peak allocated memory (bytes, log scale; lower is better)")
        better = "higher" if y.maximise else "lower"
        axis.set_ylabel(f"{y.metric} ({better} is better)")
        axis.grid(True, alpha=0.3)
        axis.legend(fontsize=7)
    figure.suptitle(title)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def pareto_figure(frame: pd.DataFrame, analysis: ParetoAnalysis, title: str) -> Any:
    """The plotly figure: one panel per projection, hover = the trial's config and numbers."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    x = Objective(MEMORY, "minimize")
    panels = projections(analysis)
    figure = make_subplots(
        rows=1, cols=max(1, len(panels)), subplot_titles=[f"memory vs {y.metric}" for y in panels]
    )
    feasible = analysis.feasible
    hover = frame.apply(
        lambda row: (
            f"{config_label(row)}<br>status {row['status']}<br>"
            f"peak {format_bytes(row[MEMORY]) if pd.notna(row.get(MEMORY)) else '-'}"
        ),
        axis=1,
    )
    palette = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2"]
    for column, y in enumerate(panels, start=1):
        for index, (name, members) in enumerate(groups_of(frame, analysis)):
            usable = members[feasible.loc[members.index]]
            colour = palette[index % len(palette)]
            figure.add_trace(
                go.Scatter(
                    x=usable[x.metric],
                    y=usable[y.metric],
                    mode="markers",
                    name=name,
                    legendgroup=name,
                    showlegend=column == 1,
                    marker={"color": colour},
                    hovertext=hover.loc[usable.index],
                    hoverinfo="text+y",
                ),
                row=1,
                col=column,
            )
            if not usable.empty:
                xs, ys = step_front(usable, x, y)
                figure.add_trace(
                    go.Scatter(
                        x=xs,
                        y=ys,
                        mode="lines",
                        line={"shape": "hv" if y.maximise else "vh", "color": colour},
                        name=f"{name} front",
                        legendgroup=name,
                        showlegend=False,
                        hoverinfo="skip",
                    ),
                    row=1,
                    col=column,
                )
        out = frame[~feasible]
        if not out.empty:
            figure.add_trace(
                go.Scatter(
                    x=infeasible_memory(out),
                    y=out[y.metric].fillna(0.0) if y.metric in out else [0.0] * len(out),
                    mode="markers",
                    name="not feasible",
                    showlegend=column == 1,
                    marker={"color": GREY, "symbol": "x"},
                    hovertext=hover.loc[out.index],
                    hoverinfo="text",
                ),
                row=1,
                col=column,
            )
        if analysis.budget:
            figure.add_vline(
                x=analysis.budget,
                line_dash="dash",
                row=1,
                col=column,
                annotation_text=f"budget {format_bytes(analysis.budget)}",
            )
        figure.update_xaxes(type="log", title_text="peak allocated bytes", row=1, col=column)
        figure.update_yaxes(title_text=y.metric, row=1, col=column)
    figure.update_layout(title=title, height=520)
    return figure


def breakdown_frame(frame: pd.DataFrame) -> pd.DataFrame:
    ok = frame[frame["status"].eq("ok")].copy()
    ok["config"] = ok.apply(config_label, axis=1)
    columns = [c for c in BREAKDOWN if c in ok]
    return ok.set_index("config")[columns].fillna(0.0).sort_values(columns[0] if columns else [])


def breakdown_png(frame: pd.DataFrame, path: Path, title: str) -> Path:
    """Stacked bars: where each configuration's peak memory goes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = breakdown_frame(frame) / 2**20
    height = max(3.0, 0.28 * len(data) + 1.5)
    figure, axis = plt.subplots(figsize=(10, height))
    left = np.zeros(len(data))
    for column in data.columns:
        axis.barh(data.index, data[column], left=left, label=BREAKDOWN[column])
        left += data[column].to_numpy()
    axis.set_xlabel("MiB at the moment of peak")
    axis.set_title(title)
    axis.legend(fontsize=8, loc="lower right")
    axis.tick_params(axis="y", labelsize=7)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def breakdown_figure(frame: pd.DataFrame, title: str) -> Any:
    import plotly.graph_objects as go

    data = breakdown_frame(frame)
    figure = go.Figure()
    for column in data.columns:
        figure.add_trace(
            go.Bar(
                y=data.index,
                x=data[column] / 2**20,
                name=BREAKDOWN[column],
                orientation="h",
                hovertemplate="%{y}<br>" + BREAKDOWN[column] + ": %{x:.3f} MiB<extra></extra>",
            )
        )
    figure.update_layout(
        barmode="stack",
        title=title,
        xaxis_title="MiB at the moment of peak",
        height=max(360, 22 * len(data) + 160),
    )
    return figure


# ---- memory timelines (harness.meters.timeline's JSON) -------------------------------------

TIMELINE_LABELS = {
    "param": "parameters",
    "grad": "gradients",
    "optim": "optimizer state",
    "activation": "activations",
    "other": "other",
}
PHASE_COLOURS = {
    "forward": "#e3eef9",
    "backward": "#fde9d9",
    "recompute": "#f8cfcf",
    "optimizer": "#e2f2dd",
}


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
            labels=[TIMELINE_LABELS[c] for c in data["categories"]],
            step="post",
            alpha=0.85,
        )
        if "reserved" in frame:
            axis.step(frame["op"], frame["reserved"] / 2**20, where="post", color="k", lw=1,
                      label="reserved (CUDA)")  # fmt: skip
        peak = data["peak_index"]
        if peak is not None:
            x, y = frame["op"][peak], frame["total"][peak] / 2**20
            axis.axvline(x, color="#c00000", lw=1, ls="--")
            axis.annotate(f"peak {format_bytes(frame['total'][peak])}", (x, y),
                          textcoords="offset points", xytext=(4, 4), color="#c00000",
                          fontsize=8)  # fmt: skip
        handles, labels = axis.get_legend_handles_labels()
        handles += [matplotlib.patches.Patch(color=c) for c in PHASE_COLOURS.values()]
        labels += list(PHASE_COLOURS)
        axis.legend(handles, labels, fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
    else:
        colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
        for (label, data), colour in zip(timelines, colours, strict=False):
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
                name=TIMELINE_LABELS[category],
                stackgroup="memory",
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
