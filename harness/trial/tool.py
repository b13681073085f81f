"""The shape every trial-layer tool shares: ``python -m harness.trial.X IN.json OUT.json``.

The sweep layer asks the trial layer for predictions in a child process (so it never imports
model code, and several children can answer at once). IN names the target device and the
configs, OUT gets one answer per config; a progress line per config goes to stdout as it is
answered. Several children may read the same IN: with ``claims`` (a folder) each answers only
the configs it claims first (an exclusively created file per config), taken in ``order`` (a
list of indices; default IN's order), and leaves ``null`` in OUT for the others.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from harness.trial.config import TrialConfig


def prediction_device(name: str) -> tuple[torch.device, bool]:
    """The device predictions run on for target ``name``, and whether storages are accounted
    as CUDA allocates them: autograd's engine needs a real CUDA runtime even for fake CUDA
    tensors, so without a GPU CPU kernels run for a ``cuda`` target."""
    device = torch.device(name)
    as_cuda = device.type == "cuda" and not torch.cuda.is_available()
    return (torch.device("cpu") if as_cuda else device), as_cuda


# (config, its index in IN, IN itself, device, as_cuda) -> the config's answer
Answer = Callable[[TrialConfig, int, dict[str, Any], torch.device, bool], dict[str, Any]]


def serve(argv: list[str], answer: Answer, verb: str, seconds_key: str, label: str = "") -> int:
    """Answer IN's configs (in its ``order``, those this process claims): ``answer(config, index,
    request, device, as_cuda)``, timed into ``seconds_key``. ``label``: a format of the config
    shown in progress lines."""
    request = json.loads(Path(argv[0]).read_text())
    device, as_cuda = prediction_device(request["device"])
    configs = [TrialConfig.from_dict(data) for data in request["configs"]]
    claims = Path(request["claims"]) if request.get("claims") else None
    answers: list[dict[str, Any] | None] = [None] * len(configs)  # None: another child's
    for index in request.get("order") or range(len(configs)):
        config = configs[index]
        if claims is not None and not claim(claims / str(index)):
            continue
        started = time.perf_counter()
        found = answer(config, index, request, device, as_cuda)
        found[seconds_key] = time.perf_counter() - started
        answers[index] = found
        shown = label.format(config=config)
        note = found.pop("progress_note", "")  # what the answer adds to its line, if anything
        print(
            f"{verb} {index + 1}/{len(configs)}: {config.model_size} {shown}{config.dtype} "
            f"{config.strategy_text}{', ' + note if note else ''} ({found[seconds_key]:.1f} s)",
            flush=True,
        )
    Path(argv[1]).write_text(json.dumps(answers))
    return 0


def claim(path: Path) -> bool:
    """Whether this process is the first to claim ``path`` (atomic: ``O_EXCL``)."""
    try:
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True
