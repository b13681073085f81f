"""One trial, in process and as the worker process the sweep launches."""

from __future__ import annotations

import subprocess
import sys

from harness.spec import parse_spec, trial_configs
from harness.trial.result import TrialResult
from harness.trial.run import run_trial
from tests.conftest import FIXTURES, REPO


def user_model_trial(base_spec, mode: str, **extra):
    base_spec["model"] = {"family": "faulty_models:build", "sizes": {mode: {"mode": mode, **extra}}}
    config = trial_configs(parse_spec(base_spec))[0]
    return config.__class__.from_dict({**config.to_dict(), "python_path": [str(FIXTURES)]})


def test_ok_trial_measures_everything(base_spec):
    result = run_trial(trial_configs(parse_spec(base_spec))[0])
    assert result.status == "ok" and result.failure_reason == ""
    metrics = result.metrics
    for name in (
        "peak_allocated_bytes",
        "peak_rss_bytes",
        "throughput",
        "step_time_ms_p50",
        "step_time_ms_p90",
        "accuracy",
        "eval_loss",
        "train_loss",
        "num_params",
        "epoch_time_s",
    ):
        assert name in metrics, name
    assert metrics["throughput"] > 0
    assert metrics["step_time_ms_p90"] >= metrics["step_time_ms_p50"] > 0
    assert 0 <= metrics["accuracy"] <= 1
    assert metrics["peak_rss_bytes"] > metrics["peak_allocated_bytes"] > 0
    assert "peak_reserved_bytes" not in metrics  # CUDA only
    assert len(result.loss_history) == metrics["train_steps"] == 20
    assert result.info["device"] == "cpu" and result.info["throughput_unit"] == "samples/s"


def test_training_learns(base_spec):
    base_spec["train"]["budget"] = {"epochs": 3}
    base_spec["model"]["sizes"]["tiny"] = {"width": 64, "depth": 1}
    result = run_trial(trial_configs(parse_spec(base_spec))[0])
    history = result.loss_history
    assert sum(history[-10:]) / 10 < 0.5 * sum(history[:10]) / 10
    assert result.metrics["accuracy"] > 0.8


def test_measurement_steps_are_trained_even_on_a_tiny_budget(base_spec):
    base_spec["train"]["budget"] = {"steps": 1}
    result = run_trial(trial_configs(parse_spec(base_spec))[0])
    assert result.status == "ok"
    assert result.metrics["train_steps"] == 1 + 2 + 3  # warm-up + memory + timed
    assert "epoch_time_s" not in result.metrics  # no untimed steps left to time an epoch


def test_predicted_over_device_memory_is_infeasible_and_not_trained(base_spec):
    base_spec["device_memory"] = "8KiB"
    result = run_trial(trial_configs(parse_spec(base_spec))[0])
    assert result.status == "infeasible"
    assert "predicted peak" in result.failure_reason
    assert result.metrics["predicted_peak_bytes"] > 8 * 1024
    assert result.loss_history == [] and "peak_allocated_bytes" not in result.metrics


def test_over_device_memory_is_oom_with_the_measured_peak(base_spec):
    base_spec["device_memory"] = "8KiB"
    base_spec["limits"] = {"run_infeasible": True}  # train it anyway: the real peak says oom
    result = run_trial(trial_configs(parse_spec(base_spec))[0])
    assert result.status == "oom"
    assert "exceeds device_memory 8.00 KiB" in result.failure_reason
    assert result.metrics["peak_allocated_bytes"] > 8 * 1024
    assert "accuracy" not in result.metrics  # that card would never have finished


def test_nan_loss_is_diverged_at_its_step(base_spec):
    result = run_trial(user_model_trial(base_spec, "nan"))
    assert result.status == "diverged"
    assert result.failure_reason == "training loss became nan at step 1"


def test_worker_records_an_exception_as_crash(tmp_path, base_spec):
    config = user_model_trial(base_spec, "raise")
    (tmp_path / "config.json").write_text(config.to_json())
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "harness.trial",
            str(tmp_path / "config.json"),
            str(tmp_path / "result.json"),
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )
    assert done.returncode == 1
    assert "Traceback" in done.stderr  # kept for the trial log
    result = TrialResult.from_json((tmp_path / "result.json").read_text())
    assert result.status == "crash"
    assert result.failure_reason == "RuntimeError: user model failed on purpose"
    assert result.trial_key == config.trial_key


def test_a_rank_picks_its_device_before_anything_touches_it():
    """Under torchrun each rank predicts on its own GPU (cuda:LOCAL_RANK) before the process
    group starts; on a CPU the device stays the CPU for every rank."""
    import torch

    from harness.trial.distributed import Ranks

    cpu = torch.device("cpu")
    assert Ranks(rank=1, size=2, local_rank=1).local_device(cpu) == cpu
    assert Ranks(rank=0, size=1).local_device(cpu) == cpu
    if torch.cuda.is_available():  # on a card: the named GPU becomes the current one
        device = Ranks(rank=0, size=1).local_device(torch.device("cuda", 0))
        assert device == torch.device("cuda", 0) and torch.cuda.current_device() == 0
