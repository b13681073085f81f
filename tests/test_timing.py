"""The step timer: N steps between two synchronisations, and what a trial reports from it."""

from __future__ import annotations

import json
import statistics

import pytest
import torch

from harness.meters.timing import CUDA_EVENTS, PERF_COUNTER, StepTimer
from harness.spec import parse_spec, trial_configs
from harness.sweep.launch import TRIAL_FILES
from harness.trial.config import SNAPSHOT_FILE, STEP_TIMES_FILE
from harness.trial.run import run_trial

SPEED_METRICS = (
    "throughput",
    "step_time_ms_p50",
    "step_time_ms_p90",
    "step_time_ms_p99",
    "step_time_cv",
)
cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def matmul_step(size: int):
    """A small real workload whose output shows the steps ran in order."""
    weight = torch.randn(size, size)

    def step(index: int) -> int:
        (weight @ weight).sum()
        return index

    return step


def test_timer_gives_one_time_per_step_and_returns_the_outputs_in_order():
    timer = StepTimer(torch.device("cpu"))
    outputs = timer.run(matmul_step(64), list(range(7)))
    assert outputs == list(range(7))
    assert len(timer.step_ms) == 7
    assert all(ms > 0 for ms in timer.step_ms)


def test_percentiles_are_ordered_and_cv_is_stdev_over_mean():
    timer = StepTimer(torch.device("cpu"))
    timer.run(matmul_step(64), list(range(12)))
    metrics = timer.metrics(samples_per_step=32)
    assert set(metrics) == set(SPEED_METRICS)
    assert metrics["step_time_ms_p50"] <= metrics["step_time_ms_p90"]
    assert metrics["step_time_ms_p90"] <= metrics["step_time_ms_p99"] <= max(timer.step_ms)
    assert metrics["step_time_ms_p50"] == statistics.median(timer.step_ms)
    assert metrics["throughput"] == pytest.approx(32 / (metrics["step_time_ms_p50"] / 1000))
    expected_cv = statistics.stdev(timer.step_ms) / statistics.mean(timer.step_ms)
    assert metrics["step_time_cv"] == pytest.approx(expected_cv)
    assert metrics["step_time_cv"] >= 0


def test_a_single_step_has_every_percentile_equal_and_no_variation():
    timer = StepTimer(torch.device("cpu"))
    timer.run(matmul_step(16), [0])
    metrics = timer.metrics(samples_per_step=1)
    assert metrics["step_time_ms_p50"] == metrics["step_time_ms_p90"]
    assert metrics["step_time_ms_p90"] == metrics["step_time_ms_p99"]
    assert metrics["step_time_cv"] == 0.0


def test_cpu_steps_are_timed_by_the_host_clock():
    timer = StepTimer(torch.device("cpu"))
    timer.run(matmul_step(16), [0, 1])
    artifact = timer.artifact()
    assert artifact == {"step_time_ms": timer.step_ms, "device": "cpu", "clock": PERF_COUNTER}


@cuda_only
def test_cuda_steps_are_timed_by_events_without_a_sync_between_them():
    device = torch.device("cuda")
    weight = torch.randn(512, 512, device=device)
    timer = StepTimer(device)
    outputs = timer.run(lambda _: weight @ weight, list(range(5)))
    assert len(outputs) == len(timer.step_ms) == 5
    assert all(ms > 0 for ms in timer.step_ms)
    assert timer.artifact()["clock"] == CUDA_EVENTS


def small_trial(base_spec, **measure):
    base_spec["measure"].update(timed_steps=5, **measure)
    return trial_configs(parse_spec(base_spec))[0]


def test_a_trial_writes_its_raw_step_times(base_spec, tmp_path):
    config = small_trial(base_spec)
    result = run_trial(config, tmp_path)
    assert result.status == "ok", result.failure_reason
    data = json.loads((tmp_path / STEP_TIMES_FILE).read_text())
    times = data["step_time_ms"]
    assert len(times) == config.timed_steps == 5
    assert data["device"] == "cpu" and data["clock"] == PERF_COUNTER
    assert data["trial_key"] == config.trial_key and data["world_size"] == 1
    metrics = result.metrics
    for name in SPEED_METRICS:
        assert name in metrics, name
    assert metrics["step_time_ms_p50"] == pytest.approx(statistics.median(times))
    assert metrics["step_time_ms_p50"] <= metrics["step_time_ms_p90"]
    assert metrics["step_time_ms_p90"] <= metrics["step_time_ms_p99"]
    cv = statistics.stdev(times) / statistics.mean(times)
    assert metrics["step_time_cv"] == pytest.approx(cv) and cv >= 0
    samples = data["samples_per_step"]
    assert metrics["throughput"] == pytest.approx(samples / (statistics.median(times) / 1000))
    # The timed steps still train: their losses are recorded after the window.
    assert len(result.loss_history) == metrics["train_steps"]


def test_without_an_output_dir_nothing_is_written(base_spec, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = run_trial(small_trial(base_spec))
    assert result.status == "ok" and "step_time_cv" in result.metrics
    assert list(tmp_path.iterdir()) == []


def test_the_step_times_are_a_trial_file():
    # Removed before a rerun of the trial and logged with its other artifacts.
    assert STEP_TIMES_FILE in TRIAL_FILES and SNAPSHOT_FILE in TRIAL_FILES


def test_allocator_snapshot_is_off_by_default_and_not_part_of_the_key(base_spec):
    default = small_trial(base_spec)
    assert default.allocator_snapshot is False
    asked = small_trial(base_spec, allocator_snapshot=True)
    assert asked.allocator_snapshot is True
    assert asked.trial_key == default.trial_key


def test_allocator_snapshot_is_cuda_only_and_harmless_on_cpu(base_spec, tmp_path):
    result = run_trial(small_trial(base_spec, allocator_snapshot=True), tmp_path)
    assert result.status == "ok", result.failure_reason
    assert not (tmp_path / SNAPSHOT_FILE).exists()
    assert "allocator_snapshot" not in result.info  # nothing failed: nothing to note


@cuda_only
def test_cuda_trial_reports_device_memory_and_writes_a_bounded_snapshot(base_spec, tmp_path):
    base_spec["device"] = "cuda"
    result = run_trial(small_trial(base_spec, allocator_snapshot=True), tmp_path)
    assert result.status == "ok", result.failure_reason
    metrics = result.metrics
    assert metrics["peak_device_bytes"] >= metrics["peak_reserved_bytes"]
    assert metrics["peak_reserved_bytes"] >= metrics["peak_allocated_bytes"]
    assert (tmp_path / SNAPSHOT_FILE).stat().st_size > 0
    assert json.loads((tmp_path / STEP_TIMES_FILE).read_text())["clock"] == CUDA_EVENTS
