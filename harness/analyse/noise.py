"""Whether a trial's speed figures can be compared: steady steps, nothing competing.

Why: on a shared or small machine the same loop runs at 421 and at 32,079 samples/s in
consecutive processes (2 OpenMP threads on 2 busy cores: each parallel region waits for a
descheduled thread). A throughput measured like that is a number, not a measurement; every
table, summary and report marks it with the reason from here, so nobody compares it.

The rule reads a trial's recorded metrics (a results-table row or a ``TrialResult``'s
metrics): the spread of its timed steps (``step_time_cv``, ``step_time_ms_p90`` /
``step_time_ms_p50``) and, on CPU, what competed for the cores during the timed window
(``timing_other_busy_cores``, ``timing_steal_fraction``, ``timing_free_cores`` against the
trial's ``torch_threads``; the thread rule only where the row's ``device`` is a CPU or
unknown). Measured by ``harness.meters.contention``.
"""

from __future__ import annotations

import math
from typing import Any, Protocol

MAX_CV = 0.10  # timed steps' stdev / mean above this: too unsteady to compare
MAX_P90_OVER_P50 = 1.25
MAX_STEAL = 0.05  # share of CPU time the hypervisor took from this VM during timing
NOISY_MARK = "~"  # put after a throughput figure that is flagged


class Row(Protocol):
    """A trial's recorded figures by name, None where absent: a mapping (a ``TrialResult``'s
    metrics) or a results-table row (a pandas Series), both read with ``get`` only."""

    def get(self, key: str, /) -> Any: ...


def _number(row: Row, key: str) -> float | None:
    value = row.get(key)
    if value is None:
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def noise_reason(row: Row) -> str | None:
    """Why this trial's throughput is too noisy to compare (one short phrase), or None."""
    reasons = []
    cv = _number(row, "step_time_cv")
    if cv is not None and cv > MAX_CV:
        reasons.append(f"step times vary {cv:.0%} (CV)")
    p50, p90 = _number(row, "step_time_ms_p50"), _number(row, "step_time_ms_p90")
    if p50 and p90 and p90 / p50 > MAX_P90_OVER_P50 and not reasons:
        reasons.append(f"p90 step {p90 / p50:.2f}x the median")
    steal = _number(row, "timing_steal_fraction")
    if steal is not None and steal > MAX_STEAL:
        reasons.append(f"{steal:.0%} CPU steal")
    # The thread rule is for CPU trials: a GPU's throughput does not wait for torch's CPU
    # threads (the figures are recorded there too). A row without a device is judged as CPU.
    device = row.get("device")
    on_cpu = not isinstance(device, str) or not device or device.startswith("cpu")
    free, threads = _number(row, "timing_free_cores"), _number(row, "torch_threads")
    if on_cpu and free is not None and threads is not None and threads > free + 0.5:
        reasons.append(f"{threads:.0f} threads on {max(free, 0):.1f} free cores")
    return "; ".join(reasons) or None


# The least spread a throughput is given: two runs of one steady loop differ by a few percent
# more than the timed steps of one run vary (the process's placement, its allocator's
# state), so a figure is never taken as finer than +-5 %: two steady throughputs less than
# about 10 % apart tie, as the noise rule calls steps varying up to MAX_CV steady.
SPREAD_FLOOR = MAX_CV / 2
TIE_MARGIN = MAX_CV  # the gap (relative to the larger) under which two steady figures tie


def throughput_interval(row: Row) -> tuple[float, float] | None:
    """Where a trial's throughput could lie, from what was measured of it: the timed steps'
    spread (``step_time_cv``, ``step_time_ms_p90`` over ``_p50``; at least ``SPREAD_FLOOR``)
    either side, widened to the slowest and fastest of its runs where ``train.repeats`` ran
    it more than once, and above that what competition for the CPU can explain: more torch threads
    than free cores slow a parallel region by up to threads / free cores (at least one core is
    the trial's own), CPU steal by 1 / (1 - steal). Bounded on purpose: a flagged trial is
    still a measurement, and a figure 10x below another is no tie because the machine was
    busy. None without a throughput."""
    throughput = _number(row, "throughput")
    if throughput is None:
        return None
    spread = SPREAD_FLOOR
    cv = _number(row, "step_time_cv")
    if cv is not None:
        spread = max(spread, cv)
    p50, p90 = _number(row, "step_time_ms_p50"), _number(row, "step_time_ms_p90")
    if p50 and p90:
        spread = max(spread, p90 / p50 - 1)
    slowed = 1.0
    device = row.get("device")
    on_cpu = not isinstance(device, str) or not device or device.startswith("cpu")
    free, threads = _number(row, "timing_free_cores"), _number(row, "torch_threads")
    if on_cpu and free is not None and threads is not None and threads > free + 0.5:
        slowed = threads / max(free, 1.0)
    steal = _number(row, "timing_steal_fraction")
    if steal is not None and steal > MAX_STEAL:
        slowed /= 1 - min(steal, 0.5)
    low, high = throughput / (1 + spread), throughput * (1 + spread) * max(slowed, 1.0)
    # train.repeats: where the runs themselves landed (harness.sweep.repeats)
    slowest, fastest = _number(row, "throughput_min"), _number(row, "throughput_max")
    return min(low, slowest or low), max(high, fastest or high)


def throughputs_tie(a: Row, b: Row) -> bool:
    """Whether two trials' throughputs cannot be told apart: their intervals
    (``throughput_interval``) overlap. A noisy trial's interval is wider, not endless: it ties
    with what its own spread and the competition it met can explain, not with everything. A
    trial without a throughput ties with nothing."""
    x, y = throughput_interval(a), throughput_interval(b)
    if x is None or y is None:
        return False
    return x[0] <= y[1] and y[0] <= x[1]
