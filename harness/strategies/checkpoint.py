"""``checkpoint[:K]``: activation recomputation over the model's repeated blocks.

Only each segment's input is kept from the forward pass; the segment's inside is recomputed in
backward (``torch.utils.checkpoint``, non-reentrant). Segments of K blocks store n/K inputs and
recompute K blocks at a time, so K = sqrt(n) gives Chen et al.'s O(sqrt n) activation memory.

The blocks (``repeated_blocks``) are found in any model: ``model.blocks`` (the built-in
families, timm's ViTs), ``model.stages`` (timm's staged nets), a ResNet's ``layer1``..``layer4``,
else the longest ``nn.ModuleList``/``nn.Sequential`` of modules of one type
(``TransformerEncoder.layers``, a Hugging Face model's ``layers`` or ``h``). A block keeps its
module and type (only its ``forward`` is wrapped), so parents that look inside their blocks
(``TransformerEncoder``'s fast-path checks) and module hooks (FSDP, the memory tracker) see
the model unchanged, and whatever arguments a parent passes its blocks (masks, position
embeddings, caches) reach them. A Hugging Face model that supports it is checkpointed by its
own ``gradient_checkpointing_enable`` (non-reentrant), as a Trainer script would.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from harness.strategies.base import Strategy, StrategyError, TrialContext


def repeated_blocks(model: nn.Module) -> tuple[str, list[nn.Module]]:
    """Where the model's repeated blocks are, and the blocks in execution order."""
    for name in ("blocks", "stages"):
        found = getattr(model, name, None)
        if isinstance(found, nn.ModuleList | nn.Sequential) and len(found):
            return name, list(found)
    if all(isinstance(getattr(model, f"layer{i}", None), nn.Module) for i in range(1, 5)):
        return "layer1..layer4", [getattr(model, f"layer{i}") for i in range(1, 5)]
    best: tuple[str, list[nn.Module]] | None = None
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList | nn.Sequential) and len(module) > 1:
            children = list(module)
            same_type = all(type(child) is type(children[0]) for child in children)
            if same_type and (best is None or len(children) > len(best[1])):
                best = name, children
    if best is None:
        raise StrategyError(
            f"checkpoint: no repeated blocks found in {type(model).__name__} (looked for "
            "model.blocks, model.stages, layer1..layer4 and lists of same-type modules)"
        )
    return best


def _pass_through(*args: Any, **kwargs: Any) -> Any:
    """A block inside a checkpointed segment: the segment's head already ran it."""
    return args[0]


def checkpoint_segments(blocks: list[nn.Module], per_segment: int, **options: Any) -> int:
    """Checkpoint consecutive runs of ``per_segment`` blocks; returns the number of segments.
    ``options`` go to ``torch.utils.checkpoint.checkpoint`` (``sac``'s ``context_fn``).

    The first block of a segment runs the whole segment under ``checkpoint``; the others pass
    their input through when their parent calls them (the segment ran them already, through
    their own ``__call__``, so their hooks fire once, inside the segment).
    """
    segments = 0
    for start in range(0, len(blocks), per_segment):
        head, *rest = blocks[start : start + per_segment]
        head_forward = head.forward

        def run(
            *args: Any, _head: Any = head_forward, _rest: list[nn.Module] = rest, **kwargs: Any
        ) -> Any:
            out = _head(*args, **kwargs)
            for block in _rest:
                if not isinstance(out, torch.Tensor):
                    raise StrategyError(
                        f"checkpoint:{per_segment}: segments of several blocks need blocks that "
                        f"return a tensor ({type(block).__name__} returns "
                        f"{type(out).__name__}); use checkpoint"
                    )
                del block.forward  # the module's own forward again, for this call
                try:
                    out = block(out, *args[1:], **kwargs)
                finally:
                    block.forward = _pass_through
            return out

        head.forward = functools.partial(checkpoint, run, use_reentrant=False, **options)
        for block in rest:
            block.forward = _pass_through
        segments += 1
    return segments


def enable_hf_checkpointing(model: nn.Module, **options: Any) -> None:
    """A transformers model's own checkpointing, non-reentrant (transformers >= 5.23 names it
    activation checkpointing; earlier releases gradient checkpointing)."""
    kwargs = {"use_reentrant": False, **options}
    # A transformers PreTrainedModel (transformers is imported only by the trials that use it,
    # so not named here): these methods are its own, not nn.Module's.
    hf_model: Any = model
    if hasattr(hf_model, "activation_checkpointing_enable"):
        hf_model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        hf_model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


class Checkpoint(Strategy):
    name = "checkpoint"

    def checkpoint_options(self) -> dict[str, Any]:
        """Extra arguments of ``torch.utils.checkpoint.checkpoint`` (none: full recomputation)."""
        return {}

    def prepare_model(self, model: nn.Module, ctx: TrialContext) -> nn.Module:
        per_segment = int(self.arg) if self.arg else 1
        where, blocks = repeated_blocks(model)
        what = f"{where}: {len(blocks)} x {type(blocks[0]).__name__}"
        options = self.checkpoint_options()
        if per_segment == 1 and getattr(model, "supports_gradient_checkpointing", False):
            enable_hf_checkpointing(model, **options)
            ctx.notes["checkpoint_blocks"] = f"{what} (transformers' gradient checkpointing)"
            ctx.notes["checkpoint_segments"] = len(blocks)
            return model
        ctx.notes["checkpoint_blocks"] = what
        ctx.notes["checkpoint_segments"] = checkpoint_segments(blocks, per_segment, **options)
        return model
