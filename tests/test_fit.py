"""``harness fit``: the largest batch whose predicted peak fits a budget, held to its promise.

For each configuration (mlp, gpt and an ``hf`` Llama; none, checkpoint, accumulate, fsdp:2)
the answer b* satisfies predicted(b*) <= budget < predicted(next allowed b), checked with
predictions of our own (not the search's cache), and a real CPU trial at b* measures no more
than the budget while one at the next allowed value measures more.
"""

from __future__ import annotations

import copy
import functools
import io
import statistics
from dataclasses import replace
from typing import Any

import pandas as pd
import pytest
import torch

from harness.spec import parse_spec, trial_configs
from harness.strategies.combination import Combination
from harness.sweep.fit import upper_bound
from harness.sweep.launch import launch_trial
from harness.trial.config import TrialConfig
from harness.trial.estimate import Predictor, estimate_peak
from harness.trial.fit import Curve, Moments, at_value, axis_step, fit_config, predict_fresh
from harness.trial.run import run_trial
from tests.conftest import BASE_SPEC, expect_exit, run_cli, write_spec

CPU = torch.device("cpu")

# Tiny models (one block): a prediction takes under a second. gpt and the Llama read small
# datasets (a short held-out split: evaluating 3,600 windows of `text` costs a trial 30 s).
FAMILIES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "mlp": ({"width": 64, "depth": 2}, {"dataset": "digits"}),
    "gpt": (
        {"n_layer": 1, "d_model": 32, "n_head": 2, "seq_len": 64},
        {"dataset": "text", "test_fraction": 0.002},
    ),
    "hf": (
        {
            "preset": "llama-3.2-1b",
            "num_hidden_layers": 1,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "vocab_size": 256,
            "seq_len": 32,
        },
        {"dataset": "tokens", "vocab_size": 256, "num_samples": 200},
    ),
}

# name: family, strategy, the allowed step it implies, and b0: a batch (not one of the
# search's probes) with a budget placed between predicted(b0) and predicted(b0 + step), so the
# answer must be b0.
CASES: dict[str, tuple[str, str | list[str], int, int]] = {
    "mlp-none": ("mlp", "none", 1, 40),
    "mlp-accumulate:4": ("mlp", "accumulate:4", 4, 44),
    "mlp-fsdp:2+accumulate:4": ("mlp", ["fsdp:2", "accumulate:4"], 8, 24),
    "gpt-checkpoint": ("gpt", "checkpoint", 1, 12),
    "gpt-fsdp:2": ("gpt", "fsdp:2", 2, 10),
    "hf-none": ("hf", "none", 1, 6),
    "hf-checkpoint": ("hf", "checkpoint", 1, 10),
    "hf-accumulate:4": ("hf", "accumulate:4", 4, 12),
    "hf-fsdp:2": ("hf", "fsdp:2", 2, 6),
}

# Checkpointing needs repeated blocks: two of them.
KNOBS: dict[str, dict[str, Any]] = {"hf-checkpoint": {"num_hidden_layers": 2}}

# A real trial at b* and at b* + step, for each family and each strategy at least once.
REAL = ["mlp-none", "mlp-accumulate:4", "gpt-checkpoint", "gpt-fsdp:2", "hf-none"]


def case_config(name: str) -> TrialConfig:
    family, strategy, _, b0 = CASES[name]
    knobs, data = FAMILIES[family]
    spec = copy.deepcopy(BASE_SPEC)
    spec["model"] = {"family": family, "sizes": {"m": {**knobs, **KNOBS.get(name, {})}}}
    spec["data"] = dict(data)
    spec["grid"].update(batch_size=[b0], strategy=[strategy])
    spec["train"]["budget"] = {"steps": 3}
    spec["measure"] = {"warmup_steps": 1, "memory_steps": 1, "timed_steps": 1, "timeline": False}
    (config,) = trial_configs(parse_spec(spec))
    assert config.device_memory_bytes is None  # a real trial must not stop itself
    return config


def peak(config: TrialConfig, batch: int) -> float:
    """An independent prediction (a fresh estimate, not the search's cache)."""
    return estimate_peak(at_value(config, "batch_size", batch), CPU).peak_bytes


@functools.cache
def fitted(name: str) -> dict[str, Any]:
    """One search per case, two budgets: between b0 and its successor (the answer is known),
    and a round number, 1.5x the prediction at b0 to 10 kB (it is not)."""
    config = case_config(name)
    _, _, step, b0 = CASES[name]
    assert axis_step(config, "batch_size") == step and b0 % step == 0
    low, high = peak(config, b0), peak(config, b0 + step)
    assert low < high, f"{name}: predicted peak flat at {b0}: no budget lies between"
    between = int(low + (high - low) // 2)
    rounded = int(round(1.5 * low, -4))
    maximum = upper_bound(config, "batch_size", None)
    rows = fit_config(config, "batch_size", [between, rounded], maximum, CPU)
    return {
        "config": config,
        "step": step,
        "b0": b0,
        "maximum": maximum,
        "between": (between, low, high),
        "rounded": rounded,
        "rows": rows,
    }


@pytest.mark.parametrize("name", list(CASES))
def test_the_answer_fits_and_the_next_allowed_batch_does_not(name):
    found = fitted(name)
    config, step, b0, maximum = found["config"], found["step"], found["b0"], found["maximum"]
    (between, low, high), rounded = found["between"], found["rounded"]
    at_between, at_rounded = found["rows"]

    # The budget between b0 and b0 + step: the answer is b0, and the row says why.
    assert at_between["budget_bytes"] == between
    assert at_between["value"] == b0, at_between
    assert at_between["predicted_peak_bytes"] == low <= between
    assert at_between["next_value"] == b0 + step
    assert at_between["next_predicted_peak_bytes"] == high > between
    assert at_between["margin_bytes"] == between - low

    # A round budget: the answer is not known beforehand; check it with predictions of our own.
    best = at_rounded["value"]
    assert at_rounded["budget_bytes"] == rounded
    assert best > b0 and best % step == 0, at_rounded  # 1.5x the peak at b0 fits more
    assert best + step <= maximum, f"{name}: the search reached --max; pick a smaller budget"
    predicted, following = peak(config, best), peak(config, best + step)
    assert predicted <= rounded < following, (name, best, predicted, rounded, following)
    assert at_rounded["predicted_peak_bytes"] == predicted
    assert at_rounded["next_value"] == best + step
    assert at_rounded["next_predicted_peak_bytes"] == following

    for row in found["rows"]:
        # On CPU every moment's line is exact, so the first guess is the answer (the one
        # exception, a micro-batch of one, lies below every case's probes and answers).
        assert row["method"] == "model", row
        assert 1 <= row["predictions"] <= 4, row


@pytest.mark.parametrize("name", list(CASES))
def test_every_moment_of_two_probes_predicts_the_peak_at_any_batch(name):
    """The search's model: the live total after each allocating op, recorded at two batch
    sizes, is a line per moment, and the largest of those lines at any other batch is the
    peak a fresh estimate predicts there, to the byte (CPU accounting is exact). Batches whose
    micro-batch is one are left out: a copy of a tensor with a dimension of one can be a view
    (``contiguous`` has nothing to do), so the lines may overstate them by a few hundred bytes."""
    config = case_config(name)
    step = CASES[name][2]
    with Predictor(at_value(config, "batch_size", step), CPU, steps_run=1, totals=True) as p:
        curve = Curve(p.predict, step)
        for probe in (16 * step, 32 * step):
            curve(probe)
        moments = Moments.of(curve, [16 * step, 32 * step])
    assert moments is not None, f"{name}: the probes ran different ops"
    for batch in (3 * step, 7 * step, 50 * step):
        assert moments.peak(batch) == peak(config, batch), (name, batch)


@pytest.mark.parametrize(
    "strategy",
    ["qlora:4", ["sac", "fsdp:2", "accumulate:2"]],  # adapters; sharded, split
)
def test_one_built_model_predicts_each_batch_as_a_fresh_estimate_does(strategy):
    """The search builds a model once and predicts every batch on it (``Predictor``), running
    one step of a two-step memory window: each of its predictions, taken in any order, equals a
    fresh estimate at that batch (both window steps) to the byte."""
    config = case_config("hf-none")
    knobs = {**config.model_knobs, "num_hidden_layers": 2}
    terms = [strategy] if isinstance(strategy, str) else strategy
    config = replace(config, model_knobs=knobs, strategy=Combination.parse(terms), memory_steps=2)
    with Predictor(at_value(config, "batch_size", 4), CPU) as predictor:
        shared = {batch: predictor.predict(batch) for batch in (8, 4, 12)}
    with Predictor(at_value(config, "batch_size", 4), CPU, steps_run=1) as predictor:
        one_step = {batch: predictor.predict(batch) for batch in (12, 4, 8)}
    for batch, prediction in shared.items():
        fresh = estimate_peak(at_value(config, "batch_size", batch), CPU)
        assert fresh.peak_bytes is not None, fresh
        assert prediction == fresh, (strategy, batch)
        assert one_step[batch] == fresh, (strategy, batch)  # the fit search's shortcut
    assert shared[4].peak_bytes < shared[8].peak_bytes


def test_predictions_per_answer_stay_few():
    """The issue's target for the bench is a median of <= 4 predictions per answer; here a
    looser bound (the first budget of a case pays for the probes)."""
    counts = [row["predictions"] for name in CASES for row in fitted(name)["rows"]]
    print(f"predictions per answer: {counts}, median {statistics.median(counts)}")
    assert statistics.median(counts) <= 5, counts


def measured_peak(config: TrialConfig, batch: int, folder) -> float:
    trial = at_value(config, "batch_size", batch)
    if trial.world_size > 1:  # torchrun, two gloo ranks
        result = launch_trial(trial, folder / f"batch{batch}", timeout_s=300)
    else:
        result = run_trial(trial)
    assert result.status == "ok", result.failure_reason
    return result.metrics["peak_allocated_bytes"]


@pytest.mark.slow
@pytest.mark.parametrize("name", REAL)
def test_a_real_trial_at_the_answer_fits_and_at_the_next_allowed_batch_does_not(tmp_path, name):
    found = fitted(name)
    config, step = found["config"], found["step"]
    (between, low, high) = found["between"]
    best = found["rows"][0]["value"]
    assert best == found["b0"]
    if config.world_size > 1:
        # fsdp:2 on gloo: a rank's reduce-scatter buffer can outlive its collective, so the
        # real peak can exceed the prediction, by at most a buffer (docs/estimate.md, "Known
        # gaps"; seen 0.12-0.19 MB on a 2-layer MLP, 4.5 MB on a 512-wide Llama, each below
        # the model's whole fp32 gradient). Here half a batch step (the budget's margin at b*)
        # is worth more than that whole gradient, so the variability cannot cross the budget.
        tolerance = 4 * estimate_peak(config, CPU).num_params_total
        assert between - low > tolerance, (between - low, tolerance)
    else:
        tolerance = 0  # single rank on CPU: the prediction is the trial's own tensor accounting
    at_best = measured_peak(config, best, tmp_path)
    at_next = measured_peak(config, best + step, tmp_path)
    print(f"{name}: measured {at_best:.0f} at b*={best} <= {between} < {at_next:.0f}")
    assert at_best <= between < at_next, (name, at_best, between, at_next)
    # And why: measured = predicted (on gloo, up to the tolerance above; never below).
    assert low <= at_best <= low + tolerance, (at_best, low)
    assert high <= at_next <= high + tolerance, (at_next, high)


# --- through the CLI -----------------------------------------------------------------------


def cli_spec(tmp_path) -> str:
    spec = copy.deepcopy(BASE_SPEC)  # a 16-wide one-layer mlp on digits
    spec["grid"].update(strategy=["none", "accumulate:4"])
    return str(write_spec(tmp_path, spec))


def test_fit_cli_answers_each_configuration_and_budget(tmp_path):
    done = run_cli(
        "fit", cli_spec(tmp_path), "--budget", "80KiB,120KiB", "--format", "csv", cwd=tmp_path
    )
    expect_exit(done)
    frame = pd.read_csv(io.StringIO(done.stdout))
    assert len(frame) == 4
    for (strategy,), rows in frame.groupby(["strategy"]):
        step = 4 if strategy == "accumulate:4" else 1
        rows = rows.sort_values("budget_bytes")
        assert list(rows["budget_bytes"]) == [80 * 1024, 120 * 1024]
        values = list(rows["value"])
        assert values == sorted(values) and values[0] > 0, rows
        assert all(v % step == 0 for v in values)
        assert (rows["predicted_peak_bytes"] <= rows["budget_bytes"]).all()
        assert (rows["next_predicted_peak_bytes"] > rows["budget_bytes"]).all()
        assert (rows["next_value"] == rows["value"] + step).all()
    assert not (tmp_path / "results").exists()  # predicted, nothing ran


def test_fit_cli_table_says_when_not_even_a_batch_of_one_fits(tmp_path):
    done = run_cli("fit", cli_spec(tmp_path), "--budget", "1KiB,120KiB", cwd=tmp_path)
    expect_exit(done)
    assert "largest batch that fits" in done.stdout
    assert done.stdout.count("does not fit at 1") == 2  # one per configuration, 1 KiB column
    assert "accumulate:4" in done.stdout


@pytest.mark.parametrize("name", ["gpt-checkpoint", "hf-none"])
def test_three_sequence_lengths_predict_the_peak_at_any_length(name):
    """Along ``seq_len`` each moment is a parabola (attention's scores grow with the square of
    the length), so three probes give every moment, and the answer for a budget is their
    crossing: it fits, the next length does not (fresh predictions of our own)."""
    config = case_config(name)

    def fresh(length: int) -> float:
        return estimate_peak(at_value(config, "seq_len", length), CPU).peak_bytes

    curve = Curve(lambda v: predict_fresh(at_value(config, "seq_len", v), CPU, False), 1)
    for probe in (16, 32, 64):
        curve(probe)
    moments = Moments.of(curve, [16, 32, 64])
    assert moments is not None
    for length in (8, 48, 100):
        assert moments.peak(length) == fresh(length), (name, length)
    budget = int(round(1.5 * fresh(100), -4))
    (row,) = fit_config(config, "seq_len", [budget], 4096, CPU)
    assert row["method"] == "model", row
    best = row["value"]
    assert fresh(best) <= budget < fresh(best + 1), (name, best, budget)
