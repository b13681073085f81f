"""What every command shares: the console, one-line errors instead of tracebacks, the options
that name a recorded sweep, and how a table is printed."""

from __future__ import annotations

import gc
import io
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from numbers import Integral, Number
from pathlib import Path
from typing import Any, cast

import click
import pandas as pd
from rich.console import Console
from rich.table import Table

from harness.analyse.noise import NOISY_MARK, Row, noise_reason
from harness.contract import DEFAULT_MLFLOW_URI, DEFAULT_RESULTS_DIR
from harness.metrics import (
    BREAKDOWN_CATEGORIES,
    THROUGHPUT,
    breakdown_metric,
    format_metric,
    unit_of,
)
from harness.spec import SpecError


def make_console() -> Console:
    """Rich wraps at 80 columns when output is not a terminal (CI logs, pipes); give it room."""
    if sys.stdout.isatty() or "COLUMNS" in os.environ:
        return Console()
    return Console(width=140)


class SpecAwareGroup(click.Group):
    """Turns a bad spec into one line per problem and exit code 2, never a traceback; so is a
    store that fails (``StoreError``, or a database error that got past the store checks)."""

    # How the read commands name the store they were given (``harness.record.store_checks``).
    STORE_LABELS = (("tracking_uri", "--tracking-uri"),)

    def main(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().main(*args, **kwargs)
        finally:
            # What the command built (MLflow, SQLAlchemy, pandas objects) lives until the exit:
            # kept out of the collector, the interpreter's last collection skips it, which
            # saves each command about a second; atexit handlers still run.
            gc.freeze()

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
        except (click.ClickException, click.exceptions.Exit, click.exceptions.Abort):
            raise  # said already, or an exit asked for
        except Exception as error:
            from harness.record.store_checks import escaped_store_error

            line = escaped_store_error(error, dict(self.STORE_LABELS))
            if line is None:
                raise
            # Said as click says a bad option, or as a bad spec field is (``file: field: ...``).
            option = line.startswith(tuple(option for _, option in self.STORE_LABELS))
            click.echo(f"Error: {line}" if option else line, err=True)
            ctx.exit(2)


def choice_option(
    *decls: str, choices: Sequence[str], default: str, help: str | None = None
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """An option that takes one of ``choices``, its default shown in ``--help``: the shape of
    ``--format`` and of fit's ``--axis`` and ``--device``, said once."""
    return click.option(
        *decls, type=click.Choice(choices), default=default, show_default=True, help=help
    )


def positive_int_option(
    *decls: str, help: str
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """An optional whole number of at least 1 (None when not given: the command's own default,
    which ``help`` says), such as fit's ``--max`` and ``--jobs``."""
    return click.option(*decls, type=click.IntRange(min=1), default=None, help=help)


def format_option(command: Callable[..., Any]) -> Callable[..., Any]:
    """``--format table|csv|json`` (into ``fmt``): a table for people, raw numbers for tools."""
    return choice_option("--format", "fmt", choices=("table", "csv", "json"), default="table")(
        command
    )


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
        help="'latest', 'all', or a sweep's parent run id (or its first 6+ characters, as "
        "harness sweeps prints it).",
    )(command)


def sweep_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """Which sweep, from which store: ``--experiment``, ``--sweep``, ``--tracking-uri``."""
    return experiment_option(sweep_option(tracking_uri_option(command)))


def open_sweep(experiment: str | None, sweep_id: str, tracking_uri: str) -> Any:
    """The recorded sweep, or a one-line error saying what to do (exit 2 when the store
    itself is unusable: unreachable, missing, damaged, not MLflow's)."""
    from harness.record.results import load_sweep

    return read_recorded(lambda: load_sweep(experiment, tracking_uri, sweep_id))


def open_selected(selector: str, tracking_uri: str) -> Any:
    """The sweep a ``harness compare`` selector names (``EXPERIMENT[@RUN_ID|@DEVICE]``), or a
    one-line error, as ``open_sweep``."""
    from harness.record.results import select_sweep

    return read_recorded(lambda: select_sweep(selector, tracking_uri))


def read_recorded(read: Callable[[], Any]) -> Any:
    """What ``read`` reads from the MLflow store (a sweep, ``harness sweeps``' table), or a
    one-line error, as ``open_sweep``."""
    from harness.record.results import ResultsError
    from harness.record.store_checks import StoreError

    try:
        return read()
    except ResultsError as error:
        raise click.ClickException(str(error)) from None
    except StoreError as error:
        label = dict(SpecAwareGroup.STORE_LABELS).get(error.label)
        raise OneLineError(error.line(label)) from None


def output_dir(sweep: Any, out_dir: Path | None) -> Path:
    """Where an analysis writes its files: ``results/<experiment>/`` unless told."""
    return out_dir or Path(DEFAULT_RESULTS_DIR) / sweep.experiment


# How each column reads in a terminal table (CSV, JSON and Parquet keep raw numbers): in its
# unit, by the one formatter every command and the report share (harness.metrics.format_metric).
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


def show_recomputation(console: Console, frame: pd.DataFrame, batch: str) -> None:
    """checkpoint:auto / sac:auto: the plan each row's prediction chose for its budget, a line
    per row (``batch``: the column holding the batch size, ``value`` in a fit answer)."""
    if "recomputation" not in frame:
        return
    for record in frame.dropna(subset=["recomputation"]).to_dict("records"):
        where = f" on {record['card']}" if isinstance(record.get("card"), str) else ""
        console.print(
            f"{record['model_size']} {record['dtype']} batch {int(record[batch])} "
            f"{record['strategy']}{where}: {record['recomputation']}",
            soft_wrap=True,
            highlight=False,
        )


def is_missing(value: Any) -> bool:
    if value is None or isinstance(value, str):
        return value is None
    try:
        return bool(pd.isna(value))
    except (TypeError, ValueError):  # a list or an array: not one missing value
        return False


def cell(column: str, value: Any, row: Row | None = None) -> str:
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
    # A table's number is an int, a float or a numpy scalar: typed as the float the formatters
    # take (``numbers.Number`` declares no arithmetic).
    number = cast(float, value)
    if unit_of(column) is None and isinstance(value, Integral):
        return f"{int(number):,}"
    if unit_of(column) == THROUGHPUT:  # measured or predicted: in the trial's unit
        row = {} if row is None else row
        unit = row.get("throughput_unit")
        text = format_metric(column, number, unit if isinstance(unit, str) and unit else None)
        noisy = column == "throughput" and noise_reason(row)
        return text + (NOISY_MARK if noisy else "")
    return format_metric(column, number)


def breakdown_cell(row: Row) -> str:
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
        f"machine or with unsteady steps ({example}): do not compare them; rerun on an idle host "
        "(docs/measuring.md#stable-cpu-timings)"
    )
    return wrap_note(line)


def wrap_note(line: str, width: int | None = None) -> str:
    """A note under a table, whole, on as many lines as it takes within ``width`` (default
    ``MAX_LINE``, or the terminal's when narrower): a cut note tells nobody what to do."""
    import textwrap

    width = min(width or MAX_LINE, terminal_width() or MAX_LINE)
    return textwrap.fill(
        " ".join(line.split()), width=max(width, 40), subsequent_indent="  ", break_on_hyphens=False
    )


def terminal_width() -> int | None:
    """The terminal's columns when stdout is one (or ``COLUMNS`` says how wide), else None:
    a pipe or a file gets whole lines, as wide as the cells."""
    if sys.stdout.isatty() or "COLUMNS" in os.environ:
        return Console().width
    return None


TEXT_FOLD = 8  # the narrowest a text column folds to (wider where its heading's word is)
TERM_FOLD = 16  # a strategy column folds between terms up to this wide (checkpoint:auto+)
HEADING_WORD = 12  # a heading word longer than this folds rather than widen its column


def _widest_line(text: str) -> int:
    from rich.cells import cell_len

    return max((cell_len(line) for line in text.splitlines()), default=0)


def _longest_word(text: str) -> int:
    from rich.cells import cell_len

    return min(max((cell_len(word) for word in text.split()), default=0), HEADING_WORD)


def table_layout(
    headings: Sequence[str],
    numeric: Sequence[bool],
    rows: Sequence[Sequence[str]],
    width: int | None,
    overhead: Callable[[int], int],
    spare: Sequence[int] = (),
    whole: Sequence[bool] = (),
    fold_names: int = 0,
) -> tuple[list[int], list[int]]:
    """Which columns a table of ``width`` columns shows (by index) and each one's width.

    A number is never cut: a numeric column is as wide as its widest cell, only its heading
    folds. The widest column narrows first; text folds down to ``TEXT_FOLD``. Where even that
    does not fit, columns are left out: first those in ``spare`` (the caller's least needed,
    numbers included), then text columns from the right (never the first, which names the
    row). Where that is still too wide, every column stays and the table is wider than asked:
    a terminal folds its lines, nothing is hidden or cut. ``overhead(n)``: what borders and
    padding add to ``n`` columns.

    A text column marked ``whole`` (a strategy's name: ``qlora:16+chunked_ce`` folded inside
    its words reads as other names) is kept as whole as room allows, in steps
    (``fold_names``): 0, as wide as its widest name, where leaving out the ``spare`` columns
    but the last (the most wanted) makes room; 1, folded between its ``+``-joined terms (inside
    one only past ``TERM_FOLD`` characters), where leaving out ``spare`` makes room; 2, like any
    text column."""
    count = len(headings)
    named = [i < len(whole) and whole[i] and fold_names < 2 for i in range(count)]
    unbroken = [numeric[i] or (named[i] and fold_names == 0) for i in range(count)]
    cells = [max((_widest_line(row[i]) for row in rows), default=0) for i in range(count)]
    natural = [max(cells[i], _widest_line(headings[i]), 1) for i in range(count)]
    least = [
        max(cells[i], _longest_word(headings[i]), 1)
        if unbroken[i]
        else max(min(_longest_term(rows, i), TERM_FOLD), _longest_word(headings[i]), 1)
        if named[i]
        else min(natural[i], max(TEXT_FOLD, _longest_word(headings[i])))
        for i in range(count)
    ]
    every = list(range(count))
    if width is None or sum(natural) + overhead(count) <= width:
        return every, natural

    def fits(shown: list[int]) -> bool:
        return sum(least[i] for i in shown) + overhead(len(shown)) <= width

    text = [i for i in reversed(every[1:]) if not unbroken[i] and not named[i]]
    shown = every
    # names are kept whole at the cost of spare columns only, never of a status or a dtype
    dropped = [*spare[:-1]] if fold_names == 0 else spare if any(named) else [*spare, *text]
    for index in dict.fromkeys(dropped):  # in order, once each
        if fits(shown):
            break
        shown = [i for i in shown if i != index]
    if not fits(shown) and any(named):  # the names must give more
        return table_layout(headings, numeric, rows, width, overhead, spare, whole, fold_names + 1)
    if not fits(shown):
        shown = every  # leaving columns out does not make it fit: show them all, narrowest
    room = max(width - overhead(len(shown)), sum(least[i] for i in shown))
    widths = {i: natural[i] for i in shown}
    while sum(widths.values()) > room:  # the widest column that can give gives one, in turn
        wider = [i for i in shown if widths[i] > least[i]]
        widths[max(wider, key=widths.__getitem__)] -= 1
    return shown, [widths[i] for i in shown]


# Text columns whose cells are never folded (by heading): a name split over rows reads as
# several names.
WHOLE_HEADINGS = frozenset({"strategy"})


def _longest_term(rows: Sequence[Sequence[str]], index: int) -> int:
    """The widest ``+``-joined term (its ``+`` kept) of column ``index``'s cells."""
    return max((len(term) + 1 for row in rows for term in row[index].split("+")), default=1)


def terminal_table(
    headings: Sequence[str],
    numeric: Sequence[bool],
    rows: Sequence[Sequence[str]],
    width: int | None = None,
    spare: Sequence[int] = (),
    **options: Any,
) -> tuple[Table, list[str], int]:
    """A rich ``Table(**options)`` of ``rows`` (cells as text) laid out by ``table_layout`` for
    ``width`` (None: as wide as its cells; ``spare``: the columns to leave out first):
    numbers right-aligned and never wrapped, text left-aligned and folded; the headings left
    out; the width the table takes."""
    from rich.measure import Measurement
    from rich.text import Text

    measurer = Console(file=io.StringIO(), width=100_000)
    rows = [[str(value) for value in row] for row in rows]

    def overhead(count: int) -> int:
        probe = Table(**options)
        for _ in range(count):
            probe.add_column(width=1)
        return Measurement.get(measurer, measurer.options, probe).maximum - count

    named = [" ".join(heading.split()) in WHOLE_HEADINGS for heading in headings]
    shown, widths = table_layout(headings, numeric, rows, width, overhead, spare, named)
    given = dict(zip(shown, widths, strict=True))
    whole = [  # kept whole where the layout gave the column its widest cell
        named[i] and i in given and given[i] >= max((_widest_line(r[i]) for r in rows), default=0)
        for i in range(len(headings))
    ]
    table = Table(**options)
    for index, column_width in zip(shown, widths, strict=True):
        table.add_column(
            Text(fold(headings[index], column_width), no_wrap=False, overflow="fold"),
            justify="right" if numeric[index] else "left",
            width=column_width,
            no_wrap=numeric[index] or whole[index],
            overflow="fold",
        )
    width_of = dict(zip(shown, widths, strict=True))
    for row in rows:
        table.add_row(
            *(Text(row[i] if numeric[i] or whole[i] else fold(row[i], width_of[i])) for i in shown)
        )
    left_out = [" ".join(headings[i].split()) for i in range(len(headings)) if i not in shown]
    return table, left_out, sum(widths) + overhead(len(shown))


def fold(text: str, width: int) -> str:
    """``text`` in lines of at most ``width``, broken at spaces and, in a word longer than
    ``width``, after a ``/``, ``_``, ``+``, ``-`` or ``,`` (``activation_`` / ``checkpointing``,
    not ``activatio`` / ``n_checkp``...): rich breaks only at spaces, then anywhere. A part
    still longer than ``width`` is left to rich."""
    import re

    if _widest_line(text) <= width:
        return text
    lines: list[str] = []
    for line in text.splitlines():
        current = ""
        parts: list[str] = []
        for word in re.split(r"(?<= )", line):  # each word with its space
            long = len(word.rstrip()) > width
            parts += re.split(r"(?<=[/_+,-])", word) if long else [word]
        for part in parts:
            if current and len((current + part).rstrip()) > width:
                lines.append(current.rstrip())
                current = ""
            current += part
        lines.append(current.rstrip())
    return "\n".join(lines)


def left_out_line(headings: Sequence[str], width: int, how: str) -> str:
    """The one line under a table that had to leave columns out to fit the terminal."""
    return f"left out to fit {width} columns: {', '.join(headings)} ({how})"


def print_table(
    console: Console,
    headings: Sequence[str],
    numeric: Sequence[bool],
    rows: Sequence[Sequence[str]],
    how: str,
    spare: Sequence[int] = (),
    **options: Any,
) -> None:
    """A table on ``console`` that fits its width without ever cutting a number (see
    ``table_layout``; ``spare``: the columns to leave out first); ``how``: how to see the
    columns it left out, said in one line."""
    table, left_out, needed = terminal_table(
        headings, numeric, rows, console.width, spare, **options
    )
    width = console.width
    try:
        console.width = max(width, needed)  # numbers wider than the terminal: it folds lines
        console.print(table)
    finally:
        console.width = width
    if left_out:
        console.print(left_out_line(left_out, width, how), highlight=False, markup=False)


LEFT_OUT_HOW = "--columns picks columns; --wide or --format csv shows every one"


def table_text(
    frame: pd.DataFrame,
    columns: list[str] | None = None,
    headings: Mapping[str, str] | None = None,
    title: str | None = None,
    width: int | None = None,
    how: str = LEFT_OUT_HOW,
    spare: Sequence[str] = (),
) -> str:
    """``frame``'s ``columns`` (default: all) as a plain-text table, each cell by ``cell``
    (``breakdown``: ``breakdown_cell``), numbers right-aligned, ``title`` on the line above.
    ``width`` None: as wide as its cells (a pager or the terminal folds it); else laid out to
    fit it by ``table_layout`` (``spare``: the columns to leave out first), with a line saying
    which columns were left out (``how``: how to see them)."""
    from rich import box

    columns = list(frame.columns) if columns is None else columns
    headings = headings or {}
    numeric = [
        column == BREAKDOWN
        or (
            column in frame
            and pd.api.types.is_numeric_dtype(frame[column])
            and not pd.api.types.is_bool_dtype(frame[column])
        )
        for column in columns
    ]
    rows = [
        [
            breakdown_cell(row) if column == BREAKDOWN else cell(column, row[column], row)
            for column in columns
        ]
        for _, row in frame.iterrows()
    ]
    shown = [
        headings.get(column, BREAKDOWN_HEADING if column == BREAKDOWN else column)
        for column in columns
    ]
    table, left_out, _ = terminal_table(
        shown,
        numeric,
        rows,
        width,
        [columns.index(column) for column in spare if column in columns],
        box=box.SIMPLE_HEAD,
        show_edge=False,
        pad_edge=False,
        collapse_padding=True,
    )
    console = Console(file=io.StringIO(), width=100_000, color_system=None)
    console.print(table, highlight=False)
    text = console.file.getvalue()  # type: ignore[attr-defined]
    text = "\n".join(line.rstrip() for line in text.splitlines()).strip("\n")
    if left_out and width is not None:
        text += "\n" + left_out_line(left_out, width, how)
    return text if title is None else f"{title}\n{text}"


def show(
    frame: pd.DataFrame, title: str, console: Console, columns: list[str] | None = None
) -> None:
    """``frame``'s ``columns`` (default: all) as a table on ``console`` under its title, cells
    by ``cell``, with the noise footnote where a throughput is marked; laid out to fit the
    console's width, numbers never cut."""
    how = "`harness results --columns` shows any column"
    text = table_text(frame, columns, HEADINGS, f"\n{title}", console.width, how)
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


def cards_file_option(command: Callable[..., Any]) -> Callable[..., Any]:
    """``--cards FILE``: your own cards beside the catalogue."""
    return click.option(
        "--cards",
        "cards_file",
        type=click.Path(dir_okay=False, path_type=Path),
        default=None,
        help="A YAML file of your own cards (see docs/cards.md).",
    )(command)


def card_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """``--card NAME`` and ``--cards FILE``: plan for another card than the spec's."""
    command = cards_file_option(command)
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


# The options that shape a --model spec, by the name the command receives them under.
MODEL_FLAGS = {
    "seq_len": "--seq-len",
    "strategies": "--strategies",
    "batch_text": "--batch",
    "dtype": "--dtype",
}


def model_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """``--model NAME`` and its companions, for a question asked without a spec file
    (``harness.spec.oneshot``): the command gets the written spec as ``spec_path``. Exactly
    one of SPEC and ``--model``; ``--model`` needs the card it asks about."""
    import functools

    @functools.wraps(command)
    def resolved(**kwargs: Any) -> Any:
        model = kwargs.pop("model")
        given = {key: kwargs.pop(key) for key in MODEL_FLAGS}
        spec_path = kwargs.get("spec_path")
        if model is None:
            unused = [MODEL_FLAGS[key] for key, value in given.items() if value]
            if spec_path is None:
                raise click.UsageError("give a SPEC file or --model NAME (e.g. llama-3.1-8b)")
            if unused:
                raise click.UsageError(f"{', '.join(unused)}: only with --model (the spec says it)")
            return command(**kwargs)
        if spec_path is not None:
            raise click.UsageError(f"give a SPEC file or --model, not both ({spec_path}, {model})")
        card = kwargs.get("card") or kwargs.get("cards")
        if not card:
            raise click.UsageError("--model needs --card NAME: the card to plan for")
        kwargs["spec_path"] = oneshot_path(model, given, str(card).split(",")[0].strip())
        return command(**kwargs)

    options = [
        click.option(
            "--model",
            default=None,
            help="Ask without a spec file: an hf preset (llama-3.1-8b, qwen2.5-7b, ...), a "
            "folder with a config.json, or a hub id ORG/NAME (transformers' local cache); the "
            "spec written for it is kept in results/specs/.",
        ),
        positive_int_option(
            "--seq-len",
            help="With --model: tokens per sample (2048, or the model's positions if fewer).",
        ),
        click.option(
            "--strategies",
            default=None,
            help="With --model: strategies to compare, comma-separated, a combination joined "
            "by + (default none,checkpoint,lora:16,lora:16+checkpoint,qlora:16,"
            "qlora:16+checkpoint).",
        ),
        click.option(
            "--batch", "batch_text", default=None, help="With --model: batch sizes (1,2,4,8)."
        ),
        click.option(
            "--dtype",
            type=click.Choice(("bf16", "fp16", "fp32")),
            default=None,
            help="With --model: the dtype axis (bf16).",
        ),
    ]
    for option in reversed(options):
        resolved = option(resolved)
    return resolved


def oneshot_path(model: str, given: Mapping[str, Any], card: str) -> Path:
    """The spec ``--model`` stands for, written under results/specs/ (said on stderr)."""
    from harness.spec.oneshot import oneshot_spec, write_oneshot

    batches = None
    if given.get("batch_text"):
        try:
            batches = [int(part) for part in str(given["batch_text"]).split(",") if part.strip()]
        except ValueError:
            raise click.BadParameter(
                f"{given['batch_text']!r}: whole numbers, comma-separated", param_hint="--batch"
            ) from None
    try:
        spec = oneshot_spec(
            model,
            seq_len=given.get("seq_len"),
            strategies=given.get("strategies"),
            batch_sizes=batches,
            dtype=given.get("dtype") or "bf16",
            card=card,
        )
        path = write_oneshot(spec)
    except SpecError as error:
        raise click.ClickException(str(error)) from None
    click.echo(f"spec for --model {model}: {path} (edit it and pass it as SPEC for more)", err=True)
    return path
