"""The trial's device mesh: one per trial, shared by every parallel strategy.

``[fsdp:2, tp:2]`` runs on 4 ranks arranged 2 x 2 (``combination.Layout``): tensor parallelism
splits each block over the ``tp`` dimension, FSDP shards the result over ``dp``. Each strategy
takes its own dimension of the one mesh, so their process groups line up.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from harness.compat.internals import disable_current_modes, flatten_mesh
from harness.strategies.base import TrialContext


def require_group(name: str) -> None:
    if not dist.is_initialized():
        raise RuntimeError(f"{name} needs the trial to run under torchrun (the launcher does this)")


def real_tensors() -> Any:
    """A mesh is a small table of rank numbers searched by value: it must stay a real tensor
    when the estimator builds or slices it on fake ones."""
    return disable_current_modes()


def device_mesh(ctx: TrialContext) -> DeviceMesh:
    """The trial's mesh (built on first use), named by ``MESH_DIMS``; a mesh of one dimension
    (``dp``) where the layout names none (a process group started outside a sweep)."""
    if ctx.mesh is None:
        sizes = ctx.layout.sizes or (("dp", dist.get_world_size()),)
        with real_tensors():
            ctx.mesh = init_device_mesh(
                ctx.device.type,
                tuple(size for _, size in sizes),
                mesh_dim_names=tuple(dim for dim, _ in sizes),
            )
    mesh: Any = ctx.mesh
    return mesh


def submesh(ctx: TrialContext, dim: str) -> DeviceMesh:
    """One dimension of the trial's mesh (``pp``, ``dp``, ``cp``, ``tp``); ``dp`` with ``cp``:
    the two flattened into one."""
    mesh = device_mesh(ctx)
    if mesh.mesh_dim_names is not None and len(mesh.mesh_dim_names) == 1:
        return mesh
    with real_tensors():
        if dim == "dp" and "cp" in ctx.layout.names and "dp" in ctx.layout.names:
            # Parameters are whole over the context ranks too: FSDP shards, and DDP averages
            # gradients, over both dimensions as one.
            if "dp_cp" not in ctx.submeshes:
                ctx.submeshes["dp_cp"] = flatten_mesh(mesh["dp", "cp"], "dp_cp")
            return ctx.submeshes["dp_cp"]
        return mesh[dim]
