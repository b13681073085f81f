"""Shared helpers: a valid spec to mutate, the ``harness`` CLI run as a user runs it, and a
headless browser."""

from __future__ import annotations

import contextlib
import copy
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

FIXTURES = Path(__file__).parent / "fixtures"
REPO = Path(__file__).resolve().parent.parent

BASE_SPEC: dict[str, Any] = {
    "name": "unit",
    "model": {"family": "mlp", "sizes": {"tiny": {"width": 16, "depth": 1}}},
    "data": {"dataset": "digits"},
    "grid": {"batch_size": [32], "dtype": ["fp32"], "strategy": ["none"]},
    "train": {"optimizer": {"name": "adam", "lr": 0.001}, "budget": {"steps": 20}, "seed": 0},
    "measure": {"warmup_steps": 1, "memory_steps": 2, "timed_steps": 3},
    "device": "cpu",
}


@pytest.fixture
def base_spec() -> dict[str, Any]:
    return copy.deepcopy(BASE_SPEC)


def write_spec(folder: Path, data: dict[str, Any], name: str = "spec.yaml") -> Path:
    path = folder / name
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def run_cli(*args: str, cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    """Run ``python -m harness ARGS`` in ``cwd`` (so its results/ land there)."""
    # Tables as a pipe gets them (140 columns), whatever terminal width the runner exports.
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    env["PYTHONPATH"] = str(REPO)
    return subprocess.run(
        [sys.executable, "-m", "harness", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def record_trial(
    tracker: Any,
    parent: str,
    workdir: Path,
    config: Any,
    status: str = "ok",
    metrics: dict[str, float] | None = None,
    run_name: str = "label",
) -> str:
    """One trial recorded as a sweep records it (``Tracker.log_trial``) without running it, in
    a real MLflow store: the results and decisions read exactly this. Its run id."""
    from harness.trial.result import Status, TrialResult

    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "config.json").write_text(config.to_json())
    result = TrialResult(
        trial_key=config.trial_key,
        status=Status(status),
        failure_reason="" if status == "ok" else "why",
        metrics=metrics or {},
        loss_history=[2.0, 1.5, float("nan")],
        info={"device": "cpu", "torch_threads": 2},
    )
    return tracker.log_trial(parent, config, result, workdir, int(time.time() * 1000), run_name)


def copy_fixture(name: str, folder: Path) -> Path:
    return Path(shutil.copy(FIXTURES / name, folder / name))


@contextlib.contextmanager
def headless_chromium(window: str, console_log: bool = False) -> Iterator[Any]:
    """Debian's Chromium under Selenium, closed afterwards; skipped where it is not installed
    (``make browser`` installs it), a failure in CI, which must have it."""
    chromium, driver_path = shutil.which("chromium"), shutil.which("chromedriver")
    if not (chromium and driver_path):
        if os.environ.get("CI"):
            pytest.fail("CI must have chromium + chromedriver (make browser installs them)")
        pytest.skip("chromium / chromedriver not installed (make browser installs them)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage",
                     f"--window-size={window}"):  # fmt: skip
        options.add_argument(argument)
    if console_log:
        options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    browser = webdriver.Chrome(options=options, service=Service(driver_path))
    try:
        yield browser
    finally:
        browser.quit()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def wait_for_port(port: int, seconds: float, what: str) -> None:
    """Until something listens on 127.0.0.1:``port``; the test fails after ``seconds``."""
    deadline = time.time() + seconds
    while time.time() < deadline:
        with contextlib.suppress(OSError):
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        time.sleep(0.3)
    pytest.fail(f"{what} did not start in {seconds:g} s")


@contextlib.contextmanager
def mlflow_server_at(folder: Path) -> Iterator[str]:
    """A real ``mlflow server`` (SQLite store and artifacts under ``folder``) on a free port,
    its URL; stopped with every process it started. MLflow 3's job runner is off: eight
    polling processes no test uses."""
    port = free_port()
    command = [
        os.path.join(os.path.dirname(sys.executable), "mlflow"), "server",
        "--backend-store-uri", f"sqlite:///{folder}/server.db",
        "--artifacts-destination", str(folder / "server-artifacts"),
        "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
    ]  # fmt: skip
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    server = subprocess.Popen(
        command, cwd=folder, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True,
    )  # fmt: skip
    try:
        wait_for_port(port, 90, "mlflow server")
        yield f"http://127.0.0.1:{port}"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait(timeout=30)
