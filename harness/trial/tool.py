"""The shape every trial-layer tool shares: ``python -m harness.trial.X IN.json OUT.json``.

The sweep layer asks the trial layer for predictions in a child process (so it never imports
model code, and several children can answer at once). IN names the target device and the
configs, OUT gets one answer per config; a progress line per config goes to stdout as it is
answered, numbered within the whole job (``numbers``/``total``: a child may hold a share).
"""

from __future__ import annotations

import json
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
    """Answer IN's configs in order: ``answer(config, index, request, device, as_cuda)``, timed into
    ``seconds_key``. ``label``: a format of the config shown in progress lines."""
    request = json.loads(Path(argv[0]).read_text())
    device, as_cuda = prediction_device(request["device"])
    configs = [TrialConfig.from_dict(data) for data in request["configs"]]
    numbers = request.get("numbers") or list(range(1, len(configs) + 1))
    total = request.get("total") or len(configs)
    answers = []
    for index, (config, number) in enumerate(zip(configs, numbers, strict=True)):
        started = time.perf_counter()
        found = answer(config, index, request, device, as_cuda)
        found[seconds_key] = time.perf_counter() - started
        answers.append(found)
        shown = label.format(config=config)
        print(
            f"{verb} {number}/{total}: {config.model_size} {shown}{config.dtype} "
            f"{config.strategy_text} ({found[seconds_key]:.1f} s)",
            flush=True,
        )
    Path(argv[1]).write_text(json.dumps(answers))
    return 0
