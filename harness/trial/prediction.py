"""One prediction of a trial's peak memory, typed: what the estimator found, or why nothing.

The estimator (``harness.trial.estimate``) answers with a ``Prediction``; the trial
(``harness.trial.run``), the fit search (``harness.trial.fit``) and the closed-form cross-checks
read its fields. Where a prediction leaves the process (JSON between the trial-layer tools and
the sweep layer, then ``harness estimate|fit`` output) it is a flat mapping under the names
users see (``predicted_peak_bytes``, ``predicted_mem_<category>_bytes``, ``refused`` or
``unpredictable`` holding the reason, ...): ``to_dict`` writes it, ``from_dict`` reads it back.

Standard library only: the sweep layer reads rows with ``from_dict`` without importing torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Any

from harness.metrics import BREAKDOWN_CATEGORIES, breakdown_metric
from harness.units import format_bytes

if TYPE_CHECKING:
    from harness.cuda.device_memory import Replayable

PEAK = "predicted_peak_bytes"


class Outcome(StrEnum):
    """How a prediction ended. The value of a failure is also the key its reason is written
    under (``{"unpredictable": "adam8bit: ..."}``), a column of ``harness estimate``."""

    OK = "ok"
    # A strategy cannot apply to the model: the trial would end before training, with the
    # same message.
    REFUSED = "refused"
    # The step cannot run on fake tensors (``harness.trial.fake.FAKE_REFUSALS``, a strategy's
    # ``unpredictable``): the trial still runs, without a prediction.
    CANNOT_PREDICT = "unpredictable"


FAILURES = (Outcome.REFUSED, Outcome.CANNOT_PREDICT)


@dataclass(frozen=True, kw_only=True)
class CardFigures:
    """What a CUDA target's card holds, the caching allocator's rules replayed on the step's
    allocations (``harness.cuda.device_memory``): absent on a CPU target."""

    reserved_bytes: float  # the allocator's segments at their peak
    device_bytes: float  # reserved + context + NCCL: what the card must hold
    context_bytes: float
    nccl_bytes: float
    fragmentation_bytes: float  # peak reserved - peak allocated
    # Of the breakdown's "other": the library workspaces live at the peak (cuBLAS and
    # cuBLASLt, one per handle and stream: ``harness.cuda.kernels.Workspaces``).
    workspace_bytes: float = 0.0
    card: str  # the card's name
    note: str  # the device-specific choices made (attention backend, ...): for a reader
    # The peak by tensor accounting alone, before the allocator's view of it (workspaces,
    # unsplit block remainders): what the fit search's moments model. Not in a fit answer's
    # row, which keeps the predicted_ figures only.
    tracked_peak_bytes: float | None = None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "predicted_reserved_bytes": self.reserved_bytes,
            "predicted_device_bytes": self.device_bytes,
            "predicted_context_bytes": self.context_bytes,
            "predicted_nccl_bytes": self.nccl_bytes,
            "predicted_fragmentation_bytes": self.fragmentation_bytes,
            "predicted_mem_workspace_bytes": self.workspace_bytes,
        }
        if self.tracked_peak_bytes is not None:
            out["tracked_peak_bytes"] = self.tracked_peak_bytes
        out["card"], out["note"] = self.card, self.note
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> CardFigures | None:
        """The card's figures of a row, None when it has none (a CPU target)."""
        if _absent(data.get("predicted_device_bytes")):
            return None
        tracked = data.get("tracked_peak_bytes")
        workspace = data.get("predicted_mem_workspace_bytes")
        return cls(
            reserved_bytes=data["predicted_reserved_bytes"],
            device_bytes=data["predicted_device_bytes"],
            context_bytes=data["predicted_context_bytes"],
            nccl_bytes=data["predicted_nccl_bytes"],
            fragmentation_bytes=data["predicted_fragmentation_bytes"],
            workspace_bytes=0.0 if workspace is None or _absent(workspace) else float(workspace),
            card=data["card"],
            note=data["note"],
            tracked_peak_bytes=None if _absent(tracked) else tracked,
        )


# The speed figures' names where a prediction is a row (``SpeedFigures.to_dict``'s order).
SPEED_COLUMNS = (
    "predicted_step_time_ms",
    "predicted_throughput",
    "throughput_unit",
    "predicted_mfu",
    "predicted_step_flops",
    "predicted_model_flops",
    "speed_device",
    "speed_unmodelled_ops",
)


@dataclass(frozen=True, kw_only=True)
class SpeedFigures:
    """How fast one training step is predicted to run (``harness.meters.roofline``): priced on
    a card's roofline, or on the CPU's calibrated one."""

    step_time_ms: float
    throughput: float  # in throughput_unit, all ranks together
    throughput_unit: str  # samples/s, or tokens/s for sequence models
    mfu: float  # model FLOPs per second over the device's peak for the trial's dtype
    step_flops: float  # per step and rank, recomputation included
    model_flops: float  # per step and rank, without recomputation
    device: str  # whose roofline: a card's name, or "cpu"
    unmodelled_ops: str  # ops no rule covered, comma-separated ("" when none)

    def to_dict(self) -> dict[str, Any]:
        values = (
            self.step_time_ms,
            self.throughput,
            self.throughput_unit,
            self.mfu,
            self.step_flops,
            self.model_flops,
            self.device,
            self.unmodelled_ops,
        )
        return dict(zip(SPEED_COLUMNS, values, strict=True))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SpeedFigures | None:
        """The figures of a row that has them all (a fit answer keeps only its predicted_
        figures: none then)."""
        if any(_absent(data.get(key)) for key in SPEED_COLUMNS[:-1]):
            return None
        return cls(
            step_time_ms=data["predicted_step_time_ms"],
            throughput=data["predicted_throughput"],
            throughput_unit=data.get("throughput_unit") or "samples/s",
            mfu=data["predicted_mfu"],
            step_flops=data["predicted_step_flops"],
            model_flops=data["predicted_model_flops"],
            device=data["speed_device"],
            unmodelled_ops=data.get("speed_unmodelled_ops") or "",
        )


@dataclass(frozen=True, kw_only=True)
class Prediction:
    """A trial's predicted peak and what it is made of, or why there is none (``outcome``,
    ``reason``). The figures are None (``breakdown`` empty) when there is no prediction, and
    where a row read back carries an outcome only (a fit answer where nothing fits)."""

    outcome: Outcome = Outcome.OK
    reason: str = ""  # why there is no prediction (refused, unpredictable); "" when ok
    peak_bytes: float | None = None  # allocated at the step's worst moment
    breakdown: dict[str, float] = field(default_factory=dict)  # category -> bytes at the peak
    num_params: float | None = None  # trainable parameters (this rank's)
    num_params_total: float | None = None  # frozen ones (a LoRA base) too
    num_params_nf4: float | None = None  # those stored in NF4 (qlora's base)
    model_state_bytes: float | None = None  # parameters + gradients + optimizer state as built
    totals: list[int] | None = None  # the live total after every op (``totals=True``: fit)
    on_card: CardFigures | None = None  # a CUDA target's card
    speed: SpeedFigures | None = None  # the step's predicted time
    replay: Replayable | None = field(default=None, compare=False, repr=False)
    # checkpoint:auto / sac:auto: the plan chosen for the budget and why ("" without one).
    recomputation: str = ""
    # pp:N: each stage's predicted peak, first stage first (the figures above: the worst's).
    stage_peaks: tuple[float, ...] = ()

    @classmethod
    def refused(cls, reason: str) -> Prediction:
        return cls(outcome=Outcome.REFUSED, reason=reason)

    @classmethod
    def unpredictable(cls, reason: str) -> Prediction:
        return cls(outcome=Outcome.CANNOT_PREDICT, reason=reason)

    @property
    def ok(self) -> bool:
        return self.outcome is Outcome.OK

    @property
    def judged_bytes(self) -> float | None:
        """The figure a memory budget is held against: what the card holds for a CUDA target
        (a card runs out on it), else the allocated peak."""
        return self.on_card.device_bytes if self.on_card is not None else self.peak_bytes

    @property
    def tensor_peak_bytes(self) -> float | None:
        """The peak by tensor accounting alone: on a CPU target the peak itself."""
        tracked = self.on_card.tracked_peak_bytes if self.on_card is not None else None
        return self.peak_bytes if tracked is None else tracked

    @property
    def note(self) -> str:
        """The device-specific choices the prediction made (a CUDA target's), else ""."""
        return self.on_card.note if self.on_card is not None else ""

    def to_dict(self) -> dict[str, Any]:
        """The flat mapping written out (JSON between processes, output rows), keys in the
        order users have always seen them; ``replay`` stays behind."""
        if not self.ok:
            return {self.outcome.value: self.reason}
        out: dict[str, Any] = {PEAK: self.peak_bytes}
        out.update({f"predicted_{breakdown_metric(c)}": v for c, v in self.breakdown.items()})
        out["num_params"] = self.num_params
        out["num_params_total"] = self.num_params_total
        out["num_params_nf4"] = self.num_params_nf4
        out["predicted_model_state_bytes"] = self.model_state_bytes
        if self.totals is not None:
            out["totals"] = self.totals
        if self.on_card is not None:
            out.update(self.on_card.to_dict())
        if self.speed is not None:
            out.update(self.speed.to_dict())
        if self.recomputation:
            out["recomputation"] = self.recomputation
        if self.stage_peaks:
            out["predicted_stage_peaks"] = ", ".join(format_bytes(b) for b in self.stage_peaks)
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Prediction:
        """``to_dict``'s mapping read back, from any row that carries one: keys of its own
        (a trial key, the closed forms, a fit answer's search) are left alone, and a missing
        value (None, or NaN where a table row lacks the column) counts as absent."""
        for outcome in FAILURES:
            reason = data.get(outcome.value)
            if isinstance(reason, str):
                return cls(outcome=outcome, reason=reason)

        def get(key: str) -> Any:
            value = data.get(key)
            return None if _absent(value) else value

        breakdown = {
            category: data[f"predicted_{breakdown_metric(category)}"]
            for category in BREAKDOWN_CATEGORIES
            if not _absent(data.get(f"predicted_{breakdown_metric(category)}"))
        }
        return cls(
            peak_bytes=get(PEAK),
            breakdown=breakdown,
            num_params=get("num_params"),
            num_params_total=get("num_params_total"),
            num_params_nf4=get("num_params_nf4"),
            model_state_bytes=get("predicted_model_state_bytes"),
            totals=get("totals"),
            on_card=CardFigures.from_dict(data),
            speed=SpeedFigures.from_dict(data),
            recomputation=get("recomputation") or "",
        )


def _absent(value: Any) -> bool:
    """None, or a table's NaN for a column this row lacks."""
    return value is None or (isinstance(value, float) and value != value)
