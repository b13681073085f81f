"""Tensor accounting: the trackers the meters use, and what they read from them.

A tracker sees every storage created while it is active and files it by what holds it
(parameter, gradient, optimizer state, activation, ...): PyTorch's ``MemTracker``
(``torch.distributed._tools.mem_tracker``), run by the engine ``harness.compat.memtracker`` picks
for the installed torch (fast, on its private parts; or as shipped, slower, same numbers). The
memory window, the timeline and ``quantize_int8``'s inference peak use it through this module,
and fold its reference types into the five categories of ``harness.metrics`` here, once.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch

from harness.compat import memtracker as tracker
from harness.compat.memtracker import get_untyped_storages
from harness.compat.snapshot_keys import TOTAL

__all__ = [
    "CUDA_BLOCK",
    "ObservingTracker",
    "PeakTracker",
    "TotalsTracker",
    "allocated_bytes",
    "cuda_accounting",
    "fold",
    "get_untyped_storages",
    "on_device",
    "optimizer_state_bytes",
    "peak_forward_bytes",
    "storage_bytes",
]

CUDA_BLOCK = 512  # the CUDA caching allocator rounds every block up to this


class PeakTracker:
    """Tensor accounting over a ``with`` block: the running snapshot by reference type, and
    its peak. ``MemTracker``'s interface, on the engine ``harness.compat.memtracker`` chose
    (``kind`` forces one: ``"fast"`` or ``"public"``).

    Register what exists before the block with ``track_external`` (model, optimizer,
    batches); call ``reset_mod_stats`` between two forward passes of one step.
    """

    def __init__(self, kind: str | None = None) -> None:
        self.engine: tracker.Tracker = tracker.engine(kind)

    def track_external(self, *external: Any) -> None:
        self.engine.track_external(*external)

    def __enter__(self) -> PeakTracker:
        self.engine.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.engine.__exit__(*exc)

    def reset_mod_stats(self) -> None:
        self.engine.reset_mod_stats()

    def get_tracker_snapshot(self, type: str = "current") -> dict[Any, dict[Any, int]]:
        """``"current"`` or ``"peak"``: bytes by device, then by reference type and ``Total``."""
        return self.engine.get_tracker_snapshot(type)


class ObservingTracker(PeakTracker):
    """A tracker that looks at the running snapshot after every op (``after_op``), where
    ``MemTracker`` takes its peak: the base of ``TotalsTracker`` and the timeline's, and the
    memory window's own, which notes the phase the peak fell in (``peak_phase``: forward,
    backward, recompute or optimizer). Why the phase: a peak in the optimizer step is one
    that no activation strategy can lower, and only a look at when it happens says so."""

    def __init__(self, device: torch.device, kind: str | None = None) -> None:
        self.observed: tracker.ObservedTracker = tracker.observed_engine(
            self._observe, device.type, kind
        )
        self.engine = self.observed
        self.peak_total = -1
        self.peak_phase: str | None = None

    def _observe(self) -> None:
        total = self.observed.total()
        if total > self.peak_total:  # strictly, as MemTracker moves its own peak
            self.peak_total, self.peak_phase = total, self.observed.phase()
        self.after_op()

    def after_op(self) -> None:
        """After every tracked op; ``self.observed`` says what the snapshot holds now."""


class TotalsTracker(ObservingTracker):
    """``PeakTracker`` that also keeps the running total on one device type at entry and after
    every op that allocated: the moments its peak is the largest of.

    Why: each moment's total is a sum of tensor sizes, and those grow affinely with the batch
    (quadratically at most with a sequence length), so two or three such traces of the same
    step at different sizes give every moment's curve, and their maximum is the peak at any
    size (``harness.trial.fit``). Only moments after an allocation are kept (a total grows
    only there, so the peak is among them): ops that allocate nothing (views, device queries)
    come and go between steps (the first step after a warm-up runs a few more than the next),
    and would misalign the moments.
    """

    def __init__(self, device: torch.device, kind: str | None = None) -> None:
        super().__init__(device, kind)
        self.device_type = device.type
        self.totals: list[int] = []

    def __enter__(self) -> TotalsTracker:
        super().__enter__()
        self.totals.append(self.observed.total())
        return self

    def after_op(self) -> None:
        if self.observed.rose:  # a new storage, or one resized larger (FSDP's all-gather)
            self.totals.append(self.observed.total())
            self.observed.rose = False


_round_every_device = False  # set by cuda_accounting()


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
    helper, which is why that one method is swapped for the duration (either engine: the
    helper is ``MemTracker``'s own; ``tracker.storage_record`` checks it is there)."""
    global _round_every_device
    info = tracker.storage_record()
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
        to_local = getattr(value, "to_local", None)
        if to_local is not None:  # a sharded DTensor (FSDP): this rank's shard
            value = to_local()
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


def fold(by_type: Mapping[Any, int], persistent_optim: int) -> dict[str, int]:
    """One device's ``MemTracker`` snapshot as the five categories of the breakdown.

    ``MemTracker`` files the optimizer step's temporaries under optimizer state while
    ``step()`` runs; only ``persistent_optim`` bytes (the state that outlives the step) stay
    there, the rest goes to *other* with buffers and backward temporaries.

    Keys are ``MemTracker``'s reference types, a ``str`` enum: each equals (and hashes as) its
    value, the name looked up here (``snapshot_keys.SNAPSHOT_KEYS``, checked at start-up).
    """
    optim_total = by_type.get("Optstate", 0)
    optim = min(persistent_optim, optim_total)
    return {
        "param": by_type.get("Parameter", 0),
        "grad": by_type.get("Gradient", 0),
        "optim": optim,
        "activation": by_type.get("Activation", 0),
        "other": by_type.get("Buffer", 0)
        + by_type.get("Temp", 0)
        + by_type.get("Other", 0)
        + optim_total
        - optim,
    }


def on_device(snapshot: Mapping[Any, Mapping[Any, int]], device: torch.device) -> Mapping[Any, int]:
    """The part of a ``MemTracker`` snapshot (keyed by device) for ``device``'s type."""
    return next((s for dev, s in snapshot.items() if torch.device(dev).type == device.type), {})


def peak_forward_bytes(
    model: torch.nn.Module, batch: dict[str, torch.Tensor], forward: Callable[[], Any]
) -> int:
    """Peak live tensor bytes on the CPU over one no-grad ``forward()`` of ``model`` on
    ``batch``, model and batch included (what an inference batch costs)."""
    peak = PeakTracker()
    peak.track_external(model, *batch.values())
    with peak, torch.no_grad():
        forward()
    cpu = torch.device("cpu")
    return int(on_device(peak.get_tracker_snapshot("peak"), cpu).get(TOTAL, 0))
