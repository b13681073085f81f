"""The ``harness`` command: one group, the commands of each step of the data flow."""

from __future__ import annotations

import click

from harness.cli.cards import cards
from harness.cli.common import SpecAwareGroup
from harness.cli.compare import compare_command
from harness.cli.decide import pareto, recommend, report, timeline
from harness.cli.doctor import doctor
from harness.cli.fit import fit
from harness.cli.plan import estimate, plan, validate
from harness.cli.replay import replay
from harness.cli.results import results
from harness.cli.run import sweep, worker
from harness.cli.sweeps import sweeps


@click.group(cls=SpecAwareGroup)
@click.version_option(package_name="harness")
def main() -> None:
    """Measure the memory / speed / accuracy trade-offs of training PyTorch models."""


# In the order of the data flow: look at a spec, run it, read it, decide from it.
for command in (
    validate,
    estimate,
    plan,
    fit,
    cards,
    doctor,
    replay,
    sweep,
    worker,
    results,
    sweeps,
    pareto,
    compare_command,
    recommend,
    report,
    timeline,
):
    main.add_command(command)
