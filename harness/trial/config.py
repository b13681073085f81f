"""The plain, JSON-serialisable description of one trial: what the sweep hands the trial worker.

Standard library only (the registries it reads are plain data), so the sweep layer builds these
without importing torch.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from harness.strategies.combination import Combination
from harness.strategies.settings import LoraSettings, OptimizerSettings
from harness.workloads import resolve_knobs

NOT_DEFINING = (
    "python_path",
    "run_infeasible",
    "timeline",
    "allocator_snapshot",
    "batch_size_search",
)
# Fields added after sweeps were first recorded count in the key only when set, so a spec that
# does not use them keeps its trial keys (and resumes its sweep).
KEYED_WHEN_SET: dict[str, Any] = {
    "model_loss": None,
    "lora": None,
    "hardware": None,
    "card": None,
    "allocator": None,
}
# Files a trial writes beside its result.json (all logged as MLflow artifacts under trial/).
TIMELINE_FILE = "timeline.json"  # harness.meters.timeline's samples of the memory window
TIMELINE_PNG = "timeline.png"  # drawn from it by the sweep (matplotlib is not a trial need)
SNAPSHOT_FILE = "memory_snapshot.pickle"  # CUDA, measure.allocator_snapshot: PyTorch's viewer
STEP_TIMES_FILE = "step_times.json"  # the timed window's raw per-step times (rank 0's)


# A quality a trial may train until (``train.budget.target``): each metric and the bound it is
# held to (a loss must fall below its bound, accuracy rise above it).
TARGET_BOUNDS = {"eval_loss": "below", "perplexity": "below", "accuracy": "above"}


class BudgetError(ValueError):
    """A budget or target that cannot be: which of its keys (``field``, empty for the budget as
    a whole) and why; the spec reports it at that key."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}" if field else reason)
        self.field, self.reason = field, reason


@dataclass(frozen=True)
class Target:
    """Train until ``metric`` is ``below`` (a loss) or ``above`` (accuracy) this value at an
    evaluation: time to a quality (MLPerf's measure) instead of a fixed number of steps."""

    metric: str
    below: float | None = None
    above: float | None = None

    def __post_init__(self) -> None:
        bound = TARGET_BOUNDS.get(self.metric)
        if bound is None:
            raise BudgetError("metric", f"must be one of {', '.join(TARGET_BOUNDS)}")
        other = "above" if bound == "below" else "below"
        if getattr(self, other) is not None:
            raise BudgetError(other, f"target {self.metric} takes {bound}, not {other}")
        if getattr(self, bound) is None:
            raise BudgetError(bound, f"required for target {self.metric} (the value to reach)")

    @property
    def bound(self) -> float:
        return float(self.below if self.below is not None else self.above or 0.0)

    def met(self, metrics: Mapping[str, float]) -> bool:
        """Whether an evaluation's ``metrics`` reach the target (a missing metric does not)."""
        value = metrics.get(self.metric)
        if value is None:
            return False
        return value < self.bound if self.below is not None else value > self.bound

    def to_dict(self) -> dict[str, Any]:
        bound = "below" if self.below is not None else "above"
        return {"metric": self.metric, bound: self.bound}


@dataclass(frozen=True)
class Budget:
    """How long a trial trains: exactly one of ``epochs`` or ``steps``, or a ``target`` with
    ``max_steps`` (train until it is met at an evaluation, at most that many steps); and, with
    any of them, ``eval_every`` (evaluate on the held-out split every that many steps: the
    quality curve, and where a target is checked)."""

    epochs: int | None = None
    steps: int | None = None
    max_steps: int | None = None
    eval_every: int | None = None
    target: Target | None = None

    def __post_init__(self) -> None:
        if self.target is not None:
            for key in ("epochs", "steps"):
                if getattr(self, key) is not None:
                    raise BudgetError(
                        key, "not with a target (it trains until the target or max_steps)"
                    )
            if self.max_steps is None:
                raise BudgetError("max_steps", "required with a target (the most steps to try)")
            if self.eval_every is None:
                raise BudgetError(
                    "eval_every", "required with a target (how often to check it, in steps)"
                )
        elif self.max_steps is not None:
            raise BudgetError("max_steps", "only applies with a target (else give steps)")
        elif (self.epochs is None) == (self.steps is None):
            raise BudgetError("", "give exactly one of epochs or steps")
        for name in ("epochs", "steps", "max_steps", "eval_every"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise BudgetError(name, "must be at least 1")

    def total_steps(self, per_epoch: int) -> int:
        """Optimizer steps in all (with a target: at most), an epoch being ``per_epoch`` steps."""
        if self.max_steps is not None:
            return self.max_steps
        return self.steps if self.steps is not None else int(self.epochs or 0) * per_epoch

    def to_dict(self) -> dict[str, Any]:
        """What is set, e.g. ``{"steps": 20}`` (the trial JSON, the ``budget`` param): a budget
        without the later keys writes (and so keys its trials) exactly as before them."""
        data: dict[str, Any] = {
            name: getattr(self, name)
            for name in ("epochs", "steps", "max_steps", "eval_every")
            if getattr(self, name) is not None
        }
        if self.target is not None:
            data["target"] = self.target.to_dict()
        return data

    @property
    def text(self) -> str:
        """One line, e.g. ``steps=20`` or ``max_steps=400,eval_every=20,target=accuracy>0.9``
        (the MLflow ``budget`` param)."""
        parts = [f"{k}={v}" for k, v in self.to_dict().items() if k != "target"]
        if self.target is not None:
            sign = "<" if self.target.below is not None else ">"
            parts.append(f"target={self.target.metric}{sign}{self.target.bound:g}")
        return ",".join(parts)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Budget:
        target = data.get("target")
        return cls(**{**data, "target": None if target is None else Target(**target)})


@dataclass(frozen=True)
class TrialConfig:
    """Everything that determines one trial's result (and so its ``trial_key``).

    ``strategy`` is the validated combination, written to JSON as its terms, e.g.
    ``["checkpoint", "accumulate:4"]``; ``optimizer``, ``budget`` and ``lora`` are typed
    settings written as the plain dicts they always were (``to_dict``/``from_dict`` are the
    only conversions, so the JSON and ``trial_key`` do not depend on the Python types).
    """

    experiment: str
    model_family: str
    model_size: str
    model_knobs: dict[str, Any]
    dataset: str
    data_options: dict[str, Any]
    batch_size: int
    dtype: str
    strategy: Combination
    optimizer: OptimizerSettings
    budget: Budget
    seed: int = 0
    warmup_steps: int = 2
    memory_steps: int = 2
    timed_steps: int = 10
    device: str = "auto"
    device_memory_bytes: int | None = None
    # A user model's loss, ``module:function`` taking (outputs, batch); None: the model's own
    # loss, else cross-entropy of its logits.
    model_loss: str | None = None
    # train.lora (alpha, dropout, targets, base_dtype) for trials with lora/qlora, else None.
    lora: LoraSettings | None = None
    # The hardware the sweep resolved ``device`` to on its host (``harness.trial.hardware``:
    # device type and name; the world size is the strategy's): a CPU's results are not an
    # H200's. None where nothing runs (estimates, dry runs without a host probe).
    hardware: dict[str, str] | None = None
    # The card a CUDA trial is planned for (``harness.cuda.cards.Card.to_dict``: the spec's
    # ``card``), None for none named; and the caching allocator's settings
    # (PYTORCH_CUDA_ALLOC_CONF text, the spec's ``allocator``), None for the defaults. Both
    # change what the trial is predicted to hold and when it is infeasible.
    card: dict[str, Any] | None = None
    allocator: str | None = None
    # Not part of the key: where user model code (``module:attr``) is importable from, whether
    # to run a trial even when it is predicted not to fit, whether to record the memory
    # timeline and (CUDA only) the allocator's history: both run in the untimed memory window
    # and change no measurement; for ``grid.batch_size: max``, how ``batch_size`` was found
    # (the ``batch_size_search`` tag; the batch itself is in the key).
    python_path: list[str] = field(default_factory=list)
    run_infeasible: bool = False
    timeline: bool = True
    allocator_snapshot: bool = False
    batch_size_search: str | None = None

    @property
    def strategy_text(self) -> str:
        """Canonical one-string form, e.g. ``checkpoint+accumulate:4`` (the results-table value)."""
        return self.strategy.text

    @property
    def knobs(self) -> dict[str, Any]:
        """The model's knobs with the family's defaults and preset filled in."""
        return resolve_knobs(self.model_family, self.model_knobs)

    @property
    def dataset_options(self) -> dict[str, Any]:
        """What the dataset loader gets: the spec's options, and a sequence model's ``seq_len``
        as the length of its text windows."""
        options = dict(self.data_options)
        knobs = self.knobs
        if "seq_len" in knobs:
            options.setdefault("seq_len", knobs["seq_len"])
        return options

    @property
    def world_size(self) -> int:
        """Processes the trial runs on: N for ``ddp:N``/``fsdp:N``, else 1."""
        return self.strategy.world_size

    @property
    def trial_key(self) -> str:
        """A stable hash of everything that defines the trial (not where it runs from)."""
        defining = {
            k: v
            for k, v in self.to_dict().items()
            if k not in NOT_DEFINING and not (k in KEYED_WHEN_SET and v == KEYED_WHEN_SET[k])
        }
        blob = json.dumps(defining, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON types only: what crosses the process boundary and is keyed."""
        data = asdict(self)  # deep copies of the plain fields
        data["strategy"] = self.strategy.texts
        data["optimizer"] = self.optimizer.to_dict()
        data["budget"] = self.budget.to_dict()
        data["lora"] = None if self.lora is None else self.lora.to_dict()
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TrialConfig:
        """The config ``to_dict`` wrote (the strategy terms checked again, as a trial worker
        receives them from outside)."""
        lora = data.get("lora")
        return cls(
            **{
                **data,
                "strategy": Combination.parse(data["strategy"]),
                "optimizer": OptimizerSettings.from_dict(data["optimizer"]),
                "budget": Budget.from_dict(data["budget"]),
                "lora": None if lora is None else LoraSettings.from_dict(lora),
            }
        )

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> TrialConfig:
        return cls.from_dict(json.loads(text))
