"""``ddp:N`` and ``fsdp:N``: data-parallel training over N processes started by torchrun.

The launcher starts N ranks and the loop gives each its 1/N of every global batch (so the
effective batch is the spec's ``batch_size``); these strategies only wrap the model.

- DDP keeps a full replica of parameters, gradients and optimizer state on every rank and
  all-reduces gradients in backward.
- FSDP2 (``fully_shard``) shards parameters, gradients and optimizer state over the ranks and
  all-gathers one block's parameters at a time, so model state per rank falls to ~1/N plus one
  unsharded block in flight.
- ``fsdp_mixed`` adds FSDP2's ``MixedPrecisionPolicy``: the sharded fp32 parameters are
  all-gathered and computed in bf16 (half the all-gather buffers and traffic), gradients are
  reduce-scattered in fp32. ``fsdp_offload`` adds ``CPUOffloadPolicy``: the sharded parameters,
  their gradients and the optimizer state live in pinned host memory and the optimizer steps
  on the CPU; the device holds only what is all-gathered in flight (CUDA only).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from harness.strategies.base import Strategy, StrategyError, TrialContext
from harness.strategies.checkpoint import repeated_blocks
from harness.strategies.mesh import require_group, submesh


def _all_reduce_in_place(state, bucket):  # type: ignore[no-untyped-def]
    """DDP's comm hook for the estimator: each gradient bucket all-reduced in place on the
    (fake) group, synchronously; the bucket itself is the result. Unannotated: DDP compares
    a hook's annotations with its own types, which postponed annotations are not."""
    import torch.distributed as dist

    buffer = bucket.buffer()
    dist.all_reduce(buffer)
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(buffer)
    return future


class Ddp(Strategy):
    name = "ddp"

    def prepare_model(self, model: nn.Module, ctx: TrialContext) -> nn.Module:
        require_group("ddp")
        # With a pipeline, the replicas of one stage all-reduce among themselves; with context
        # ranks, the replicas and the context ranks together.
        others = ctx.layout.size("pp") > 1 or ctx.layout.size("cp") > 1
        group = submesh(ctx, "dp").get_group() if others else None
        parts = getattr(model, "parts", None)
        if isinstance(parts, nn.ModuleList):  # a pipeline: each stage a replica of its own
            for index, part in enumerate(parts):
                parts[index] = self.wrap(part, ctx, group)
            return model
        return self.wrap(model, ctx, group)

    def wrap(self, model: nn.Module, ctx: TrialContext, group: Any) -> nn.Module:
        from torch.nn.parallel import DistributedDataParallel

        # The start-up check that all replicas are equal reads parameter values, which the
        # estimator's fake tensors do not have; it allocates nothing that lasts.
        init_sync = not ctx.estimating
        device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
        wrapped = DistributedDataParallel(
            model,
            device_ids=device_ids,
            init_sync=init_sync,
            # Estimating: the reducer's bucket rebuild after the first step broadcasts and reads
            # bucket indices, which fake tensors cannot hold; finding unused parameters skips it.
            find_unused_parameters=ctx.estimating,
            process_group=group,
        )
        if ctx.estimating:
            # No peers: the bucket is "all-reduced" where it lies (in place, as the real
            # all-reduce is), so the gradient buckets cost what they cost in training; the
            # fake group's all-reduce moves nothing but is seen, so the step time prices it.
            wrapped.register_comm_hook(None, _all_reduce_in_place)
        return wrapped


class Fsdp(Strategy):
    name = "fsdp"

    def prepare_model(self, model: nn.Module, ctx: TrialContext) -> nn.Module:
        from torch.distributed.fsdp import fully_shard

        require_group("fsdp")
        mesh = submesh(ctx, "dp")  # with tp: the blocks' DTensor shards, sharded again
        parts = getattr(model, "parts", None)
        # A pipeline's stages are each a root: the schedule calls them, not their container.
        roots = list(parts) if isinstance(parts, nn.ModuleList) else [model]
        units = 0
        for root in roots:
            try:
                _, blocks = repeated_blocks(root)
            except StrategyError:
                blocks = []  # no repeated blocks: shard the model as one unit
            for block in blocks:
                fully_shard(block, mesh=mesh, **ctx.shard_options)
            fully_shard(root, mesh=mesh, **ctx.shard_options)
            units += len(blocks) + 1
        ctx.notes["fsdp_units"] = units
        return model


class FsdpMixed(Strategy):
    name = "fsdp_mixed"

    def shard_options(self, ctx: TrialContext) -> dict[str, Any]:
        from torch.distributed.fsdp import MixedPrecisionPolicy

        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        return {"mp_policy": policy}


class FsdpOffload(Strategy):
    name = "fsdp_offload"

    def shard_options(self, ctx: TrialContext) -> dict[str, Any]:
        from torch.distributed.fsdp import CPUOffloadPolicy

        return {"offload_policy": CPUOffloadPolicy(pin_memory=ctx.device.type == "cuda")}
