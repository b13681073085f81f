"""Tensor accounting: PyTorch's ``MemTracker``, loaded cheaply, and what the meters build on it.

``MemTracker`` (``torch.distributed._tools.mem_tracker``) sees every storage created while it is
active and files it by what holds it (parameter, gradient, optimizer state, activation, ...).
The memory window, the timeline and ``quantize_int8``'s inference peak all use it through this
module, and fold its reference types into the five categories of ``harness.metrics`` here,
once.
"""

from __future__ import annotations

import contextlib
import functools
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

from torch._guards import active_fake_mode  # noqa: E402
from torch.distributed._tools import mem_tracker  # noqa: E402
from torch.distributed._tools.common_utils import get_untyped_storages  # noqa: E402
from torch.distributed._tools.mem_tracker import (  # noqa: E402
    _TOTAL_KEY,
    MemTracker,
    _MemRefType,
    _ModState,
)
from torch.distributed.tensor import DTensor  # noqa: E402
from torch.utils._pytree import tree_map_only  # noqa: E402

CUDA_BLOCK = 512  # the CUDA caching allocator rounds every block up to this


class PeakTracker(MemTracker):
    """``MemTracker`` keeping only what the meters read: the running snapshot and the peak.

    After every op ``MemTracker`` also updates a peak per tracked module, walking every module
    it has seen; nothing here reads those, and on a 32-layer model that walk was 60 % of a
    tracked step (an 8B Llama's fake step: 18 s). Module hooks still run: they tell forward,
    backward and recomputation apart.
    """

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        """``MemTracker``'s, minus its per-op costs that buy nothing here: a pytree walk over
        every op's outputs (most ops return one tensor or a flat tuple of them) and a second
        look at the mode stack. Same decisions: DTensor ops left to DTensor, a fake
        ``wait_tensor`` returning its input, ops of a nested fake mode (DTensor's sharding
        propagation) not tracked, the reference type by phase. A tracked step: -20 %."""
        if DTensor in types:
            return NotImplemented
        fake_mode = active_fake_mode()
        if func is torch.ops._c10d_functional.wait_tensor.default and fake_mode:
            result = args[0]  # the meta kernel would return a new tensor; eager does not
        else:
            result = func(*args, **(kwargs or {}))
        if fake_mode is not self._fake_mode_on_entry:
            return result
        if self._in_opt:
            reftype = _MemRefType.OPT
        elif self._mod_tracker.is_bw and not self._in_ac:
            reftype = _MemRefType.TEMP
        else:
            reftype = _MemRefType.ACT
        track = functools.partial(self._track, reftype)
        if isinstance(result, torch.Tensor):
            track(result)
        elif isinstance(result, (tuple, list)):
            for item in result:
                if isinstance(item, torch.Tensor):
                    track(item)
                elif isinstance(item, (tuple, list, dict)):
                    tree_map_only(torch.Tensor, track, item)
        elif isinstance(result, dict):
            tree_map_only(torch.Tensor, track, result)
        self._update_peak_stats(_ModState.PEAK_BW if self._mod_tracker.is_bw else _ModState.PEAK_FW)
        return result

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


class TotalsTracker(PeakTracker):
    """``PeakTracker`` that also keeps the running total on one device type at entry and after
    every op that allocated: the moments its peak is the largest of.

    Why: each moment's total is a sum of tensor sizes, and those grow affinely with the batch
    (quadratically at most with a sequence length), so two or three such traces of the same
    step at different sizes give every moment's curve, and their maximum is the peak at any
    size (``harness.trial.fit``). Only moments after an allocation are kept (a total grows
    only there, so the peak is among them): ops that allocate nothing (views, device queries)
    come and go between steps (the first step after a warm-up runs a few more than the next),
    and would misalign the moments.
    """

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device_type = device.type
        self.totals: list[int] = []
        self._allocated = False  # since the last kept moment

    def __enter__(self) -> TotalsTracker:
        super().__enter__()
        self.totals.append(self._total())
        return self

    def _update_snap(self, u_type: Any, winfo: Any, *args: Any, **kwargs: Any) -> None:
        before = self._total()
        super()._update_snap(u_type, winfo, *args, **kwargs)
        if self._total() > before:  # a new storage, or one resized larger (FSDP's all-gather)
            self._allocated = True

    def _update_peak_stats(self, peak_state: Any) -> None:  # after every op
        super()._update_peak_stats(peak_state)
        if self._allocated:
            self.totals.append(self._total())
            self._allocated = False

    def _total(self) -> int:
        for dev, dev_snap in self._curr_mem_snap.items():
            if dev.type == self.device_type:
                return dev_snap[_TOTAL_KEY]
        return 0


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
