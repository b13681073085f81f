"""``quantize_int8``: post-training dynamic int8 quantization of the trained model's Linear layers.

Training is untouched (the trial's training metrics mean what they always do). After training,
a CPU fp32 copy of the model is quantized with ``torch.ao.quantization.quantize_dynamic``:
Linear weights are stored as int8 with a scale and zero point, activations are quantized on the
fly per batch. This is an inference-side saving, measured beside the float copy on the same CPU:

- ``float_linear_weight_bytes`` / ``int8_linear_weight_bytes``: the Linear weights before and
  after (int8 values plus their scales and zero points); about 4x smaller.
- ``float_peak_inference_bytes`` / ``int8_peak_inference_bytes``: peak tensor memory of one
  held-out forward pass of a fixed batch, by ``MemTracker`` tensor accounting (model, input and
  every tensor the pass creates). The int8 weights live in packed objects that tensor accounting
  cannot see, so their bytes (int8 weights, scales, zero points and the packed fp32 biases) are
  ADDED to the int8 peak; without that the int8 model would look weightless.
- ``int8_accuracy``: held-out accuracy of the int8 model, run in fp32 on the CPU without the
  trial's autocast (the quantized kernels take fp32 input only).

Only Linear layers are quantized: convolutions, embeddings and norms stay fp32.
"""

from __future__ import annotations

import copy
import warnings

import torch
from torch import nn
from torch.ao.nn.quantized.dynamic import Linear as DynamicQuantizedLinear
from torch.distributed.tensor import DTensor
from torch.nn.utils import prune

from harness.meters.accounting import peak_forward_bytes
from harness.meters.accuracy import EVAL_BATCH
from harness.strategies.base import Strategy, TrialContext

PEAK_BATCH = 256  # held-out samples in the forward pass whose peak memory is measured


def _unwrap(model: nn.Module) -> nn.Module:
    """The plain module under ``torch.compile`` / DistributedDataParallel wrappers."""
    model = getattr(model, "_orig_mod", model)
    return getattr(model, "module", model) if hasattr(model, "no_sync") else model


def float_copy(model: nn.Module) -> nn.Module:
    """An fp32 CPU copy in eval mode; pruning masks are folded into plain weights (the
    quantizer would otherwise carry the masking hook onto a module without ``weight_orig``)."""
    model = _unwrap(model)
    if any(isinstance(p, DTensor) for p in model.parameters()):
        raise ValueError("quantize_int8 cannot quantize an FSDP-sharded model (use ddp)")
    copied = copy.deepcopy(model).float().cpu().eval()
    for module in copied.modules():
        if prune.is_pruned(module) and hasattr(module, "weight_orig"):
            prune.remove(module, "weight")
    return copied


def quantize(model: nn.Module) -> nn.Module:
    """Swap every Linear of ``model`` (changed in place) for a dynamic int8 one."""
    with warnings.catch_warnings():  # torch.ao.quantization warns it is deprecated
        warnings.filterwarnings("ignore", message=r".*torch\.ao\.quantization is deprecated")
        warnings.filterwarnings("ignore", message=r".*quantized tensor creation functions")
        warnings.filterwarnings("ignore", message=r"torch\.quantize_per_tensor")
        return torch.ao.quantization.quantize_dynamic(
            model, {nn.Linear}, dtype=torch.qint8, inplace=True
        )


def int8_weight_bytes(weight: torch.Tensor) -> int:
    """int8 values plus quantization parameters (per-tensor: one fp32 scale + one int32 zero
    point; per-channel: one of each per output channel, at their stored sizes)."""
    values = weight.int_repr().numel()  # 1 byte each
    if weight.qscheme() in (torch.per_channel_affine, torch.per_channel_symmetric):
        params = (weight.q_per_channel_scales(), weight.q_per_channel_zero_points())
        return values + sum(t.numel() * t.element_size() for t in params)
    return values + 8


def packed_bytes(qmodel: nn.Module) -> tuple[int, int]:
    """(int8 weight bytes, all bytes hidden in packed params: weights + biases)."""
    weights = biases = 0
    for module in qmodel.modules():
        if isinstance(module, DynamicQuantizedLinear):
            weights += int8_weight_bytes(module.weight())
            bias = module.bias()
            biases += 0 if bias is None else bias.numel() * bias.element_size()
    return weights, weights + biases


def as_input(x: torch.Tensor) -> torch.Tensor:
    return x.float() if x.is_floating_point() else x


@torch.no_grad()
def cpu_accuracy(model: nn.Module, test_x: torch.Tensor, test_y: torch.Tensor) -> float:
    """Held-out accuracy (per token for sequence models) in fp32 on the CPU, no autocast."""
    correct = count = 0
    for start in range(0, len(test_x), EVAL_BATCH):
        logits = model(as_input(test_x[start : start + EVAL_BATCH].cpu()))
        y = test_y[start : start + EVAL_BATCH].cpu()
        correct += int((logits.argmax(dim=-1) == y).sum())
        count += y.numel()
    return correct / count


class QuantizeInt8(Strategy):
    name = "quantize_int8"

    def after_training(self, model: nn.Module, ctx: TrialContext) -> dict[str, float]:
        fmodel = float_copy(model)
        float_bytes = sum(
            m.weight.numel() * m.weight.element_size()
            for m in fmodel.modules()
            if isinstance(m, nn.Linear)
        )
        x = as_input(ctx.data.test_x[:PEAK_BATCH].cpu())
        float_peak = peak_forward_bytes(fmodel, x)
        qmodel = quantize(fmodel)  # in place: fmodel is already a private copy
        int8_bytes, hidden_bytes = packed_bytes(qmodel)
        return {
            "float_linear_weight_bytes": float(float_bytes),
            "int8_linear_weight_bytes": float(int8_bytes),
            "float_peak_inference_bytes": float(float_peak),
            "int8_peak_inference_bytes": float(peak_forward_bytes(qmodel, x) + hidden_bytes),
            "int8_accuracy": cpu_accuracy(qmodel, ctx.data.test_x, ctx.data.test_y),
        }
