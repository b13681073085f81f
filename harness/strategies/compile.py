"""``compile``: ``torch.compile`` (inductor) on the model, with the compile time kept apart.

The model is compiled in place (``nn.Module.compile``) rather than wrapped in an
``OptimizedModule``: the module keeps its type, its ``state_dict`` keys and its submodules, so
later strategies and the memory meter's module hooks see the same model as without compile.

Compilation happens lazily: the first forward traces and compiles the forward graph, and the
first backward compiles the backward graph. So the first forward+backward is timed (the loop
enters ``step_context`` around exactly that) and reported as ``compile_time_s``; it includes
one step's ordinary compute, which is small beside compilation. The timed steps that follow
run the compiled code only, so throughput is not polluted by compilation.

Memory: Dynamo does not run compiled code while a Python dispatch mode is active, and the
memory window's tensor accounting (``MemTracker``) is one, so the window runs this model
eagerly and reports the eager peak. A compiled model's own peak needs a window without the
tracker (CUDA allocator counters); on CPU it cannot be measured by tensor accounting at all,
since inductor's kernels allocate below the dispatcher.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from harness.strategies.base import Strategy, TrialContext


class Compile(Strategy):
    name = "compile"

    def __init__(self, arg: str | None = None) -> None:
        super().__init__(arg)
        self.device: torch.device | None = None
        self.compile_time_s: float | None = None
        self._timing = False

    def prepare_model(self, model: nn.Module, ctx: TrialContext) -> nn.Module:
        self.device = ctx.device
        model.compile()  # default backend: inductor
        return model

    def step_context(self) -> contextlib.AbstractContextManager[Any]:
        if self.compile_time_s is None and not self._timing:
            return self._time_first_step()
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def _time_first_step(self) -> Iterator[None]:
        self._timing = True
        self._sync()
        start = time.perf_counter()
        try:
            yield
            self._sync()
            self.compile_time_s = time.perf_counter() - start
        finally:
            self._timing = False

    def _sync(self) -> None:
        if self.device is not None and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def after_training(self, model: nn.Module, ctx: TrialContext) -> dict[str, float]:
        if self.compile_time_s is None:
            return {}
        return {"compile_time_s": self.compile_time_s}
