"""Peak memory over a window of training steps, with a breakdown by what holds it.

CUDA: the allocator's own counters (``max_memory_allocated`` / ``max_memory_reserved``) give the
peak. CPU has no such counters, so the peak comes from tensor accounting: PyTorch's
``MemTracker`` sees every storage created in the window, plus the model, optimizer and staged
batches registered up front. Both devices use ``MemTracker``'s snapshot at the peak for the
breakdown. The tracker slows steps several times, which is why timing runs in its own window.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

import torch


def _skip_tools_package_init() -> None:
    """Let ``torch.distributed._tools.mem_tracker`` load without its package's ``__init__``.

    That ``__init__`` imports every tool of the package, among them a runtime estimator that
    loads the inductor: ~1.7-2.5 s of every trial's start-up, for nothing a trial uses. The
    package is registered as a plain namespace for its submodules (torch's own code imports
    only submodules from it, never names from the package itself).
    """
    import importlib.util
    import sys

    import torch.distributed  # noqa: F401  (the parent must exist first)

    name = "torch.distributed._tools"
    if name not in sys.modules:
        spec = importlib.util.find_spec(name)
        if spec is not None:
            sys.modules[name] = importlib.util.module_from_spec(spec)


_skip_tools_package_init()

from torch.distributed._tools import mem_tracker  # noqa: E402
from torch.distributed._tools.common_utils import get_untyped_storages  # noqa: E402
from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType  # noqa: E402

CUDA_BLOCK = 512  # the CUDA caching allocator rounds every block up to this
_round_every_device = False  # set by cuda_accounting()


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


def allocated_bytes(size: int, device: torch.device) -> int:
    """What a storage of ``size`` bytes takes on ``device`` (CUDA rounds up to its block)."""
    if device.type == "cuda" or _round_every_device:
        return -(-size // CUDA_BLOCK) * CUDA_BLOCK
    return size


@contextlib.contextmanager
def cuda_accounting() -> Iterator[None]:
    """Count every storage as CUDA's caching allocator would (512-byte blocks), whatever its
    device: a CUDA trial predicted where there is no GPU runs CPU kernels but must be accounted
    as CUDA. ``MemTracker`` decides the rounding per storage by device type in a private
    helper, which is why that one method is swapped for the duration."""
    global _round_every_device
    info = mem_tracker._WeakRefInfo
    original = info._calculate_mem_consumed

    def rounded(self: Any) -> int:
        return allocated_bytes(self.size * self.element_size, torch.device("cuda"))

    info._calculate_mem_consumed = rounded
    _round_every_device = True
    try:
        yield
    finally:
        info._calculate_mem_consumed = original
        _round_every_device = False


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes held by these tensors' storages on this rank, each storage once."""
    seen: dict[int, int] = {}
    for value in tensors:
        if hasattr(value, "to_local"):  # a sharded DTensor (FSDP): this rank's shard
            value = value.to_local()
        # Tensor subclasses (torchao's 8-bit state) keep their bytes in inner tensors.
        for storage in get_untyped_storages(value):
            key = storage._cdata  # the StorageImpl: one per storage, fake ones too
            seen[key] = allocated_bytes(storage.nbytes(), value.device)
    return sum(seen.values())


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the optimizer's persistent state (moments, step counters)."""
    return storage_bytes(
        value
        for state in optimizer.state.values()
        for value in state.values()
        if isinstance(value, torch.Tensor)
    )


class MemoryWindow:
    """Context manager around the memory-measurement steps; call ``step_done()`` after each
    forward+backward (each micro-batch, under gradient accumulation).

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
        self.timeline_tracker = None
        if timeline:
            from harness.meters.timeline import TimelineTracker

            self.timeline_tracker = TimelineTracker(device)
        self.tracker: MemTracker = self.timeline_tracker or MemTracker()
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

    def step_done(self) -> None:
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
        snapshot = self.tracker.get_tracker_snapshot("peak")
        by_type = next(
            (snap for dev, snap in snapshot.items() if torch.device(dev).type == self.device.type),
            {},
        )
        optim_total = by_type.get(_MemRefType.OPT, 0)
        persistent_optim = min(optimizer_state_bytes(self.optimizer), optim_total)
        step_temporaries = optim_total - persistent_optim
        other = (
            by_type.get(_MemRefType.BUFFER, 0)
            + by_type.get(_MemRefType.TEMP, 0)
            + by_type.get(_MemRefType.OTH, 0)
            + step_temporaries
        )
        tracked_peak = by_type.get("Total", 0)
        reserved = None
        if self.allocator_counters:
            torch.cuda.synchronize(self.device)
            peak = torch.cuda.max_memory_allocated(self.device)
            reserved = torch.cuda.max_memory_reserved(self.device)
            # Allocations the tracker cannot see (library workspaces, caches) count as "other".
            other += max(0, peak - tracked_peak)
        else:
            peak = tracked_peak
        return MemoryReading(
            peak_allocated_bytes=int(peak),
            mem_param_bytes=int(by_type.get(_MemRefType.PARAM, 0)),
            mem_grad_bytes=int(by_type.get(_MemRefType.GRAD, 0)),
            mem_optim_bytes=int(persistent_optim),
            mem_activation_bytes=int(by_type.get(_MemRefType.ACT, 0)),
            mem_other_bytes=int(other),
            peak_reserved_bytes=None if reserved is None else int(reserved),
        )
