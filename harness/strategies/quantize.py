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
from harness.meters.accuracy import evaluate
from harness.strategies.base import Strategy, TrialContext
from harness.workloads.tensors import Batch, inputs_only, take

CPU = torch.device("cpu")

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


def fp32_inputs(batch: Batch) -> Batch:
    """The quantized kernels take fp32 input only: floating tensors to fp32, the rest as is."""
    return {k: t.float() if t.is_floating_point() else t for k, t in batch.items()}


class QuantizeInt8(Strategy):
    name = "quantize_int8"

    def after_training(self, model: nn.Module, ctx: TrialContext) -> dict[str, float]:
        fmodel = float_copy(model)
        float_bytes = sum(
            m.weight.numel() * m.weight.element_size()
            for m in fmodel.modules()
            if isinstance(m, nn.Linear)
        )
        test = {k: t.cpu() for k, t in ctx.data.test.items()}
        batch = fp32_inputs(inputs_only(take(test, slice(0, PEAK_BATCH))))

        def inference_peak(of: nn.Module) -> int:
            return peak_forward_bytes(of, batch, lambda: ctx.task.outputs(of, batch))

        float_peak = inference_peak(fmodel)
        qmodel = quantize(fmodel)  # in place: fmodel is already a private copy
        int8_bytes, hidden_bytes = packed_bytes(qmodel)
        # fp32 on the CPU without the trial's autocast (the quantized kernels take fp32 only).
        held_out = evaluate(qmodel, ctx.task, test, CPU, prepare_batch=fp32_inputs)
        return {
            "float_linear_weight_bytes": float(float_bytes),
            "int8_linear_weight_bytes": float(int8_bytes),
            "float_peak_inference_bytes": float(float_peak),
            "int8_peak_inference_bytes": float(inference_peak(qmodel) + hidden_bytes),
            "int8_accuracy": held_out["accuracy"],
        }
