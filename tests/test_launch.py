"""Warm trial starts (``harness.trial.zygote``): as isolated as a fresh process, seconds faster."""

from __future__ import annotations

import json

import pytest

from harness.spec import parse_spec, trial_configs
from harness.sweep.launch import launch_trial
from tests.conftest import FIXTURES

MiB = 2**20


def faulty_trial(base_spec, mode: str):
    base_spec["model"] = {"family": "faulty_models:build", "sizes": {mode: {"mode": mode}}}
    config = trial_configs(parse_spec(base_spec))[0]
    return config.__class__.from_dict({**config.to_dict(), "python_path": [str(FIXTURES)]})


@pytest.fixture
def report(tmp_path, monkeypatch):
    path = tmp_path / "report.jsonl"
    monkeypatch.setenv("HARNESS_TEST_REPORT", str(path))  # the trial inherits our environment
    return path


def test_each_warm_trial_starts_fresh_counters_and_no_leaked_tensors(tmp_path, base_spec, report):
    """A trial that leaks a tensor, then one that drives RSS up, then the leaky one again, all
    forked from one zygote: the third sees nothing of the first two."""
    leaky, hog = faulty_trial(dict(base_spec), "leak"), faulty_trial(dict(base_spec), "hog")
    first = launch_trial(leaky, tmp_path / "first", 120)
    big = launch_trial(hog, tmp_path / "hog", 120)
    again = launch_trial(leaky, tmp_path / "again", 120)

    assert [r.status for r in (first, big, again)] == ["ok"] * 3
    assert {r.info["trial_start"] for r in (first, big, again)} == {"warm"}
    # The model is built twice per trial (estimate, then training): the first build of each
    # trial process must find no leak from before.
    builds = [json.loads(line) for line in report.read_text().splitlines()]
    first_builds = {b["pid"]: b for b in reversed(builds)}
    assert len(first_builds) == 2
    assert [b["leaked_before"] for b in first_builds.values()] == [0, 0]
    assert len({b["live_tensors"] for b in first_builds.values()}) == 1
    # Peak counters start anew: the same bytes and losses, and the hog's RSS is not inherited.
    assert again.metrics["peak_allocated_bytes"] == first.metrics["peak_allocated_bytes"]
    assert again.loss_history == first.loss_history
    assert big.metrics["peak_rss_bytes"] > first.metrics["peak_rss_bytes"] + 500 * MiB
    assert abs(again.metrics["peak_rss_bytes"] - first.metrics["peak_rss_bytes"]) < 64 * MiB


def test_a_warm_trial_measures_what_a_fresh_process_measures(tmp_path, base_spec, monkeypatch):
    config = trial_configs(parse_spec(base_spec))[0]
    warm = launch_trial(config, tmp_path / "warm", 120)
    monkeypatch.setenv("HARNESS_WARM_START", "0")
    fresh = launch_trial(config, tmp_path / "fresh", 120)
    assert (warm.info["trial_start"], fresh.info["trial_start"]) == ("warm", "fresh")
    for name in ("peak_allocated_bytes", "predicted_peak_bytes", "mem_activation_bytes"):
        assert warm.metrics[name] == fresh.metrics[name], name
    assert warm.loss_history == fresh.loss_history
    assert warm.info["torch_threads"] == fresh.info["torch_threads"]
    assert warm.wall_time_s < fresh.wall_time_s  # no imports to pay


def test_a_warm_trial_that_hangs_or_crashes_leaves_the_zygote_serving(tmp_path, base_spec):
    hung = launch_trial(faulty_trial(dict(base_spec), "hang"), tmp_path / "hang", 3)
    crashed = launch_trial(faulty_trial(dict(base_spec), "crash"), tmp_path / "crash", 60)
    fine = launch_trial(trial_configs(parse_spec(base_spec))[0], tmp_path / "ok", 60)
    assert (hung.status, hung.info["trial_start"]) == ("timeout", "warm")
    assert hung.wall_time_s < 10
    assert (crashed.status, crashed.failure_reason) == ("crash", "killed by SIGSEGV")
    assert (fine.status, fine.info["trial_start"]) == ("ok", "warm")
