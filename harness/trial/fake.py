"""What fake tensors lack, supplied so that a fake training step takes the real one's path.

A fake tensor has a shape, dtype and device but no values and no storage. That is all memory
needs, except in four places, each handled here:

- **Values read during a step.** A step that reads a scalar (``.item()``: Adafactor's step
  count and parameter norm) gets 1 (``True`` for a flag) from ``ValuesReadAsOne``; the memory
  a step allocates does not depend on those numbers. The same mode answers ``is_pinned()`` of
  a fake tensor made with ``pin_memory=True`` (or by ``pin_memory()``) with True: a fake
  tensor forgets it was pinned, and DDP's reducer asserts that its pinned copy is (on a
  card, where its used-parameter map lives on CUDA: the first card run found this).
- **Values read while a model is built.** Constructors that compute Python numbers from
  tensors (timm's stochastic-depth rates: ``torch.linspace(0, rate, depth)[i].item()``) would
  get 1 there too and build a different model (``DropPath(1.0)`` where the real one has
  ``Identity``). So the model is not built on fake tensors: ``construct_on_meta`` builds it
  for real, with every tensor larger than ``SMALL`` elements created on the meta device (no
  storage, free initialisation) and the small ones as real CPU tensors whose values the
  constructor may read. ``harness.workloads.convert`` then turns both into fake tensors on the
  trial's device. accelerate's ``init_empty_weights`` has the same aim; it allocates each
  parameter before moving it, which an 8B model cannot afford here.
- **Libraries that treat a fake tensor as tracing.** transformers' mask code asks
  ``is_tracing(tensor)``, which is true for any FakeTensor, and then builds an explicit
  causal mask where the real run passes none (which switches SDPA's GQA path off and copies
  K/V to every head: +4-8 % on a small GQA Llama). ``libraries_run_eagerly`` makes that check
  see the fake tensor as the eager tensor it stands for.
- **Other ranks.** ``ddp:N``/``fsdp:N``/``tp:N``/``pp:N`` run one rank of N against torch's
  "fake" process group, whose collectives return at once, so sharding, all-gather buffers and
  gradient buckets are those of the real run. A device mesh is a table of rank numbers that
  torch searches by value (``nonzero``), so meshes are built from real tensors; and DTensor
  caches its sharding decisions under meshes that compare equal across process groups, so the
  caches are emptied when the fake group goes (else the real run reuses the fake group's).
"""

from __future__ import annotations

import contextlib
import sys
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode
from torch.overrides import TorchFunctionMode

from harness.compat.internals import (
    BATCH_P2P,
    FakeTensor,
    TorchDispatchMode,
    disable_current_modes,
    fake_refusals,
    fake_store,
    forget_sharding_decisions,
    replaced,
)
from harness.trial.distributed import Ranks

SMALL = 2**16  # elements: tensors up to this size are built for real (their values readable)

# What fake tensors raise where a step's path depends on values they do not have (an output
# whose shape depends on data, a guard on a data-dependent size) or where an op has no fake
# kernel: a step that raises one of these cannot be predicted, which the estimate says (an
# ``unpredictable`` Prediction). Any other exception is a bug, in harness or in the model: a crash.
# A private piece the installed torch lacks (``harness.compat``) is refused the same way.
FAKE_REFUSALS: tuple[type[Exception], ...] = (*fake_refusals(), GuardOnDataDependentSymNode)

# Functions that create a tensor from sizes or Python numbers, not from other tensors.
_FACTORIES = {
    torch.empty,
    torch.empty_strided,
    torch.zeros,
    torch.ones,
    torch.full,
    torch.rand,
    torch.randn,
    torch.randint,
    torch.arange,
    torch.linspace,
    torch.logspace,
    torch.eye,
    torch.Tensor.new_empty,
    torch.Tensor.new_zeros,
    torch.Tensor.new_ones,
    torch.Tensor.new_full,
}


_PINNING = {torch.ops.aten._pin_memory.default}  # what ``Tensor.pin_memory()`` dispatches to


class ValuesReadAsOne(TorchDispatchMode):
    """Answers a fake tensor's ``.item()`` with 1 instead of failing (see the module notes).

    While ``watching(record)``, also hands every op, its arguments and its result to
    ``record`` (``OpCostCounter.record``): the counter then costs the fake step no dispatch mode
    of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.record: Callable[[Any, Any, Any, Any], None] | None = None
        # Fake tensors made pinned, by id (a tensor's == is elementwise): what ``is_pinned()``
        # says True for; each entry leaves with its tensor.
        self.pinned: dict[int, weakref.ref[torch.Tensor]] = {}

    @contextlib.contextmanager
    def watching(self, record: Callable[[Any, Any, Any, Any], None]) -> Iterator[None]:
        self.record = record
        try:
            yield
        finally:
            self.record = None

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.ops.aten._local_scalar_dense.default:
            tensor = args[0]
            if tensor.dtype == torch.bool:
                result: Any = True
            else:
                result = 1.0 if tensor.is_floating_point() else 1
        elif func is torch.ops.aten.is_pinned.default:
            made = self.pinned.get(id(args[0]))
            result = (made is not None and made() is args[0]) or func(*args, **(kwargs or {}))
        else:
            result = func(*args, **(kwargs or {}))
            if isinstance(result, torch.Tensor) and (
                (kwargs and kwargs.get("pin_memory")) or func in _PINNING
            ):
                key = id(result)
                self.pinned[key] = weakref.ref(
                    result, lambda _, key=key: self.pinned.pop(key, None)
                )
        if self.record is not None:
            self.record(func, args, kwargs, result)
        return result


class LargeTensorsOnMeta(TorchFunctionMode):
    """Creates every factory-made tensor of more than ``SMALL`` elements on the meta device."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in _FACTORIES:
            probe = func(*args, **{**kwargs, "device": "meta"})  # the shape, for free
            if probe.numel() > SMALL:
                return probe
        return func(*args, **kwargs)


@contextlib.contextmanager
def construct_on_meta() -> Iterator[None]:
    """Build a model for real (outside any fake or tracking mode), its large tensors on meta."""
    with disable_current_modes(), LargeTensorsOnMeta():
        yield


def _eager_is_tracing(original: Any) -> Any:
    def is_tracing(tensor: Any = None) -> bool:
        return original(None if isinstance(tensor, FakeTensor) else tensor)

    return is_tracing


@contextlib.contextmanager
def libraries_run_eagerly() -> Iterator[None]:
    """transformers' masks as in an eager run (see the module notes); nothing else changes."""
    # transformers' module, loaded by the model (never imported here): untyped here.
    masking: Any = sys.modules.get("transformers.masking_utils")
    if masking is None or not hasattr(masking, "is_tracing"):
        yield
        return
    original = masking.is_tracing
    masking.is_tracing = _eager_is_tracing(original)
    try:
        yield
    finally:
        masking.is_tracing = original


@contextlib.contextmanager
def fake_process_group(ranks: Ranks) -> Iterator[None]:
    """Rank ``ranks.rank`` of ``ranks.size`` with no peers: torch's "fake" backend completes
    every collective without communicating (a receive leaves its buffer as it was). Must not
    meet a real group (the trial predicts before joining one)."""
    if not ranks.distributed:
        yield
        return
    if dist.is_initialized():
        raise RuntimeError("a multi-rank trial must be predicted before its process group starts")
    # Making its store registers the "fake" backend (torch's own tests and tools use it so).
    store = fake_store()
    dist.init_process_group("fake", store=store, rank=ranks.rank, world_size=ranks.size)
    try:
        with meshes_of_real_tensors(), sends_hold_their_tensors():
            yield
    finally:
        dist.destroy_process_group()
        forget_sharding_decisions()


class _HeldWork:
    """A point-to-point operation's work that keeps its tensors until waited on, as a real
    backend's does (the fake one's lets them go at once)."""

    def __init__(self, works: list[Any], tensors: list[torch.Tensor]) -> None:
        self.works, self.tensors = works, tensors

    def wait(self, *args: Any, **kwargs: Any) -> bool:
        self.tensors = []
        return all(work.wait(*args, **kwargs) is not False for work in self.works)


@contextlib.contextmanager
def sends_hold_their_tensors() -> Iterator[None]:
    """A pipeline schedule's sends and receives, their tensors held until the schedule waits
    on them: what a real step holds between the two (a torch without the schedule's batching
    function, or without pipelining, holds nothing)."""

    def holding(original: Callable[..., Any]) -> Callable[..., Any]:
        def batch_p2p(p2p_ops: list[Any], desc: str | None = None) -> list[Any]:
            # The fake group's sends may return no work at all: one that holds them stands in.
            works = original(p2p_ops, desc=desc)
            return [_HeldWork(works, [op.tensor for op in p2p_ops])] if p2p_ops else works

        return batch_p2p

    with replaced(BATCH_P2P, holding):
        yield


@contextlib.contextmanager
def meshes_of_real_tensors() -> Iterator[None]:
    """Every ``DeviceMesh`` made meanwhile (FSDP makes one joining its mesh to a tensor-parallel
    one) built outside the fake world: its rank lookups read values."""
    from torch.distributed.device_mesh import DeviceMesh

    original = DeviceMesh.__init__

    def build_for_real(self: Any, *args: Any, **kwargs: Any) -> None:
        with disable_current_modes():
            original(self, *args, **kwargs)

    DeviceMesh.__init__ = build_for_real  # type: ignore[method-assign]
    try:
        yield
    finally:
        DeviceMesh.__init__ = original  # type: ignore[method-assign]
