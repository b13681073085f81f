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
import weakref
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


# A block's recomputation under ``:auto``: kept (saved for backward as usual), recomputed in
# full, or under ``sac``'s policy.
KEEP, FULL, SAC = "keep", "full", "sac"


class BlockRecomputation:
    """Each repeated block's recomputation, switchable per block after the model is built:
    ``checkpoint:auto`` and ``sac:auto`` try one plan after another on the same (fake) model,
    and the trial applies the chosen one to the real model.

    Every block's ``forward`` is wrapped once; at each call it reads its block's mode. The
    modes are a tuple of ``KEEP``, ``FULL``, ``SAC``, one per block in execution order."""

    def __init__(self, blocks: list[nn.Module], sac_options: dict[str, Any]) -> None:
        self.blocks = blocks
        self.sac_options = sac_options
        self.modes: tuple[str, ...] = (FULL,) * len(blocks)
        for index, block in enumerate(blocks):
            block.forward = functools.partial(self._run, index, block.forward)

    def _run(self, index: int, forward: Any, *args: Any, **kwargs: Any) -> Any:
        mode = self.modes[index]
        if mode == KEEP:
            return forward(*args, **kwargs)
        options = self.sac_options if mode == SAC else {}
        return checkpoint(forward, *args, use_reentrant=False, **options, **kwargs)


def fitted(modes: tuple[str, ...] | None, count: int) -> tuple[str, ...]:
    """``modes`` for a model of ``count`` blocks: None is every block in full; a plan made for
    another depth applies only where it treats every block alike (else it is returned as it
    is, and does not fit)."""
    if modes is None:
        return (FULL,) * count
    if len(modes) != count and len(set(modes)) == 1:
        return (modes[0],) * count
    return modes


def describe(modes: tuple[str, ...]) -> str:
    """Which blocks do what, e.g. ``full: 0-2; keep: 3-7``."""
    parts = []
    for mode in (FULL, SAC, KEEP):
        indices = [i for i, m in enumerate(modes) if m == mode]
        if indices:
            parts.append(f"{mode}: {spans(indices)}")
    return "; ".join(parts)


def spans(indices: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``0-2, 5``."""
    runs: list[list[int]] = []
    for index in indices:
        if runs and index == runs[-1][-1] + 1:
            runs[-1].append(index)
        else:
            runs.append([index])
    return ", ".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else f"{r[0]}" for r in runs)


class Checkpoint(Strategy):
    name = "checkpoint"
    # Under ``:auto``, what the blocks not recomputed in full do.
    rest_mode = KEEP

    def __init__(self, arg: str | None = None) -> None:
        super().__init__(arg)
        self.auto = (arg or "").strip() == "auto"
        # ``:auto``: the plan to apply (chosen by ``harness.trial.recompute`` before training;
        # None: every block recomputed in full, the most memory it can save) and the blocks
        # of the model it was last applied to.
        self.modes: tuple[str, ...] | None = None
        self.recomputation: BlockRecomputation | None = None
        # Every model still alive that this strategy prepared: a deep model's prediction
        # builds shallow copies beside the whole one (``harness.trial.depth``), and a plan
        # set later is every one's.
        self.applied: weakref.WeakSet[BlockRecomputation] = weakref.WeakSet()
        self.order: list[int] | None = None  # blocks in the order auto recomputes them

    def checkpoint_options(self) -> dict[str, Any]:
        """Extra arguments of ``torch.utils.checkpoint.checkpoint`` (none: full recomputation)."""
        return {}

    def sac_options(self) -> dict[str, Any]:
        """The arguments of a block in ``SAC`` mode (``sac``'s policy; ``checkpoint`` has
        none)."""
        return {}

    def set_modes(self, modes: tuple[str, ...] | None) -> None:
        """``:auto``: the plan for every model prepared and every later one (None: all in
        full). A plan that treats every block alike is any depth's (a shallow copy's too)."""
        self.modes = modes
        for recomputation in self.applied:
            recomputation.modes = fitted(modes, len(recomputation.blocks))
            if len(recomputation.modes) != len(recomputation.blocks):
                # a shallow copy the deep model's prediction is done with (it predicts only
                # plans that treat every block alike): in full until it is used again
                recomputation.modes = (FULL,) * len(recomputation.blocks)

    def uniform_mode(self) -> str | None:
        """The one mode of a plan that treats every block alike (None: a plan that does not)."""
        if self.modes is None:
            return FULL
        return self.modes[0] if len(set(self.modes)) == 1 else None

    def plan(self, full: list[int], count: int) -> tuple[str, ...]:
        """The blocks ``full`` recomputed in full, the others ``rest_mode``."""
        chosen = set(full)
        return tuple(FULL if i in chosen else self.rest_mode for i in range(count))

    def prepare_auto(self, model: nn.Module, ctx: TrialContext) -> nn.Module:
        where, blocks = repeated_blocks(model)
        self.recomputation = BlockRecomputation(blocks, self.sac_options())
        self.applied.add(self.recomputation)
        self.set_modes(self.modes)
        if self.modes is not None and len(fitted(self.modes, len(blocks))) != len(blocks):
            raise StrategyError(
                f"{self.name}:auto: a plan for {len(self.modes)} blocks does not apply to "
                f"{where}'s {len(blocks)} blocks"
            )
        modes = self.recomputation.modes
        full = modes.count(FULL)
        rest = len(blocks) - full
        others = (
            ""
            if not rest
            else f", the other {rest} "
            + ("under sac's policy" if self.rest_mode == SAC else "kept")
        )
        ctx.notes["checkpoint_blocks"] = (
            f"{where}: {full} of {len(blocks)} x {type(blocks[0]).__name__} recomputed in "
            f"full{others}"
        )
        ctx.notes["checkpoint_segments"] = sum(m != KEEP for m in modes)
        ctx.notes["checkpoint_full_blocks"] = full
        ctx.notes["checkpoint_policy"] = f"{self.name}:auto ({describe(modes)})"
        return model

    def prepare_model(self, model: nn.Module, ctx: TrialContext) -> nn.Module:
        if self.auto:
            return self.prepare_auto(model, ctx)
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
