"""The vocabulary both layers share besides metric names and units: the grid's axes, dtypes,
optimizers, default objectives and default stores. Standard library only.

Each name lives here once. The spec validates against these tuples, the trial maps them to
torch objects, the results table and the analysis use the same words, so a new dtype or
optimizer is one edit here plus its implementation.
"""

from __future__ import annotations

from typing import Literal, get_args

# The grid's axes in order: a trial is one value of each (also the config columns of a table).
AXES = ("model_size", "batch_size", "dtype", "strategy")

# The dtype axis: autocast mixed precision (fp16 adds a GradScaler).
DType = Literal["fp32", "bf16", "fp16"]
DTYPES: tuple[DType, ...] = get_args(DType)

# Optimizers the trial builds; a spec's train.optimizer names one of SPEC_OPTIMIZERS, the
# others come in through optimizer strategies.
OPTIMIZERS = ("adam", "adamw", "sgd", "adafactor", "adam8bit")
SpecOptimizer = Literal["adam", "adamw", "sgd"]
SPEC_OPTIMIZERS: tuple[SpecOptimizer, ...] = get_args(SpecOptimizer)
# Persistent optimizer state per parameter in fp32, the textbook cross-check of a prediction
# (sgd_momentum is sgd with a momentum buffer).
OPTIMIZER_STATE_BYTES = {
    "adam": 8,
    "adamw": 8,
    "sgd": 0,
    "sgd_momentum": 4,
    "adafactor": 0,
    "adam8bit": 2,
}

# The share of a dataset held out for evaluation when the spec does not say.
DEFAULT_TEST_FRACTION = 0.2

# The largest value `harness fit` and `batch_size: [max]` try on an axis without `--max`.
# The card name ``harness plan`` gives this host's CPU (``--card cpu``), beside the catalogue's.
CPU_CARD = "cpu"

DEFAULT_FIT_MAX = {"batch_size": 4096, "seq_len": 131072}

# (metric, direction) a sweep optimises when its spec names no objectives.
Direction = Literal["minimize", "maximize"]
DEFAULT_OBJECTIVES: tuple[tuple[str, Direction], ...] = (
    ("peak_allocated_bytes", "minimize"),
    ("throughput", "maximize"),
    ("accuracy", "maximize"),
)

# Where a sweep records when the spec says nothing: files under results/ of the working
# directory, so `make sweep` works offline on a fresh machine.
DEFAULT_RESULTS_DIR = "results"
DEFAULT_MLFLOW_URI = "sqlite:///results/mlflow.db"
DEFAULT_STORAGE = "sqlite:///results/optuna.db"
# `harness worker` reads the shared stores from these when not given on its command line:
# `--workers N` passes them so (a password in a URL never appears in `ps`).
STORAGE_ENV = "HARNESS_STORAGE"
TRACKING_ENV = "HARNESS_TRACKING_URI"
# A `harness sweep --launcher slurm|ray` submission's id, handed to its workers with the stores.
LAUNCH_ENV = "HARNESS_LAUNCH"
# Set ("1") on the workers `harness sweep --workers N` starts: the sweep shows their progress.
MANAGED_WORKER_ENV = "HARNESS_MANAGED_WORKER"
