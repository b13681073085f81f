"""Results a careful user can trust: hardware in every trial's identity, failed trials retried
in place, worker GPUs split without overlap, and no password in any record or command line."""

from __future__ import annotations

import contextlib
import copy
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from mlflow.entities import ViewType
from mlflow.tracking import MlflowClient

from harness.results import load
from harness.spec import SpecError, SweepPlan, parse_spec, trial_configs
from harness.sweep import plan
from harness.sweep.workers import check_gpus, gpus_for_worker
from harness.trial.hardware import cpu_name, host_hardware
from tests.conftest import (
    BASE_SPEC,
    REPO,
    copy_fixture,
    expect_exit,
    output_tail,
    run_cli,
    write_spec,
)
from tests.test_workers import PASSWORD, fresh_database, postgres_up  # noqa: F401

CPU = {"device": "cpu", "device_name": "Some CPU"}
H200 = {"device": "cuda", "device_name": "NVIDIA H200"}


def test_the_hardware_is_part_of_every_trials_identity():
    spec = parse_spec(copy.deepcopy(BASE_SPEC), "s.yaml")
    (unprobed,) = trial_configs(spec)
    (on_cpu,) = SweepPlan(spec).on_hardware(CPU).configs
    (on_gpu,) = SweepPlan(spec).on_hardware(H200).configs
    assert on_cpu.device == "cpu" and on_gpu.device == "cuda"  # resolved, not "auto"
    assert on_gpu.hardware == H200
    assert len({unprobed.trial_key, on_cpu.trial_key, on_gpu.trial_key}) == 3
    other_cpu = SweepPlan(spec).on_hardware({**CPU, "device_name": "Another CPU"})
    assert other_cpu.configs[0].trial_key != on_cpu.trial_key
    # The world size is the strategy's, part of the key already.
    assert on_gpu.world_size == 1 and "strategy" in on_gpu.to_dict()


def test_this_host_resolves_auto_without_torch_on_a_cpu_machine():
    assert host_hardware("cpu") == {"device": "cpu", "device_name": cpu_name()}
    found = host_hardware("auto")
    assert found["device"] in ("cpu", "cuda") and found["device_name"]


def test_a_spec_swept_on_other_hardware_is_a_new_sweep(tmp_path):
    data = {**copy.deepcopy(BASE_SPEC), "tracking": {"storage": f"sqlite:///{tmp_path}/o.db"}}
    spec = parse_spec(data, "s.yaml")
    first = plan.open_study(SweepPlan(spec).on_hardware(CPU))
    first.enqueue_trial({"model_size": "tiny", "batch_size": 32, "dtype": "fp32"})
    first.ask()
    assert plan.swept_elsewhere(first, SweepPlan(spec).on_hardware(CPU)) is None  # resuming it
    second = plan.open_study(SweepPlan(spec).on_hardware(H200))
    assert second.study_name != first.study_name
    assert plan.swept_elsewhere(second, SweepPlan(spec).on_hardware(H200)) == "cpu (Some CPU)"


def test_workers_get_gpus_of_their_own_and_too_many_are_refused():
    assert [gpus_for_worker(i, 2, 8) for i in range(4)] == ["0,1", "2,3", "4,5", "6,7"]
    assert gpus_for_worker(0, 1, 1) is None and gpus_for_worker(1, 1, 0) is None
    spec = parse_spec(copy.deepcopy(BASE_SPEC), "s.yaml")
    check_gpus(spec, 4, 2, 8)
    check_gpus(spec, 3, 2, 0)  # no GPU: CPU workers, nothing to split
    with pytest.raises(SpecError, match=r"--workers 3: each worker needs 2 GPU\(s\).* has 4"):
        check_gpus(spec, 3, 2, 4)


@pytest.mark.slow
def test_retry_failed_replaces_failed_records_in_the_same_sweep(tmp_path):
    copy_fixture("faulty_models.py", tmp_path)
    data = copy.deepcopy(BASE_SPEC)
    data["name"] = "retry"
    data["model"] = {
        "family": "faulty_models:build",
        "sizes": {"ok": {"mode": "ok"}, "flaky": {"mode": "crash_once"}, "huge": {"mode": "huge"}},
    }
    spec_path = write_spec(tmp_path, data)
    uri = f"sqlite:///{tmp_path}/results/mlflow.db"

    first = run_cli("sweep", str(spec_path), cwd=tmp_path)
    expect_exit(first, 1)  # the crash
    before = load("retry", uri).set_index("model_size")
    assert before["status"].to_dict() == {"ok": "ok", "flaky": "crash", "huge": "oom"}
    assert before["device"].eq("cpu").all() and before["device_name"].eq(cpu_name()).all()

    again = run_cli("sweep", str(spec_path), "--retry-failed", cwd=tmp_path)
    expect_exit(again)
    assert "Retrying 1 recorded trial(s)" in again.stdout
    after = load("retry", uri).set_index("model_size")
    assert after["status"].to_dict() == {"ok": "ok", "flaky": "ok", "huge": "oom"}
    assert after["sweep_run_id"].nunique() == 1  # the same parent run
    assert after.loc["ok", "run_id"] == before.loc["ok", "run_id"]  # kept, not re-run
    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name("retry").experiment_id
    (old,) = client.search_runs([experiment], run_view_type=ViewType.DELETED_ONLY)
    assert old.info.run_id == before.loc["flaky", "run_id"]
    assert old.data.tags["superseded"] == "retry-failed"

    everything = run_cli("sweep", str(spec_path), "--retry-failed=all", cwd=tmp_path)
    expect_exit(everything)
    assert "Retrying 1 recorded trial(s)" in everything.stdout  # the oom; ok trials stay
    last = load("retry", uri).set_index("model_size")
    assert len(last) == 3 and last["trial_key"].is_unique
    assert last.loc["huge", "run_id"] != after.loc["huge", "run_id"]
    assert last.loc["flaky", "run_id"] == after.loc["flaky", "run_id"]
    parent = client.get_run(last["sweep_run_id"].iloc[0])
    assert parent.data.tags["device"] == "cpu"
    assert parent.data.tags["device_name"] == cpu_name()
    assert parent.data.metrics["trials_ok"] == 2 and parent.data.metrics["trials_oom"] == 1
    assert parent.data.metrics["trials_crash"] == 0

    plain = run_cli("sweep", str(spec_path), cwd=tmp_path)
    expect_exit(plain)
    assert "Nothing left to run" in plain.stdout


def worker_command_lines(sweep_pid: int) -> list[str]:
    """The command lines of the sweep's own workers: its process tree only. A suite running
    beside this one has workers of its own, e.g. test_workers.py's, which is given the
    password on its command line (``harness worker --storage URL``) as a user may give it."""
    lines = []
    with contextlib.suppress(psutil.NoSuchProcess):
        for process in psutil.Process(sweep_pid).children(recursive=True):
            with contextlib.suppress(psutil.Error):
                with_args = " ".join(process.cmdline())
                if "harness" in with_args and "worker" in with_args:
                    lines.append(with_args)
    return lines


@pytest.mark.slow
@pytest.mark.skipif(not postgres_up(), reason="no PostgreSQL server at 127.0.0.1:5432")
def test_no_password_in_records_or_command_lines(tmp_path, fresh_database):  # noqa: F811
    data = copy.deepcopy(BASE_SPEC)
    data["name"] = "secret-store"
    data["grid"] = {**data["grid"], "batch_size": [8, 16]}
    data["tracking"] = {"storage": fresh_database}
    spec_path = write_spec(tmp_path, data)
    assert PASSWORD in spec_path.read_text()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    command = [sys.executable, "-m", "harness", "sweep", str(spec_path), "--workers", "2"]
    sweep = subprocess.Popen(
        command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    seen: list[str] = []
    while sweep.poll() is None:
        seen += worker_command_lines(sweep.pid)
        time.sleep(0.2)
    output = sweep.stdout.read() if sweep.stdout else ""
    assert sweep.returncode == 0, output_tail(output)
    assert any("worker" in line for line in seen), "no worker process was seen running"
    assert not [line for line in seen if PASSWORD in line]
    assert PASSWORD not in output
    uri = f"sqlite:///{tmp_path}/results/mlflow.db"
    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name("secret-store").experiment_id
    runs = client.search_runs([experiment])
    described = [
        {
            k: run.data.tags.get(k)
            for k in ("harness_role", "trial_key", "status", "harness_candidate")
        }
        | {"run": run.info.run_id[:8], "state": run.info.status}
        for run in runs
    ]
    assert len(runs) == 3, f"not the sweep and its two trials: {described}\n{output_tail(output)}"
    for run in runs:
        recorded = " ".join([*run.data.params.values(), *run.data.tags.values()])
        assert PASSWORD not in recorded
    parent = next(run for run in runs if run.data.tags.get("harness_role") == "sweep")
    logged = Path(client.download_artifacts(parent.info.run_id, "spec", str(tmp_path / "dl")))
    text = (logged / "spec.yaml").read_text()
    assert PASSWORD not in text and "postgres:***@127.0.0.1" in text
    assert len(load("secret-store", uri)) == 2


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp:1", "fsdp:1"])
def test_one_rank_ddp_and_fsdp_run_under_torchrun_and_are_predicted(tmp_path, strategy):
    from harness.sweep.launch import launch_trial

    data = copy.deepcopy(BASE_SPEC)
    data["grid"] = {**data["grid"], "strategy": [strategy]}
    (config,) = trial_configs(parse_spec(data, "s.yaml"))
    result = launch_trial(config, tmp_path / "trial", 300)
    assert result.status.value == "ok", result.failure_reason
    assert result.info["trial_start"] == "torchrun"
    assert 0.9 <= result.metrics["prediction_ratio"] <= 1.1
