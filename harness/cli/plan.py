"""``harness validate`` and ``harness estimate``: look at a spec before running it."""

from __future__ import annotations

from pathlib import Path

import click

from harness.spec import load_spec, points
from harness.units import format_bytes


@click.command()
@click.argument("specs", nargs=-1, required=True, type=click.Path(dir_okay=False, path_type=Path))
def validate(specs: tuple[Path, ...]) -> None:
    """Check SPEC files without running anything; print the number of trials each plans."""
    for path in specs:
        spec = load_spec(path)
        click.echo(f"{path}: ok ({len(points(spec))} trials, experiment {spec.experiment!r})")


@click.command()
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
    from harness.spec.schema import local_device
    from harness.sweep.estimate import EstimateError, estimate_grid

    spec = load_spec(spec_path)
    target = device if device != "auto" else spec.device.split(":")[0]
    if target == "auto":
        target = local_device()
    try:
        frame = estimate_grid(spec, target)
    except EstimateError as error:
        raise click.ClickException(str(error)) from None
    if fmt == "csv":
        click.echo(frame.to_csv(index=False), nl=False)
    elif fmt == "json":
        click.echo(frame.to_json(orient="records", indent=1))
    else:
        shown = frame.drop(columns=["trial_key"])
        for column in [c for c in shown.columns if c.endswith("_bytes")]:
            shown[column] = shown[column].map(format_bytes)
        click.echo(shown.to_string(index=False))
