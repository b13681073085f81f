"""harness pareto / recommend / report on a real (small) sweep: tables, files, MLflow artifacts."""

from __future__ import annotations

import pytest
from mlflow.tracking import MlflowClient

from harness.results import load_sweep
from tests.conftest import BASE_SPEC, run_cli, write_spec

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
    }
    done = run_cli("sweep", str(write_spec(folder, data)), cwd=folder)
    assert done.returncode == 0, done.stderr
    return folder


def artifacts(folder, path):
    sweep = load_sweep("analysed", f"sqlite:///{folder}/results/mlflow.db")
    client = MlflowClient(tracking_uri=sweep.tracking_uri)
    return {a.path for a in client.list_artifacts(sweep.parent_run_id, path)}


def test_pareto_prints_fronts_and_writes_plots(sweep_folder):
    done = run_cli("pareto", cwd=sweep_folder)
    assert done.returncode == 0, done.stderr
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
    assert done.returncode == 2
    assert "unknown metric 'thruput'" in done.stderr and "Traceback" not in done.stderr


def test_recommend_fits_the_budget_or_says_nothing_does(sweep_folder):
    done = run_cli("recommend", "--budget", "64KiB", cwd=sweep_folder)
    assert done.returncode == 0, done.stderr
    assert "Recommended: s 8 fp32" in done.stdout
    assert "Runner-up:" in done.stdout
    sweep = load_sweep("analysed", f"sqlite:///{sweep_folder}/results/mlflow.db")
    chosen = done.stdout.split("Recommended: s 8 fp32 ")[1].split()[0]
    frame = sweep.frame
    row = frame[(frame["strategy"] == chosen) & (frame["batch_size"] == 8)].iloc[0]
    assert row["status"] == "ok" and row["peak_allocated_bytes"] <= 64 * 1024
    nothing = run_cli("recommend", "--budget", "1KiB", cwd=sweep_folder)
    assert nothing.returncode == 2
    assert "nothing in sweep 'analysed' fits in 1.00 KiB" in nothing.stderr


def test_report_is_one_self_contained_page(sweep_folder):
    done = run_cli("report", cwd=sweep_folder)
    assert done.returncode == 0, done.stderr
    page = (sweep_folder / "results" / "analysed" / "report.html").read_text()
    assert "<h2>Pareto front</h2>" in page and 'id="pareto"' in page
    # plotly.js is embedded, not fetched: the page opens offline.
    assert '<script src="http' not in page and len(page) > 1_000_000
    assert artifacts(sweep_folder, "report") == {"report/report.html"}
