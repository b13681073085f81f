"""Memory-management strategies that change where or how tensors live, not what is computed.

- ``offload_activations``: saved activations move to pinned host memory in forward and come
  back in backward, trading GPU memory for PCIe traffic (CUDA only).
- ``expandable_segments``: the CUDA caching allocator grows segments in place instead of
  carving fixed blocks, so less memory is reserved but unusable (CUDA only).
- ``keep_grads``: gradients are zeroed in place rather than freed, so they stay allocated
  through forward: the baseline's ``set_to_none`` is itself a memory technique, and this
  shows its worth.
- ``channels_last``: NHWC layout for conv models and their image inputs; same bytes, faster
  convolutions on GPUs with tensor cores.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import torch
from torch import nn

from harness.compat.internals import FakeTensor
from harness.strategies.base import Strategy, TrialContext
from harness.workloads.convert import convert

# PyTorch >= 2.9 also reads the device-neutral PYTORCH_ALLOC_CONF; when a user has set that one,
# it gets the setting too, so whichever variable the allocator reads has it.
ALLOC_CONF_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


def merge_conf(first: str, second: str) -> str:
    """``second``'s options over ``first``'s (``k:v,k:v``), each key once, in order."""
    merged = first
    for part in second.split(","):
        if part.strip():
            key, _, value = part.partition(":")
            merged = with_option(merged, key.strip(), value.strip())
    return merged


def with_option(conf: str, key: str, value: str) -> str:
    """``conf`` (``k:v,k:v``) with ``key`` set to ``value``, the other options kept in order."""
    options = [part.strip() for part in conf.split(",") if part.strip()]
    options = [part for part in options if part.split(":", 1)[0].strip() != key]
    return ",".join([*options, f"{key}:{value}"])


class OffloadActivations(Strategy):
    name = "offload_activations"

    def step_context(self) -> contextlib.AbstractContextManager[Any]:
        # Pinned host buffers let the copies back to the GPU overlap with compute.
        host = torch.autograd.graph.save_on_cpu(pin_memory=True)

        def pack(tensor: torch.Tensor) -> tuple[bool, Any]:
            if tensor.device.type == "cpu" and isinstance(tensor, FakeTensor):
                # This strategy is CUDA only, so a fake CPU tensor stands for a CUDA one: a
                # machine without a GPU predicting the trial for a card. Its host copy is not
                # device memory; on the meta device it is counted nowhere, as on the card.
                return True, (tensor.device, torch.empty_like(tensor, device="meta"))
            return False, host.pack_hook(tensor)

        def unpack(packed: tuple[bool, Any]) -> torch.Tensor:
            standing_in, payload = packed
            if standing_in:
                device, copy = payload
                return torch.empty_like(copy, device=device)  # back on the "card" in backward
            return host.unpack_hook(payload)

        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


class ExpandableSegments(Strategy):
    name = "expandable_segments"

    def environment(self) -> dict[str, str]:
        env = {"PYTORCH_CUDA_ALLOC_CONF": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")}
        if "PYTORCH_ALLOC_CONF" in os.environ:
            env["PYTORCH_ALLOC_CONF"] = os.environ["PYTORCH_ALLOC_CONF"]
        return {var: with_option(conf, "expandable_segments", "True") for var, conf in env.items()}


class KeepGrads(Strategy):
    name = "keep_grads"

    def zero_grad_set_to_none(self) -> bool:
        return False


class ChannelsLast(Strategy):
    name = "channels_last"

    def prepare_model(self, model: nn.Module, ctx: TrialContext) -> nn.Module:
        return convert(model, memory_format=torch.channels_last)

    def prepare_batch(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 4 and x.is_floating_point():
            return x.contiguous(memory_format=torch.channels_last)
        return x
