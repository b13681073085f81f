"""``harness compare``: sweeps side by side (harness.analyse.compare), its selectors
(harness.record.results.select_sweep) and the command."""

from __future__ import annotations

import copy
import json

import pandas as pd
import pytest

from harness.analyse.compare import compare
from harness.metrics import parse_objectives
from harness.results import load
from tests.conftest import BASE_SPEC, expect_exit, run_cli, write_spec

OBJECTIVES = parse_objectives("peak_allocated_bytes:min,throughput:max")


def sweep_frame(rows: list[tuple[str, float, float]]) -> pd.DataFrame:
    """A results table of ok trials: (model_size, peak bytes, throughput) each."""
    return pd.DataFrame(
        [
            {
                "status": "ok", "model": "mlp", "model_size": size, "batch_size": 8,
                "dtype": "fp32", "strategy": "none", "peak_allocated_bytes": peak,
                "throughput": rate,
            }
            for size, peak, rate in rows
        ]
    )  # fmt: skip


def test_fronts_share_one_scale_and_matched_configurations_become_ratios():
    """Worked by hand. Over both sweeps' feasible trials memory spans 100-300 and throughput
    10-70, so (memory - 100) / 200 and (70 - throughput) / 60 put every point in [0, 1] with 0
    best. a: (0, 1), (0.5, 2/3); its dominated area under the reference point (1.1, 1.1) is
    0.5 x 0.1 + 0.6 x (1.1 - 2/3) = 0.31, over the box's 1.21: 0.2562. b: (0, 5/6), (0.5, 1/6),
    (1, 0): 0.5 x (1.1 - 5/6) + 0.5 x (1.1 - 1/6) + 0.1 x 1.1 = 0.71, over 1.21: 0.5868."""
    a = sweep_frame([("s", 100, 10), ("m", 200, 30)])
    b = sweep_frame([("s", 100, 20), ("m", 200, 60), ("l", 300, 70)])
    result = compare({"a": a, "b": b}, OBJECTIVES)
    volumes = result.analysis.groups.set_index("group")["hypervolume"]
    assert volumes["a"] == pytest.approx(0.31 / 1.21)
    assert volumes["b"] == pytest.approx(0.71 / 1.21)
    # Each point of a's front is dominated by b's point of the same size; none the other way.
    assert result.analysis.dominance.loc["b", "a"] == 1.0
    assert result.analysis.dominance.loc["a", "b"] == 0.0
    assert result.dominance_lines() == ["b's front dominates 100% of a's"]
    matched = result.matched.set_index("model_size")
    assert list(matched.index) == ["s", "m"]  # the first sweep's order
    assert matched["throughput b/a"].tolist() == [2.0, 2.0]
    assert matched["peak_allocated_bytes b/a"].tolist() == [1.0, 1.0]
    assert result.ratio_lines() == [
        "b / a peak_allocated_bytes: 1.00x over 2 configurations",
        "b / a throughput: 2.00x over 2 configurations",
    ]
    missing = result.missing.set_index("model_size")
    assert missing.loc["l", "a"] == "absent" and missing.loc["l", "b"] == "ok"


def test_a_configuration_that_failed_in_one_sweep_is_not_matched_but_listed():
    a = sweep_frame([("s", 100, 10), ("m", 200, 30)])
    a.loc[1, "status"] = "oom"
    b = sweep_frame([("s", 100, 15), ("m", 200, 60)])
    result = compare({"a": a, "b": b}, OBJECTIVES)
    assert result.matched["model_size"].tolist() == ["s"]
    assert result.matched["throughput b/a"].tolist() == [1.5]
    row = result.missing.set_index("model_size").loc["m"]
    assert (row["a"], row["b"]) == ("oom", "ok")


def test_one_sweep_is_nothing_to_compare():
    with pytest.raises(ValueError, match="two sweeps or more"):
        compare({"a": sweep_frame([("s", 1, 1)])}, OBJECTIVES)


@pytest.fixture(scope="module")
def two_sweeps(tmp_path_factory):
    """One spec swept twice (a fresh sweep the second time): two sweeps of the same
    configurations on the same hardware."""
    folder = tmp_path_factory.mktemp("compare")
    data = copy.deepcopy(BASE_SPEC)
    data["model"]["sizes"] = {"tiny": {"width": 16, "depth": 1}, "wide": {"width": 64, "depth": 1}}
    spec = write_spec(folder, data)
    expect_exit(run_cli("sweep", str(spec), cwd=folder), 0)
    expect_exit(run_cli("sweep", str(spec), "--fresh", cwd=folder), 0)
    frame = load("unit", f"sqlite:///{folder}/results/mlflow.db", sweep="all")
    first, second = frame.sort_values("start_time")["sweep_run_id"].unique()
    return folder, frame, str(first), str(second)


@pytest.mark.slow
def test_compare_two_recorded_sweeps_by_run_id_and_by_device(two_sweeps):
    folder, frame, first, second = two_sweeps
    device = str(frame["device_name"].iloc[0]).split()[0].lower()  # e.g. "amd"
    done = run_cli(
        "compare", f"unit@{first[:8]}", f"unit@{device}", "--format", "json",
        "--objectives", "peak_allocated_bytes:min,throughput:max", cwd=folder,
    )  # fmt: skip
    expect_exit(done, 0)
    answer = json.loads(done.stdout)
    # The device selector names the latest sweep on that device: the second.
    assert [s["sweep_run_id"] for s in answer["sweeps"]] == [first, second]
    assert answer["baseline"] == f"unit@{first[:8]}"
    by_sweep = {run: rows.set_index("model_size") for run, rows in frame.groupby("sweep_run_id")}
    for row in answer["matched"]:
        size = row["model_size"]
        expected = (
            by_sweep[second].loc[size, "throughput"] / by_sweep[first].loc[size, "throughput"]
        )
        assert row[f"throughput unit@{device}/unit@{first[:8]}"] == pytest.approx(expected)
        # The same configuration on the same hardware holds the same bytes.
        assert row[f"peak_allocated_bytes unit@{device}/unit@{first[:8]}"] == 1.0
    assert answer["missing"] == []
    assert (folder / "results" / "compare" / "compare.png").stat().st_size > 0
    assert (folder / "results" / "compare" / "compare.html").stat().st_size > 0


@pytest.mark.slow
def test_compare_prints_its_tables_and_says_what_it_wrote(two_sweeps):
    folder, _, first, second = two_sweeps
    done = run_cli("compare", f"unit@{first}", f"unit@{second[:6]}", "--no-plots", cwd=folder)
    expect_exit(done, 0)
    for words in (
        "Sweeps: fronts on one scale",
        "Matched configurations: ratios",
        f"unit@{second[:6]} / unit@{first} peak_allocated_bytes: 1.00x over 2 configurations",
    ):
        assert words in done.stdout
    assert "wrote" not in done.stdout
    csv = run_cli("compare", "unit", f"unit@{first}", "--format", "csv", "--no-plots", cwd=folder)
    expect_exit(csv, 0)
    assert csv.stdout.splitlines()[0].startswith("model,model_size,batch_size,dtype,strategy,")


@pytest.mark.slow
@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["unit"], "compare needs two sweeps or more"),
        (["unit", "unit"], "each sweep once"),
        (["unit", "unit@no-such-gpu"], "no sweep of 'unit' has run id 'no-such-gpu' or ran on"),
        (["unit", "other"], "no experiment named 'other'"),
        (["unit", "@h100"], "name an experiment"),
    ],
)
def test_bad_selectors_are_one_line(two_sweeps, args, words):
    folder = two_sweeps[0]
    done = run_cli("compare", *args, cwd=folder)
    assert done.returncode in (1, 2)
    assert words in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


@pytest.mark.slow
def test_pareto_over_every_sweep_draws_a_front_per_sweep(two_sweeps):
    folder, _, first, second = two_sweeps
    done = run_cli("pareto", "-e", "unit", "--sweep", "all", "--no-plots", cwd=folder)
    expect_exit(done, 0)
    assert "Per sweep: hypervolume" in done.stdout
    assert first[:8] in done.stdout and second[:8] in done.stdout


@pytest.mark.slow
def test_sweeps_lists_both_sweeps_and_compare_takes_what_it_prints(two_sweeps):
    """Two sweeps of one experiment read apart: ``harness sweeps`` lists each (short id, start,
    trials), ``compare`` takes its selectors, ``--sweep`` its short ids, ``results --sweep all``
    has a sweep column, and each trial's MLflow run name carries its sweep's short id."""
    folder, frame, first, second = two_sweeps
    listed = run_cli("sweeps", "--format", "json", cwd=folder)
    expect_exit(listed, 0)
    rows = json.loads(listed.stdout)
    assert [row["sweep_run_id"] for row in rows] == [first, second]  # oldest first
    assert [row["selector"] for row in rows] == [f"unit@{first[:8]}", f"unit@{second[:8]}"]
    per_sweep = frame.groupby("sweep_run_id").size()
    assert [row["trials"] for row in rows] == [per_sweep[first], per_sweep[second]]
    assert all(row["sweep"].startswith(row["sweep_run_id"][:8] + " 20") for row in rows)
    table = run_cli("sweeps", "-e", "unit", cwd=folder)
    expect_exit(table, 0)
    assert f"compare two: harness compare unit@{first[:8]} unit@{second[:8]}" in table.stdout

    compared = run_cli("compare", *[row["selector"] for row in rows], "--no-plots", cwd=folder)
    expect_exit(compared, 0)

    assert frame["sweep"].nunique() == 2
    assert set(frame["sweep"].str.split().str[0]) == {first[:8], second[:8]}
    shown = run_cli("results", "-e", "unit", "--sweep", "all", cwd=folder)
    expect_exit(shown, 0)
    assert rows[0]["sweep"] in shown.stdout and rows[1]["sweep"] in shown.stdout
    only_first = run_cli("results", "-e", "unit", "--sweep", first[:8], "--format", "json",
                         cwd=folder)  # fmt: skip
    expect_exit(only_first, 0)
    assert {row["sweep_run_id"] for row in json.loads(only_first.stdout)} == {first}

    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{folder}/results/mlflow.db")
    for run_id, parent in frame[["run_id", "sweep_run_id"]].itertuples(index=False):
        assert client.get_run(run_id).info.run_name.endswith(f" @{parent[:8]}")


@pytest.mark.slow
@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["results", "-e", "unti"], "no experiment named 'unti'; did you mean unit?"),
        (["sweeps", "-e", "unti"], "no experiment named 'unti'; did you mean unit?"),
        (["results", "-e", "unit", "--sweep", "abc"], "give 6+ characters"),
        (["results", "-e", "unit", "--sweep", "ffffffff"], "no sweep with run id 'ffffffff'"),
    ],
)
def test_a_mistyped_experiment_or_sweep_is_one_line(two_sweeps, args, words):
    done = run_cli(*args, cwd=two_sweeps[0])
    assert done.returncode in (1, 2)
    assert words in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


@pytest.mark.slow
def test_a_report_versus_another_sweep_has_a_comparison_section(two_sweeps):
    folder, _, first, second = two_sweeps
    page = folder / "report.html"
    done = run_cli("report", "-e", "unit", "--versus", f"unit@{first}", "--out", str(page),
                   cwd=folder)  # fmt: skip
    expect_exit(done, 0)
    text = page.read_text()
    assert "<h2>Compared with other sweeps</h2>" in text
    assert f"unit@{second[:8]}" in text and f"unit@{first}" in text
    assert 'id="compare"' in text or "id='compare'" in text
