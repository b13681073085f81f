"""Does the results side scale to 10,000 trials? (issue 7, figure 5)

10,000 synthetic trial records (realistic metrics, a mix of statuses) are written to a fresh
MLflow SQLite store through the harness's own ``Tracker.log_trial``, exactly as a sweep records
a trial. Then: ``harness.results.load`` into pandas (target <= 10 s), MLflow's own
``search_runs`` path for comparison (reported), and the Pareto front of the 10,000 points with
``harness.analyse.pareto`` (target <= 1 s; the full per-group analysis with hypervolumes is reported).
"""

from __future__ import annotations

import random
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.figures import Figure, at_most
from harness.analyse.pareto import analyse, feasible, non_dominated
from harness.metrics import DEFAULT_OBJECTIVES
from harness.record.tracking import Tracker
from harness.results import load
from harness.strategies.combination import Combination
from harness.strategies.settings import OptimizerSettings
from harness.trial.config import Budget, TrialConfig
from harness.trial.result import Status, TrialResult

RECORDS = 10_000
EXPERIMENT = "bench-scale"
SIZES = {"s": 8, "m": 16, "l": 32, "xl": 64}
STRATEGIES = (["none"], ["checkpoint"], ["accumulate:4"], ["adafactor"])
BUDGET = 64 * 2**20


def synthetic_result(config: TrialConfig, rng: random.Random) -> TrialResult:
    """Plausible numbers: memory grows with width and batch, throughput falls with width."""
    width = config.model_knobs["width"]
    peak = width * config.batch_size * rng.uniform(1.5e3, 2.5e3)
    throughput = 2e6 / width * rng.uniform(0.6, 1.4)
    accuracy = min(0.99, 0.7 + 0.004 * width * rng.uniform(0.8, 1.2))
    status = rng.choices(["ok", "oom", "infeasible", "crash"], [90, 4, 4, 2])[0]
    if peak > BUDGET:
        status = "oom"
    metrics: dict[str, float] = {"predicted_peak_bytes": peak * rng.uniform(0.98, 1.02)}
    if status in ("ok", "oom"):
        metrics |= {
            "peak_allocated_bytes": peak,
            "peak_rss_bytes": peak + 4e8,
            "mem_param_bytes": peak * 0.1,
            "mem_grad_bytes": peak * 0.1,
            "mem_optim_bytes": peak * 0.2,
            "mem_activation_bytes": peak * 0.5,
            "mem_other_bytes": peak * 0.1,
            "num_params": width * 1e3,
        }
    if status == "ok":
        metrics |= {
            "throughput": throughput,
            "step_time_ms_p50": 1e3 * config.batch_size / throughput,
            "step_time_ms_p90": 1.1e3 * config.batch_size / throughput,
            "accuracy": accuracy,
            "eval_loss": 1 - accuracy,
            "train_loss": 1.1 - accuracy,
            "train_steps": 100.0,
            "epochs": 2.0,
            "train_time_s": 5.0,
            "eval_time_s": 0.2,
        }
    return TrialResult(
        trial_key=config.trial_key,
        status=Status(status),
        failure_reason="" if status == "ok" else f"synthetic {status}",
        metrics=metrics,
        loss_history=[rng.uniform(0.1, 2.0) for _ in range(20)] if status == "ok" else [],
        info={"device": "cpu", "torch_version": "synthetic", "throughput_unit": "samples/s"},
        wall_time_s=6.0,
    )


def write_records(folder: Path, log: Callable[[str], None]) -> tuple[str, float]:
    uri = f"sqlite:///{folder / 'mlflow.db'}"
    tracker = Tracker(uri, EXPERIMENT, folder / "artifacts")
    parent = tracker.open_sweep(None, f"sweep {EXPERIMENT}", {}, {"device_memory_bytes": "0"})
    workdir = folder / "trial"
    workdir.mkdir()
    (workdir / "config.json").write_text("{}")
    rng = random.Random(0)
    started = time.perf_counter()
    for index in range(RECORDS):
        size = rng.choice(list(SIZES))
        config = TrialConfig(
            experiment=EXPERIMENT,
            model_family="cnn",
            model_size=size,
            model_knobs={"width": SIZES[size]},
            dataset="digits",
            data_options={},
            batch_size=rng.choice([16, 32, 64, 128, 256]),
            dtype=rng.choice(["fp32", "bf16"]),
            strategy=Combination.parse(rng.choice(STRATEGIES)),
            optimizer=OptimizerSettings(name="adam", lr=1e-3),
            budget=Budget(steps=100),
            seed=index,  # every record a distinct trial
            device_memory_bytes=BUDGET,
        )
        result = synthetic_result(config, rng)
        tracker.log_trial(parent, config, result, workdir, int(time.time() * 1000), f"t{index}")
        if (index + 1) % 2000 == 0:
            log(f"  {index + 1:,} records written ({time.perf_counter() - started:.0f} s)")
    return uri, time.perf_counter() - started


def timed(work: Callable[[], Any]) -> tuple[Any, float]:
    started = time.perf_counter()
    value = work()
    return value, time.perf_counter() - started


def run(log: Callable[[str], None]) -> list[Figure]:
    with tempfile.TemporaryDirectory(prefix="harness-bench-scale-") as folder:
        log(f"scale: {RECORDS:,} synthetic trials through Tracker.log_trial")
        uri, write_s = write_records(Path(folder), log)
        frame, load_s = timed(lambda: load(EXPERIMENT, uri))
        via_mlflow, mlflow_s = timed(lambda: load(EXPERIMENT, uri, via="mlflow"))
    if len(frame) != RECORDS or len(via_mlflow) != RECORDS:
        raise RuntimeError(f"loaded {len(frame)} / {len(via_mlflow)} rows, wrote {RECORDS}")
    objectives = list(DEFAULT_OBJECTIVES)

    def front_of_all() -> Any:
        candidates = frame[feasible(frame, objectives, BUDGET)]
        return candidates, non_dominated(candidates, objectives)

    (candidates, front), front_s = timed(front_of_all)
    analysis, analyse_s = timed(lambda: analyse(frame, objectives, "strategy", BUDGET))
    log(
        f"  write {write_s:.0f} s ({write_s / RECORDS * 1e3:.1f} ms a trial); load {load_s:.2f} s "
        f"(MLflow search_runs: {mlflow_s:.1f} s); front of {len(candidates):,} feasible points "
        f"in {front_s * 1e3:.0f} ms ({int(front.sum())} on it); full analysis {analyse_s:.2f} s"
    )
    return [
        at_most(
            "results_load_10k_s",
            load_s,
            10,
            "s",
            via_search_runs_s=mlflow_s,
            write_s=write_s,
            write_ms_per_trial=write_s / RECORDS * 1e3,
            rows=len(frame),
        ),
        at_most(
            "pareto_front_10k_s",
            front_s,
            1,
            "s",
            feasible_points=len(candidates),
            front_points=int(front.sum()),
            full_analysis_s=analyse_s,
            groups=len(analysis.groups),
        ),
    ]
