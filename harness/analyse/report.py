"""``harness report``'s page: one self-contained HTML file for a sweep (plotly.js embedded, no
request leaves it). It opens with the answer: the configuration to run within the memory
budget and what it gives up against the fastest, the most accurate and the least-memory trials.
Then the Pareto fronts (table, plot, hypervolume, dominance), where the memory goes (breakdown,
the front's memory timelines) and every trial. Numbers carry their units (bytes in KiB/MiB/GiB,
rates as ``2.60k samples/s``, accuracy to 3 digits); a throughput too noisy to compare
(``harness.analyse.noise``) is marked; every trial links to its MLflow run."""

from __future__ import annotations

import html
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pandas as pd

from harness.analyse import plots, timelines
from harness.analyse.compare import Comparison
from harness.analyse.noise import NOISY_MARK, noise_reason, throughputs_tie
from harness.analyse.pareto import MEMORY, ParetoAnalysis, rank_fits, unusable
from harness.analyse.peak_phase import peak_reason
from harness.analyse.style import BREAKDOWN_LABELS
from harness.analyse.tuning import tuning_note
from harness.contract import AXES
from harness.metrics import Objective, format_metric
from harness.record.results import ResultsError, Sweep, trial_timeline
from harness.units import format_bytes

REPORT_TIMELINES = 8  # most Pareto-front trials whose timelines the report shows
MLFLOW_UI = "http://127.0.0.1:5000"  # what `make ui` serves; write_report(mlflow_ui=...)
STYLE = (
    "body{font-family:sans-serif;margin:2em;max-width:1400px}"
    "table{border-collapse:collapse;font-size:12px;margin:.5em 0}"
    "td,th{border:1px solid #ccc;padding:2px 6px}th{background:#f3f3f3;text-align:left}"
    "td.num{text-align:right;white-space:nowrap}"
    "#recommendation{border:2px solid #0072B2;border-radius:6px;padding:.2em 1em 1em;"
    "background:#f5f9fd}p.answer{font-size:16px}p.note{font-size:11px;color:#555}"
    "span.noisy{color:#9a6700}span.over{color:#b00020}"
)
NOISY_NOTE = (
    f"{NOISY_MARK} throughput too noisy to compare (unsteady steps or a busy machine; hover "
    "the figure for the reason, and see the All trials table's note column)."
)


# --- cells ---------------------------------------------------------------------------------


def _missing(value: Any) -> bool:
    return value is None or bool(pd.isna(value))


def _float(value: Any) -> float | None:
    """A cell as a float, None where it is missing (None or NaN)."""
    return None if _missing(value) else float(value)


def rate(row: pd.Series) -> str:
    """The trial's throughput with its unit, ``2.60k samples/s``, marked when noisy."""
    value = _float(row.get("throughput"))
    if value is None:
        return "-"
    unit = row.get("throughput_unit")
    text = html.escape(format_metric("throughput", value, None if _missing(unit) else str(unit)))
    reason = noise_reason(row)
    if reason:
        return f"<span class='noisy' title='{html.escape(reason, quote=True)}'>{text}{NOISY_MARK}</span>"
    return text


def metric_cell(metric: str, row: pd.Series) -> str:
    """One metric of one trial, formatted with its unit (HTML)."""
    if metric == "throughput":
        return rate(row)
    value = _float(row.get(metric))
    if value is None:
        return "-"
    return html.escape(format_metric(metric, value))


def run_url(mlflow_ui: str, experiment_id: str, run_id: str) -> str:
    """The MLflow UI page of a run."""
    return f"{mlflow_ui.rstrip('/')}/#/experiments/{experiment_id}/runs/{run_id}"


def run_cell(row: pd.Series, mlflow_ui: str, experiment_id: str | None) -> str:
    run_id = row.get("run_id")
    if _missing(run_id):
        return "-"
    short = html.escape(str(run_id)[:8])
    if experiment_id is None:
        return f"<code>{short}</code>"
    url = html.escape(run_url(mlflow_ui, experiment_id, str(run_id)), quote=True)
    return f"<a class='run' href='{url}' title='open the trial in the MLflow UI'>{short}</a>"


def table(columns: Sequence[tuple[str, bool]], rows: list[list[str]], css: str = "") -> str:
    """An HTML table of already formatted cells: ``columns`` is (header, numeric) pairs."""
    head = "".join(f"<th>{html.escape(name)}</th>" for name, _ in columns)
    body = "".join(
        "<tr>"
        + "".join(
            f"<td class='num'>{cell}</td>" if numeric else f"<td>{cell}</td>"
            for cell, (_, numeric) in zip(row, columns, strict=True)
        )
        + "</tr>"
        for row in rows
    )
    return f"<table class='{css}'><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def header(metric: str) -> str:
    names = {MEMORY: "peak memory", "predicted_peak_bytes": "predicted peak"}
    names.update({b: BREAKDOWN_LABELS[c] for b, c in plots.BREAKDOWN.items()})
    return names.get(metric, metric)


def noisy_note(rows: pd.DataFrame) -> list[str]:
    flagged = any(noise_reason(row) for _, row in rows.iterrows())
    return [f"<p class='note'>{html.escape(NOISY_NOTE)}</p>"] if flagged else []


# --- the answer ----------------------------------------------------------------------------


def config_words(row: pd.Series) -> str:
    """A grid point with its axes named: ``model_size large, batch_size 128, dtype bf16``."""
    return ", ".join(f"{c} {row[c]}" for c in AXES if c in row.index)


def recommendation_objective(objectives: list[Objective], frame: pd.DataFrame) -> str:
    """What the recommendation maximises: the sweep's first of throughput / accuracy."""
    for objective in objectives:
        wanted = objective.metric in ("throughput", "accuracy") and objective.maximise
        if wanted and objective.metric in frame and frame[objective.metric].notna().any():
            return objective.metric
    return "throughput"


def extremes(frame: pd.DataFrame) -> list[tuple[str, pd.Series]]:
    """The fastest, the most accurate and the least-memory ``ok`` trials (any memory)."""
    ok = frame[frame["status"].eq("ok")]
    found = []
    for role, metric, largest in (
        ("fastest", "throughput", True),
        ("most accurate", "accuracy", True),
        ("least memory", MEMORY, False),
    ):
        have = ok[ok[metric].notna()] if metric in ok else ok.iloc[0:0]
        if not have.empty:
            best = have[metric].astype(float)
            found.append((role, have.iloc[best.argmax() if largest else best.argmin()]))
    return found


def trade(chosen: pd.Series, other: pd.Series) -> str:
    """What running ``chosen`` instead of ``other`` gives up and gains, in words; throughputs
    within noise (``throughputs_tie``) are neither, and the text says so."""
    if chosen.name == other.name:
        return "- (the recommendation itself)"
    gives: list[str] = []
    gains: list[str] = []
    a, b = _float(chosen.get("throughput")), _float(other.get("throughput"))
    tied = throughputs_tie(chosen, other)  # a difference the noise rule cannot tell apart
    if a is not None and b is not None and b > 0 and not tied:
        ratio = a / b
        if ratio < 0.995:
            gives.append(f"{1 - ratio:.0%} of the throughput")
        elif ratio > 1.005:
            gains.append(
                f"{ratio - 1:.0%} more throughput" if ratio < 2 else f"{ratio:.1f}x the throughput"
            )
    a, b = _float(chosen.get("accuracy")), _float(other.get("accuracy"))
    if a is not None and b is not None:
        difference = a - b
        if difference <= -0.0005:
            gives.append(f"{-difference:.3f} accuracy")
        elif difference >= 0.0005:
            gains.append(f"{difference:.3f} accuracy")
    a, b = _float(chosen.get(MEMORY)), _float(other.get(MEMORY))
    if a is not None and b is not None and a != b:
        if a > b:
            times = f" ({a / b:.1f}x)" if b > 0 else ""
            gives.append(f"{format_bytes(a - b, short=True)} more memory{times}")
        else:
            gains.append(f"{format_bytes(b - a, short=True)} less memory")
    text = "gives up " + (", ".join(gives) if gives else "nothing")
    text += ("; gains " + ", ".join(gains)) if gains else ""
    return text + ("; throughput within noise" if tied else "")


def budget_of(sweep: Sweep, analysis: ParetoAnalysis) -> tuple[float | None, str]:
    """The budget the answer is for, and where it comes from."""
    if analysis.budget is not None:
        same = sweep.device_memory is not None and float(sweep.device_memory) == float(
            analysis.budget
        )
        return float(analysis.budget), "the spec's device_memory" if same else "the budget given"
    if sweep.device_memory is not None:
        return float(sweep.device_memory), "the spec's device_memory"
    return None, "no budget set"


def recommendation_section(
    sweep: Sweep,
    analysis: ParetoAnalysis,
    objectives: list[Objective],
    link: Callable[[pd.Series], str],
) -> list[str]:
    frame = sweep.frame
    budget, source = budget_of(sweep, analysis)
    objective = recommendation_objective(objectives, frame)
    best_word = "fastest" if objective == "throughput" else "most accurate"
    has_memory = MEMORY in frame and frame[MEMORY].notna().any()
    ranking = (
        rank_fits(frame, budget if budget is not None else float("inf"), objective)
        if objective in frame and has_memory
        else None
    )
    ranked = ranking.trials.head(1) if ranking is not None else frame.iloc[0:0]
    tie = ranking.tie_note(1) if ranking is not None else None
    among = ""
    if tie and ranking is not None:  # accuracy or memory decided the first place, not noise
        best_word = "most accurate" if ranking.has_accuracy else "least-memory"
        among = " among those whose throughputs are within noise of the fastest"
    where = (
        f"Within <b>{html.escape(format_bytes(budget))}</b> ({source})"
        if budget is not None
        else "With no memory budget (the spec sets no device_memory)"
    )
    parts = ["<section id='recommendation'>", "<h2>Recommendation</h2>"]
    rows: list[tuple[str, pd.Series]] = []
    if ranked.empty:
        ok = frame[frame["status"].eq("ok")]
        ok = ok[ok[MEMORY].notna()] if MEMORY in ok else ok.iloc[0:0]
        smallest = (
            f"the smallest measured peak is {html.escape(format_bytes(ok[MEMORY].min()))} "
            f"({html.escape(plots.config_label(ok.iloc[ok[MEMORY].argmin()]))})"
            if not ok.empty
            else "no trial finished ok"
        )
        parts.append(f"<p class='answer'>{where}: <b>nothing fits</b>; {smallest}.</p>")
    else:
        best = ranked.iloc[0]
        fits = "that fits" if budget is not None else "measured"
        numbers = ", ".join(
            [
                rate(best),
                f"accuracy {metric_cell('accuracy', best)}",
                f"peak {metric_cell(MEMORY, best)}",
            ]
        )
        parts.append(
            f"<p class='answer'>{where}, run <b>{html.escape(config_words(best))}</b>: "
            f"the {best_word} configuration {fits}{among}: {numbers} (MLflow run {link(best)}).</p>"
        )
        if tie:
            parts.append(f"<p class='note'>{html.escape(tie)}.</p>")
        reason = noise_reason(best)
        if reason:
            parts.append(
                f"<p class='note'>Its throughput is flagged as noisy ({html.escape(reason)}): "
                "rerun on a quiet machine before trusting the ranking.</p>"
            )
        why = peak_reason(best.to_dict())
        if why:
            parts.append(f"<p class='note'>Its {html.escape(why)}.</p>")
        rows.append(("recommended", best))
    rows += extremes(frame)
    if rows:
        chosen = rows[0][1] if not ranked.empty else None

        def memory(row: pd.Series) -> str:
            cell = metric_cell(MEMORY, row)
            over = (
                budget is not None and not _missing(row.get(MEMORY)) and float(row[MEMORY]) > budget
            )
            return f"<span class='over'>{cell} (over budget)</span>" if over else cell

        columns = [
            ("", False),
            ("configuration", False),
            ("peak memory", True),
            ("throughput", True),
            ("accuracy", True),
            ("the recommendation vs this trial", False),
            ("MLflow run", False),
        ]
        body = [
            [
                html.escape(role),
                html.escape(plots.config_label(row)),
                memory(row),
                rate(row),
                metric_cell("accuracy", row),
                html.escape(trade(chosen, row)) if chosen is not None else "-",
                link(row),
            ]
            for role, row in rows
        ]
        parts.append(table(columns, body, "answer"))
        parts += noisy_note(pd.DataFrame([row for _, row in rows]))
    parts.append("</section>")
    return parts


# --- the rest of the page ------------------------------------------------------------------


def experiment_of(sweep: Sweep) -> str | None:
    """The MLflow experiment id of the sweep's runs (for links), or None when unknown."""
    if "experiment_id" in sweep.frame and sweep.frame["experiment_id"].notna().any():
        return str(sweep.frame["experiment_id"].dropna().iloc[0])
    uri = sweep.tracking_uri
    if uri.startswith("sqlite:///") and not Path(uri.removeprefix("sqlite:///")).exists():
        return None
    try:
        from mlflow.tracking import MlflowClient

        from harness.record.stores import quiet_mlflow

        quiet_mlflow()
        return str(MlflowClient(tracking_uri=uri).get_run(sweep.parent_run_id).info.experiment_id)
    except Exception:  # no store, no run: the page goes without links
        return None


def trial_table(
    frame: pd.DataFrame, metrics: list[str], link: Callable[[pd.Series], str], note: bool = False
) -> list[str]:
    """Trials as a table: grid point, status, the metrics formatted, the MLflow run."""
    axes = [c for c in AXES if c in frame]
    metrics = [m for m in dict.fromkeys(metrics) if m in frame]
    columns = [(c, False) for c in axes] + ([("status", False)] if "status" in frame else [])
    columns += [(header(m), True) for m in metrics] + [("MLflow run", False)]
    if note:
        columns.append(("note", False))
    rows = []
    for _, row in frame.iterrows():
        cells = [html.escape(str(row[c])) for c in axes]
        cells += [html.escape(str(row["status"]))] if "status" in frame else []
        cells += [metric_cell(m, row) for m in metrics] + [link(row)]
        if note:
            reasons = [str(row.get("failure_reason") or "")[:160]]
            noisy = noise_reason(row)
            reasons.append(f"throughput noisy: {noisy}" if noisy else "")
            reasons.append(tuning_note(row, frame) or "")
            cells.append(html.escape("; ".join(r for r in reasons if r)))
        rows.append(cells)
    return [table(columns, rows), *noisy_note(frame)]


def groups_table(analysis: ParetoAnalysis, heading: str = "group") -> str:
    columns = [(heading, False), ("trials", True), ("feasible", True), ("front size", True)]
    columns.append(("hypervolume", True))
    rows = [
        [html.escape(str(g["group"])), str(g["trials"]), str(g["feasible"]), str(g["front_size"]),
         f"{float(g['hypervolume']):.3f}"]
        for _, g in analysis.groups.iterrows()
    ]  # fmt: skip
    return table(columns, rows)


def dominance_table(analysis: ParetoAnalysis) -> str:
    names = [str(n) for n in analysis.dominance.columns]
    columns = [("front A dominates ->", False)] + [(n, True) for n in names]
    rows = [
        [html.escape(str(a))] + [f"{float(v):.0%}" for v in shares]
        for a, shares in zip(analysis.dominance.index, analysis.dominance.to_numpy(), strict=True)
    ]
    return table(columns, rows)


def write_report(
    sweep: Sweep,
    analysis: ParetoAnalysis,
    objectives: list[Objective],
    path: Path,
    mlflow_ui: str = MLFLOW_UI,
    experiment_id: str | None = None,
    comparison: Comparison | None = None,
) -> Path:
    """Write the page. ``mlflow_ui``: the MLflow UI the trial links open (``make ui``'s by
    default); ``experiment_id``: the sweep's MLflow experiment (default: looked up);
    ``comparison``: this sweep beside others (``harness report --versus``), a section of its own.
    ``ValueError`` (and no file) when no trial can be compared (``unusable``): a page without
    one would read as an answer."""
    reason = unusable(sweep.frame, analysis.objectives)
    if reason:
        raise ValueError(f"nothing to report: {reason}")
    experiment_id = experiment_id or experiment_of(sweep)

    def link(row: pd.Series) -> str:
        return run_cell(row, mlflow_ui, experiment_id)

    frame = sweep.frame
    pareto_figure = plots.pareto_figure(frame, analysis, "Pareto fronts")
    breakdown = plots.breakdown_figure(frame, "Memory at the moment of peak")
    counts = frame["status"].value_counts().to_dict()
    budget = format_bytes(analysis.budget) if analysis.budget else "none"
    sweep_link = (
        f"<a href='{html.escape(run_url(mlflow_ui, experiment_id, sweep.parent_run_id), quote=True)}'>"
        f"{html.escape(sweep.parent_run_id)}</a>"
        if experiment_id is not None
        else f"<code>{html.escape(sweep.parent_run_id)}</code>"
    )
    objective_metrics = [o.metric for o in analysis.objectives]
    front = analysis.front.sort_values(analysis.objectives[0].metric)
    ordered = (
        frame.assign(_ok=frame["status"].ne("ok")).sort_values(["_ok", MEMORY]).drop(columns="_ok")
    )
    every = [*plots.BREAKDOWN, MEMORY, "predicted_peak_bytes", "throughput", "accuracy"]
    sections = [
        f"<h1>{html.escape(sweep.experiment)}</h1>",
        *recommendation_section(sweep, analysis, objectives, link),
        "<h2>The sweep</h2>",
        f"<p>{len(frame)} trials: "
        + ", ".join(f"{n} {html.escape(str(s))}" for s, n in sorted(counts.items()))
        + f". {int(analysis.feasible.sum())} feasible within the budget ({budget})."
        + f" Objectives: {html.escape(', '.join(map(str, objectives)))}."
        + f" MLflow sweep run {sweep_link}; trial links open the MLflow UI at "
        + f"<code>{html.escape(mlflow_ui)}</code> (<code>make ui</code>).</p>",
        "<h2>Pareto front</h2>",
        "<p>Feasible trials that no other trial beats in every objective, best in "
        f"{html.escape(analysis.objectives[0].metric)} first.</p>",
        *trial_table(front, objective_metrics, link),
        pareto_figure.to_html(full_html=False, include_plotlyjs=True, div_id="pareto"),
        f"<h2>Hypervolume per {html.escape(analysis.by or 'sweep')}</h2>",
        groups_table(analysis),
        f"<p class='note'>{html.escape(analysis.reference)}</p>",
    ]
    if len(analysis.dominance) > 1:
        sections += ["<h2>Dominance between fronts</h2>", dominance_table(analysis)]
    if comparison is not None:
        sections += comparison_section(comparison)
    sections += [
        "<h2>Where the memory goes</h2>",
        breakdown.to_html(full_html=False, include_plotlyjs=False, div_id="breakdown"),
        *front_timelines(sweep, analysis),
        "<h2>All trials</h2>",
        *trial_table(ordered, every, link, note=True),
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


def comparison_section(comparison: Comparison) -> list[str]:
    """This sweep beside the others (``harness.analyse.compare``): every front on one scale,
    who dominates whom, each matched configuration's ratios to this sweep."""
    figure = plots.pareto_figure(comparison.frame, comparison.analysis, "Pareto fronts by sweep")
    keys = [c for c in comparison.matched.columns if "/" not in c and " " not in c]
    ratios = [c for c in comparison.matched.columns if "/" in c]
    matched_rows = [
        [html.escape(str(row[c])) for c in keys] + [f"{float(row[c]):.2f}x" for c in ratios]
        for _, row in comparison.matched.iterrows()
    ]
    section = [
        "<h2>Compared with other sweeps</h2>",
        "<p>Every front scaled over the feasible trials of all these sweeps together (one "
        f"reference point); ratios are to {html.escape(comparison.labels[0])}, over the "
        "configurations every sweep finished ok.</p>",
        groups_table(comparison.analysis, "sweep"),
        "<ul>"
        + "".join(
            f"<li>{html.escape(line)}</li>"
            for line in comparison.dominance_lines() + comparison.ratio_lines()
        )
        + "</ul>",
        figure.to_html(full_html=False, include_plotlyjs=False, div_id="compare"),
    ]
    if matched_rows:
        heads = [(html.escape(c), False) for c in keys] + [(html.escape(c), True) for c in ratios]
        section.append(table(heads, matched_rows))
    if not comparison.missing.empty:
        missing = comparison.missing
        section += [
            "<p>Not in every sweep (each sweep's status there, or absent):</p>",
            table(
                [(html.escape(str(c)), False) for c in missing.columns],
                [[html.escape(str(v)) for v in row] for row in missing.to_numpy()],
            ),
        ]
    return section


def front_timelines(sweep: Sweep, analysis: ParetoAnalysis) -> list[str]:
    """HTML for the memory timelines of the Pareto-front trials (those that have one)."""
    front = analysis.front.sort_values(analysis.objectives[0].metric).head(REPORT_TIMELINES)
    parts: list[Any] = []
    for _, row in front.iterrows():
        try:
            data = trial_timeline(sweep.tracking_uri, row["run_id"])
        except ResultsError:  # the store is gone: no timelines to show
            return []
        if data is None:
            continue
        figure = timelines.timeline_figure(plots.config_label(row), data)
        div = f"timeline-{len(parts)}"
        parts.append(figure.to_html(full_html=False, include_plotlyjs=False, div_id=div))
    if not parts:
        return []
    return [
        "<h3>Memory timelines of the Pareto-front trials</h3>",
        "<p>Bytes held by tensors after each op of the memory window, stacked by category in "
        "the breakdown's colours; the bands behind are the phases and the dashed line the "
        "peak (both in the legend).</p>",
        *parts,
    ]
