"""Peak memory over a window of training steps, with a breakdown by what holds it.

CUDA: the allocator's own counters (``max_memory_allocated`` / ``max_memory_reserved``) give the
peak. CPU has no such counters, so the peak comes from tensor accounting: PyTorch's
``MemTracker`` sees every storage created in the window, plus the model, optimizer and staged
batches registered up front. Both devices use ``MemTracker``'s snapshot at the peak for the
breakdown. The tracker slows steps several times, which is why timing runs in its own window.

Device level (CUDA only, ``peak_device_bytes``): the allocator's peak reservation plus what
lives on the device outside the allocator at the end of the window, read with
``cudaMemGetInfo``. It is an estimate of the device's high-water mark, not a measured peak:
the outside part (CUDA context, cuBLAS/cuDNN workspaces not served by the caching allocator,
NCCL buffers, and any other process on the same GPU) is taken as it stands after the window,
so a transient outside allocation inside the window is missed and another process's usage is
counted. It is its own figure (docs/measuring.md), never the trial's peak.

The allocator snapshot (CUDA only, opt-in): the caching allocator's alloc/free history over the
window, dumped for PyTorch's memory viewer. Bounded to ``SNAPSHOT_MAX_ENTRIES`` events with
Python-only stacks for allocations (the cheapest tracebacks torch offers; it has no stack-depth
knob); a failure to record or dump it is noted, never raised.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch

from harness.compat.internals import dump_snapshot, record_memory_history
from harness.meters.accounting import (
    ObservingTracker,
    TotalsTracker,
    fold,
    on_device,
    optimizer_state_bytes,
)
from harness.meters.timeline import TimelineTracker
from harness.metrics import breakdown_metric

# The allocator history's ring buffer: the newest this many alloc/free events are kept (each
# holds a traceback, a few KB of host memory).
SNAPSHOT_MAX_ENTRIES = 20_000


@dataclass(frozen=True)
class MemoryReading:
    peak_allocated_bytes: int
    mem_param_bytes: int
    mem_grad_bytes: int
    mem_optim_bytes: int
    mem_activation_bytes: int
    mem_other_bytes: int
    peak_reserved_bytes: int | None = None
    peak_device_bytes: int | None = None
    # When the tracked peak happened: forward, backward, recompute or optimizer (the step).
    peak_phase: str | None = None

    def metrics(self) -> dict[str, float]:
        """The numbers (``peak_phase`` is not one)."""
        return {k: float(v) for k, v in asdict(self).items() if v is not None and k != "peak_phase"}


class MemoryWindow:
    """Context manager around the memory-measurement steps; call ``micro_batch_done()`` after
    each forward+backward (each micro-batch, under gradient accumulation).

    Must start after at least one optimizer step, so the optimizer's state already exists and
    its persistent bytes can be told apart from the step's temporaries (which ``MemTracker`` also
    files under optimizer state while ``step()`` runs).
    """

    def __init__(
        self,
        device: torch.device,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        staged: list[torch.Tensor],
        allocator_counters: bool = True,
        timeline: bool = False,
        allocator_snapshot: str | None = None,
        totals: bool = False,
    ) -> None:
        self.device = device
        # Off when estimating on fake tensors: then there is no allocator to ask.
        self.allocator_counters = allocator_counters and device.type == "cuda"
        self.optimizer = optimizer
        self.timeline_tracker = TimelineTracker(device) if timeline else None
        # ``totals``: the running total after every op, kept (``TotalsTracker``; the fit search).
        self.totals_tracker = TotalsTracker(device) if totals and not timeline else None
        self.tracker: ObservingTracker = (
            self.timeline_tracker or self.totals_tracker or ObservingTracker(device)
        )
        self.tracker.track_external(model, optimizer, *staged)
        # CUDA only: where to dump the allocator's history for PyTorch's memory viewer.
        self.allocator_snapshot = allocator_snapshot if self.allocator_counters else None
        # Why the snapshot was not written, if it was asked for and failed.
        self.snapshot_error: str | None = None
        self.reading: MemoryReading | None = None

    def __enter__(self) -> MemoryWindow:
        if self.allocator_counters:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        if self.allocator_snapshot:
            self._start_history()
        if self.timeline_tracker is not None:
            self.timeline_tracker.persistent_optim = optimizer_state_bytes(self.optimizer)
        self.tracker.__enter__()
        return self

    def micro_batch_done(self) -> None:
        """After each forward+backward: ``MemTracker`` refuses a second root forward otherwise."""
        self.tracker.reset_mod_stats()
        if self.timeline_tracker is not None:
            self.timeline_tracker.micro_batch += 1

    def __exit__(self, *exc: Any) -> None:
        self.tracker.__exit__(*exc)
        if self.allocator_snapshot:
            self._dump_history(self.allocator_snapshot)
        if self.timeline_tracker is not None:
            self.timeline_tracker.close()
        if exc[0] is None:
            self.reading = self._read()

    def _start_history(self) -> None:
        """Record the allocator's history, bounded; a refusal only loses the snapshot."""
        try:
            record_memory_history(
                enabled="all",
                context="alloc",  # tracebacks of allocations only, not of frees
                stacks="python",  # no C++ frames: the smallest stacks torch records
                max_entries=SNAPSHOT_MAX_ENTRIES,  # the whole process's allocator, every device
            )
        except Exception as error:  # an old driver, a build without it: the trial goes on
            self.snapshot_error = f"allocator history not recorded: {type(error).__name__}: {error}"
            self.allocator_snapshot = None

    def _dump_history(self, path: str) -> None:
        """Write the history for the memory viewer and stop recording, whatever happens."""
        try:
            dump_snapshot(path)
        except Exception as error:
            self.snapshot_error = f"allocator snapshot not written: {type(error).__name__}: {error}"
        finally:
            try:
                record_memory_history(enabled=None)
            except Exception as error:
                self.snapshot_error = self.snapshot_error or (
                    f"allocator history not stopped: {type(error).__name__}: {error}"
                )

    def timeline(self, steps: int, micro_batches: int) -> dict[str, Any] | None:
        """The window's memory timeline (``harness.meters.timeline``), if it was recorded."""
        if self.timeline_tracker is None:
            return None
        return self.timeline_tracker.to_json(steps, micro_batches)

    def _read(self) -> MemoryReading:
        by_type = on_device(self.tracker.get_tracker_snapshot("peak"), self.device)
        parts = fold(by_type, optimizer_state_bytes(self.optimizer))
        tracked_peak = by_type.get("Total", 0)
        reserved = device_peak = None
        if self.allocator_counters:
            torch.cuda.synchronize(self.device)
            peak = torch.cuda.max_memory_allocated(self.device)
            reserved = torch.cuda.max_memory_reserved(self.device)
            device_peak = device_peak_bytes(self.device, reserved)
            # Allocations the tracker cannot see (library workspaces, caches) count as "other".
            parts["other"] += max(0, peak - tracked_peak)
        else:
            peak = tracked_peak
        return MemoryReading(
            peak_allocated_bytes=int(peak),
            **{breakdown_metric(category): int(value) for category, value in parts.items()},
            peak_reserved_bytes=None if reserved is None else int(reserved),
            peak_device_bytes=device_peak,
            peak_phase=self.tracker.peak_phase,
        )


def device_peak_bytes(device: torch.device, peak_reserved: int) -> int:
    """CUDA: the allocator's peak reservation plus what the device holds outside the allocator
    now (``total - free`` from ``cudaMemGetInfo`` minus ``memory_reserved``): the context, NCCL
    and library buffers, other processes. An estimate of the device-level peak (see the module
    docstring for what it misses and what it over-counts)."""
    free, total = torch.cuda.mem_get_info(device)
    outside = (total - free) - torch.cuda.memory_reserved(device)
    return int(peak_reserved + max(0, outside))
