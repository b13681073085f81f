"""Pictures of a sweep: Pareto projections and memory breakdowns, as PNG and interactive HTML.

PNG (matplotlib, headless ``Agg``) for reports and MLflow's artifact view; HTML (plotly, with
plotly.js embedded so the file opens offline) where hovering a point shows the trial's config.
Colours, labels and memory ticks: ``harness.analyse.style``, the same in both.

The memory axis spans the trials drawn (feasible ones and those that did not fit, at their
measured or predicted peak); the budget's line is drawn when it is near them, else the title
says where it is. Trials that did not fit sit in a strip of their own under each panel, one row
per reason, never at zero on the objective's axis.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from harness.analyse.pareto import MEMORY, ParetoAnalysis, non_dominated, unusable
from harness.analyse.style import (
    BREAKDOWN_COLOURS,
    BREAKDOWN_LABELS,
    BUDGET,
    NOT_FEASIBLE,
    byte_label,
    byte_ticks,
    group_colour,
    linear_byte_ticks,
    not_feasible_marker,
    rate_label,
)
from harness.contract import AXES
from harness.metrics import BREAKDOWN_CATEGORIES, Objective, axis_label, breakdown_metric
from harness.units import format_bytes, format_quantity

# The breakdown's metrics in stacking order, and their category.
BREAKDOWN = {breakdown_metric(c): c for c in BREAKDOWN_CATEGORIES}
NEAR = 4.0  # the budget is drawn when within this factor of the trials' memory
LOG_ABOVE = 8.0  # a memory axis is logarithmic when its trials span more than this factor


def config_label(row: pd.Series) -> str:
    """A trial's grid point in words, e.g. ``small 32 bf16 checkpoint``."""
    return " ".join(str(row[c]) for c in AXES if c in row.index)


def projections(analysis: ParetoAnalysis) -> list[Objective]:
    """The objectives plotted against memory (memory vs throughput, memory vs accuracy, ...)."""
    return [o for o in analysis.objectives if o.metric != MEMORY]


def step_front(group: pd.DataFrame, x: Objective, y: Objective) -> tuple[np.ndarray, np.ndarray]:
    """The group's 2-D front in this projection, sorted by memory, for a step line (drawn
    "post": up to the next point's memory, the best reachable is the current point's value)."""
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
    return peak.astype(float)


def not_feasible_kind(row: pd.Series) -> str:
    """Why a trial is off the fronts, as the strip's row names it."""
    status = str(row["status"])
    return "over budget" if status == "ok" else status


def throughput_unit(frame: pd.DataFrame) -> str:
    """The throughput's unit from the results table (``samples/s``, ``tokens/s``)."""
    units = frame["throughput_unit"].dropna().unique() if "throughput_unit" in frame else []
    return " or ".join(sorted(map(str, units))) or "samples/s"


def metric_label(metric: str, frame: pd.DataFrame) -> str:
    """An objective's axis title with its unit, e.g. ``throughput (samples/s)``."""
    return axis_label(metric, throughput_unit(frame))


@dataclass(frozen=True)
class MemoryAxis:
    """The memory axis of a Pareto picture: limits (bytes), scale, ticks, the budget."""

    low: float
    high: float
    log: bool
    budget_drawn: bool
    note: str  # the budget's whereabouts when it is not drawn; "" otherwise

    @property
    def ticks(self) -> list[float]:
        return byte_ticks(self.low, self.high, self.log)

    @property
    def labels(self) -> list[str]:
        return [byte_label(t) for t in self.ticks]


def memory_axis(frame: pd.DataFrame, analysis: ParetoAnalysis) -> MemoryAxis:
    """Limits spanning every trial drawn (feasible at its peak, the rest at their measured or
    predicted peak), the budget included only when within ``NEAR`` of them."""
    fits = frame.loc[analysis.feasible, MEMORY] if MEMORY in frame else pd.Series(dtype=float)
    drawn = pd.concat([fits.astype(float), infeasible_memory(frame[~analysis.feasible])])
    drawn = drawn[np.isfinite(drawn) & (drawn > 0)]
    budget = analysis.budget
    if drawn.empty:
        low, high = (budget / 2, budget * 1.1) if budget else (2.0**10, 2.0**20)
        return MemoryAxis(low, high, True, bool(budget), "")
    low, high = float(drawn.min()), float(drawn.max())
    drawn_budget = bool(budget) and low / NEAR <= budget <= high * NEAR
    note = ""
    if budget and not drawn_budget:
        where = "above" if budget > high else "below"
        edge = f"max {format_bytes(high)}" if budget > high else f"min {format_bytes(low)}"
        note = f"budget {format_bytes(budget)}: far {where} every trial ({edge}), not drawn"
    if budget and drawn_budget:
        low, high = min(low, budget), max(high, budget)
    log = high > LOG_ABOVE * low
    if log:
        pad = max((high / low) ** 0.05, 1.12)
        return MemoryAxis(low / pad, high * pad, True, drawn_budget, note)
    pad = (high - low) * 0.08 if high > low else high * 0.1
    return MemoryAxis(max(low - pad, low * 0.5), high + pad, False, drawn_budget, note)


def title_notes(mem: MemoryAxis, out: pd.DataFrame, placed: pd.DataFrame) -> list[str]:
    """What the picture cannot show: a far budget, trials with no memory figure to place."""
    notes = [mem.note] if mem.note else []
    missing = out.drop(index=placed.index)
    if not missing.empty:
        counts = missing.apply(not_feasible_kind, axis=1).value_counts().sort_index()
        listed = ", ".join(f"{n} {kind}" for kind, n in counts.items())
        notes.append(f"not drawn (no measured or predicted memory): {listed}")
    return notes


def _panel_title(y: Objective) -> str:
    return f"memory vs {y.metric} ({'higher' if y.maximise else 'lower'} is better)"


@dataclass(frozen=True)
class ParetoLayout:
    """What both Pareto pictures (PNG and HTML) are drawn from: the panels (one per
    projection), the memory axis, and the trials that did not fit, placed by their memory in
    a strip of their own (``kinds``: oom, over budget, infeasible, ...)."""

    x: Objective
    panels: list[Objective]
    mem: MemoryAxis
    out: pd.DataFrame  # the trials that are not feasible
    placed: pd.DataFrame  # those of them with a memory to place them at
    kinds: list[str]

    @property
    def strip(self) -> bool:
        return bool(self.kinds)

    def of_kind(self, kind: str) -> pd.DataFrame:
        return self.placed[[not_feasible_kind(r) == kind for _, r in self.placed.iterrows()]]


def pareto_layout(frame: pd.DataFrame, analysis: ParetoAnalysis) -> ParetoLayout:
    """What the Pareto plots draw; ``ValueError`` when no trial can be compared (empty axes
    would pass for a picture of the sweep)."""
    reason = unusable(frame, analysis.objectives)
    if reason:
        raise ValueError(f"nothing to plot: {reason}")
    out = frame[~analysis.feasible]
    out_memory = infeasible_memory(out)
    placed = out[np.isfinite(out_memory) & (out_memory > 0)]
    return ParetoLayout(
        x=Objective(MEMORY, "minimize"),
        panels=projections(analysis) or [Objective("throughput", "maximize")],
        mem=memory_axis(frame, analysis),
        out=out,
        placed=placed,
        kinds=sorted({not_feasible_kind(row) for _, row in placed.iterrows()}),
    )


def feasible_groups(
    frame: pd.DataFrame, analysis: ParetoAnalysis, y: Objective
) -> Iterator[tuple[str, str, pd.DataFrame]]:
    """Each group's name, colour and feasible trials that have ``y`` (one front each)."""
    for index, (name, members) in enumerate(groups_of(frame, analysis)):
        usable = members[analysis.feasible.loc[members.index]]
        if not usable.empty and y.metric in usable:
            yield name, group_colour(index), usable


def pareto_matplotlib(frame: pd.DataFrame, analysis: ParetoAnalysis, title: str) -> Any:
    """The matplotlib figure of ``pareto_png`` (for tests and notebooks): one panel per
    projection, a strip under each for the trials that did not fit, a legend to the right."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FixedLocator, FuncFormatter, MaxNLocator, NullLocator

    layout = pareto_layout(frame, analysis)
    x, panels, mem, strip, kinds = layout.x, layout.panels, layout.mem, layout.strip, layout.kinds
    figure = plt.figure(
        figsize=(6.0 * len(panels) + 2.6, 5.6 if strip else 5.0), layout="constrained"
    )
    grid = figure.add_gridspec(
        2 if strip else 1, len(panels), height_ratios=[6, 1] if strip else [1]
    )
    handles: dict[str, Any] = {}
    for column, y in enumerate(panels):
        axis = figure.add_subplot(grid[0, column])
        axes = [axis]
        for name, colour, usable in feasible_groups(frame, analysis, y):
            handles[name] = axis.scatter(
                usable[x.metric], usable[y.metric], color=colour, s=22, alpha=0.7
            )
            xs, ys = step_front(usable, x, y)
            (handles[f"{name} front"],) = axis.plot(
                xs, ys, drawstyle="steps-post", color=colour, marker="o", markersize=8,
                markerfacecolor="none", markeredgewidth=1.4, label=f"{name} front",
            )  # fmt: skip
        axis.set_ylabel(
            f"{metric_label(y.metric, frame)}\n{'higher' if y.maximise else 'lower'} is better"
        )
        axis.set_title(_panel_title(y), fontsize=10)
        if y.metric == "throughput":
            axis.yaxis.set_major_locator(MaxNLocator(nbins=6, steps=[1, 2, 5, 10]))
            axis.yaxis.set_major_formatter(FuncFormatter(lambda v, _: rate_label(v)))
        axis.grid(True, alpha=0.3)
        if strip:
            band = figure.add_subplot(grid[1, column], sharex=axis)
            axes.append(band)
            axis.tick_params(labelbottom=False)
            for kind in kinds:
                rows = layout.of_kind(kind)
                marker, _ = not_feasible_marker(kind)
                handles[f"not feasible: {kind}"] = band.scatter(
                    infeasible_memory(rows), [kinds.index(kind)] * len(rows),
                    color=NOT_FEASIBLE, marker=marker, s=40,
                )  # fmt: skip
            band.set_yticks(range(len(kinds)), kinds, fontsize=7)
            band.set_ylim(-0.7, len(kinds) - 0.3)
            band.set_ylabel("not\nfeasible", fontsize=8)
            band.grid(True, axis="x", alpha=0.3)
        for each in axes:
            if mem.budget_drawn and analysis.budget:
                handles[f"budget {format_bytes(analysis.budget)}"] = each.axvline(
                    analysis.budget, color=BUDGET, linestyle="--", linewidth=1
                )
        bottom = axes[-1]
        bottom.set_xscale("log" if mem.log else "linear")
        bottom.set_xlim(mem.low, mem.high)
        bottom.xaxis.set_major_locator(FixedLocator(mem.ticks))
        bottom.xaxis.set_major_formatter(FuncFormatter(lambda v, _: byte_label(v)))
        bottom.xaxis.set_minor_locator(NullLocator())
        scale = "log scale, " if mem.log else ""
        bottom.set_xlabel(f"peak allocated memory ({scale}lower is better)")
    figure.legend(
        list(handles.values()), list(handles), loc="outside right upper", fontsize=8, frameon=False
    )
    figure.suptitle("\n".join([title, *title_notes(mem, layout.out, layout.placed)]))
    return figure


def pareto_png(frame: pd.DataFrame, analysis: ParetoAnalysis, path: Path, title: str) -> Path:
    figure = pareto_matplotlib(frame, analysis, title)
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def hover_text(frame: pd.DataFrame) -> pd.Series:
    """Each trial's config, status and numbers, formatted, for a plotly hover box."""

    def text(row: pd.Series) -> str:
        parts = [config_label(row), f"status {row['status']}"]
        if pd.notna(row.get(MEMORY)):
            parts.append(f"peak {format_bytes(row[MEMORY])}")
        elif pd.notna(row.get("predicted_peak_bytes")):
            parts.append(f"predicted peak {format_bytes(row['predicted_peak_bytes'])}")
        if pd.notna(row.get("throughput")):
            unit = row.get("throughput_unit") or "samples/s"
            parts.append(f"throughput {format_quantity(row['throughput'], str(unit))}")
        if pd.notna(row.get("accuracy")):
            parts.append(f"accuracy {row['accuracy']:.3f}")
        return "<br>".join(parts)

    return frame.apply(text, axis=1) if not frame.empty else pd.Series([], dtype=str)


def pareto_figure(frame: pd.DataFrame, analysis: ParetoAnalysis, title: str) -> Any:
    """The plotly figure: one panel per projection (a strip under each for the trials that did
    not fit), hover = the trial's config and numbers."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    layout = pareto_layout(frame, analysis)
    x, panels, mem, strip, kinds = layout.x, layout.panels, layout.mem, layout.strip, layout.kinds
    figure = make_subplots(
        rows=2 if strip else 1,
        cols=len(panels),
        shared_xaxes=True,
        row_heights=[0.82, 0.18] if strip else None,
        vertical_spacing=0.05,
        subplot_titles=[_panel_title(y) for y in panels],
    )
    hover = hover_text(frame)
    for column, y in enumerate(panels, start=1):
        for name, colour, usable in feasible_groups(frame, analysis, y):
            figure.add_trace(
                go.Scatter(
                    x=usable[x.metric], y=usable[y.metric], mode="markers", name=name,
                    legendgroup=name, showlegend=column == 1,
                    marker={"color": colour, "opacity": 0.7},
                    hovertext=hover.loc[usable.index], hoverinfo="text",
                ),
                row=1, col=column,
            )  # fmt: skip
            xs, ys = step_front(usable, x, y)
            figure.add_trace(
                go.Scatter(
                    x=xs, y=ys, mode="lines+markers", line={"shape": "hv", "color": colour},
                    marker={"size": 11, "symbol": "circle-open", "color": colour},
                    name=f"{name} front", legendgroup=name, showlegend=column == 1,
                    hoverinfo="skip",
                ),
                row=1, col=column,
            )  # fmt: skip
        for kind in kinds:
            rows = layout.of_kind(kind)
            _, symbol = not_feasible_marker(kind)
            figure.add_trace(
                go.Scatter(
                    x=infeasible_memory(rows), y=[kind] * len(rows), mode="markers",
                    name=f"not feasible: {kind}", legendgroup=f"not feasible: {kind}",
                    showlegend=column == 1,
                    marker={"color": NOT_FEASIBLE, "symbol": symbol, "size": 9},
                    hovertext=hover.loc[rows.index], hoverinfo="text",
                ),
                row=2, col=column,
            )  # fmt: skip
        if mem.budget_drawn and analysis.budget:
            for row in range(1, 3 if strip else 2):
                # plotly is untyped and pyright reads row/col's type off their default, "all";
                # add_vline's docs take "None, int or 'all'".
                figure.add_vline(
                    x=analysis.budget, line_dash="dash", line_color=BUDGET, line_width=1,
                    row=row, col=column,  # pyright: ignore[reportArgumentType]
                    name=f"budget {format_bytes(analysis.budget)}",
                    showlegend=column == 1 and row == 1,
                )  # fmt: skip
        bottom = 2 if strip else 1
        span = [math.log10(mem.low), math.log10(mem.high)] if mem.log else [mem.low, mem.high]
        for row in range(1, bottom + 1):
            figure.update_xaxes(
                type="log" if mem.log else "linear", range=span, tickvals=mem.ticks,
                ticktext=mem.labels, row=row, col=column,
            )  # fmt: skip
        scale = "log scale, " if mem.log else ""
        figure.update_xaxes(
            title_text=f"peak allocated memory ({scale}lower is better)", row=bottom, col=column
        )
        figure.update_yaxes(title_text=metric_label(y.metric, frame), row=1, col=column)
        if y.metric == "throughput":
            figure.update_yaxes(tickformat=".3~s", row=1, col=column)
        if strip:
            figure.update_yaxes(
                title_text="not feasible", categoryorder="array", categoryarray=kinds,
                row=2, col=column,
            )  # fmt: skip
    notes = title_notes(mem, layout.out, layout.placed)
    heading = title + "".join(f"<br><sup>{n}</sup>" for n in notes)
    figure.update_layout(
        title=heading, height=(560 if strip else 520) + 20 * len(notes),
        margin={"t": 80 + 22 * len(notes)},
    )  # fmt: skip
    return figure


def breakdown_frame(frame: pd.DataFrame) -> pd.DataFrame:
    """Per ``ok`` configuration, its peak's parts; ``ValueError`` when no trial finished ok
    (no bars to draw)."""
    ok = frame[frame["status"].eq("ok")].copy()
    if ok.empty:
        raise ValueError(f"nothing to plot: {unusable(frame, [])}")
    ok["config"] = ok.apply(config_label, axis=1) if not ok.empty else pd.Series(dtype=str)
    columns = [c for c in BREAKDOWN if c in ok]
    data = ok.set_index("config")[columns].fillna(0.0)
    return data.loc[data.sum(axis=1).sort_values(kind="stable").index]  # largest on top


def breakdown_png(frame: pd.DataFrame, path: Path, title: str) -> Path:
    """Stacked bars: where each configuration's peak memory goes."""
    figure = breakdown_matplotlib(frame, title)
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def breakdown_matplotlib(frame: pd.DataFrame, title: str) -> Any:
    """The matplotlib figure of ``breakdown_png``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FixedLocator, FuncFormatter

    data = breakdown_frame(frame)
    height = max(3.0, 0.28 * len(data) + 1.5)
    figure, axis = plt.subplots(figsize=(10, height), layout="constrained")
    left = np.zeros(len(data))
    for column in data.columns:
        category = BREAKDOWN[column]
        axis.barh(
            data.index, data[column], left=left, label=BREAKDOWN_LABELS[category],
            color=BREAKDOWN_COLOURS[category],
        )  # fmt: skip
        left += data[column].to_numpy()
    high = float(left.max()) * 1.05 if len(left) and left.max() > 0 else 2.0**20
    axis.set_xlim(0, high)
    axis.xaxis.set_major_locator(FixedLocator(linear_byte_ticks(0, high)))
    axis.xaxis.set_major_formatter(FuncFormatter(lambda v, _: byte_label(v)))
    axis.set_xlabel("memory at the moment of peak")
    axis.set_title(title)
    axis.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1), frameon=False)
    axis.tick_params(axis="y", labelsize=7)
    return figure


def breakdown_figure(frame: pd.DataFrame, title: str) -> Any:
    import plotly.graph_objects as go

    data = breakdown_frame(frame)
    figure = go.Figure()
    for column in data.columns:
        label = BREAKDOWN_LABELS[BREAKDOWN[column]]
        figure.add_trace(
            go.Bar(
                y=data.index,
                x=data[column],
                name=label,
                orientation="h",
                marker={"color": BREAKDOWN_COLOURS[BREAKDOWN[column]]},
                customdata=[format_bytes(v) for v in data[column]],
                hovertemplate="%{y}<br>" + label + ": %{customdata}<extra></extra>",
            )
        )
    high = float(data.sum(axis=1).max()) * 1.05 if len(data) else 2.0**20
    ticks = linear_byte_ticks(0, high)
    figure.update_layout(
        barmode="stack",
        title=title,
        xaxis={
            "title": "memory at the moment of peak",
            "range": [0, high],
            "tickvals": ticks,
            "ticktext": [byte_label(t) for t in ticks],
        },
        height=max(360, 22 * len(data) + 160),
        legend={"traceorder": "normal"},
    )
    return figure
