"""Which ``Launcher`` (``harness.sweep.launcher``) starts a sweep's workers, by name.

Each launcher lives beside the code it drives and is imported only when chosen, so the
default install never imports a cluster's scheduler package.
"""

from __future__ import annotations

from collections.abc import Callable

from harness.sweep.launcher import Launcher


def _local() -> Launcher:
    from harness.sweep.run import LocalLauncher

    return LocalLauncher()


def _workers() -> Launcher:
    from harness.sweep.workers import WorkersLauncher

    return WorkersLauncher()


def _slurm() -> Launcher:
    from harness.sweep.slurm import SlurmLauncher

    return SlurmLauncher()


def _ray() -> Launcher:
    from harness.sweep.ray_launcher import RayLauncher

    return RayLauncher()


# ``workers`` is ``local`` with ``--workers N`` (N > 1): N processes on this host.
LAUNCHERS: dict[str, Callable[[], Launcher]] = {
    "local": _local,
    "workers": _workers,
    "slurm": _slurm,
    "ray": _ray,
}


def launcher_for(name: str, workers: int = 1) -> Launcher:
    """The launcher of the spec's ``launcher.name`` (``--launcher``), given ``--workers``."""
    return LAUNCHERS["workers" if name == "local" and workers > 1 else name]()
