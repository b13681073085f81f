"""``python -m benchmarks [--only NAME ...] [--out DIR]``: run the benchmarks, print a table and
write ``DIR/summary.json`` (default ``results/bench``). Exit 1 only when a benchmark errored."""

from __future__ import annotations

import json
import platform
import time
from pathlib import Path

import click
import torch
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from benchmarks import allocator, depth, estimator, fit, overhead, scale, search, step_time
from benchmarks.figures import Figure
from benchmarks.published import bench as published
from benchmarks.published import speed as published_speed

SUITES = {
    "overhead": overhead.run,
    "scale": scale.run,
    "search": search.run,
    "estimator": estimator.run,
    "allocator": allocator.run,
    "fit": fit.run,
    "depth": depth.run,
    "step_time": step_time.run,
    "published": published.run,
    "published_speed": published_speed.run,
}


def table(figures: list[Figure]) -> Table:
    out = Table(title="harness benchmarks")
    for column in ("figure", "value", "unit", "target", "met"):
        out.add_column(column)
    for figure in figures:
        value = "-" if figure.value is None else f"{figure.value:,.4g}"
        met = {True: "[green]yes[/]", False: "[red]NO[/]", None: "-"}[figure.met]
        out.add_row(escape(figure.name), value, figure.unit, figure.target, met)
    return out


@click.command()
@click.option("--only", multiple=True, type=click.Choice(sorted(SUITES)), help="Run only these.")
@click.option("--out", default="results/bench", show_default=True, type=click.Path(path_type=Path))
def main(only: tuple[str, ...], out: Path) -> None:
    console = Console(width=140 if not Console().is_terminal else None)
    figures: list[Figure] = []
    errors: dict[str, str] = {}
    started = time.perf_counter()
    for name in only or SUITES:
        try:
            figures += SUITES[name](lambda line: console.print(line, soft_wrap=True, markup=False))
        except Exception as error:  # report it with the rest; the exit status says it failed
            errors[name] = f"{type(error).__name__}: {error}"
            console.print(f"[red]benchmark {name} failed:[/] {errors[name]}")
    console.print(table(figures))
    out.mkdir(parents=True, exist_ok=True)
    summary = {
        "machine": {
            "platform": platform.platform(),
            "cpus": torch.get_num_threads(),
            "torch": torch.__version__,
            "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        },
        "seconds": time.perf_counter() - started,
        "figures": [f.to_dict() for f in figures],
        "errors": errors,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    console.print(f"wrote {out / 'summary.json'} ({summary['seconds']:.0f} s)")
    raise SystemExit(1 if errors else 0)


if __name__ == "__main__":
    main()
