"""Pictures of a sweep: Pareto projections and memory breakdowns, as PNG and interactive HTML.

PNG (matplotlib, headless ``Agg``) for reports and MLflow's artifact view; HTML (plotly, with
plotly.js embedded so the file opens offline) where hovering a point shows the trial's config.
Colours and labels: ``harness.analyse.style``, the same in both.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from harness.analyse.pareto import MEMORY, Objective, ParetoAnalysis, non_dominated
from harness.analyse.style import BREAKDOWN_COLOURS, BREAKDOWN_LABELS, NOT_FEASIBLE, group_colour
from harness.contract import AXES
from harness.metrics import BREAKDOWN_CATEGORIES, breakdown_metric
from harness.units import format_bytes

# The breakdown's metrics in stacking order, and their category.
BREAKDOWN = {breakdown_metric(c): c for c in BREAKDOWN_CATEGORIES}


def config_label(row: pd.Series) -> str:
    """A trial's grid point in words, e.g. ``small 32 bf16 checkpoint``."""
    return " ".join(str(row[c]) for c in AXES if c in row.index)


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
    for axis, y in zip(axes, panels, strict=False):
        for index, (name, members) in enumerate(groups_of(frame, analysis)):
            usable = members[feasible.loc[members.index]]
            colour = group_colour(index)
            axis.scatter(usable[x.metric], usable[y.metric], color=colour, s=22, alpha=0.7)
            if not usable.empty:
                xs, ys = step_front(usable, x, y)
                where = "post" if y.maximise else "pre"
                axis.step(xs, ys, where=where, color=colour, label=f"{name} front")
        if not out.empty:
            axis.scatter(
                infeasible_memory(out),
                out[y.metric].fillna(0.0) if y.metric in out else np.zeros(len(out)),
                color=NOT_FEASIBLE,
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
    for column, y in enumerate(panels, start=1):
        for index, (name, members) in enumerate(groups_of(frame, analysis)):
            usable = members[feasible.loc[members.index]]
            colour = group_colour(index)
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
                    marker={"color": NOT_FEASIBLE, "symbol": "x"},
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
        category = BREAKDOWN[column]
        axis.barh(
            data.index, data[column], left=left, label=BREAKDOWN_LABELS[category],
            color=BREAKDOWN_COLOURS[category],
        )  # fmt: skip
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
        label = BREAKDOWN_LABELS[BREAKDOWN[column]]
        figure.add_trace(
            go.Bar(
                y=data.index,
                x=data[column] / 2**20,
                name=label,
                orientation="h",
                marker={"color": BREAKDOWN_COLOURS[BREAKDOWN[column]]},
                hovertemplate="%{y}<br>" + label + ": %{x:.3f} MiB<extra></extra>",
            )
        )
    figure.update_layout(
        barmode="stack",
        title=title,
        xaxis_title="MiB at the moment of peak",
        height=max(360, 22 * len(data) + 160),
    )
    return figure
