"""Step latency of N back-to-back steps between two device synchronisations; medians, not means.

Synchronising before and after every step would hide what a fast GPU overlaps: the host
launching step i+1 while the device still runs step i. So the timed steps run exactly as a
training loop runs them, and the device is synchronised only before the first and after the
last. Per-step times come from marks between steps:

- CUDA: a ``torch.cuda.Event(enable_timing=True)`` recorded on the device's current stream
  before the first step and after each step; ``elapsed_time`` of consecutive events is the
  device-side time from one step boundary to the next (launch gaps included: an event completes
  only once the device has reached it, so a starved device shows up as a longer step).
- CPU: ``time.perf_counter()`` between steps (CPU ops run synchronously, nothing to wait for).

A step must not synchronise for the measurement's sake (no ``.item()`` in it): read losses
after the window.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from itertools import pairwise
from typing import Any, TypeVar

import torch

R = TypeVar("R")

CUDA_EVENTS = "cuda_events"
PERF_COUNTER = "perf_counter"


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _HostClock:
    """Host wall-clock marks: exact where the device runs synchronously (CPU)."""

    name = PERF_COUNTER

    def __init__(self) -> None:
        self.times: list[float] = []

    def mark(self) -> None:
        self.times.append(time.perf_counter())

    def intervals_ms(self) -> list[float]:
        return [(later - earlier) * 1000 for earlier, later in pairwise(self.times)]


class _CudaEventClock:
    """CUDA events on the current stream: marks that cost the host no synchronisation."""

    name = CUDA_EVENTS

    def __init__(self, device: torch.device, marks: int) -> None:
        self.stream = torch.cuda.current_stream(device)
        # Created before timing starts, so the timed loop only records them.
        self.events = [torch.cuda.Event(enable_timing=True) for _ in range(marks)]
        self.recorded = 0

    def mark(self) -> None:
        self.events[self.recorded].record(self.stream)
        self.recorded += 1

    def intervals_ms(self) -> list[float]:
        """Call after synchronising: ``elapsed_time`` needs both events completed."""
        done = self.events[: self.recorded]
        return [earlier.elapsed_time(later) for earlier, later in pairwise(done)]


def percentile(values: Sequence[float], q: int) -> float:
    """The q-th percentile (1-99), interpolated inclusively; the value itself for one value."""
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(sorted(values), n=100, method="inclusive")[q - 1]


def coefficient_of_variation(values: Sequence[float]) -> float:
    """Sample standard deviation / mean: how steady the steps were (0 for a single step)."""
    if len(values) < 2:
        return 0.0
    return statistics.stdev(values) / statistics.mean(values)


class StepTimer:
    """Times steps run back to back, the device synchronised only around the whole run."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.clock = CUDA_EVENTS if device.type == "cuda" else PERF_COUNTER
        self.step_ms: list[float] = []

    def run(self, step: Callable[[Any], R], inputs: Sequence[Any]) -> list[R]:
        """``step(x)`` for each of ``inputs`` in turn; their outputs. Fills ``step_ms``."""
        clock: _CudaEventClock | _HostClock = (
            _CudaEventClock(self.device, len(inputs) + 1)
            if self.clock == CUDA_EVENTS
            else _HostClock()
        )
        outputs = []
        synchronize(self.device)  # nothing queued before the first step is timed with it
        clock.mark()
        for x in inputs:
            outputs.append(step(x))
            clock.mark()
        synchronize(self.device)  # the one wait: every event has completed after it
        self.step_ms = clock.intervals_ms()
        return outputs

    def metrics(self, samples_per_step: int) -> dict[str, float]:
        """Throughput (samples per median step) and the latency figures of the timed steps."""
        times = self.step_ms
        median_ms = statistics.median(times)
        return {
            "throughput": samples_per_step / (median_ms / 1000),
            "step_time_ms_p50": median_ms,
            "step_time_ms_p90": percentile(times, 90),
            "step_time_ms_p99": percentile(times, 99),
            "step_time_cv": coefficient_of_variation(times),
        }

    def artifact(self) -> dict[str, Any]:
        """The raw per-step times and how they were taken (``step_times.json``)."""
        return {"step_time_ms": list(self.step_ms), "device": str(self.device), "clock": self.clock}
