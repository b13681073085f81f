"""``harness pareto``, ``recommend``, ``report`` and ``timeline``: decide from a recorded sweep.

Each reads one sweep from MLflow (``--experiment``/``--sweep`` as ``harness results``), never
runs a trial, and writes its files under ``results/<experiment>/`` and onto the sweep's parent
MLflow run as artifacts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click
import pandas as pd
from rich.table import Table

from harness.analyse.pareto import (
    DEFAULT_OBJECTIVES,
    MEMORY,
    Objective,
    ParetoAnalysis,
    analyse,
    gives_up,
    group_column,
    parse_objectives,
)
from harness.analyse.pareto import recommend as ranked_fits
from harness.cli.common import (
    experiment_option,
    make_console,
    open_sweep,
    output_dir,
    show,
    sweep_options,
    tracking_uri_option,
)
from harness.contract import AXES
from harness.record.results import Sweep, trial_timeline
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
    try:
        return analyse(sweep.frame, objectives, group_column(sweep.frame, by), budget)
    except ValueError as error:
        raise click.ClickException(str(error)) from None


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
    analysis = run_analysis(sweep, chosen, by, limit)
    where = f"within {format_bytes(limit)}" if limit else "no memory budget"
    console.print(
        f"[bold]{sweep.experiment}[/]: {int(analysis.feasible.sum())} of {len(sweep.frame)} "
        f"trials feasible ({where}); objectives {', '.join(map(str, chosen))}"
    )
    show(analysis.front_table(), "Pareto front (feasible, non-dominated)", console)
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
    type=click.Choice(("throughput", "accuracy")),
    default="throughput",
    show_default=True,
)
def recommend(
    experiment: str | None, sweep_id: str, tracking_uri: str, budget: str, objective: str
) -> None:
    """The best measured config whose peak fits BUDGET, the runner-up, and what it gives up."""
    console = make_console()
    limit = budget_option(budget)
    sweep = open_sweep(experiment, sweep_id, tracking_uri)
    ranked = ranked_fits(sweep.frame, limit, objective)
    if ranked.empty:
        ok = sweep.frame[sweep.frame["status"].eq("ok") & sweep.frame[MEMORY].notna()]
        smallest = (
            f"; the smallest measured peak is {format_bytes(ok[MEMORY].min())}"
            if not ok.empty
            else "; no trial finished ok"
        )
        click.echo(
            f"nothing in sweep {sweep.experiment!r} fits in {format_bytes(limit)}{smallest}",
            err=True,
        )
        raise SystemExit(2)
    best = ranked.iloc[0]
    columns = [*AXES, MEMORY, "throughput", "accuracy"]
    show(ranked[[c for c in columns if c in ranked]], f"Best within {format_bytes(limit)}", console)
    console.print(
        f"Recommended: {' '.join(str(best[c]) for c in AXES)} "
        f"({objective} {best[objective]:,.4g}, peak {format_bytes(best[MEMORY])})",
        soft_wrap=True,
    )
    if len(ranked) > 1:
        runner = ranked.iloc[1]
        console.print(
            f"Runner-up: {' '.join(str(runner[c]) for c in AXES)}: "
            f"{gives_up(best, runner, objective)}",
            soft_wrap=True,
        )


@click.command()
@sweep_options
@click.option("--by", default="auto", show_default=True, help=BY_HELP)
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), default=None)
def report(
    experiment: str | None, sweep_id: str, tracking_uri: str, by: str, out: Path | None
) -> None:
    """One self-contained HTML page for a sweep: tables, Pareto plots, memory breakdown."""
    from harness.analyse.report import write_report

    sweep = open_sweep(experiment, sweep_id, tracking_uri)
    objectives = objectives_for(sweep, None)
    analysis = run_analysis(sweep, objectives, by, sweep.device_memory)
    path = write_report(sweep, analysis, objectives, out or output_dir(sweep, None) / "report.html")
    publish(sweep.tracking_uri, sweep.parent_run_id, [path], "report")
    click.echo(f"wrote {path} (also on MLflow run {sweep.parent_run_id})")


def trial_row(sweep: Sweep, key_or_run: str) -> pd.Series:
    """The trial with this run id or trial key (the latest run of it in the sweep)."""
    frame = sweep.frame
    found = frame[(frame["run_id"] == key_or_run) | (frame["trial_key"] == key_or_run)]
    if found.empty:
        raise click.ClickException(
            f"no trial with run id or trial key {key_or_run!r} in experiment "
            f"{sweep.experiment!r} (see the trial_key and run_id columns of harness results)"
        )
    return found.sort_values("start_time").iloc[-1]


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
    """Draw a trial's memory timeline (TRIAL: its run id or trial key), or overlay two."""
    from harness.analyse import plots, timelines

    sweep = open_sweep(experiment, "all", tracking_uri)
    rows = [trial_row(sweep, trial)] + ([trial_row(sweep, other)] if other else [])
    drawn = [(plots.config_label(row), row_timeline(sweep, row)) for row in rows]
    name = "-vs-".join(str(row["trial_key"]) for row in rows)
    path = out or output_dir(sweep, None) / "timelines" / f"{name}.png"
    title = " vs ".join(label for label, _ in drawn)
    timelines.timeline_png(drawn, path, f"memory timeline: {title}")
    table = Table(title="memory timeline")
    for column in ("trial", "trial_key", "peak (total)", "peak activations", "ops"):
        table.add_column(column)
    for (label, data), row in zip(drawn, rows, strict=True):
        total, activations = timeline_peaks(data)
        table.add_row(
            label, str(row["trial_key"]), format_bytes(total), format_bytes(activations),
            str(data["ops"]),
        )  # fmt: skip
    make_console().print(table)
    click.echo(f"wrote {path}")
