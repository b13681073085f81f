"""``train.repeats``: a trial run N times, its throughput the runs' median, their spread kept.

Why: one run's timed steps show how steady that run was, not how far the next run may land
(another process, another placement, another moment of a shared machine). MLPerf and
optimum-benchmark repeat runs for that; here the repeats' slowest and fastest throughputs are
recorded beside their median (``throughput_min``, ``throughput_max``, ``repeats``), and the
noise rule's interval (``harness.analyse.noise.throughput_interval``) spans them, so two
configurations tie only where their runs overlap.
"""

from __future__ import annotations

import statistics

from harness.trial.result import TrialResult


def repeated(first: TrialResult, others: list[TrialResult]) -> TrialResult:
    """``first`` (the row recorded, its files and figures) with its throughput the median of
    every run that measured one and their range beside it; ``first`` unchanged where fewer
    than two did."""
    speeds = [
        float(run.metrics["throughput"])
        for run in (first, *others)
        if run.metrics.get("throughput") is not None
    ]
    if len(speeds) < 2:
        return first
    first.metrics.update(
        throughput=statistics.median(speeds),
        throughput_min=min(speeds),
        throughput_max=max(speeds),
        repeats=float(len(speeds)),
    )
    return first
