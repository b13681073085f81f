"""``lora:R`` and ``qlora:R``: low-rank adapters over a frozen base, and the same over a 4-bit one.

LoRA (Hu et al. 2021, through ``peft``): every targeted Linear ``W`` gets ``B @ A`` of rank R
beside it; only ``A`` and ``B`` train. So gradients and optimizer state exist for the adapters
alone (a few MB), while the frozen base still counts as parameters and the activations stay
nearly those of full fine-tuning: backward must still flow through every frozen layer to reach
the adapters below it. The frozen base needs no fp32 master copy (it is never updated), so it
is stored in the trial's 16-bit dtype when the dtype axis is bf16/fp16, as a fine-tuning script
loads it (``torch_dtype=torch.bfloat16``); the adapters stay fp32, as ``peft`` keeps them.
``train.lora`` sets alpha, dropout, targets and the base's dtype.

QLoRA (Dettmers et al. 2023) stores the repeated blocks' frozen Linear weights in NF4: 4-bit
codes with an absmax scale per 64 values, the scales themselves quantized to 8 bits per 256
(double quantization): ~0.516 B/param instead of 2. Embeddings, norms and the LM head stay in
the base dtype. The implementation is torchao's ``NF4Tensor`` (runs on CPU and CUDA, and on
the estimator's fake tensors); each forward dequantizes one weight at a time to the compute
dtype, so the 4-bit base costs a transient 16-bit copy of the largest Linear. bitsandbytes'
``Linear4bit`` (CUDA only, its own kernels) is what most CUDA scripts use: same storage
format, other temporaries.

``peft`` cannot add adapters to a model of fake tensors (it swaps tensors in a way they
refuse), so while estimating the adapters are built the way the model was: for real, their
large tensors on the meta device, then made fake (``harness.trial.fake``).
"""

from __future__ import annotations

import contextlib
import math
import warnings
from typing import Any

import torch
from torch import nn

from harness.strategies.base import Strategy, StrategyError, TrialContext
from harness.strategies.checkpoint import repeated_blocks
from harness.strategies.settings import LoraSettings
from harness.workloads.convert import convert
from harness.workloads.libraries import import_library

NF4_BLOCK = 64  # values per absmax scale (QLoRA's block size)
NF4_SCALER_BLOCK = 256  # scales per second-level (fp32) scale in the double quantization
NF4_BYTES_PER_PARAM = 0.5 + 1 / NF4_BLOCK + 4 / (NF4_BLOCK * NF4_SCALER_BLOCK)  # 0.5159
BASE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def import_peft() -> Any:
    peft = import_library("peft", "strategy lora")
    # peft asks transformers 5 for a renamed property on every get_peft_model: noise in each
    # trial's log, nothing the user can act on.
    warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning)
    return peft


def base_dtype(options: LoraSettings, dtype_axis: str) -> torch.dtype:
    """The frozen base's storage dtype: ``train.lora.base_dtype``, or for ``auto`` the dtype
    axis' 16-bit type (fp32 under fp32)."""
    chosen = options.base_dtype
    return BASE_DTYPES[dtype_axis if chosen == "auto" else chosen]


def target_names(model: nn.Module, targets: list[str] | None) -> list[str]:
    """The Linear modules that get adapters: every Linear of the repeated blocks, or those whose
    name is, or ends with, one of ``targets`` (``q_proj``, ``mlp.fc1``)."""
    if targets:
        found = [
            name
            for name, module in model.named_modules()
            if isinstance(module, nn.Linear)
            and any(name == t or name.endswith(f".{t}") for t in targets)
        ]
        if not found:
            raise StrategyError(
                f"lora: no Linear module matches train.lora.targets {targets} in "
                f"{type(model).__name__}"
            )
        return found
    where, blocks = repeated_blocks(model)
    in_blocks = {id(m) for block in blocks for m in block.modules() if isinstance(m, nn.Linear)}
    found = [name for name, m in model.named_modules() if id(m) in in_blocks]
    if not found:
        raise StrategyError(
            f"lora: the repeated blocks ({where}) of {type(model).__name__} hold no Linear"
        )
    return found


class Lora(Strategy):
    name = "lora"
    quantized = False  # qlora: the blocks' frozen Linear weights in NF4

    def load_libraries(self) -> None:
        import_peft()
        if self.quantized:
            with contextlib.suppress(ImportError):  # quantize_blocks says what is missing
                import torchao.dtypes  # noqa: F401

    def prepare_model(self, model: nn.Module, ctx: TrialContext) -> nn.Module:
        peft = import_peft()
        rank = int(self.arg or 0)
        options = ctx.lora
        names = target_names(model, None if options.targets is None else list(options.targets))
        for param in model.parameters():
            param.requires_grad_(False)
        stored_as = base_dtype(options, ctx.dtype)
        convert(model, dtype=stored_as, parameters_only=True)
        config = peft.LoraConfig(
            r=rank,
            lora_alpha=float(options.alpha or rank),
            lora_dropout=float(options.dropout),
            target_modules=names,
            bias="none",
        )
        with ctx.construction():  # while estimating: for real, large tensors on meta
            model = peft.get_peft_model(model, config)
        if ctx.estimating:
            model = convert(model, ctx.device, materialize_meta=True)
        ctx.notes["lora_targets"] = len(names)
        ctx.notes["lora_base_dtype"] = str(stored_as).removeprefix("torch.")
        if self.quantized:
            ctx.notes.update(quantize_blocks(model))
        return model

    def after_training(self, model: nn.Module, ctx: TrialContext) -> dict[str, float]:
        from harness.meters.accounting import storage_bytes

        weights = block_linear_weights(model)
        frozen = [p for p in model.parameters() if not p.requires_grad]
        stored = storage_bytes(weights)
        count = sum(w.numel() for w in weights)
        return {
            "base_weight_bytes": float(storage_bytes(frozen)),
            "block_linear_weight_bytes": float(stored),
            "block_linear_bytes_per_param": stored / count if count else math.nan,
        }


class QLora(Lora):
    name = "qlora"
    quantized = True


def is_nf4(tensor: torch.Tensor) -> bool:
    """Whether a parameter is stored as torchao's NF4Tensor (without importing torchao; a
    Parameter of a tensor subclass keeps the subclass's type, fake inner tensors too)."""
    return type(tensor).__name__ == "NF4Tensor"


def block_linear_weights(model: nn.Module) -> list[torch.Tensor]:
    """The frozen Linear weights inside the repeated blocks (the adapters' bases and any
    Linear left without an adapter)."""
    return [module.weight for module in frozen_block_linears(model)]


def quantize_blocks(model: nn.Module) -> dict[str, Any]:
    """Every frozen Linear weight of the repeated blocks to NF4; what was done, for the notes.

    A weight whose size is not a multiple of the 64-value block stays in the base dtype; a
    small one whose block count is not a multiple of 256 gets a smaller second-level block.
    """
    # torchao.dtypes keeps to_nf4 in every torchao the declared range allows (0.13-0.17);
    # 0.18 moved it to torchao.quantization.
    torchao = import_library("torchao.dtypes", "strategy qlora", "pip install torchao")
    to_nf4 = getattr(torchao, "to_nf4", None)
    if to_nf4 is None:
        to_nf4 = import_library("torchao.quantization", "strategy qlora", "pip install torchao")
        to_nf4 = to_nf4.to_nf4
    quantized = kept = 0
    for module in frozen_block_linears(model):
        weight = module.weight
        if weight.numel() % NF4_BLOCK:
            kept += 1
            continue
        scaler_block = math.gcd(weight.numel() // NF4_BLOCK, NF4_SCALER_BLOCK)
        module.weight = nn.Parameter(
            to_nf4(weight.detach(), NF4_BLOCK, scaler_block), requires_grad=False
        )
        quantized += 1
    if not quantized:
        raise StrategyError("qlora: no Linear weight of the repeated blocks can be stored in NF4")
    return {"qlora_nf4_linears": quantized, "qlora_unquantized_linears": kept}


def frozen_block_linears(model: nn.Module) -> list[nn.Linear]:
    _, blocks = repeated_blocks(model)
    found: dict[int, nn.Linear] = {}
    for block in blocks:
        for module in block.modules():
            if isinstance(module, nn.Linear) and not module.weight.requires_grad:
                found.setdefault(id(module), module)
    return list(found.values())
