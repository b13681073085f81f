"""harness pareto / recommend / report on a real (small) sweep: tables, files, MLflow artifacts."""

from __future__ import annotations

import io
import re

import pandas as pd
import pytest
from mlflow.tracking import MlflowClient

from harness.results import load_sweep
from tests.conftest import BASE_SPEC, expect_exit, run_cli, write_spec

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def sweep_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("analysis")
    data = {
        **BASE_SPEC,
        "name": "analysed",
        "model": {"family": "mlp", "sizes": {"s": {"width": 16, "depth": 1}}},
        "grid": {"batch_size": [8, 256], "dtype": ["fp32"], "strategy": ["none", "checkpoint"]},
        "device_memory": "64KiB",  # batch 256 does not fit: infeasible, not run
        "measure": {**BASE_SPEC["measure"], "timeline": True},  # `harness timeline` reads them
    }
    done = run_cli("sweep", str(write_spec(folder, data)), cwd=folder)
    expect_exit(done)
    return folder


def artifacts(folder, path):
    sweep = load_sweep("analysed", f"sqlite:///{folder}/results/mlflow.db")
    client = MlflowClient(tracking_uri=sweep.tracking_uri)
    return {a.path for a in client.list_artifacts(sweep.parent_run_id, path)}


def test_pareto_prints_fronts_and_writes_plots(sweep_folder):
    done = run_cli("pareto", cwd=sweep_folder)
    expect_exit(done)
    assert "2 of 4 trials feasible (within 64.00 KiB)" in done.stdout
    assert "Pareto front" in done.stdout and "hypervolume" in done.stdout
    assert "Share of front B dominated by front A" in done.stdout  # two groups
    out = sweep_folder / "results" / "analysed"
    for name in ("pareto.png", "pareto.html", "breakdown.png", "breakdown.html"):
        assert (out / name).stat().st_size > 1000, name
    page = (out / "pareto.html").read_text()
    assert "s 8 fp32 checkpoint" in page  # hover text names the trial
    assert artifacts(sweep_folder, "pareto") == {
        "pareto/pareto.png",
        "pareto/pareto.html",
        "pareto/breakdown.png",
        "pareto/breakdown.html",
    }


def test_pareto_with_a_bad_objective_is_one_clear_line(sweep_folder):
    done = run_cli("pareto", "--objectives", "thruput:max", cwd=sweep_folder)
    expect_exit(done, 2)
    assert "unknown metric 'thruput'" in done.stderr and "Traceback" not in done.stderr


def test_recommend_fits_the_budget_or_says_nothing_does(sweep_folder):
    done = run_cli("recommend", "--budget", "64KiB", cwd=sweep_folder)
    expect_exit(done)
    assert "Recommended: s 8 fp32" in done.stdout
    assert "Runner-up:" in done.stdout
    sweep = load_sweep("analysed", f"sqlite:///{sweep_folder}/results/mlflow.db")
    chosen = done.stdout.split("Recommended: s 8 fp32 ")[1].split()[0]
    frame = sweep.frame
    row = frame[(frame["strategy"] == chosen) & (frame["batch_size"] == 8)].iloc[0]
    assert row["status"] == "ok" and row["peak_allocated_bytes"] <= 64 * 1024
    nothing = run_cli("recommend", "--budget", "1KiB", cwd=sweep_folder)
    expect_exit(nothing, 2)
    assert "nothing in sweep 'analysed' fits in 1.00 KiB" in nothing.stderr


def test_report_is_one_self_contained_page(sweep_folder):
    done = run_cli("report", cwd=sweep_folder)
    expect_exit(done)
    page = (sweep_folder / "results" / "analysed" / "report.html").read_text()
    assert "<h2>Pareto front</h2>" in page and 'id="pareto"' in page
    # plotly.js is embedded, not fetched: the page opens offline.
    assert '<script src="http' not in page and len(page) > 1_000_000
    assert artifacts(sweep_folder, "report") == {"report/report.html"}


def test_results_table_fits_160_columns_with_units(sweep_folder):
    done = run_cli("results", cwd=sweep_folder)
    expect_exit(done)
    lines = done.stdout.splitlines()
    assert max(map(len, lines)) <= 160, done.stdout
    assert lines[0].split()[:6] == ["size", "batch", "dtype", "strategy", "status", "trial"]
    assert "KiB" in done.stdout and "samples/s" in done.stdout
    assert not re.search(r"(?<![\w.])\d{4,}(\.\d+)?(?![\w.])", done.stdout)  # no 255300.0
    assert "infeasible [1]" in done.stdout  # batch 256 > 64 KiB: why, in a note under the table
    assert any(line.startswith("[1] predicted peak") for line in lines)


def test_results_columns_wide_and_a_misspelt_column(sweep_folder):
    picked = run_cli(
        "results", "--columns", "strategy,peak_rss_bytes,step_time_ms_p50", cwd=sweep_folder
    )
    expect_exit(picked)
    lines = picked.stdout.splitlines()
    assert lines[0].split() == ["strategy", "peak_rss_bytes", "step_time_ms_p50"]
    assert "MiB" in picked.stdout and " ms" in picked.stdout
    wide = run_cli("results", "--wide", cwd=sweep_folder)
    expect_exit(wide)
    header = wide.stdout.splitlines()[0].split()
    assert {"trial_key", "peak_rss_bytes", "step_time_cv", "run_id", "failure_reason"} <= set(
        header
    )
    assert "peak_reserved_bytes" not in header  # CUDA only: empty on CPU
    bad = run_cli("results", "--columns", "strategy,thruput", cwd=sweep_folder)
    expect_exit(bad, 2)
    (line,) = bad.stderr.strip().splitlines()
    assert line.startswith("Error: --columns: no results column 'thruput'; did you mean throughput")


def test_results_csv_keeps_every_column_and_raw_numbers(sweep_folder):
    done = run_cli("results", "--format", "csv", cwd=sweep_folder)
    expect_exit(done)
    exported = pd.read_csv(io.StringIO(done.stdout))
    frame = load_sweep("analysed", f"sqlite:///{sweep_folder}/results/mlflow.db").frame
    assert list(exported.columns) == list(frame.columns)
    assert exported["peak_allocated_bytes"].tolist() == pytest.approx(
        frame["peak_allocated_bytes"].tolist(), nan_ok=True
    )
    assert exported["trial_key"].tolist() == frame["trial_key"].tolist()  # full keys


def test_timeline_takes_a_key_prefix_or_a_run_name(sweep_folder):
    frame = load_sweep("analysed", f"sqlite:///{sweep_folder}/results/mlflow.db").frame
    row = frame[(frame["status"] == "ok") & (frame["strategy"] == "checkpoint")].iloc[0]
    by_prefix = run_cli("timeline", row["trial_key"][:6], cwd=sweep_folder)
    expect_exit(by_prefix)
    assert row["trial_key"][:8] in by_prefix.stdout and "wrote" in by_prefix.stdout
    by_name = run_cli("timeline", "s bs=8 fp32 checkpoint", cwd=sweep_folder)
    expect_exit(by_name)
    assert f"{row['trial_key']}.png" in by_name.stdout
    short = run_cli("timeline", row["trial_key"][:2], cwd=sweep_folder)
    expect_exit(short, 1)
    assert "a key prefix needs 4+ characters" in short.stderr
