"""``prune:AMOUNT`` and ``prune_structured:AMOUNT``: two kinds of pruning with opposite effects
on memory, kept side by side so the sweep shows the difference.

``prune`` zeroes weights (unstructured sparsity): the model keeps its dense shapes, so training
memory does not fall; it rises. ``prune_structured`` removes whole hidden units, so every layer
really becomes smaller and parameters, gradients, optimizer state and activations all shrink.
"""

from __future__ import annotations

from collections import Counter
from typing import cast

import torch
from torch import nn
from torch.nn.utils import prune

from harness.strategies import STRATEGIES
from harness.strategies.base import Strategy, TrialContext

PRUNABLE = (nn.Linear, nn.Conv2d)


def _shared_ids(model: nn.Module) -> set[int]:
    """Ids of parameters registered in more than one module (e.g. a head tied to an embedding)."""
    owners = Counter(
        id(p) for m in model.modules() for p in m._parameters.values() if p is not None
    )
    return {key for key, count in owners.items() if count > 1}


class MagnitudePrune(Strategy):
    """Global unstructured L1 (magnitude) pruning of AMOUNT of all Linear/Conv2d weights, once,
    before training.

    ``torch.nn.utils.prune`` reparametrizes each pruned weight: the trained parameter becomes
    ``weight_orig``, a ``weight_mask`` buffer holds the zeros, and a forward pre-hook recomputes
    ``weight = weight_orig * weight_mask`` each forward, so pruned weights stay zero through
    training. Dense storage does NOT shrink: parameter bytes are unchanged, the masks add a
    buffer as large as the weights, and the recomputed weight adds a copy per forward. This is
    a study of accuracy under sparsity, not a memory saving. Weights shared with another module
    (the gpt head tied to the token embedding) are skipped: masking one would mask both.
    """

    name = "prune"

    def prepare_model(self, model: nn.Module, ctx: TrialContext) -> nn.Module:
        amount = float(self.arg or 0)
        if not 0 < amount < 1:
            raise ValueError(f"prune: the fraction must be between 0 and 1 (got {self.arg})")
        shared = _shared_ids(model)
        self.pruned = [
            m for m in model.modules() if isinstance(m, PRUNABLE) and id(m.weight) not in shared
        ]
        if not self.pruned:
            raise ValueError(f"prune: {type(model).__name__} has no unshared Linear/Conv2d weight")
        prune.global_unstructured(
            [(m, "weight") for m in self.pruned],
            pruning_method=prune.L1Unstructured,
            amount=amount,
        )
        return model

    def after_training(self, model: nn.Module, ctx: TrialContext) -> dict[str, float]:
        zeros = total = 0
        with torch.no_grad():
            for m in self.pruned:
                # The effective weight, recomputed (module.weight is refreshed only by a forward):
                # torch's prune registered weight_orig (a parameter) and weight_mask (a buffer).
                weight = (
                    cast(torch.Tensor, m.weight_orig) * cast(torch.Tensor, m.weight_mask)
                    if hasattr(m, "weight_mask")
                    else m.weight
                )
                zeros += int((weight == 0).sum())
                total += weight.numel()
        return {"sparsity": zeros / total}


# ---- structured pruning ---------------------------------------------------------------------


def _keep(weight: torch.Tensor, amount: float) -> torch.Tensor:
    """Sorted indices of the output units (rows / filters) with the largest L2 norm."""
    units = weight.shape[0]
    keep = max(1, round(units * (1 - amount)))
    norms = weight.detach().flatten(1).float().norm(dim=1)
    return norms.topk(keep).indices.sort().values


def _slice(module: nn.Module, name: str, dim: int, index: torch.Tensor) -> None:
    """Replace ``module.<name>`` by the kept slice along ``dim`` (same device, dtype, grad flag)."""
    old = getattr(module, name)
    if old is None:
        return
    new = old.detach().index_select(dim, index.to(old.device)).clone()
    setattr(module, name, nn.Parameter(new, requires_grad=old.requires_grad))


def _shrink_outputs(layer: nn.Linear | nn.Conv2d, index: torch.Tensor) -> None:
    _slice(layer, "weight", 0, index)
    _slice(layer, "bias", 0, index)
    if isinstance(layer, nn.Conv2d):
        layer.out_channels = len(index)
    else:
        layer.out_features = len(index)


def _shrink_inputs(layer: nn.Linear | nn.Conv2d, index: torch.Tensor) -> None:
    _slice(layer, "weight", 1, index)
    if isinstance(layer, nn.Conv2d):
        layer.in_channels = len(index)
    else:
        layer.in_features = len(index)


def _prune_chain(layers: list[nn.Linear | nn.Conv2d], head: nn.Linear, amount: float) -> None:
    """Layers run one after another (through elementwise activations and pooling only): remove
    each one's weakest output units and the matching inputs of the next layer, or of the head.

    A conv model's head reads the flattened feature map channel-major, so a removed channel
    takes its whole block of H*W head inputs with it.
    """
    for i, layer in enumerate(layers):
        index = _keep(layer.weight, amount)
        units = layer.weight.shape[0]
        _shrink_outputs(layer, index)
        if i + 1 < len(layers):
            _shrink_inputs(layers[i + 1], index)
            continue
        per_unit = head.in_features // units
        columns = torch.arange(per_unit, device=index.device)
        index = (index[:, None] * per_unit + columns).flatten()
        _shrink_inputs(head, index)


def _prune_gpt(model: nn.Module, amount: float) -> None:
    """Each transformer MLP's hidden units: rows of ``fc`` (and its bias), columns of ``proj``.
    The residual stream width (d_model) is shared by every block and stays as it is."""
    mlps = [
        (fc, proj)
        for m in model.modules()
        if isinstance(fc := getattr(m, "fc", None), nn.Linear)
        and isinstance(proj := getattr(m, "proj", None), nn.Linear)
    ]
    for fc, proj in mlps:
        index = _keep(fc.weight, amount)
        _shrink_outputs(fc, index)
        _shrink_inputs(proj, index)


class StructuredPrune(Strategy):
    """Removes AMOUNT of the hidden units with the lowest L2 norm before training, building
    smaller layers: mlp hidden neurons, cnn conv channels, gpt MLP hidden units.

    Unlike ``prune`` this really shrinks parameters, gradients, optimizer state and activations
    (``num_params`` falls). At initialisation the norms carry little information, so this is
    "train a narrower model" chosen by norm; the sweep measures what it costs in accuracy. At
    least one unit per layer is kept. ResNet is refused: its residual additions tie the channel
    counts of whole stages together, which this simple per-layer surgery cannot respect.
    """

    name = "prune_structured"

    def prepare_model(self, model: nn.Module, ctx: TrialContext) -> nn.Module:
        amount = float(self.arg or 0)
        if not 0 < amount < 1:
            raise ValueError(
                f"prune_structured: the fraction must be between 0 and 1 (got {self.arg})"
            )
        if ctx.family == "resnet":
            raise ValueError(
                "structured pruning of ResNet is not supported: residual connections tie the "
                "channel counts of each stage together (use prune for unstructured sparsity)"
            )
        families = STRATEGIES[self.name].families or ()
        if ctx.family not in families:
            raise ValueError(
                f"structured pruning supports the {', '.join(families)} families, "
                f"not {ctx.family!r}"
            )
        if any(prune.is_pruned(m) for m in model.modules()):
            raise ValueError("prune_structured must come before prune in a combination")
        blocks = getattr(model, "blocks", None)
        if not isinstance(blocks, nn.ModuleList):
            raise ValueError(
                "prune_structured must come before strategies that wrap the model "
                "(compile, ddp, fsdp) in a combination"
            )
        before = sum(p.numel() for p in model.parameters())
        if ctx.family == "gpt":
            _prune_gpt(model, amount)
        else:
            kind = nn.Linear if ctx.family == "mlp" else nn.Conv2d
            layers: list[nn.Linear | nn.Conv2d] = [
                m for m in blocks.modules() if isinstance(m, kind)
            ]
            # The mlp and cnn families' head is a Linear (harness.workloads.mlp, .cnn).
            _prune_chain(layers, cast(nn.Linear, model.head), amount)
        ctx.notes["pruned_params"] = before - sum(p.numel() for p in model.parameters())
        return model
