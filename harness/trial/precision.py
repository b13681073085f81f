"""Mixed precision: ``torch.autocast`` for bf16/fp16, plus a ``GradScaler`` for fp16.

fp16's narrow exponent underflows small gradients; the scaler multiplies the loss before backward
and unscales before the step, skipping steps whose gradients overflowed.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class Precision:
    def __init__(self, dtype: str, device: torch.device, scaler: bool = True) -> None:
        if dtype not in DTYPES:
            raise ValueError(f"unknown dtype {dtype!r}; allowed: {', '.join(DTYPES)}")
        self.name = dtype
        self.device = device
        self.dtype = DTYPES[dtype]
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
