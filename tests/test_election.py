"""Workers that start a sweep together elect one MLflow parent run, without a clock."""

from __future__ import annotations

import copy
import threading
from pathlib import Path

import optuna
from mlflow.entities import ViewType

from harness.record.stores import storage_for
from harness.record.tracking import CANDIDATE_TAG, ROLE_TAG, SWEEP_ROLE, Tracker
from harness.spec import load_spec
from harness.sweep import plan
from harness.sweep.prepare import prepare
from tests.conftest import BASE_SPEC, write_spec


def spec_in(folder: Path) -> Path:
    data = copy.deepcopy(BASE_SPEC)
    data["tracking"] = {
        "storage": f"journal:{folder}/results/optuna.journal",
        "mlflow_uri": f"sqlite:///{folder}/results/mlflow.db",
        "results_dir": str(folder / "results"),
    }
    (folder / "results").mkdir()
    return write_spec(folder, data)


def test_the_first_live_candidate_entered_is_elected_by_everyone(tmp_path):
    spec = load_spec(spec_in(tmp_path))
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(study_name="s", storage=storage_for(spec.tracking.storage))
    live = {"a", "b", "c"}
    assert plan.elect_parent(spec, study, "a", live.__contains__) == "a"
    assert plan.elect_parent(spec, study, "b", live.__contains__) == "a"
    live.discard("a")  # its run is gone from MLflow (a store emptied while the study stayed)
    assert plan.elect_parent(spec, study, "c", live.__contains__) == "b"
    names = optuna.get_all_study_names(storage_for(spec.tracking.storage))
    assert sorted(names) == ["s", plan.election_name("s")]


def test_workers_starting_together_settle_on_one_parent_run(tmp_path):
    spec = load_spec(spec_in(tmp_path))
    parents: list[str] = []
    errors: list[BaseException] = []
    gate = threading.Barrier(3)

    def start() -> None:
        try:
            gate.wait()
            parents.append(prepare(spec, worker=True, runs_trials=False).parent)
        except BaseException as error:  # shown by the assertion below
            errors.append(error)

    threads = [threading.Thread(target=start) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert not errors, errors  # the SQLite stores too were created by racing starts
    assert len(parents) == 3 and len(set(parents)) == 1, parents
    tracker = Tracker(spec.tracking.mlflow_uri, spec.experiment, tmp_path / "artifacts")
    runs = tracker.client.search_runs(
        [tracker.experiment_id], f"tags.{ROLE_TAG} = '{SWEEP_ROLE}'"
    )  # live runs only: the losers deleted theirs
    assert [run.info.run_id for run in runs] == parents[:1]
    assert CANDIDATE_TAG not in runs[0].data.tags  # confirmed: readers take it for the sweep
    assert tracker.settled_sweep(runs[0].data.tags["study_name"]) == parents[0]
    every = tracker.client.search_runs(
        [tracker.experiment_id], f"tags.{ROLE_TAG} = '{SWEEP_ROLE}'", run_view_type=ViewType.ALL
    )
    print(f"{len(every)} parent run(s) created, {len(every) - 1} deleted by their losing start")
