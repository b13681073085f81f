"""What the card holds: a prediction's allocation order replayed through the caching allocator,
plus what lives outside it.

Three figures, each the one its layer runs out on:

- **allocated**: bytes held by tensors (and library workspaces) at the worst moment;
- **reserved**: the caching allocator's segments at their peak (``harness.cuda.allocator``
  replaying the order of requests and frees the prediction made, ``AllocationLog``), which is
  what ``set_per_process_memory_fraction`` and a card's cudaMalloc limit apply to;
- **device**: reserved + the CUDA context + NCCL's buffers (multi-rank trials), what
  nvidia-smi shows and what must fit in the card's memory.

The allocator is replayed with a cap when the unbounded replay does not fit the budget: the real
allocator frees its cached blocks and retries before it gives up, so a run that fits only
thanks to that is still judged to fit.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from harness.cuda.allocator import AllocatorConfig, CachingAllocator, OutOfMemory
from harness.cuda.cards import MIB, Card

FREE = -1  # AllocationLog's markers: a free, and torch.cuda.empty_cache()
EMPTY_CACHE = -2

# NCCL's buffers for one communicator, per rank: an estimate. NCCL allocates them outside
# PyTorch's allocator: per channel and peer connection a Simple (4 MiB, NCCL_BUFFSIZE), LL
# (512 KiB) and LL128 (~4.7 MiB) buffer, ~9.2 MiB (NCCL source: src/include/comm.h,
# DEFAULT_*_BUFFSIZE); channels grow with the interconnect. Published per-GPU figures: 544-688 MB
# on 4 x A100 NVLink (NVIDIA/nccl issue #964); NVLS (NVSwitch systems, NCCL >= 2.17) reserves
# ~1 GiB more (NVIDIA/nccl-tests issue #216) unless NCCL_NVLS_ENABLE=0.
NCCL_PCIE = 300 * MIB
NCCL_NVLINK = 700 * MIB
NCCL_NVSWITCH = 1024 * MIB


def nccl_bytes(card: Card, world_size: int, communicator: bool = False) -> int:
    """NCCL's device buffers per rank for a trial of ``world_size`` ranks: 0 for one rank
    without a process group; a process group of one (``ddp:1``, ``fsdp:1``) still makes a
    communicator, and NCCL loads its kernels and buffers for it (558 MiB outside the allocator
    on the H200 run's ``fsdp:1``): charged as any communicator on that link, an estimate on
    the safe side (1 GiB there)."""
    if world_size <= 1 and not communicator:
        return 0
    link = card.interconnect.lower()
    if "nvlink 4" in link or "nvlink 5" in link:
        return NCCL_NVSWITCH
    if "nvlink" in link or "infinity fabric" in link:
        return NCCL_NVLINK
    return NCCL_PCIE


@dataclass(frozen=True)
class DeviceMemory:
    """One prediction's three figures on a card (bytes)."""

    allocated: int
    reserved: int
    context: int
    nccl: int
    fragmentation: int  # peak reserved - peak allocated: what the cache holds beyond tensors
    alloc_retries: int  # times the replayed allocator freed its cache and retried
    fits: bool | None  # within the budget; None: no budget

    @property
    def device(self) -> int:
        return self.reserved + self.context + self.nccl

    def metrics(self) -> dict[str, float]:
        return {
            "predicted_reserved_bytes": float(self.reserved),
            "predicted_device_bytes": float(self.device),
            "predicted_context_bytes": float(self.context),
            "predicted_nccl_bytes": float(self.nccl),
            "predicted_fragmentation_bytes": float(self.fragmentation),
        }


def replay(
    history: Iterable[tuple[int, int]],
    window: Sequence[tuple[int, int]],
    config: AllocatorConfig,
    capacity: int | None = None,
) -> CachingAllocator:
    """The allocator after ``history`` (what ran before the measured window) then ``window``,
    its peaks reset between them as ``reset_peak_memory_stats`` does; ``OutOfMemory`` when a
    request cannot be met within ``capacity``."""
    allocator = CachingAllocator(config, capacity=capacity)
    addresses: dict[int, int] = {}

    def run(events: Iterable[tuple[int, int]]) -> None:
        for ident, size in events:
            if size == EMPTY_CACHE:
                allocator.empty_cache()
            elif size == FREE:
                address = addresses.pop(ident, None)
                if address is not None:
                    allocator.free(address)
            else:
                addresses[ident] = allocator.malloc(size)

    run(history)
    allocator.reset_peak()
    run(window)
    return allocator


@dataclass(frozen=True)
class Replayable:
    """A predicted step as the card's allocator would see it: ``history`` (what ran before the
    measured window), the ``window``, the allocator ``config``, the ``card`` and the ranks
    (``world_size``). Kept whole so a fit search can judge it against other budgets later
    (``harness.trial.estimate.REPLAY``) without predicting it again."""

    history: Sequence[tuple[int, int]]
    window: Sequence[tuple[int, int]]
    config: AllocatorConfig
    card: Card
    world_size: int
    communicator: bool = False  # a process group (NCCL on a card), even of one rank

    def device_memory(self, budget: int | None) -> DeviceMemory:
        """Reserved and device bytes of the replayed step, judged against ``budget`` (bytes
        the device may use in all: the card's memory or a smaller ``device_memory``)."""
        unbounded = self._figures(replay(self.history, self.window, self.config), budget)
        # Over the budget (fits is False only where there is one): the real allocator frees its
        # cache and retries before an OOM.
        if budget is not None and unbounded.fits is False:
            return self.capped(budget) or unbounded
        return unbounded

    def capped(self, budget: int) -> DeviceMemory | None:
        """The step replayed with cudaMalloc capped at what ``budget`` leaves beside the context
        and NCCL: freeing the cache and retrying where it runs out; None when even so it does
        not fit (an OOM on the card)."""
        room = (
            budget - self.card.context - nccl_bytes(self.card, self.world_size, self.communicator)
        )
        if room <= 0:
            return None
        try:
            allocator = replay(self.history, self.window, self.config, capacity=room)
        except OutOfMemory:
            return None
        return self._figures(allocator, budget)

    def _figures(self, allocator: CachingAllocator, budget: int | None) -> DeviceMemory:
        context, nccl = self.card.context, nccl_bytes(self.card, self.world_size, self.communicator)
        reserved = allocator.peak_reserved_bytes
        return DeviceMemory(
            allocated=allocator.peak_allocated_bytes,
            reserved=reserved,
            context=context,
            nccl=nccl,
            fragmentation=reserved - allocator.peak_allocated_bytes,
            alloc_retries=allocator.num_alloc_retries,
            fits=None if budget is None else reserved + context + nccl <= budget,
        )
