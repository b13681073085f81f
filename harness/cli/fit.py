"""``harness fit``: the largest batch (or sequence length) that fits each card, predicted."""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import click

from harness.cli.common import (
    card_options,
    choice_option,
    emit,
    format_option,
    make_console,
    model_options,
    positive_int_option,
    prediction_target,
    print_table,
    show_recomputation,
)
from harness.cuda.margin import CARD_MARGIN
from harness.spec import SpecError, load_spec, with_card
from harness.trial.prediction import Prediction
from harness.units import format_bytes, parse_bytes


def budgets_option(text: str | None, spec: Any, source: Path) -> list[int]:
    """``--budget 24GiB,80GiB,141GiB``, or the spec's budget (``device_memory``, else the
    card's memory); one line if none."""
    if text is None:
        if spec.memory_budget is None:
            raise SpecError(
                f"{source}: device_memory: not set; give --card h100-80gb or --budget "
                "24GiB,80GiB (the cards to fit)"
            )
        return [int(spec.memory_budget)]
    budgets = []
    for part in text.split(","):
        try:
            budgets.append(parse_bytes(part.strip()))
        except ValueError as error:
            raise click.BadParameter(f"{part.strip()!r}: {error}", param_hint="--budget") from None
    return budgets


def cell(row: Any, axis: str) -> str:
    """A matrix cell: the largest value that fits, or why there is none."""
    if not Prediction.from_dict(row).ok:
        return "not predicted"
    value = row.get("value")
    if value is None or value != value:
        return "-"
    if int(value) == 0:
        return "does not fit at 1" if axis == "batch_size" else "does not fit"
    capped = int(value) >= int(row.get("max_tried") or 0)
    return f"{int(value):,}" + ("+" if capped else "")


@click.command()
@click.argument(
    "spec_path", metavar="[SPEC]", required=False, type=click.Path(dir_okay=False, path_type=Path)
)
@click.option(
    "--budget",
    "budget_text",
    default=None,
    help="Memory budgets to fit, e.g. 24GiB,80GiB,141GiB (default: the spec's device_memory, "
    "else the card's memory). On CUDA each budget holds the device figure: reserved + context, less the safety margin (docs/cards.md).",
)
@choice_option(
    "--axis",
    choices=["batch_size", "seq_len"],
    default="batch_size",
    help="What to make as large as fits (the grid's other axes stay).",
)
@positive_int_option(
    "--max",
    "maximum",
    help="The largest value to try (default 4096 for the batch, also at most the dataset's "
    "training split; 131072 for seq_len).",
)
@format_option
@choice_option(
    "--device",
    choices=["auto", "cpu", "cuda"],
    default="auto",
    help="Predict for this device's allocator (cuda works without a GPU).",
)
@positive_int_option(
    "--jobs",
    help="Search processes at once, each taking the next configuration not yet taken (default: "
    "one per CPU core; each holds one fake model, ~1 GB for an 8B one).",
)
@card_options
@model_options
def fit(
    spec_path: Path,
    budget_text: str | None,
    axis: str,
    maximum: int | None,
    fmt: str,
    device: str,
    jobs: int | None,
    card: str | None,
    cards_file: Path | None,
) -> None:
    """The largest batch (or sequence length) of every configuration that fits each budget,
    predicted on fake tensors: no GPU, nothing allocated."""
    from harness.sweep.estimate import EstimateError
    from harness.sweep.fit import default_jobs, fit_grid

    spec = with_card(load_spec(spec_path), card, str(cards_file) if cards_file else None)
    budgets = budgets_option(budget_text, spec, spec_path)
    target = prediction_target(spec, device)
    started = time.perf_counter()
    try:
        frame = fit_grid(spec, target, budgets, axis, maximum, jobs or default_jobs())
    except EstimateError as error:
        raise click.ClickException(str(error)) from None
    seconds = time.perf_counter() - started
    emit(frame, fmt, lambda: show_fit(frame, spec, budgets, axis, target, seconds))


def show_fit(
    frame: Any, spec: Any, budgets: list[int], axis: str, target: str, seconds: float
) -> None:
    """The matrix (configurations × cards), then how the answers were found."""
    console = make_console()
    noun = "batch" if axis == "batch_size" else "sequence length"
    headings = ["size", "dtype", "strategy", *(format_bytes(b, short=True) for b in budgets)]
    rows = []
    for (size, dtype, strategy), group in frame.groupby(
        ["model_size", "dtype", "strategy"], sort=False
    ):
        by_budget = {int(r["budget_bytes"]): r for r in group.to_dict("records")}
        rows.append([size, dtype, strategy, *(cell(by_budget[b], axis) for b in budgets)])
    print_table(
        console,
        headings,
        [False] * 3 + [True] * len(budgets),  # a budget's answer is never cut
        rows,
        "--format csv or json shows every column",
        title=f"{spec.name}: the largest {noun} that fits, predicted for {target}",
    )
    answered = frame[frame["value"].fillna(0) > 0]
    counts = frame["predictions"].dropna()
    methods = answered["method"].value_counts().to_dict() if len(answered) else {}
    console.print(
        f"{len(frame)} answers from {int(counts.sum())} predictions "
        f"(median {statistics.median(counts):g} per answer; "
        + ", ".join(f"{n} by {m}" for m, n in methods.items())
        + f") in {seconds:.0f} s. Each answer b fits: predicted(b) <= budget < predicted(next "
        "allowed b) (on a card: the budget less its safety margin); '+' means the search stopped at --max (or the training split).",
        soft_wrap=True,
        highlight=False,
    )
    margin = answered["margin_bytes"].min() if len(answered) else None  # of the whole budget
    judged = (
        "the device figure: the caching allocator's reserved segments (its rules replayed on "
        "the step's allocations) + the CUDA context + NCCL buffers"
        if "predicted_device_bytes" in frame
        else "tensor accounting (exact on CPU)"
    )
    console.print(
        f"Judged on {judged}"
        + (
            f"; the smallest margin left is {format_bytes(margin, short=True)}"
            if margin is not None
            else ""
        )
        + ".",
        soft_wrap=True,
        highlight=False,
    )
    if "safety_margin_bytes" in frame:
        console.print(margin_line(frame), soft_wrap=True, highlight=False)
    for note in sorted({n for n in frame.get("note", []) if isinstance(n, str)}):
        console.print(f"prediction: {note}", soft_wrap=True, highlight=False)
    if "recomputation" in frame:  # checkpoint:auto / sac:auto: the plan at each answer
        console.print(
            "auto recomputation: the largest batch that fits with every block recomputed, then "
            "the fewest blocks recomputed in full at that batch:",
            soft_wrap=True,
            highlight=False,
        )
        show_recomputation(console, frame, "value")


def margin_line(frame: Any) -> str:
    """Under a card's answers: what each budget held back, and why."""
    held = frame.groupby("budget_bytes", sort=False)["safety_margin_bytes"].first()
    parts = ", ".join(
        f"{format_bytes(margin, short=True)} of {format_bytes(budget, short=True)}"
        for budget, margin in held.items()
    )
    why = CARD_MARGIN.text()
    return f"Safety margin held back before fitting: {parts}. {why[:1].upper()}{why[1:]}."
