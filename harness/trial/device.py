"""Which device a trial runs on, what it is called, and how big a card it pretends to be."""

from __future__ import annotations

import torch

from harness.trial.hardware import cpu_name
from harness.trial.result import Status, TrialFailure


def resolve_device(name: str) -> torch.device:
    """``auto`` is CUDA where there is one; asking for CUDA where there is none ends the trial."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise TrialFailure(Status.CRASH, f"device {name!r} was asked for but CUDA is not available")
    return device


def emulate_card(device: torch.device, budget: int | None, outside: int = 0) -> None:
    """Cap this process's caching allocator at what the planned card leaves it (``budget``
    minus ``outside``: the card's context and NCCL buffers, as predicted), so a trial too big
    for that card really runs out of memory here (CUDA only)."""
    if device.type != "cuda" or budget is None:
        return
    total = torch.cuda.get_device_properties(device).total_memory
    allowed = budget - outside
    if allowed < total:
        torch.cuda.set_per_process_memory_fraction(max(allowed, 0) / total, cuda_index(device))


def cuda_index(device: torch.device) -> int:
    """The CUDA device's ordinal: a single-rank trial's device is plain ``cuda`` (the current
    one), which ``set_per_process_memory_fraction`` refuses (it needs an index; the first card
    run found this)."""
    return device.index if device.index is not None else torch.cuda.current_device()


def device_name(device: torch.device) -> str:
    """The GPU's name, or the CPU's model: the ``device_name`` tag."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return cpu_name()
