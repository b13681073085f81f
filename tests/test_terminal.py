"""What the terminal shows: one number format per column, tables that fit 160 columns, trials
named by a key prefix, and commands that say what to do when there is nothing to show.

Fast: synthetic results frames; the real sweep's tables are in test_analysis_cli.py."""

from __future__ import annotations

import re

import pandas as pd
import pytest

from harness.cli.common import BREAKDOWN, cell, noise_footnote, table_text
from harness.record.results import ResultsError, Sweep, find_trial
from tests.conftest import BASE_SPEC, write_spec


def digits_row(**overrides) -> dict:
    """A results row shaped like the default sweep's (experiments/default.yaml)."""
    row = {
        "trial_key": "32a56ce2f00dbabe",
        "run_id": "0123456789abcdef0123456789abcdef",
        "sweep_run_id": "parent",
        "start_time": pd.Timestamp("2025-01-01 12:00:00", tz="UTC"),
        "status": "ok",
        "failure_reason": "",
        "model_size": "medium",
        "batch_size": 128,
        "dtype": "bf16",
        "strategy": "none",
        "peak_allocated_bytes": 255300.0,
        "mem_param_bytes": 7590.0,
        "mem_grad_bytes": 2600.0,
        "mem_optim_bytes": 15180.0,
        "mem_activation_bytes": 147000.0,
        "mem_other_bytes": 82930.0,
        "throughput": 2602.4,
        "throughput_unit": "samples/s",
        "step_time_ms_p50": 12.345,
        "step_time_ms_p90": 13.0,
        "step_time_cv": 0.04,
        "accuracy": 0.98712,
        "epoch_time_s": 1.23456,
        "train_steps": 12345.0,
        "num_params": 41_900_000.0,
        "torch_threads": 2,
    }
    return row | overrides


def test_one_rule_per_column():
    row = digits_row()
    assert cell("peak_allocated_bytes", 255300.0) == "249 KiB"
    assert cell("predicted_mem_activation_bytes", 3 * 2**20) == "3 MiB"
    assert cell("throughput", 2602.4, row) == "2.60k samples/s"
    assert cell("throughput", 10540.0, {"throughput_unit": "tokens/s"}) == "10.5k tokens/s"
    assert cell("step_time_ms_p50", 12.345) == "12.3 ms"
    assert cell("memory_step_time_ms", 250.0) == "250 ms"
    assert cell("epoch_time_s", 1.23456) == "1.23 s"
    assert cell("accuracy", 0.98712) == "0.987"
    assert cell("prediction_ratio", 1.0) == "1.00"
    assert cell("train_steps", 12345.0) == "12,345"
    assert cell("num_params", 41_900_000.0) == "41.9 M"
    assert cell("trial_key", "32a56ce2f00dbabe") == "32a56ce2"
    assert cell("accuracy", float("nan")) == "-" and cell("status", None) == "-"
    assert cell("foreach", True) == "yes"


def test_a_noisy_throughput_is_marked_and_explained_once():
    from harness.analyse.noise import NOISY_MARK

    steady, noisy = digits_row(), digits_row(step_time_cv=0.4)
    assert cell("throughput", 2602.4, noisy) == "2.60k samples/s" + NOISY_MARK
    assert noise_footnote(pd.DataFrame([steady, steady])) is None
    line = noise_footnote(pd.DataFrame([steady, noisy, noisy]))
    assert line.startswith(f"{NOISY_MARK} 2 of 3 throughputs were measured on a busy machine")
    assert "(step times vary 40% (CV))" in line
    assert all(len(part) <= 160 for part in line.splitlines())
    assert " ".join(part.strip() for part in line.splitlines()).endswith(
        "(docs/measuring.md#stable-cpu-timings)"
    )


def test_a_table_of_the_default_sweeps_shape_fits_160_columns():
    from harness.cli.results import readable_table

    rows = [
        digits_row(model_size=size, batch_size=batch, dtype=dtype, trial_key=f"ab{i:014x}")
        for i, (size, batch, dtype) in enumerate(
            (s, b, d)
            for s in ("small", "medium", "large")
            for b in (32, 128)
            for d in ("fp32", "bf16")
        )
    ]
    rows[3] |= {"status": "infeasible", "failure_reason": "predicted peak 1 GiB exceeds " * 20}
    text = readable_table(pd.DataFrame(rows), None)
    lines = text.splitlines()
    assert max(map(len, lines)) <= 160, text
    assert "KiB" in text and "samples/s" in text and "2.60k samples/s" in text
    assert not re.search(r"(?<![\w.])\d{4,}(\.\d+)?(?![\w.])", text)  # no 255300.0, no 2602
    assert "infeasible [1]" in text
    assert any(line.startswith("[1] predicted peak") for line in lines)
    assert BREAKDOWN not in text and "3/1/6/58/32" in text  # the peak's shares in percent


def test_table_text_right_aligns_numbers_and_keeps_every_requested_column():
    frame = pd.DataFrame([digits_row(), digits_row(throughput=12.0, model_size="s")])
    text = table_text(frame, ["model_size", "throughput"])
    header, _, first, second = text.splitlines()
    assert header.split() == ["model_size", "throughput"]
    assert first.endswith("2.60k samples/s") and second.endswith("12.0 samples/s")


def test_a_strategy_name_stays_whole_where_the_spare_columns_make_room():
    """A name folded over rows reads as several names: where leaving out the columns the
    caller can spare (but the last, the most wanted) makes room, the strategy column is as wide
    as its longest name; else it folds like other text rather than push out another column."""
    long = "qlora:16+chunked_ce+checkpoint:auto"
    frame = pd.DataFrame(
        [digits_row(strategy=long, failure_reason="a reason " * 8), digits_row(strategy="none")]
    )
    columns = ["strategy", "failure_reason", "throughput"]
    spared = table_text(frame, columns, width=60, spare=["failure_reason", "throughput"])
    table = [line for line in spared.splitlines() if not line.startswith("left out")]
    assert any(long in line for line in table) and max(map(len, table)) <= 60, spared
    assert "left out to fit 60 columns: failure_reason" in spared
    # narrower still: folded between its terms, never inside one
    terms = table_text(frame, columns, width=40, spare=["failure_reason", "throughput"])
    table = [line for line in terms.splitlines()[2:] if not line.startswith("left out")]
    names = [line.split()[0] for line in table if line.strip()][:-1]  # the last row: none
    assert "".join(names) == long and all(n.endswith("+") for n in names[:-1]), terms
    assert max(map(len, table)) <= 40 and "samples/s" in terms
    folded = table_text(frame, columns, width=60)  # nothing to spare: like any text
    assert long not in folded and "qlora:16+" in folded and "a reason" in folded


# -- harness timeline TRIAL: which trial a name means -------------------------------------


def sweep_of(rows: list[dict]) -> Sweep:
    return Sweep(pd.DataFrame(rows), "digits-cnn", "parent", {}, "sqlite:////nonexistent.db")


def test_a_trial_is_found_by_run_id_key_or_key_prefix():
    rows = [
        digits_row(trial_key="abcd1234aaaaaaaa", run_id="r1", model_size="small"),
        digits_row(trial_key="abcd5678bbbbbbbb", run_id="r2", model_size="large"),
    ]
    sweep = sweep_of(rows)
    assert find_trial(sweep, "r2")["model_size"] == "large"
    assert find_trial(sweep, "abcd5678bbbbbbbb")["model_size"] == "large"
    assert find_trial(sweep, "abcd12")["model_size"] == "small"
    with pytest.raises(ResultsError) as ambiguous:
        find_trial(sweep, "abcd")
    message = str(ambiguous.value)
    assert "\n" not in message and "names 2 trials" in message
    assert "abcd1234aaaaaaaa (small bs=128 bf16 none)" in message and "abcd5678" in message


def test_the_latest_run_of_a_rerun_trial_is_the_one_found():
    early = digits_row(trial_key="abcd1234aaaaaaaa", run_id="old")
    late = early | {"run_id": "new", "start_time": early["start_time"] + pd.Timedelta("1h")}
    assert find_trial(sweep_of([late, early]), "abcd1234")["run_id"] == "new"


# -- harness recommend when nothing ran ---------------------------------------------------


def test_recommend_says_nothing_ran_and_how_to_run_it():
    from harness.cli.decide import nothing_fits

    infeasible = digits_row(
        status="infeasible", peak_allocated_bytes=None, predicted_peak_bytes=3 * 2**20
    )
    sweep = sweep_of([infeasible, infeasible | {"predicted_peak_bytes": 2**20}])
    sweep.params["device_memory_bytes"] = str(64 * 1024)
    line = nothing_fits(sweep, 16 * 2**30)
    assert "\n" not in line and "16" not in line.split(";")[0]  # not "nothing fits in 16 GiB"
    assert "no trial of sweep 'digits-cnn' finished ok (2 infeasible)" in line
    assert "device_memory 64.00 KiB" in line and "limits.run_infeasible: true" in line
    assert "--retry-failed=all" in line and "device_memory: 1MiB or more" in line
    oom = nothing_fits(sweep_of([digits_row(status="oom")]), 2**30)
    assert "(1 oom)" in oom and "ran out of memory" in oom
    measured = nothing_fits(sweep_of([digits_row()]), 1024)
    assert "smallest measured peak is 249.32 KiB (--budget 249.4KiB or more)" in measured


# -- harness validate A B C ---------------------------------------------------------------


def test_validate_checks_every_file_and_names_each_bad_one(tmp_path):
    from click.testing import CliRunner

    from harness.cli import main

    good = write_spec(tmp_path, BASE_SPEC, "good.yaml")
    bad_grid = write_spec(tmp_path, BASE_SPEC | {"grid": {"batch_size": [-4]}}, "bad1.yaml")
    bad_name = write_spec(tmp_path, BASE_SPEC | {"nmae": "x"}, "bad2.yaml")
    done = CliRunner().invoke(main, ["validate", str(bad_grid), str(good), str(bad_name)])
    assert done.exit_code == 2, done.output
    assert done.stdout.strip() == f"{good}: ok (1 trials, experiment 'unit')"
    problems = done.stderr.strip().splitlines()
    assert problems[0].startswith(f"{bad_grid}: grid.batch_size[0]: ")
    assert problems[1].startswith(f"{bad_name}: nmae: ")
    assert problems[2] == f"2 of 3 specs have problems: {bad_grid}, {bad_name}"
    assert "Traceback" not in done.output
