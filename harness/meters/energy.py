"""Energy the GPU drew over the timed window: NVML's cumulative energy counter at its refreshes.

Why NVML through ``nvidia-ml-py`` (NVIDIA's own bindings, pure Python over the driver's
``libnvidia-ml``) and not ``zeus``: the figure needs two reads of one counter
(``nvmlDeviceGetTotalEnergyConsumption``: millijoules since the driver loaded, Volta and
newer), which is exactly what zeus does underneath on these GPUs; zeus adds a monitor process
model, its own dependencies and power-limit optimisers this harness does not use.

The driver refreshes the counter periodically, not at every read (NVIDIA does not publish the
period: the first card's read 0 J over a 33 ms window), so reading it around the window would
miss or double a refresh. The meter aligns to refreshes instead: with the device idle it waits
for one refresh and times the next (the period, and the idle power between them), starts the
window at that refresh, and after the window's closing synchronisation waits for the next
refresh; the idle power times the wait after the window is subtracted. The counter counts the
whole GPU, other processes on it included. The ``energy_counter`` tag gives the window, the
refresh period and the idle power subtracted.

Absent, never zero, where there is no counter: a CPU trial, no ``nvidia-ml-py``, no NVML driver,
a GPU older than Volta, a counter that went backwards (the driver reloaded). The reason is the
trial's ``energy_counter`` tag either way.
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass
from typing import Any

import torch

from harness.meters.timing import synchronize

MILLIJOULES_PER_JOULE = 1000.0
REFRESH_WAIT_S = 1.0  # a counter that does not move for this long is not counting
POLL_S = 0.0005  # between reads while waiting for a refresh
STALLED = f"the NVML energy counter did not advance within {REFRESH_WAIT_S:.0f} s"


class _Stalled(Exception):
    """The counter did not refresh in time."""


@dataclass(frozen=True)
class EnergyReading:
    """One rank's energy over the window: ``joules`` None where there is no counter (``why``)."""

    joules: float | None
    seconds: float
    gpu: str  # the GPU's NVML identity (its UUID), so two ranks on one GPU count it once
    why: str = ""
    refresh_s: float = 0.0  # the counter's refresh period, as timed before the window
    idle_w: float = 0.0  # the GPU's idle power, subtracted for the wait after the window

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def window_joules(start_mj: int, end_mj: int) -> float | None:
    """Joules between two reads of the cumulative counter; None when it went backwards (the
    driver reloaded between them: the difference means nothing)."""
    if end_mj < start_mj:
        return None
    return (end_mj - start_mj) / MILLIJOULES_PER_JOULE


def combine(readings: list[dict[str, Any]], samples: float) -> tuple[dict[str, float], str]:
    """Every rank's reading -> ``energy_j`` (the sum over distinct GPUs) and
    ``energy_per_sample_j`` (over the window's ``samples``: the global batch times the steps),
    and the ``energy_counter`` text: what was summed, or why nothing was. One rank without a
    counter makes the figure absent: a sum over some GPUs would read as the whole trial's."""
    missing = [r for r in readings if r["joules"] is None]
    if missing:
        return {}, f"absent: {missing[0]['why']}"
    per_gpu: dict[str, float] = {}
    for reading in readings:
        per_gpu.setdefault(reading["gpu"], reading["joules"])
    joules = sum(per_gpu.values())
    metrics = {"energy_j": joules}
    if samples > 0:
        metrics["energy_per_sample_j"] = joules / samples
    gpus = len(per_gpu)
    seconds = max(r["seconds"] for r in readings)
    refresh = max(r.get("refresh_s", 0.0) for r in readings)
    idle = max(r.get("idle_w", 0.0) for r in readings)
    text = (
        f"NVML total energy of {gpus} GPU{'s' if gpus > 1 else ''} over the "
        f"{seconds * 1000:.0f} ms timed window (the counter refreshed every "
        f"{refresh * 1000:.0f} ms; {idle:.0f} W idle subtracted after the window)"
    )
    return metrics, text


class EnergyMeter:
    """``with EnergyMeter(device) as meter: <timed steps>``; then ``meter.reading``."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.handle: Any = None
        self.gpu = ""
        self.why = ""
        self.start_mj = 0
        self.start_s = 0.0
        self.refresh_s = 0.0
        self.idle_w = 0.0
        self.reading: EnergyReading | None = None
        self._open()

    def _open(self) -> None:
        if self.device.type != "cuda":
            self.why = f"no GPU energy counter on {self.device.type}"
            return
        try:
            import pynvml
        except ImportError:
            self.why = "nvidia-ml-py is not installed (pip install nvidia-ml-py)"
            return
        try:
            pynvml.nvmlInit()
            self.handle, self.gpu = nvml_handle(pynvml, self.device)
            pynvml.nvmlDeviceGetTotalEnergyConsumption(self.handle)  # supported here?
        except pynvml.NVMLError as error:  # no driver, a GPU before Volta, no permission
            self.handle = None
            self.why = f"NVML energy counter unavailable: {error}"

    def _read_mj(self) -> int:
        import pynvml

        return int(pynvml.nvmlDeviceGetTotalEnergyConsumption(self.handle))

    def _next_refresh(self, seen_mj: int) -> tuple[int, float]:
        """The counter's next value after ``seen_mj`` and when it appeared (polled)."""
        deadline = time.perf_counter() + REFRESH_WAIT_S
        while time.perf_counter() < deadline:
            value = self._read_mj()
            if value != seen_mj:
                return value, time.perf_counter()
            time.sleep(POLL_S)
        raise _Stalled

    def __enter__(self) -> EnergyMeter:
        if self.handle is not None:
            synchronize(self.device)  # earlier queued work is not the window's
            try:
                first_mj, first_s = self._next_refresh(self._read_mj())
                self.start_mj, self.start_s = self._next_refresh(first_mj)
            except _Stalled:
                self.handle, self.why = None, STALLED
            else:
                self.refresh_s = self.start_s - first_s
                self.idle_w = (self.start_mj - first_mj) / MILLIJOULES_PER_JOULE / self.refresh_s
        self.start_s = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is not None:
            return
        joules = None
        if self.handle is not None:
            synchronize(self.device)
        end_s = time.perf_counter()
        if self.handle is not None:
            try:
                end_mj, refreshed_s = self._next_refresh(self._read_mj())
            except _Stalled:
                self.why = STALLED
            else:
                joules = window_joules(self.start_mj, end_mj)
                if joules is None:
                    self.why = "the NVML energy counter went backwards (driver reloaded)"
                else:
                    joules -= self.idle_w * (refreshed_s - end_s)
                    if joules <= 0:
                        joules, self.why = (
                            None,
                            (
                                f"the {(end_s - self.start_s) * 1000:.0f} ms window was too short for "
                                f"the counter (refreshed every {self.refresh_s * 1000:.0f} ms)"
                            ),
                        )
        self.reading = EnergyReading(
            joules, end_s - self.start_s, self.gpu or str(self.device), self.why,
            self.refresh_s, self.idle_w,
        )  # fmt: skip


def nvml_handle(pynvml: Any, device: torch.device) -> tuple[Any, str]:
    """The NVML handle of a torch CUDA device, found by UUID (torch numbers the devices it sees
    after ``CUDA_VISIBLE_DEVICES``, NVML numbers all of them), else by the index that
    ``CUDA_VISIBLE_DEVICES`` maps it to."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    uuid = str(getattr(torch.cuda.get_device_properties(index), "uuid", "") or "")
    if uuid:
        nvml_uuid = uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"
        try:
            return pynvml.nvmlDeviceGetHandleByUUID(nvml_uuid), nvml_uuid
        except pynvml.NVMLError:
            pass
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")]
    if index < len(visible) and visible[index].isdigit():
        index = int(visible[index])
    return pynvml.nvmlDeviceGetHandleByIndex(index), f"nvml:{index}"
