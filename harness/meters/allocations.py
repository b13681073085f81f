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

With ``blocks`` (``BlockTags``) set, every event is also tagged with the model block it belongs
to (``tags``, beside ``events``): a free outside every block under its allocation's, an output
of the optimizer's step under the block of the input it stands for (``inherited``), so a
shallow model's log can be extended to its full depth (``harness.meters.block_repeat``).
"""

from __future__ import annotations

import contextlib
import itertools
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch.nn.modules import module as nn_module

from harness.compat.internals import TorchDispatchMode, active_fake_mode, tree_leaves
from harness.meters.accounting import get_untyped_storages
from harness.meters.block_repeat import OUTSIDE
from harness.meters.block_tags import BlockTags

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
        self.tags: list[int] = []  # each event's block (OUTSIDE without ``blocks``)
        self.blocks: BlockTags | None = None
        self.tag_of: dict[int, int] = {}  # allocation id -> its tag
        self.registered: dict[int, int] = {}  # allocation id -> id() of the module it went to
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
        blocks = self.blocks.parameter_blocks if self.blocks is not None else {}
        for tensor in tensors:
            self._saw(tensor, blocks.get(id(tensor), OUTSIDE))

    @contextlib.contextmanager
    def watching_registrations(self) -> Iterator[None]:
        """Note which module each new parameter or buffer is registered to while a model is
        built (the global registration hooks of ``torch.nn``), so ``tag_what_was_built`` can
        tell a block's tensors even where they are replaced later (a LoRA base cast to bf16)."""

        def registered(module: torch.nn.Module, _name: str, tensor: Any) -> None:
            if isinstance(tensor, torch.Tensor) and tensor.device.type == self.device_type:
                for storage in get_untyped_storages(tensor):
                    found = self.live.get(storage._cdata)
                    if found is not None:
                        self.registered.setdefault(found[0], id(module))

        with contextlib.ExitStack() as stack:
            stack.callback(nn_module.register_module_parameter_registration_hook(registered).remove)
            stack.callback(nn_module.register_module_buffer_registration_hook(registered).remove)
            yield

    def tag_what_was_built(self) -> None:
        """Tag the events filed before ``blocks`` was set (the model's construction): a tensor
        registered to a module of a block, or alive in one now, under its block; every other
        event under the block whose tensor was made last before it (its construction's
        temporaries, the tensors its tensors replaced)."""
        assert self.blocks is not None
        block_of_module: dict[int, int] = {}
        owner: dict[int, int] = {}  # allocation id -> block
        for index, block in enumerate(self.blocks.blocks):
            for module in block.modules():
                block_of_module[id(module)] = index
            for tensor in [*block.parameters(), *block.buffers()]:
                for storage in get_untyped_storages(tensor):
                    found = self.live.get(storage._cdata)
                    if found is not None:
                        owner[found[0]] = index
        for ident, module in self.registered.items():
            if module in block_of_module:
                owner.setdefault(ident, block_of_module[module])
        building = OUTSIDE
        made_at: dict[int, int] = {}
        for at, (ident, size) in enumerate(self.events):
            if size >= 0:
                building = owner.get(ident, building)
                self.tag_of[ident] = building
                made_at[ident] = at
            elif size == FREE and building != OUTSIDE and self.tag_of.get(ident) == OUTSIDE:
                # made before any block's tensor, replaced while its block was built: the
                # block's own (a weight made for real, then cast)
                self.tag_of[ident] = building
                self.tags[made_at[ident]] = building
            self.tags[at] = building if size != EMPTY_CACHE else OUTSIDE

    def empty_cache(self) -> None:
        """``torch.cuda.empty_cache()`` at this point (the trial calls it after building)."""
        self._file(-1, EMPTY_CACHE, OUTSIDE)

    def allocate(self, nbytes: int) -> None:
        """An allocation no tensor shows (a library workspace), never freed."""
        ident = next(self._ids)
        self.untracked.append(ident)
        self._file(ident, nbytes, self._now())

    def _now(self) -> int:
        return self.blocks.current if self.blocks is not None else OUTSIDE

    def _file(self, ident: int, size: int, tag: int) -> None:
        self.events.append((ident, size))
        self.tags.append(tag)
        if size >= 0:
            self.tag_of[ident] = tag

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if self.on_op is not None and active_fake_mode() is self._fake_mode_on_entry:
            for nbytes in self.on_op(func):
                self.allocate(nbytes)
        result = func(*args, **(kwargs or {}))
        if active_fake_mode() is not self._fake_mode_on_entry:
            return result  # a nested fake mode's op (DTensor's sharding propagation)
        if isinstance(result, torch.Tensor):
            outputs = [result]
        else:
            outputs = [item for item in tree_leaves(result) if isinstance(item, torch.Tensor)]
        now = self._now()
        if now == OUTSIDE and self.blocks is not None and self.blocks.optimizing:
            for output, tag in zip(outputs, self.inherited(args, len(outputs)), strict=True):
                self._saw(output, tag)
        else:
            for output in outputs:
                self._saw(output, now)
        return result

    def inherited(self, args: Any, count: int) -> list[int]:
        """Tags for the ``count`` outputs of an op of the optimizer's step: a ``_foreach``
        op's i-th output the block of its list's i-th input; any other's the one block all its
        tagged inputs share; an output with none (a parameter's ``step`` count) the block the
        step made its last output for, as it goes parameter by parameter."""
        assert self.blocks is not None
        tags: list[int] | None = None
        for arg in args:
            listed = isinstance(arg, list | tuple) and len(arg) == count and count > 1
            if listed and all(isinstance(item, torch.Tensor) for item in arg):
                tags = [self._tag_of_tensor(item) for item in arg]
                break
        if tags is None:
            found = {
                self._tag_of_tensor(item)
                for item in (args if isinstance(args, tuple | list) else (args,))
                if isinstance(item, torch.Tensor)
            }
            found.discard(OUTSIDE)
            tags = [found.pop() if len(found) == 1 else OUTSIDE] * count
        for index, tag in enumerate(tags):
            if tag == OUTSIDE:
                tags[index] = self.blocks.stepping
            else:
                self.blocks.stepping = tag
        return tags

    def _tag_of_tensor(self, tensor: torch.Tensor) -> int:
        if tensor.device.type != self.device_type:
            return OUTSIDE
        for storage in get_untyped_storages(tensor):
            found = self.live.get(storage._cdata)
            if found is not None:
                return self.tag_of.get(found[0], OUTSIDE)
        return OUTSIDE

    def _saw(self, tensor: torch.Tensor, tag: int = OUTSIDE) -> None:
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
            self._file(ident, nbytes, tag)
            self._refs[key] = weakref.ref(storage, self._finalizer(key))

    def _finalizer(self, key: int) -> Callable[[Any], None]:
        def freed(_: Any) -> None:
            found = self.live.pop(key, None)
            self._refs.pop(key, None)
            if found is not None:
                self._freed(found[0])

        return freed

    def _freed(self, ident: int) -> None:
        """A free is filed under the block at work, or outside every block under its
        allocation's (the optimizer's burst of frees sweeps the blocks as its allocations did)."""
        now = self.blocks.freeing if self.blocks is not None else OUTSIDE
        self._file(ident, FREE, self.tag_of.get(ident, OUTSIDE) if now == OUTSIDE else now)

    def _resized(self, storage: torch.UntypedStorage) -> None:
        key = storage._cdata
        found = self.live.get(key)
        nbytes = storage.nbytes()
        if found is not None and found[1] == nbytes:
            return
        tag = self._now()
        if found is not None:
            del self.live[key]
            if tag == OUTSIDE:
                tag = self.tag_of.get(found[0], OUTSIDE)
            self._freed(found[0])
        if nbytes > 0:
            ident = next(self._ids)
            self.live[key] = (ident, nbytes)
            self._file(ident, nbytes, tag)
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
