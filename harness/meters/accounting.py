"""Tensor accounting: PyTorch's ``MemTracker``, loaded cheaply, and what the meters build on it.

``MemTracker`` (``torch.distributed._tools.mem_tracker``) sees every storage created while it is
active and files it by what holds it (parameter, gradient, optimizer state, activation, ...).
The memory window, the timeline and ``quantize_int8``'s inference peak all use it through this
module, and fold its reference types into the five categories of ``harness.metrics`` here,
once.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch


def _skip_tools_package_init() -> None:
    """Let ``torch.distributed._tools.mem_tracker`` load without its package's ``__init__``.

    That ``__init__`` imports every tool of the package, among them a runtime estimator that
    loads the inductor: ~1.7-2.5 s of every trial's start-up, for nothing a trial uses. The
    package is registered as a plain namespace for its submodules (torch's own code imports
    only submodules from it, never names from the package itself).
    """
    import importlib.util
    import sys

    import torch.distributed  # noqa: F401  (the parent must exist first)

    name = "torch.distributed._tools"
    if name not in sys.modules:
        spec = importlib.util.find_spec(name)
        if spec is not None:
            sys.modules[name] = importlib.util.module_from_spec(spec)


_skip_tools_package_init()

from torch.distributed._tools import mem_tracker  # noqa: E402
from torch.distributed._tools.common_utils import get_untyped_storages  # noqa: E402
from torch.distributed._tools.mem_tracker import (  # noqa: E402
    _TOTAL_KEY,
    MemTracker,
    _MemRefType,
)

CUDA_BLOCK = 512  # the CUDA caching allocator rounds every block up to this


class PeakTracker(MemTracker):
    """``MemTracker`` keeping only what the meters read: the running snapshot and the peak.

    After every op ``MemTracker`` also updates a peak per tracked module, walking every module
    it has seen; nothing here reads those, and on a 32-layer model that walk was 60 % of a
    tracked step (an 8B Llama's fake step: 18 s). Module hooks still run: they tell forward,
    backward and recomputation apart.
    """

    def _update_peak_stats(self, peak_state: Any) -> None:
        for dev, dev_snap in self._curr_mem_snap.items():
            if self._peak_mem.get(dev, 0) < dev_snap[_TOTAL_KEY]:
                self._peak_mem[dev] = dev_snap[_TOTAL_KEY]
                self._peak_mem_snap[dev] = dict(dev_snap)

    def _track_module_params_and_buffers(
        self, module: torch.nn.Module, install_grad_hooks: bool = True
    ) -> tuple[int, int]:
        """As ``MemTracker``'s, but gradient hooks only on parameters that get gradients:
        ``MemTracker`` hooks every parameter, and a frozen one (a LoRA base) refuses hooks."""
        memory = super()._track_module_params_and_buffers(module, install_grad_hooks=False)
        if install_grad_hooks:
            for param in module.parameters():
                if param.requires_grad and param not in self._param_to_grad_hook_handles:
                    self._param_to_grad_hook_handles[param] = (
                        param.register_hook(self._track_gradient),
                        param.register_post_accumulate_grad_hook(
                            lambda p: self._track_gradient(p.grad)
                        ),
                    )
        return memory

    def _track_gradient(self, grad: torch.Tensor) -> None:
        self._update_and_maybe_create_winfos(grad, _MemRefType.GRAD)


_round_every_device = False  # set by cuda_accounting()


def allocated_bytes(size: int, device: torch.device) -> int:
    """What a storage of ``size`` bytes takes on ``device`` (CUDA rounds up to its block)."""
    if device.type == "cuda" or _round_every_device:
        return -(-size // CUDA_BLOCK) * CUDA_BLOCK
    return size


@contextlib.contextmanager
def cuda_accounting() -> Iterator[None]:
    """Count every storage as CUDA's caching allocator would (512-byte blocks), whatever its
    device: a CUDA trial predicted where there is no GPU runs CPU kernels but must be accounted
    as CUDA. ``MemTracker`` decides the rounding per storage by device type in a private
    helper, which is why that one method is swapped for the duration."""
    global _round_every_device
    info = mem_tracker._WeakRefInfo
    original = info._calculate_mem_consumed

    def rounded(self: Any) -> int:
        return allocated_bytes(self.size * self.element_size, torch.device("cuda"))

    info._calculate_mem_consumed = rounded
    _round_every_device = True
    try:
        yield
    finally:
        info._calculate_mem_consumed = original
        _round_every_device = False


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes held by these tensors' storages on this rank, each storage once."""
    seen: dict[int, int] = {}
    for value in tensors:
        if hasattr(value, "to_local"):  # a sharded DTensor (FSDP): this rank's shard
            value = value.to_local()
        # Tensor subclasses (torchao's 8-bit state) keep their bytes in inner tensors.
        for storage in get_untyped_storages(value):
            key = storage._cdata  # the StorageImpl: one per storage, fake ones too
            seen[key] = allocated_bytes(storage.nbytes(), value.device)
    return sum(seen.values())


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the optimizer's persistent state (moments, step counters)."""
    return storage_bytes(
        value
        for state in optimizer.state.values()
        for value in state.values()
        if isinstance(value, torch.Tensor)
    )


def fold(by_type: Mapping[Any, int], persistent_optim: int) -> dict[str, int]:
    """One device's ``MemTracker`` snapshot as the five categories of the breakdown.

    ``MemTracker`` files the optimizer step's temporaries under optimizer state while
    ``step()`` runs; only ``persistent_optim`` bytes (the state that outlives the step) stay
    there, the rest goes to *other* with buffers and backward temporaries.
    """
    optim_total = by_type.get(_MemRefType.OPT, 0)
    optim = min(persistent_optim, optim_total)
    return {
        "param": by_type.get(_MemRefType.PARAM, 0),
        "grad": by_type.get(_MemRefType.GRAD, 0),
        "optim": optim,
        "activation": by_type.get(_MemRefType.ACT, 0),
        "other": by_type.get(_MemRefType.BUFFER, 0)
        + by_type.get(_MemRefType.TEMP, 0)
        + by_type.get(_MemRefType.OTH, 0)
        + optim_total
        - optim,
    }


def on_device(snapshot: Mapping[Any, Mapping[Any, int]], device: torch.device) -> Mapping[Any, int]:
    """The part of a ``MemTracker`` snapshot (keyed by device) for ``device``'s type."""
    return next((s for dev, s in snapshot.items() if torch.device(dev).type == device.type), {})


def peak_forward_bytes(
    model: torch.nn.Module, batch: dict[str, torch.Tensor], forward: Callable[[], Any]
) -> int:
    """Peak live tensor bytes on the CPU over one no-grad ``forward()`` of ``model`` on
    ``batch``, model and batch included (what an inference batch costs)."""
    tracker = PeakTracker()
    tracker.track_external(model, *batch.values())
    with tracker, torch.no_grad():
        forward()
    cpu = torch.device("cpu")
    return int(on_device(tracker.get_tracker_snapshot("peak"), cpu).get("Total", 0))
