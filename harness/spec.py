"""The YAML experiment spec: pydantic models, loading with one-line errors, and grid expansion.

Key names follow the design notes §7 and are a contract with users; every key is documented in
the README. Unknown keys are errors, so a typo never silently changes a sweep.
"""

from __future__ import annotations

import difflib
import hashlib
import itertools
import math
import re
import types
import typing
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    PositiveFloat,
    PositiveInt,
    PrivateAttr,
    ValidationError,
    field_validator,
    model_validator,
)

from harness import strategies
from harness.metrics import METRICS
from harness.trial.config import TrialConfig
from harness.units import parse_bytes, parse_seconds
from harness.workloads import DATASETS, FAMILIES, Family, is_user_family, resolve_knobs

DTYPES = ("fp32", "bf16", "fp16")
DEVICE_RE = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


class SpecError(Exception):
    """A spec problem, already formatted as one line: ``file: field.path: what is wrong``."""


class FieldProblem(ValueError):
    """A validator's complaint about a place *inside* the field it validates."""

    def __init__(self, subpath: list[str | int], message: str) -> None:
        super().__init__(message)
        self.subpath = subpath
        self.message = message


def did_you_mean(word: str, options: typing.Iterable[str]) -> str:
    close = difflib.get_close_matches(str(word), list(options), n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def require_known(kind: str, name: str, options: typing.Iterable[str], also: str = "") -> str:
    """``name`` if it is one of ``options``; else a ValueError listing them, with a suggestion."""
    options = list(options)
    if name in options:
        return name
    allowed = ", ".join(options) + (f", {also}" if also else "")
    raise ValueError(f"unknown {kind} {name!r} (allowed: {allowed}){did_you_mean(name, options)}")


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# ---- sections ------------------------------------------------------------------------------


class ModelSpec(Strict):
    family: str
    sizes: dict[str, dict[str, Any]] = Field(min_length=1)

    @field_validator("family")
    @classmethod
    def known_family(cls, family: str) -> str:
        if is_user_family(family):
            return family
        return require_known("model family", family, FAMILIES, "or module:attr for your own code")

    @model_validator(mode="after")
    def known_knobs(self) -> ModelSpec:
        family = FAMILIES.get(self.family)
        if family is None:
            return self  # user code receives its knobs as keyword arguments, unchecked
        for size, knobs in self.sizes.items():
            if not NAME_RE.match(size):
                raise FieldProblem(["sizes", size], "size names use letters, digits, '_', '-', '.'")
            for knob, value in knobs.items():
                check_knob(family, ["sizes", size, knob], knob, value)
            resolved = resolve_knobs(self.family, knobs)
            for multiple, of in family.divisible:
                if resolved[multiple] % resolved[of]:
                    raise FieldProblem(
                        ["sizes", size, multiple],
                        f"{multiple} {resolved[multiple]} must be a multiple of {of} {resolved[of]}",
                    )
        return self


def check_knob(family: Family, where: list[str | int], knob: str, value: Any) -> None:
    if knob == "preset" and family.presets:
        if value not in family.presets:
            raise FieldProblem(
                where,
                f"unknown preset {value!r} for family {family.name} "
                f"(allowed: {', '.join(family.presets)}){did_you_mean(str(value), family.presets)}",
            )
        return
    if knob not in family.knob_names:
        allowed = family.knob_names + (["preset"] if family.presets else [])
        raise FieldProblem(
            where,
            f"unknown knob {knob!r} for family {family.name} "
            f"(allowed: {', '.join(allowed)}){did_you_mean(knob, allowed)}",
        )
    spec = next(k for k in family.knobs if k.name == knob)
    if isinstance(value, bool) or not isinstance(value, int) or value < spec.minimum:
        kind = "a positive integer" if spec.minimum == 1 else f"an integer >= {spec.minimum}"
        raise FieldProblem(where, f"must be {kind} (got {value!r})")
    if spec.choices and value not in spec.choices:
        raise FieldProblem(
            where, f"must be one of {', '.join(map(str, spec.choices))} (got {value!r})"
        )


class DataSpec(Strict):
    dataset: str = "digits"
    data_dir: str = "data"
    download: bool = False
    test_fraction: float = Field(0.2, gt=0, lt=1)
    shape: list[PositiveInt] | None = Field(None, min_length=1)
    num_classes: int | None = Field(None, ge=2)
    num_samples: int | None = Field(None, ge=2)

    @field_validator("dataset")
    @classmethod
    def known_dataset(cls, name: str) -> str:
        return require_known("dataset", name, DATASETS)

    @model_validator(mode="after")
    def options_fit_dataset(self) -> DataSpec:
        used = DATASETS[self.dataset].options
        for key in ("shape", "num_classes", "num_samples", "data_dir", "download", "test_fraction"):
            if key in self.model_fields_set and key not in used:
                users = [name for name, info in DATASETS.items() if key in info.options]
                raise FieldProblem(
                    [key], f"only applies to dataset {' or '.join(users)}, not {self.dataset!r}"
                )
        return self

    def options(self) -> dict[str, Any]:
        """What the dataset loader receives (only what the dataset uses, so keys stay stable)."""
        chosen: dict[str, Any] = {}
        for key in DATASETS[self.dataset].options:
            value = getattr(self, key)
            if value is not None:
                chosen[key] = value
        return chosen


def _strategy_entry(entry: Any) -> str:
    terms = entry if isinstance(entry, list) else [entry]
    if not terms or not all(isinstance(t, str) and t.strip() for t in terms):
        raise ValueError("each entry is a strategy name or a list of names")
    try:
        return "+".join(strategies.canonical(terms))
    except ValueError as error:
        message = str(error)
        if message.startswith("unknown strategy"):
            bad = next(t for t in terms if t.partition(":")[0].strip() not in strategies.STRATEGIES)
            name = bad.partition(":")[0].strip()
            message += (
                f" (allowed: {', '.join(strategies.STRATEGIES)})"
                f"{did_you_mean(name, strategies.STRATEGIES)}"
            )
        raise ValueError(message) from None


def _no_duplicates(values: list[Any]) -> list[Any]:
    seen: list[Any] = []
    for index, value in enumerate(values):
        if value in seen:
            raise FieldProblem([index], f"duplicate value {value!r}")
        seen.append(value)
    return values


class GridSpec(Strict):
    batch_size: Annotated[list[PositiveInt], AfterValidator(_no_duplicates)] = Field(min_length=1)
    dtype: Annotated[list[Literal["fp32", "bf16", "fp16"]], AfterValidator(_no_duplicates)] = Field(
        ["fp32"], min_length=1
    )
    strategy: Annotated[
        list[Annotated[Any, AfterValidator(_strategy_entry)]], AfterValidator(_no_duplicates)
    ] = Field(["none"], min_length=1)


class OptimizerSpec(Strict):
    name: Literal["adam", "adamw", "sgd"] = "adam"
    lr: PositiveFloat = 1e-3
    weight_decay: float = Field(0.0, ge=0)
    momentum: float = Field(0.0, ge=0, lt=1)
    foreach: bool = False

    @model_validator(mode="after")
    def momentum_is_sgd_only(self) -> OptimizerSpec:
        if self.momentum and self.name != "sgd":
            raise FieldProblem(["momentum"], f"only applies to optimizer sgd, not {self.name!r}")
        return self


class BudgetSpec(Strict):
    epochs: PositiveInt | None = None
    steps: PositiveInt | None = None

    @model_validator(mode="after")
    def exactly_one(self) -> BudgetSpec:
        if (self.epochs is None) == (self.steps is None):
            raise ValueError("give exactly one of epochs or steps")
        return self

    def as_dict(self) -> dict[str, int]:
        return (
            {"epochs": self.epochs} if self.epochs is not None else {"steps": int(self.steps or 0)}
        )


class TrainSpec(Strict):
    optimizer: OptimizerSpec = OptimizerSpec()
    budget: BudgetSpec = BudgetSpec(epochs=1)
    seed: int = Field(0, ge=0)


class MeasureSpec(Strict):
    warmup_steps: int = Field(2, ge=1)  # >= 1: the optimizer state must exist before measuring
    memory_steps: int = Field(2, ge=1)
    timed_steps: int = Field(10, ge=1)
    # Record the memory timeline in the (untimed) memory window: a JSON + PNG per trial.
    timeline: bool = True


class ObjectiveSpec(Strict):
    metric: str
    direction: Literal["minimize", "maximize"]

    @field_validator("metric")
    @classmethod
    def known_metric(cls, metric: str) -> str:
        return require_known("metric", metric, METRICS)


DEFAULT_OBJECTIVES = [
    ObjectiveSpec(metric="peak_allocated_bytes", direction="minimize"),
    ObjectiveSpec(metric="throughput", direction="maximize"),
    ObjectiveSpec(metric="accuracy", direction="maximize"),
]


class SearchSpec(Strict):
    """``grid`` runs every point; ``optuna`` lets a multi-objective sampler pick ``n_trials`` of
    them (the grid's axes are its search space), learning from each result."""

    method: Literal["grid", "optuna"] = "grid"
    sampler: Literal["tpe", "nsga2", "nsga3", "random"] = "tpe"
    n_trials: int | None = Field(None, ge=1)
    objectives: list[ObjectiveSpec] = Field(DEFAULT_OBJECTIVES, min_length=1)

    @model_validator(mode="after")
    def optuna_settings(self) -> SearchSpec:
        if self.method == "grid":
            for key in ("sampler", "n_trials"):
                if key in self.model_fields_set:
                    raise FieldProblem([key], "only applies to method: optuna (this is grid)")
        elif self.n_trials is None:
            raise FieldProblem(
                ["n_trials"], "required with method: optuna (how many trials to run)"
            )
        metrics = [o.metric for o in self.objectives]
        for index, metric in enumerate(metrics):
            if metrics.index(metric) != index:
                raise FieldProblem(["objectives", index, "metric"], f"{metric!r} is listed twice")
        return self


def _seconds(value: Any) -> float:
    return parse_seconds(value)


def _bytes(value: Any) -> int:
    return parse_bytes(value)


class LimitsSpec(Strict):
    trial_timeout: Annotated[Any, AfterValidator(_seconds)] = 600.0
    retries: int = Field(0, ge=0, le=10)
    run_infeasible: bool = False  # run trials predicted over device_memory / host RAM anyway


class TrackingSpec(Strict):
    mlflow_uri: str = "sqlite:///results/mlflow.db"
    storage: str = "sqlite:///results/optuna.db"
    experiment: str | None = None
    results_dir: str = "results"


class Spec(Strict):
    name: str
    description: str = ""
    model: ModelSpec
    data: DataSpec = DataSpec()
    grid: GridSpec
    train: TrainSpec = TrainSpec()
    measure: MeasureSpec = MeasureSpec()
    device: str = "auto"
    device_memory: Annotated[Any, AfterValidator(_bytes)] | None = None
    search: SearchSpec = SearchSpec()
    limits: LimitsSpec = LimitsSpec()
    tracking: TrackingSpec = TrackingSpec()
    # Set by parse_spec: where the spec came from (user model code is imported from there).
    _source: str = PrivateAttr("")

    @field_validator("name")
    @classmethod
    def usable_name(cls, name: str) -> str:
        if not NAME_RE.match(name):
            raise ValueError(
                "use letters, digits, '_', '-' and '.', starting with a letter or digit"
            )
        return name

    @field_validator("device")
    @classmethod
    def known_device(cls, device: str) -> str:
        if not DEVICE_RE.match(device):
            raise ValueError("must be auto, cpu, cuda or cuda:N")
        return device

    @model_validator(mode="after")
    def axes_fit_together(self) -> Spec:
        family = FAMILIES.get(self.model.family)
        if family is not None and self.data.dataset not in family.datasets:
            raise FieldProblem(
                ["data", "dataset"],
                f"model family {family.name} trains on {' or '.join(family.datasets)}, "
                f"not {self.data.dataset!r}",
            )
        for index, entry in enumerate(self.grid.strategy):
            terms = entry.split("+")
            device = self.device
            if device == "auto" and any(
                strategies.STRATEGIES[strategies.parse_term(t)[0]].devices != strategies.ALL_DEVICES
                for t in terms
            ):
                device = local_device()
            for dtype, batch_size in itertools.product(self.grid.dtype, self.grid.batch_size):
                try:
                    strategies.check_context(terms, dtype, self.model.family, device, batch_size)
                except ValueError as error:
                    raise FieldProblem(["grid", "strategy", index], str(error)) from None
        return self

    @model_validator(mode="after")
    def search_fits_the_grid(self) -> Spec:
        size = math.prod(len(values) for values in self.axes().values())
        if self.search.n_trials is not None and self.search.n_trials > size:
            raise FieldProblem(
                ["search", "n_trials"],
                f"{self.search.n_trials} exceeds the grid's {size} points "
                "(use method: grid to run them all)",
            )
        return self

    @property
    def experiment(self) -> str:
        return self.tracking.experiment or self.name

    # ---- expansion ----------------------------------------------------------------------------

    def axes(self) -> dict[str, list[Any]]:
        """The grid's axes in order; the trial set is their product."""
        return {
            "model_size": list(self.model.sizes),
            "batch_size": list(self.grid.batch_size),
            "dtype": list(self.grid.dtype),
            "strategy": list(self.grid.strategy),
        }

    def trial_config(self, point: dict[str, Any]) -> TrialConfig:
        """The trial at one grid point (``point`` maps each axis name to a value)."""
        size = point["model_size"]
        spec_dir = str(Path(self._source).resolve().parent) if self._source else str(Path.cwd())
        return TrialConfig(
            experiment=self.experiment,
            model_family=self.model.family,
            model_size=size,
            model_knobs=dict(self.model.sizes[size]),
            dataset=self.data.dataset,
            data_options=self.data.options(),
            batch_size=int(point["batch_size"]),
            dtype=point["dtype"],
            strategy=point["strategy"].split("+"),
            optimizer=self.train.optimizer.model_dump(),
            budget=self.train.budget.as_dict(),
            seed=self.train.seed,
            warmup_steps=self.measure.warmup_steps,
            memory_steps=self.measure.memory_steps,
            timed_steps=self.measure.timed_steps,
            device=self.device,
            device_memory_bytes=self.device_memory,
            python_path=[spec_dir, str(Path.cwd())],
            run_infeasible=self.limits.run_infeasible,
            timeline=self.measure.timeline,
        )

    def points(self) -> list[dict[str, Any]]:
        axes = self.axes()
        return [
            dict(zip(axes, values, strict=True)) for values in itertools.product(*axes.values())
        ]

    def trials(self) -> list[TrialConfig]:
        return [self.trial_config(point) for point in self.points()]

    def grid_hash(self) -> str:
        """Identifies the set of trials: the same spec resumes its sweep, a changed grid starts anew."""
        keys = sorted(config.trial_key for config in self.trials())
        return hashlib.sha256("\n".join(keys).encode()).hexdigest()[:10]


def local_device() -> str:
    """What ``device: auto`` means on this machine (imports torch: only asked when it matters)."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


# ---- loading with one-line errors ----------------------------------------------------------

FRIENDLY = {
    "missing": "required key is missing",
    "too_short": "must list at least one value",
    "greater_than": "must be greater than {gt}",
    "greater_than_equal": "must be at least {ge}",
    "less_than": "must be less than {lt}",
    "less_than_equal": "must be at most {le}",
    "int_type": "must be an integer",
    "int_parsing": "must be an integer",
    "int_from_float": "must be an integer",
    "float_type": "must be a number",
    "float_parsing": "must be a number",
    "bool_type": "must be true or false",
    "bool_parsing": "must be true or false",
    "string_type": "must be a string",
    "list_type": "must be a list",
    "dict_type": "must be a mapping of keys to values",
    "model_type": "must be a mapping of keys to values",
    "model_attributes_type": "must be a mapping of keys to values",
}


def _dotted(loc: typing.Sequence[str | int]) -> str:
    text = ""
    for part in loc:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text or "(top level)"


def _model_at(loc: typing.Sequence[str | int]) -> type[BaseModel] | None:
    """The pydantic model that owns the mapping at ``loc`` (to list its allowed keys)."""
    annotation: Any = Spec
    for part in loc:
        model = _find_model(annotation)
        if model is not None and isinstance(part, str) and part in model.model_fields:
            annotation = model.model_fields[part].annotation
        elif model is None:
            annotation = _inner(annotation)
    return _find_model(annotation)


def _inner(annotation: Any) -> Any:
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    return args[-1] if args else annotation


def _find_model(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(annotation):
            found = _find_model(arg)
            if found is not None:
                return found
    return None


def format_error(source: str, error: dict[str, Any]) -> str:
    loc = list(error["loc"])
    kind = error["type"]
    problem = (error.get("ctx") or {}).get("error")
    if isinstance(problem, FieldProblem):
        loc += problem.subpath
        message = problem.message
    elif kind == "extra_forbidden":
        key = str(loc[-1])
        model = _model_at(loc[:-1])
        allowed = list(model.model_fields) if model else []
        hint = f" (allowed: {', '.join(allowed)}){did_you_mean(key, allowed)}" if allowed else ""
        return f"{source}: {_dotted(loc)}: unknown key{hint}"
    elif kind in FRIENDLY:
        message = FRIENDLY[kind].format(**(error.get("ctx") or {}))
    else:
        message = error["msg"].removeprefix("Value error, ")
        if kind == "literal_error":
            expected_text = str((error.get("ctx") or {}).get("expected", ""))
            message = f"must be one of {expected_text}"
            if isinstance(error.get("input"), str):
                message += did_you_mean(error["input"], re.findall(r"'([^']*)'", expected_text))
    value = error.get("input")
    # Echo the bad value unless it is a whole section or a list the message already names.
    echo = not isinstance(value, dict) and not (isinstance(value, list) and value)
    if kind != "missing" and echo and repr(value) not in message:
        message += f" (got {value!r})"
    return f"{source}: {_dotted(loc)}: {message}"


def parse_spec(data: Any, source: str = "<spec>") -> Spec:
    """Validate an already-parsed YAML document; raise ``SpecError`` with one line per problem."""
    if not isinstance(data, dict):
        raise SpecError(
            f"{source}: the spec must be a YAML mapping of keys (name, model, grid, ...)"
        )
    try:
        spec = Spec.model_validate(data)
    except ValidationError as error:
        raise SpecError("\n".join(format_error(source, e) for e in error.errors())) from None
    spec._source = source
    return spec


def load_spec(path: str | Path) -> Spec:
    path = Path(path)
    if not path.is_file():
        raise SpecError(f"{path}: no such spec file")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        problem = getattr(error, "problem", None) or str(error).splitlines()[0]
        raise SpecError(f"{where}: invalid YAML: {problem}") from None
    except (OSError, UnicodeDecodeError) as error:
        raise SpecError(f"{path}: cannot read: {error}") from None
    if data is None:
        raise SpecError(f"{path}: the spec is empty")
    return parse_spec(data, str(path))
