"""Moving a model's parameters and buffers to a device / dtype / memory format, ties kept.

``nn.Module.to`` swaps tensors in a way fake tensors (the estimator's) refuse, so the trial and
the estimator both convert through this one function: what runs is what is predicted. The
estimator builds large tensors on the meta device (``harness.trial.fake``); converted with
``materialize_meta`` they become tensors of the same shape on ``device`` (fake ones there).
"""

from __future__ import annotations

import torch
from torch import nn


def convert(
    model: nn.Module,
    device: torch.device | None = None,
    dtype: torch.dtype | None = None,
    memory_format: torch.memory_format | None = None,
    materialize_meta: bool = False,
    parameters_only: bool = False,
) -> nn.Module:
    """Convert in place; floating tensors take ``dtype``; 4-D ones take ``memory_format``.
    ``parameters_only``: buffers stay as they are (a LoRA base cast to bf16 keeps its fp32
    rotary tables and running statistics)."""
    done: dict[int, torch.Tensor] = {}

    def converted(tensor: torch.Tensor) -> torch.Tensor:
        if id(tensor) not in done:
            new = tensor.detach()
            if materialize_meta and new.is_meta:
                new = torch.empty_strided(
                    new.size(), new.stride(), dtype=new.dtype, device=device or "cpu"
                )
            elif device is not None:
                new = new.to(device)
            if dtype is not None and new.is_floating_point():
                new = new.to(dtype)
            if memory_format is not None and new.dim() == 4:
                new = new.contiguous(memory_format=memory_format)
            done[id(tensor)] = new
        return done[id(tensor)]

    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is not None:
                if id(param) not in done:
                    done[id(param)] = nn.Parameter(converted(param), param.requires_grad)
                module._parameters[name] = done[id(param)]  # type: ignore[assignment]
        for name, buffer in list(module._buffers.items()):
            if buffer is not None and not parameters_only:
                module._buffers[name] = converted(buffer)
    return model
