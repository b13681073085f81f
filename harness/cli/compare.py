"""``harness compare A B [C...]``: recorded sweeps side by side (``harness.analyse.compare``).

Each argument names one sweep (``harness.record.results.select_sweep``: ``EXPERIMENT``,
``EXPERIMENT@RUN_ID`` or ``EXPERIMENT@DEVICE``); nothing runs. The first is the baseline of
every ratio.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import click
import pandas as pd

from harness.analyse.compare import CONFIG, SWEEP, Comparison, compare
from harness.analyse.noise import noise_reason
from harness.analyse.pareto import unusable
from harness.cli.common import (
    OneLineError,
    make_console,
    open_selected,
    show,
    tracking_uri_option,
)
from harness.cli.decide import budget_option, objectives_for
from harness.contract import DEFAULT_RESULTS_DIR
from harness.units import format_bytes


def sweep_rows(comparison: Comparison, sweeps: dict[str, Any]) -> pd.DataFrame:
    """One row per sweep: what it is (experiment, parent run, device) and its front."""
    groups = comparison.analysis.groups.set_index("group").to_dict(orient="index")
    rows = []
    for label, sweep in sweeps.items():
        devices = sweep.frame["device_name"].dropna().astype(str).unique()
        front = groups.get(label, {})
        rows.append(
            {
                "sweep": label,
                "experiment": sweep.experiment,
                "sweep_run_id": sweep.parent_run_id,
                "device_name": ", ".join(sorted(devices)),
                "trials": int(front.get("trials", 0)),
                "feasible": int(front.get("feasible", 0)),
                "front_size": int(front.get("front_size", 0)),
                "hypervolume": float(front.get("hypervolume", 0.0)),
            }
        )
    return pd.DataFrame(rows)


def as_json(comparison: Comparison, sweeps: pd.DataFrame) -> dict[str, Any]:
    def records(frame: pd.DataFrame) -> list[dict[str, Any]]:
        return json.loads(frame.to_json(orient="records"))

    return {
        "objectives": [str(o) for o in comparison.objectives],
        "baseline": comparison.labels[0],
        "reference": comparison.analysis.reference,
        "sweeps": records(sweeps),
        "dominance": {
            str(a): {str(b): float(share) for b, share in row.items()}
            for a, row in comparison.analysis.dominance.to_dict(orient="index").items()
        },
        "ratios": records(comparison.ratios()),
        "matched": records(comparison.matched),
        "missing": records(comparison.missing),
    }


def write_plots(comparison: Comparison, folder: Path) -> list[Path]:
    from harness.analyse import plots

    folder.mkdir(parents=True, exist_ok=True)
    title = "Pareto fronts by sweep: " + " vs ".join(comparison.labels)
    png = plots.pareto_png(comparison.frame, comparison.analysis, folder / "compare.png", title)
    page = folder / "compare.html"
    figure = plots.pareto_figure(comparison.frame, comparison.analysis, title)
    figure.write_html(page, include_plotlyjs=True)
    return [png, page]


@click.command(name="compare")
@click.argument("selectors", nargs=-1, required=True)
@click.option(
    "--objectives",
    default=None,
    help="e.g. 'peak_allocated_bytes:min,throughput:max'; default: the first sweep's own.",
)
@click.option(
    "--budget", default=None, help="Memory budget for the fronts, e.g. 40GiB; default none."
)
@click.option("--format", "fmt", type=click.Choice(["table", "csv", "json"]), default="table",
              show_default=True, help="csv: the matched configurations; json: everything.")  # fmt: skip
@click.option("--out-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Where compare.png and compare.html go; default results/compare/.")  # fmt: skip
@click.option("--no-plots", is_flag=True, help="Write no plots.")
@tracking_uri_option
def compare_command(
    selectors: tuple[str, ...],
    objectives: str | None,
    budget: str | None,
    fmt: str,
    out_dir: Path | None,
    no_plots: bool,
    tracking_uri: str,
) -> None:
    """Recorded sweeps side by side: their Pareto fronts on one scale (hypervolume, dominance),
    each matched configuration's objectives as ratios to the first sweep, the configurations one
    sweep lacks; one plot of all the fronts (PNG and HTML). Name a sweep as EXPERIMENT (its
    latest), EXPERIMENT@RUN_ID or EXPERIMENT@DEVICE (its latest sweep on that device)."""
    if len(selectors) < 2:
        raise OneLineError("compare needs two sweeps or more, e.g. gpt@a100 gpt@h100")
    if len(set(selectors)) < len(selectors):
        raise OneLineError("each sweep once: " + " ".join(selectors))
    sweeps = {selector: open_selected(selector, tracking_uri) for selector in selectors}
    first = next(iter(sweeps.values()))
    chosen = objectives_for(first, objectives)
    for label, sweep in sweeps.items():
        reason = unusable(sweep.frame, chosen)
        if reason is not None:
            raise click.ClickException(f"{label}: {reason}; nothing to compare")
    limit = budget_option(budget) if budget else None
    try:
        comparison = compare({k: s.frame for k, s in sweeps.items()}, chosen, limit)
    except ValueError as error:
        raise click.ClickException(str(error)) from None
    rows = sweep_rows(comparison, sweeps)
    paths = (
        []
        if no_plots
        else write_plots(comparison, out_dir or Path(DEFAULT_RESULTS_DIR) / "compare")
    )
    if fmt == "json":
        click.echo(json.dumps(as_json(comparison, rows), indent=1))
    elif fmt == "csv":
        comparison.matched.to_csv(sys.stdout, index=False)
    else:
        print_table(comparison, rows, limit)
    if paths:
        click.echo("wrote " + ", ".join(str(p) for p in paths), err=fmt != "table")


def print_table(comparison: Comparison, rows: pd.DataFrame, limit: float | None) -> None:
    console = make_console()
    where = f"within {format_bytes(limit)}" if limit else "no memory budget"
    console.print(
        f"Comparing {len(comparison.labels)} sweeps ({where}); objectives "
        f"{', '.join(map(str, comparison.objectives))}; ratios to {comparison.labels[0]}",
        soft_wrap=True,
    )
    show(rows, "Sweeps: fronts on one scale", console)
    console.print(
        "Hypervolume: normalised per objective over the feasible trials of all the sweeps "
        "together (0 best, 1 worst), one reference point (1.1 in each) for every sweep.",
        soft_wrap=True,
    )
    for line in comparison.dominance_lines() + comparison.ratio_lines():
        console.print(line, soft_wrap=True, highlight=False, markup=False)
    noisy = int(sum(noise_reason(row) is not None for _, row in comparison.frame.iterrows()))
    if noisy and any(o.metric == "throughput" for o in comparison.objectives):
        console.print(
            f"~ {noisy} of the {len(comparison.frame)} throughputs were measured on a busy "
            "machine or with unsteady steps: their ratios are not the hardware's "
            "(docs/measuring.md#stable-cpu-timings)",
            soft_wrap=True,
            highlight=False,
            markup=False,
        )
    keys = [c for c in CONFIG if c in comparison.matched]
    ratio_columns = [c for c in comparison.matched.columns if "/" in c]
    if not comparison.matched.empty:
        show(comparison.matched, "Matched configurations: ratios", console, keys + ratio_columns)
    if not comparison.missing.empty:
        show(comparison.missing, f"Not in every {SWEEP} (status, or absent)", console)
