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


# Two steady throughputs closer than this (relative to the larger) are not told apart: the
# noise rule accepts timed steps that vary up to MAX_CV as steady, so a difference below that
# spread can come from the steps alone, and a rerun may reverse it.
TIE_MARGIN = MAX_CV


def throughputs_tie(a: Row, b: Row) -> bool:
    """Whether two trials' throughputs cannot be told apart: either is noisy (its figure is a
    moment of a busy machine, not a measurement to rank by), or they differ by less than
    ``TIE_MARGIN`` of the larger. A trial without a throughput ties with nothing."""
    x, y = _number(a, "throughput"), _number(b, "throughput")
    if x is None or y is None:
        return False
    if noise_reason(a) or noise_reason(b):
        return True
    high = max(abs(x), abs(y))
    return high == 0 or abs(x - y) < TIE_MARGIN * high
