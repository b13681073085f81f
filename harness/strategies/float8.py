"""``float8``: torchao's float8 training: the Linear layers' matmuls in fp8 on sm89+ cards.

``torchao.float8.convert_to_float8_training`` swaps each ``nn.Linear`` for a ``Float8Linear``:
the weight stays in its own precision (the optimizer and the master copy are unchanged), and
every forward casts input and weight to ``float8_e4m3fn`` with a scale computed from their
absolute maximum (``tensorwise``: one scale per tensor; ``rowwise``: one per row), then runs
aten ``_scaled_mm`` (fp8 tensor cores: twice bf16's peak on Hopper and Ada). The backward casts
the output gradient the same way (``e5m2`` in the rowwise recipe's grad path).

Which layers: those torchao's kernels take (both dimensions multiples of 16) and not a language
model's output head (torchtitan and torchao leave it in high precision: the logits' precision
matters and a vocabulary's size is rarely a multiple of 16 anyway).

With ``fsdp:N`` the tensorwise recipe also gathers the weights in fp8
(``enable_fsdp_float8_all_gather``): half a bf16 all-gather's bytes, and the unsharded weight
the backward keeps is fp8. The scales are then computed per weight each step; torchtitan's
``precompute_float8_dynamic_scale_for_fsdp`` (one all-reduce for all of them) is a speed
refinement left out here.

Memory: fp8 copies of the saved activations are extra (the high-precision ones stay saved for
the layers around), so float8 rarely lowers a peak; torchao's published Llama-3-8B row moves
47.65 to 47.77 GB. Speed is where it pays. Both are predicted from a CPU: the cast and
``_scaled_mm`` run on fake tensors like any op, priced at the card's fp8 peak.

Cards: ``_scaled_mm`` needs compute capability 8.9 or later (Ada, Hopper, Blackwell); older
cards are refused in one line before anything runs (``Combination.card_refusal``: an
estimate's row for such a card says so; a trial on one ends before it trains).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from harness.strategies import STRATEGIES
from harness.strategies.base import Strategy, StrategyError, TrialContext
from harness.strategies.combination import capability_refusal

RECIPES = ("tensorwise", "rowwise")
# Module names torchao and torchtitan leave in high precision: a language model's head.
HEADS = ("lm_head", "output", "head")


def converts(module: nn.Module, name: str) -> bool:
    """Whether ``convert_to_float8_training`` swaps this module (its ``module_filter_fn``)."""
    if not isinstance(module, nn.Linear):
        return True  # the filter is asked of containers too: descend into them
    if name.rpartition(".")[2] in HEADS:
        return False
    return module.in_features % 16 == 0 and module.out_features % 16 == 0


class Float8(Strategy):
    name = "float8"

    def __init__(self, arg: str | None = None) -> None:
        super().__init__(arg)
        self.recipe = arg or RECIPES[0]

    def load_libraries(self) -> None:
        import torchao.float8  # noqa: F401

    def prepare_model(self, model: nn.Module, ctx: TrialContext) -> nn.Module:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        if ctx.device.type == "cuda" and not ctx.estimating:  # the card this trial runs on
            index = ctx.device.index if ctx.device.index is not None else 0
            refusal = capability_refusal(
                STRATEGIES[self.name],
                torch.cuda.get_device_name(index),
                torch.cuda.get_device_capability(index),
            )
            if refusal:
                raise StrategyError(refusal)
        config = Float8LinearConfig.from_recipe_name(self.recipe)
        sharded = "fsdp" in ctx.combination and ctx.layout.size("dp") > 1  # not ddp's replicas
        if self.recipe == "tensorwise" and sharded:
            config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)
        before = sum(isinstance(m, nn.Linear) for m in model.modules())
        convert_to_float8_training(model, config=config, module_filter_fn=converts)
        from torchao.float8.float8_linear import Float8Linear

        swapped = sum(isinstance(m, Float8Linear) for m in model.modules())
        if not swapped:
            raise StrategyError(
                "float8: no Linear layer with both sizes a multiple of 16 to run in fp8"
            )
        ctx.notes["float8_layers"] = f"{swapped} of {before} Linear layers in fp8 ({self.recipe})"
        return model
