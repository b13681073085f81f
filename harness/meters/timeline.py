"""Memory over time in the memory window: live tensor bytes by category after every op, with
the phase each op ran in (forward, backward, recomputation, optimizer step) and its micro-batch.

A peak says *how much*; the timeline says *when* and *why*: activations climb through the
forward pass and fall through backward, gradients appear, the optimizer step adds temporaries,
and under checkpointing the recomputation shows as a saw-tooth inside backward. The samples
come from the same accounting as the peak (``MemTracker``'s running snapshot, read after each op,
where its own peak is taken, on whichever engine ``harness.compat.memtracker`` chose), so the timeline's highest total is the trial's
``peak_allocated_bytes`` on CPU. On CUDA the allocator's ``memory_allocated`` and
``memory_reserved`` are sampled beside it (reserved - allocated = caching/fragmentation).

It runs only inside the memory window, which is never timed, and only when the spec's
``measure.timeline`` is on.
"""

from __future__ import annotations

from typing import Any

import torch

from harness.meters.accounting import ObservingTracker, fold, on_device
from harness.metrics import BREAKDOWN_CATEGORIES

PHASES = ("forward", "backward", "recompute", "optimizer")
MAX_SAMPLES = 20_000  # beyond this, every k-th sample is kept (and always the peak)
FORMAT_VERSION = 1


class TimelineTracker(ObservingTracker):
    """``PeakTracker`` that also keeps a sample of its running snapshot after every op."""

    def __init__(self, device: torch.device, kind: str | None = None) -> None:
        super().__init__(device, kind)
        self.device = device
        self.persistent_optim = 0  # the optimizer state's own bytes: the rest of OPT is "other"
        self.micro_batch = 0
        self.ops = 0
        self.rows: list[tuple[int, ...]] = []

    def after_op(self) -> None:
        self.ops += 1
        self.sample()

    def sample(self) -> None:
        parts = fold(on_device(self.observed.current(), self.device), self.persistent_optim)
        row = (
            PHASES.index(self.observed.phase()),
            self.micro_batch,
            *(parts[c] for c in BREAKDOWN_CATEGORIES),
        )
        if self.device.type == "cuda":
            row += (
                torch.cuda.memory_allocated(self.device),
                torch.cuda.memory_reserved(self.device),
            )
        if self.rows and self.rows[-1][1:] == row:
            return  # nothing changed since the last kept sample: a step plot stays exact
        self.rows.append((self.ops, *row))

    def close(self) -> None:
        """The last op's state, so a step plot runs to the end of the window."""
        if self.rows and self.rows[-1][0] != self.ops:
            self.rows.append((self.ops, *self.rows[-1][1:]))

    def to_json(self, steps: int, micro_batches: int) -> dict[str, Any]:
        """Columnar, compact: one list per field, bytes as integers."""
        rows = self.rows
        totals = [sum(r[3:8]) for r in rows]
        peak = max(range(len(rows)), key=totals.__getitem__) if rows else None
        if peak is not None and len(rows) > MAX_SAMPLES:
            stride = -(-len(rows) // MAX_SAMPLES)
            keep = sorted(set(range(0, len(rows), stride)) | {peak, len(rows) - 1})
            rows, totals = [rows[i] for i in keep], [totals[i] for i in keep]
            peak = keep.index(peak)
        fields = ["op", "phase", "micro_batch", *BREAKDOWN_CATEGORIES]
        if self.device.type == "cuda":
            fields += ["allocated", "reserved"]
        columns = {name: [r[i] for r in rows] for i, name in enumerate(fields)}
        return {
            "format": FORMAT_VERSION,
            "device": self.device.type,
            "unit": "bytes",
            "categories": list(BREAKDOWN_CATEGORIES),
            "phases": list(PHASES),
            "steps": steps,
            "micro_batches_per_step": micro_batches,
            "ops": self.ops,
            "peak_index": peak,
            "peak_total": totals[peak] if peak is not None else 0,
            "samples": {**columns, "total": totals},
        }
