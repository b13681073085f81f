"""The MLflow UI shows a sweep as model training: the printed URL opens the trials' runs table
with their key metrics as columns (not MLflow 3's GenAI overview), checked in headless
Chromium against `mlflow ui` as `make ui` runs it."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from harness.contract import DEFAULT_MLFLOW_URI
from harness.record.stores import initialise_mlflow_store, prepare_store
from harness.record.tracking import (
    EXPERIMENT_KIND_TAG,
    LOCAL_UI,
    NOTE_TAG,
    TRAINING_KIND,
    VIEW_KEY,
    VIEW_TAG,
    runs_url,
    trial_note,
    ui_hint,
    ui_links,
)
from harness.spec import parse_spec, trial_configs
from harness.trial.result import Status, TrialResult
from tests.conftest import (
    BASE_SPEC,
    expect_exit,
    free_port,
    headless_chromium,
    record_trial,
    run_cli,
    wait_for_port,
    write_spec,
)
from tests.test_tracking import store  # noqa: F401  (store: a fixture)


def test_the_experiment_is_tagged_and_its_runs_url_printed(store, base_spec):  # noqa: F811
    uri, tracker, parent, folder = store
    tags = tracker.client.get_experiment(tracker.experiment_id).tags
    assert tags[EXPERIMENT_KIND_TAG] == TRAINING_KIND
    view = json.loads(tags[VIEW_TAG])
    assert view["searchFilter"] == "tags.harness_role = 'trial'"
    assert "metrics.`peak_allocated_bytes`" in view["selectedColumns"]
    assert view["orderByKey"] != "attributes.start_time"  # so trials are rows of their own
    url = runs_url(tracker.experiment_id)
    assert url == (
        f"{LOCAL_UI}/#/experiments/{tracker.experiment_id}/runs"
        f"?workflowType=machine_learning&viewStateShareKey={VIEW_KEY}"
    )
    assert ui_hint(uri, "exp") == f"mlflow ui --backend-store-uri {uri}, then open {url}"
    assert ui_links(uri) == [("exp", url)]
    # A kind the user picked in the UI is kept when the next sweep opens the experiment.
    tracker.client.set_experiment_tag(tracker.experiment_id, EXPERIMENT_KIND_TAG, "finetuning")
    again = type(tracker)(uri, "exp", folder / "artifacts")
    assert again.client.get_experiment(again.experiment_id).tags[EXPERIMENT_KIND_TAG] == (
        "finetuning"
    )
    config = trial_configs(parse_spec(base_spec))[0]
    metrics = {"peak_allocated_bytes": 3 * 2**20, "throughput": 2600.0, "accuracy": 0.91234}
    run_id = record_trial(tracker, parent, folder / "w", config, metrics=metrics)
    note = tracker.client.get_run(run_id).data.tags[NOTE_TAG]
    assert note == "peak 3 MiB · 2.60k samples/s · acc 0.912"


def test_a_failed_trials_note_says_why():
    result = TrialResult.failure("k", Status.OOM, "CUDA out of memory")
    assert trial_note(result) == "oom · (CUDA out of memory)"


def start_mlflow_ui(folder: Path, port: int) -> subprocess.Popen[bytes]:
    """`make ui` in ``folder``, on another port (and one worker: it starts sooner); its output
    in ``folder/mlflow-ui.log``."""
    command = [
        os.path.join(os.path.dirname(sys.executable), "mlflow"), "ui",
        "--backend-store-uri", DEFAULT_MLFLOW_URI,
        "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
    ]  # fmt: skip
    with (folder / "mlflow-ui.log").open("wb") as log:
        return subprocess.Popen(
            command, cwd=folder, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )


def stop(server: subprocess.Popen[bytes]) -> None:
    os.killpg(server.pid, signal.SIGTERM)
    try:
        server.wait(timeout=60)
    except subprocess.TimeoutExpired:  # a loaded machine: uvicorn's workers take their time
        os.killpg(server.pid, signal.SIGKILL)
        server.wait(timeout=30)


@pytest.mark.slow
def test_the_printed_url_opens_the_trials_in_headless_chromium(tmp_path):
    """As a user would: sweep, `make ui`, open the URL the summary printed in Chromium."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    # The store first, so the UI starts while the sweep runs (each takes seconds).
    prepare_store(f"sqlite:///{tmp_path}/results/mlflow.db", initialise_mlflow_store)
    port = free_port()
    server = start_mlflow_ui(tmp_path, port)
    stack = contextlib.ExitStack()
    try:
        spec = {**BASE_SPEC, "name": "ui"}
        spec["train"] = {**BASE_SPEC["train"], "budget": {"steps": 6}}
        done = run_cli("sweep", str(write_spec(tmp_path, spec)), cwd=tmp_path)
        expect_exit(done)
        printed = re.search(r"Next: make ui, then open (\S+)", done.stdout)
        assert printed, done.stdout
        store = f"sqlite:///{tmp_path}/results/mlflow.db"
        experiment = MlflowClient(tracking_uri=store).get_experiment_by_name("ui")
        assert printed.group(1) == runs_url(experiment.experiment_id)
        url = runs_url(experiment.experiment_id, f"http://127.0.0.1:{port}")
        wait_for_port(port, 180, "mlflow ui", server, tmp_path / "mlflow-ui.log")

        browser = stack.enter_context(headless_chromium("1920,1000"))
        browser.get(url)
        trial = "tiny bs=32 fp32 none"  # the run name: the trial's label

        def table() -> str:
            grids = browser.find_elements(By.CSS_SELECTOR, ".ag-root")
            return grids[0].text if grids else ""

        WebDriverWait(browser, 90).until(lambda _: trial in table() and "KiB" in table())
        text = table()
        screenshot = tmp_path / "mlflow-ui.png"  # kept with the test's files for a look
        assert browser.save_screenshot(str(screenshot))
        # The runs table, not the GenAI overview; the trial a row of its own, its key numbers
        # in units (the description) and its metrics as columns; the sweep's run filtered out.
        assert f"/experiments/{experiment.experiment_id}/runs" in browser.current_url
        for column in ("Description", "peak_allocated_bytes", "throughput", "accuracy"):
            assert column in text, text
        assert "samples/s" in text and "sweep ui" not in text, text
        assert "Observability" not in browser.find_element(By.TAG_NAME, "body").text  # GenAI's
    finally:
        stack.close()
        stop(server)
