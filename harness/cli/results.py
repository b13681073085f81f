"""``harness results``: the results table of a recorded sweep, printed or written to a file."""

from __future__ import annotations

from pathlib import Path

import click

from harness.cli.common import sweep_options

FORMATS = ("table", "csv", "parquet", "json")
HIDDEN_IN_TABLE = ["run_id", "sweep_run_id", "start_time"]


@click.command()
@sweep_options
@click.option("--format", "fmt", type=click.Choice(FORMATS), default="table", show_default=True)
@click.option(
    "--out",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Write to this file instead of stdout (required for parquet).",
)
def results(
    experiment: str | None, sweep_id: str, tracking_uri: str, fmt: str, out: Path | None
) -> None:
    """One row per trial: configuration, status and every metric, as a table or a file."""
    from harness.record.results import ResultsError, load

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
    else:
        shown = frame[[c for c in frame.columns if frame[c].notna().any()]]
        text = shown.drop(columns=HIDDEN_IN_TABLE, errors="ignore").to_string(index=False)
    if fmt != "parquet":
        if out is None:
            click.echo(text)
        else:
            out.write_text(text)
    if out is not None:
        click.echo(f"wrote {len(frame)} trials to {out}", err=True)
