"""Decisions never rest on noise or on nothing: throughputs the noise rule cannot tell apart
tie and the next objective decides; a sweep without a usable trial gets one line, exit 1 and
no files; the noise note under a table is printed whole.

The tie rule is tested as the pure function it is; the commands on sweeps recorded in a real
temporary MLflow SQLite store (``Tracker.log_trial``, as a sweep records them, no trial run)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from harness.analyse import plots
from harness.analyse.noise import NOISY_MARK, TIE_MARGIN, throughput_interval, throughputs_tie
from harness.analyse.pareto import (
    analyse,
    gives_up,
    rank_fits,
    rank_within_noise,
    recommend,
    throughput_tiers,
    unusable,
)
from harness.analyse.report import write_report
from harness.cli.common import noise_footnote
from harness.metrics import DEFAULT_OBJECTIVES, Objective, parse_objectives
from harness.record.results import load_sweep
from harness.record.tracking import Tracker
from harness.spec import parse_spec, trial_configs
from tests.conftest import BASE_SPEC, REPO, expect_exit, record_trial, run_cli

GIB = 2**30
STEADY = {"step_time_cv": 0.02}
NOISY = {"step_time_cv": 0.4}  # step times vary 40 %: flagged by noise_reason
# Several reasons at once: the note under a table grows past 160 characters.
VERY_NOISY = {
    "step_time_cv": 0.4,
    "timing_steal_fraction": 0.12,
    "timing_free_cores": 0.4,  # against the trial's torch_threads, 2 (a tag, not a metric)
}


def trial(name: str, throughput: float, accuracy: float | None, peak: float, **noise) -> dict:
    row = {"model_size": name, "batch_size": 32, "dtype": "fp32", "strategy": "none"}
    row |= {"status": "ok", "throughput": throughput, "accuracy": accuracy}
    return row | {"peak_allocated_bytes": peak, **(noise or STEADY)}


def names(frame: pd.DataFrame) -> list[str]:
    return frame["model_size"].tolist()


# -- the tie rule, pure -------------------------------------------------------------------


def test_two_throughputs_tie_only_where_their_intervals_overlap():
    steady = {"throughput": 1000.0, **STEADY}
    assert pytest.approx(0.10) == TIE_MARGIN  # derived from the noise rule's MAX_CV
    assert throughput_interval(steady) == pytest.approx((1000 / 1.05, 1050.0))  # +-5 % at least
    assert throughputs_tie(steady, {**steady, "throughput": 950.0})  # 5 % apart
    assert not throughputs_tie(steady, {**steady, "throughput": 800.0})  # 20 % apart
    # A noisy figure is wider by its own spread (40 % CV: 1400 reaches 1000) ...
    assert throughputs_tie(steady, {"throughput": 1400.0, **NOISY})
    # ... and by what the competition it met can explain (2 threads on 0.4 free cores: up to
    # 2x slower, 12 % steal: 1/0.88 more), never by everything: 10x apart is no tie.
    busy = {"throughput": 300.0, "torch_threads": 2, **VERY_NOISY}
    low, high = throughput_interval(busy)
    assert low == pytest.approx(300 / 1.4) and high == pytest.approx(300 * 1.4 * 2 / 0.88)
    assert throughputs_tie(steady, busy)
    assert not throughputs_tie(steady, {"throughput": 10_000.0, **NOISY})
    assert not throughputs_tie(steady, {**busy, "throughput": 100.0})
    assert not throughputs_tie(steady, {"throughput": None, **NOISY})  # nothing measured


def test_a_noisy_fastest_trial_ties_within_its_spread_and_accuracy_decides():
    # The fault drill: 8.75k samples/s~ at accuracy 0.827 was the headline; its 40 % spread
    # reaches down to 6.25k, within the accurate trial's reach.
    frame = pd.DataFrame(
        [
            trial("noisy-fast", 8750.0, 0.827, 2 * GIB, **NOISY),
            trial("accurate", 6000.0, 0.951, 3 * GIB),
            trial("slow", 3000.0, 0.990, 1 * GIB),  # steady, 50 % behind: a clear difference
        ]
    )
    ranking = rank_within_noise(frame)
    assert names(ranking.trials) == ["accurate", "noisy-fast", "slow"]
    assert ranking.tier.tolist() == [0, 0, 1]
    note = ranking.tie_note(1)
    assert note is not None and note.startswith("throughputs within noise")
    assert note.endswith("ranked by accuracy, then lower peak memory, then fewer strategies")
    # Without the noisy trial nothing ties: the steady order stands, and no note.
    steady = rank_within_noise(frame.iloc[1:])
    assert names(steady.trials) == ["accurate", "slow"] and steady.tie_note(2) is None


def test_on_a_busy_machine_throughputs_tie_within_their_spreads_only():
    frame = pd.DataFrame(
        [
            trial("a", 9000.0, 0.80, 2 * GIB, **NOISY),  # 6.4k-12.6k samples/s
            trial("b", 3000.0, 0.95, 2 * GIB, **NOISY),  # 2.1k-4.2k: below a's reach
            trial("c", 6000.0, 0.95, 1 * GIB, **NOISY),  # 4.3k-8.4k: ties with a
        ]
    )
    ranking = rank_within_noise(frame)
    assert names(ranking.trials) == ["c", "a", "b"] and ranking.tier.tolist() == [0, 0, 1]


def test_a_trial_ten_times_slower_is_never_recommended_on_a_tie_break():
    """The issue's loaded machine: every trial flagged (threads on busy cores, steal), the
    slower one more accurate and smaller; a 10x gap is no tie, so it never wins on those."""
    busy = {"torch_threads": 2, **VERY_NOISY}
    frame = pd.DataFrame(
        [
            trial("slow-accurate", 30.0, 0.99, 1 * GIB, **busy),
            trial("fast", 300.0, 0.90, 2 * GIB, **busy),
        ]
    )
    ranking = rank_within_noise(frame)
    assert names(ranking.trials) == ["fast", "slow-accurate"] and ranking.tie_note(2) is None
    assert names(recommend(frame, budget=4 * GIB)) == ["fast", "slow-accurate"]


def test_clear_differences_between_steady_trials_keep_the_throughput_order():
    frame = pd.DataFrame(
        [
            trial("slow-accurate", 3000.0, 0.99, 1 * GIB),
            trial("fast", 9000.0, 0.80, 1 * GIB),
            trial("medium", 6000.0, 0.90, 1 * GIB),
        ]
    )
    ranking = rank_within_noise(frame)
    assert names(ranking.trials) == ["fast", "medium", "slow-accurate"]  # unchanged order
    assert ranking.tier.tolist() == [0, 1, 2]
    assert ranking.tie_note(2) is None
    assert names(recommend(frame, budget=2 * GIB)) == ["fast", "medium"]


def test_ties_are_judged_against_the_tiers_leader_not_by_chaining():
    frame = pd.DataFrame(
        [
            trial("a", 10_000.0, 0.70, GIB),
            trial("b", 9_500.0, 0.80, GIB),  # 5 % below a: ties
            trial("c", 9_100.0, 0.90, GIB),  # 9 % below a: ties (+-5 % each)
            trial("d", 8_700.0, 0.99, GIB),  # 13 % below a, 4 % below c: next tier
        ]
    )
    assert throughput_tiers(frame).tolist() == [0, 0, 0, 1]
    assert names(rank_within_noise(frame).trials) == ["c", "b", "a", "d"]


def test_without_accuracy_a_tie_goes_to_less_memory():
    frame = pd.DataFrame(
        [trial("big", 1000.0, None, 3 * GIB), trial("small", 980.0, None, 1 * GIB)]
    )
    ranking = rank_fits(frame, budget=4 * GIB)
    assert names(ranking.trials) == ["small", "big"]
    assert ranking.tie_note(1).endswith("ranked by lower peak memory, then fewer strategies")


def test_a_full_tie_goes_to_the_simpler_configuration():
    """The issue's sweep: checkpoint left the peak where none has it (the peak is in the
    optimizer step) and measured 0.6 % faster, within noise; the recommendation is none, which
    does not recompute anything for nothing."""
    none = trial("m", 1000.0, 0.9, GIB) | {"strategy": "none"}
    checkpoint = trial("m", 1006.0, 0.9, GIB) | {"strategy": "checkpoint"}
    both = trial("m", 1008.0, 0.9, GIB) | {"strategy": "checkpoint+accumulate:4"}
    ranking = rank_fits(pd.DataFrame([both, checkpoint, none]), budget=2 * GIB)
    assert ranking.trials["strategy"].tolist() == ["none", "checkpoint", "checkpoint+accumulate:4"]
    # Outside a tie the throughput order stands: 20 % faster is not noise.
    faster = trial("m", 1200.0, 0.9, GIB) | {"strategy": "checkpoint"}
    assert rank_fits(pd.DataFrame([none, faster]), 2 * GIB).trials["strategy"].iloc[0] == (
        "checkpoint"
    )


def test_the_accuracy_objective_is_not_touched_by_the_throughput_rule():
    frame = pd.DataFrame([trial("a", 9000.0, 0.80, GIB, **NOISY), trial("b", 1000.0, 0.95, GIB)])
    ranking = rank_fits(frame, budget=2 * GIB, objective="accuracy")
    assert names(ranking.trials) == ["b", "a"] and ranking.tie_note(2) is None


def test_the_runner_up_within_noise_says_so_and_names_the_accuracy():
    frame = pd.DataFrame(
        [trial("best", 5000.0, 0.95, GIB), trial("runner", 6500.0, 0.90, GIB, **NOISY)]
    )
    best, runner = rank_within_noise(frame).trials.iloc[0], rank_within_noise(frame).trials.iloc[1]
    text = gives_up(best, runner, "throughput", tied=True)
    assert text.startswith("throughput +30.0% (within noise), accuracy -0.050, peak memory")


# -- no usable trial ----------------------------------------------------------------------


def test_unusable_says_why_in_one_phrase():
    crashed = pd.DataFrame([{"status": "crash"}] * 3 + [{"status": "timeout"}])
    objectives = list(DEFAULT_OBJECTIVES)
    assert unusable(crashed, objectives) == "no trial finished ok (3 crash, 1 timeout)"
    unmeasured = pd.DataFrame([trial("a", 100.0, None, GIB)])
    wanted = [Objective("accuracy", "maximize")]
    assert unusable(unmeasured, wanted) == "none of its 1 ok trials measured accuracy (1 ok)"
    assert unusable(unmeasured, [Objective("throughput", "maximize")]) is None
    assert unusable(pd.DataFrame(), objectives) == "no trial recorded yet"


# -- sweeps recorded in a real MLflow store ------------------------------------------------

OBJECTIVES = "peak_allocated_bytes:min,throughput:max,accuracy:max"


def record_sweep(folder: Path, outcomes: list[tuple[str, dict]], name: str = "guards") -> str:
    """A sweep recorded as ``harness sweep`` records it, one trial per (status, metrics), under
    ``folder/results/mlflow.db`` (the commands' default store when run in ``folder``); returns
    the parent run id."""
    results = folder / "results"
    results.mkdir(parents=True, exist_ok=True)
    tracker = Tracker(f"sqlite:///{results}/mlflow.db", name, results / "mlartifacts" / name)
    params = {"objectives": OBJECTIVES, "device_memory_bytes": str(float(GIB))}
    parent = tracker.open_sweep(None, f"sweep {name}", tags={}, params=params)
    spec = {**BASE_SPEC, "name": name}
    spec["grid"] = {**BASE_SPEC["grid"], "batch_size": [8 * 2**i for i in range(len(outcomes))]}
    for index, (config, (status, metrics)) in enumerate(
        zip(trial_configs(parse_spec(spec)), outcomes, strict=True)
    ):
        workdir = folder / "work" / str(index)
        record_trial(tracker, parent, workdir, config, status, metrics, f"bs={config.batch_size}")
    tracker.close_sweep(parent, {})
    return parent


def measured(throughput: float, accuracy: float, peak: float, **noise: float) -> dict:
    return {"throughput": throughput, "accuracy": accuracy, "peak_allocated_bytes": peak,
            "step_time_ms_p50": 10.0, **(noise or STEADY)}  # fmt: skip


@pytest.fixture
def failed_sweep(tmp_path) -> tuple[Path, str]:
    outcomes = [("crash", {})] * 3 + [("timeout", {})]
    return tmp_path, record_sweep(tmp_path, outcomes)


@pytest.fixture
def noisy_sweep(tmp_path) -> tuple[Path, str]:
    """Batch 8: noisy and fastest (its 40 % spread reaches batch 16's figure), least
    accurate; batch 16: steady and most accurate; batch 32: steady, 21 % behind batch 16 (a
    clear difference), least memory."""
    outcomes = [
        ("ok", measured(6800.0, 0.827, 400e6, **VERY_NOISY)),
        ("ok", measured(5200.0, 0.951, 500e6)),
        ("ok", measured(4100.0, 0.930, 300e6)),
    ]
    return tmp_path, record_sweep(tmp_path, outcomes)


def test_no_picture_and_no_page_of_a_sweep_where_nothing_finished(failed_sweep, tmp_path):
    folder, _ = failed_sweep
    sweep = load_sweep("guards", f"sqlite:///{folder}/results/mlflow.db")
    assert set(sweep.frame["status"]) == {"crash", "timeout"}
    analysis = analyse(sweep.frame, list(DEFAULT_OBJECTIVES), None, sweep.device_memory)
    out = tmp_path / "out"
    with pytest.raises(ValueError, match=r"nothing to plot: no trial finished ok \(3 crash"):
        plots.pareto_png(sweep.frame, analysis, out / "pareto.png", "t")
    with pytest.raises(ValueError, match="nothing to plot"):
        plots.breakdown_png(sweep.frame, out / "breakdown.png", "t")
    with pytest.raises(ValueError, match=r"nothing to report: no trial finished ok"):
        write_report(sweep, analysis, list(DEFAULT_OBJECTIVES), out / "report.html")
    assert not out.exists()


def report_answer(folder: Path) -> str:
    """The report's opening section (its recommendation) for the sweep recorded in ``folder``."""
    sweep = load_sweep("guards", f"sqlite:///{folder}/results/mlflow.db")
    objectives = parse_objectives(OBJECTIVES)
    analysis = analyse(sweep.frame, objectives, None, sweep.device_memory)
    page = write_report(sweep, analysis, objectives, folder / "report.html").read_text()
    return page.split("<body>", 1)[1].split("</section>", 1)[0]


def test_the_report_ranks_noisy_throughputs_by_accuracy(noisy_sweep):
    folder, _ = noisy_sweep
    answer = report_answer(folder)
    # The headline is the accurate steady trial, not the noisy 6.80k samples/s one.
    assert "run <b>model_size tiny, batch_size 16" in answer
    assert "the most accurate configuration that fits among those whose throughputs" in answer
    assert "throughputs within noise (their measured spreads overlap): ranked by" in answer
    assert "6.80k samples/s" + NOISY_MARK in answer  # still shown, as the fastest, marked


# -- the commands, as a user runs them ------------------------------------------------------


@pytest.mark.slow
def test_pareto_report_recommend_on_an_all_failed_sweep_say_one_line_and_write_nothing(
    failed_sweep,
):
    folder, parent = failed_sweep
    out = folder / "out"
    expected = f"sweep {parent[:8]} of guards: no trial finished ok (3 crash, 1 timeout); "
    expected += "nothing to compare; harness results shows each failure_reason"
    for args in (
        ["pareto", "--out-dir", str(out)],
        ["report", "--out", str(out / "report.html")],
        ["report"],
        ["pareto"],
        ["recommend", "--budget", "1GiB"],
    ):
        done = run_cli(*args, cwd=folder)
        expect_exit(done, 1)
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and expected in lines[0], (args, done.stderr)
        assert done.stdout == "", args  # no header, no empty table
    assert not out.exists()
    assert not (folder / "results" / "guards").exists()  # no default out dir either
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{folder}/results/mlflow.db")
    assert client.list_artifacts(parent) == []  # nothing published on the sweep's run


def run_at_80_columns(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """``python -m harness ARGS`` as in an 80-column terminal."""
    env = {**os.environ, "COLUMNS": "80", "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-m", "harness", *args],
        cwd=cwd, capture_output=True, text=True, timeout=600, env=env,
    )  # fmt: skip


@pytest.mark.slow
def test_recommend_ties_noise_and_prints_the_long_note_whole_at_80_columns(noisy_sweep):
    folder, _ = noisy_sweep
    done = run_at_80_columns("recommend", "--budget", "1GiB", cwd=folder)
    expect_exit(done)
    lines = done.stdout.splitlines()
    assert any(line.startswith("Recommended: tiny 16 fp32 none") for line in lines), done.stdout
    runner = next(line for line in lines if line.startswith("Runner-up:"))
    # The noisy batch 8 ties with batch 16 on throughput and loses on accuracy.
    assert runner.startswith("Runner-up: tiny 8 fp32 none: throughput +30.8% (within noise), ")
    assert "accuracy -0.124, peak memory" in runner
    tie = "throughputs within noise (their measured spreads overlap): ranked by accuracy"
    assert any(line.startswith(tie) for line in lines), done.stdout
    for output in (done.stdout, run_at_80_columns("results", cwd=folder).stdout):
        lines = output.splitlines()
        start = next(i for i, line in enumerate(lines) if line.startswith(NOISY_MARK))
        folded = [lines[start], *(line for line in lines[start + 1 :] if line.startswith("  "))]
        note = " ".join(line.strip() for line in folded)  # whole, folded within 80 columns
        assert all(len(line) <= 80 for line in folded) and "…" not in note
        assert note.endswith(
            "do not compare them; rerun on an idle host (docs/measuring.md#stable-cpu-timings)"
        )
        assert "step times vary 40% (CV); 12% CPU steal; 2 threads on 0.4 free cores" in note


def test_a_recorded_loaded_sweep_never_recommends_the_ten_times_slower_trial(tmp_path):
    """The issue's sweep on a loaded machine, recorded as a sweep records it: both trials
    flagged (threads on busy cores, steal), the slower one 10x behind, more accurate and
    smaller. ``recommend`` and the report take the faster; the runner-up is no tie."""
    busy = {"step_time_cv": 0.03, "timing_steal_fraction": 0.12, "timing_free_cores": 0.4}
    outcomes = [
        ("ok", measured(30.0, 0.99, 300e6, **busy)),  # batch 8: slow, accurate, small
        ("ok", measured(300.0, 0.90, 500e6, **busy)),  # batch 16: 10x faster
    ]
    record_sweep(tmp_path, outcomes)
    done = run_at_80_columns("recommend", "--budget", "1GiB", cwd=tmp_path)
    expect_exit(done)
    lines = done.stdout.splitlines()
    assert any(line.startswith("Recommended: tiny 16 fp32 none") for line in lines), done.stdout
    runner = next(line for line in lines if line.startswith("Runner-up:"))
    assert "within noise" not in runner and "throughput -90.0%" in runner, runner
    assert "run <b>model_size tiny, batch_size 16" in report_answer(tmp_path)


def test_the_noise_note_is_never_cut():
    rows = [{"throughput": 100.0, "torch_threads": 2, **VERY_NOISY}, {"throughput": 90.0}]
    note = noise_footnote(pd.DataFrame(rows))
    assert note is not None and "…" not in note
    lines = note.splitlines()
    assert len(lines) > 1 and all(len(line) <= 160 for line in lines)  # folded, never cut
    whole = " ".join(line.strip() for line in lines)
    assert whole.endswith("rerun on an idle host (docs/measuring.md#stable-cpu-timings)")
