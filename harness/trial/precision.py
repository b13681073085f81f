"""Mixed precision: ``torch.autocast`` for bf16/fp16, plus a ``GradScaler`` for fp16.

fp16's narrow exponent underflows small gradients; the scaler multiplies the loss before backward
and unscales before the step, skipping steps whose gradients overflowed.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from harness.contract import DTYPES

TORCH_DTYPES = dict(zip(DTYPES, (torch.float32, torch.bfloat16, torch.float16), strict=True))


class Precision:
    def __init__(self, dtype: str, device: torch.device, scaler: bool = True) -> None:
        if dtype not in TORCH_DTYPES:
            raise ValueError(f"unknown dtype {dtype!r}; allowed: {', '.join(DTYPES)}")
        self.device = device
        self.dtype = TORCH_DTYPES[dtype]
        # The estimator runs without one: the scaler's inf check reads a value, which fake
        # tensors do not have (its memory, a few scalars, does not matter).
        self.scaler = torch.amp.GradScaler(device.type) if dtype == "fp16" and scaler else None

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.dtype is torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.dtype)

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler else loss).backward()

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        if self.scaler is None:
            optimizer.step()
        else:
            self.scaler.step(optimizer)
            self.scaler.update()
