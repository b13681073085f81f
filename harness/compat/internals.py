"""Every private PyTorch name harness uses outside tensor accounting, declared once.

PyTorch's private modules (``torch._subclasses``, ``torch.utils._python_dispatch``,
``torch._C``'s dispatcher calls, ``torch.testing._internal``, DTensor's caches) change between
releases without notice. Each one harness reaches for is a ``Private``: where it lives and
which *feature* it enables. Each is looked up once, at import of this module, and never
raises here: a piece the installed torch lacks is bound to a stand-in that raises ``Missing``
(naming the piece, the feature and the torch version) only when that feature is used. A
prediction catches ``Missing`` as it catches fake tensors' refusals (``unpredictable``, with
the reason), so one missing piece costs its feature, never every trial's import.

Nothing else in ``harness/`` may name a private torch module or attribute: the import-linter
contract ``harness.compat.lint.PrivateTorchContract`` (``pyproject.toml``) checks it, and
``harness doctor`` prints what the installed torch supports (``FEATURES``).
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

TORCH_VERSION: str = torch.__version__

# The features, as `harness doctor` names them.
FAKE_TENSORS = "predictions on fake tensors (estimate, fit, plan, the in-trial prediction)"
DISPATCH_MODES = "op-level meters (op costs, the allocation log, autocast rules, mesh building)"
CUDA_AUTOCAST = "CUDA-target predictions from a CPU (CUDA autocast's rules, card kernels)"
BACKWARD_PASS = "recomputation and per-thread workspaces told apart (the backward pass seen)"
FAKE_GROUP = "multi-rank predictions (torch's fake process group)"
DTENSOR_CACHES = "DTensor's sharding caches emptied after a multi-rank prediction"
PIPELINE_SENDS = "pp predictions holding sent tensors until waited on"
ALLOCATOR_SNAPSHOT = "the CUDA allocator snapshot artifact (allocator.pickle)"
CONTEXT_PARALLEL = "cp:N (context parallelism, torch 2.9 or newer)"
MESH_FLATTEN = "cp with data parallelism (a flattened dp x cp mesh)"


class Missing(RuntimeError):
    """The installed torch lacks a private piece a feature needs (the message names both)."""


@dataclass(frozen=True)
class Private:
    """One private name: ``module`` (importable; ``a|b``: where releases have kept it, tried
    in order) and, unless empty, ``name`` (a dotted attribute path in it), and the feature it
    enables. ``optional``: a torch without it has
    nothing for the feature to do (a cache it does not keep), so its absence costs nothing.
    ``since``: the first torch release that has it, where that is newer than the oldest
    supported (the feature needs that release)."""

    feature: str
    module: str
    name: str = ""
    optional: bool = False
    since: str = ""

    def __str__(self) -> str:
        module = self.module.split("|")[0]
        return f"{module}.{self.name}" if self.name else f"module {module}"

    def load(self) -> Any:
        """The piece itself; ``Missing`` where this torch lacks it."""
        failure: Exception | None = None
        for module in self.module.split("|"):
            try:
                owner: Any = importlib.import_module(module)
                for part in filter(None, self.name.split(".")):
                    owner = getattr(owner, part)
                return owner
            except (ImportError, AttributeError) as error:
                failure = error
        raise self.missing(f"{type(failure).__name__}: {failure}") from failure

    def present(self) -> bool:
        try:
            self.load()
        except Missing:
            return False
        return True

    @property
    def owner(self) -> Any:
        """The module that holds ``name`` (the first of ``a|b`` that does)."""
        for module in self.module.split("|"):
            try:
                found = importlib.import_module(module)
            except ImportError:
                continue
            if hasattr(found, self.name.split(".")[0]):
                return found
        raise self.missing()

    def missing(self, detail: str = "") -> Missing:
        why = f" ({detail})" if detail else ""
        return Missing(f"torch {TORCH_VERSION} lacks {self}{why}, needed for {self.feature}")


PIECES: list[Private] = []
"""Every piece declared below, in order (``harness doctor`` and the tests read it)."""


def _declare(
    feature: str, module: str, name: str = "", optional: bool = False, since: str = ""
) -> Private:
    piece = Private(feature, module, name, optional, since)
    PIECES.append(piece)
    return piece


def _bind(piece: Private, stand_in: Any) -> Any:
    try:
        return piece.load()
    except Missing:
        return stand_in


def _missing_class(piece: Private, base: type = object) -> type:
    """A class that stands in for a missing one: subclassable and usable in ``isinstance``
    (nothing is an instance), refusing to be made."""

    def refuse(self: Any, *args: Any, **kwargs: Any) -> None:
        raise piece.missing()

    return type(piece.name.rpartition(".")[2] or "Missing", (base,), {"__init__": refuse})


def _missing_function(piece: Private) -> Callable[..., Any]:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise piece.missing()

    return refuse


# ---- Fake tensors ----------------------------------------------------------------------------

_FAKE = "torch._subclasses.fake_tensor"
FAKE_TENSOR_MODE = _declare(FAKE_TENSORS, _FAKE, "FakeTensorMode")
FAKE_TENSOR = _declare(FAKE_TENSORS, _FAKE, "FakeTensor")
ACTIVE_FAKE_MODE = _declare(FAKE_TENSORS, "torch._guards", "active_fake_mode")
FAKE_TENSOR_LOGGER = _FAKE  # the logger fake tensors warn on (autocast's probes quiet it)
_REFUSALS = tuple(
    _declare(FAKE_TENSORS, _FAKE, name)
    for name in (
        "DataDependentOutputException",
        "DynamicOutputShapeException",
        "UnsupportedOperatorException",
        "UnsupportedFakeTensorException",
        "UnsupportedMutationAliasingException",
    )
)

FakeTensorMode: Any = _bind(FAKE_TENSOR_MODE, _missing_class(FAKE_TENSOR_MODE))
FakeTensor: Any = _bind(FAKE_TENSOR, _missing_class(FAKE_TENSOR, torch.Tensor))
active_fake_mode: Callable[[], Any] = _bind(ACTIVE_FAKE_MODE, _missing_function(ACTIVE_FAKE_MODE))


def fake_refusals() -> tuple[type[Exception], ...]:
    """What fake tensors raise where a step depends on values they lack or an op has no fake
    kernel (those this torch has), and ``Missing``: a feature this torch cannot serve."""
    found = (_bind(piece, None) for piece in _REFUSALS)
    return (*(error for error in found if isinstance(error, type)), Missing)


# ---- Dispatch modes and pytrees --------------------------------------------------------------

_DISPATCH = "torch.utils._python_dispatch"
TORCH_DISPATCH_MODE = _declare(DISPATCH_MODES, _DISPATCH, "TorchDispatchMode")
DISABLE_CURRENT_MODES = _declare(DISPATCH_MODES, _DISPATCH, "_disable_current_modes")
TREE_LEAVES = _declare(DISPATCH_MODES, "torch.utils._pytree", "tree_leaves")

TorchDispatchMode: Any = _bind(TORCH_DISPATCH_MODE, _missing_class(TORCH_DISPATCH_MODE))
tree_leaves: Callable[[Any], list[Any]] = _bind(TREE_LEAVES, _missing_function(TREE_LEAVES))
_disable_modes: Callable[[], Any] = _bind(
    DISABLE_CURRENT_MODES, _missing_function(DISABLE_CURRENT_MODES)
)


def disable_current_modes() -> contextlib.AbstractContextManager[Any]:
    """Every active dispatch mode (fake tensors, trackers) set aside for the duration."""
    return _disable_modes()


# ---- The dispatcher and ops ------------------------------------------------------------------

OP_OVERLOAD = _declare(CUDA_AUTOCAST, "torch._ops", "OpOverload")
ALL_OP_NAMES = _declare(CUDA_AUTOCAST, "torch._C", "_dispatch_get_all_op_names")
DISPATCH_DUMP = _declare(CUDA_AUTOCAST, "torch._C", "_dispatch_dump")
EXCLUDE_GUARD = _declare(CUDA_AUTOCAST, "torch._C", "_ExcludeDispatchKeyGuard")
DISPATCH_KEY_SET = _declare(CUDA_AUTOCAST, "torch._C", "DispatchKeySet")
DISPATCH_KEY = _declare(CUDA_AUTOCAST, "torch._C", "DispatchKey")
LIBRARY_DESTROY = _declare(CUDA_AUTOCAST, "torch.library", "Library._destroy")
GRAPH_TASK_ID = _declare(BACKWARD_PASS, "torch._C", "_current_graph_task_id")

if TYPE_CHECKING:  # the type checker reads torch's own class
    from torch._ops import OpOverload
else:
    OpOverload = _bind(OP_OVERLOAD, _missing_class(OP_OVERLOAD))
_graph_task_id: Callable[[], int] = _bind(GRAPH_TASK_ID, _missing_function(GRAPH_TASK_ID))


def in_backward() -> bool:
    """Inside autograd's backward pass (a graph task runs)."""
    return _graph_task_id() != -1


def op_schema(op: Any) -> Any:
    """An op overload's schema (its arguments, defaults and name); None for anything else."""
    return getattr(op, "_schema", None)


def is_view(tensor: torch.Tensor) -> bool:
    """A view of another tensor's storage (what autocast's weight cache refuses)."""
    return tensor._is_view()


def flop_formula_of_tensors(formula: Callable[..., Any]) -> Callable[..., Any]:
    """``formula`` marked for ``FlopCounterMode``'s ``custom_mapping`` as taking the op's tensors
    (``_get_raw``), as its own registry's are, rather than their shapes."""
    formula._get_raw = True  # type: ignore[attr-defined]
    return formula


def registered_ops(dispatch_key: str) -> list[str]:
    """Every op with a (non-fall-through) kernel at ``dispatch_key``, e.g. ``AutocastCUDA``,
    as the dispatcher's own dump says."""
    names, dump = ALL_OP_NAMES.load(), DISPATCH_DUMP.load()
    marker = f"{dispatch_key}: registered"
    return sorted(name for name in names() if marker in dump(name))


def excluding_dispatch_key(dispatch_key: str) -> contextlib.AbstractContextManager[Any]:
    """The dispatcher skips ``dispatch_key`` for the duration (what a C++ wrapper does below
    itself)."""
    keys = DISPATCH_KEY_SET.load()(getattr(DISPATCH_KEY.load(), dispatch_key))
    return EXCLUDE_GUARD.load()(keys)


def destroy_library(library: torch.library.Library) -> None:
    """Every kernel ``library`` registered removed (the ones it overrode come back)."""
    LIBRARY_DESTROY.load()  # says which piece is missing, if it is
    library._destroy()


# ---- Distributed -----------------------------------------------------------------------------

FAKE_STORE = _declare(FAKE_GROUP, "torch.testing._internal.distributed.fake_pg", "FakeStore")
REDISTRIBUTE_CACHE = _declare(
    DTENSOR_CACHES,
    "torch.distributed.tensor._redistribute",
    "clear_redistribute_planner_cache",
    optional=True,
)
SHARDING_PROP_CACHE = _declare(
    DTENSOR_CACHES, "torch.distributed.tensor.debug", "_clear_sharding_prop_cache", optional=True
)
BATCH_P2P = _declare(PIPELINE_SENDS, "torch.distributed.pipelining.schedules", "_batch_p2p")
CP_OPTIONS = _declare(
    CONTEXT_PARALLEL,
    # torch 2.9's: 2.8 kept another context parallelism (its own module, no load balancing
    # switch, refusing harness's gpt and HF attention), so cp needs 2.9 or newer.
    "torch.distributed.tensor.experimental._context_parallel._attention",
    "_cp_options",
    since="2.9",
)
MESH_FLATTEN_METHOD = _declare(MESH_FLATTEN, "torch.distributed.device_mesh", "DeviceMesh._flatten")


def fake_store() -> Any:
    """A store for torch's ``fake`` backend (importing its module registers the backend)."""
    return FAKE_STORE.load()()


def forget_sharding_decisions() -> None:
    """DTensor's caches of sharding propagation and redistribution plans emptied; a torch
    without one of them (2.8 has no redistribution planner cache) keeps nothing there to empty."""
    for piece in (SHARDING_PROP_CACHE, REDISTRIBUTE_CACHE):
        clear = _bind(piece, None)
        if clear is not None:
            clear()


@contextlib.contextmanager
def replaced(piece: Private, wrap: Callable[[Any], Any]) -> Iterator[bool]:
    """``piece`` (a module-level function) replaced by ``wrap(original)`` for the duration;
    yields False, changing nothing, where this torch lacks it."""
    try:
        original = piece.load()
    except Missing:
        yield False
        return
    owner = piece.owner
    setattr(owner, piece.name, wrap(original))
    try:
        yield True
    finally:
        setattr(owner, piece.name, original)


def cp_options() -> Any:
    """Ring attention's module options (``enable_load_balance``)."""
    return CP_OPTIONS.load()


def flatten_mesh(mesh: Any, name: str) -> Any:
    """A multi-dimensional mesh's ranks as one named dimension (FSDP over dp x cp)."""
    MESH_FLATTEN_METHOD.load()
    return mesh._flatten(name)


# ---- CUDA allocator history ------------------------------------------------------------------

RECORD_HISTORY = _declare(ALLOCATOR_SNAPSHOT, "torch.cuda.memory", "_record_memory_history")
DUMP_SNAPSHOT = _declare(ALLOCATOR_SNAPSHOT, "torch.cuda.memory", "_dump_snapshot")


def record_memory_history(**options: Any) -> None:
    RECORD_HISTORY.load()(**options)


def dump_snapshot(path: str) -> None:
    DUMP_SNAPSHOT.load()(path)


# ---- What this torch supports ----------------------------------------------------------------


@dataclass(frozen=True)
class Support:
    """One feature on the installed torch: the pieces it lacks, each with why."""

    feature: str
    missing: tuple[tuple[Private, str], ...]

    @property
    def usable(self) -> bool:
        return all(piece.optional for piece, _ in self.missing)

    @property
    def as_expected(self) -> bool:
        """Nothing missing but optional pieces and those of a newer torch release than this
        one: unusable features of an older supported torch are not faults."""
        return all(piece.optional or newer_than_installed(piece.since) for piece, _ in self.missing)


def newer_than_installed(release: str) -> bool:
    """``release`` (``2.9``) is newer than the installed torch."""
    if not release:
        return False

    def numbers(text: str) -> tuple[int, ...]:
        return tuple(int(part) for part in text.split("+")[0].split(".")[:2])

    return numbers(release) > numbers(TORCH_VERSION)


def support() -> list[Support]:
    """Every feature, in declaration order, with what the installed torch lacks of it."""
    found: dict[str, list[tuple[Private, str]]] = {}
    for piece in PIECES:
        gone = found.setdefault(piece.feature, [])
        try:
            piece.load()
        except Missing as error:
            gone.append((piece, str(error.__cause__ or error)))
    return [Support(feature, tuple(gone)) for feature, gone in found.items()]
