"""Energy per trial (harness.meters.energy): the arithmetic, the absent cases a CPU can reach,
and the objective a CPU sweep cannot have. The counter itself is read on a card only (the GPU
check, docs/gpu-validation.md)."""

from __future__ import annotations

import pytest
import torch

from harness.meters.energy import EnergyMeter, EnergyReading, combine, window_joules
from harness.metrics import format_metric, parse_objectives
from harness.spec import SpecError, parse_spec, trial_configs
from harness.trial.run import run_trial
from tests.test_estimate import spec


def reading(joules: float | None, gpu: str, seconds: float = 0.5, why: str = "") -> dict:
    return EnergyReading(joules, seconds, gpu, why, refresh_s=0.02, idle_w=80.0).as_dict()


def test_the_window_is_the_counters_difference_in_joules():
    assert window_joules(1_000_000, 1_041_250) == pytest.approx(41.25)
    assert window_joules(5, 5) == 0.0
    # A counter that went backwards (the driver reloaded) says nothing about the window.
    assert window_joules(9_000, 1_000) is None


def test_ranks_on_distinct_gpus_add_up_and_per_sample_divides_by_the_windows_samples():
    metrics, text = combine([reading(40.0, "GPU-a"), reading(60.0, "GPU-b", 0.7)], samples=200)
    assert metrics == {"energy_j": 100.0, "energy_per_sample_j": 0.5}
    assert text == (
        "NVML total energy of 2 GPUs over the 700 ms timed window (the counter refreshed every "
        "20 ms; 80 W idle subtracted after the window)"
    )


def test_two_ranks_on_one_gpu_count_its_energy_once():
    metrics, _ = combine([reading(40.0, "GPU-a"), reading(40.0, "GPU-a")], samples=100)
    assert metrics["energy_j"] == 40.0


def test_one_rank_without_a_counter_makes_the_figure_absent_not_partial():
    metrics, text = combine(
        [reading(40.0, "GPU-a"), reading(None, "GPU-b", why="NVML energy counter unavailable")],
        samples=100,
    )
    assert metrics == {}
    assert text == "absent: NVML energy counter unavailable"


def test_a_cpu_window_has_no_counter_and_says_so():
    with EnergyMeter(torch.device("cpu")) as meter:
        torch.ones(4).sum()
    assert meter.reading is not None
    assert meter.reading.joules is None
    assert meter.reading.why == "no GPU energy counter on cpu"
    assert meter.reading.seconds >= 0


def test_a_cuda_device_without_an_nvml_driver_reads_absent_with_nvmls_reason():
    # This machine has nvidia-ml-py but no NVIDIA driver: NVML itself refuses to start.
    meter = EnergyMeter(torch.device("cuda", 0))
    if meter.handle is not None:  # a real card: its counter is checked by the GPU check
        pytest.skip("an NVML driver is present")
    assert meter.why.startswith("NVML energy counter unavailable: ")


def test_a_cpu_trial_records_no_energy_and_tags_why():
    result = run_trial(trial_configs(parse_spec(spec()))[0])
    assert "energy_j" not in result.metrics and "energy_per_sample_j" not in result.metrics
    assert result.info["energy_counter"] == "absent: no GPU energy counter on cpu"
    assert result.metrics["throughput"] > 0  # the rest of the timed window is unaffected


def test_energy_is_an_objective_shown_in_joules():
    (objective,) = parse_objectives("energy_per_sample_j:min")
    assert str(objective) == "energy_per_sample_j:min"
    assert format_metric("energy_j", 1234.0) == "1.23k J"


def test_a_cpu_sweep_cannot_optimise_energy():
    data = spec()
    data["device"] = "cpu"
    data["search"] = {"objectives": [{"metric": "energy_j", "direction": "minimize"}]}
    with pytest.raises(
        SpecError, match=r"search\.objectives\[0\]\.metric: energy_j is measured on CUDA GPUs only"
    ):
        parse_spec(data)
