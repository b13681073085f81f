"""``harness pareto``, ``harness recommend``, ``harness report``: decide from a recorded sweep.

Each reads one sweep from MLflow (``--experiment``/``--sweep`` as ``harness results``), never
runs a trial, and writes its files under ``results/<experiment>/`` and onto the sweep's parent
MLflow run as artifacts.
"""

from __future__ import annotations

import html
from pathlib import Path
from typing import Any

import click
import pandas as pd
from rich.console import Console
from rich.table import Table

from harness.units import format_bytes, parse_bytes

CONFIG = ["model_size", "batch_size", "dtype", "strategy"]
GROUPABLE = ("strategy", "dtype", "model_size", "batch_size")
BY_HELP = (
    "Group column (strategy, dtype, model_size, ...), 'auto' (the first that varies) or 'none'."
)


def sweep_options(command: Any) -> Any:
    """The options every analysis command shares: which sweep, from which store, where to."""
    for option in reversed(
        [
            click.option(
                "--experiment",
                "-e",
                default=None,
                help="Experiment (spec name); default: the one run last.",
            ),
            click.option(
                "--sweep",
                "sweep_id",
                default="latest",
                show_default=True,
                help="'latest', 'all', or a sweep's parent run id.",
            ),
            click.option(
                "--tracking-uri", default="sqlite:///results/mlflow.db", show_default=True
            ),
        ]
    ):
        command = option(command)
    return command


def open_sweep(experiment: str | None, sweep_id: str, tracking_uri: str) -> Any:
    from harness.results import ResultsError, load_sweep

    try:
        return load_sweep(experiment, tracking_uri, sweep_id)
    except ResultsError as error:
        raise click.ClickException(str(error)) from None


def objectives_for(sweep: Any, text: str | None) -> list[Any]:
    from harness.pareto import DEFAULT_OBJECTIVES, parse_objectives

    text = text or sweep.params.get("objectives")
    if not text:
        return list(DEFAULT_OBJECTIVES)
    try:
        return parse_objectives(text)
    except ValueError as error:
        raise click.BadParameter(str(error), param_hint="--objectives") from None


def budget_option(value: str | None) -> float | None:
    if value is None:
        return None
    try:
        return float(parse_bytes(value))
    except ValueError as error:
        raise click.BadParameter(str(error), param_hint="--budget") from None


def output_dir(sweep: Any, out_dir: Path | None) -> Path:
    return out_dir or Path("results") / sweep.experiment


def publish(sweep: Any, paths: list[Path], folder: str) -> None:
    """Copy the files onto the sweep's parent run, so the MLflow UI shows them beside it."""
    from harness.tracking import quiet_mlflow

    quiet_mlflow()
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=sweep.tracking_uri)
    for path in paths:
        client.log_artifact(sweep.parent_run_id, str(path), artifact_path=folder)


def show(frame: pd.DataFrame, title: str, console: Console) -> None:
    table = Table(title=title)
    for column in frame.columns:
        table.add_column(str(column))
    for _, row in frame.iterrows():
        table.add_row(*(cell(column, row[column]) for column in frame.columns))
    console.print(table)


def cell(column: str, value: Any) -> str:
    if value is None or (not isinstance(value, str) and pd.isna(value)):
        return "-"
    if column.endswith("_bytes"):
        return format_bytes(value)
    if isinstance(value, float):
        return f"{value:,.4g}"
    return str(value)


def front_table(analysis: Any) -> pd.DataFrame:
    columns = [*CONFIG, *[o.metric for o in analysis.objectives]]
    seen = [c for c in dict.fromkeys(columns) if c in analysis.front]
    ordered = analysis.front.sort_values(analysis.objectives[0].metric)
    return ordered[seen].reset_index(drop=True)


def dominance_table(analysis: Any) -> pd.DataFrame:
    percent = (analysis.dominance * 100).round(0).astype(int).astype(str) + "%"
    return percent.reset_index().rename(columns={"front A": "front A dominates ->"})


def group_column(frame: pd.DataFrame, by: str) -> str | None:
    """``auto``: the first of strategy, dtype, model_size, batch_size that varies in the sweep."""
    if by == "none":
        return None
    if by != "auto":
        return by
    return next((c for c in GROUPABLE if c in frame and frame[c].nunique() > 1), None)


def run_analysis(sweep: Any, objectives: list[Any], by: str, budget: float | None) -> Any:
    from harness.pareto import analyse

    if sweep.frame.empty:
        raise click.ClickException("the sweep has no trials recorded yet")
    by = group_column(sweep.frame, by)
    try:
        return analyse(sweep.frame, objectives, by, budget)
    except ValueError as error:
        raise click.ClickException(str(error)) from None


def write_pareto_files(sweep: Any, analysis: Any, folder: Path) -> list[Path]:
    from harness import plots

    title = f"{sweep.experiment}: Pareto fronts" + (f" by {analysis.by}" if analysis.by else "")
    png = plots.pareto_png(sweep.frame, analysis, folder / "pareto.png", title)
    page = folder / "pareto.html"
    plots.pareto_figure(sweep.frame, analysis, title).write_html(page, include_plotlyjs=True)
    bars_png = plots.breakdown_png(
        sweep.frame, folder / "breakdown.png", f"{sweep.experiment}: memory at peak"
    )
    bars = folder / "breakdown.html"
    plots.breakdown_figure(sweep.frame, f"{sweep.experiment}: memory at peak").write_html(
        bars, include_plotlyjs=True
    )
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
    from harness.cli import make_console

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
    show(front_table(analysis), "Pareto front (feasible, non-dominated)", console)
    show(analysis.groups, f"Per {analysis.by or 'sweep'}: hypervolume", console)
    console.print(f"Hypervolume: {analysis.reference}.", soft_wrap=True)
    if len(analysis.dominance) > 1:
        show(dominance_table(analysis), "Share of front B dominated by front A", console)
    if no_plots:
        return
    paths = write_pareto_files(sweep, analysis, output_dir(sweep, out_dir))
    publish(sweep, paths, "pareto")
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
    from harness.cli import make_console
    from harness.pareto import MEMORY, gives_up
    from harness.pareto import recommend as ranked_fits

    console = make_console()
    limit = budget_option(budget)
    assert limit is not None
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
    columns = [*CONFIG, MEMORY, "throughput", "accuracy"]
    show(ranked[[c for c in columns if c in ranked]], f"Best within {format_bytes(limit)}", console)
    console.print(
        f"Recommended: {' '.join(str(best[c]) for c in CONFIG)} "
        f"({objective} {best[objective]:,.4g}, peak {format_bytes(best[MEMORY])})",
        soft_wrap=True,
    )
    if len(ranked) > 1:
        runner = ranked.iloc[1]
        console.print(
            f"Runner-up: {' '.join(str(runner[c]) for c in CONFIG)}: "
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
    from harness import plots

    sweep = open_sweep(experiment, sweep_id, tracking_uri)
    objectives = objectives_for(sweep, None)
    analysis = run_analysis(sweep, objectives, by, sweep.device_memory)
    path = out or output_dir(sweep, None) / "report.html"
    path.parent.mkdir(parents=True, exist_ok=True)
    pareto_figure = plots.pareto_figure(sweep.frame, analysis, "Pareto fronts")
    breakdown = plots.breakdown_figure(sweep.frame, "Memory at the moment of peak")
    counts = sweep.frame["status"].value_counts().to_dict()
    results = sweep.frame[
        [*CONFIG, "status", *plots.BREAKDOWN, "peak_allocated_bytes", "throughput", "accuracy"]
    ]
    sections = [
        f"<h1>{html.escape(sweep.experiment)}</h1>",
        f"<p>{len(sweep.frame)} trials: "
        + ", ".join(f"{n} {html.escape(str(s))}" for s, n in sorted(counts.items()))
        + f". Budget: {format_bytes(sweep.device_memory) if sweep.device_memory else 'none'}."
        + f" Objectives: {html.escape(', '.join(map(str, objectives)))}."
        + f" MLflow sweep run <code>{sweep.parent_run_id}</code>.</p>",
        "<h2>Pareto front</h2>",
        front_table(analysis).to_html(index=False, na_rep="-"),
        f"<h2>Hypervolume per {html.escape(analysis.by or 'sweep')}</h2>",
        analysis.groups.to_html(index=False, float_format=lambda v: f"{v:.4f}"),
        f"<p>{html.escape(analysis.reference)}</p>",
        "<h2>Dominance between fronts</h2>",
        dominance_table(analysis).to_html(index=False),
        pareto_figure.to_html(full_html=False, include_plotlyjs=True, div_id="pareto"),
        breakdown.to_html(full_html=False, include_plotlyjs=False, div_id="breakdown"),
        *front_timelines(sweep, analysis),
        "<h2>All trials</h2>",
        results.to_html(index=False, na_rep="-"),
    ]
    page = (
        # No favicon request: the page is one self-contained file.
        "<!DOCTYPE html><html><head><meta charset='utf-8'><link rel='icon' href='data:,'>"
        f"<title>harness report: {html.escape(sweep.experiment)}</title>"
        "<style>body{font-family:sans-serif;margin:2em}table{border-collapse:collapse;"
        "font-size:12px}td,th{border:1px solid #ccc;padding:2px 6px}</style></head><body>"
        + "\n".join(sections)
        + "</body></html>"
    )
    path.write_text(page)
    publish(sweep, [path], "report")
    click.echo(f"wrote {path} (also on MLflow run {sweep.parent_run_id})")


# ---- harness timeline ------------------------------------------------------------------------

REPORT_TIMELINES = 8  # most Pareto-front trials whose timelines the report shows


def front_timelines(sweep: Any, analysis: Any) -> list[str]:
    """HTML for the memory timelines of the Pareto-front trials (those that have one)."""
    from harness import plots

    front = analysis.front.sort_values(analysis.objectives[0].metric).head(REPORT_TIMELINES)
    parts = []
    for index, (_, row) in enumerate(front.iterrows()):
        try:
            data = trial_timeline(sweep, row)
        except click.ClickException:
            continue
        figure = plots.timeline_figure(plots.config_label(row), data)
        parts.append(
            figure.to_html(full_html=False, include_plotlyjs=False, div_id=f"timeline-{index}")
        )
    if not parts:
        return []
    return [
        "<h2>Memory timelines of the Pareto-front trials</h2>",
        "<p>Bytes held by tensors after each op of the memory window, by category; bands: "
        "forward (blue), backward (orange), recomputation (red), optimizer step (green).</p>",
        *parts,
    ]


def trial_row(sweep: Any, key_or_run: str) -> pd.Series:
    """The trial with this run id or trial key (the latest run of it in the sweep)."""
    frame = sweep.frame
    found = frame[(frame["run_id"] == key_or_run) | (frame["trial_key"] == key_or_run)]
    if found.empty:
        raise click.ClickException(
            f"no trial with run id or trial key {key_or_run!r} in experiment "
            f"{sweep.experiment!r} (see the trial_key and run_id columns of harness results)"
        )
    return found.sort_values("start_time").iloc[-1]


def trial_timeline(sweep: Any, row: pd.Series) -> dict[str, Any]:
    """The trial's ``timeline.json`` artifact, read from MLflow."""
    import json
    import tempfile

    from harness.tracking import quiet_mlflow
    from harness.trial.config import TIMELINE_FILE

    quiet_mlflow()
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=sweep.tracking_uri)
    with tempfile.TemporaryDirectory() as folder:
        try:
            path = client.download_artifacts(row["run_id"], f"trial/{TIMELINE_FILE}", folder)
            return json.loads(Path(path).read_text())
        except (MlflowException, OSError, ValueError):
            raise click.ClickException(
                f"trial {row['trial_key']} (run {row['run_id']}, status {row['status']}) has no "
                "memory timeline: it ended before its memory window, ran with "
                "measure.timeline: false, or was recorded before timelines existed"
            ) from None


def timeline_peaks(data: dict[str, Any]) -> tuple[int, int]:
    """(highest total, highest activation bytes) over the window."""
    samples = data["samples"]
    return max(samples["total"], default=0), max(samples["activation"], default=0)


@click.command()
@click.argument("trial")
@click.option("--compare", "other", default=None, help="A second trial to overlay.")
@click.option("--experiment", "-e", default=None, help="Experiment; default: the one run last.")
@click.option("--tracking-uri", default="sqlite:///results/mlflow.db", show_default=True)
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="PNG to write; default results/<experiment>/timelines/<trial>[-vs-<other>].png")  # fmt: skip
def timeline(
    trial: str, other: str | None, experiment: str | None, tracking_uri: str, out: Path | None
) -> None:
    """Draw a trial's memory timeline (TRIAL: its run id or trial key), or overlay two."""
    from harness import plots

    sweep = open_sweep(experiment, "all", tracking_uri)
    rows = [trial_row(sweep, trial)] + ([trial_row(sweep, other)] if other else [])
    timelines = [(plots.config_label(row), trial_timeline(sweep, row)) for row in rows]
    name = "-vs-".join(str(row["trial_key"]) for row in rows)
    path = out or output_dir(sweep, None) / "timelines" / f"{name}.png"
    title = " vs ".join(label for label, _ in timelines)
    plots.timeline_png(timelines, path, f"memory timeline: {title}")
    table = Table(title="memory timeline")
    for column in ("trial", "trial_key", "peak (total)", "peak activations", "ops"):
        table.add_column(column)
    for (label, data), row in zip(timelines, rows, strict=True):
        total, activations = timeline_peaks(data)
        table.add_row(
            label, str(row["trial_key"]), format_bytes(total), format_bytes(activations),
            str(data["ops"]),
        )  # fmt: skip
    Console().print(table)
    click.echo(f"wrote {path}")
