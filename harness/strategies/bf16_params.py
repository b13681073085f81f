"""``bf16_params``: parameters, gradients and optimizer state all in bf16 (no fp32 master copy).

Halves model-state memory against fp32. Without fp32 master weights, small updates can round
away (bf16 keeps 8 mantissa bits), so accuracy may suffer; the sweep measures by how much.
The loss is still computed in fp32.
"""

from __future__ import annotations

import torch
from torch import nn

from harness.strategies.base import Strategy, TrialContext
from harness.workloads.convert import convert


class Bf16Params(Strategy):
    name = "bf16_params"

    def prepare_model(self, model: nn.Module, ctx: TrialContext) -> nn.Module:
        return convert(model, dtype=torch.bfloat16)

    def prepare_batch(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(torch.bfloat16) if x.is_floating_point() else x
