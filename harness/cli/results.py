"""``harness results``: the results table of a recorded sweep, printed or written to a file.

The printed table is for reading: by default the grid point, status, a short trial key, the
peak and its breakdown, throughput and accuracy, in 160 columns and fitted to a narrower
terminal (``--columns`` picks others, ``--wide`` shows every column), each cell formatted by
``harness.cli.common.cell``, numbers never cut. CSV, JSON and Parquet are for programs: every
column, raw numbers.
"""

from __future__ import annotations

import difflib
from pathlib import Path

import click
import pandas as pd

from harness.analyse.peak_phase import optimizer_peak_note
from harness.cli.common import (
    BREAKDOWN,
    BREAKDOWN_HEADING,
    HEADINGS,
    OneLineError,
    noise_footnote,
    sweep_options,
    table_text,
    terminal_width,
    wrap_note,
)

FORMATS = ("table", "csv", "parquet", "json")
DEFAULT_COLUMNS = [
    "model_size",
    "batch_size",
    "dtype",
    "strategy",
    "status",
    "trial_key",
    "peak_allocated_bytes",
    BREAKDOWN,
    "throughput",
    "accuracy",
    "peak_phase",
]
SPARE_COLUMNS = ["peak_phase", "trial_key", BREAKDOWN]  # what a narrow terminal leaves out first


@click.command()
@sweep_options
@click.option("--format", "fmt", type=click.Choice(FORMATS), default="table", show_default=True)
@click.option(
    "--out",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Write to this file instead of stdout (required for parquet).",
)
@click.option(
    "--columns",
    default=None,
    help="Table only: these results columns, in this order, by full name or the heading a "
    "table shows, e.g. 'size,strategy,peak,peak_rss_bytes,step_time_ms_p50' ('breakdown': "
    "the peak's shares).",
)
@click.option("--wide", is_flag=True, help="Table only: every column that has a value.")
def results(
    experiment: str | None,
    sweep_id: str,
    tracking_uri: str,
    fmt: str,
    out: Path | None,
    columns: str | None,
    wide: bool,
) -> None:
    """One row per trial: configuration, status and every metric, as a table or a file.

    The table shows the grid point, status, trial key, peak memory and its breakdown,
    throughput and accuracy; --columns and --wide show others. CSV, JSON and Parquet hold
    every column with raw numbers.
    """
    from harness.record.results import ResultsError, load

    if fmt != "table" and (columns or wide):
        raise OneLineError(f"--columns and --wide shape the table; --format {fmt} has every column")
    if columns and wide:
        raise OneLineError("give --columns or --wide, not both")
    try:
        frame = load(experiment, tracking_uri, sweep=sweep_id)
    except ResultsError as error:
        raise click.ClickException(str(error)) from None
    if fmt == "parquet":
        if out is None:
            raise click.UsageError("--format parquet writes a binary file: give --out FILE.parquet")
        frame.to_parquet(out, index=False)
    elif fmt == "csv":
        text = frame.to_csv(index=False)
    elif fmt == "json":
        text = frame.to_json(orient="records", indent=1, date_format="iso")
    elif wide:
        filled = frame.replace("", None).notna().any()
        text = table_text(frame, [c for c in frame.columns if filled[c]])
    else:
        picked = chosen_columns(frame, columns) if columns else None
        text = readable_table(frame, picked, None if out else terminal_width())
    if fmt != "parquet":
        if out is None:
            click.echo(text)
        else:
            out.write_text(text)
    if out is not None:
        click.echo(f"wrote {len(frame)} trials to {out}", err=True)


def column_names(frame: pd.DataFrame) -> dict[str, str]:
    """What ``--columns`` takes, lower-cased, and the column each names: every full name and
    the short heading a table shows it under (``peak``, ``size``, ...), so what you read in
    a table is what you type."""
    names = {column.lower(): column for column in [*frame.columns, BREAKDOWN]}
    for column, heading in {**HEADINGS, BREAKDOWN: BREAKDOWN_HEADING}.items():
        if column in names.values():
            names.setdefault(heading.lower(), column)
    return names


def chosen_columns(frame: pd.DataFrame, text: str) -> list[str]:
    """``--columns a,b,c`` (full names or headings, any case) as a list of columns, or one
    line naming an unknown column, close ones and every name allowed."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    known = column_names(frame)
    for name in names:
        if name.lower() not in known:
            close = difflib.get_close_matches(name.lower(), list(known), n=4, cutoff=0.5)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            full = dict.fromkeys(known.values())  # the full names, in the table's order
            headings = [h for h, column in known.items() if h != column.lower()]
            raise OneLineError(
                f"--columns: no results column {name!r}{hint} (allowed: {', '.join(full)}; "
                f"or the headings {', '.join(headings)})"
            )
    if not names:
        raise OneLineError("--columns: name at least one column, e.g. --columns model_size,status")
    return [known[name.lower()] for name in names]


def readable_table(frame: pd.DataFrame, columns: list[str] | None, width: int | None = None) -> str:
    """The table people read: the chosen columns (default ``DEFAULT_COLUMNS``), why a trial
    did not finish in a numbered note under it, and what a throughput's noise mark means.
    ``width``: a terminal's, which the table fits (text folds or is left out, numbers are
    never cut); None: as wide as its cells."""
    frame = frame.copy()
    if columns is None:
        columns = [c for c in DEFAULT_COLUMNS if c in frame.columns or c == BREAKDOWN]
        if "sweep" in frame and frame["sweep"].nunique() > 1:  # --sweep all: whose row is it
            columns.insert(0, "sweep")
    notes: dict[str, int] = {}
    if "status" in columns and "failure_reason" not in columns:
        for index, reason in frame["failure_reason"].items():
            if isinstance(reason, str) and reason:
                number = notes.setdefault(reason, len(notes) + 1)
                frame.at[index, "status"] = f"{frame.at[index, 'status']} [{number}]"
    lines = [table_text(frame, columns, HEADINGS, width=width, spare=SPARE_COLUMNS)]
    for reason, number in notes.items():
        lines.append(wrap_note(f"[{number}] {reason}", width))
    footnote = noise_footnote(frame) if "throughput" in columns else None
    if footnote:
        lines.append(footnote)
    in_step = optimizer_peak_note(frame)
    if in_step:
        lines.append(wrap_note(in_step, width))
    return "\n".join(lines)
