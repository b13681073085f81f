"""``harness plan``'s picture: predicted memory against predicted throughput, one colour per card.

Each card's points that fit are filled dots joined by the card's front (no point of the card
is both smaller and faster), the ones that do not fit are hollow, and the card's budget is a
dashed line of its colour: the fastest configuration that fits is the highest filled dot left
of the line. The same picture as PNG (matplotlib) and HTML (plotly), with the memory axis in
binary units and throughput in the trial's unit.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from harness.analyse.style import byte_label, byte_ticks, group_colour, rate_label
from harness.contract import CPU_CARD
from harness.units import format_bytes


def judged_memory(rows: pd.DataFrame) -> pd.Series:
    """The figure a point is judged on: device bytes on a card, the allocated peak on a CPU."""
    if "predicted_device_bytes" in rows:
        return rows["predicted_device_bytes"].where(
            rows["card"].ne(CPU_CARD), rows["predicted_peak_bytes"]
        )
    return rows["predicted_peak_bytes"]


def plotted(frame: pd.DataFrame) -> pd.DataFrame:
    """The predicted points with the figure each is judged on (``memory``)."""
    out = frame.assign(memory=judged_memory(frame))
    return out[out["memory"].notna() & out["predicted_throughput"].notna()]


def front_of(points: pd.DataFrame) -> pd.DataFrame:
    """The fitting points no other fitting point beats in both memory and throughput, by
    memory: the staircase a card's choices climb."""
    fitting = points[points["fits"].fillna(False).astype(bool)].sort_values("memory")
    best = -np.inf
    keep = []
    for index, throughput in fitting["predicted_throughput"].items():
        if throughput > best:
            keep.append(index)
            best = throughput
    return fitting.loc[keep]


def axis_labels(frame: pd.DataFrame) -> tuple[str, str]:
    units = frame.get("throughput_unit", pd.Series(dtype=object)).dropna().unique()
    unit = units[0] if len(units) == 1 else "samples or tokens/s"
    memory = "predicted device memory (CUDA: reserved + context; CPU: allocated), lower is better"
    return memory, f"predicted throughput ({unit}), higher is better"


def point_label(row: Any) -> str:
    return f"{row['strategy']} b{int(row['batch_size'])}"


def front_png(frame: pd.DataFrame, path: Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import (
        FixedLocator,
        FuncFormatter,
        LogLocator,
        NullFormatter,
        NullLocator,
    )

    points = plotted(frame)
    figure, axis = plt.subplots(figsize=(11, 6), layout="constrained")
    for index, (card, rows) in enumerate(points.groupby("card", sort=False)):
        colour = group_colour(index)
        fits = rows["fits"].fillna(False).astype(bool)
        if fits.any():
            axis.scatter(rows.loc[fits, "memory"], rows.loc[fits, "predicted_throughput"],
                         color=colour, s=30, label=f"{card}: fits")  # fmt: skip
        if (~fits).any():
            axis.scatter(rows.loc[~fits, "memory"], rows.loc[~fits, "predicted_throughput"],
                         facecolors="none", edgecolors=colour, s=30,
                         label=f"{card}: does not fit")  # fmt: skip
        front = front_of(rows)
        if len(front):
            axis.plot(front["memory"], front["predicted_throughput"], drawstyle="steps-post",
                      color=colour, linewidth=1.2)  # fmt: skip
            best = front.iloc[-1]  # the fastest that fits: the front's top
            axis.annotate(f"best on {card}: {point_label(best)}",
                          (best["memory"], best["predicted_throughput"]), fontsize=7,
                          xytext=(6, -12 - 9 * index), textcoords="offset points", color=colour)  # fmt: skip
        budget = rows["budget_bytes"].iloc[0]
        if pd.notna(budget):
            axis.axvline(float(budget), color=colour, linestyle="--", linewidth=1,
                         label=f"{card} budget {format_bytes(float(budget), short=True)}")  # fmt: skip
    memory_label, rate = axis_labels(points)
    values = [*points["memory"], *points["budget_bytes"].dropna().astype(float)]
    low, high = min(values) * 0.8, max(values) * 1.2
    axis.set_xscale("log")
    axis.set_xlim(low, high)
    axis.xaxis.set_major_locator(FixedLocator(byte_ticks(low, high, log=True)))
    axis.xaxis.set_major_formatter(FuncFormatter(lambda v, _: byte_label(v)))
    axis.xaxis.set_minor_locator(NullLocator())
    axis.set_yscale("log")
    axis.yaxis.set_major_formatter(FuncFormatter(lambda v, _: rate_label(v)))
    axis.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    axis.yaxis.set_minor_formatter(NullFormatter())
    rates = points["predicted_throughput"]
    axis.set_ylim(rates.min() / 1.3, rates.max() * 1.3)
    axis.set_xlabel(f"{memory_label} (log scale)")
    axis.set_ylabel(f"{rate} (log scale)")
    axis.grid(True, alpha=0.3, which="both")
    figure.legend(fontsize=8, loc="outside right upper", frameon=False)
    axis.set_title(title, fontsize=10)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def front_html(frame: pd.DataFrame, path: Path, title: str) -> Path:
    import plotly.graph_objects as go

    points = plotted(frame)
    figure = go.Figure()
    for index, (card, rows) in enumerate(points.groupby("card", sort=False)):
        colour = group_colour(index)
        fits = rows["fits"].fillna(False).astype(bool)
        for subset, name, symbol in ((rows[fits], "fits", "circle"),
                                     (rows[~fits], "does not fit", "circle-open")):  # fmt: skip
            figure.add_trace(
                go.Scatter(
                    x=subset["memory"],
                    y=subset["predicted_throughput"],
                    mode="markers",
                    marker={"color": colour, "symbol": symbol, "size": 9},
                    name=f"{card}: {name}",
                    text=[hover(row) for _, row in subset.iterrows()],
                    hoverinfo="text",
                )
            )
        front = front_of(rows)
        if len(front):
            figure.add_trace(
                go.Scatter(
                    x=front["memory"], y=front["predicted_throughput"], mode="lines",
                    line={"color": colour, "shape": "hv"}, name=f"{card}: front",
                    hoverinfo="skip",
                )
            )  # fmt: skip
        budget = rows["budget_bytes"].iloc[0]
        if pd.notna(budget):  # a line trace, so the legend names it
            rates = points["predicted_throughput"]
            figure.add_trace(
                go.Scatter(
                    x=[float(budget)] * 2, y=[rates.min() / 1.3, rates.max() * 1.3],
                    mode="lines", line={"color": colour, "dash": "dash", "width": 1},
                    name=f"{card} budget {format_bytes(float(budget), short=True)}",
                    hoverinfo="name",
                )
            )  # fmt: skip
    memory_label, rate = axis_labels(points)
    values = [*points["memory"], *points["budget_bytes"].dropna().astype(float)]
    low, high = min(values) * 0.8, max(values) * 1.2
    ticks = byte_ticks(low, high, log=True)
    figure.update_layout(
        title=title,
        xaxis={"title": memory_label, "type": "log", "tickvals": ticks,
               "ticktext": [byte_label(t) for t in ticks],
               "range": [np.log10(low), np.log10(high)]},
        yaxis={"title": rate, "type": "log"},
        template="plotly_white",
    )  # fmt: skip
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.write_html(path, include_plotlyjs=True)
    return path


def hover(row: Any) -> str:
    unit = row.get("throughput_unit") or "samples/s"
    rank = f"rank {int(row['rank'])} on {row['card']}" if pd.notna(row["rank"]) else "not ranked"
    return (
        f"{point_label(row)} {row['dtype']} on {row['card']}<br>"
        f"memory {format_bytes(row['memory'], short=True)}<br>"
        f"{row['predicted_throughput']:,.0f} {unit}, step {row['predicted_step_time_ms']:,.1f} ms"
        f"<br>{rank}"
    )
