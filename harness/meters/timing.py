"""Step latency with the device synchronised before each clock read; medians, not means."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class StepTimer:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.seconds: list[float] = []

    def time(self, step: Callable[[], object]) -> object:
        synchronize(self.device)
        start = time.perf_counter()
        out = step()
        synchronize(self.device)
        self.seconds.append(time.perf_counter() - start)
        return out

    def percentile_ms(self, q: float) -> float:
        ordered = sorted(self.seconds)
        if len(ordered) == 1:
            return ordered[0] * 1000
        return statistics.quantiles(ordered, n=100, method="inclusive")[int(q) - 1] * 1000

    def metrics(self, samples_per_step: int) -> dict[str, float]:
        median_s = statistics.median(self.seconds)
        return {
            "throughput": samples_per_step / median_s,
            "step_time_ms_p50": median_s * 1000,
            "step_time_ms_p90": self.percentile_ms(90),
        }
