"""No orphan trial process, ever (``harness.lifeline``): real processes, real kills, no mocks.

A trial process dies with the process that launched it however early it is (before torch is
imported), and a timed-out multi-rank trial leaves no rank behind, even one still starting up
and even on a machine busy with other work. The tag each trial carries (``HARNESS_TRIAL_DIR``)
is how these tests find a trial's processes, as the launcher does.
"""

from __future__ import annotations

import copy
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from harness import lifeline
from tests.conftest import BASE_SPEC, REPO, copy_fixture, wait_until

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="/proc and PR_SET_PDEATHSIG are Linux's"
)

GONE_WITHIN_S = 10.0  # how long after its trial ended a trial process may still exist


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in (lifeline.LIFELINE_ENV,)}
    return {**env, "PYTHONPATH": str(REPO), **extra}


def _tagged(workdir: Path) -> list[psutil.Process]:
    """The live processes carrying ``workdir``'s trial tag (zombies have exited)."""
    tag, found = str(workdir.resolve()), []
    for process in psutil.process_iter():
        try:
            if process.status() == psutil.STATUS_ZOMBIE:
                continue
            if process.environ().get(lifeline.TRIAL_ENV) == tag:
                found.append(process)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def _seconds_until_gone(workdir: Path) -> float:
    """Seconds from now until no process of ``workdir``'s trial is left; the test fails after
    ``GONE_WITHIN_S``, naming what is left."""
    started = time.monotonic()
    wait_until(
        lambda: not _tagged(workdir), GONE_WITHIN_S, f"no process of the trial in {workdir} left"
    )
    return time.monotonic() - started


@pytest.fixture
def cpu_load() -> Iterator[None]:
    """Two processes burning a core each for the test's duration: a busy CI machine, where the
    ranks of a trial take many seconds to import torch and a timeout falls in their imports."""
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        yield
    finally:
        for burner in burners:
            burner.kill()
            burner.wait()


def _ddp_config(folder: Path, mode: str):
    from harness.spec import parse_spec, trial_configs

    copy_fixture("faulty_models.py", folder)
    data = copy.deepcopy(BASE_SPEC)
    data["model"] = {"family": "faulty_models:build", "sizes": {"f": {"mode": mode}}}
    data["grid"].update(batch_size=[16], strategy=["ddp:2"])
    return trial_configs(parse_spec(data, str(folder / "spec.yaml")))[0]


class RankWatch:
    """Records, from a thread, every rank (a process of the trial that torchrun started: it has
    ``LOCAL_RANK``) seen alive while a trial runs."""

    def __init__(self, workdir: Path) -> None:
        self.workdir, self.ranks, self.done = workdir, set[int](), threading.Event()
        self.started, self.first_seen_s = time.monotonic(), None
        self.thread = threading.Thread(target=self._watch, daemon=True)
        self.thread.start()

    def _watch(self) -> None:
        while not self.done.wait(0.2):
            for process in _tagged(self.workdir):
                try:
                    if "LOCAL_RANK" in process.environ():
                        self.ranks.add(process.pid)
                        if self.first_seen_s is None:
                            self.first_seen_s = time.monotonic() - self.started
                except (psutil.NoSuchProcess, psutil.AccessDenied):
                    continue

    def stop(self) -> set[int]:
        self.done.set()
        self.thread.join()
        return self.ranks


@pytest.mark.slow
@pytest.mark.parametrize("timeout_s", [5, 12])
def test_a_hung_ddp_trial_leaves_no_rank_behind_on_a_busy_machine(tmp_path, cpu_load, timeout_s):
    """The CI failure of issue 47: two CPU burners beside a hung ``ddp:2`` trial. Its timeout
    falls while the ranks import torch (5 s: they start ~4 s in on two busy cores) or once they
    hang (12 s, as in ``test_sweep_e2e.py``); either way no rank is left."""
    from harness.sweep.launch import launch_trial

    workdir = tmp_path / "trial"
    config = _ddp_config(tmp_path, "hang")
    watch = RankWatch(workdir)
    result = launch_trial(config, workdir, timeout_s=timeout_s)
    returned_s = time.monotonic() - watch.started
    ranks = watch.stop()
    assert result.status == "timeout", result.failure_reason
    gone_s = _seconds_until_gone(workdir)
    seen = f"first seen {watch.first_seen_s:.1f}s in" if watch.first_seen_s else "never seen"
    print(
        f"timeout {timeout_s}s: {len(ranks)} ranks ({seen}); launch_trial returned "
        f"{returned_s:.2f}s in, no rank left {gone_s:.2f}s later"
    )
    # A killed rank may still be tearing down (its memory and environ already gone, so the tag
    # scan above misses it): the issue's bound is that none is left within 10 s.
    assert not _still_alive(ranks, within_s=10.0)


def _still_alive(pids: set[int], within_s: float) -> list[int]:
    """The ``pids`` still alive (not zombies) after waiting up to ``within_s`` for them to go."""
    deadline = time.monotonic() + within_s
    while (left := [pid for pid in pids if _alive(pid)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


STALL = """
import os, time
if "LOCAL_RANK" in os.environ and os.environ.get("HARNESS_TEST_STALL_RANKS"):
    time.sleep(float(os.environ["HARNESS_TEST_STALL_RANKS"]))  # a rank stuck starting up
"""


@pytest.mark.slow
def test_ranks_stuck_starting_up_are_killed_when_their_trial_times_out(tmp_path, monkeypatch):
    """Each rank stalls at interpreter start (a ``sitecustomize`` sleeps): it never reaches
    ``harness.trial``'s code, so neither the lifeline nor the parent death signal holds it; the
    launcher finds it by its tag and kills it before ``launch_trial`` returns."""
    from harness.sweep.launch import launch_trial

    stall = tmp_path / "stall"
    stall.mkdir()
    (stall / "sitecustomize.py").write_text(STALL)
    path = os.pathsep.join(p for p in (str(stall), str(REPO), os.environ.get("PYTHONPATH")) if p)
    monkeypatch.setenv("PYTHONPATH", path)
    monkeypatch.setenv("HARNESS_TEST_STALL_RANKS", "300")
    workdir = tmp_path / "trial"
    watch = RankWatch(workdir)
    started = time.monotonic()
    result = launch_trial(_ddp_config(tmp_path, "ok"), workdir, timeout_s=15)
    returned_s = time.monotonic() - started
    ranks = watch.stop()
    assert result.status == "timeout", result.failure_reason
    assert len(ranks) == 2, f"torchrun started {len(ranks)} rank(s) within the 15s timeout"
    gone_s = _seconds_until_gone(workdir)
    print(f"launch_trial returned after {returned_s:.1f}s; ranks left {gone_s:.2f}s later")
    assert not [pid for pid in ranks if _alive(pid)]


# The unit of the lifeline: a process that holds it, started under various launchers.
HOLDER = """
import sys, time
from harness import lifeline
lifeline.hold()
print("held", flush=True)
time.sleep(float(sys.argv[1]) if len(sys.argv) > 1 else 60)
"""


def _holder(env: dict[str, str], *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", HOLDER, *args], env=env, stdout=subprocess.PIPE, text=True
    )


def test_a_trial_run_by_hand_holds_nothing_against_it():
    """Without ``HARNESS_LIFELINE`` (``python -m harness.trial`` run by hand) the trial runs."""
    done = subprocess.run(
        [sys.executable, "-c", HOLDER, "0"], env=_env(), capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0 and done.stdout == "held\n", done.stderr


def _dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


@pytest.mark.parametrize("launcher", ["dead", "recycled", "not_an_ancestor"])
def test_a_trial_whose_launcher_is_gone_exits_at_once(launcher):
    """Gone: its pid is free; recycled: its pid runs another process (this one, started at
    another time); not an ancestor: it lives, but the trial is not its child or grandchild (its
    real parent died and it was handed to init)."""
    if launcher == "dead":
        who = f"{_dead_pid()}:1"
    elif launcher == "recycled":
        who = f"{os.getpid()}:1"
    else:
        # This process is the holder's parent; a sleeping sibling is not an ancestor of it.
        sibling = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        who = lifeline.identity(sibling.pid)
    started = time.monotonic()
    try:
        done = subprocess.run(
            [sys.executable, "-c", HOLDER],
            env=_env(**{lifeline.LIFELINE_ENV: who}),
            capture_output=True,
            text=True,
            timeout=60,
        )
    finally:
        if launcher == "not_an_ancestor":
            sibling.kill()
            sibling.wait()
    assert done.returncode == lifeline.EXIT_CODE, done.stderr
    assert done.stdout == "" and "exiting" in done.stderr
    assert time.monotonic() - started < 30  # at once: far from the holder's 60 s sleep


LAUNCHER = """
import os, subprocess, sys
from harness import lifeline
# Like torchrun: a middle process, in a session of its own, starts the holder.
middle = [sys.executable, "-c", "import subprocess, sys; subprocess.Popen(sys.argv[1:]).wait()"]
env = {**os.environ, lifeline.LIFELINE_ENV: lifeline.identity()}
subprocess.Popen(
    [*middle, sys.executable, "-c", sys.argv[1]], env=env, start_new_session=True
).wait()
"""


def _chain(holder_code: str) -> tuple[subprocess.Popen[bytes], psutil.Process, psutil.Process]:
    """launcher -> middle (its own session, like torchrun) -> holder; waits for the holder to
    hold its lifeline (it prints ``held``)."""
    launcher = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, holder_code], env=_env(), stdout=subprocess.PIPE
    )
    assert launcher.stdout is not None
    assert launcher.stdout.readline() == b"held\n"
    (middle,) = psutil.Process(launcher.pid).children()
    (holder,) = middle.children()
    return launcher, middle, holder


def _seconds_until_dead(process: psutil.Process, within_s: float) -> float:
    started = time.monotonic()
    wait_until(lambda: not _alive(process.pid), within_s, f"process {process.pid} gone")
    return time.monotonic() - started


@pytest.mark.parametrize("killed", ["launcher", "parent"])
def test_a_trial_dies_with_its_launcher_or_its_parent(killed):
    """The launcher killed (the middle process, like torchrun, lives on): the holder sees it
    gone within its poll (0.5 s). Its parent killed: the kernel kills it at once."""
    launcher, middle, holder = _chain(HOLDER)
    try:
        if killed == "launcher":
            launcher.kill()
            launcher.wait()
        else:
            middle.kill()
        gone_s = _seconds_until_dead(holder, 10)
        print(f"{killed} killed: the trial was gone {gone_s:.2f}s later")
        assert gone_s < 2.5
    finally:
        for process in (holder, middle):
            if _alive(process.pid):
                process.kill()
        launcher.kill()
        launcher.wait()


def test_a_launcher_kills_what_its_trials_left_at_its_exit(tmp_path):
    """A trial's leftover (a process started by ``exec``, so carrying the launcher's identity)
    is killed when the launcher exits normally."""
    script = textwrap.dedent(
        f"""
        import os, subprocess, sys
        from harness import lifeline
        lifeline.end_launched_at_exit()
        env = {{**os.environ, lifeline.LIFELINE_ENV: lifeline.identity()}}
        left = subprocess.Popen(
            [sys.executable, "-c", "import time; time.sleep(60)"], env=env,
            start_new_session=True,
        )
        open({str(tmp_path / "pid")!r}, "w").write(str(left.pid))
        """
    )
    done = subprocess.run([sys.executable, "-c", script], env=_env(), timeout=60)
    assert done.returncode == 0
    pid = int((tmp_path / "pid").read_text())
    wait_until(lambda: not _alive(pid), 5, "the launched process killed at its launcher's exit")


def test_a_stray_tagged_process_is_found_and_ended(tmp_path):
    """``end_trial`` kills every process carrying the trial's tag, a process forked by one too,
    and leaves others alone."""
    workdir = tmp_path / "trial"
    workdir.mkdir()
    tag = {lifeline.TRIAL_ENV: str(workdir.resolve())}
    forks = "import os, time; os.fork(); time.sleep(60)"
    tagged = subprocess.Popen([sys.executable, "-c", forks], env=_env(**tag))
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env=_env())
    try:
        wait_until(lambda: len(_tagged(workdir)) == 2, 30, "the tagged process and its fork")
        killed = lifeline.end_trial(workdir)
        assert len(set(killed)) == 2 and tagged.pid in killed
        tagged.wait(timeout=10)
        assert tagged.returncode == -signal.SIGKILL
        assert other.poll() is None
    finally:
        for process in (tagged, other):
            process.kill()
            process.wait()
