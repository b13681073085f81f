"""Noisy throughput: the rule that flags it, and the meter of what competed for the CPUs."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from harness.analyse.noise import noise_reason
from harness.meters.contention import ContentionMeter, read_cpu_times, usable_cores
from harness.metrics import METRICS
from harness.spec import parse_spec, trial_configs
from harness.trial.run import run_trial

CONTENTION_METRICS = (
    "timing_other_busy_cores",
    "timing_steal_fraction",
    "timing_free_cores",
    "timing_load_avg",
)
linux_only = pytest.mark.skipif(not Path("/proc/stat").exists(), reason="needs /proc/stat")

STEADY = {
    "device": "cpu",
    "throughput": 30000.0,
    "step_time_cv": 0.03,
    "step_time_ms_p50": 4.0,
    "step_time_ms_p90": 4.2,
    "timing_steal_fraction": 0.0,
    "timing_free_cores": 1.9,
    "torch_threads": 2,
}


def test_a_steady_trial_on_idle_cores_is_not_flagged():
    assert noise_reason(STEADY) is None
    assert noise_reason({}) is None  # nothing measured: nothing to flag


def test_unsteady_steps_are_flagged_by_cv_or_by_the_p90():
    assert "CV" in noise_reason({**STEADY, "step_time_cv": 0.4})
    reason = noise_reason({**STEADY, "step_time_ms_p90": 6.0})
    assert "p90" in reason and "1.50x" in reason


def test_cpu_steal_is_flagged():
    assert "10% CPU steal" in noise_reason({**STEADY, "timing_steal_fraction": 0.1})


def test_more_threads_than_free_cores_is_flagged_on_cpu_only():
    busy = {**STEADY, "timing_free_cores": 0.9}
    assert noise_reason(busy) == "2 threads on 0.9 free cores"
    assert noise_reason({**busy, "torch_threads": 1}) is None  # one thread fits
    assert noise_reason({**busy, "device": "cuda:0"}) is None  # the GPU does not wait for them
    # A row with no device (or a table's missing value) is judged as CPU.
    assert noise_reason({**busy, "device": None}) == "2 threads on 0.9 free cores"
    assert noise_reason({**busy, "device": math.nan}) == "2 threads on 0.9 free cores"


def test_every_reason_is_given_at_once():
    reason = noise_reason(
        {**STEADY, "step_time_cv": 0.5, "timing_steal_fraction": 0.2, "timing_free_cores": 0.0}
    )
    assert reason.count(";") == 2


def test_the_contention_figures_are_registered_metrics():
    for name in CONTENTION_METRICS:
        assert name in METRICS, name


def sleeping_window(seconds: float) -> dict[str, float]:
    """A window in which this process mostly sleeps: what others ran is all that is busy."""
    with ContentionMeter() as meter:
        time.sleep(seconds)
    return meter.metrics()


def spinning(process: subprocess.Popen[bytes], cpu_s: float = 0.2, within_s: float = 30) -> None:
    """Return once ``process`` has run ``cpu_s`` of CPU time: started and spinning, however
    loaded the machine is."""
    watched, deadline = psutil.Process(process.pid), time.monotonic() + within_s
    while sum(watched.cpu_times()[:2]) < cpu_s:
        assert time.monotonic() < deadline, f"the spinner ran < {cpu_s} s of CPU in {within_s} s"
        time.sleep(0.05)


@linux_only
def test_a_process_spinning_a_core_is_seen_as_other_work():
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        spinning(spinner)
        figures = sleeping_window(1.0)
    finally:
        spinner.kill()
        spinner.wait()
    cores = len(usable_cores() or []) or os.cpu_count()
    assert set(figures) == set(CONTENTION_METRICS)
    assert figures["timing_other_busy_cores"] > 0.5, figures
    assert figures["timing_free_cores"] == pytest.approx(cores - figures["timing_other_busy_cores"])
    assert figures["timing_load_avg"] >= 0


@linux_only
def test_without_a_spinner_the_figures_are_still_sane():
    # Whatever else this machine runs (CI shares it): no tight numbers, only their bounds.
    figures = sleeping_window(0.5)
    cores = len(usable_cores() or []) or os.cpu_count()
    assert 0 <= figures["timing_other_busy_cores"] <= cores
    assert 0 <= figures["timing_free_cores"] <= cores
    assert 0 <= figures["timing_steal_fraction"] <= 1


@linux_only
def test_unknown_cores_fall_back_to_the_whole_machine():
    times = read_cpu_times([10**6])  # no such cpu line in /proc/stat
    assert times is not None and times.count == os.cpu_count()
    assert times.total >= times.busy > 0


def test_a_trial_records_what_competed_during_its_timed_window(base_spec):
    # Enough timed steps that the window outlasts /proc/stat's 10 ms tick on an idle machine
    # (a shorter window records only the load average: it saw no tick to count).
    base_spec["measure"]["timed_steps"] = 200
    result = run_trial(trial_configs(parse_spec(base_spec))[0])
    assert result.status == "ok", result.failure_reason
    metrics = result.metrics
    expected = CONTENTION_METRICS if Path("/proc/stat").exists() else ("timing_load_avg",)
    for name in expected:
        assert name in metrics, name
    if "timing_free_cores" in metrics:
        assert 0 <= metrics["timing_other_busy_cores"] <= os.cpu_count()
        assert 0 <= metrics["timing_steal_fraction"] <= 1
    assert result.info["torch_threads"] >= 1
    # The rule reads the result as the sweep hands it over: a reason or None, never an error.
    row = {**metrics, "torch_threads": result.info["torch_threads"], "device": "cpu"}
    assert noise_reason(row) is None or isinstance(noise_reason(row), str)
