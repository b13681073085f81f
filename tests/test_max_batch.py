"""``grid.batch_size: [max]``: the largest batch that fits ``device_memory``, found by the sweep
before planning (``harness fit``'s search), recorded as what trained and how it was found."""

from __future__ import annotations

import copy
import hashlib
import json
from dataclasses import replace

import pytest

from harness.spec import SpecError, SweepPlan, parse_spec, points, trial_configs
from harness.sweep.prepare import max_batch_entry
from harness.sweep.progress import trial_label
from harness.trial.config import KEYED_WHEN_SET, NOT_DEFINING
from tests.conftest import BASE_SPEC, expect_exit, run_cli, write_spec

BUDGET = "64KiB"  # the tiny MLP on digits fits a batch of a few dozen: well under the split


def max_spec(batches: list) -> dict:
    data = copy.deepcopy(BASE_SPEC)
    data["grid"]["batch_size"] = batches
    data["device_memory"] = BUDGET
    return data


def test_the_schema_takes_max_alone_or_beside_integers():
    alone = parse_spec(max_spec(["max"]), "s.yaml")
    assert alone.grid.batch_size == ["max"]
    assert [p["batch_size"] for p in points(alone)] == ["max"]
    beside = parse_spec(max_spec([8, "max"]), "s.yaml")
    assert beside.grid.batch_size == [8, "max"]
    assert len(points(beside)) == 2
    # Strategies that split the batch: max is found as a multiple of their split, never refused.
    data = max_spec(["max"])
    data["grid"]["strategy"] = ["none", "accumulate:3"]
    assert len(points(parse_spec(data, "s.yaml"))) == 2


def test_max_needs_device_memory_one_line_exit_2(tmp_path):
    data = max_spec([8, "max"])
    del data["device_memory"]
    with pytest.raises(SpecError) as error:
        parse_spec(data, "s.yaml")
    line = str(error.value)
    assert "\n" not in line and line.startswith("s.yaml: grid.batch_size[1]: ")
    assert "device_memory" in line
    path = write_spec(tmp_path, data)
    done = run_cli("validate", str(path), cwd=tmp_path)
    expect_exit(done, 2)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{path}: grid.batch_size[1]: "), done.stderr
    assert "set device_memory" in lines[0]


def test_bad_batch_entries_are_one_line_each():
    for bad, words in ((-4, "greater than 0 (got -4)"), ("maxx", "did you mean 'max'"),
                       (True, "positive integer or max")):  # fmt: skip
        with pytest.raises(SpecError) as error:
            parse_spec(max_spec([8, bad]), "s.yaml")
        line = str(error.value)
        assert "\n" not in line and line.startswith("s.yaml: grid.batch_size[1]: "), line
        assert words in line, line


def test_each_point_trains_at_its_resolved_batch_and_keeps_max():
    spec = parse_spec(max_spec([8, "max"]), "s.yaml")
    found = {("tiny", "fp32", "none"): {"batch_size": 69, "search": "max within 64.00 KiB: 69"}}
    resolved = SweepPlan(spec).with_max_batch(found)
    fixed, searched = resolved.configs
    assert (fixed.batch_size, fixed.batch_size_search) == (8, None)
    assert (searched.batch_size, searched.batch_size_search) == (69, "max within 64.00 KiB: 69")
    assert resolved.points[1]["batch_size"] == "max"  # the grid point (and search space) stays
    assert trial_label(resolved.points[1], searched) == "tiny bs=max:69 fp32 none"
    assert spec.grid.batch_size == [8, "max"]  # the user's spec is as written
    # The found batch is in the key, how it was found is not.
    assert "batch_size_search" in NOT_DEFINING
    assert replace(searched, batch_size_search=None).trial_key == searched.trial_key
    assert replace(searched, batch_size=70).trial_key != searched.trial_key
    # A max that found a batch the grid also lists is that very trial, once.
    same = SweepPlan(spec).with_max_batch(
        {("tiny", "fp32", "none"): {"batch_size": 8, "search": "x"}}
    )
    assert [p["batch_size"] for p in same.points] == [8]


def test_an_ordinary_specs_trial_key_is_what_it_was():
    (config,) = trial_configs(parse_spec(copy.deepcopy(BASE_SPEC), "s.yaml"))
    assert config.batch_size_search is None
    old_fields = {
        k: v
        for k, v in config.to_dict().items()
        if k not in ("python_path", "run_infeasible", "timeline", "allocator_snapshot")
        and k != "batch_size_search"  # the new field: not in the blob
        and not (k in KEYED_WHEN_SET and v == KEYED_WHEN_SET[k])
    }
    blob = json.dumps(old_fields, sort_keys=True, separators=(",", ":"))
    assert config.trial_key == hashlib.sha256(blob.encode()).hexdigest()[:16]


def test_a_configuration_where_nothing_fits_gets_the_smallest_allowed_batch():
    none = max_batch_entry({"value": 0, "method": "none", "predictions": 3}, 4, 65536, 1438)
    assert none["batch_size"] == 4 and "none fits, the smallest allowed batch 4" in none["search"]
    refused = max_batch_entry({"value": None, "refused": "needs CUDA"}, 2, 65536, 1438)
    assert refused["batch_size"] == 2 and "not predicted (needs CUDA)" in refused["search"]
    found = max_batch_entry({"value": 69, "method": "newton", "predictions": 9}, 1, 65536, 1438)
    assert found == {
        "batch_size": 69,
        "search": "max within 64.00 KiB: 69 (newton, 9 predictions)",
        "method": "newton",
        "predicted_peak_bytes": None,
    }
    capped = max_batch_entry({"value": 1438, "method": "model", "predictions": 2}, 1, 2**30, 1438)
    assert capped["search"].endswith("(model, 2 predictions, the largest tried)")


@pytest.mark.slow
def test_a_max_sweep_trains_at_the_found_batch_records_how_and_resumes(tmp_path):
    from mlflow.tracking import MlflowClient

    from harness.spec import load_spec
    from harness.sweep.fit import fit_grid
    from harness.units import parse_bytes

    path = write_spec(tmp_path, max_spec(["max"]))
    done = run_cli("sweep", str(path), cwd=tmp_path)
    expect_exit(done)
    assert "tiny fp32 none: batch_size max within 64.00 KiB: " in done.stdout, done.stdout

    expected = fit_grid(load_spec(path), "cpu", [parse_bytes(BUDGET)])
    (value,) = expected["value"].tolist()
    assert 1 < value < 1438  # found, not the smallest batch nor the training split

    client = MlflowClient(f"sqlite:///{tmp_path}/results/mlflow.db")
    experiment = client.get_experiment_by_name("unit")
    (run,) = client.search_runs([experiment.experiment_id], "tags.harness_role = 'trial'")
    assert run.data.params["batch_size"] == str(value)
    assert run.data.tags["status"] == "ok"
    assert run.data.metrics["peak_allocated_bytes"] <= parse_bytes(BUDGET)
    search = run.data.tags["batch_size_search"]
    assert search.startswith(f"max within 64.00 KiB: {value} (") and "predictions" in search
    parent = run.data.tags["mlflow.parentRunId"]
    assert run.info.run_name == f"tiny bs=max:{value} fp32 none @{parent[:8]}"

    again = run_cli("sweep", str(path), cwd=tmp_path)
    expect_exit(again)
    assert "Nothing left to run" in again.stdout, again.stdout
