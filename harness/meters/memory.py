"""Peak memory over a window of training steps, with a breakdown by what holds it.

CUDA: the allocator's own counters (``max_memory_allocated`` / ``max_memory_reserved``) give the
peak. CPU has no such counters, so the peak comes from tensor accounting: PyTorch's
``MemTracker`` sees every storage created in the window, plus the model, optimizer and staged
batches registered up front. Both devices use ``MemTracker``'s snapshot at the peak for the
breakdown. The tracker slows steps several times, which is why timing runs in its own window.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch

from harness.meters.accounting import PeakTracker, fold, on_device, optimizer_state_bytes
from harness.meters.timeline import TimelineTracker
from harness.metrics import breakdown_metric


@dataclass(frozen=True)
class MemoryReading:
    peak_allocated_bytes: int
    mem_param_bytes: int
    mem_grad_bytes: int
    mem_optim_bytes: int
    mem_activation_bytes: int
    mem_other_bytes: int
    peak_reserved_bytes: int | None = None

    def metrics(self) -> dict[str, float]:
        return {k: float(v) for k, v in asdict(self).items() if v is not None}


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
    ) -> None:
        self.device = device
        # Off when estimating on fake tensors: then there is no allocator to ask.
        self.allocator_counters = allocator_counters and device.type == "cuda"
        self.optimizer = optimizer
        self.timeline_tracker = TimelineTracker(device) if timeline else None
        self.tracker: PeakTracker = self.timeline_tracker or PeakTracker()
        self.tracker.track_external(model, optimizer, *staged)
        # CUDA only: where to dump the allocator's history for PyTorch's memory viewer.
        self.allocator_snapshot = allocator_snapshot if self.allocator_counters else None
        self.reading: MemoryReading | None = None

    def __enter__(self) -> MemoryWindow:
        if self.allocator_counters:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        if self.allocator_snapshot:
            torch.cuda.memory._record_memory_history(max_entries=100_000)
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
            try:
                torch.cuda.memory._dump_snapshot(self.allocator_snapshot)
            finally:
                torch.cuda.memory._record_memory_history(enabled=None)
        if self.timeline_tracker is not None:
            self.timeline_tracker.close()
        if exc[0] is None:
            self.reading = self._read()

    def timeline(self, steps: int, micro_batches: int) -> dict[str, Any] | None:
        """The window's memory timeline (``harness.meters.timeline``), if it was recorded."""
        if self.timeline_tracker is None:
            return None
        return self.timeline_tracker.to_json(steps, micro_batches)

    def _read(self) -> MemoryReading:
        by_type = on_device(self.tracker.get_tracker_snapshot("peak"), self.device)
        parts = fold(by_type, optimizer_state_bytes(self.optimizer))
        tracked_peak = by_type.get("Total", 0)
        reserved = None
        if self.allocator_counters:
            torch.cuda.synchronize(self.device)
            peak = torch.cuda.max_memory_allocated(self.device)
            reserved = torch.cuda.max_memory_reserved(self.device)
            # Allocations the tracker cannot see (library workspaces, caches) count as "other".
            parts["other"] += max(0, peak - tracked_peak)
        else:
            peak = tracked_peak
        return MemoryReading(
            peak_allocated_bytes=int(peak),
            **{breakdown_metric(category): int(value) for category, value in parts.items()},
            peak_reserved_bytes=None if reserved is None else int(reserved),
        )
