"""The training settings strategies read or replace: the optimizer (``train.optimizer``, which
the optimizer strategies swap) and the adapters (``train.lora``, which lora/qlora read).

Their defaults live here and nowhere else: the spec's pydantic models take theirs from these
classes, and the trial builds from these values. Both travel in ``TrialConfig`` and cross the
process boundary as the plain dicts ``to_dict`` writes (every field, so the trial JSON and its
key stay as they were). Standard library only.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from typing import Any


@dataclass(frozen=True)
class OptimizerSettings:
    """Which optimizer a trial builds and its hyper-parameters (``harness.trial.optim``)."""

    name: str = "adam"  # harness.contract.OPTIMIZERS
    lr: float = 1e-3
    weight_decay: float = 0.0
    momentum: float = 0.0  # SGD only
    # Fixed, not left to PyTorch's per-device choice, so CPU and GPU steps (and their
    # predictions) hold the same temporaries.
    foreach: bool = False

    def swapped(
        self, name: str, momentum: float | None = None, lr: float | None = None
    ) -> OptimizerSettings:
        """Another optimizer with this one's weight decay and foreach, and its lr unless ``lr``
        is given (``momentum``: for SGD; otherwise the default)."""
        return replace(
            self,
            name=name,
            lr=self.lr if lr is None else lr,
            momentum=DEFAULT_OPTIMIZER.momentum if momentum is None else momentum,
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> OptimizerSettings:
        return cls(**data)


DEFAULT_OPTIMIZER = OptimizerSettings()


@dataclass(frozen=True)
class LoraSettings:
    """``train.lora``: how lora/qlora adapters are set up (their rank is the strategy's
    argument)."""

    alpha: float | None = None  # None: the rank (adapter scaling alpha/r = 1)
    dropout: float = 0.0
    # Module names or name suffixes (q_proj, mlp.fc1); None: every Linear of the repeated blocks.
    targets: tuple[str, ...] | None = None
    base_dtype: str = "auto"  # fp32 | bf16 | fp16, or auto: the dtype axis' 16-bit type

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["targets"] = None if self.targets is None else list(self.targets)
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> LoraSettings:
        targets = data.get("targets")
        return cls(**{**data, "targets": None if targets is None else tuple(targets)})


DEFAULT_LORA = LoraSettings()
