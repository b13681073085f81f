"""Shared helpers: a valid spec to mutate, and the ``harness`` CLI run as a user runs it."""

from __future__ import annotations

import copy
import os
import shutil
import subprocess
import sys
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
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-m", "harness", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def copy_fixture(name: str, folder: Path) -> Path:
    return Path(shutil.copy(FIXTURES / name, folder / name))
