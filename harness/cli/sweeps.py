"""``harness sweeps``: the recorded sweeps, one row each, named the way other commands take them.

One experiment run twice (a ``--fresh`` start, another card, another day) is two sweeps whose
trials share run names and configurations; this lists them apart (short id and start time), with
the ``selector`` ``harness compare`` takes and the short id ``--sweep`` takes.
"""

from __future__ import annotations

import click

from harness.cli.common import (
    experiment_option,
    read_recorded,
    table_text,
    terminal_width,
    tracking_uri_option,
)

FORMATS = ("table", "csv", "json")
TABLE_COLUMNS = ["experiment", "sweep", "selector", "status", "trials", "ok", "device_name"]
HEADINGS = {"device_name": "device"}


@click.command("sweeps")
@experiment_option
@tracking_uri_option
@click.option("--format", "fmt", type=click.Choice(FORMATS), default="table", show_default=True)
def sweeps(experiment: str | None, tracking_uri: str, fmt: str) -> None:
    """One row per recorded sweep (of --experiment, else of every experiment), oldest first.

    The selector column is what `harness compare` takes (EXPERIMENT@SHORT_ID); the short id
    (the sweep column's first word) is what --sweep takes in results, pareto, recommend and
    report. The trials of a sweep carry its short id in their MLflow run names.
    """
    from harness.record.results import list_sweeps

    frame = read_recorded(lambda: list_sweeps(tracking_uri, experiment))
    if fmt == "csv":
        click.echo(frame.to_csv(index=False), nl=False)
    elif fmt == "json":
        click.echo(frame.to_json(orient="records", indent=1, date_format="iso"))
    else:
        click.echo(table_text(frame, TABLE_COLUMNS, HEADINGS, width=terminal_width()))
        if len(frame) > 1:
            first, last = frame["selector"].iloc[0], frame["selector"].iloc[-1]
            click.echo(f"compare two: harness compare {first} {last}")
