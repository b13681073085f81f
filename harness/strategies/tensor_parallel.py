"""``tp:N``: tensor parallelism, each block's projections split over N ranks (Megatron's layout).

In every repeated block, the projections that widen (attention's query/key/value, the MLP's
up/gate) are split column-wise: each rank computes its own heads and its own hidden units; the
projections that narrow (attention's output, the MLP's down) are split row-wise: each rank
multiplies its part and an all-reduce sums them. So the blocks' weights, gradients and optimizer
state are 1/N per rank, and so are the activations between the split projections; the inputs of
each block (and norms, embeddings, the output head) are whole on every rank. All of it is
``torch.distributed.tensor.parallel.parallelize_module`` with PyTorch's own ``ColwiseParallel``
and ``RowwiseParallel`` styles; what is ours is the plan (which modules, in which style) for the
model families it covers.

Covered: ``gpt`` (a fused ``qkv`` projection: its rows are reordered before the split so that
each rank's slice holds its own heads' queries, keys and values, ``_group_heads``) and
Hugging Face decoders with ``q_proj``/``k_proj``/``v_proj``/``o_proj`` attention and a
``gate_proj``/``up_proj``/``down_proj`` MLP (Llama, Qwen2, Qwen3, Mistral). Others are refused
in one line: a plan guessed from names could run and silently compute something else.

``tp:N:sp`` adds sequence parallelism (``SequenceParallel``): a block's norms and residual
additions work on 1/N of the sequence, gathered before the column-wise projections and
reduce-scattered after the row-wise ones, in place of the all-reduce.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from harness.strategies.base import Strategy, StrategyError, TrialContext
from harness.strategies.checkpoint import repeated_blocks
from harness.strategies.mesh import require_group, submesh

# Hugging Face decoder layers whose plan is known: their attention's and MLP's module names.
HF_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
HF_MLP = ("gate_proj", "up_proj", "down_proj")
HF_NORMS = ("input_layernorm", "post_attention_layernorm")
HF_COVERED = ("llama", "qwen2", "qwen3", "mistral")


def check_divisible(what: str, count: int, ranks: int) -> None:
    if count % ranks:
        raise StrategyError(f"tp:{ranks}: {what} ({count}) must be a multiple of {ranks}")


def _group_heads(linear: nn.Linear, ranks: int) -> None:
    """Reorder a fused ``[q; k; v]`` projection's rows so that row block r (what rank r keeps
    under a column-wise split) is ``[q_r; k_r; v_r]``, rank r's heads. Without it rank 0 would
    hold all of q and half of k: it would train, on the wrong numbers."""
    out_features, width = linear.weight.shape
    per_rank = out_features // 3 // ranks
    with torch.no_grad():
        weight = linear.weight.view(3, ranks, per_rank, width).transpose(0, 1)
        linear.weight.copy_(weight.reshape(out_features, width).clone())
        if linear.bias is not None:
            bias = linear.bias.view(3, ranks, per_rank).transpose(0, 1)
            linear.bias.copy_(bias.reshape(out_features).clone())


def split_block(
    plan: dict[str, Any],
    block: nn.Module,
    prefix: str,
    parts: list[tuple[str, tuple[str, ...], str, bool]],
    norms: tuple[str, ...],
    sequence: bool,
) -> None:
    """One block's entries of the plan. ``parts``: (attention or MLP, its widening projections,
    its narrowing one, whether the block passes it its input by keyword). With ``sequence``
    the residual stream inside the block is a DTensor sharded on the sequence (dimension 1):
    norms run on the local part, each part gathers the whole sequence before its widening
    projections and its narrowing one reduce-scatters back; the block's output is whole again
    (``_whole_again``): embeddings, final norm and head stay whole."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    if sequence:
        plan[prefix] = PrepareModuleInput(
            input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),), use_local_output=False
        )
        for norm in norms:
            plan[f"{prefix}.{norm}"] = SequenceParallel(use_local_output=False)
        block.register_forward_hook(_whole_again)
    for part, widen, narrow, by_keyword in parts:
        if sequence and by_keyword:
            plan[f"{prefix}.{part}"] = PrepareModuleInput(
                input_kwarg_layouts={"hidden_states": Shard(1)},
                desired_input_kwarg_layouts={"hidden_states": Replicate()},
            )
        elif sequence:
            plan[f"{prefix}.{part}"] = PrepareModuleInput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
            )
        for name in widen:
            plan[f"{prefix}.{part}.{name}"] = ColwiseParallel()
        plan[f"{prefix}.{part}.{narrow}"] = (
            RowwiseParallel(output_layouts=Shard(1), use_local_output=False)
            if sequence
            else RowwiseParallel()
        )


def _whole_again(module: nn.Module, args: Any, output: Any) -> Any:
    """A sequence-parallel block's output, gathered: the next block (or the final norm and
    head, which stay whole) takes the whole sequence."""
    from torch.distributed.tensor import DTensor, Replicate

    def whole(tensor: Any) -> Any:
        if isinstance(tensor, DTensor):
            return tensor.redistribute(tensor.device_mesh, (Replicate(),)).to_local()
        return tensor

    if isinstance(output, tuple):  # (hidden_states, ...) from older decoder layers
        return (whole(output[0]), *output[1:])
    return whole(output)


def gpt_plan(model: nn.Module, ranks: int, sequence: bool) -> dict[str, Any]:
    blocks = list(getattr(model, "blocks", []))
    if not blocks:
        raise StrategyError("tp: this gpt has no blocks to split")
    check_divisible("n_head", blocks[0].attn.n_head, ranks)
    check_divisible("the MLP's width", blocks[0].mlp.fc.out_features, ranks)
    plan: dict[str, Any] = {}
    parts = [("attn", ("qkv",), "proj", False), ("mlp", ("fc",), "proj", False)]
    for index, block in enumerate(blocks):
        _group_heads(block.attn.qkv, ranks)
        split_block(plan, block, f"blocks.{index}", parts, ("ln1", "ln2"), sequence)
    return plan


def hf_plan(model: nn.Module, ranks: int, sequence: bool) -> dict[str, Any]:
    config: Any = getattr(model, "config", None)
    model_type = getattr(config, "model_type", type(model).__name__)
    try:
        path, layers = repeated_blocks(model)
    except StrategyError:
        layers, path = [], ""
    names = {name for layer in layers[:1] for name, _ in layer.named_modules()}
    needed = [f"self_attn.{n}" for n in HF_ATTENTION] + [f"mlp.{n}" for n in HF_MLP]
    needed += list(HF_NORMS)
    if model_type not in HF_COVERED or not layers or not all(n in names for n in needed):
        raise StrategyError(
            f"tp: no tensor-parallel plan for {model_type!r} (covered: "
            f"{', '.join(HF_COVERED)} decoders; gpt)"
        )
    check_divisible("num_attention_heads", config.num_attention_heads, ranks)
    check_divisible("num_key_value_heads", config.num_key_value_heads, ranks)
    check_divisible("intermediate_size", config.intermediate_size, ranks)
    plan: dict[str, Any] = {}
    parts = [
        ("self_attn", HF_ATTENTION[:3], HF_ATTENTION[3], True),
        ("mlp", HF_MLP[:2], HF_MLP[2], False),
    ]
    for index, layer in enumerate(layers):
        split_block(plan, layer, f"{path}.{index}", parts, HF_NORMS, sequence)
    return plan


class TensorParallel(Strategy):
    name = "tp"

    def prepare_model(self, model: nn.Module, ctx: TrialContext) -> nn.Module:
        from torch.distributed.tensor.parallel import parallelize_module

        require_group("tp")
        ranks = ctx.layout.size("tp")
        sequence = (self.arg or "").partition(":")[2].strip() == "sp"
        parts = getattr(model, "parts", None)
        # A pipeline stage (pp:N applied first) is split as a whole model would be.
        stages: list[Any] = list(parts) if isinstance(parts, nn.ModuleList) else []
        targets: list[nn.Module] = [stage.model for stage in stages] or [model]
        planned = 0
        for target in targets:
            if ctx.family == "gpt":
                plan = gpt_plan(target, ranks, sequence)
            else:
                plan = hf_plan(target, ranks, sequence)
            parallelize_module(target, submesh(ctx, "tp"), plan)
            planned += len(plan)
        ctx.notes["tp_modules"] = planned
        return model
