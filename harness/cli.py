"""The ``harness`` command line: validate, estimate, sweep, results (and, from analysis_cli,
pareto, recommend, report)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import click
from rich.console import Console
from rich.table import Table

from harness.spec import SpecError, load_spec
from harness.units import format_bytes

FORMATS = ("table", "csv", "parquet", "json")
SUMMARY_COLUMNS = ("model_size", "batch_size", "dtype", "strategy")


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


@click.group(cls=SpecAwareGroup)
@click.version_option(package_name="harness")
def main() -> None:
    """Measure the memory / speed / accuracy trade-offs of training PyTorch models."""


@main.command()
@click.argument("specs", nargs=-1, required=True, type=click.Path(dir_okay=False, path_type=Path))
def validate(specs: tuple[Path, ...]) -> None:
    """Check SPEC files without running anything; print the number of trials each plans."""
    for path in specs:
        spec = load_spec(path)
        click.echo(f"{path}: ok ({len(spec.points())} trials, experiment {spec.experiment!r})")


@main.command()
@click.argument("spec_path", metavar="SPEC", type=click.Path(dir_okay=False, path_type=Path))
@click.option(
    "--fresh",
    is_flag=True,
    help="Start a new sweep even if this spec already ran (earlier runs stay in MLflow).",
)
@click.option("--dry-run", is_flag=True, help="List the planned trials and exit.")
@click.option(
    "--n-trials",
    type=click.IntRange(min=1),
    default=None,
    help="search.method optuna only: run this many trials more than are recorded already.",
)
@click.option(
    "--workers",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Run N trials at once in N worker processes sharing the study (one per GPU on a "
    "multi-GPU host; on a CPU they distort throughput).",
)
def sweep(spec_path: Path, fresh: bool, dry_run: bool, n_trials: int | None, workers: int) -> None:
    """Run the trials of SPEC (each in its own process) and record them in MLflow.

    Grid: every point. Optuna: search.n_trials points chosen by the sampler. Running the same
    SPEC again resumes: recorded trials are kept and never re-run.
    """
    spec = load_spec(spec_path)
    if n_trials is not None and spec.search.method != "optuna":
        raise SpecError(
            f"{spec_path}: --n-trials needs search.method: optuna (this spec is a grid that "
            "runs all its points)"
        )
    if n_trials is not None and workers > 1:
        raise SpecError(
            f"{spec_path}: --n-trials and --workers: add the extra trials in one worker"
        )
    console = make_console()
    if dry_run:
        if spec.search.method == "optuna":
            console.print(
                f"search space: Optuna's {spec.search.sampler} sampler picks "
                f"{spec.search.n_trials} of these {len(spec.points())} points"
            )
        for index, point in enumerate(spec.points(), start=1):
            config = spec.trial_config(point)
            console.print(f"{index:>4}  {config.trial_key}  {point}")
        return
    from harness.sweep import run_sweep

    try:
        outcome = run_sweep(spec, console, fresh=fresh, more_trials=n_trials, workers=workers)
    except KeyboardInterrupt:
        console.print(
            "\nInterrupted. Finished trials are recorded; run the same command to resume."
        )
        sys.exit(130)
    print_summary(console, spec.experiment, spec.tracking.mlflow_uri, outcome.parent_run_id)


@main.command()
@click.argument("spec_path", metavar="SPEC", type=click.Path(dir_okay=False, path_type=Path))
@click.option(
    "--storage",
    default=None,
    help="Optuna storage shared by all workers (postgresql://..., journal:PATH); "
    "default: the spec's tracking.storage.",
)
@click.option(
    "--tracking-uri",
    default=None,
    help="MLflow tracking URI shared by all workers (e.g. http://host:5000); "
    "default: the spec's tracking.mlflow_uri.",
)
def worker(spec_path: Path, storage: str | None, tracking_uri: str | None) -> None:
    """Join SPEC's sweep from this process (any host) and run trials until none is left.

    Start one per GPU host (e.g. from a SLURM array) against the same PostgreSQL storage and
    MLflow tracking server; every grid point runs exactly once, on whichever worker claims it.
    """
    from harness.sweep import prepare, with_tracking, work

    spec = with_tracking(load_spec(spec_path), storage=storage, mlflow_uri=tracking_uri)
    console = make_console()
    try:
        state = prepare(spec, worker=True)
        work(state, console, shuffle=True)
    except KeyboardInterrupt:
        console.print(
            "\nInterrupted. Finished trials are recorded; start the worker again to go on."
        )
        sys.exit(130)


def print_summary(console: Console, experiment: str, tracking_uri: str, parent_run_id: str) -> None:
    from harness.results import load

    frame = load(experiment, tracking_uri, sweep=parent_run_id)
    counts = frame["status"].value_counts().to_dict()
    console.print(
        f"\n[bold]{len(frame)} trials[/]: "
        + ", ".join(f"{n} {status}" for status, n in sorted(counts.items()))
    )
    ok = frame[frame["status"] == "ok"]
    if not ok.empty:
        table = Table(title="Best configurations (ok trials)")
        unit = ok["throughput_unit"].dropna().iloc[0] if ok["throughput_unit"].notna().any() else ""
        for column in (
            "best for",
            "size",
            "batch",
            "dtype",
            "strategy",
            "peak alloc",
            unit or "throughput",
            "acc",
        ):
            table.add_column(column, no_wrap=True)
        picks = [
            ("least memory", ok.nsmallest(2, "peak_allocated_bytes")),
            ("most throughput", ok.nlargest(2, "throughput")),
            ("best accuracy", ok.nlargest(2, "accuracy")),
        ]
        for label, rows in picks:
            for _, row in rows.iterrows():
                table.add_row(
                    label,
                    *(str(row[c]) for c in SUMMARY_COLUMNS),
                    format_bytes(row["peak_allocated_bytes"]),
                    f"{row['throughput']:,.0f}",
                    f"{row['accuracy']:.3f}",
                )
                label = ""
        console.print(table)
    console.print(
        "Next: [bold]make ui[/] (MLflow UI on http://127.0.0.1:5000), "
        f"[bold]harness results --experiment {experiment}[/] (the table), "
        "or harness.results.load() in Python.",
        soft_wrap=True,
    )


ESTIMATE_COLUMNS = [
    "model_size",
    "batch_size",
    "dtype",
    "strategy",
    "predicted_peak_bytes",
    "predicted_mem_param_bytes",
    "predicted_mem_grad_bytes",
    "predicted_mem_optim_bytes",
    "predicted_mem_activation_bytes",
    "predicted_mem_other_bytes",
    "predicted_model_state_bytes",
    "closed_form_model_state_bytes",
    "korthikanti_activation_bytes",
    "num_params",
    "fits",
    "device",
    "trial_key",
    "estimate_seconds",
    "unpredictable",
    "note",
]


@main.command()
@click.argument("spec_path", metavar="SPEC", type=click.Path(dir_okay=False, path_type=Path))
@click.option(
    "--format",
    "fmt",
    type=click.Choice(("table", "csv", "json")),
    default="table",
    show_default=True,
)
@click.option(
    "--device",
    type=click.Choice(("auto", "cpu", "cuda")),
    default="auto",
    show_default=True,
    help="Device to predict for; auto: the spec's device (auto there means CUDA if present here). "
    "CUDA is predicted from any machine, with the allocator's 512-byte rounding.",
)
def estimate(spec_path: Path, fmt: str, device: str) -> None:
    """Predict every grid point's peak memory and breakdown without running (fake tensors)."""
    import json
    import subprocess
    import tempfile

    import pandas as pd

    from harness.spec import local_device

    spec = load_spec(spec_path)
    target = device if device != "auto" else spec.device.split(":")[0]
    if target == "auto":
        target = local_device()
    configs = [spec.trial_config(point) for point in spec.points()]
    with tempfile.TemporaryDirectory() as folder:
        request, answer = Path(folder) / "in.json", Path(folder) / "out.json"
        request.write_text(
            json.dumps({"device": target, "configs": [c.to_dict() for c in configs]})
        )
        click.echo(f"estimating {len(configs)} trials for {target} ...", err=True)
        done = subprocess.run(  # its progress lines go to our stderr, its errors are kept
            [sys.executable, "-m", "harness.trial.estimate", str(request), str(answer)],
            stdout=sys.stderr,
            stderr=subprocess.PIPE,
            text=True,
        )
        if done.returncode != 0:
            last = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else "no output"
            raise click.ClickException(f"the estimator failed: {last}")
        frame = pd.DataFrame(json.loads(answer.read_text()))
    frame["model_size"] = [c.model_size for c in configs]
    frame["batch_size"] = [c.batch_size for c in configs]
    frame["dtype"] = [c.dtype for c in configs]
    frame["strategy"] = [c.strategy_text for c in configs]
    frame["device"] = target
    if spec.device_memory and "predicted_peak_bytes" in frame:
        predicted = frame["predicted_peak_bytes"]
        frame["fits"] = (predicted <= spec.device_memory).astype("boolean").where(predicted.notna())
    frame = frame.reindex(columns=[c for c in ESTIMATE_COLUMNS if c in frame.columns])
    if fmt == "csv":
        click.echo(frame.to_csv(index=False), nl=False)
    elif fmt == "json":
        click.echo(frame.to_json(orient="records", indent=1))
    else:
        shown = frame.drop(columns=["trial_key"])
        for column in [c for c in shown.columns if c.endswith("_bytes")]:
            shown[column] = shown[column].map(format_bytes)
        click.echo(shown.to_string(index=False))


@main.command()
@click.option(
    "--experiment", "-e", default=None, help="Experiment (spec name); default: the one run last."
)
@click.option(
    "--sweep",
    "sweep_id",
    default="latest",
    show_default=True,
    help="'latest', 'all', or a sweep's parent run id.",
)
@click.option("--format", "fmt", type=click.Choice(FORMATS), default="table", show_default=True)
@click.option(
    "--out",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Write to this file instead of stdout (required for parquet).",
)
@click.option("--tracking-uri", default="sqlite:///results/mlflow.db", show_default=True)
def results(
    experiment: str | None, sweep_id: str, fmt: str, out: Path | None, tracking_uri: str
) -> None:
    """One row per trial: configuration, status and every metric, as a table or a file."""
    from harness.results import ResultsError, load

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
        text = shown.drop(
            columns=["run_id", "sweep_run_id", "start_time"], errors="ignore"
        ).to_string(index=False)
    if fmt != "parquet":
        if out is None:
            click.echo(text)
        else:
            out.write_text(text)
    if out is not None:
        click.echo(f"wrote {len(frame)} trials to {out}", err=True)


def _register_analysis_commands() -> None:
    from harness.analysis_cli import pareto, recommend, report, timeline

    for command in (pareto, recommend, report, timeline):
        main.add_command(command)


_register_analysis_commands()
