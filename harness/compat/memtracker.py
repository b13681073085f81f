"""Which tensor-accounting engine this torch can run: the one place that decides.

The meters' trackers (``accounting.PeakTracker``, ``accounting.TotalsTracker``,
``timeline.TimelineTracker``) do their work through an engine asked of this module. There are
two engines, with one interface:

- **fast** (``memtracker_fast``): PyTorch's ``MemTracker`` with its per-op work trimmed, through
  its private parts (a leaner ``__torch_dispatch__``, ``_update_peak_stats``, ``_curr_mem_snap``,
  ``_in_opt``, ...), loaded without ``torch.distributed._tools``' package ``__init__`` (~1-2 s of a
  trial's start-up). Private parts change between releases without notice, so
- **public** (``memtracker_public``): ``MemTracker`` as it ships, through its public methods;
  slower, same numbers (``tests/test_tracker_adapter.py`` holds them equal, byte for byte).

At first use ``choice()`` checks every private piece the fast engine relies on (``FAST``:
modules, classes, the attributes it reads and the methods it overrides or calls, with the
arguments it passes) against the installed torch. All there: fast. One missing: public,
saying once on stderr which pieces are missing. Public unusable too (``PUBLIC``): one line
naming the torch version and what is missing. ``HARNESS_TRACKER=public`` (or ``kind="public"``)
forces the public engine; ``HARNESS_TRACKER=fast`` refuses to fall back (docs/measuring.md).
Tested: torch ``TESTED_TORCH`` (the Makefile's pin, and .ci/torch_range's releases).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import os
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Protocol

import torch

from harness.compat.snapshot_keys import SNAPSHOT_KEYS, TOTAL

ENV = "HARNESS_TRACKER"
KINDS = ("auto", "fast", "public")
TESTED_TORCH = "2.8.0, 2.14.1, 2.15.0"  # docs/compatibility.md: what CI runs

TOOLS = "torch.distributed._tools"
MEM = f"{TOOLS}.mem_tracker"
MOD = f"{TOOLS}.mod_tracker"
COMMON = f"{TOOLS}.common_utils"


class TrackerUnavailable(RuntimeError):
    """No tensor-accounting engine can run on this torch (the message says what is missing)."""


class Tracker(Protocol):
    """What the meters call on an engine: ``MemTracker``'s public interface."""

    def track_external(self, *external: Any) -> None: ...
    def __enter__(self) -> Any: ...
    def __exit__(self, *exc: Any) -> Any: ...
    def reset_mod_stats(self) -> None: ...
    def get_tracker_snapshot(self, type: str = ...) -> dict[Any, dict[Any, int]]: ...


class ObservedTracker(Tracker, Protocol):
    """An engine that calls its ``after_op`` after every tracked op; what it offers then."""

    rose: bool  # the total on its device type rose since this was last cleared

    def current(self) -> Mapping[Any, Mapping[Any, int]]: ...  # the running snapshot
    def total(self) -> int: ...  # its total on the device type
    def phase(self) -> str: ...  # forward, backward, recompute or optimizer


# ---- The pieces, and how each is seen to be there ---------------------------------------------

_PROBE = torch.zeros(1)  # made at import, outside any fake or dispatch mode a first use sits in


@dataclass(frozen=True)
class Piece:
    """One piece of torch an engine relies on.

    ``kind``: ``module`` (importable), ``package`` (a package whose ``__init__`` can be skipped:
    ``find_spec`` gives its folder), ``attr`` (``name``, a dotted path, exists in ``module``;
    with ``call``, it accepts those arguments: names as passed positionally, ``name=`` as
    keywords), ``live`` (``name`` exists on a live object: ``MemTracker()`` after a ``with``,
    a snapshot of it, or ``_WeakRefInfo(...)``, MemTracker's record of one storage).
    """

    kind: str
    module: str
    name: str = ""
    call: tuple[str, ...] = ()

    def __str__(self) -> str:
        shape = f"({', '.join(self.call)})" if self.call else ""
        if self.kind == "module":
            return f"module {self.module}"
        if self.kind == "package":
            return f"{self.module} (a package loadable without its __init__)"
        if self.kind == "live" and self.module == "snapshot":
            return f"the key {self.name!r} in a MemTracker snapshot"
        if self.kind == "live":
            return f"{self.module}.{self.name}"
        return f"{self.module}.{self.name}{shape}"

    def present(self) -> bool:
        try:
            if self.kind == "package":
                spec = importlib.util.find_spec(self.module)
                return spec is not None and spec.submodule_search_locations is not None
            if self.kind == "live":
                return _has(_probe(self.module), self.name)
            owner: Any = importlib.import_module(self.module)
            if self.kind == "module":
                return True
            *parents, last = self.name.split(".")
            for part in parents:
                owner = getattr(owner, part)
            return hasattr(owner, last) and _accepts(owner, last, self.call)
        except Exception:  # an import that fails, a probe that raises: the piece is not usable
            return False


def module(name: str) -> Piece:
    return Piece("module", name)


def package(name: str) -> Piece:
    return Piece("package", name)


def attr(where: str, name: str, *call: str) -> Piece:
    return Piece("attr", where, name, call)


def live(on: str, name: str) -> Piece:
    return Piece("live", on, name)


def _has(obj: Any, path: str) -> bool:
    if isinstance(obj, Mapping):
        return path in obj
    for part in path.split("."):
        if not hasattr(obj, part):
            return False
        obj = getattr(obj, part)
    return True


def _accepts(owner: Any, name: str, call: tuple[str, ...]) -> bool:
    """Whether ``owner.name`` takes these arguments (``self`` added for a method of a class)."""
    if not call:
        return True
    function = getattr(owner, name)
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):  # a builtin without a signature: nothing to tell
        return True
    method = isinstance(owner, type) and inspect.isfunction(inspect.getattr_static(owner, name))
    positional = [None] * (method + sum(not a.endswith("=") for a in call))
    keywords = dict.fromkeys(a[:-1] for a in call if a.endswith("="))
    try:
        signature.bind(*positional, **keywords)
    except TypeError:
        return False
    return True


@functools.cache  # one live object per kind serves every piece looked for on it
def _probe(on: str) -> Any:
    """A live object to look for attributes on: ``MemTracker()`` (tracking ``_PROBE``, after a
    ``with``: some attributes are made only on entry), its snapshot (the device's part), or
    ``_WeakRefInfo(...)``. Registering a tensor runs no op, so no mode in force sees it."""
    mem = importlib.import_module(MEM)
    if on == "_WeakRefInfo(size, element_size, device, reftype)":
        return mem._WeakRefInfo(1, 4, torch.device("cpu"), mem._MemRefType.OTH)
    tracker = mem.MemTracker()
    tracker.track_external(_PROBE)
    with tracker:
        pass
    if on == "snapshot":
        return next(iter(tracker.get_tracker_snapshot("current").values()))
    return tracker


def missing(pieces: Iterable[Piece]) -> list[Piece]:
    """The pieces this torch lacks, in the order given."""
    return [piece for piece in pieces if not piece.present()]


# What MemTracker's public interface must offer either engine: the meters call these.
_INTERFACE = (
    attr(MEM, "MemTracker.track_external", "external"),
    attr(MEM, "MemTracker.get_tracker_snapshot", "type"),
    attr(MEM, "MemTracker.reset_mod_stats"),
    attr(MEM, "MemTracker.__enter__"),
    attr(MEM, "MemTracker.__exit__", "exc_type", "exc", "traceback"),
    *(live("snapshot", key) for key in (*SNAPSHOT_KEYS, TOTAL)),
    # accounting.storage_bytes (and allocations.py) walk storages as MemTracker does.
    attr(COMMON, "get_untyped_storages", "t"),
)

# Every private piece memtracker_fast.py relies on (keep in step with it).
FAST: tuple[Piece, ...] = (
    package(TOOLS),  # loaded as a namespace: its __init__ imports the inductor
    module(MEM),
    attr(MEM, "MemTracker"),
    attr(MEM, "_TOTAL_KEY"),
    *(attr(MEM, f"_MemRefType.{ref}") for ref in ("OPT", "TEMP", "ACT", "GRAD")),
    attr(MEM, "_ModState.PEAK_FW"),
    attr(MEM, "_ModState.PEAK_BW"),
    # overridden (each called by MemTracker with these arguments)
    attr(MEM, "MemTracker.__torch_dispatch__", "func", "types", "args", "kwargs"),
    attr(MEM, "MemTracker._update_peak_stats", "peak_state"),
    attr(MEM, "MemTracker._update_snap", "u_type", "winfo"),
    attr(MEM, "MemTracker._track_module_params_and_buffers", "module", "install_grad_hooks="),
    attr(MEM, "MemTracker._pre_fw_hook", "module", "inputs"),
    # called
    attr(MEM, "MemTracker._track", "reftype", "t"),
    attr(MEM, "MemTracker._update_and_maybe_create_winfos", "t", "reftype"),
    # read or written on a tracker
    live("MemTracker()", "_in_opt"),
    live("MemTracker()", "_in_ac"),
    live("MemTracker()", "_mod_tracker.is_bw"),
    live("MemTracker()", "_curr_mem_snap"),
    live("MemTracker()", "_peak_mem"),
    live("MemTracker()", "_peak_mem_snap"),
    live("MemTracker()", "_param_to_grad_hook_handles"),
    live("MemTracker()", "memory_tracking"),
    live("MemTracker()", "_mod_tracker.parents"),
    live("MemTracker()", "_mod_tracker.get_known_fqn"),
    # the rest of tracker_fast's imports
    attr("torch._guards", "active_fake_mode"),
    attr("torch.distributed.tensor", "DTensor"),
    attr("torch.utils._pytree", "tree_map_only", "type_or_types", "func", "tree"),
    attr("torch", "ops._c10d_functional.wait_tensor.default"),
    *_INTERFACE,
)

# What memtracker_public.py uses: MemTracker's public interface, and public hooks besides.
PUBLIC: tuple[Piece, ...] = (
    module(MEM),
    attr(MEM, "MemTracker"),
    attr(MEM, "MemTracker.__torch_dispatch__", "func", "types", "args", "kwargs"),
    live("MemTracker()", "memory_tracking"),
    attr(MOD, "ModTracker.is_bw"),
    attr("torch._guards", "active_fake_mode"),
    attr("torch.nn.modules.module", "register_module_forward_pre_hook", "hook"),
    attr("torch.nn.modules.module", "register_module_forward_hook", "hook", "always_call="),
    attr("torch.optim.optimizer", "register_optimizer_step_pre_hook", "hook"),
    attr("torch.optim.optimizer", "register_optimizer_step_post_hook", "hook"),
    attr("torch.utils.hooks", "RemovableHandle"),
    *_INTERFACE,
)

# accounting.cuda_accounting (a CUDA target predicted without a GPU): MemTracker decides a
# storage's bytes in its record of it, whose byte count is swapped for CUDA's rounding.
CUDA_ROUNDING: tuple[Piece, ...] = (
    attr(MEM, "_WeakRefInfo._calculate_mem_consumed"),
    live("_WeakRefInfo(size, element_size, device, reftype)", "size"),
    live("_WeakRefInfo(size, element_size, device, reftype)", "element_size"),
)


# ---- Loading without the package's __init__, and finishing it for the public engine ----------

_skipped_init: ModuleType | None = None  # the package module whose __init__ was not run


def _skip_package_init() -> None:
    """Load ``torch.distributed._tools.mem_tracker`` without its package's ``__init__``.

    That ``__init__`` imports every tool of the package, among them a runtime estimator that
    loads the inductor: ~1.7-2.5 s of every trial's start-up, for nothing a trial uses. The
    package is registered as a module not yet run, for its submodules; done at import, so the
    warm starter (``trial/zygote.py``) holds these modules for the trials it forks. Never
    raises: what did not load, the check finds missing.
    """
    global _skipped_init
    import torch.distributed  # noqa: F401  (the parent must exist first)

    if TOOLS in sys.modules:
        return
    spec = importlib.util.find_spec(TOOLS)
    if spec is None or spec.submodule_search_locations is None:
        return
    _skipped_init = sys.modules[TOOLS] = importlib.util.module_from_spec(spec)
    try:
        importlib.import_module(MEM)
    except Exception:
        _run_package_init()  # the submodule needed it: leave the package as torch imports it


def _run_package_init() -> None:
    """Run the ``__init__`` skipped above, so the package is as a plain ``import`` leaves it
    (the public engine imports MemTracker the normal way). Same module object: the
    submodules already loaded stay where they are."""
    global _skipped_init
    package, _skipped_init = _skipped_init, None
    if package is None or sys.modules.get(TOOLS) is not package:
        return
    try:
        assert package.__spec__ is not None and package.__spec__.loader is not None
        package.__spec__.loader.exec_module(package)
        torch.distributed._tools = package  # type: ignore[attr-defined]  (as an import binds it)
    except Exception:  # the public check reports what cannot be imported
        del sys.modules[TOOLS]


if os.environ.get(ENV) != "public":
    _skip_package_init()


# ---- The choice ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Choice:
    """The engine in use: ``kind`` (fast or public), ``why`` the public one is (None if fast),
    and ``engines``, the module with its ``Engine`` and ``ObservedEngine`` classes."""

    kind: str
    why: str | None
    engines: ModuleType


def choose(
    kind: str = "auto",
    fast: Iterable[Piece] = FAST,
    public: Iterable[Piece] = PUBLIC,
    source: str = "kind",
) -> Choice:
    """Check the pieces and pick the engine (no caching, no printing: ``choice`` does both).

    ``fast`` and ``public`` are the requirement lists, arguments so a test can check against
    a list torch cannot meet; ``source`` names where ``kind`` came from, for the messages."""
    version = torch.__version__
    if kind not in KINDS:
        raise TrackerUnavailable(f"{source}={kind}: expected one of {', '.join(KINDS)}")
    if kind == "public":
        why = f"asked for ({source}=public)"
    else:
        gone = missing(fast)
        if not gone:
            from harness.compat import memtracker_fast

            return Choice("fast", None, memtracker_fast)
        pieces = ", ".join(map(str, gone))
        if kind == "fast":
            raise TrackerUnavailable(
                f"{source}=fast, but torch {version} lacks what the fast tracker relies on: {pieces}"
                f" (tested: torch {TESTED_TORCH})"
            )
        why = (
            f"torch {version} lacks {pieces}, which the fast tracker relies on "
            f"(tested: torch {TESTED_TORCH})"
        )
    _run_package_init()
    gone = missing(public)
    if gone:
        raise TrackerUnavailable(
            f"tensor accounting needs PyTorch's MemTracker, and torch {version} lacks "
            f"{', '.join(map(str, gone))} (tested: torch {TESTED_TORCH})"
        )
    from harness.compat import memtracker_public

    return Choice("public", why, memtracker_public)


def choice(kind: str | None = None) -> Choice:
    """The engine for ``kind`` (default: ``HARNESS_TRACKER``, else ``auto``), checked once per
    process and kind; the first public choice says so on stderr, once."""
    if kind is not None:
        return _chosen(kind, "kind")
    return _chosen(os.environ.get(ENV) or "auto", ENV)


@functools.cache
def _chosen(kind: str, source: str) -> Choice:
    chosen = choose(kind, source=source)
    if chosen.why is not None:
        print(
            "harness: tensor accounting uses PyTorch's MemTracker as shipped, the slower "
            f"tracker (same numbers): {chosen.why}",
            file=sys.stderr,
        )
    return chosen


def engine(kind: str | None = None) -> Tracker:
    """A new engine that keeps the running snapshot and its peak."""
    return choice(kind).engines.Engine()


def observed_engine(
    after_op: Callable[[], None], device_type: str, kind: str | None = None
) -> ObservedTracker:
    """A new engine that also calls ``after_op()`` after every tracked op."""
    return choice(kind).engines.ObservedEngine(after_op, device_type)


@functools.cache
def _storage_walk() -> Callable[[torch.Tensor], set[torch.UntypedStorage]]:
    choice()  # checked with the rest of what the engine needs (and loaded as it loads it)
    return importlib.import_module(COMMON).get_untyped_storages


def get_untyped_storages(tensor: torch.Tensor) -> set[torch.UntypedStorage]:
    """Every storage behind ``tensor`` (a wrapper subclass's inner tensors' too), walked as
    MemTracker walks them, so sizes counted here agree with its snapshot."""
    return _storage_walk()(tensor)


def storage_record() -> Any:
    """MemTracker's record of one storage (``_WeakRefInfo``), whose byte count
    ``accounting.cuda_accounting`` swaps; checked, since it is private to either engine."""
    choice()
    gone = missing(CUDA_ROUNDING)
    if gone:
        raise TrackerUnavailable(
            "predicting a CUDA target without a GPU rounds each storage to CUDA's 512-byte "
            f"blocks inside MemTracker, and torch {torch.__version__} lacks "
            f"{', '.join(map(str, gone))} (tested: torch {TESTED_TORCH})"
        )
    return importlib.import_module(MEM)._WeakRefInfo
