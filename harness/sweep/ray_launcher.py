"""``harness sweep --launcher ray``: the sweep's workers as Ray actors.

``ray.init(address=launcher.ray.address)`` joins a running cluster (none given: Ray's own
default, ``RAY_ADDRESS`` or a local cluster started for the sweep and stopped after it). Each of
``launcher.ray.workers`` actors is one worker (``RayWorker``: the loop of ``harness worker`` in
the actor's process) holding the GPUs of the grid's largest world size (``num_gpus``; none for
``device: cpu``); Ray gives it those GPUs through ``CUDA_VISIBLE_DEVICES``, and each trial still
runs in a process of its own under it, so isolation is unchanged. A lost actor (its node
failed, its process was killed) is restarted by Ray up to ``launcher.ray.retries`` times and
its ``run`` retried, so it rejoins the sweep; the trial it had is stale and runs again
(``harness.sweep.claim``).

Ray actors die with the driver that made them, so ``harness sweep --launcher ray`` waits for
the sweep (``ray job submit -- harness sweep SPEC --launcher ray`` runs it as a Ray job instead).
The stores reach the actors as arguments of their creation, held by Ray's control plane, and
from there their environment; never a command line. So does the spec's text, for nodes that do
not share the driver's filesystem. Named ``ray_launcher`` so it is never
mistaken for the ``ray`` package; ray is imported inside the functions
(``pip install 'harness[ray]'``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rich.console import Console

from harness.contract import LAUNCH_ENV, STORAGE_ENV, TRACKING_ENV
from harness.spec import Spec, SpecError
from harness.sweep import remote
from harness.sweep.launcher import LaunchOutcome, LaunchRequest


class RayWorker:
    """One Ray actor: ``harness worker`` for the driver's spec, from ``cwd`` where the node has
    it, with the stores of ``environment``.

    Ray nodes seldom share a filesystem: where the spec file is not on the node as the driver
    read it, the actor writes the driver's text (``spec_text``) into a folder of its own and
    runs that (your own code named in it must then be importable on the node)."""

    def __init__(
        self, spec_path: str, spec_text: str, cwd: str, environment: dict[str, str]
    ) -> None:
        os.environ.update(environment)
        with contextlib.suppress(OSError):  # a node without the driver's folder keeps its own
            os.chdir(cwd)
        self.spec_path = spec_path
        self.spec_text = spec_text

    @contextlib.contextmanager
    def spec_file(self) -> Iterator[str]:
        """The spec as the driver read it: its own file where the node has it, else a copy."""
        path = Path(self.spec_path)
        try:
            same = path.read_text() == self.spec_text
        except OSError:  # not on this node
            same = False
        if same:
            yield str(path)
            return
        with tempfile.TemporaryDirectory(prefix="harness-spec-") as folder:
            copy = Path(folder) / path.name
            copy.write_text(self.spec_text)
            yield str(copy)

    def run(self) -> dict[str, Any]:
        from harness.sweep.run import run_worker

        with self.spec_file() as spec_path:
            outcome = run_worker(
                spec_path,
                Console(width=140),
                storage=os.environ.get(STORAGE_ENV),
                tracking_uri=os.environ.get(TRACKING_ENV),
                launch=os.environ.get(LAUNCH_ENV),
            )
        return {"host": socket.gethostname(), "pid": os.getpid(), "parent": outcome.parent_run_id}


def launch(spec: Spec, console: Console) -> LaunchOutcome:
    """Start ``launcher.ray.workers`` actors and follow the study until they are done."""
    ray = remote.require("ray", "ray")
    settings = spec.launcher.ray
    spec = remote.prepare_launch(spec, "ray")
    path = remote.spec_path(spec)
    gpus = remote.gpus_needed(spec)
    options: dict[str, Any] = {"logging_level": logging.WARNING}
    if settings.address is None:  # Ray's own choice: RAY_ADDRESS, else a local cluster
        options["include_dashboard"] = False
    try:
        ray.init(address=settings.address, **options)
    except (ConnectionError, RuntimeError, ValueError) as error:
        where = settings.address or "a local cluster"
        raise SpecError(
            f"{spec._source}: launcher.ray.address: cannot join {where}: {remote.first_line(error)}"
        ) from None
    try:
        return run_actors(ray, spec, console, path, gpus)
    finally:
        ray.shutdown()


def run_actors(ray: Any, spec: Spec, console: Console, path: str, gpus: int) -> LaunchOutcome:
    settings = spec.launcher.ray
    have = ray.cluster_resources()
    for kind, need in (("GPU", gpus), ("CPU", settings.cpus_per_worker)):
        if need and have.get(kind, 0) < need:  # an autoscaler may still add nodes
            console.print(
                f"[yellow]warning:[/] each worker needs {need:g} {kind}(s) and the Ray cluster "
                f"has {have.get(kind, 0):g} now: the workers wait until it has them"
                + (" (device: cpu runs CPU workers)" if kind == "GPU" else ""),
                soft_wrap=True,
            )
    launch_id = remote.new_launch_id()
    worker = ray.remote(RayWorker).options(
        num_cpus=settings.cpus_per_worker,
        num_gpus=gpus,
        max_restarts=settings.retries,
        max_task_retries=settings.retries,
    )
    environment = remote.worker_settings(spec, launch_id)
    text = Path(path).read_text()
    actors = [worker.remote(path, text, os.getcwd(), environment) for _ in range(settings.workers)]
    refs = [actor.run.remote() for actor in actors]
    names = [f"actor {index}" for index in range(len(actors))]
    console.print(
        f"Started {len(actors)} Ray worker(s) for sweep [bold]{spec.experiment}[/], "
        f"{gpus} GPU(s) and {settings.cpus_per_worker:g} CPU(s) each, on "
        f"{settings.address or os.environ.get('RAY_ADDRESS') or 'a local Ray cluster'}.",
        soft_wrap=True,
    )
    outcome = LaunchOutcome(
        "ray", spec.experiment, spec.tracking.mlflow_uri, names, True, remote.trials_wanted(spec)
    )
    study = remote.StudyWatch(spec, launch_id)

    def alive() -> int:
        return len(ray.wait(refs, num_returns=len(refs), timeout=0)[1])

    remote.watch(console, "ray", study, alive, len(actors), outcome.total)
    for name, ref in zip(names, refs, strict=True):
        try:
            ray.get(ref)
        except Exception as error:  # the actor was lost more often than retries allow, or failed
            cause = getattr(error, "cause", None) or error
            outcome.problems.append(f"{name}: {remote.first_line(cause)}")
    return remote.finish(outcome, spec, study)


class RayLauncher:
    """``--launcher ray``: ``launcher.ray.workers`` actors, followed until they are done."""

    name: str = "ray"
    resume_hint: str | None = "the Ray workers stop with this driver; launch again to go on"

    def launch(self, request: LaunchRequest) -> LaunchOutcome:
        return launch(request.spec, request.console)
