"""What every command shares: the console, one-line errors instead of tracebacks, the options
that name a recorded sweep, and how a table is printed."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
import pandas as pd
from rich.console import Console
from rich.table import Table

from harness.contract import DEFAULT_MLFLOW_URI, DEFAULT_RESULTS_DIR
from harness.spec import SpecError
from harness.units import format_bytes


def make_console() -> Console:
    """Rich wraps at 80 columns when output is not a terminal (CI logs, pipes); give it room."""
    if sys.stdout.isatty() or "COLUMNS" in os.environ:
        return Console()
    return Console(width=140)


class SpecAwareGroup(click.Group):
    """Turns a bad spec into one line per problem and exit code 2, never a traceback."""

    def invoke(self, ctx: click.Context) -> object:
        try:
            return super().invoke(ctx)
        except SpecError as error:
            click.echo(str(error), err=True)
            ctx.exit(2)
        except OSError as error:  # a full disk, a folder that became read-only, ...
            where = f"{error.filename}: " if error.filename else ""
            click.echo(f"harness: {where}{error.strerror or error}", err=True)
            ctx.exit(1)


def tracking_uri_option(command: Callable[..., Any]) -> Callable[..., Any]:
    return click.option("--tracking-uri", default=DEFAULT_MLFLOW_URI, show_default=True)(command)


def experiment_option(command: Callable[..., Any]) -> Callable[..., Any]:
    return click.option(
        "--experiment",
        "-e",
        default=None,
        help="Experiment (spec name); default: the one run last.",
    )(command)


def sweep_option(command: Callable[..., Any]) -> Callable[..., Any]:
    return click.option(
        "--sweep",
        "sweep_id",
        default="latest",
        show_default=True,
        help="'latest', 'all', or a sweep's parent run id.",
    )(command)


def sweep_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """Which sweep, from which store: ``--experiment``, ``--sweep``, ``--tracking-uri``."""
    return experiment_option(sweep_option(tracking_uri_option(command)))


def open_sweep(experiment: str | None, sweep_id: str, tracking_uri: str) -> Any:
    """The recorded sweep, or a one-line error saying what to do."""
    from harness.record.results import ResultsError, load_sweep

    try:
        return load_sweep(experiment, tracking_uri, sweep_id)
    except ResultsError as error:
        raise click.ClickException(str(error)) from None


def output_dir(sweep: Any, out_dir: Path | None) -> Path:
    """Where an analysis writes its files: ``results/<experiment>/`` unless told."""
    return out_dir or Path(DEFAULT_RESULTS_DIR) / sweep.experiment


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
