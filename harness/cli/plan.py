"""``harness validate`` and ``harness estimate``: look at a spec before running it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from harness.cli.common import card_options, emit, format_option, prediction_target
from harness.spec import SweepPlan, load_spec, points, with_card
from harness.trial.prediction import Prediction
from harness.units import format_bytes


@click.command()
@click.argument("specs", nargs=-1, required=True, type=click.Path(dir_okay=False, path_type=Path))
def validate(specs: tuple[Path, ...]) -> None:
    """Check SPEC files without running anything; print the number of trials each plans.

    Every file is checked: one line per problem per bad file (stderr), one ok line per good
    one (stdout); exit status 2 when any was bad."""
    from harness.spec import SpecError
    from harness.sweep.preflight import device_problem

    bad = []
    for path in specs:
        try:
            spec = load_spec(path)
            planned = len(points(spec))
        except SpecError as error:
            click.echo(str(error), err=True)
            bad.append(path)
            continue
        click.echo(f"{path}: ok ({planned} trials, experiment {spec.experiment!r})")
        why = device_problem(spec.device)
        if why:  # a valid spec for another machine: sweep refuses it here, estimate is fine
            click.echo(
                f"{path}: warning: device: {why}; `harness sweep` refuses it on this host", err=True
            )
    if bad:
        if len(specs) > 1:
            click.echo(
                f"{len(bad)} of {len(specs)} specs have problems: {', '.join(map(str, bad))}",
                err=True,
            )
        raise SystemExit(2)


@click.command()
@click.argument("spec_path", metavar="SPEC", type=click.Path(dir_okay=False, path_type=Path))
@format_option
@click.option(
    "--device",
    type=click.Choice(("auto", "cpu", "cuda")),
    default="auto",
    show_default=True,
    help="Device to predict for; auto: the spec's device (auto there means CUDA where a card is "
    "named or present here). CUDA is predicted from any machine, under CUDA's own rules.",
)
@card_options
def estimate(
    spec_path: Path, fmt: str, device: str, card: str | None, cards_file: Path | None
) -> None:
    """Predict every grid point's peak memory and breakdown without running (fake tensors).

    For a CUDA card: allocated (tensors and library workspaces), reserved (the caching
    allocator's segments, its rules replayed on the step's allocations) and device (reserved +
    the CUDA context + NCCL buffers); fits is judged on the device figure."""
    from harness.sweep.estimate import EstimateError, estimate_grid
    from harness.sweep.prepare import resolve_max_batch
    from harness.sweep.progress import max_batch_lines

    spec = with_card(load_spec(spec_path), card, str(cards_file) if cards_file else None)
    target = prediction_target(spec, device)
    sweep = resolve_max_batch(SweepPlan(spec), target)  # grid.batch_size: max, for this target
    for line in max_batch_lines(sweep):
        click.echo(line, err=True)
    try:
        frame = estimate_grid(sweep, target)
    except EstimateError as error:
        raise click.ClickException(str(error)) from None
    emit(frame, fmt, lambda: show_estimate(frame, spec, target))


# The table's columns (csv/json keep every column under its full name): short headings, bytes
# with units; what is the same on every row is said once under the table.
TABLE_COLUMNS = {
    "model_size": "size",
    "batch_size": "batch",
    "dtype": "dtype",
    "strategy": "strategy",
    "predicted_peak_bytes": "allocated",
    "predicted_reserved_bytes": "reserved",
    "predicted_device_bytes": "device",
    "predicted_mem_param_bytes": "params",
    "predicted_mem_grad_bytes": "grads",
    "predicted_mem_optim_bytes": "optim",
    "predicted_mem_activation_bytes": "activ.",
    "predicted_mem_other_bytes": "other",
    "predicted_model_state_bytes": "model\nstate",
    "closed_form_model_state_bytes": "closed\nform",
    "korthikanti_activation_bytes": "Korthikanti",
    "num_params": "trainable",
    "fits": "fits",
    "predicted_step_time_ms": "step",
    "predicted_throughput": "throughput",
    "predicted_mfu": "MFU",
}


CROSS_CHECKS = ("predicted_model_state_bytes", "closed_form_model_state_bytes")
# What a narrow terminal leaves out first (named under the table): the cross-checks, then
# the breakdown's parts from the right; the axes, the peak figures and fits stay.
SPARE_COLUMNS = (
    *CROSS_CHECKS[::-1],
    "num_params",
    "predicted_mfu",
    "predicted_throughput",
    "predicted_mem_other_bytes",
    "predicted_mem_activation_bytes",
    "predicted_mem_optim_bytes",
    "predicted_mem_grad_bytes",
    "predicted_mem_param_bytes",
)


def show_estimate(frame: Any, spec: Any, target: str) -> None:
    """The estimate as a table people read: a column per part of the breakdown, the axes that
    do not vary named once in the title, why a row has no prediction in a note under it."""
    from rich import box

    from harness.cli.common import make_console, print_table

    columns = [c for c in TABLE_COLUMNS if c in frame.columns]
    fixed = [c for c in ("model_size", "batch_size", "dtype") if frame[c].nunique() == 1]
    columns = [c for c in columns if c not in fixed]
    cuda = "predicted_device_bytes" in frame
    if cuda:  # two more figures to show: the model-state cross-checks stay in csv/json
        columns = [c for c in columns if c not in CROSS_CHECKS]
    budget = format_bytes(spec.memory_budget, short=True) if spec.memory_budget else ""
    headings = [TABLE_COLUMNS[c] + (f"\n{budget}" if c == "fits" else "") for c in columns]
    rows: list[list[str]] = []
    reasons: list[str] = []
    for _, row in frame.iterrows():
        cells = [estimate_cell(column, row[column], row) for column in columns]
        prediction = Prediction.from_dict(row)
        if not prediction.ok:
            reasons.append(f"[{len(reasons) + 1}] {row['strategy']}: {prediction.reason}")
            cells[columns.index("strategy")] += f" [{len(reasons)}]"
        rows.append(cells)
    console = make_console()
    print_table(
        console,
        headings,
        [c not in ("model_size", "dtype", "strategy") for c in columns],
        rows,
        "--format csv or json shows every column",
        [columns.index(c) for c in SPARE_COLUMNS if c in columns],
        title=estimate_title(frame, spec, target, fixed),
        box=box.SIMPLE_HEAD,
        pad_edge=False,
        collapse_padding=True,
    )
    console.print(
        "allocated = params + grads + optim + activ. + other at the step's worst moment"
        + (
            "; reserved = the caching allocator's segments at their peak; device = reserved + "
            "CUDA context + NCCL buffers, what the card must hold (fits is judged on it)"
            if "predicted_device_bytes" in frame
            else ""
        )
        + (
            "; model state and its closed form: --format csv|json"
            if cuda
            else "; model state = parameters + gradients + optimizer state as built; closed "
            "form = the same from textbook bytes per parameter"
        )
        + "; trainable = parameters that get gradients; step = one optimizer step's predicted "
        "time, MFU = model FLOPs per step time over the device's peak (docs/speed.md)",
        highlight=False,
    )
    for reason in reasons:
        console.print(f"not predicted {reason}", highlight=False)
    if "estimate_seconds" in frame:
        seconds = frame["estimate_seconds"]
        console.print(
            f"estimated {len(frame)} trials in {seconds.sum():.0f} s "
            f"({seconds.min():.1f}-{seconds.max():.1f} s each, imports not counted)",
            highlight=False,
        )
    for note in sorted({n for n in frame.get("note", []) if isinstance(n, str)}):
        console.print(f"prediction: {note}", highlight=False)


def estimate_title(frame: Any, spec: Any, target: str, fixed: list[str]) -> str:
    """What was predicted, for which device and card, and what every row shares."""
    cards = frame["card"].dropna().unique() if "card" in frame else []
    device = f"{target} ({', '.join(map(str, cards))})" if len(cards) else target
    title = (
        f"{spec.experiment}: peak memory and step time of {len(frame)} trials predicted for "
        f"{device} on fake tensors, nothing run"
    )
    shared = ", ".join(f"{TABLE_COLUMNS[c]} {frame[c].iloc[0]}" for c in fixed)
    return f"{title}; every row: {shared}" if shared else title


def estimate_cell(column: str, value: Any, row: Any = None) -> str:
    from harness.cli.common import cell, is_missing

    if column == "fits" and not is_missing(value):
        return "yes" if value else "NO"
    return cell(column, value, row)  # the one rule of every table: bytes, counts, ...
