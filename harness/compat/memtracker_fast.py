"""The fast tensor-accounting engines: PyTorch's ``MemTracker`` trimmed through its private parts.

Imported only by ``harness.compat.memtracker``, and only after it has checked that every private
piece used here exists in the installed torch with the shape used here (``tracker.FAST``
lists them: keep that list in step with this file). Everything below reads or overrides
``MemTracker``'s internals; ``memtracker_public`` is the same interface on its public methods.

What the trimming buys: after every op ``MemTracker`` also updates a peak per tracked module,
walking every module it has seen; nothing here reads those, and on a 32-layer model that walk
was 60 % of a tracked step (an 8B Llama's fake step: 18 s). Its per-op dispatch also walks
every op's outputs with pytree and looks at the mode stack twice: -20 % a tracked step here.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch._guards import active_fake_mode
from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker, _MemRefType, _ModState
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_map_only


class Engine(MemTracker):
    """``MemTracker`` keeping only what the meters read: the running snapshot and the peak.

    Module hooks still run: they tell forward, backward and recomputation apart. Frozen
    parameters (a LoRA base) get no gradient hook: ``MemTracker`` hooks every parameter, and a
    frozen one refuses hooks.
    """

    _entries = 0  # how deep this tracker is entered (a pipeline stage re-enters it)
    _entry_fake_mode: Any = None  # the fake mode active when first entered; None in eager

    def __enter__(self) -> Engine:
        """Notes the fake mode active on entry, as newer MemTrackers do themselves
        (``_fake_mode_on_entry``): ops of a fake mode entered later (DTensor's sharding
        propagation) are not the step's. Noted here so a torch whose MemTracker lacks it
        (2.11, the first card's) keeps the fast engine."""
        if self._entries == 0:
            self._entry_fake_mode = active_fake_mode()
        self._entries += 1
        super().__enter__()
        return self

    def __exit__(self, *args: Any) -> None:
        super().__exit__(*args)
        self._entries -= 1

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        """``MemTracker``'s, minus its per-op costs that buy nothing here: a pytree walk over
        every op's outputs (most ops return one tensor or a flat tuple of them) and a second
        look at the mode stack. Same decisions: DTensor ops left to DTensor, a fake
        ``wait_tensor`` returning its input, ops of a nested fake mode (DTensor's sharding
        propagation) not tracked, the reference type by phase."""
        if DTensor in types:
            return NotImplemented
        fake_mode = active_fake_mode()
        if func is torch.ops._c10d_functional.wait_tensor.default and fake_mode:
            result = args[0]  # the meta kernel would return a new tensor; eager does not
        else:
            result = func(*args, **(kwargs or {}))
        if fake_mode is not self._entry_fake_mode:
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
        """As ``MemTracker``'s, but gradient hooks only on parameters that get gradients."""
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

    def _pre_fw_hook(self, module: torch.nn.Module, inputs: Any) -> None:
        """As ``MemTracker``'s, except that a top-level module called again in forward starts
        its per-module statistics afresh instead of refusing: a pipeline stage runs once per
        micro-batch, its backwards interleaved (what ``reset_mod_stats`` does between steps,
        for that module alone; nothing here reads those statistics)."""
        name = self._mod_tracker.get_known_fqn(module)
        again = module in self.memory_tracking and not self._mod_tracker.is_bw
        if again and set(self._mod_tracker.parents) - {name} == {"Global"}:
            del self.memory_tracking[module]
        super()._pre_fw_hook(module, inputs)

    def _track_gradient(self, grad: torch.Tensor) -> None:
        self._update_and_maybe_create_winfos(grad, _MemRefType.GRAD)


class ObservedEngine(Engine):
    """``Engine`` that calls ``after_op()`` after every tracked op (where ``MemTracker`` takes
    its peak) and notes whether the total on ``device_type`` rose since ``rose`` was last
    cleared: at any update of the snapshot (a new storage, one resized larger, FSDP's
    all-gather), inside an op or between two (a hook)."""

    def __init__(self, after_op: Callable[[], None], device_type: str) -> None:
        super().__init__()
        self.after_op = after_op
        self.device_type = device_type
        self.rose = False

    def current(self) -> Mapping[Any, Mapping[Any, int]]:
        """The running snapshot itself (read it, never keep it: it changes with every op)."""
        return self._curr_mem_snap

    def total(self) -> int:
        for dev, dev_snap in self._curr_mem_snap.items():
            if dev.type == self.device_type:
                return dev_snap[_TOTAL_KEY]
        return 0

    def phase(self) -> str:
        if self._in_opt:
            return "optimizer"
        if self._mod_tracker.is_bw:
            return "recompute" if self._in_ac else "backward"
        return "forward"

    def _update_snap(self, u_type: Any, winfo: Any, *args: Any, **kwargs: Any) -> None:
        before = self.total()
        super()._update_snap(u_type, winfo, *args, **kwargs)
        if self.total() > before:
            self.rose = True

    def _update_peak_stats(self, peak_state: Any) -> None:  # after every tracked op
        super()._update_peak_stats(peak_state)
        self.after_op()
