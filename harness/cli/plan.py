"""``harness validate`` and ``harness estimate``: look at a spec before running it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from harness.cli.common import (
    card_options,
    cards_file_option,
    emit,
    format_option,
    model_options,
    prediction_target,
    show_recomputation,
)
from harness.cuda.margin import CARD_MARGIN
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
    from harness.sweep.preflight import device_problem, model_id_problem

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
        for size, knobs in spec.model.sizes.items():
            missing = model_id_problem(str(knobs["model_id"])) if "model_id" in knobs else None
            if missing:  # with the network a trial may still fetch it: a warning, not an error
                click.echo(f"{path}: warning: model.sizes.{size}.model_id: {missing}", err=True)
    if bad:
        if len(specs) > 1:
            click.echo(
                f"{len(bad)} of {len(specs)} specs have problems: {', '.join(map(str, bad))}",
                err=True,
            )
        raise SystemExit(2)


@click.command()
@click.argument(
    "spec_path", metavar="[SPEC]", required=False, type=click.Path(dir_okay=False, path_type=Path)
)
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
@model_options
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
    "predicted_mem_workspace_bytes": "work-\nspaces",
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
# the breakdown's parts from the right, then MFU and throughput (half of what a user asks an
# estimate: they go last); the axes, the peak figures, fits and the step time stay.
SPARE_COLUMNS = (
    *CROSS_CHECKS[::-1],
    "num_params",
    "predicted_mem_workspace_bytes",
    "predicted_mem_other_bytes",
    "predicted_mem_activation_bytes",
    "predicted_mem_optim_bytes",
    "predicted_mem_grad_bytes",
    "predicted_mem_param_bytes",
    "predicted_mfu",
    "predicted_throughput",
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
        if "fits" in columns and cuda and spec.memory_budget:
            cells[columns.index("fits")] = fits_cell(row, spec.memory_budget)
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
    if "safety_margin_bytes" in frame:
        console.print(
            f"fits: the device figure within {budget} less a safety margin of "
            f"{format_bytes(frame['safety_margin_bytes'].iloc[0], short=True)}: "
            f"{CARD_MARGIN.text()}",
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
    show_recomputation(console, frame, "batch_size")


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


def fits_cell(row: Any, budget: float) -> str:
    """``yes, 1.2 GiB spare`` / ``NO, 0.8 GiB over``: how far the device figure is from the
    budget (a card's fits also holds back the safety margin: a yes is spare beyond it)."""
    from harness.cli.common import is_missing

    fits, device = row.get("fits"), row.get("predicted_device_bytes")
    if is_missing(fits) or is_missing(device):
        return "-"
    room = budget - device
    if not fits and room >= 0:
        return "NO, in margin"
    words = f"{format_bytes(abs(room), short=True)} {'spare' if room >= 0 else 'over'}"
    return f"yes, {words}" if fits else f"NO, {words}"


def estimate_cell(column: str, value: Any, row: Any = None) -> str:
    from harness.cli.common import cell, is_missing

    if column == "fits" and not is_missing(value):
        return "yes" if value else "NO"
    return cell(column, value, row)  # the one rule of every table: bytes, counts, ...


@click.command()
@click.argument(
    "spec_path", metavar="[SPEC]", required=False, type=click.Path(dir_okay=False, path_type=Path)
)
@click.option(
    "--card",
    "cards",
    default=None,
    help="Cards to plan on, comma-separated (`harness cards` lists them; `cpu` is this host); "
    "default: the spec's card, else this host's GPU or CPU.",
)
@cards_file_option
@click.option(
    "--gpus",
    type=click.IntRange(min=1),
    default=None,
    help="Cards per configuration: every data-parallel strategy (ddp:N, fsdp:N) runs on this "
    "many, and a configuration without one is planned as ddp over them (throughput counts "
    "every card; memory is per card).",
)
@click.option(
    "--all",
    "every",
    is_flag=True,
    help="Predict every point on every card; by default a configuration's batch sizes above "
    "one that already exceeds a card are not predicted on it (they cannot fit).",
)
@format_option
@click.option(
    "--out",
    "out_dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Where the front is drawn (PNG + HTML); default results/plan/EXPERIMENT.",
)
@model_options
def plan(
    spec_path: Path,
    cards: str | None,
    cards_file: Path | None,
    gpus: int | None,
    every: bool,
    fmt: str,
    out_dir: Path | None,
) -> None:
    """Which configurations fit each card, ranked by predicted throughput, nothing run.

    Every grid point (every `max` batch resolved per card) is predicted on each card as
    `harness estimate` predicts it: fits (judged on the device figure), peak, step time,
    throughput, MFU. The fitting points are ranked per card, the memory-vs-throughput front is
    drawn (PNG + HTML), and one line per card says what the runner-up trades."""
    from harness.analyse.plan_front import front_html, front_png
    from harness.spec import SpecError
    from harness.sweep.card_plan import known_cards, plan_grid, trade_line, with_gpus
    from harness.sweep.estimate import EstimateError

    spec = load_spec(spec_path)
    names = [c.strip().lower() for c in cards.split(",") if c.strip()] if cards else []
    if not names:
        names = [spec.card.lower()] if spec.card else [default_card(spec)]
    unknown = [n for n in names if n not in known_cards() and not cards_file]
    if unknown:
        raise click.BadParameter(
            f"unknown card {', '.join(map(repr, unknown))} (known: {', '.join(known_cards())}; "
            "or add your own with --cards FILE)",
            param_hint="--card",
        )
    try:
        if gpus is not None:
            spec = with_gpus(spec, gpus)
        frame = plan_grid(spec, names, str(cards_file) if cards_file else None, every)
    except SpecError as error:
        raise click.ClickException(str(error)) from None
    except EstimateError as error:
        raise click.ClickException(str(error)) from None
    if fmt != "table":
        emit(frame, fmt, lambda: None)
        return
    out = out_dir or Path("results") / "plan" / spec.experiment
    title = f"{spec.experiment}: predicted memory and throughput on {', '.join(names)}"
    show_plan(frame, spec, names)
    png = front_png(frame, out / "front.png", title)
    html = front_html(frame, out / "front.html", title)
    for name in names:
        click.echo(trade_line(frame, name))
    click.echo(f"front: {png} and {html}")


PLAN_TABLE = {
    "rank": "rank",
    "model_size": "size",
    "batch_size": "batch",
    "dtype": "dtype",
    "strategy": "strategy",
    "predicted_peak_bytes": "allocated",
    "predicted_device_bytes": "device",
    "fits": "fits",
    "predicted_step_time_ms": "step",
    "predicted_throughput": "throughput",
    "predicted_mfu": "MFU",
}


def show_plan(frame: Any, spec: Any, cards: list[str]) -> None:
    """One table per card: the points that fit, fastest first, then the rest."""
    from rich import box

    from harness.cli.common import is_missing, make_console, print_table

    console = make_console()
    fixed = [c for c in ("model_size", "dtype") if frame[c].nunique() == 1]
    columns = [c for c in PLAN_TABLE if c in frame.columns and c not in fixed]
    for card in cards:
        rows = frame[frame["card"].eq(card)]
        if rows.empty:
            continue
        budget = rows["budget_bytes"].iloc[0]
        within = "" if is_missing(budget) else f" within {format_bytes(budget, short=True)}"
        cells = []
        reasons: dict[str, int] = {}  # one note per reason, shared by the rows it explains
        for _, row in rows.iterrows():
            line = [plan_cell(column, row[column], row) for column in columns]
            skipped = row.get("skipped")
            reason = skipped if isinstance(skipped, str) else None
            if reason is None:
                prediction = Prediction.from_dict(row)
                reason = None if prediction.ok else f"not predicted: {prediction.reason}"
            if reason is not None:
                number = reasons.setdefault(f"{row['strategy']}: {reason}", len(reasons) + 1)
                line[columns.index("strategy")] += f" [{number}]"
            cells.append(line)
        shared = ", ".join(f"{PLAN_TABLE[c]} {frame[c].iloc[0]}" for c in fixed)
        print_table(
            console,
            [PLAN_TABLE[c] for c in columns],
            [c not in ("model_size", "dtype", "strategy") for c in columns],
            cells,
            "--format csv or json shows every column",
            [columns.index(c) for c in ("predicted_mfu", "predicted_peak_bytes") if c in columns],
            title=f"{card}: {len(rows)} points, ranked by predicted throughput where they fit"
            f"{within}" + (f"; every row: {shared}" if shared else ""),
            box=box.SIMPLE_HEAD,
            pad_edge=False,
            collapse_padding=True,
        )
        for reason, number in reasons.items():
            console.print(f"[{number}] {reason}", highlight=False, markup=False)
    console.print(
        "device = what the card holds (reserved + CUDA context + NCCL), fits is judged on it "
        "(on a CPU: allocated); step = one optimizer step's predicted time; MFU = model FLOPs "
        "per step time over the card's peak (docs/speed.md)",
        highlight=False,
    )
    if "safety_margin_bytes" in frame and frame["safety_margin_bytes"].notna().any():
        console.print(
            "fits on a card: the device figure within the budget less a safety margin ("
            + ", ".join(
                f"{card} {format_bytes(margin, short=True)}"
                for card, margin in frame.groupby("card", sort=False)["safety_margin_bytes"]
                .first()
                .dropna()
                .items()
            )
            + f"): {CARD_MARGIN.text()}",
            highlight=False,
        )
    show_recomputation(console, frame, "batch_size")


def plan_cell(column: str, value: Any, row: Any) -> str:
    from harness.cli.common import is_missing

    if column == "rank":
        return "-" if is_missing(value) else str(int(value))
    if column == "predicted_mfu" and not is_missing(value):
        return f"{100 * value:.3g} %"
    return estimate_cell(column, value, row)


def default_card(spec: Any) -> str:
    """This host's GPU as a catalogue card, else ``cpu``."""
    from harness.contract import CPU_CARD
    from harness.cuda.cards import card_for_device_name
    from harness.spec.schema import local_device

    if local_device() == "cuda":
        import torch

        card = card_for_device_name(torch.cuda.get_device_name())
        if card is not None:
            return card.name
    return CPU_CARD
