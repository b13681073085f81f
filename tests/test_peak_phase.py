"""When a trial's peak happens (``peak_phase``) and what a reader is told about it: a peak in the
optimizer step is one no activation strategy can lower (harness.analyse.peak_phase)."""

from __future__ import annotations

import copy

import pytest

from harness.analyse.peak_phase import activation_only, optimizer_peak_note, peak_reason
from harness.results import load
from harness.spec import parse_spec, trial_configs
from harness.strategies import LOWERS, STRATEGIES
from harness.trial.run import run_trial
from tests.conftest import BASE_SPEC, expect_exit, run_cli, write_spec


def mlp_spec(batch_size: int, strategies: list[str], width: int = 16) -> dict:
    data = copy.deepcopy(BASE_SPEC)
    data["model"]["sizes"] = {"m": {"width": width, "depth": 2}}
    data["grid"].update(batch_size=[batch_size], strategy=strategies)
    data["train"]["budget"] = {"steps": 4}
    return data


def measured(data: dict) -> dict:
    result = run_trial(trial_configs(parse_spec(data))[0])
    assert result.status == "ok", result.failure_reason
    return {**result.metrics, **result.info}


def test_a_small_batch_peaks_in_the_optimizer_step_and_a_large_one_in_the_pass():
    """A 2-layer MLP on 64 features: at batch 8 Adam's step (its moments and temporaries)
    outweighs the activations; at batch 1024 the activations of 1024 samples do."""
    small = measured(mlp_spec(8, ["none"]))
    assert small["peak_phase"] == "optimizer"
    large = measured(mlp_spec(1024, ["none"]))
    assert large["peak_phase"] in ("forward", "backward")
    assert large["mem_activation_bytes"] > small["mem_activation_bytes"]


def row(phase: str, strategy: str = "none", device: str = "cpu", **parts: float) -> dict:
    shares = {"param": 1.0, "grad": 1.0, "optim": 2.0, "activation": 0.0, "other": 1.0, **parts}
    return {
        "peak_phase": phase,
        "strategy": strategy,
        "device": device,
        "model": "gpt",
        **{f"mem_{c}_bytes": v for c, v in shares.items()},
    }


def test_a_peak_in_the_optimizer_step_names_what_can_lower_it_and_what_cannot():
    line = peak_reason(row("optimizer"))
    assert line is not None
    assert line.startswith("peak in the optimizer step (model state 80%, temporaries 20%)")
    assert "activation strategies (checkpoint, sac, accumulate, ...) cannot lower it" in line
    tried = line.split("; try ")[1]
    assert tried.startswith("adam8bit, adafactor")
    assert "checkpoint" not in tried
    # Already in use: not suggested again.
    assert "adam8bit" not in peak_reason(row("optimizer", "adam8bit")).split("; try ")[1]


def test_a_peak_in_the_backward_pass_names_activation_strategies_for_its_device():
    line = peak_reason(row("backward", activation=10.0))
    assert line is not None
    assert line.startswith("peak in the backward pass (activations 67% of it)")
    tried = line.split("; try ")[1]
    assert "checkpoint" in tried and "cannot lower" not in line
    assert "offload_activations" not in tried  # CUDA only: the row ran on a CPU
    assert "offload_activations" in peak_reason(row("backward", device="cuda", activation=10.0))
    assert peak_reason({**row("backward"), "peak_phase": None}) is None


def test_every_strategy_said_to_lower_memory_exists():
    assert set(LOWERS) <= set(STRATEGIES)
    assert {"checkpoint", "accumulate"} <= set(activation_only())


@pytest.mark.slow
def test_a_sweep_peaking_in_the_optimizer_step_says_so_in_results_and_recommend(tmp_path):
    """The issue's sweep: checkpoint and accumulate leave the peak where none has it (in Adam's
    step); the results table and recommend say why and what would move it."""
    data = mlp_spec(8, ["none", "checkpoint", "accumulate:2"])
    data["name"] = "optimizer-peak"
    spec = write_spec(tmp_path, data)
    expect_exit(run_cli("sweep", str(spec), cwd=tmp_path))
    frame = load("optimizer-peak", f"sqlite:///{tmp_path}/results/mlflow.db")
    assert set(frame["peak_phase"]) == {"optimizer"}
    assert frame["peak_allocated_bytes"].nunique() == 1  # the same peak, whatever the strategy
    note = optimizer_peak_note(frame)
    assert note == (
        "3 of 3 finished trials peak in the optimizer step: activation strategies (accumulate, "
        "checkpoint among them) cannot lower those peaks; harness recommend names what can"
    )
    table = run_cli("results", "--wide", cwd=tmp_path)
    expect_exit(table, 0)
    assert "peak_phase" in table.stdout
    shown = run_cli("results", cwd=tmp_path)
    assert "3 of 3 finished trials peak in the optimizer step" in " ".join(shown.stdout.split())
    advice = run_cli("recommend", "--budget", "1GiB", cwd=tmp_path)
    expect_exit(advice, 0)
    assert "Its peak in the optimizer step (model state" in advice.stdout
    assert "try adam8bit, adafactor" in advice.stdout
