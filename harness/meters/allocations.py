"""Every storage a prediction creates and frees on the target device, in order.

Tensor accounting gives the live total at each moment; a caching allocator's reservation
depends on more than that: the *order* of requests and frees and their sizes decide which
cached blocks are reused, split or left stranded. ``AllocationLog`` records that order for the
CUDA caching-allocator model (``harness.cuda.device_memory``): a dispatch mode that sees each
op's outputs and files every new storage as an allocation, and a weak reference per storage
that files its free the moment the last tensor using it dies (as the allocator gets it back).
Storages resized in place (FSDP2's unsharded parameters) count as a free and a new
allocation, which is what ``resize_`` does on CUDA.

``register`` files tensors that exist before the log starts (the model's parameters and
buffers as ``.to("cuda")`` would allocate them, in module order). ``on_op`` lets the caller add
allocations a kernel makes outside any output (cuBLAS workspaces). Events are
``(allocation id, bytes)`` for an allocation, ``(allocation id, FREE)`` for its free and
``(-1, EMPTY_CACHE)`` where the cache is emptied.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch

from harness.compat.internals import TorchDispatchMode, active_fake_mode, tree_leaves
from harness.meters.accounting import get_untyped_storages

FREE = -1
EMPTY_CACHE = -2  # the size of an event that is torch.cuda.empty_cache(), not an allocation
Event = tuple[int, int]


class AllocationLog(TorchDispatchMode):
    """The allocation and free events of storages on ``device_type``, in order."""

    def __init__(
        self, device_type: str, on_op: Callable[[Any], Iterable[int]] | None = None
    ) -> None:
        super().__init__()
        self.device_type = device_type
        self.on_op = on_op
        self.events: list[Event] = []
        self.untracked: list[int] = []  # ids of the allocations no tensor shows, in order
        self.live: dict[int, tuple[int, int]] = {}  # storage key -> (allocation id, bytes)
        self._ids = itertools.count()
        self._refs: dict[int, weakref.ref[Any]] = {}
        self._fake_mode_on_entry: Any = None
        self._original_resize: Any = None

    def __enter__(self) -> AllocationLog:
        self._fake_mode_on_entry = active_fake_mode()
        self._original_resize = torch.UntypedStorage.resize_
        log = self

        def resize_(self: torch.UntypedStorage, size: int) -> Any:  # the method it replaces
            result = log._original_resize(self, size)
            log._resized(self)
            return result

        torch.UntypedStorage.resize_ = resize_  # not a dispatched op: watched here
        super().__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        torch.UntypedStorage.resize_ = self._original_resize

    def register(self, tensors: Iterable[torch.Tensor]) -> None:
        """File tensors made before the log started, in the order given."""
        for tensor in tensors:
            self._saw(tensor)

    def empty_cache(self) -> None:
        """``torch.cuda.empty_cache()`` at this point (the trial calls it after building)."""
        self.events.append((-1, EMPTY_CACHE))

    def allocate(self, nbytes: int) -> None:
        """An allocation no tensor shows (a library workspace), never freed."""
        ident = next(self._ids)
        self.untracked.append(ident)
        self.events.append((ident, nbytes))

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if self.on_op is not None and active_fake_mode() is self._fake_mode_on_entry:
            for nbytes in self.on_op(func):
                self.allocate(nbytes)
        result = func(*args, **(kwargs or {}))
        if active_fake_mode() is not self._fake_mode_on_entry:
            return result  # a nested fake mode's op (DTensor's sharding propagation)
        if isinstance(result, torch.Tensor):
            self._saw(result)
        else:
            for item in tree_leaves(result):
                if isinstance(item, torch.Tensor):
                    self._saw(item)
        return result

    def _saw(self, tensor: torch.Tensor) -> None:
        if tensor.device.type != self.device_type:
            return
        for storage in get_untyped_storages(tensor):
            key = storage._cdata
            if key in self.live:
                continue
            nbytes = storage.nbytes()
            if nbytes == 0:  # the allocator hands out no block for an empty storage
                continue
            ident = next(self._ids)
            self.live[key] = (ident, nbytes)
            self.events.append((ident, nbytes))
            self._refs[key] = weakref.ref(storage, self._finalizer(key))

    def _finalizer(self, key: int) -> Callable[[Any], None]:
        def freed(_: Any) -> None:
            found = self.live.pop(key, None)
            self._refs.pop(key, None)
            if found is not None:
                self.events.append((found[0], FREE))

        return freed

    def _resized(self, storage: torch.UntypedStorage) -> None:
        key = storage._cdata
        found = self.live.get(key)
        nbytes = storage.nbytes()
        if found is not None and found[1] == nbytes:
            return
        if found is not None:
            del self.live[key]
            self.events.append((found[0], FREE))
        if nbytes > 0:
            ident = next(self._ids)
            self.live[key] = (ident, nbytes)
            self.events.append((ident, nbytes))
            if key not in self._refs:
                self._refs[key] = weakref.ref(storage, self._finalizer(key))

    def live_ids(self) -> list[int]:
        """Allocation ids alive now, oldest first."""
        return sorted(ident for ident, _ in self.live.values())


def repeated_step(events: list[Event], start: int) -> list[Event] | None:
    """The step filed from ``events[start:]`` filed once more, as the next step would file it
    when every step of a window runs the same ops on the same state (what a prediction's window
    relies on): each allocation of the step made again under a new id, each free of one of the
    step's own allocations freeing its new copy, and each free of something made before the
    step (the last step's gradients, its loss) freeing what this step made in its place.

    The step's survivors stand in for what it freed of earlier steps, matched in allocation
    order and size (a survivor that matches none outlives the next step too, as a tensor kept
    alive by a reference cycle does); None when they cannot be matched (the step changed the
    state: a first step that creates the optimizer's state or a library's workspace), so the
    caller runs the next step instead of assuming it."""
    step = events[start:]
    alive: dict[int, int] = {}
    for ident, size in events[:start]:
        if size >= 0:
            alive[ident] = size
        elif size == FREE:
            alive.pop(ident, None)
    made = {ident: size for ident, size in step if size >= 0}
    freed = {ident for ident, size in step if size == FREE}
    earlier = sorted(ident for ident in freed if ident not in made)
    survivors = iter(sorted(ident for ident in made if ident not in freed))
    successors: dict[int, int] = {}
    for old in earlier:  # the first survivor of its size after the last one matched
        new = next((ident for ident in survivors if made[ident] == alive.get(old)), None)
        if new is None:
            return None
        successors[old] = new
    first = max((ident for ident, _ in events), default=-1) + 1
    renamed = {ident: first + index for index, ident in enumerate(made)}
    renamed.update(successors)
    return [(ident if size == EMPTY_CACHE else renamed[ident], size) for ident, size in step]
