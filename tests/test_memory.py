"""The memory meter against oracles that hold exactly on CPU (design notes §4)."""

from __future__ import annotations

import pytest
import torch

from harness.meters.accounting import TotalsTracker
from harness.spec import parse_spec, trial_configs
from harness.trial.loop import check_budget
from harness.trial.result import Status, TrialFailure
from harness.trial.run import run_trial


def mlp_trial(base_spec, *, batch_size=8, dtype="fp32", optimizer=None, width=256):
    base_spec["model"] = {"family": "mlp", "sizes": {"m": {"width": width, "depth": 2}}}
    base_spec["grid"].update(batch_size=[batch_size], dtype=[dtype])
    base_spec["train"]["optimizer"] = optimizer or {"name": "adam", "lr": 1e-3, "foreach": False}
    base_spec["train"]["budget"] = {"steps": 8}
    result = run_trial(trial_configs(parse_spec(base_spec))[0])
    assert result.status == "ok", result.failure_reason
    return result.metrics


def model_state_bytes(metrics):
    return metrics["mem_param_bytes"] + metrics["mem_grad_bytes"] + metrics["mem_optim_bytes"]


def test_fp32_adam_holds_16_bytes_per_parameter(base_spec):
    # Small batch: the peak falls in the optimizer step, when params, grads and state all live.
    metrics = mlp_trial(base_spec)
    n = metrics["num_params"]
    assert metrics["mem_param_bytes"] == 4 * n
    assert metrics["mem_grad_bytes"] == 4 * n
    # Adam's exp_avg + exp_avg_sq; only the per-tensor fp32 `step` scalars (4 B each) differ.
    assert model_state_bytes(metrics) == pytest.approx(16 * n, rel=1e-3)
    assert model_state_bytes(metrics) >= 16 * n
    # The step's temporaries are not optimizer state: they show up as "other".
    assert metrics["mem_other_bytes"] > 0


def test_breakdown_adds_up_to_the_peak(base_spec):
    metrics = mlp_trial(base_spec, batch_size=64)
    parts = (
        "mem_param_bytes",
        "mem_grad_bytes",
        "mem_optim_bytes",
        "mem_activation_bytes",
        "mem_other_bytes",
    )
    assert sum(metrics[p] for p in parts) == metrics["peak_allocated_bytes"]


@pytest.mark.parametrize(
    ("optimizer", "state_bytes_per_param"),
    [
        ({"name": "sgd", "lr": 0.01}, 0),
        ({"name": "sgd", "lr": 0.01, "momentum": 0.9}, 4),
        ({"name": "adamw", "lr": 0.001}, 8),
    ],
)
def test_optimizer_state_per_parameter(base_spec, optimizer, state_bytes_per_param):
    # SGD's in-place step makes no temporaries, so its peak may fall in backward, when only part
    # of the gradients exist: parameters and optimizer state are the quantities fixed there.
    metrics = mlp_trial(base_spec, optimizer=optimizer)
    n = metrics["num_params"]
    assert metrics["mem_param_bytes"] == 4 * n
    assert metrics["mem_optim_bytes"] == pytest.approx(state_bytes_per_param * n, rel=1e-3, abs=64)


def test_bf16_autocast_lowers_activation_memory(base_spec):
    import copy

    fp32 = mlp_trial(copy.deepcopy(base_spec), batch_size=512, dtype="fp32")
    bf16 = mlp_trial(copy.deepcopy(base_spec), batch_size=512, dtype="bf16")
    assert bf16["mem_activation_bytes"] < 0.8 * fp32["mem_activation_bytes"]
    # Autocast keeps fp32 master weights: parameters are unchanged.
    assert bf16["mem_param_bytes"] == fp32["mem_param_bytes"]


def test_bigger_batch_needs_more_activation_memory(base_spec):
    import copy

    small = mlp_trial(copy.deepcopy(base_spec), batch_size=64)
    large = mlp_trial(copy.deepcopy(base_spec), batch_size=512)
    assert large["mem_activation_bytes"] > 4 * small["mem_activation_bytes"]
    assert large["peak_allocated_bytes"] > small["peak_allocated_bytes"]


def test_cpu_peak_is_repeatable(base_spec):
    import copy

    first = mlp_trial(copy.deepcopy(base_spec), batch_size=64)
    second = mlp_trial(copy.deepcopy(base_spec), batch_size=64)
    assert first["peak_allocated_bytes"] == second["peak_allocated_bytes"]


def test_cpu_has_no_allocator_or_device_figures(base_spec):
    metrics = mlp_trial(base_spec)
    assert "peak_reserved_bytes" not in metrics and "peak_device_bytes" not in metrics


def test_cpu_budget_check_compares_the_allocated_peak(base_spec):
    base_spec["device_memory"] = "8KiB"
    base_spec["limits"] = {"run_infeasible": True}
    result = run_trial(trial_configs(parse_spec(base_spec))[0])
    assert result.status == "oom"
    assert result.failure_reason.startswith("peak allocated ")
    assert result.failure_reason.endswith("exceeds device_memory 8.00 KiB")


def test_cuda_budget_check_compares_the_reserved_peak():
    # What the per-process memory fraction caps is the reservation: a reading within budget by
    # its allocated bytes but over it by its reserved bytes is what OOMs on that card.
    reading = {"peak_allocated_bytes": 900.0, "peak_reserved_bytes": 2048.0}
    with pytest.raises(TrialFailure) as failure:
        check_budget(reading, 1024)
    assert failure.value.status is Status.OOM
    assert failure.value.reason == "peak reserved 2.00 KiB exceeds device_memory 1.00 KiB"
    check_budget(reading, 4096)  # within budget: no failure
    check_budget(reading, None)  # no budget: nothing to compare


def test_the_totals_after_each_allocation_reach_the_peak():
    """``TotalsTracker`` keeps the live total at entry and after every op that allocated (the
    fit search's moments); the peak is among them."""
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))
    optimizer = torch.optim.Adam(model.parameters(), foreach=False)
    inputs = torch.randn(32, 64)
    model(inputs).sum().backward()
    optimizer.step()  # the state exists before the tracked step
    tracker = TotalsTracker(torch.device("cpu"))
    tracker.track_external(model, optimizer, inputs)
    with tracker:
        optimizer.zero_grad()
        model(inputs).square().mean().backward()
        optimizer.step()
    peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    assert max(tracker.totals) == peak
    assert tracker.totals[0] < peak  # entry: model, optimizer state and inputs only
