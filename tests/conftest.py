"""Shared helpers: a valid spec to mutate, the ``harness`` CLI run as a user runs it, waits on
conditions (never a fixed sleep), exit codes checked with the process's own words, and a
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
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
import yaml

from harness.pipes import LineReader, PipeClosed

# One torch thread per process (this one's trials and every process a test starts): the suite
# runs two pytest processes on a small machine, each often with a trial process beside it, and
# more threads than cores spin-wait against each other. Memory figures do not depend on it; the
# tests that look at threads or throughput noise build their rows themselves.
os.environ.setdefault("OMP_NUM_THREADS", "1")

FIXTURES = Path(__file__).parent / "fixtures"
REPO = Path(__file__).resolve().parent.parent
T = TypeVar("T")
TAIL_CHARS = 4000  # of a failing process's stderr and of its stdout, shown by expect_exit

BASE_SPEC: dict[str, Any] = {
    "name": "unit",
    "model": {"family": "mlp", "sizes": {"tiny": {"width": 16, "depth": 1}}},
    "data": {"dataset": "digits"},
    "grid": {"batch_size": [32], "dtype": ["fp32"], "strategy": ["none"]},
    "train": {"optimizer": {"name": "adam", "lr": 0.001}, "budget": {"steps": 20}, "seed": 0},
    # No memory timeline (not part of the trial key): drawing it costs a sweep a matplotlib
    # import and each trial a picture. The tests of timelines turn it on (test_timeline.py,
    # test_analysis_cli.py, test_sweep_strategies.py; experiments/default.yaml has it on).
    "measure": {"warmup_steps": 1, "memory_steps": 2, "timed_steps": 3, "timeline": False},
    "device": "cpu",
}


# The `text` dataset with a short held-out split, for trials whose accuracy is not the point:
# evaluating the default 20 % (about 4,400 windows) costs a small model's trial 20-30 s here.
SHORT_TEXT: dict[str, Any] = {"dataset": "text", "test_fraction": 0.01}


@pytest.fixture
def base_spec() -> dict[str, Any]:
    return copy.deepcopy(BASE_SPEC)


def write_spec(folder: Path, data: dict[str, Any], name: str = "spec.yaml") -> Path:
    path = folder / name
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def run_cli(*args: str, cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    """Run ``python -m harness ARGS`` in ``cwd`` (so its results/ land there), as a child of
    this test process's fork server (tests/cli_server.py: the same command in a fresh process,
    without re-importing MLflow and pandas each time), or as a plain subprocess when
    ``HARNESS_TEST_FORK=0``."""
    # Tables as a pipe gets them (140 columns), whatever terminal width the runner exports.
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    env["PYTHONPATH"] = str(REPO)
    command = [sys.executable, "-m", "harness", *args]
    if os.environ.get("HARNESS_TEST_FORK", "1") == "0":
        return subprocess.run(
            command, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env
        )
    return _cli_server().run(command, [*args], cwd, env, timeout)


class _CliServer:
    """This test process's end of tests/cli_server.py: one command at a time."""

    def __init__(self) -> None:
        self.process = subprocess.Popen(
            [sys.executable, str(REPO / "tests" / "cli_server.py")],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )
        assert self.process.stdout is not None
        self.answers = LineReader(self.process.stdout.fileno())
        self._answer("ready", 300)

    def alive(self) -> bool:
        return self.process.poll() is None

    def _answer(self, key: str, seconds: float) -> Any:
        import json

        try:
            line = self.answers.line(seconds)
        except PipeClosed:
            line = None
        if line is None:
            raise RuntimeError(
                f"the tests' harness fork server gave no {key!r} answer within {seconds:g} s"
                f" (exit code {self.process.poll()}); HARNESS_TEST_FORK=0 runs commands"
                " without it"
            )
        return json.loads(line)[key]

    def run(
        self, command: list[str], argv: list[str], cwd: Path, env: dict[str, str], timeout: float
    ) -> subprocess.CompletedProcess[str]:
        import json
        import tempfile

        assert self.process.stdin is not None
        with tempfile.TemporaryDirectory(prefix="harness-cli-") as folder:
            out, err = Path(folder) / "stdout", Path(folder) / "stderr"
            request = {"argv": argv, "cwd": str(cwd), "env": env,
                       "stdout": str(out), "stderr": str(err)}  # fmt: skip
            self.process.stdin.write(json.dumps(request) + "\n")
            self.process.stdin.flush()
            pid = self._answer("pid", 60)
            try:
                code = self._answer("code", timeout)
            except RuntimeError:
                if not self.alive():
                    raise
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pid, signal.SIGKILL)
                self._answer("code", 60)
                raise subprocess.TimeoutExpired(
                    command, timeout, output=out.read_text(), stderr=err.read_text()
                ) from None
            return subprocess.CompletedProcess(
                command, code, out.read_text(errors="replace"), err.read_text(errors="replace")
            )

    def close(self) -> None:
        if self.process.stdin is not None:
            self.process.stdin.close()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()


_server: _CliServer | None = None


def _cli_server() -> _CliServer:
    global _server
    if _server is None or not _server.alive():
        _server = _CliServer()
    return _server


@pytest.fixture(scope="session", autouse=True)
def _close_cli_server() -> Iterator[None]:
    yield
    if _server is not None:
        _server.close()


def output_tail(stdout: str | None, stderr: str | None = None, chars: int = TAIL_CHARS) -> str:
    """The end of what a process printed, stderr first (where its error is), for an assertion
    message: a failing test shows the process's own words, not only its exit code."""
    parts = [
        f"--- {name} (last {chars} characters) ---\n{text[-chars:]}"
        for name, text in (("stderr", stderr), ("stdout", stdout))
        if text
    ]
    return "\n".join(parts) or "(it printed nothing)"


def expect_exit(
    done: subprocess.CompletedProcess[str], code: int = 0
) -> subprocess.CompletedProcess[str]:
    """``done``, after asserting it exited with ``code``; otherwise the test fails with its
    command, its exit code and the tails of its stderr and stdout."""
    if done.returncode != code:
        command = " ".join(str(part) for part in done.args) if done.args else "?"
        pytest.fail(
            f"`{command}` exited {done.returncode}, expected {code}\n"
            + output_tail(done.stdout, done.stderr),
        )
    return done


def wait_until(condition: Callable[[], T], seconds: float, what: str, every: float = 0.2) -> T:
    """Poll ``condition`` until it returns something true (returned); the test fails after
    ``seconds``, naming ``what`` and that limit. The limits are generous: a loaded machine (a
    second suite beside this one) is slow, and a condition met early ends the wait early."""
    deadline = time.monotonic() + seconds
    while True:
        found = condition()
        if found:
            return found
        if time.monotonic() >= deadline:
            pytest.fail(f"waited the {seconds:g} s limit for: {what}")
        time.sleep(every)


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


def listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except OSError:
        return False
    return True


def wait_for_port(
    port: int,
    seconds: float,
    what: str,
    process: subprocess.Popen[Any] | None = None,
    log: Path | None = None,
) -> None:
    """Until something listens on 127.0.0.1:``port``; the test fails after ``seconds``. Given
    the ``process`` that should listen (and the ``log`` its output goes to), it fails at once
    when that process exits, with the end of its log: its own error, not a timeout."""

    def up() -> bool:
        if process is not None and process.poll() is not None:
            said = log.read_text(errors="replace") if log and log.exists() else None
            pytest.fail(
                f"{what} exited {process.returncode} before listening on port {port}\n"
                + output_tail(None, said),
            )
        return listening(port)

    wait_until(up, seconds, f"{what} listening on port {port}", every=0.3)


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
    log = folder / "mlflow-server.log"
    with log.open("wb") as output:
        server = subprocess.Popen(
            command, cwd=folder, env=env, stdout=output, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
    try:
        wait_for_port(port, 180, "mlflow server", server, log)
        yield f"http://127.0.0.1:{port}"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait(timeout=30)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Files with the most end-to-end (``slow``) tests first: ``make test``'s two xdist
    workers take a file each at a time in this order, so the heaviest files start early and
    the two finish together instead of one running a long file alone at the end. Stable: the
    order within a file, and of files alike, stays."""
    slow = Counter(str(item.path) for item in items if item.get_closest_marker("slow"))
    items.sort(key=lambda item: -slow[str(item.path)])


BASE_MODEL = REPO / "results" / "base-model"  # what `make base-model` writes


def ensure_base_model() -> Path:
    """The pre-trained model experiments/finetune_quality.yaml loads, made as `make base-model`
    makes it where it is missing (built aside, then moved in: two test processes may race)."""
    if (BASE_MODEL / "model.safetensors").exists():
        return BASE_MODEL
    import importlib.util
    import tempfile

    spec = importlib.util.spec_from_file_location(
        "pretrain_base", REPO / "scripts" / "pretrain_base.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    BASE_MODEL.parent.mkdir(parents=True, exist_ok=True)
    aside = Path(tempfile.mkdtemp(dir=BASE_MODEL.parent, prefix=".base-model-"))
    module.pretrain(aside, steps=400)
    try:
        aside.rename(BASE_MODEL)
    except OSError:  # the other process got there first: its model is the same
        shutil.rmtree(aside, ignore_errors=True)
    return BASE_MODEL
