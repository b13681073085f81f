"""The canonical metrics: one registry (name, unit, which way is better, meaning) that the
trial, MLflow, the results table, objective validation, every table and picture and the README
all agree on, and the one formatter that shows a number in its unit. Standard library only."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from harness import contract
from harness.contract import Direction
from harness.units import format_bytes, format_count, format_quantity

# Units. THROUGHPUT is the trial's own (samples/s or tokens/s: its throughput_unit tag).
BYTES = "bytes"
SECONDS = "s"
MILLISECONDS = "ms"
THROUGHPUT = "throughput"
COUNT = "count"  # a whole number, shown with thousands separators
PARAMETERS = "parameters"  # a parameter count, shown as published: 8.03 B, 41.9 M
FRACTION = "fraction"  # 0..1
RATIO = "ratio"  # a quotient of two figures (1.0: equal)
CORES = "cores"
BYTES_PER_PARAM = "B/param"
JOULES = "J"
PLAIN = ""  # a loss, a load average, epochs: a number without a unit

Better = Literal["lower", "higher"] | None


@dataclass(frozen=True)
class Metric:
    """A metric: its ``unit`` (one of the constants above), which way is ``better`` (None:
    neither, a figure to read), and what it means (``doc``, the README's metric table)."""

    name: str
    unit: str
    better: Better
    doc: str
    title: str | None = None  # an axis title that says more than "name (unit)"


_DOCS: dict[str, str] = {
    "peak_allocated_bytes": "bytes held by tensors at the worst moment of the memory window "
    "(CUDA: max_memory_allocated; CPU: tensor accounting)",
    "peak_reserved_bytes": "CUDA only: the caching allocator's peak reservation "
    "(reserved - allocated = caching/fragmentation overhead)",
    "peak_device_bytes": "CUDA only: estimated device-level peak, peak_reserved_bytes plus what "
    "the device held outside the allocator after the window (cudaMemGetInfo total - free - "
    "memory_reserved: CUDA context, NCCL and library buffers, other processes); not the "
    "trial's peak",
    "peak_rss_bytes": "the trial process's resident-set high-water mark over its whole life "
    "(a warm-started trial counts only the shared library pages it touches itself)",
    "mem_param_bytes": "breakdown at the peak: parameters",
    "mem_grad_bytes": "breakdown at the peak: gradients",
    "mem_optim_bytes": "breakdown at the peak: the optimizer's persistent state",
    "mem_activation_bytes": "breakdown at the peak: tensors made in the forward pass",
    "mem_other_bytes": "breakdown at the peak: the rest (inputs, backward and optimizer-step "
    "temporaries, buffers, untracked allocations)",
    "num_params": "trainable parameters of the model as built for the trial",
    "num_params_total": "all parameters of the model as built, frozen ones included (a LoRA "
    "base); equals num_params when nothing is frozen",
    "throughput": "samples/s: samples per step / the median timed-step time (steps run back to "
    "back, the device synchronised only around the timed window)",
    "throughput_min": "train.repeats > 1: the slowest repeat's throughput (samples/s); "
    "throughput is then the repeats' median, the rest of the row the first run's",
    "throughput_max": "train.repeats > 1: the fastest repeat's throughput (samples/s)",
    "repeats": "train.repeats > 1: how many runs of the trial measured a throughput (the "
    "spread between them widens the interval ties are judged on)",
    "step_time_ms_p50": "median timed-step latency in milliseconds",
    "step_time_ms_p90": "90th-percentile timed-step latency in milliseconds",
    "step_time_ms_p99": "99th-percentile timed-step latency in milliseconds",
    "step_time_cv": "coefficient of variation of the timed steps' times (sample stdev / mean; "
    "0 for one step): how steady the steps were",
    # What competed for the CPUs during the timed window (harness.meters.contention; Linux
    # /proc/stat, the load average elsewhere too): why a throughput may be noise.
    "timing_other_busy_cores": "cores the rest of the machine kept busy on average during the "
    "timed window: (busy CPU-seconds of this process's cores, steal included - the trial "
    "process's own) / wall seconds; other ranks of the trial count (the busiest rank's)",
    "timing_steal_fraction": "share of those cores' CPU time during the timed window that the "
    "hypervisor gave to other virtual machines (steal / total)",
    "timing_free_cores": "cores this process may use minus timing_other_busy_cores: what was "
    "left for the trial's torch_threads (the fewest of any rank)",
    "timing_load_avg": "the 1-minute load average at the end of the timed window (the trial's "
    "own threads included)",
    "accuracy": "held-out accuracy after the training budget (with train.budget.eval_every, "
    "also the MLflow metric history accuracy_step)",
    "eval_loss": "held-out cross-entropy after the training budget (per token for language "
    "models; with train.budget.eval_every, also the MLflow metric history eval_loss_step)",
    "perplexity": "language models only (gpt, a Hugging Face causal LM): exp(eval_loss), the "
    "held-out per-token perplexity (with eval_every, also perplexity_step); absent for "
    "classifiers",
    "reached_target": "train.budget.target: 1.0 when an evaluation met the target within "
    "max_steps, else 0.0",
    "steps_to_target": "train.budget.target: optimizer steps taken before the evaluation that "
    "first met it (measured phases' steps included); absent when it was not met",
    "time_to_target_s": "train.budget.target: seconds of training steps before the evaluation "
    "that first met it, evaluations excluded (as MLPerf's time to train); absent when not met",
    "train_loss": "mean training loss over the last epoch's worth of steps "
    "(the loss curve is the MLflow metric history train_loss_step, at most 250 points)",
    "train_steps": "optimizer steps taken (the budget, or the measured steps if more)",
    "epochs": "epochs trained (train_steps / steps per epoch)",
    "epoch_time_s": "wall time of one epoch including moving batches to the device, "
    "from the untimed training steps",
    "predicted_peak_bytes": "the estimator's prediction of peak_allocated_bytes, made before "
    "the trial trained (fake tensors: the same code, no allocation)",
    "prediction_ratio": "predicted_peak_bytes / peak_allocated_bytes (1.0: exact)",
    "predicted_reserved_bytes": "CUDA only: the caching allocator's predicted peak reservation "
    "(its rules, harness.cuda.allocator, replayed on the predicted order of allocations and "
    "frees)",
    "predicted_device_bytes": "CUDA only: predicted_reserved_bytes + the card's CUDA context + "
    "NCCL buffers (multi-rank): what the card must hold; infeasible is judged on it",
    "reserved_prediction_ratio": "predicted_reserved_bytes / peak_reserved_bytes (1.0: exact)",
    "device_prediction_ratio": "predicted_device_bytes / peak_device_bytes (1.0: exact)",
    # Where a trial's time went (the sweep's own overhead is trial_wall_time_s minus these).
    "estimate_time_s": "seconds the in-trial peak prediction took (before training)",
    "setup_time_s": "seconds loading the dataset and building model, strategies and optimizer",
    "train_time_s": "seconds of all training steps: warm-up, memory window, timed steps and "
    "the rest of the budget (evaluations between steps excluded)",
    "eval_time_s": "seconds of the held-out evaluation (and strategies' post-training checks); "
    "with train.budget.eval_every, the evaluations during training too",
    "memory_step_time_ms": "mean wall time of a step inside the memory window, where tensor "
    "accounting runs (compare with step_time_ms_p50: why the windows are separate)",
    "predicted_step_time_ms": "the step's time predicted before training from its ops' FLOPs "
    "and bytes on the device's roofline (a card's, or the CPU's calibrated one)",
    "predicted_throughput": "samples/s (tokens/s for sequence models) at predicted_step_time_ms, "
    "all ranks together",
    "predicted_mfu": "model FLOPs per predicted step time over the device's peak for the "
    "dtype most of them run in (recomputation not counted)",
    "mfu": "model FLOPs utilisation: the step's model FLOPs (counted on its ops, recomputation "
    "not counted) per measured median step time, over the device's peak for the dtype most "
    "of them run in (a card's datasheet; on CPU the calibrated matmul rate)",
    "step_time_ratio": "predicted_step_time_ms / step_time_ms_p50 (1.0: exact)",
    "comm_time_ms": "multi-rank: the time one step spends in collectives (gloo's records on "
    "CPU, NCCL kernels on CUDA), profiled on a step after the timed window; the slowest rank's",
    "energy_j": "NVIDIA GPUs: joules the trial's GPUs drew over the timed window (NVML's "
    "cumulative energy counter read around it, summed over ranks' distinct GPUs; the whole "
    "GPU, other processes included); absent where there is no counter (energy_counter says why)",
    "energy_per_sample_j": "energy_j per training sample of the timed window (a sequence for "
    "language models: per token, divide by the sequence length)",
    "peak_rank": "multi-rank: the rank whose allocated peak is peak_allocated_bytes (every "
    "rank's in the rank_memory tag)",
    # Recorded by particular strategies only.
    "sparsity": "prune: fraction of prunable weights that are zero after training",
    "float_linear_weight_bytes": "quantize_int8: bytes of the trained model's Linear weights",
    "int8_linear_weight_bytes": "quantize_int8: bytes of the same weights after int8 quantization",
    "float_peak_inference_bytes": "quantize_int8: peak memory of held-out inference, float model on CPU",
    "int8_peak_inference_bytes": "quantize_int8: peak memory of held-out inference, int8 model on CPU",
    "int8_accuracy": "quantize_int8: held-out accuracy of the int8 model",
    "compile_time_s": "compile: seconds the first (compiling) training step took",
    "base_weight_bytes": "lora/qlora: stored bytes of the frozen base (every frozen parameter)",
    "block_linear_weight_bytes": "lora/qlora: stored bytes of the frozen Linear weights inside "
    "the repeated blocks (NF4 codes and scales under qlora)",
    "block_linear_bytes_per_param": "lora/qlora: block_linear_weight_bytes per parameter "
    "(2 in bf16, ~0.52 in NF4)",
}

# Unit and direction, each listing the metrics that have them (every metric in exactly one).
_KINDS: dict[tuple[str, Better], tuple[str, ...]] = {
    (BYTES, "lower"): (
        "peak_allocated_bytes",
        "peak_reserved_bytes",
        "peak_device_bytes",
        "peak_rss_bytes",
        "mem_param_bytes",
        "mem_grad_bytes",
        "mem_optim_bytes",
        "mem_activation_bytes",
        "mem_other_bytes",
        "float_linear_weight_bytes",
        "int8_linear_weight_bytes",
        "float_peak_inference_bytes",
        "int8_peak_inference_bytes",
        "base_weight_bytes",
        "block_linear_weight_bytes",
    ),
    (BYTES, None): ("predicted_peak_bytes", "predicted_reserved_bytes", "predicted_device_bytes"),
    (BYTES_PER_PARAM, "lower"): ("block_linear_bytes_per_param",),
    (PARAMETERS, None): ("num_params", "num_params_total"),
    (THROUGHPUT, "higher"): ("throughput",),
    (THROUGHPUT, None): ("predicted_throughput", "throughput_min", "throughput_max"),
    (MILLISECONDS, "lower"): (
        "step_time_ms_p50",
        "step_time_ms_p90",
        "step_time_ms_p99",
        "memory_step_time_ms",
        "comm_time_ms",
    ),
    (MILLISECONDS, None): ("predicted_step_time_ms",),
    (SECONDS, "lower"): (
        "epoch_time_s",
        "estimate_time_s",
        "setup_time_s",
        "train_time_s",
        "eval_time_s",
        "compile_time_s",
        "time_to_target_s",
    ),
    (JOULES, "lower"): ("energy_j", "energy_per_sample_j"),
    (RATIO, "lower"): ("step_time_cv",),
    (RATIO, None): (
        "prediction_ratio",
        "reserved_prediction_ratio",
        "device_prediction_ratio",
        "step_time_ratio",
    ),
    (FRACTION, "higher"): ("accuracy", "int8_accuracy", "mfu", "reached_target"),
    (FRACTION, None): ("timing_steal_fraction", "sparsity", "predicted_mfu"),
    (CORES, None): ("timing_other_busy_cores", "timing_free_cores"),
    (COUNT, None): ("train_steps", "peak_rank", "repeats"),
    (COUNT, "lower"): ("steps_to_target",),
    (PLAIN, "lower"): ("eval_loss", "train_loss", "perplexity"),
    (PLAIN, None): ("timing_load_avg", "epochs"),
}
# Measured on CUDA GPUs only: a CPU trial has none of them (not zero).
CUDA_ONLY_METRICS = frozenset(
    {"peak_reserved_bytes", "peak_device_bytes", "energy_j", "energy_per_sample_j"}
)
_KIND_OF = {name: kind for kind, names in _KINDS.items() for name in names}
assert len(_KIND_OF) == sum(map(len, _KINDS.values())), "a metric listed under two kinds"
assert _KIND_OF.keys() == _DOCS.keys(), "every metric has a unit and a meaning"
_TITLES = {"accuracy": "held-out accuracy (fraction correct)"}
METRICS: dict[str, Metric] = {
    name: Metric(name, *_KIND_OF[name], doc, _TITLES.get(name)) for name, doc in _DOCS.items()
}

# Columns of tables that are not metrics (the grid, the estimate's and fit's own figures), by
# unit where the name does not say it.
COUNT_COLUMNS = {
    "attempts",
    "world_size",
    "batch_size",
    "seed",
    "torch_threads",
    "warmup_steps",
    "memory_steps",
    "timed_steps",
    "trials",
    "feasible",
    "front_size",
}


def unit_of(column: str) -> str | None:
    """A column's unit: the registry's for a metric, else what its name says (``*_bytes``,
    ``*_ms``, ``*_s``, a count); None when nothing says."""
    if column in METRICS:
        return METRICS[column].unit
    if column in COUNT_COLUMNS:
        return COUNT
    if column.endswith("_bytes"):
        return BYTES
    if column.endswith("_ms") or "_ms_" in column:
        return MILLISECONDS
    if column.endswith("_s") or column.endswith("_seconds"):
        return SECONDS
    if column.endswith("_j"):
        return JOULES
    return None


def format_metric(column: str, value: float, throughput_unit: str | None = None) -> str:
    """A number as every table and report shows it, in its column's unit: bytes with a binary
    unit, parameter counts as published, counts whole, times in ms or s, throughput in the
    trial's unit (``throughput_unit``; samples/s when unknown), the rest to three digits."""
    unit = unit_of(column)
    if unit == BYTES:
        return format_bytes(value, short=True)
    if unit == PARAMETERS:
        return format_count(value)
    if unit == COUNT:
        return f"{int(value):,}"
    if unit == THROUGHPUT:
        return format_quantity(value, throughput_unit or "samples/s")
    if unit in (MILLISECONDS, SECONDS, JOULES):
        return format_quantity(value, unit)
    return format_quantity(value)  # accuracy, losses, ratios, fractions, cores: three digits


def axis_label(metric: str, throughput_unit: str | None = None) -> str:
    """An axis title with its unit, e.g. ``throughput (samples/s)``, ``peak_allocated_bytes
    (bytes)``, ``accuracy (fraction)``; the bare name where there is no unit."""
    if metric in METRICS and METRICS[metric].title:
        return str(METRICS[metric].title)
    unit = unit_of(metric)
    if unit == THROUGHPUT:
        return f"{metric} ({throughput_unit or 'samples/s'})"
    if unit in (None, PLAIN, COUNT):
        return metric
    return f"{metric} ({unit})"


# The breakdown at the peak: five categories that add up to peak_allocated_bytes, in stacking
# order. The memory meter, the timeline, the tables and every plot use these names (their
# labels and colours: harness.analyse.style).
BREAKDOWN_CATEGORIES = ("param", "grad", "optim", "activation", "other")


def breakdown_metric(category: str) -> str:
    """The metric holding a category's bytes at the peak, e.g. ``mem_param_bytes``."""
    return f"mem_{category}_bytes"


@dataclass(frozen=True)
class Objective:
    """A metric to optimise and which way: the one type a spec's ``search.objectives``, the
    sweep's record, ``--objectives`` and the Pareto analysis share. Written as text in one
    form, ``metric:min`` / ``metric:max`` (``str``, ``parse_objectives``)."""

    metric: str
    direction: Direction

    @property
    def maximise(self) -> bool:
        return self.direction == "maximize"

    def __str__(self) -> str:
        return f"{self.metric}:{'max' if self.maximise else 'min'}"


# What a sweep optimises when its spec names no objectives (``harness.contract``).
DEFAULT_OBJECTIVES = tuple(Objective(metric, way) for metric, way in contract.DEFAULT_OBJECTIVES)
DIRECTION_WORDS: dict[str, Direction] = {
    "min": "minimize",
    "minimize": "minimize",
    "max": "maximize",
    "maximize": "maximize",
}


def parse_objectives(text: str) -> list[Objective]:
    """``peak_allocated_bytes:min,throughput:max`` -> objectives; ``ValueError`` says what is
    wrong (an unknown metric, a direction other than min/max)."""
    out = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        metric, _, direction = item.partition(":")
        if metric not in METRICS:
            raise ValueError(f"unknown metric {metric!r} (allowed: {', '.join(METRICS)})")
        if direction not in DIRECTION_WORDS:
            better = METRICS[metric].better
            hint = {"lower": f"{metric}:min", "higher": f"{metric}:max"}.get(
                better or "", f"{metric}:min or {metric}:max"
            )
            raise ValueError(f"{item!r}: give a direction, e.g. {hint}")
        out.append(Objective(metric, DIRECTION_WORDS[direction]))
    if not out:
        raise ValueError("name at least one objective, e.g. peak_allocated_bytes:min")
    return out
