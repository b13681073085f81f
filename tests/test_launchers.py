"""Sweeps handed to a cluster's scheduler: --launcher slurm (submitit) and --launcher ray.

The end-to-end tests run the real submission code: submitit's local executor starts real job
processes, a Ray cluster started here runs real actors, against this machine's PostgreSQL and an
`mlflow server` started here. In each, one worker is killed with SIGKILL while the study shows it
running a trial (and a Slurm job is preempted as Slurm does it, with SIGUSR2: submitit requeues
it); every point must still be recorded exactly once, the cut-off ones by another worker. Also: the launcher spec's one-line errors, preflight's refusal of stores that only this
host sees, and Optuna's own heartbeat on an RDB storage.
"""

from __future__ import annotations

import contextlib
import copy
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import optuna
import psutil
import pytest
from optuna.trial import TrialState

from harness.record.stores import storage_for
from harness.results import load
from harness.spec import SpecError, parse_spec
from harness.sweep import claim, plan, preflight, remote
from tests.conftest import (
    BASE_SPEC,
    REPO,
    expect_exit,
    free_port,
    mlflow_server_at,
    output_tail,
    run_cli,
    wait_for_port,
    wait_until,
    write_spec,
)
from tests.test_workers import (
    PASSWORD,
    POINTS,
    exactly_once,
    fresh_database,
    postgres_up,
)

__all__ = ["fresh_database"]  # a fixture the PostgreSQL tests use


def launcher_spec(name: str, launcher: dict[str, Any], **tracking: str) -> dict[str, Any]:
    data = {**copy.deepcopy(BASE_SPEC), "name": name, "grid": POINTS, "launcher": launcher}
    data["train"] = {**BASE_SPEC["train"], "budget": {"steps": 6}}
    if tracking:
        data["tracking"] = tracking
    return data


# ---- the spec and the checks before anything is submitted ---------------------------------


@pytest.mark.parametrize(
    ("launcher", "expected"),
    [
        ({"name": "slurmm"}, "launcher.name: must be one of 'local', 'slurm' or 'ray'"),
        ({"slurm": {"jbs": 3}}, "launcher.slurm.jbs: unknown key (allowed: jobs, cluster,"),
        ({"slurm": {"jobs": 0}}, "launcher.slurm.jobs: must be greater than 0"),
        ({"slurm": {"mem": "lots"}}, "launcher.slurm.mem: expected a size such as 512MiB"),
        ({"slurm": {"time": "soon"}}, "launcher.slurm.time: expected a duration such as 90s"),
        ({"slurm": {"cluster": "pbs"}}, "launcher.slurm.cluster: must be one of 'slurm' or"),
        ({"ray": {"adress": "x"}}, "launcher.ray.adress: unknown key (allowed: address,"),
        ({"ray": {"retries": -1}}, "launcher.ray.retries: must be at least 0"),
    ],
)
def test_a_bad_launcher_is_one_line_naming_the_field(launcher, expected):
    with pytest.raises(SpecError) as error:
        parse_spec(launcher_spec("l", launcher), "s.yaml")
    assert str(error.value).startswith(f"s.yaml: {expected}"), str(error.value)
    assert "\n" not in str(error.value)


def test_slurm_options_reach_submitit_as_written():
    from harness.sweep import slurm

    settings = {
        "jobs": 3, "partition": "gpu", "account": "lab", "cpus_per_task": 8, "mem": "64GiB",
        "time": "4h", "slurm_qos": "high", "slurm_max_num_timeout": 5,
    }  # fmt: skip
    spec = parse_spec(launcher_spec("l", {"name": "slurm", "slurm": settings}), "s.yaml")
    chosen = slurm.parameters(spec, gpus=2)
    assert chosen["slurm_gpus_per_task"] == 2 and chosen["tasks_per_node"] == 1
    assert chosen["slurm_partition"] == "gpu" and chosen["slurm_account"] == "lab"
    assert chosen["cpus_per_task"] == 8 and chosen["slurm_mem"] == "65536M"
    assert chosen["timeout_min"] == 240 and chosen["slurm_qos"] == "high"
    assert "slurm_max_num_timeout" not in chosen  # an executor option, given when it is made
    # The grid's largest world size is what a worker asks for; none for device: cpu.
    wide = launcher_spec("l", {"name": "slurm"})
    wide["grid"] = {**POINTS, "strategy": ["none", "ddp:2"], "batch_size": [8, 16]}
    assert remote.gpus_needed(parse_spec({**wide, "device": "auto"}, "s.yaml")) == 2
    assert remote.gpus_needed(parse_spec(wide, "s.yaml")) == 0


def test_an_option_submitit_does_not_know_is_one_line(tmp_path):
    pytest.importorskip("submitit")
    from harness.sweep import slurm

    data = launcher_spec("l", {"name": "slurm", "slurm": {"cluster": "local", "slurm_qoss": 1}})
    with pytest.raises(SpecError, match=r"^s.yaml: launcher.slurm: Unknown argument 'qoss'"):
        slurm.make_executor(parse_spec(data, "s.yaml"), tmp_path, 0)


def test_a_preempted_job_requeues_the_same_worker():
    pytest.importorskip("submitit")
    from harness.sweep.slurm import SlurmWorker

    worker = SlurmWorker("/shared/spec.yaml", "/shared")
    again = worker.checkpoint(2)  # what submitit calls on Slurm's preemption/time-out signal
    assert again.function is worker and again.args == (2,)


def test_a_missing_launcher_package_names_the_extra():
    with pytest.raises(
        SpecError, match=r"needs the no_such_pkg package: pip install 'harness\[ray\]'"
    ):
        remote.require("no_such_pkg", "ray")


def test_a_remote_launcher_refuses_a_sqlite_store_on_this_host(tmp_path):
    data = launcher_spec("refused", {"name": "local", "slurm": {"cluster": "local"}})
    done = run_cli("sweep", str(write_spec(tmp_path, data)), "--launcher", "slurm", cwd=tmp_path)
    expect_exit(done, 2)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert "tracking.storage: sqlite:///results/optuna.db is a path on this host only" in lines[0]
    assert not (tmp_path / "results" / "refused" / "slurm").exists()  # nothing submitted


@pytest.mark.parametrize(
    ("tracking", "field"),
    [
        ({"storage": "journal:results/optuna.journal"}, "tracking.storage"),
        (
            {"storage": "postgresql://db/x", "mlflow_uri": "sqlite:///mlflow.db"},
            "tracking.mlflow_uri",
        ),
        ({"storage": "postgresql://db/x", "mlflow_uri": "mlruns"}, "tracking.mlflow_uri"),
    ],
)
def test_stores_every_node_cannot_reach_are_refused(tracking, field):
    spec = parse_spec({**launcher_spec("l", {"name": "ray"}), "tracking": tracking}, "s.yaml")
    with pytest.raises(SpecError, match=rf"^s.yaml: {field}: .* is a path on this host only"):
        preflight.check_shared_stores(spec, "ray")


def test_shared_stores_pass():
    for tracking in (
        {"storage": "postgresql://u:pw@db/x", "mlflow_uri": "http://mlflow:5000"},
        {"storage": "journal:/shared/optuna.journal", "mlflow_uri": "sqlite:////shared/m.db"},
        {"storage": "sqlite:////shared/optuna.db", "mlflow_uri": "https://mlflow.example"},
    ):
        spec = parse_spec({**launcher_spec("l", {"name": "slurm"}), "tracking": tracking}, "s")
        preflight.check_shared_stores(spec, "slurm")


def test_options_a_cluster_launch_cannot_honour_are_refused():
    from harness.cli.run import check_remote_options, with_launcher

    spec = parse_spec(launcher_spec("l", {"name": "local"}), "s.yaml")
    spec = with_launcher(spec, "slurm")  # --launcher overrides the spec's name
    assert spec.launcher.name == "slurm" and spec._source == "s.yaml"
    with pytest.raises(SpecError, match=r"--workers and --launcher slurm: .*launcher.slurm.jobs"):
        check_remote_options(spec, False, None, None, 2)
    with pytest.raises(SpecError, match=r"^s.yaml: --fresh and --launcher slurm: "):
        check_remote_options(spec, True, None, None, 1)
    check_remote_options(spec, False, None, None, 1)


# ---- Optuna's heartbeat on an RDB storage -------------------------------------------------


def test_optuna_heartbeat_keeps_a_live_trial_and_fails_a_silent_one(tmp_path, monkeypatch, capsys):
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    monkeypatch.setattr(claim, "HEARTBEAT_S", 0.3)
    url = f"sqlite:///{tmp_path}/hb.db"
    storage = storage_for(url, heartbeat_s=1, grace_s=1, on_stale=claim.report_stale)
    study = plan.create_or_load("hb", lambda: storage, ["minimize"])
    live, silent = plan.new_trial(study), plan.new_trial(study)
    assert claim.claim_point(study, live, "live") and claim.claim_point(study, silent, "silent")
    assert silent.study.trials[silent.number].user_attrs[claim.TrialAttr.OPTUNA_BEAT] is True
    with claim.heartbeat(live):
        # The silent trial goes stale once the database clock (whole seconds) is past grace_s;
        # the live one, beating every 0.3 s, never does.
        failed = wait_until(lambda: claim.fail_stale_trials(study), 60, "the silent trial failed")
        assert failed == 1
    states = {t.user_attrs["trial_key"]: t for t in study.get_trials()}
    assert states["live"].state == TrialState.RUNNING
    assert states["silent"].state == TrialState.FAIL
    assert claim.released(states["silent"], {})  # failed without a status: its point is free
    # Whoever runs that point again deletes any MLflow run of it its dead worker left.
    assert claim.cut_off_before(study, live, "silent") and not claim.cut_off_before(
        study, live, "live"
    )
    assert "point silent, worker" in capsys.readouterr().err  # the stale-trial callback's line


# ---- end to end: real jobs, real actors, a worker killed mid-trial ------------------------


def sweep_driver(folder: Path, data: dict[str, Any], *flags: str) -> subprocess.Popen[str]:
    """``harness sweep`` of the spec ``data`` in ``folder``, as a user starts it: its output
    (stdout and stderr together) read by the test."""
    spec_path = write_spec(folder, data)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen(
        [sys.executable, "-m", "harness", "sweep", str(spec_path), *flags],
        cwd=folder, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip


@pytest.fixture(scope="module")
def tracking_server(tmp_path_factory) -> Iterator[str]:
    """One `mlflow server` for this module's end-to-end tests (each has its own experiment)."""
    with mlflow_server_at(tmp_path_factory.mktemp("mlflow-server")) as url:
        yield url


def session_processes(sid: int) -> list[psutil.Process]:
    found = []
    for process in psutil.process_iter():
        with contextlib.suppress(psutil.Error, ProcessLookupError):
            if os.getsid(process.pid) == sid and process.status() != psutil.STATUS_ZOMBIE:
                found.append(process)
    return found


def stop_session(sid: int, grace_s: float = 5.0) -> list[psutil.Process]:
    """SIGTERM every process of a session, SIGKILL what is left after ``grace_s``; what
    needed the SIGKILL."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(sid, signal.SIGTERM)
    deadline = time.time() + grace_s
    while time.time() < deadline and session_processes(sid):
        time.sleep(0.2)
    left = session_processes(sid)
    for process in left:
        with contextlib.suppress(psutil.Error):
            process.kill()
    psutil.wait_procs(left, timeout=10)
    return left


def the_study(storage: Any) -> Any:
    """The one sweep study of a fresh database (not its workers' parent-run election)."""
    summaries = [
        summary
        for summary in optuna.get_all_study_summaries(storage, include_best_trial=False)
        if not summary.study_name.endswith(":parent")  # plan.election_name
    ]
    if not summaries:
        return None
    return optuna.load_study(study_name=summaries[0].study_name, storage=storage)


def stop_a_worker_mid_trial(
    storage_url: str,
    is_worker: Any,
    driver: subprocess.Popen[str],
    how: signal.Signals = signal.SIGKILL,
    spare: tuple[str, ...] = (),
    timeout_s: float = 240,
) -> tuple[list[int], list[psutil.Process], str]:
    """Wait until the study shows a claimed trial RUNNING (of an owner not in ``spare``), send
    its worker (``owner``) ``how``, and once the worker is gone return the trials that were cut
    off (a trial that ended just before its worker died does not count: another worker is
    stopped then), the processes the worker had started, and its owner."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    storage = optuna.storages.RDBStorage(storage_url)
    deadline = time.time() + timeout_s
    stopped: list[int] = []
    orphans: list[psutil.Process] = []
    while time.time() < deadline and driver.poll() is None and len(stopped) < 2:
        study = the_study(storage)
        running = [] if study is None else study.get_trials(states=(TrialState.RUNNING,))
        claimed = [
            t
            for t in running
            if "trial_key" in t.user_attrs and t.user_attrs.get("owner") not in (None, *spare)
        ]
        if not claimed:
            time.sleep(0.1)
            continue
        trial = claimed[0]
        try:
            worker = psutil.Process(int(trial.user_attrs["owner"].rpartition(":")[2]))
            assert is_worker(worker), worker.cmdline()
            orphans += worker.children(recursive=True)
            worker.send_signal(how)
        except psutil.NoSuchProcess:  # it ended on its own just now
            continue
        worker.wait(60)
        after = study.trials[trial.number]
        if after.state != TrialState.COMPLETE and "status" not in after.user_attrs:
            return [*stopped, trial.number], orphans, trial.user_attrs["owner"]
        stopped.append(trial.number)  # it had just finished: stop another one
    pytest.fail(f"no trial was cut off by {how.name} (driver exit {driver.poll()})")


def assert_recovered(storage_url: str, cut_off: list[int]) -> None:
    """Each cut-off trial failed as a dead worker's, and its point ran again on another."""
    study = the_study(optuna.storages.RDBStorage(storage_url))
    for number in cut_off:
        dead = study.trials[number]
        assert dead.state == TrialState.FAIL and "status" not in dead.user_attrs
        again = [
            t
            for t in study.trials
            if t.user_attrs.get("trial_key") == dead.user_attrs["trial_key"]
            and t.state == TrialState.COMPLETE
        ]
        assert len(again) == 1 and again[0].user_attrs["owner"] != dead.user_attrs["owner"]


def assert_gone(processes: list[psutil.Process], seconds: float = 60) -> None:
    """The processes end within ``seconds`` (at once, usually; a loaded machine is slower)."""
    _, alive = psutil.wait_procs(processes, timeout=seconds)
    assert not alive, f"alive after the {seconds:g} s limit: {[p.cmdline() for p in alive]}"


@pytest.mark.slow
@pytest.mark.skipif(not postgres_up(), reason="no PostgreSQL server at 127.0.0.1:5432")
def test_slurm_job_array_records_every_point_once_through_a_killed_and_a_preempted_job(
    tmp_path, tracking_server, fresh_database
):
    pytest.importorskip("submitit")
    name = "slurm-array"
    slurm = {"jobs": 3, "cluster": "local", "time": "10m"}
    data = launcher_spec(
        name, {"name": "slurm", "slurm": slurm}, storage=fresh_database, mlflow_uri=tracking_server
    )
    # Eight points, not six: after the first job is killed, the other two must still have a
    # trial running for the preemption to cut off (with six, a loaded machine's sweep could
    # end before it: CI, "no trial was cut off by SIGUSR2 (driver exit 0)").
    # Twenty steps a trial: the two jobs left after the kill must not finish every point before
    # the preemption finds a trial running (at 6 steps they did, twice, on a loaded machine).
    data["grid"] = {**POINTS, "batch_size": [*POINTS["batch_size"], 64]}
    data["train"]["budget"] = {"steps": 20}
    started = time.monotonic()
    driver = sweep_driver(tmp_path, data, "--wait")
    try:

        def is_job(process: psutil.Process) -> bool:
            return "submitit.core._submit" in " ".join(process.cmdline())

        killed, orphans, owner = stop_a_worker_mid_trial(fresh_database, is_job, driver)
        # Then what Slurm sends a job it preempts: submitit requeues it, and it rejoins.
        preempted, more, _ = stop_a_worker_mid_trial(
            fresh_database, is_job, driver, signal.SIGUSR2, spare=(owner,)
        )
        output, _ = driver.communicate(timeout=300)
    finally:
        if driver.poll() is None:
            driver.kill()
    took = time.monotonic() - started
    print(f"slurm launch, 8 points over 3 jobs, one killed, one preempted: {took:.1f} s")
    assert driver.returncode == 0, output_tail(output)
    assert "Submitted 3 local submitit job(s)" in output
    assert output.count("warning: job ") == 1 and "ended without a result" in output  # killed
    exactly_once(load(name, tracking_server), 8)
    assert_recovered(fresh_database, killed + preempted)
    assert_gone(orphans + more)  # the stopped workers' trials and warm starters went with them
    folder = tmp_path / "results" / name / "slurm"  # submitit's files and the jobs' logs
    assert len(list(folder.glob("*_log.out"))) == 3
    assert any("Requeued job" in log.read_text() for log in folder.glob("*_log.out"))
    for path in folder.iterdir():  # the stores went by environment: no password in a file
        assert PASSWORD.encode() not in path.read_bytes(), path.name
    assert PASSWORD not in output


@pytest.fixture
def ray_cluster() -> Iterator[str]:
    """A local Ray cluster (`ray start --head`), its own session, stopped and checked gone."""
    pytest.importorskip("ray")
    folder = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # Ray's socket paths must stay short
    port = free_port()
    command = [
        os.path.join(os.path.dirname(sys.executable), "ray"), "start", "--head", "--block",
        "--port", str(port), "--num-cpus", "4", "--num-gpus", "0", "--include-dashboard=false",
        "--disable-usage-stats", "--temp-dir", folder, "--object-store-memory", "100000000",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO), "RAY_USAGE_STATS_ENABLED": "0"}
    log = Path(folder) / "ray-start.log"
    with log.open("wb") as output:
        head = subprocess.Popen(
            command, env=env, stdout=output, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        wait_for_port(port, 180, "ray head", head, log)
        yield f"127.0.0.1:{port}"
    finally:
        stop_session(head.pid, grace_s=2.0)
        head.wait(timeout=30)
        left = session_processes(head.pid)
        assert not left, f"Ray processes outlived the cluster: {[p.cmdline() for p in left]}"
        shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.slow
@pytest.mark.skipif(not postgres_up(), reason="no PostgreSQL server at 127.0.0.1:5432")
def test_ray_actors_record_every_point_once_through_a_killed_worker(
    tmp_path, tracking_server, fresh_database, ray_cluster
):
    name = "ray-actors"
    ray = {"address": ray_cluster, "workers": 2, "retries": 2}
    data = launcher_spec(
        name, {"name": "local", "ray": ray}, storage=fresh_database, mlflow_uri=tracking_server
    )
    started = time.monotonic()
    driver = sweep_driver(tmp_path, data, "--launcher", "ray")
    try:
        cut_off, orphans, _ = stop_a_worker_mid_trial(
            fresh_database, lambda p: "RayWorker" in " ".join(p.cmdline()), driver
        )
        output, _ = driver.communicate(timeout=300)
    finally:
        if driver.poll() is None:
            driver.kill()
    print(f"ray launch, 6 points over 2 actors, one killed: {time.monotonic() - started:.1f} s")
    assert driver.returncode == 0, output_tail(output)
    assert "Started 2 Ray worker(s)" in output
    exactly_once(load(name, tracking_server), 6)
    assert_recovered(fresh_database, cut_off)
    assert_gone(orphans)


def test_the_readme_recipes_are_valid_specs():
    import re

    import yaml

    text = (REPO / "README.md").read_text()
    section = text[text.index("## Many machines") : text.index("## Documentation")]
    recipes = re.findall(r"```yaml\n(.*?)```", section, re.S)
    assert len(recipes) == 2
    for recipe, name in zip(recipes, ("slurm", "ray"), strict=True):
        spec = parse_spec({**copy.deepcopy(BASE_SPEC), **yaml.safe_load(recipe)}, "README.md")
        assert spec.launcher.name == name
        preflight.check_shared_stores(spec, name)  # the stores every node reaches
