"""Models of the published runs, built as their sources built them (random weights, no download).

harness calls each function as ``function(data=DataInfo, **knobs)`` (docs/own-code.md). The
vision model is torchvision's own; the language models are re-implementations of the sources'
model code, in ``litgpt_model`` and ``torchtune_model``, because the memory a step allocates
depends on that code (fused QKV, chunked heads, where logits are upcast), not only on the shapes.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from benchmarks.published.litgpt_model import litgpt_chunked_loss, litgpt_lora
from benchmarks.published.torchtune_model import torchtune_llama, torchtune_loss

__all__ = ["litgpt_chunked_loss", "litgpt_lora", "torchtune_llama", "torchtune_loss", "vit_l_16"]


def vit_l_16(data: Any) -> nn.Module:
    """torchvision's ViT-L/16 with a head for the dataset's classes.

    rasbt/pytorch-memory-optim loads ``vit_l_16(weights=IMAGENET1K_V1)`` and replaces
    ``heads.head`` by ``Linear(1024, 10)``; building with ``num_classes`` gives the same modules
    and shapes (weights' values do not change memory) without downloading anything.
    """
    from torchvision.models import vit_l_16 as build

    return build(num_classes=data.num_classes)
