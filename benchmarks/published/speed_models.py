"""Models of the published *speed* runs that the built-in families cannot configure as the
sources ran them (``speed_specs/``; the memory runs' models are in ``models.py``).

harness calls each function as ``function(data=DataInfo, **knobs)`` (docs/own-code.md).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from harness.workloads import timm_models

__all__ = ["timm_unfused_attention"]


def timm_unfused_attention(data: Any, name: str, **knobs: Any) -> nn.Module:
    """A timm model as timm 0.6.6 built it (``results/benchmark-train-*-pt112-*.csv``): its
    attention blocks compute ``q @ k.T``, softmax and ``@ v`` as separate ops. timm >= 0.9 calls
    ``F.scaled_dot_product_attention`` when torch has it, chosen when a block is built; timm's
    own switch (``set_fused_attn(False)``, as ``TIMM_FUSED_ATTN=0`` does) builds the old path.
    Everything else is ``harness``' own ``timm`` family."""
    from timm.layers import set_fused_attn

    set_fused_attn(False)
    return timm_models.build(data, name, **knobs)
