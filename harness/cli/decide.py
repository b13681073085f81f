"""``harness pareto``, ``recommend``, ``report`` and ``timeline``: decide from a recorded sweep.

Each reads one sweep from MLflow (``--experiment``/``--sweep`` as ``harness results``), never
runs a trial, and writes its files under ``results/<experiment>/`` and onto the sweep's parent
MLflow run as artifacts.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import click
import pandas as pd

from harness.analyse.pareto import (
    MEMORY,
    RANKABLE,
    ParetoAnalysis,
    Ranking,
    analyse,
    gives_up,
    group_column,
    rank_fits,
    unusable,
)
from harness.analyse.peak_phase import peak_reason
from harness.cli.common import (
    cell,
    experiment_option,
    make_console,
    open_selected,
    open_sweep,
    output_dir,
    show,
    sweep_options,
    table_text,
    tracking_uri_option,
)
from harness.contract import AXES
from harness.metrics import DEFAULT_OBJECTIVES, METRICS, Objective, parse_objectives
from harness.record.results import ResultsError, Sweep, find_trial, trial_timeline
from harness.record.tracking import publish
from harness.units import format_bytes, parse_bytes

BY_HELP = (
    "Group column (strategy, dtype, model_size, ...), 'auto' (the first that varies) or 'none'."
)


def objectives_for(sweep: Sweep, text: str | None) -> list[Objective]:
    """``--objectives`` if given, else the sweep's own (recorded on its parent run)."""
    text = text or sweep.params.get("objectives")
    if not text:
        return list(DEFAULT_OBJECTIVES)
    try:
        return parse_objectives(text)
    except ValueError as error:
        raise click.BadParameter(str(error), param_hint="--objectives") from None


def budget_option(value: str) -> float:
    try:
        return float(parse_bytes(value))
    except ValueError as error:
        raise click.BadParameter(str(error), param_hint="--budget") from None


def run_analysis(
    sweep: Sweep, objectives: list[Objective], by: str, budget: float | None
) -> ParetoAnalysis:
    if sweep.frame.empty:
        raise click.ClickException("the sweep has no trials recorded yet")
    require_usable(sweep, objectives)
    try:
        return analyse(sweep.frame, objectives, group_column(sweep.frame, by), budget)
    except ValueError as error:
        raise click.ClickException(str(error)) from None


def require_usable(sweep: Sweep, objectives: list[Objective]) -> None:
    """One line and exit 1 when no trial finished ok with every objective measured: a front,
    a picture or a page drawn from nothing would pass for an answer, so none is written."""
    reason = unusable(sweep.frame, objectives)
    if reason is None:
        return
    hints = failure_hints(sweep) or ["see harness results"]
    raise click.ClickException(
        f"sweep {sweep.parent_run_id[:8]} of {sweep.experiment}: {reason}; nothing to compare; "
        + "; ".join(hints)
    )


def write_pareto_files(sweep: Sweep, analysis: ParetoAnalysis, folder: Path) -> list[Path]:
    from harness.analyse import plots

    title = f"{sweep.experiment}: Pareto fronts" + (f" by {analysis.by}" if analysis.by else "")
    png = plots.pareto_png(sweep.frame, analysis, folder / "pareto.png", title)
    page = folder / "pareto.html"
    plots.pareto_figure(sweep.frame, analysis, title).write_html(page, include_plotlyjs=True)
    bars_title = f"{sweep.experiment}: memory at peak"
    bars_png = plots.breakdown_png(sweep.frame, folder / "breakdown.png", bars_title)
    bars = folder / "breakdown.html"
    plots.breakdown_figure(sweep.frame, bars_title).write_html(bars, include_plotlyjs=True)
    return [png, page, bars_png, bars]


@click.command()
@sweep_options
@click.option(
    "--objectives",
    default=None,
    help="e.g. 'peak_allocated_bytes:min,throughput:max'; default: the sweep's own.",
)
@click.option("--by", default="auto", show_default=True, help=BY_HELP)
@click.option("--budget", default=None, help="Memory budget, e.g. 16GiB; default device_memory.")
@click.option("--out-dir", type=click.Path(file_okay=False, path_type=Path), default=None)
@click.option("--no-plots", is_flag=True, help="Print the tables only.")
def pareto(
    experiment: str | None,
    sweep_id: str,
    tracking_uri: str,
    objectives: str | None,
    by: str,
    budget: str | None,
    out_dir: Path | None,
    no_plots: bool,
) -> None:
    """The non-dominated trials overall and per group, each group's hypervolume, and how often
    one group's front dominates another's; plots as PNG and interactive HTML."""
    console = make_console()
    sweep = open_sweep(experiment, sweep_id, tracking_uri)
    chosen = objectives_for(sweep, objectives)
    limit = budget_option(budget) if budget else sweep.device_memory
    if sweep_id == "all" and by == "auto" and sweep.frame["sweep_run_id"].nunique() > 1:
        by = "sweep"  # every sweep of the experiment: a front each, by short id and start
    analysis = run_analysis(sweep, chosen, by, limit)
    where = f"within {format_bytes(limit)}" if limit else "no memory budget"
    console.print(
        f"[bold]{sweep.experiment}[/]: {int(analysis.feasible.sum())} of {len(sweep.frame)} "
        f"trials feasible ({where}); objectives {', '.join(map(str, chosen))}"
    )
    front = analysis.front.sort_values(chosen[0].metric)  # front_table's order, whole rows
    columns = list(analysis.front_table().columns)
    show(front, "Pareto front (feasible, non-dominated)", console, columns)
    show(analysis.groups, f"Per {analysis.by or 'sweep'}: hypervolume", console)
    console.print(f"Hypervolume: {analysis.reference}.", soft_wrap=True)
    if len(analysis.dominance) > 1:
        show(analysis.dominance_table(), "Share of front B dominated by front A", console)
    if no_plots:
        return
    paths = write_pareto_files(sweep, analysis, output_dir(sweep, out_dir))
    publish(sweep.tracking_uri, sweep.parent_run_id, paths, "pareto")
    console.print(
        "wrote "
        + ", ".join(str(p) for p in paths)
        + f" (also on MLflow run {sweep.parent_run_id})",
        soft_wrap=True,
    )


@click.command()
@sweep_options
@click.option("--budget", required=True, help="Memory you have, e.g. 16GiB or 500MB.")
@click.option(
    "--objective",
    type=click.Choice(RANKABLE),
    default="throughput",
    show_default=True,
    help="What ranks the configs: higher throughput or accuracy; lower eval_loss, perplexity, "
    "time_to_target_s or steps_to_target (trials that did not reach the target are left out).",
)
def recommend(
    experiment: str | None, sweep_id: str, tracking_uri: str, budget: str, objective: str
) -> None:
    """The best measured config whose peak fits BUDGET, the runner-up, and what it gives up."""
    console = make_console()
    limit = budget_option(budget)
    sweep = open_sweep(experiment, sweep_id, tracking_uri)
    direction = "maximize" if METRICS[objective].better == "higher" else "minimize"
    require_usable(sweep, [Objective(objective, direction), Objective(MEMORY, "minimize")])
    try:
        ranking = rank_fits(sweep.frame, limit, objective)
    except ValueError as error:
        raise click.ClickException(str(error)) from None
    ranked = ranking.trials.head(2)
    if ranked.empty:
        click.echo(nothing_fits(sweep, limit), err=True)
        raise SystemExit(2)
    best = ranked.iloc[0]
    columns = [*AXES, MEMORY, "throughput", "accuracy"]
    columns += [objective] if objective not in columns else []
    show(ranked, f"Best within {format_bytes(limit)}", console, [c for c in columns if c in ranked])
    tie = ranking.tie_note(len(ranked))
    if tie:
        console.print(tie, soft_wrap=True, highlight=False, markup=False)
    console.print(
        f"Recommended: {' '.join(str(best[c]) for c in AXES)} "
        f"({objective} {cell(objective, best[objective], best)}, "
        f"peak {cell(MEMORY, best[MEMORY])})",
        soft_wrap=True,
        highlight=False,
    )
    if len(ranked) > 1:
        runner = ranked.iloc[1]
        console.print(
            f"Runner-up: {' '.join(str(runner[c]) for c in AXES)}: "
            f"{gives_up(best, runner, objective, tied=same_tier(ranking))}",
            soft_wrap=True,
            highlight=False,
        )
    why = peak_reason(best.to_dict())
    if why:
        console.print(f"Its {why}", soft_wrap=True, highlight=False, markup=False)


def same_tier(ranking: Ranking) -> bool:
    """Whether the best and the runner-up tie on the objective (within noise)."""
    return len(ranking.tier) > 1 and ranking.tier.iloc[0] == ranking.tier.iloc[1]


def nothing_fits(sweep: Sweep, limit: float) -> str:
    """Why nothing can be recommended, in one line, and what to do about it: a budget below
    every measured peak, or a sweep in which no trial ran to the end."""
    frame, where = sweep.frame, f"sweep {sweep.experiment!r}"
    if frame.empty:
        return f"nothing to recommend: {where} has no trials recorded yet"
    ok = frame[frame["status"].eq("ok") & frame[MEMORY].notna()]
    if not ok.empty:
        smallest = ok[MEMORY].min()
        return (
            f"nothing in {where} fits in {format_bytes(limit)}; the smallest measured peak is "
            f"{format_bytes(smallest)} (--budget {budget_at_least(smallest)} or more)"
        )
    counts = frame["status"].value_counts()
    statuses = ", ".join(f"{n} {status}" for status, n in counts.items())
    return f"nothing to recommend: no trial of {where} finished ok ({statuses}); " + "; ".join(
        failure_hints(sweep)
    )


def failure_hints(sweep: Sweep) -> list[str]:
    """What to do about the trials that did not finish ok: run the infeasible ones, give the
    oom ones memory, read the other failures' reasons. Empty when every trial finished ok."""
    frame = sweep.frame
    counts = frame["status"].value_counts()
    hints = []
    if counts.get("infeasible"):
        device = sweep.device_memory
        over = f"predicted over device_memory {format_bytes(device)}" if device else "not run"
        predicted = frame.loc[frame["status"].eq("infeasible"), "predicted_peak_bytes"].min()
        larger = "a larger device_memory"
        if not pd.isna(predicted):
            larger = f"device_memory: {budget_at_least(predicted)} or more"
        hints.append(
            f"the infeasible ones were {over}, so never ran: set limits.run_infeasible: true "
            f"and run harness sweep SPEC --retry-failed=all, or give the spec {larger}"
        )
    if counts.get("oom"):
        reached = frame.loc[frame["status"].eq("oom"), MEMORY].min()
        least = "" if pd.isna(reached) else f" (the least at {format_bytes(reached)})"
        hints.append(
            f"the oom ones ran out of memory{least}: give them a larger device_memory or "
            "device, smaller batch sizes or a memory strategy (checkpoint, bf16_params, "
            "accumulate:N)"
        )
    if set(counts.index) - {"infeasible", "oom", "ok"}:
        hints.append("harness results shows each failure_reason")
    return hints


def budget_at_least(num: float) -> str:
    """A size to type that is not below ``num`` bytes, e.g. ``249.4KiB`` for 255,300 B."""
    value, unit = float(num), "B"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            break
        value /= 1024
    return f"{math.ceil(value * 10) / 10:g}{unit}"


@click.command()
@sweep_options
@click.option("--by", default="auto", show_default=True, help=BY_HELP)
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), default=None)
@click.option(
    "--mlflow-ui",
    default="http://127.0.0.1:5000",
    show_default=True,
    help="Where the trial links point: the MLflow UI serving this store (make ui's address, "
    "or your tracking server's).",
)
@click.option(
    "--versus",
    multiple=True,
    help="Another sweep to compare with (EXPERIMENT, EXPERIMENT@RUN_ID or EXPERIMENT@DEVICE, "
    "as harness compare names them); repeatable.",
)
def report(
    experiment: str | None,
    sweep_id: str,
    tracking_uri: str,
    by: str,
    out: Path | None,
    mlflow_ui: str,
    versus: tuple[str, ...],
) -> None:
    """One self-contained HTML page for a sweep: the recommendation under the budget first,
    then the fronts, the memory breakdowns and timelines, every trial linked to its run; with
    --versus, a section comparing it with other sweeps."""
    from harness.analyse.compare import compare
    from harness.analyse.report import write_report

    sweep = open_sweep(experiment, sweep_id, tracking_uri)
    objectives = objectives_for(sweep, None)
    analysis = run_analysis(sweep, objectives, by, sweep.device_memory)
    comparison = None
    if versus:
        label = f"{sweep.experiment}@{sweep.parent_run_id[:8]}"
        others = {s: open_selected(s, tracking_uri).frame for s in versus if s != label}
        try:
            comparison = compare({label: sweep.frame, **others}, objectives)
        except ValueError as error:
            raise click.ClickException(str(error)) from None
    target = out or output_dir(sweep, None) / "report.html"
    path = write_report(
        sweep, analysis, objectives, target, mlflow_ui=mlflow_ui.rstrip("/"), comparison=comparison
    )
    publish(sweep.tracking_uri, sweep.parent_run_id, [path], "report")
    click.echo(f"wrote {path} (also on MLflow run {sweep.parent_run_id})")


def trial_row(sweep: Sweep, name: str) -> pd.Series:
    """The trial with this run id, trial key, trial key prefix (4+ characters) or run name
    (the latest run of it in the sweep), or a one-line error."""
    try:
        return find_trial(sweep, name)
    except ResultsError as error:
        raise click.ClickException(str(error)) from None


def row_timeline(sweep: Sweep, row: pd.Series) -> dict[str, Any]:
    """The trial's memory timeline, or a one-line error saying why it has none."""
    data = trial_timeline(sweep.tracking_uri, row["run_id"])
    if data is None:
        raise click.ClickException(
            f"trial {row['trial_key']} (run {row['run_id']}, status {row['status']}) has no "
            "memory timeline: it ended before its memory window, ran with "
            "measure.timeline: false, or was recorded before timelines existed"
        )
    return data


def timeline_peaks(data: dict[str, Any]) -> tuple[int, int]:
    """(highest total, highest activation bytes) over the window."""
    samples = data["samples"]
    return max(samples["total"], default=0), max(samples["activation"], default=0)


@click.command()
@click.argument("trial")
@click.option("--compare", "other", default=None, help="A second trial to overlay.")
@experiment_option
@tracking_uri_option
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="PNG to write; default results/<experiment>/timelines/<trial>[-vs-<other>].png")  # fmt: skip
def timeline(
    trial: str, other: str | None, experiment: str | None, tracking_uri: str, out: Path | None
) -> None:
    """Draw a trial's memory timeline, or overlay two. TRIAL (and OTHER): a run id, a trial
    key or its first 4+ characters (the trial column of harness results), or the run name
    ('small bs=32 fp32 none')."""
    from harness.analyse import plots, timelines

    sweep = open_sweep(experiment, "all", tracking_uri)
    rows = [trial_row(sweep, trial)] + ([trial_row(sweep, other)] if other else [])
    drawn = [(plots.config_label(row), row_timeline(sweep, row)) for row in rows]
    name = "-vs-".join(str(row["trial_key"]) for row in rows)
    path = out or output_dir(sweep, None) / "timelines" / f"{name}.png"
    title = " vs ".join(label for label, _ in drawn)
    timelines.timeline_png(drawn, path, f"memory timeline: {title}")
    peaks = pd.DataFrame(
        [
            {"trial": label, "trial_key": row["trial_key"], "ops": data["ops"]}
            | dict(zip(("peak_bytes", "activation_bytes"), timeline_peaks(data), strict=True))
            for (label, data), row in zip(drawn, rows, strict=True)
        ]
    )
    headings = {"trial_key": "key", "peak_bytes": "peak (total)"}
    headings["activation_bytes"] = "peak activations"
    columns = ["trial", "trial_key", "peak_bytes", "activation_bytes", "ops"]
    click.echo(table_text(peaks, columns, headings, title="memory timeline"))
    click.echo(f"wrote {path}")
