"""Does the harness measure without distorting? (issue 7, figures 1-4)

Every figure is a ratio of two things measured side by side in this run, so a slow or noisy
machine moves both sides alike:

1. **Throughput fidelity**: the throughput a harness trial reports / the throughput of a bare
   PyTorch loop (``benchmarks.bare_loop``) doing the same work, for the seed CNN, ResNet-18 and
   the small GPT. Harness and bare runs alternate (``ROUNDS``, or ``ROUNDS_FOR`` the model, each;
   every bare loop stages the very batches the harness trial trains on), and the best of each side is
   compared (``timeit``'s reasoning: interference only ever slows a run down, while overhead the
   harness adds slows every run, its best included). Needed on a 2-core machine: the same bare
   CNN loop lands anywhere from ~27k to ~58k samples/s from one process to the next (the slow
   runs spend about twice the kernel time), which swamps a few-percent effect in medians of a
   handful of runs. The ratio of medians is reported beside it.
2. **Trial overhead**: the wall time of ``harness sweep`` over 20 short trials (the whole
   command: start-up, fresh stores, launching, recording) / the sum of those trials' own
   training + evaluation time (``train_time_s + eval_time_s``).
3. **Repeatability**: the same trial, every round: ``peak_allocated_bytes`` must not move
   (tensor accounting is exact on CPU); the throughput's coefficient of variation is reported.
4. **Memory-measurement cost**: a step inside the memory window (tensor accounting on) / an
   untracked timed step: why the windows are separate (docs/measuring.md).
"""

from __future__ import annotations

import copy
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from benchmarks.figures import Figure, at_least, at_most
from harness.results import load
from harness.spec import parse_spec, trial_configs
from harness.sweep.launch import launch_trial, start_warm_starter
from harness.trial.config import TrialConfig

ROUNDS = 7  # per model; more where a round is cheap and its steps short (noisier)
ROUNDS_FOR = {"cnn": 9}
FIDELITY_TARGET = 0.97
OVERHEAD_TARGET = 1.25

BASE: dict[str, Any] = {
    "name": "bench-fidelity",
    "grid": {"batch_size": [32], "dtype": ["fp32"], "strategy": ["none"]},
    "train": {"optimizer": {"name": "adam", "lr": 1.0e-3}, "budget": {"steps": 1}, "seed": 0},
    "measure": {"warmup_steps": 2, "memory_steps": 2, "timed_steps": 20},
    "device": "auto",
}
# name -> (model, data, batch size, timed steps): the seed CNN as `make sweep` runs it, a
# torchvision ResNet-18 on CIFAR-10-shaped inputs and the small GPT on text.
MODELS: dict[str, tuple[dict[str, Any], dict[str, Any], int, int]] = {
    "cnn": ({"family": "cnn", "sizes": {"w32": {"width": 32}}}, {"dataset": "digits"}, 128, 300),
    "resnet18": (
        {"family": "resnet", "sizes": {"r18": {"depth": 18}}},
        {"dataset": "synthetic", "num_samples": 640},
        32,
        20,
    ),
    "gpt-small": (
        {"family": "gpt", "sizes": {"small": {"preset": "small"}}},
        {"dataset": "text"},
        8,
        30,
    ),
}

# Figure 2: twenty short trials of the seed CNN (~3 s of training each on 2 cores).
SHORT_SWEEP: dict[str, Any] = {
    "name": "bench-overhead",
    "model": {"family": "cnn", "sizes": {f"w{w}": {"width": w} for w in (8, 12, 16, 24, 32)}},
    "data": {"dataset": "digits"},
    "grid": {"batch_size": [32, 64], "dtype": ["fp32", "bf16"], "strategy": ["none"]},
    "train": {"optimizer": {"name": "adam", "lr": 3.0e-3}, "budget": {"epochs": 75}, "seed": 0},
    "measure": {"warmup_steps": 2, "memory_steps": 2, "timed_steps": 20},
    "device": "auto",
    "search": {"method": "grid"},
}


def trial_config(name: str) -> TrialConfig:
    model, data, batch, timed = MODELS[name]
    spec = copy.deepcopy(BASE)
    spec.update(model=model, data=data)
    spec["grid"]["batch_size"] = [batch]
    spec["measure"]["timed_steps"] = timed
    measured = sum(spec["measure"].values())
    spec["train"]["budget"] = {"steps": measured}  # the measured windows only
    return trial_configs(parse_spec(spec))[0]


def bare_loop(config: TrialConfig, folder: Path) -> dict[str, float]:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(config.to_json())
    script = Path(__file__).with_name("bare_loop.py")
    subprocess.run(
        [sys.executable, str(script), str(folder / "config.json"), str(folder / "bare.json")],
        check=True,
    )
    return json.loads((folder / "bare.json").read_text())


def side_by_side(
    name: str, log: Callable[[str], None], workdir: Path
) -> tuple[list[dict[str, Any]], list[dict[str, float]]]:
    """``ROUNDS`` alternating harness trials and bare loops of one model."""
    config = trial_config(name)
    harness_runs, bare_runs = [], []
    rounds = ROUNDS_FOR.get(name, ROUNDS)
    for index in range(rounds):
        result = launch_trial(config, workdir / name / f"harness{index}", 900)
        if result.status != "ok":
            raise RuntimeError(f"{name}: harness trial ended {result.status}: {result}")
        harness_runs.append(result)
        bare_runs.append(bare_loop(config, workdir / name / f"bare{index}"))
        log(
            f"  {name} round {index + 1}/{rounds}: harness "
            f"{result.metrics['throughput']:,.1f}, bare {bare_runs[-1]['throughput']:,.1f} "
            f"{result.info['throughput_unit']}"
        )
    return harness_runs, bare_runs


def coefficient_of_variation(values: list[float]) -> float:
    return statistics.stdev(values) / statistics.mean(values)


def fidelity_figures(log: Callable[[str], None], workdir: Path) -> list[Figure]:
    figures, repeat, window = [], [], []
    for name in MODELS:
        harness_runs, bare_runs = side_by_side(name, log, workdir)
        harness_tp = [r.metrics["throughput"] for r in harness_runs]
        bare_tp = [r["throughput"] for r in bare_runs]
        figures.append(
            at_least(
                f"throughput_fidelity[{name}]",
                max(harness_tp) / max(bare_tp),
                FIDELITY_TARGET,
                "",
                median_ratio=statistics.median(harness_tp) / statistics.median(bare_tp),
                harness_throughput=harness_tp,
                bare_throughput=bare_tp,
                bare_wall_clock_throughput=[r["throughput_wall"] for r in bare_runs],
                throughput_unit=harness_runs[0].info["throughput_unit"],
                timed_steps=harness_runs[0].metrics["train_steps"],
                threads=harness_runs[0].info["torch_threads"],
            )
        )
        peaks = {r.metrics["peak_allocated_bytes"] for r in harness_runs}
        repeat.append(
            Figure(
                f"repeat_distinct_peaks[{name}]",
                float(len(peaks)),
                "= 1",
                len(peaks) == 1,
                "",
                {
                    "runs": len(harness_runs),
                    "peak_allocated_bytes": sorted(peaks),
                    "throughput_cv": coefficient_of_variation(harness_tp),
                },
            )
        )
        repeat.append(
            Figure(
                f"repeat_throughput_cv[{name}]",
                coefficient_of_variation(harness_tp),
                "reported",
                None,
                "",
                {"throughput": harness_tp},
            )
        )
        tracked = statistics.median(r.metrics["memory_step_time_ms"] for r in harness_runs)
        untracked = statistics.median(r.metrics["step_time_ms_p50"] for r in harness_runs)
        window.append(
            Figure(
                f"memory_window_step_cost[{name}]",
                tracked / untracked,
                "reported",
                None,
                "x",
                {"tracked_step_ms": tracked, "untracked_step_ms": untracked},
            )
        )
    return figures + repeat + window


def short_sweep(workdir: Path, warm: bool) -> tuple[float, Any]:
    """``harness sweep`` on fresh stores in its own folder: its wall time and its results."""
    folder = workdir / ("sweep-warm" if warm else "sweep-fresh")
    folder.mkdir(parents=True)
    spec = copy.deepcopy(SHORT_SWEEP)
    (folder / "spec.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    env = {**os.environ, "HARNESS_WARM_START": "1" if warm else "0"}
    started = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "harness", "sweep", "spec.yaml"],
        cwd=folder,
        env=env,
        check=True,
        stdout=subprocess.DEVNULL,
    )
    wall = time.perf_counter() - started
    return wall, load(spec["name"], f"sqlite:///{folder}/results/mlflow.db")


def overhead_figures(log: Callable[[str], None], workdir: Path) -> list[Figure]:
    wall, frame = short_sweep(workdir, warm=True)
    if len(frame) != 20 or not (frame["status"] == "ok").all():
        raise RuntimeError(f"the short sweep did not finish 20 ok trials: {frame['status']}")
    own = float((frame["train_time_s"] + frame["eval_time_s"]).sum())
    trial_walls = float(frame["trial_wall_time_s"].sum())
    log(
        f"  20 short trials: sweep {wall:.1f} s, their training + evaluation {own:.1f} s "
        f"(median trial {frame['train_time_s'].median():.2f} s of training)"
    )
    return [
        at_most(
            "trial_overhead[20 short trials]",
            wall / own,
            OVERHEAD_TARGET,
            "",
            sweep_wall_s=wall,
            train_eval_s=own,
            overhead_per_trial_s=(wall - own) / len(frame),
            trial_process_wall_s=trial_walls,
            outside_trials_s=wall - trial_walls,  # CLI start-up, stores, recording
            median_train_s=float(frame["train_time_s"].median()),
            estimate_s=float(frame["estimate_time_s"].sum()),
            setup_s=float(frame["setup_time_s"].sum()),
        )
    ]


def run(log: Callable[[str], None]) -> list[Figure]:
    with tempfile.TemporaryDirectory(prefix="harness-bench-") as folder:
        workdir = Path(folder)
        start_warm_starter()
        log("overhead: harness trials vs a bare PyTorch loop, alternating")
        figures = fidelity_figures(log, workdir)
        log("overhead: a sweep of 20 short trials")
        figures += overhead_figures(log, workdir)
    return figures
