"""``harness report``'s page: one self-contained HTML file for a sweep (plotly.js embedded, no
request leaves it), with the front, the hypervolume and dominance tables, the interactive
Pareto and breakdown plots, the front's memory timelines and every trial."""

from __future__ import annotations

import html
from pathlib import Path
from typing import Any

from harness.analyse import plots, timelines
from harness.analyse.pareto import MEMORY, Objective, ParetoAnalysis
from harness.contract import AXES
from harness.record.results import Sweep, trial_timeline
from harness.units import format_bytes

REPORT_TIMELINES = 8  # most Pareto-front trials whose timelines the report shows
STYLE = (
    "body{font-family:sans-serif;margin:2em}table{border-collapse:collapse;"
    "font-size:12px}td,th{border:1px solid #ccc;padding:2px 6px}"
)


def write_report(
    sweep: Sweep, analysis: ParetoAnalysis, objectives: list[Objective], path: Path
) -> Path:
    pareto_figure = plots.pareto_figure(sweep.frame, analysis, "Pareto fronts")
    breakdown = plots.breakdown_figure(sweep.frame, "Memory at the moment of peak")
    counts = sweep.frame["status"].value_counts().to_dict()
    trials = sweep.frame[[*AXES, "status", *plots.BREAKDOWN, MEMORY, "throughput", "accuracy"]]
    budget = format_bytes(sweep.device_memory) if sweep.device_memory else "none"
    sections = [
        f"<h1>{html.escape(sweep.experiment)}</h1>",
        f"<p>{len(sweep.frame)} trials: "
        + ", ".join(f"{n} {html.escape(str(s))}" for s, n in sorted(counts.items()))
        + f". Budget: {budget}."
        + f" Objectives: {html.escape(', '.join(map(str, objectives)))}."
        + f" MLflow sweep run <code>{sweep.parent_run_id}</code>.</p>",
        "<h2>Pareto front</h2>",
        analysis.front_table().to_html(index=False, na_rep="-"),
        f"<h2>Hypervolume per {html.escape(analysis.by or 'sweep')}</h2>",
        analysis.groups.to_html(index=False, float_format=lambda v: f"{v:.4f}"),
        f"<p>{html.escape(analysis.reference)}</p>",
        "<h2>Dominance between fronts</h2>",
        analysis.dominance_table().to_html(index=False),
        pareto_figure.to_html(full_html=False, include_plotlyjs=True, div_id="pareto"),
        breakdown.to_html(full_html=False, include_plotlyjs=False, div_id="breakdown"),
        *front_timelines(sweep, analysis),
        "<h2>All trials</h2>",
        trials.to_html(index=False, na_rep="-"),
    ]
    page = (
        # No favicon request: the page is one self-contained file.
        "<!DOCTYPE html><html><head><meta charset='utf-8'><link rel='icon' href='data:,'>"
        f"<title>harness report: {html.escape(sweep.experiment)}</title>"
        f"<style>{STYLE}</style></head><body>" + "\n".join(sections) + "</body></html>"
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(page)
    return path


def front_timelines(sweep: Sweep, analysis: ParetoAnalysis) -> list[str]:
    """HTML for the memory timelines of the Pareto-front trials (those that have one)."""
    front = analysis.front.sort_values(analysis.objectives[0].metric).head(REPORT_TIMELINES)
    parts: list[Any] = []
    for _, row in front.iterrows():
        data = trial_timeline(sweep.tracking_uri, row["run_id"])
        if data is None:
            continue
        figure = timelines.timeline_figure(plots.config_label(row), data)
        div = f"timeline-{len(parts)}"
        parts.append(figure.to_html(full_html=False, include_plotlyjs=False, div_id=div))
    if not parts:
        return []
    return [
        "<h2>Memory timelines of the Pareto-front trials</h2>",
        "<p>Bytes held by tensors after each op of the memory window, by category; bands: "
        "forward (blue), backward (orange), recomputation (red), optimizer step (green).</p>",
        *parts,
    ]
