"""A multi-rank trial (``ddp:N``, ``fsdp:N``): torchrun starts N copies of the trial worker.

Each rank trains on its 1/N slice of every global batch and measures its own memory and speed;
the figures are then combined so the trial reports one result: peak memory is the worst rank's
(with that rank's breakdown), throughput is the sum over ranks, step times the slowest rank's.
Rank 0 writes the result. With one process every helper here is the identity.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Ranks:
    rank: int = 0
    size: int = 1
    local_rank: int = 0

    @classmethod
    def from_env(cls) -> Ranks:
        """torchrun sets RANK / WORLD_SIZE / LOCAL_RANK; a plain process is rank 0 of 1."""
        return cls(
            int(os.environ.get("RANK", 0)),
            int(os.environ.get("WORLD_SIZE", 1)),
            int(os.environ.get("LOCAL_RANK", 0)),
        )

    @property
    def distributed(self) -> bool:
        return self.size > 1

    @property
    def is_writer(self) -> bool:
        return self.rank == 0

    def local_device(self, device: torch.device) -> torch.device:
        """This rank's device (``cuda:LOCAL_RANK`` under torchrun), made the current CUDA
        device before anything touches CUDA: the in-trial prediction runs before the process
        group starts, and without this every rank would create a context on GPU 0."""
        if device.type != "cuda":
            return device
        if self.distributed:
            device = torch.device("cuda", self.local_rank)
        if device.index is not None:  # plain "cuda" is the current device already
            torch.cuda.set_device(device)
        return device

    def start(self, device: torch.device) -> torch.device:
        """Join the process group (gloo on CPU, nccl on CUDA); return this rank's device."""
        if not self.distributed:
            return device
        device = self.local_device(device)
        if not dist.is_initialized():
            dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
        return device

    def stop(self) -> None:
        if self.distributed and dist.is_initialized():
            dist.destroy_process_group()

    def shard(self, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a global batch."""
        if not self.distributed:
            return tensor
        return tensor.chunk(self.size)[self.rank]

    def gather(self, value: Any) -> list[Any]:
        """Every rank's value; just this rank's before the group starts (a trial predicted
        infeasible ends before joining it, every rank alike)."""
        if not self.distributed or not dist.is_initialized():
            return [value]
        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, value)
        return out

    def mean(self, value: float) -> float:
        """The same number on every rank (so every rank takes the same decisions)."""
        values = self.gather(value)
        return sum(values) / len(values)

    def worst_memory(self, metrics: dict[str, float]) -> dict[str, float]:
        """The memory reading of the rank with the highest peak."""
        readings = self.gather(metrics)
        return max(readings, key=lambda m: m["peak_allocated_bytes"])

    def combined_speed(self, metrics: dict[str, float]) -> dict[str, float]:
        """Throughput adds up over ranks; a step is as slow as the slowest rank."""
        readings = self.gather(metrics)
        combined = {k: max(m[k] for m in readings) for k in metrics}
        combined["throughput"] = sum(m["throughput"] for m in readings)
        return combined

    def maximum(self, value: float) -> float:
        return max(self.gather(value))
