"""``harness replay``: a user's recorded CUDA memory snapshot through the caching-allocator model.

The recorded settings first (does the model decide as the card did?), then each
``--allocator-conf`` on the same requests from the same state (what would this setting have done
to my run?). The work is :mod:`harness.cuda.snapshot`'s; this module reads the options, turns
every bad input into one line and exit code 2, and prints the report.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import click

from harness.cli.common import OneLineError, emit, format_option
from harness.units import format_bytes

PROGRESS_AFTER_S = 1.0  # a replay that takes longer says how far it is, on stderr
PROGRESS_EVERY_S = 2.0


class _Progress:
    """Progress lines on stderr, only once the replays have run for a second (most take less)."""

    def __init__(self) -> None:
        self.began = time.monotonic()
        self.last = 0.0

    def __call__(self, label: str, done: int, total: int) -> None:
        now = time.monotonic()
        if now - self.began < PROGRESS_AFTER_S or now - self.last < PROGRESS_EVERY_S:
            return
        self.last = now
        click.echo(f"replay: {label}: {done:,} of {total:,} events", err=True)


@click.command()
@click.argument(
    "snapshot_path", metavar="SNAPSHOT", type=click.Path(dir_okay=False, path_type=Path)
)
@click.option(
    "--card",
    default=None,
    metavar="NAME",
    help="Cap the replay at this card's memory less its CUDA context (`harness cards` lists "
    "them, e.g. a100-80gb), so a retry or an OOM shows; default: unlimited.",
)
@click.option(
    "--allocator-conf",
    "confs",
    multiple=True,
    metavar="TEXT",
    help="PYTORCH_CUDA_ALLOC_CONF to replay the same trace under (repeatable), e.g. "
    "expandable_segments:True; each key given replaces the recorded one, the others are kept.",
)
@click.option(
    "--device",
    type=int,
    default=None,
    metavar="N",
    help="The device whose trace to replay; default: the one with the most trace entries.",
)
@format_option
def replay(
    snapshot_path: Path, card: str | None, confs: tuple[str, ...], device: int | None, fmt: str
) -> None:
    """Replay SNAPSHOT (torch.cuda.memory._dump_snapshot) through the caching-allocator model:
    the model's decisions and peaks against the card's, then each --allocator-conf's."""
    from harness.cuda.cards import find_card
    from harness.cuda.snapshot import (
        SnapshotError,
        load_snapshot,
        override_settings,
        parse_snapshot,
        replay_report,
    )

    capacity = device_total = None
    card_line = "capacity: unlimited (give --card NAME to replay within a card's memory)"
    if card is not None:
        try:
            found = find_card(card)
        except KeyError as error:
            raise OneLineError(f"--card: {error.args[0]}") from None
        capacity = found.memory_bytes - found.context
        device_total = found.memory_bytes
        card_line = (
            f"capacity: {found.name}, {format_bytes(found.memory_bytes)} less a "
            f"{format_bytes(found.context)} CUDA context = {format_bytes(capacity)}"
        )
    try:
        recording = parse_snapshot(load_snapshot(snapshot_path), str(snapshot_path), device)
    except SnapshotError as error:
        raise OneLineError(str(error)) from None
    for text in confs:  # every setting checked before the first replay
        try:
            override_settings(recording.settings, text)
        except ValueError as error:
            raise OneLineError(f"--allocator-conf {text!r}: {error}") from None
    try:
        report = replay_report(recording, confs, capacity, device_total, progress=_Progress())
    except ValueError as error:  # a setting the model cannot run without the card's size
        raise OneLineError(f"{snapshot_path}: {error}") from None
    if fmt == "json":
        click.echo(json.dumps(report, indent=1))
        return
    emit(_frame(report), fmt, lambda: _show(report, card_line))


def _frame(report: dict[str, Any]) -> Any:
    """The card's own row, then one row per replay (what csv writes)."""
    import pandas as pd

    recorded = {
        "row": "recorded",
        "settings": report["settings"],
        "given": None,
        "start": None,
        "start_reserved_bytes": report["start_reserved_bytes"],
        "peak_reserved_bytes": report["recorded_peak_reserved_bytes"],
        "peak_allocated_bytes": report["recorded_peak_allocated_bytes"],
        "fragmentation_bytes": report["recorded_fragmentation_bytes"],
        "alloc_retries": None,  # not told apart from empty_cache() calls (likely_alloc_retries)
        "ooms": report["recorded_ooms"],
    }
    rows = [recorded] + [{"row": "model", **row} for row in report["what_if"]]
    frame = pd.DataFrame(rows)
    for column in ("alloc_retries", "ooms"):  # the card's retries are unknown: no float column
        frame[column] = frame[column].astype("Int64")
    frame.insert(0, "device", report["device"])
    frame.insert(0, "snapshot", report["snapshot"])
    return frame


def _ratio(value: int, recorded: int) -> str:
    return f"{value / recorded:.3f}x" if recorded else "-"


def _show(report: dict[str, Any], card_line: str) -> None:
    """The comparison in words, then the settings as a table people read."""
    from rich import box

    from harness.cli.common import make_console, print_table

    console = make_console()

    def say(line: str) -> None:
        console.print(line, highlight=False, markup=False, soft_wrap=True)

    entries, allocs = report["trace_entries"], report["allocs"]
    say(
        f"{report['snapshot']}: device {report['device']} of {report['devices']}, "
        f"{entries:,} trace entries, {allocs:,} allocs"
    )
    start = (
        f"{report['start_segments']:,} segments ({format_bytes(report['start_reserved_bytes'])}) "
        f"reserved and {report['start_blocks']:,} blocks "
        f"({format_bytes(report['start_allocated_bytes'])}) allocated"
    )
    if entries == 0 or (allocs == 0 and report["releases"] == 0):
        say(f"trace: no requests to replay; the state at dump time: {start}")
    elif report["starts_mid_run"]:
        say(f"trace: starts mid-run; at its first event {start} (rebuilt from the final state)")
    else:
        say("trace: covers the whole run (nothing was reserved at its first event)")
    if report["settings_recorded"]:
        say(f"settings: recorded: {report['settings']}")
    else:
        say("settings: not recorded (torch < 2.4 writes none): PyTorch's defaults assumed")
    say(card_line)
    if allocs:
        say(
            f"segment decisions matched: {report['segment_decisions_matched']:,} of "
            f"{report['segment_decisions_total']:,} allocs where the card or the model made a "
            f"new segment ({report['alloc_decisions_matched']:,} of "
            f"{report['alloc_decisions_total']:,} allocs agree, cache hits included)"
        )
    recorded = report["recorded_peak_reserved_bytes"]
    predicted = report["predicted_peak_reserved_bytes"]
    say(
        f"peak reserved: recorded {format_bytes(recorded)}, predicted {format_bytes(predicted)} "
        f"({_ratio(predicted, recorded)})"
    )
    for first in report["mismatches"][:3]:
        say(
            f"  mismatch at trace entry {first['index']:,} (alloc of {first['size']:,} B): "
            f"card {first['recorded']}, model {first['predicted']}"
        )
    if report["releases"]:
        say(
            f"segment releases replayed as empty_cache(): {report['releases']:,} "
            f"({report['likely_alloc_retries']:,} directly before a new segment or an OOM: "
            "possibly the allocator's own release before a retry)"
        )
    problems = report["inconsistencies"]
    if problems:
        listed = "; ".join(f"{count:,} {what}" for what, count in problems.items())
        say(f"inconsistencies (counted and skipped): {listed}")
    else:
        say("inconsistencies: none")

    headings = ["settings", "start", "peak reserved", "vs card", "peak allocated"]
    headings += ["fragmentation", "retries", "OOMs"]
    rows = [
        [
            "the card (recorded)",
            "-",
            format_bytes(recorded, short=True),
            "1.000x" if recorded else "-",
            format_bytes(report["recorded_peak_allocated_bytes"], short=True),
            format_bytes(report["recorded_fragmentation_bytes"], short=True),
            "-",  # a release before a new segment may be a retry or the user's empty_cache()
            f"{report['recorded_ooms']:,}",
        ]
    ]
    for i, row in enumerate(report["what_if"]):
        label = "model: the recorded settings" if i == 0 else f"model: {row['given']}"
        rows.append(
            [
                label,
                row["start"],
                format_bytes(row["peak_reserved_bytes"], short=True),
                _ratio(row["peak_reserved_bytes"], recorded),
                format_bytes(row["peak_allocated_bytes"], short=True),
                format_bytes(row["fragmentation_bytes"], short=True),
                f"{row['alloc_retries']:,}",
                f"{row['ooms']:,}",
            ]
        )
    print_table(
        console,
        headings,
        [heading not in ("settings", "start") for heading in headings],
        rows,
        "--format json shows every field",
        box=box.SIMPLE_HEAD,
        pad_edge=False,
        collapse_padding=True,
    )
    say(
        "fragmentation = reserved - allocated when the peak reservation was reached; start: "
        "adopted = the recorded segments, re-allocated = the blocks alive at the first event "
        "allocated again in address order (a segment kind the recording lacks)"
    )
