"""What hardware a sweep's trials run on, as part of their identity.

Standard library at module level: the sweep layer asks it before hashing a grid, and planning
must not import torch. A trial measured on a CPU says nothing about an H200, so the resolved
device type and its name go into every ``TrialConfig`` (and so into ``trial_key`` and the
sweep's grid hash): the same spec on other hardware is another sweep.

Resolving ``auto`` needs torch (``torch.cuda.is_available()``); that runs in a child process
(``python -m harness.trial.hardware DEVICE``) and only on hosts that show an NVIDIA driver, so
a CPU-only machine answers at once. A child, not this process: the sweep's warm trial starter
forks trials and must never have touched CUDA.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
from typing import Any

PROBE_TIMEOUT_S = 120


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``), or what ``platform`` knows."""
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def shows_nvidia_driver() -> bool:
    """Whether this host could have a CUDA device (without importing torch)."""
    return (
        os.path.exists("/proc/driver/nvidia")
        or os.path.exists("/dev/nvidiactl")
        or shutil.which("nvidia-smi") is not None
    )


def cpu_hardware() -> dict[str, str]:
    return {"device": "cpu", "device_name": cpu_name()}


def probe(device: str) -> dict[str, str]:
    """``{"device", "device_name"}`` for ``device`` (``auto``, ``cpu``, ``cuda``, ``cuda:N``),
    resolved with torch in this process."""
    import torch

    if device == "cpu" or (device == "auto" and not torch.cuda.is_available()):
        return cpu_hardware()
    resolved = "cuda" if device == "auto" else device
    if not torch.cuda.is_available():
        return {"device": resolved, "device_name": "unavailable"}
    return {"device": resolved, "device_name": torch.cuda.get_device_name(torch.device(resolved))}


def host_hardware(device: str) -> dict[str, str]:
    """The hardware this host runs ``device`` trials on; a child process asks torch when the
    host shows an NVIDIA driver, else it is the CPU."""
    if device == "cpu" or (device == "auto" and not shows_nvidia_driver()):
        return cpu_hardware()
    answer = subprocess.run(
        [sys.executable, "-m", "harness.trial.hardware", device],
        capture_output=True,
        text=True,
        timeout=PROBE_TIMEOUT_S,
        check=False,
    )
    lines = answer.stdout.strip().splitlines()
    if answer.returncode != 0 or not lines:
        detail = (answer.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"cannot tell which device {device!r} is on this host: {detail}")
    found: dict[str, Any] = json.loads(lines[-1])
    return {"device": str(found["device"]), "device_name": str(found["device_name"])}


def describe_hardware(hardware: dict[str, str]) -> str:
    """One phrase for messages, e.g. ``cuda (NVIDIA H200)``."""
    return f"{hardware.get('device', '?')} ({hardware.get('device_name', '?')})"


if __name__ == "__main__":
    print(json.dumps(probe(sys.argv[1] if len(sys.argv) > 1 else "auto")))
