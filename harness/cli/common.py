"""What every command shares: the console, one-line errors instead of tracebacks, the options
that name a recorded sweep, and how a table is printed."""

from __future__ import annotations

import io
import os
import sys
from collections.abc import Callable, Mapping
from numbers import Integral, Number
from pathlib import Path
from typing import Any

import click
import pandas as pd
from rich.console import Console
from rich.table import Table

from harness.analyse.noise import NOISY_MARK, noise_reason
from harness.contract import DEFAULT_MLFLOW_URI, DEFAULT_RESULTS_DIR
from harness.metrics import BREAKDOWN_CATEGORIES, breakdown_metric
from harness.spec import SpecError
from harness.units import format_bytes, format_count, format_quantity


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


# How each column reads in a terminal table (CSV, JSON and Parquet keep raw numbers): bytes with
# a binary unit, times in ms or s, throughput in its own unit, ratios to three digits, counts as
# integers. One rule for every command, decided by the column's name.
COUNT_COLUMNS = {
    "train_steps",
    "attempts",
    "world_size",
    "batch_size",
    "seed",
    "torch_threads",
    "warmup_steps",
    "memory_steps",
    "timed_steps",
    "trials",
    "feasible",
    "front_size",
}
PARAMETER_COUNTS = {"num_params", "num_params_total"}  # as published: 8.03 B, 41.9 M
SHORT_KEY = 8  # characters of a trial_key in a table: enough to name it (harness timeline)
MEMORY_METRIC = "peak_allocated_bytes"
BREAKDOWN = "breakdown"  # a column of the terminal tables, computed from the mem_*_bytes
BREAKDOWN_HEADING = "% param/grad/optim/act/other"
MAX_LINE = 160  # what a terminal table and its notes fit in
HEADINGS = {  # short headings of the tables people read (--wide and --columns: full names)
    "model_size": "size",
    "batch_size": "batch",
    "trial_key": "trial",
    "peak_allocated_bytes": "peak",
}


def is_missing(value: Any) -> bool:
    if value is None or isinstance(value, str):
        return value is None
    try:
        return bool(pd.isna(value))
    except (TypeError, ValueError):  # a list or an array: not one missing value
        return False


def cell(column: str, value: Any, row: Mapping[str, Any] | None = None) -> str:
    """``value`` of ``column`` as a table shows it, the same in every command. ``row`` (the
    whole results row, where there is one) gives throughput its unit and its noise mark."""
    if is_missing(value):
        return "-"
    if column == "trial_key":
        return str(value)[:SHORT_KEY]
    if pd.api.types.is_bool(value):
        return "yes" if value else "no"
    if isinstance(value, pd.Timestamp):
        return value.strftime("%Y-%m-%d %H:%M:%S")
    if isinstance(value, str) or not isinstance(value, Number):
        return str(value)
    if column.endswith("_bytes"):
        return format_bytes(value, short=True)
    if column in PARAMETER_COUNTS:
        return format_count(value)
    if column in COUNT_COLUMNS or isinstance(value, Integral):
        return f"{int(value):,}"
    if column == "throughput":
        row = {} if row is None else row
        unit = row.get("throughput_unit")
        text = format_quantity(value, unit if isinstance(unit, str) and unit else "samples/s")
        return text + (NOISY_MARK if noise_reason(row) else "")
    if column.endswith("_ms") or "_ms_" in column:
        return format_quantity(value, "ms")
    if column.endswith("_s"):
        return format_quantity(value, "s")
    return format_quantity(value)  # accuracy, losses, ratios, fractions: three digits


def breakdown_cell(row: Mapping[str, Any]) -> str:
    """The peak's breakdown as whole percentages of it, in ``BREAKDOWN_HEADING``'s order."""
    peak = row.get(MEMORY_METRIC)
    if is_missing(peak) or not peak:
        return "-"
    shares = []
    for category in BREAKDOWN_CATEGORIES:
        part = row.get(breakdown_metric(category))
        shares.append("-" if is_missing(part) else f"{100 * float(part) / float(peak):.0f}")
    return "-" if set(shares) == {"-"} else "/".join(shares)


def noise_footnote(frame: pd.DataFrame) -> str | None:
    """One line under a table with marked throughputs: how many, why, what it means."""
    if "throughput" not in frame or frame.empty:
        return None
    measured = [row for _, row in frame.iterrows() if not is_missing(row["throughput"])]
    reasons = [why for why in map(noise_reason, measured) if why]
    if not reasons:
        return None
    common = pd.Series(reasons).value_counts().index[0]  # the most frequent reason
    example = common if len(set(reasons)) == 1 else f"e.g. {common}"
    line = (
        f"{NOISY_MARK} {len(reasons)} of {len(measured)} throughputs were measured on a busy "
        f"machine or with unsteady steps ({example}): do not compare them; rerun on an idle host"
    )
    return line if len(line) <= MAX_LINE else line[: MAX_LINE - 1] + "…"


def table_text(
    frame: pd.DataFrame,
    columns: list[str] | None = None,
    headings: Mapping[str, str] | None = None,
    title: str | None = None,
) -> str:
    """``frame``'s ``columns`` (default: all) as a plain-text table as wide as its cells (a
    pager or the terminal folds it, never rich), each cell by ``cell`` (``breakdown``:
    ``breakdown_cell``), numbers right-aligned, ``title`` on the line above."""
    from rich import box

    columns = list(frame.columns) if columns is None else columns
    headings = headings or {}
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, collapse_padding=True)
    for column in columns:
        numeric = column == BREAKDOWN or (
            column in frame
            and pd.api.types.is_numeric_dtype(frame[column])
            and not pd.api.types.is_bool_dtype(frame[column])
        )
        heading = headings.get(column, BREAKDOWN_HEADING if column == BREAKDOWN else column)
        table.add_column(heading, justify="right" if numeric else "left", no_wrap=True)
    for _, row in frame.iterrows():
        table.add_row(
            *(
                breakdown_cell(row) if column == BREAKDOWN else cell(column, row[column], row)
                for column in columns
            )
        )
    console = Console(file=io.StringIO(), width=100_000, color_system=None)
    console.print(table, highlight=False)
    text = console.file.getvalue()  # type: ignore[attr-defined]
    text = "\n".join(line.rstrip() for line in text.splitlines()).strip("\n")
    return text if title is None else f"{title}\n{text}"


def show(
    frame: pd.DataFrame, title: str, console: Console, columns: list[str] | None = None
) -> None:
    """``frame``'s ``columns`` (default: all) as a table on ``console`` under its title, cells
    by ``cell``, with the noise footnote where a throughput is marked."""
    text = table_text(frame, columns, HEADINGS, title=f"\n{title}")
    console.print(text, highlight=False, markup=False, soft_wrap=True)
    footnote = noise_footnote(frame)
    if footnote:
        console.print(footnote, highlight=False, markup=False, soft_wrap=True)


class OneLineError(click.ClickException):
    """A bad command line said in one line (no usage block), exit code 2."""

    exit_code = 2


def emit(frame: pd.DataFrame, fmt: str, show_table: Callable[[], None]) -> None:
    """A predicted table on stdout: every column under its full name as CSV or JSON records,
    or the command's own readable table (``show_table``)."""
    if fmt == "csv":
        click.echo(frame.to_csv(index=False), nl=False)
    elif fmt == "json":
        click.echo(frame.to_json(orient="records", indent=1))
    else:
        show_table()


def card_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """``--card NAME`` and ``--cards FILE``: plan for another card than the spec's."""
    command = click.option(
        "--cards",
        "cards_file",
        type=click.Path(dir_okay=False, path_type=Path),
        default=None,
        help="A YAML file of your own cards (see docs/cards.md).",
    )(command)
    return click.option(
        "--card",
        default=None,
        help="The card to predict for, e.g. h100-80gb, rtx-4090 (`harness cards` lists them); "
        "its memory is the budget unless device_memory is smaller.",
    )(command)


def prediction_target(spec: Any, device: str) -> str:
    """The device type to predict for: ``--device``, else the spec's device, else CUDA when a
    card is named, else what ``auto`` means on this machine."""
    from harness.spec.schema import local_device

    target = device if device != "auto" else spec.device.split(":")[0]
    if target == "auto":
        target = "cuda" if spec.card else local_device()
    return target
