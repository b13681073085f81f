"""The estimator (fake tensors, same training code) against real CPU measurements."""

from __future__ import annotations

import copy
import io
from pathlib import Path

import pandas as pd
import pytest
import torch

from harness.results import load
from harness.spec import load_spec, parse_spec, trial_configs
from harness.sweep.estimate import run_trial_tool
from harness.sweep.launch import launch_trial
from harness.trial.estimate import DDP_ON_CUDA, closed_form, estimate_peak
from harness.trial.run import run_trial
from tests.conftest import BASE_SPEC, SHORT_TEXT, copy_fixture, run_cli, write_spec

GPT8 = {"n_layer": 8, "d_model": 32, "n_head": 2, "seq_len": 32}


def spec(strategy="none", family="mlp", knobs=None, batch_size=8, dtype="fp32"):
    data = copy.deepcopy(BASE_SPEC)
    data["model"] = {"family": family, "sizes": {"m": knobs or {"width": 256, "depth": 2}}}
    data["data"] = dict(SHORT_TEXT) if family == "gpt" else {"dataset": "digits"}
    data["grid"].update(batch_size=[batch_size], dtype=[dtype], strategy=[strategy])
    data["train"]["budget"] = {"steps": 6}
    return data


def test_fp32_mlp_adam_prediction_matches_the_measured_peak():
    result = run_trial(trial_configs(parse_spec(spec(batch_size=64)))[0])
    metrics = result.metrics
    assert metrics["predicted_peak_bytes"] == pytest.approx(
        metrics["peak_allocated_bytes"], rel=0.01
    )
    assert metrics["prediction_ratio"] == pytest.approx(1.0, abs=0.01)


@pytest.mark.parametrize("strategy", ["none", "checkpoint"])
def test_gpt_prediction_within_10_percent(strategy):
    result = run_trial(trial_configs(parse_spec(spec(strategy, "gpt", GPT8, batch_size=16)))[0])
    assert result.metrics["prediction_ratio"] == pytest.approx(1.0, abs=0.10)


def test_model_state_matches_the_closed_form():
    config = trial_configs(parse_spec(spec("bf16_params")))[0]
    prediction = estimate_peak(config, torch.device("cpu"))
    expected = closed_form(config, prediction)["closed_form_model_state_bytes"]
    # bf16 parameters and gradients, bf16 Adam moments: 8 B/param (+ fp32 step counters).
    assert prediction.model_state_bytes == pytest.approx(expected, rel=0.001)


def test_adafactor_prediction_matches_the_measured_peak():
    """Adafactor's step reads values (.item()); the estimator answers them and still agrees."""
    result = run_trial(trial_configs(parse_spec(spec("adafactor", batch_size=32)))[0])
    assert result.metrics["prediction_ratio"] == pytest.approx(1.0, abs=0.01)


@pytest.mark.slow
@pytest.mark.parametrize("parallel", ["ddp:2", "fsdp:2"])
def test_data_parallel_prediction_within_10_percent(tmp_path, parallel):
    """Rank 0 of 2 predicted on torch's fake process group vs two real gloo ranks."""
    config = trial_configs(parse_spec(spec(parallel, "gpt", GPT8, batch_size=16)))[0]
    result = launch_trial(config, tmp_path, timeout_s=300)
    assert result.status == "ok", result.failure_reason
    assert result.metrics["prediction_ratio"] == pytest.approx(1.0, abs=0.10)


@pytest.mark.slow
def test_a_multi_rank_trial_predicted_over_budget_ends_on_every_rank(tmp_path):
    """Predicted before the ranks join their group: all of them stop, none waits for another."""
    data = spec("ddp:2", batch_size=16)
    data["device_memory"] = "1KiB"
    result = launch_trial(trial_configs(parse_spec(data))[0], tmp_path, timeout_s=120)
    assert result.status == "infeasible", result.failure_reason
    assert "exceeds device_memory 1.00 KiB" in result.failure_reason


def test_adam8bit_says_why_it_is_not_predicted():
    prediction = estimate_peak(trial_configs(parse_spec(spec("adam8bit")))[0], torch.device("cpu"))
    assert list(prediction.to_dict()) == ["unpredictable"]
    assert prediction.reason.startswith("adam8bit: its step is compiled code")


def test_cuda_target_without_a_gpu_is_accounted_in_512_byte_blocks():
    config = trial_configs(parse_spec(spec(batch_size=8)))[0]
    on_cpu = estimate_peak(config, torch.device("cpu"))
    as_cuda = estimate_peak(config, torch.device("cpu"), as_cuda=True)
    assert as_cuda.peak_bytes % 512 == 0
    # The MLP's biases and the step counters are far below a block: rounding must add bytes.
    assert as_cuda.peak_bytes > on_cpu.peak_bytes
    assert as_cuda.model_state_bytes % 512 == 0
    # Outside the estimate, CPU storages are counted as they are again.
    assert estimate_peak(config, torch.device("cpu")) == on_cpu


def test_estimate_cli_prints_a_row_per_grid_point(tmp_path):
    data = spec("none", "gpt", GPT8)
    data["grid"].update(batch_size=[4, 8], strategy=["none", "checkpoint"])
    done = run_cli("estimate", str(write_spec(tmp_path, data)), "--format", "csv", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    frame = pd.read_csv(io.StringIO(done.stdout))
    assert len(frame) == 4
    for column in (
        "predicted_peak_bytes",
        "predicted_mem_activation_bytes",
        "korthikanti_activation_bytes",
    ):
        assert (frame[column] > 0).all(), column
    by = frame.set_index(["batch_size", "strategy"])["predicted_mem_activation_bytes"]
    assert by[(8, "checkpoint")] < by[(8, "none")]
    assert not (tmp_path / "results").exists()  # nothing ran, nothing recorded


@pytest.mark.slow
def test_a_7b_trial_over_budget_is_infeasible_and_not_run(tmp_path):
    data = spec("none", "gpt")
    data["name"] = "big"
    data["model"]["sizes"] = {"tiny": {"preset": "tiny"}, "7b": {"preset": "7b"}}
    data["grid"].update(batch_size=[1], dtype=["bf16"])
    data["device_memory"] = "24GiB"
    done = run_cli("sweep", str(write_spec(tmp_path, data)), cwd=tmp_path, timeout=900)
    assert done.returncode == 0, done.stderr
    frame = load("big", f"sqlite:///{tmp_path}/results/mlflow.db").set_index("model_size")
    assert frame.loc["tiny", "status"] == "ok"
    assert frame.loc["7b", "status"] == "infeasible"
    assert "exceeds device_memory 24.00 GiB" in frame.loc["7b", "failure_reason"]
    assert frame.loc["7b", "predicted_peak_bytes"] > 90 * 2**30
    assert pd.isna(frame.loc["7b", "peak_allocated_bytes"])  # never trained


def test_several_processes_answer_one_request_each_config_once(capfd):
    """``run_trial_tool(..., processes=2)``: two children share one request, each claiming the
    next config not yet taken; every config is answered once, in the request's order."""
    data = spec()
    data["grid"].update(batch_size=[8, 16, 32], strategy=["none", "checkpoint"])
    configs = trial_configs(parse_spec(data))
    request = {"device": "cpu", "configs": [c.to_dict() for c in configs]}
    answers = run_trial_tool("harness.trial.estimate", request, "the estimator", processes=2)
    assert [a["trial_key"] for a in answers] == [c.trial_key for c in configs]
    for config, answer in zip(configs, answers, strict=True):
        assert (
            answer["predicted_peak_bytes"] == estimate_peak(config, torch.device("cpu")).peak_bytes
        )
    # One line per config, counted in the order answers came: none answered twice.
    progress = [line for line in capfd.readouterr().err.splitlines() if line.startswith("[")]
    assert [line.split("]")[0] for line in progress] == [f"[{n}/6" for n in range(1, 7)], progress
    answered = {line.split("] ")[1].rsplit(": ", 1)[0] for line in progress}
    assert len(answered) == 6, progress


def faulty_spec(tmp_path, mode):
    copy_fixture("faulty_models.py", tmp_path)
    data = copy.deepcopy(BASE_SPEC)
    data["model"] = {"family": "faulty_models:build", "sizes": {mode: {"mode": mode}}}
    data["train"]["budget"] = {"steps": 2}
    return write_spec(tmp_path, data)


def test_value_dependent_shapes_are_unpredictable_and_the_trial_still_trains(tmp_path):
    """What fake tensors refuse (an output whose shape depends on values) is "unpredictable";
    the trial itself trains and says why it has no prediction."""
    config = trial_configs(load_spec(faulty_spec(tmp_path, "value_dependent")))[0]
    prediction = estimate_peak(config, torch.device("cpu"))
    assert list(prediction.to_dict()) == ["unpredictable"]
    assert prediction.reason.startswith("DynamicOutputShapeException")
    result = launch_trial(config, tmp_path / "trial", timeout_s=120)
    assert result.status == "ok", result.failure_reason
    assert "predicted_peak_bytes" not in result.metrics


def test_a_bug_in_the_model_is_a_crash_not_an_unpredictable_row(tmp_path):
    """Any other exception is a bug: the estimate does not hide it in a row. The command says
    so in one line that names where the whole traceback was kept."""
    spec_path = faulty_spec(tmp_path, "raise")
    config = trial_configs(load_spec(spec_path))[0]
    with pytest.raises(RuntimeError, match="user model failed on purpose"):
        estimate_peak(config, torch.device("cpu"))
    done = run_cli("estimate", str(spec_path), cwd=tmp_path, timeout=300)
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert "RuntimeError: user model failed on purpose" in last, done.stderr
    log = Path(last.rsplit("traceback and all: ", 1)[1].rstrip(")"))
    kept = log.read_text()
    assert "Traceback (most recent call last)" in kept and "faulty_models.py" in kept
    log.unlink()


def test_a_fake_tensor_made_pinned_says_it_is_pinned():
    """DDP's reducer asserts that its pinned copy of the used-parameter map is pinned (on a
    card, where the map lives on CUDA); a fake tensor forgets it was made pinned, which crashed
    the first card run's ddp:1 prediction. The estimator's mode remembers."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from harness.trial.fake import ValuesReadAsOne

    with FakeTensorMode(), ValuesReadAsOne() as mode:
        plain = torch.zeros(4, dtype=torch.int)
        pinned = torch.empty_like(plain, pin_memory=True)
        assert pinned.is_pinned() and not plain.is_pinned()
        del pinned
        assert not mode.pinned  # forgotten with its tensor


def test_ddp_on_a_gpu_is_unpredictable_in_the_trial_and_says_where_it_is_predicted():
    """The first card run's ddp:1 crashed in its own prediction (the reducer's pinned-buffer
    asserts on fake CUDA tensors): the trial now trains without one and says why."""
    data = spec("ddp:2", "gpt", GPT8, batch_size=16)
    data["card"] = "h200"
    prediction = estimate_peak(trial_configs(parse_spec(data))[0], torch.device("cuda"))
    assert prediction.outcome == "unpredictable"
    assert prediction.reason == DDP_ON_CUDA
