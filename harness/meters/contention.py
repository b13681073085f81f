"""What competed for the CPUs while a trial timed its steps (Linux ``/proc``; less elsewhere).

On a small or shared machine the timed window is not the trial's alone: on a 2-core machine the
same tiny-CNN loop ran at 421 and at 32,079 samples/s in consecutive processes while another
job held a core (with 2 OpenMP threads on 2 busy cores, every parallel region waits for a
descheduled thread). A throughput is only worth comparing with what ran beside it, so the
window is bracketed by two readings of

- ``/proc/stat``: the CPU time of the cores this process may run on (``sched_getaffinity``;
  their ``cpuN`` lines, else the aggregate ``cpu`` line): user, nice, system, idle, iowait,
  irq, softirq, steal (guest time is already inside user and nice);
- this process's own CPU time (``time.process_time()``: every thread, children excluded);
- the load average (``os.getloadavg()``, ``/proc/loadavg`` on Linux), at the end.

From the deltas over the window's wall time:

- ``timing_other_busy_cores``: (the cores' busy CPU-seconds, steal included, − this process's
  CPU-seconds) / wall seconds: how many cores the rest of the machine kept busy on average
  (other processes, the other ranks of a multi-rank trial, and as steal other virtual
  machines on the same host);
- ``timing_steal_fraction``: steal / all CPU time of those cores;
- ``timing_free_cores``: the cores this process may use − ``timing_other_busy_cores``;
- ``timing_load_avg``: the 1-minute load average at the end (this process's threads included).

``/proc/stat`` counts in clock ticks (10 ms), so over a window of a few tens of milliseconds
the busy-core figures carry an error of a few tenths of a core; they are averages over the
window, not a trace. Where ``/proc/stat`` is missing (macOS, Windows) only the load average is
recorded, where the platform has one. Standard library only.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from types import TracebackType

PROC_STAT = "/proc/stat"
# /proc/stat's cpu columns, in order; guest and guest_nice (after steal) are already counted in
# user and nice, so they are left out.
COLUMNS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")
IDLE = ("idle", "iowait")


@dataclass(frozen=True)
class CpuTimes:
    """CPU-seconds since boot of ``count`` cores, per column of ``/proc/stat``."""

    seconds: dict[str, float]
    count: int

    @property
    def total(self) -> float:
        return sum(self.seconds.values())

    @property
    def busy(self) -> float:
        return self.total - sum(self.seconds[name] for name in IDLE)

    def since(self, earlier: CpuTimes) -> CpuTimes:
        return CpuTimes({k: v - earlier.seconds[k] for k, v in self.seconds.items()}, self.count)


def usable_cores() -> list[int] | None:
    """The cores this process may run on (``taskset``, cgroup cpusets), or None if unknown."""
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return None


def read_cpu_times(cores: list[int] | None) -> CpuTimes | None:
    """The CPU times of ``cores`` (all cores when None, or when any has no line), or None
    where there is no ``/proc/stat``."""
    try:
        with open(PROC_STAT) as file:
            lines = [line.split() for line in file if line.startswith("cpu")]
        ticks = os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, AttributeError):
        return None
    rows = {fields[0]: fields[1:] for fields in lines if fields}
    wanted = [f"cpu{core}" for core in cores] if cores else []
    names = wanted if wanted and all(name in rows for name in wanted) else ["cpu"]
    if any(name not in rows for name in names):
        return None
    seconds: dict[str, float] = dict.fromkeys(COLUMNS, 0.0)
    try:
        for name in names:
            # Older kernels have fewer columns: the missing ones count as zero.
            for column, value in zip(COLUMNS, rows[name], strict=False):
                seconds[column] += int(value) / ticks
    except ValueError:
        return None
    count = len(names) if names != ["cpu"] else os.cpu_count() or 1
    return CpuTimes(seconds, count)


def load_average() -> float | None:
    """The 1-minute load average, or None where the platform has none."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


@dataclass(frozen=True)
class _Reading:
    wall_s: float
    own_cpu_s: float
    cores: CpuTimes | None


def _read(cores: list[int] | None) -> _Reading:
    return _Reading(time.perf_counter(), time.process_time(), read_cpu_times(cores))


class ContentionMeter:
    """``with ContentionMeter() as meter:`` around a timed window; then ``meter.metrics()``:
    what else ran on this process's cores meanwhile (empty where nothing can be read)."""

    def __init__(self) -> None:
        self.cores = usable_cores()
        self.start: _Reading | None = None
        self.end: _Reading | None = None
        self.load_avg: float | None = None

    def __enter__(self) -> ContentionMeter:
        self.start = _read(self.cores)
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.end = _read(self.cores)
        self.load_avg = load_average()

    def metrics(self) -> dict[str, float]:
        """``timing_other_busy_cores``, ``timing_steal_fraction``, ``timing_free_cores``,
        ``timing_load_avg``: those that could be measured (a window shorter than /proc/stat's
        10 ms tick counts no CPU time at all: then only the load average)."""
        out: dict[str, float] = {}
        start, end = self.start, self.end
        if start is not None and end is not None and start.cores and end.cores:
            wall = end.wall_s - start.wall_s
            cores = end.cores.since(start.cores)
            if wall > 0 and cores.total > 0:
                count = cores.count
                own = end.own_cpu_s - start.own_cpu_s
                other = min(max((cores.busy - own) / wall, 0.0), float(count))
                out["timing_other_busy_cores"] = other
                out["timing_steal_fraction"] = cores.seconds["steal"] / cores.total
                out["timing_free_cores"] = count - other
        if self.load_avg is not None:
            out["timing_load_avg"] = self.load_avg
        return out
