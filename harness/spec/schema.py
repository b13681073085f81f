"""The YAML experiment spec as pydantic models: every key, its default and its checks.

Key names are a contract with users (docs/architecture.md); every key is documented in
the README. Unknown keys are errors, so a typo never silently changes a sweep. Validators
complain with ``FieldProblem`` (a place inside the field) or ``ValueError``; ``spec.load``
turns either into one line.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import re
from collections.abc import Iterator
from typing import Annotated, Any, Literal, cast, get_args

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    PositiveFloat,
    PositiveInt,
    PrivateAttr,
    field_validator,
    model_validator,
)

from harness import strategies
from harness.contract import (
    AXES,
    DEFAULT_MLFLOW_URI,
    DEFAULT_OBJECTIVES,
    DEFAULT_RESULTS_DIR,
    DEFAULT_STORAGE,
    DEFAULT_TEST_FRACTION,
    Direction,
    DType,
    SpecOptimizer,
)
from harness.cuda.allocator import AllocatorConfig
from harness.cuda.cards import CATALOGUE, Card
from harness.metrics import CUDA_ONLY_METRICS, METRICS, Objective
from harness.spec.errors import FieldProblem, did_you_mean, require_known
from harness.strategies.combination import Combination
from harness.strategies.settings import (
    DEFAULT_LORA,
    DEFAULT_OPTIMIZER,
    LoraSettings,
    OptimizerSettings,
)
from harness.trial.config import Budget, BudgetError, Target
from harness.units import parse_bytes, parse_seconds
from harness.workloads import (
    DATASETS,
    FAMILIES,
    Family,
    is_user_code,
    resolve_knobs,
)
from harness.workloads.hf_presets import HFDatasetFormat
from harness.workloads.sizes import training_samples

DEVICE_RE = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# Metrics a trial records only with a train.budget.target.
TARGET_METRICS = ("reached_target", "steps_to_target", "time_to_target_s")


# ---- sections ------------------------------------------------------------------------------


def known_or_user_code(kind: str, name: str, registry: dict[str, Any], yours: str) -> str:
    """A registered name, or ``package.module:attr`` naming the user's own code."""
    if is_user_code(name):
        return name
    return require_known(kind, name, registry, f"or package.module:attr for {yours}")


def _user_code(value: str | None) -> str | None:
    if value is not None and not is_user_code(value):
        raise ValueError("name it as package.module:function")
    return value


class ModelSpec(Strict):
    family: str
    sizes: dict[str, dict[str, Any]] = Field(min_length=1)
    # Your own model's loss: module:function taking (outputs, batch); else the model's own.
    loss: Annotated[str | None, AfterValidator(_user_code)] = None

    @field_validator("family")
    @classmethod
    def known_family(cls, family: str) -> str:
        return known_or_user_code("model family", family, FAMILIES, "your own code")

    @model_validator(mode="after")
    def known_knobs(self) -> ModelSpec:
        family = FAMILIES.get(self.family)
        if family is None:
            return self  # user code receives its knobs as keyword arguments, unchecked
        if self.loss is not None:
            raise FieldProblem(
                ["loss"],
                f"only applies to your own model code (family module:attr), not {family.name}",
            )
        for size, knobs in self.sizes.items():
            if not NAME_RE.match(size):
                raise FieldProblem(["sizes", size], "size names use letters, digits, '_', '-', '.'")
            for knob, value in knobs.items():
                check_knob(family, ["sizes", size, knob], knob, value)
            check_sources(family, ["sizes", size], knobs)
            check_weights(family, ["sizes", size], knobs)
            resolved = resolve_knobs(self.family, knobs)
            for multiple, of in family.divisible:
                if resolved[multiple] % resolved[of]:
                    raise FieldProblem(
                        ["sizes", size, multiple],
                        f"{multiple} {resolved[multiple]} must be a multiple of {of} {resolved[of]}",
                    )
        return self


def check_knob(family: Family, where: list[str | int], knob: str, value: Any) -> None:
    if knob == "pretrained":
        if not family.weights:
            with_weights = [name for name, known in FAMILIES.items() if known.weights]
            raise FieldProblem(
                where,
                f"family {family.name} has no pretrained weights to load "
                f"(pretrained applies to {', '.join(with_weights)})",
            )
        if not isinstance(value, bool):
            raise FieldProblem(where, f"must be true or false (got {value!r})")
        return
    if knob == "preset" and family.presets:
        if value not in family.presets:
            raise FieldProblem(
                where,
                f"unknown preset {value!r} for family {family.name} "
                f"(allowed: {', '.join(family.presets)}){did_you_mean(str(value), family.presets)}",
            )
        return
    if knob in family.text_knobs:
        allowed = family.text_knobs[knob]
        if not isinstance(value, str) or not value:
            raise FieldProblem(where, f"must be a string (got {value!r})")
        if allowed and value not in allowed:
            raise FieldProblem(
                where,
                f"must be one of {', '.join(allowed)}{did_you_mean(value, allowed)} (got {value!r})",
            )
        return
    if knob not in family.knob_names:
        if family.free_knobs:
            return  # passed through to the library (a config attribute, a keyword)
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


def check_sources(family: Family, where: list[str | int], knobs: dict[str, Any]) -> None:
    """A family whose knobs are free needs a size to say what it builds from, once."""
    if not family.sources:
        return
    given = [k for k in family.sources if k in knobs]
    if not given:
        raise FieldProblem(where, f"a {family.name} size needs one of {', '.join(family.sources)}")
    exclusive = [k for k in given if k in family.exclusive]
    if len(exclusive) > 1:
        raise FieldProblem(
            where, f"give only one of {', '.join(exclusive)} (a size builds from one source)"
        )


def check_weights(family: Family, where: list[str | int], knobs: dict[str, Any]) -> None:
    """``pretrained: true`` needs a knob naming where its weights are; a knob that only names
    weights (timm's ``pretrained_file``) needs ``pretrained: true``, else it loads nothing."""
    pretrained = knobs.get("pretrained") is True
    if pretrained and not any(k in knobs for k in family.weights):
        raise FieldProblem(
            [*where, "pretrained"],
            f"needs {' or '.join(family.weights)} beside it, naming the weights to load",
        )
    for knob in family.weights:
        if knob in knobs and knob not in family.sources and not pretrained:
            raise FieldProblem([*where, knob], "loads nothing without pretrained: true beside it")


USER_DATA_OPTIONS = ("args", "test_fraction", "num_classes")


class DataSpec(Strict):
    dataset: str = "digits"
    data_dir: str = "data"
    download: bool = False
    test_fraction: float = Field(default=DEFAULT_TEST_FRACTION, gt=0, lt=1)
    shape: list[PositiveInt] | None = Field(default=None, min_length=1)
    num_classes: int | None = Field(default=None, ge=2)
    num_samples: int | None = Field(default=None, ge=2)
    seq_len: PositiveInt | None = None
    corpus: Literal["all", "first_half", "second_half"] | None = None  # text: which topics
    vocab_size: int | None = Field(default=None, ge=2)
    format: HFDatasetFormat | None = None
    data_files: str | list[str] | None = None
    text_column: str | None = None
    image_column: str | None = None
    label_column: str | None = None
    tokenizer: str | None = None
    args: dict[str, Any] | None = None  # keyword arguments of your own data function

    @field_validator("dataset")
    @classmethod
    def known_dataset(cls, name: str) -> str:
        return known_or_user_code("dataset", name, DATASETS, "your own data")

    def used_options(self) -> tuple[str, ...]:
        if is_user_code(self.dataset):
            return USER_DATA_OPTIONS
        return DATASETS[self.dataset].options

    @model_validator(mode="after")
    def options_fit_dataset(self) -> DataSpec:
        used = self.used_options()
        for key in self.model_fields_set - {"dataset"}:
            if key not in used:
                users = [name for name, info in DATASETS.items() if key in info.options]
                if key in USER_DATA_OPTIONS:
                    users.append("your own (module:function)")
                raise FieldProblem(
                    [key], f"only applies to dataset {' or '.join(users)}, not {self.dataset!r}"
                )
        if self.dataset == "hf_dataset" and not self.data_files:
            raise FieldProblem(
                ["data_files"], "required with dataset hf_dataset (a file or a list)"
            )
        return self

    def options(self) -> dict[str, Any]:
        """What the dataset loader receives (only what the dataset uses, so keys stay stable)."""
        chosen: dict[str, Any] = {}
        for key in self.used_options():
            value = getattr(self, key)
            if value is not None:
                chosen[key] = value
        return chosen


def _strategy_entry(entry: Any) -> Combination:
    """One ``grid.strategy`` entry, parsed and checked once (the grid's points and trials
    reuse the result)."""
    terms = entry if isinstance(entry, list) else [entry]
    if not terms or not all(isinstance(t, str) and t.strip() for t in terms):
        raise ValueError("each entry is a strategy name or a list of names")
    try:
        return Combination.parse(terms)
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
            shown = value.text if isinstance(value, Combination) else value
            raise FieldProblem([index], f"duplicate value {shown!r}")
        seen.append(value)
    return values


# ``grid.batch_size: [max]``: the largest batch whose predicted peak fits ``device_memory``,
# found by the sweep (``harness.sweep.prepare.resolve_max_batch``) for each size, dtype, strategy.
MAX_BATCH = "max"


def _batch_entry(value: Any) -> int | str:
    """A positive integer, or ``max``."""
    if value == MAX_BATCH:
        return MAX_BATCH
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        hint = did_you_mean(value, [MAX_BATCH]) if isinstance(value, str) else ""
        raise ValueError(f"must be a positive integer or {MAX_BATCH} (the largest that fits){hint}")
    if value <= 0:
        raise ValueError("must be greater than 0")
    return value


class GridSpec(Strict):
    batch_size: Annotated[
        list[Annotated[Any, AfterValidator(_batch_entry)]], AfterValidator(_no_duplicates)
    ] = Field(min_length=1)
    dtype: Annotated[list[DType], AfterValidator(_no_duplicates)] = Field(
        default=["fp32"], min_length=1
    )
    # Each entry a validated Combination; grid points hold its text (``Spec.axes``).
    strategy: Annotated[
        list[Annotated[Any, AfterValidator(_strategy_entry)]], AfterValidator(_no_duplicates)
    ] = Field(default=["none"], min_length=1, validate_default=True)

    def combination(self, text: str) -> Combination:
        """The validated combination a grid point names by its text."""
        for combination in self.strategy:
            if combination.text == text:
                return combination
        return Combination.parse(text)  # not one of this grid's (a hand-made point)


class OptimizerSpec(Strict):
    """``train.optimizer``; the defaults are ``OptimizerSettings``'."""

    name: SpecOptimizer = cast(SpecOptimizer, DEFAULT_OPTIMIZER.name)
    lr: PositiveFloat = DEFAULT_OPTIMIZER.lr
    weight_decay: float = Field(default=DEFAULT_OPTIMIZER.weight_decay, ge=0)
    momentum: float = Field(default=DEFAULT_OPTIMIZER.momentum, ge=0, lt=1)
    foreach: bool = DEFAULT_OPTIMIZER.foreach

    def settings(self) -> OptimizerSettings:
        return OptimizerSettings(**self.model_dump())

    @model_validator(mode="after")
    def momentum_is_sgd_only(self) -> OptimizerSpec:
        if self.momentum and self.name != "sgd":
            raise FieldProblem(["momentum"], f"only applies to optimizer sgd, not {self.name!r}")
        return self


@contextlib.contextmanager
def at_its_key() -> Iterator[None]:
    """A ``BudgetError`` reported at the budget's (or target's) key it names."""
    try:
        yield
    except BudgetError as error:
        if not error.field:
            raise ValueError(error.reason) from None
        raise FieldProblem([error.field], error.reason) from None


class TargetSpec(Strict):
    """``train.budget.target``: a quality to train until (``harness.trial.config.Target``)."""

    metric: Literal["eval_loss", "perplexity", "accuracy"]
    below: float | None = None
    above: float | None = None

    @model_validator(mode="after")
    def bound_for_the_metric(self) -> TargetSpec:
        with at_its_key():  # Target says what a valid one is
            self.target()
        return self

    def target(self) -> Target:
        return Target(self.metric, self.below, self.above)


class BudgetSpec(Strict):
    epochs: PositiveInt | None = None
    steps: PositiveInt | None = None
    max_steps: PositiveInt | None = None
    eval_every: PositiveInt | None = None
    target: TargetSpec | None = None

    @model_validator(mode="after")
    def exactly_one(self) -> BudgetSpec:
        with at_its_key():  # Budget says what a valid one is
            self.budget()
        return self

    def budget(self) -> Budget:
        target = None if self.target is None else self.target.target()
        return Budget(self.epochs, self.steps, self.max_steps, self.eval_every, target)

    def as_dict(self) -> dict[str, Any]:
        """What is set, as the trial JSON and the MLflow ``budget`` param write it."""
        return self.budget().to_dict()


LoraBaseDType = Literal["auto", "fp32", "bf16", "fp16"]


class LoraSpec(Strict):
    """Settings of the lora/qlora strategies (their rank is the strategy's argument); what each
    means and its default: ``LoraSettings``."""

    alpha: PositiveFloat | None = DEFAULT_LORA.alpha
    dropout: float = Field(default=DEFAULT_LORA.dropout, ge=0, lt=1)
    targets: list[Annotated[str, Field(min_length=1)]] | None = Field(
        default=None if DEFAULT_LORA.targets is None else list(DEFAULT_LORA.targets), min_length=1
    )
    base_dtype: LoraBaseDType = cast(LoraBaseDType, DEFAULT_LORA.base_dtype)

    def settings(self) -> LoraSettings:
        return LoraSettings.from_dict(self.model_dump())


class TrainSpec(Strict):
    optimizer: OptimizerSpec = OptimizerSpec()
    lora: LoraSpec = LoraSpec()
    budget: BudgetSpec = BudgetSpec(epochs=1)
    seed: int = Field(default=0, ge=0)
    # Runs of each trial whose throughputs are compared (``harness.sweep.repeats``): the
    # spread between runs is what a single run cannot show, its timed steps' spread aside.
    repeats: int = Field(default=1, ge=1, le=20)


class MeasureSpec(Strict):
    # >= 1: the optimizer state must exist before measuring.
    warmup_steps: int = Field(default=2, ge=1)
    memory_steps: int = Field(default=2, ge=1)
    timed_steps: int = Field(default=10, ge=1)
    # Record the memory timeline in the (untimed) memory window: a JSON + PNG per trial.
    timeline: bool = True
    # CUDA only: record the caching allocator's history in the memory window and dump it for
    # PyTorch's memory viewer (bounded, but it costs host memory and time: off unless asked).
    allocator_snapshot: bool = False


class ObjectiveSpec(Strict):
    """How a spec writes an objective (validated); ``objective()`` is the one type the rest
    of harness uses."""

    metric: str
    direction: Direction

    def objective(self) -> Objective:
        return Objective(self.metric, self.direction)

    @field_validator("metric")
    @classmethod
    def known_metric(cls, metric: str) -> str:
        return require_known("metric", metric, METRICS)


class SearchSpec(Strict):
    """``grid`` runs every point; ``optuna`` lets a multi-objective sampler pick ``n_trials`` of
    them (the grid's axes are its search space), learning from each result."""

    method: Literal["grid", "optuna"] = "grid"
    sampler: Literal["tpe", "nsga2", "nsga3", "random"] = "tpe"
    n_trials: int | None = Field(default=None, ge=1)
    objectives: list[ObjectiveSpec] = Field(
        default=[ObjectiveSpec(metric=m, direction=d) for m, d in DEFAULT_OBJECTIVES], min_length=1
    )

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
    try:
        return parse_bytes(value)
    except OverflowError:  # .inf: int(inf) raises this, which pydantic lets through as a crash
        raise ValueError("must be a finite size") from None


def _allocator(value: str | None) -> str | None:
    """PYTORCH_CUDA_ALLOC_CONF text, checked by the allocator model's own parser (the rules
    the installed PyTorch validates by); kept as written."""
    if value is not None:
        AllocatorConfig.parse(value)
    return value


class LimitsSpec(Strict):
    trial_timeout: Annotated[Any, AfterValidator(_seconds)] = 600.0
    retries: int = Field(default=0, ge=0, le=10)
    run_infeasible: bool = False  # run trials predicted over device_memory / host RAM anyway


class TrackingSpec(Strict):
    mlflow_uri: str = DEFAULT_MLFLOW_URI
    storage: str = DEFAULT_STORAGE
    experiment: str | None = None
    results_dir: str = DEFAULT_RESULTS_DIR


# ``launcher.name`` (and ``harness sweep --launcher``): who starts the sweep's workers.
Launcher = Literal["local", "slurm", "ray"]
LAUNCHERS: tuple[Launcher, ...] = get_args(Launcher)
SLURM_OPTION = re.compile(r"^slurm_[a-z][a-z0-9_]*$")


class SlurmSpec(BaseModel):
    """``launcher.slurm``: a submitit job array of workers. Keys ``slurm_<option>`` go to
    submitit as they are (``slurm_qos``, ``slurm_constraint``, ``slurm_setup``,
    ``slurm_additional_parameters``, ...); submitit's own list is checked at submission."""

    model_config = ConfigDict(extra="allow", frozen=True)

    jobs: PositiveInt = 1
    # slurm: sbatch; local: submitit's LocalExecutor runs the jobs on this host (to try a recipe)
    cluster: Literal["slurm", "local"] = "slurm"
    partition: str | None = None
    account: str | None = None
    cpus_per_task: PositiveInt | None = None
    mem: Annotated[Any, AfterValidator(_bytes)] | None = None
    time: Annotated[Any, AfterValidator(_seconds)] = 3600.0

    @model_validator(mode="after")
    def only_slurm_options(self) -> SlurmSpec:
        for key in self.model_extra or {}:
            if not SLURM_OPTION.match(key):
                allowed = [*type(self).model_fields, "slurm_<option>"]
                raise FieldProblem(
                    [key],
                    f"unknown key (allowed: {', '.join(allowed)})"
                    f"{did_you_mean(key, type(self).model_fields)}",
                )
        return self

    def passthrough(self) -> dict[str, Any]:
        """The ``slurm_<option>`` keys, for submitit."""
        return dict(self.model_extra or {})


class RaySpec(Strict):
    """``launcher.ray``: one Ray actor per worker."""

    address: str | None = None  # ray.init(address=...); None: a local cluster for the sweep
    workers: PositiveInt = 1
    cpus_per_worker: PositiveFloat = 1.0
    retries: int = Field(default=3, ge=0, le=100)  # restarts of a lost actor (node loss, a kill)


class LauncherSpec(Strict):
    name: Launcher = "local"
    slurm: SlurmSpec = SlurmSpec()
    ray: RaySpec = RaySpec()


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
    # The card planned for (``harness.cuda.cards``: a catalogue name or one of ``cards``); its
    # memory is the budget when device_memory is not set.
    card: str | None = None
    cards: str | None = None  # a YAML file of your own cards, relative to the spec
    # The CUDA caching allocator's settings, PYTORCH_CUDA_ALLOC_CONF syntax
    # ("expandable_segments:True,max_split_size_mb:128"): set for every trial, and predicted.
    allocator: Annotated[str | None, AfterValidator(_allocator)] = None
    search: SearchSpec = SearchSpec()
    limits: LimitsSpec = LimitsSpec()
    tracking: TrackingSpec = TrackingSpec()
    launcher: LauncherSpec = LauncherSpec()
    # Set by parse_spec: where the spec came from (user model code is imported from there).
    _source: str = PrivateAttr("")
    # (What a sweep resolves on a host, its hardware and ``batch_size: max``, is not kept here:
    # ``harness.spec.grid.SweepPlan``.)
    # Set by parse_spec from ``cards`` (``harness.spec.load.load_cards``): your own cards by name.
    _cards: dict[str, Card] = PrivateAttr(default_factory=dict)

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
        user_data = is_user_code(self.data.dataset)
        if family is not None and not user_data and self.data.dataset not in family.datasets:
            raise FieldProblem(
                ["data", "dataset"],
                f"model family {family.name} trains on {' or '.join(family.datasets)}, "
                f"not {self.data.dataset!r}",
            )
        for index, combination in enumerate(self.grid.strategy):
            device = self.device
            if device == "auto" and any(
                info.devices != strategies.ALL_DEVICES for info in combination.infos
            ):
                device = local_device()
            for dtype, batch in itertools.product(self.grid.dtype, self.grid.batch_size):
                # max becomes a multiple of what the strategies split a batch into
                batch_size = combination.batch_step if batch == MAX_BATCH else batch
                try:
                    combination.check_context(dtype, self.model.family, device, batch_size)
                except ValueError as error:
                    raise FieldProblem(["grid", "strategy", index], str(error)) from None
        return self

    @model_validator(mode="after")
    def batches_fit_the_data(self) -> Spec:
        """A batch larger than a fixed dataset's training split cannot be drawn: say so now,
        not in each trial."""
        given = [b for b in self.grid.batch_size if b != MAX_BATCH]
        if not given:
            return self  # max searches no further than the training split
        largest = max(given)
        for size, knobs in self.model.sizes.items():
            options = dict(self.data.options())
            resolved = resolve_knobs(self.model.family, knobs)
            if "seq_len" in resolved:  # as TrialConfig.dataset_options does
                options.setdefault("seq_len", resolved["seq_len"])
            samples = training_samples(self.data.dataset, options)
            if samples is None or largest <= samples:
                continue
            unit = (
                f"windows of seq_len {options.get('seq_len', 128)}"
                if self.data.dataset == "text"
                else "samples"
            )
            raise FieldProblem(
                ["grid", "batch_size", self.grid.batch_size.index(largest)],
                f"{largest} is larger than the training split of dataset {self.data.dataset} "
                f"({samples} {unit} for model size {size}); use at most {samples}",
            )
        return self

    @model_validator(mode="after")
    def max_batch_needs_a_budget(self) -> Spec:
        if MAX_BATCH in self.grid.batch_size and self.device_memory is None and not self.card:
            raise FieldProblem(
                ["grid", "batch_size", self.grid.batch_size.index(MAX_BATCH)],
                f"{MAX_BATCH} is the largest batch that fits device_memory, which is not set: "
                "set device_memory (e.g. 16GiB) or a card (e.g. h100-80gb), or list integers",
            )
        return self

    @model_validator(mode="after")
    def auto_needs_a_budget(self) -> Spec:
        if self.device_memory is not None or self.card:
            return self
        for index, combination in enumerate(self.grid.strategy):
            if combination.chooses_for_budget:
                raise FieldProblem(
                    ["grid", "strategy", index],
                    f"{combination.text} chooses how much to recompute for device_memory, which "
                    "is not set: set device_memory (e.g. 16GiB) or a card (e.g. h100-80gb)",
                )
        return self

    @model_validator(mode="after")
    def card_is_known(self) -> Spec:
        """A catalogue card is checked here; one from ``cards`` once that file is read."""
        if self.card is not None and self.cards is None and self.card.lower() not in CATALOGUE:
            raise FieldProblem(
                ["card"],
                f"unknown card {self.card!r} (known: {', '.join(sorted(CATALOGUE))}; or add "
                f"your own in a file named by cards:){did_you_mean(self.card, list(CATALOGUE))}",
            )
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

    @model_validator(mode="after")
    def objectives_measured_here(self) -> Spec:
        """A CUDA-only metric as an objective of CPU trials would fail every trial (Optuna is
        told nothing) and leave the front empty: refused now."""
        for index, objective in enumerate(self.search.objectives):
            if objective.metric not in CUDA_ONLY_METRICS:
                continue
            device = local_device() if self.device == "auto" else self.device
            if device == "cpu":
                raise FieldProblem(
                    ["search", "objectives", index, "metric"],
                    f"{objective.metric} is measured on CUDA GPUs only and this spec's trials "
                    f"run on cpu (device: {self.device}); choose another objective",
                )
        return self

    @model_validator(mode="after")
    def quality_measured_here(self) -> Spec:
        """``perplexity`` exists for language models only, and the time-to-target metrics with
        a ``train.budget.target`` only: as a target or objective elsewhere, every trial would
        miss it (never reach the target, or fail in Optuna)."""
        target = self.train.budget.target
        if target is not None and target.metric == "perplexity" and not self.language_model():
            raise FieldProblem(
                ["train", "budget", "target", "metric"],
                f"perplexity is for language models (gpt, hf causal-lm), not {self.model.family}"
                "; use eval_loss or accuracy",
            )
        for index, objective in enumerate(self.search.objectives):
            where = ["search", "objectives", index, "metric"]
            if objective.metric == "perplexity" and not self.language_model():
                raise FieldProblem(
                    where, f"perplexity is for language models, not {self.model.family}"
                )
            if objective.metric in TARGET_METRICS and target is None:
                raise FieldProblem(
                    where, f"{objective.metric} needs train.budget.target (a quality to reach)"
                )
        return self

    def language_model(self) -> bool:
        """Whether the trials predict the next token: gpt; hf unless a size names another task
        or the data are images (``harness.trial.curve.is_language_model`` decides in the
        trial)."""
        if self.model.family == "gpt":
            return True
        if self.model.family != "hf" or self.data.dataset in ("digits", "cifar10", "synthetic"):
            return False
        tasks = {knobs.get("task", "causal-lm") for knobs in self.model.sizes.values()}
        return tasks == {"causal-lm"}

    @property
    def experiment(self) -> str:
        return self.tracking.experiment or self.name

    @property
    def card_entry(self) -> Card | None:
        """The planned card, from the user's cards or the catalogue; None when none is named."""
        if self.card is None:
            return None
        name = self.card.lower()
        return self._cards.get(name) or CATALOGUE[name]

    @property
    def memory_budget(self) -> int | None:
        """Bytes a trial may use: ``device_memory``, the named card's memory, or the smaller
        of the two when both are given (a budget cannot exceed the card)."""
        card = self.card_entry
        budgets = [int(self.device_memory)] if self.device_memory is not None else []
        budgets += [card.memory_bytes] if card is not None else []
        return min(budgets) if budgets else None

    def axes(self) -> dict[str, list[Any]]:
        """The grid's axes in order (``harness.contract.AXES``); the trials are their product.
        Plain values (what Optuna samples and a grid point holds): a strategy as its text."""
        texts = [combination.text for combination in self.grid.strategy]
        values = (self.model.sizes, self.grid.batch_size, self.grid.dtype, texts)
        return {axis: list(value) for axis, value in zip(AXES, values, strict=True)}


def local_device() -> str:
    """What ``device: auto`` means on this machine (imports torch: only asked when it matters)."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"
