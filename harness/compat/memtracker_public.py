"""The fallback tensor-accounting engines: PyTorch's ``MemTracker`` as it ships, through its
public methods only.

``harness.compat.memtracker`` picks these when a private piece the fast engines
(``memtracker_fast``) rely on is missing from the installed torch, or when ``HARNESS_TRACKER=public``
asks for them. Same interface, same numbers, slower: ``MemTracker`` also keeps a peak per module
after every op, and what ``after_op`` observers read here is a copy of its snapshot
(``get_tracker_snapshot``), taken after every op.

Used: ``MemTracker`` (constructed, ``track_external``, ``get_tracker_snapshot``,
``reset_mod_stats``, its ``memory_tracking`` attribute, and its ``__enter__``/``__exit__``/
``__torch_dispatch__`` extended through ``super()``), ``ModTracker.is_bw``, the optimizers' global
step hooks, the module forward hooks, and ``active_fake_mode`` (which ``MemTracker`` itself uses
to skip a nested fake mode's ops). ``tracker.PUBLIC`` lists them.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch._guards import active_fake_mode
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed._tools.mod_tracker import ModTracker
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)
from torch.utils.hooks import RemovableHandle

from harness.compat.snapshot_keys import TOTAL


class FrozenParameters(RuntimeError):
    """The model has parameters without gradients, which ``MemTracker`` as shipped cannot track."""


class Engine(MemTracker):
    """``MemTracker`` as shipped, refusing up front what it would fail on mid-step.

    ``MemTracker`` hooks every parameter of a module for its gradient the first time the
    module runs, and a parameter that takes no gradient (a LoRA base) refuses hooks: the
    step would fail in its first forward with torch's ``cannot register a hook``. Told here,
    once, when the model is registered.
    """

    def track_external(self, *external: Any) -> None:
        for item in external:
            if isinstance(item, torch.nn.Module) and any(
                not p.requires_grad for p in item.parameters()
            ):
                raise FrozenParameters(
                    "PyTorch's MemTracker as shipped (the slower tracker in use) cannot track a "
                    "model with frozen parameters (lora, qlora): it hooks every parameter for "
                    "its gradient; the fast tracker can (torch 2.14.1)"
                )
        super().track_external(*external)


class ObservedEngine(Engine):
    """``Engine`` that calls ``after_op()`` after every op ``MemTracker`` tracked and notes
    whether the total on ``device_type`` rose since ``rose`` was last cleared.

    ``MemTracker``'s own updates are private, so a rise is seen from the outside: the total
    after an op above the total before it (the op made or grew a storage), or the total before
    an op above the total after the last one (a hook or ``resize_`` in between). The fast
    engine sees every update; the two differ only where a rise and an equal fall come between
    the same two readings (a garbage collection freeing tensors inside an op that allocated).
    """

    def __init__(self, after_op: Callable[[], None], device_type: str) -> None:
        super().__init__()
        self.after_op = after_op
        self.device_type = device_type
        self.rose = False
        self._snapshot: dict[Any, dict[Any, int]] = {}
        self._last_total = 0
        self._entry_fake_mode: Any = None
        self._in_optimizer = False
        self._recomputing: weakref.ref[torch.nn.Module] | None = None  # its outermost module
        self._is_bw = ModTracker()  # only its ``is_bw`` is read: no hooks, never entered
        self._handles: list[RemovableHandle] = []

    def current(self) -> Mapping[Any, Mapping[Any, int]]:
        """The snapshot after the last op (a copy)."""
        return self._snapshot

    def total(self) -> int:
        return _total(self._snapshot, self.device_type)

    def phase(self) -> str:
        """As ``MemTracker`` files an op: its optimizer-step and recomputation flags are
        private, so the same hooks keep copies of them here."""
        if self._in_optimizer:
            return "optimizer"
        if self._is_bw.is_bw:
            return "recompute" if self._recomputing is not None else "backward"
        return "forward"

    def __enter__(self) -> ObservedEngine:
        # Module hooks first, so ours run before MemTracker's (registered in its __enter__)
        # and see its ``memory_tracking`` as its own pre-forward hook does.
        self._handles = [
            register_module_forward_pre_hook(self._pre_forward),
            register_module_forward_hook(self._post_forward, always_call=True),
            register_optimizer_step_pre_hook(self._optimizer_starts),
            register_optimizer_step_post_hook(self._optimizer_ends),
        ]
        super().__enter__()
        self._entry_fake_mode = active_fake_mode()
        self._snapshot = self.get_tracker_snapshot("current")
        self._last_total = self.total()
        # What was registered before entry rose from nothing: the fast engine's flag is set.
        self.rose = self._last_total > 0
        return self

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        before = _total(self.get_tracker_snapshot("current"), self.device_type)
        if before > self._last_total:
            self.rose = True
        result = super().__torch_dispatch__(func, types, args, kwargs)
        if result is NotImplemented:  # a DTensor op, left to DTensor: nothing tracked yet
            return result
        self._snapshot = self.get_tracker_snapshot("current")
        self._last_total = self.total()
        if self._last_total > before:
            self.rose = True
        if active_fake_mode() is self._entry_fake_mode:  # MemTracker tracked it
            self.after_op()
        return result

    def _pre_forward(self, module: torch.nn.Module, args: Any) -> None:
        # MemTracker: a module it has seen, run again in backward, is recomputation until the
        # outermost such module's forward ends.
        if self._is_bw.is_bw and self._recomputing is None and module in self.memory_tracking:
            self._recomputing = weakref.ref(module)

    def _post_forward(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if self._is_bw.is_bw and self._recomputing is not None and self._recomputing() is module:
            self._recomputing = None

    def _optimizer_starts(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self._in_optimizer = True

    def _optimizer_ends(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self._in_optimizer = False


def _total(snapshot: Mapping[Any, Mapping[Any, int]], device_type: str) -> int:
    for dev, dev_snap in snapshot.items():
        if torch.device(dev).type == device_type:
            return dev_snap[TOTAL]
    return 0
