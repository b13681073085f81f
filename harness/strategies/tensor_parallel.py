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
reduce-scattered after the row-wise ones, in place of the all-reduce (gpt only).
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


def gpt_plan(model: nn.Module, ranks: int, sequence: bool) -> dict[str, Any]:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    blocks = list(getattr(model, "blocks", []))
    if not blocks:
        raise StrategyError("tp: this gpt has no blocks to split")
    attention = blocks[0].attn
    check_divisible("n_head", attention.n_head, ranks)
    check_divisible("the MLP's width", blocks[0].mlp.fc.out_features, ranks)
    plan: dict[str, Any] = {}
    for index, block in enumerate(blocks):
        _group_heads(block.attn.qkv, ranks)
        prefix = f"blocks.{index}"
        if not sequence:
            plan[f"{prefix}.attn.qkv"] = ColwiseParallel()
            plan[f"{prefix}.attn.proj"] = RowwiseParallel()
            plan[f"{prefix}.mlp.fc"] = ColwiseParallel()
            plan[f"{prefix}.mlp.proj"] = RowwiseParallel()
            continue
        # Sequence parallel: the residual stream stays a DTensor sharded on the sequence
        # (dimension 1) inside the block; whole again at the block's output.
        plan[prefix] = PrepareModuleInput(
            input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),), use_local_output=False
        )
        plan[f"{prefix}.ln1"] = SequenceParallel(use_local_output=False)
        plan[f"{prefix}.ln2"] = SequenceParallel(use_local_output=False)
        for part, widen, narrow in (("attn", "qkv", "proj"), ("mlp", "fc", "proj")):
            plan[f"{prefix}.{part}"] = PrepareModuleInput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
            )
            plan[f"{prefix}.{part}.{widen}"] = ColwiseParallel()
            plan[f"{prefix}.{part}.{narrow}"] = RowwiseParallel(
                output_layouts=Shard(1), use_local_output=False
            )
        block.register_forward_hook(_whole_again)
    return plan


def _whole_again(module: nn.Module, args: Any, output: Any) -> Any:
    """A sequence-parallel block's output, gathered: the next block (or the final norm and
    head, which stay whole) takes the whole sequence."""
    from torch.distributed.tensor import DTensor, Replicate

    if isinstance(output, DTensor):
        return output.redistribute(output.device_mesh, (Replicate(),)).to_local()
    return output


def hf_plan(model: nn.Module, ranks: int) -> dict[str, Any]:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    config: Any = getattr(model, "config", None)
    model_type = getattr(config, "model_type", type(model).__name__)
    try:
        path, layers = repeated_blocks(model)
    except StrategyError:
        layers, path = [], ""
    names = {name for layer in layers[:1] for name, _ in layer.named_modules()}
    needed = [f"self_attn.{n}" for n in HF_ATTENTION] + [f"mlp.{n}" for n in HF_MLP]
    if model_type not in HF_COVERED or not layers or not all(n in names for n in needed):
        raise StrategyError(
            f"tp: no tensor-parallel plan for {model_type!r} (covered: "
            f"{', '.join(HF_COVERED)} decoders; gpt)"
        )
    check_divisible("num_attention_heads", config.num_attention_heads, ranks)
    check_divisible("num_key_value_heads", config.num_key_value_heads, ranks)
    check_divisible("intermediate_size", config.intermediate_size, ranks)
    plan: dict[str, Any] = {}
    for index in range(len(layers)):
        prefix = f"{path}.{index}"
        for name in ("q_proj", "k_proj", "v_proj"):
            plan[f"{prefix}.self_attn.{name}"] = ColwiseParallel()
        plan[f"{prefix}.self_attn.o_proj"] = RowwiseParallel()
        plan[f"{prefix}.mlp.gate_proj"] = ColwiseParallel()
        plan[f"{prefix}.mlp.up_proj"] = ColwiseParallel()
        plan[f"{prefix}.mlp.down_proj"] = RowwiseParallel()
    return plan


class TensorParallel(Strategy):
    name = "tp"

    def prepare_model(self, model: nn.Module, ctx: TrialContext) -> nn.Module:
        from torch.distributed.tensor.parallel import parallelize_module

        require_group("tp")
        ranks = ctx.layout.size("tp")
        sequence = (self.arg or "").partition(":")[2].strip() == "sp"
        if sequence and ctx.family != "gpt":
            raise StrategyError("tp:N:sp: sequence parallelism is planned for gpt only; use tp:N")
        parts = getattr(model, "parts", None)
        # A pipeline stage (pp:N applied first) is split as a whole model would be.
        targets = [part.model for part in parts] if isinstance(parts, nn.ModuleList) else [model]
        planned = 0
        for target in targets:
            if ctx.family == "gpt":
                plan = gpt_plan(target, ranks, sequence)
            else:
                plan = hf_plan(target, ranks)
            parallelize_module(target, submesh(ctx, "tp"), plan)
            planned += len(plan)
        ctx.notes["tp_modules"] = planned
        return model
