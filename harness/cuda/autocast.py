"""CUDA's autocast rules, applied to CPU kernels: a CUDA target predicted without a GPU.

Autocast's op lists differ by device. CUDA runs ``layer_norm``, ``softmax``, ``log_softmax``,
``group_norm``, the losses and more in fp32 (saved for backward in fp32); CPU autocast leaves
most of them in the 16-bit type. A CUDA prediction on CPU kernels under CPU autocast therefore
saves 16-bit tensors where the card keeps fp32 ones: an activation-heavy fp16 encoder came out
27 % short that way.

The lists are not hand-copied here. The installed PyTorch registers a kernel at the
``AutocastCUDA`` dispatch key for every op it casts, and each kernel applies one policy of
``aten/src/ATen/autocast_mode.h`` (``lower_precision_fp``, ``fp32``, ``fp32_set_opt_dtype``,
``fp32_append_dtype``, ``promote``; a few ops are banned). Which ops are registered is read
from the dispatcher (``cuda_ops``); each op's policy is learnt (``rule_for``, the first time a
step calls the op) by calling the real CUDA kernel on fake CUDA tensors (forward only, which
needs no GPU): what came out and what the kernel handed the op underneath (cast inputs, an added
``dtype``) tell the policies apart. Ops whose probe cannot run (RNN cells, two matrix norms in
torch 2.14) run uncast and are reported. ``cuda_policies`` classifies them all at once (tests,
docs).

``cuda_autocast_rules()`` then registers, for the duration, a kernel at the ``AutocastCPU``
key of every op CUDA casts, applying CUDA's policy (with autocast's cache of cast weights, as
``cached_cast`` keeps it), and a fall-through for the ops only CPU autocast casts. Casts stay
above autograd, exactly where the C++ wrappers put them, so what autograd saves is what the
card saves.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import logging
import os
import sys
import warnings
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from harness.compat.internals import (
    FAKE_TENSOR_LOGGER,
    FakeTensorMode,
    OpOverload,
    TorchDispatchMode,
    destroy_library,
    disable_current_modes,
    excluding_dispatch_key,
    is_view,
    op_schema,
    registered_ops,
    tree_leaves,
)

LOW_PRECISION = (torch.float16, torch.bfloat16)


class Policy(enum.Enum):
    """The cast policies of ``at::autocast::CastPolicy`` (autocast_mode.h), plus banned ops."""

    LOWER_PRECISION_FP = "lower_precision_fp"  # inputs cast to the autocast dtype
    FP32 = "fp32"  # inputs cast to fp32
    FP32_SET_OPT_DTYPE = "fp32_set_opt_dtype"  # dtype=float32 unless given
    FP32_APPEND_DTYPE = "fp32_append_dtype"  # redispatched to the overload taking a dtype
    PROMOTE = "promote"  # inputs cast to the widest floating type among them
    BANNED = "banned"  # refused under autocast (binary_cross_entropy)


@dataclass(frozen=True)
class Rule:
    policy: Policy
    redispatch: str | None = None  # fp32_append_dtype: the overload that takes the dtype
    message: str | None = None  # banned: CUDA autocast's own error


@dataclass(frozen=True)
class Policies:
    """CUDA's autocast rules as the installed PyTorch registers them."""

    rules: dict[str, Rule]  # "aten::layer_norm" -> Rule
    cpu_only: tuple[str, ...]  # ops CPU autocast casts and CUDA's does not
    unclassified: tuple[str, ...]  # CUDA-registered ops whose probe could not run


def overload(name: str) -> OpOverload:
    """``aten::pow.Tensor_Scalar`` -> ``torch.ops.aten.pow.Tensor_Scalar``."""
    namespace, _, rest = name.partition("::")
    base, _, variant = rest.partition(".")
    return getattr(getattr(getattr(torch.ops, namespace), base), variant or "default")


@functools.cache
def cuda_ops() -> tuple[str, ...]:
    """The ops CUDA autocast casts, as the installed PyTorch registers them."""
    return tuple(registered_ops("AutocastCUDA"))


@functools.cache
def cpu_only_ops() -> tuple[str, ...]:
    """The ops CPU autocast casts and CUDA autocast does not."""
    cuda = set(cuda_ops())
    return tuple(name for name in registered_ops("AutocastCPU") if name not in cuda)


@functools.cache
def rule_for(name: str) -> Rule | None:
    """``name``'s CUDA policy (``classify``), learnt the first time it is asked for: a step
    calls a handful of these ops, and each costs a few milliseconds to probe. Whatever modes
    are active (a prediction's fake tensors and trackers) are set aside for the probe."""
    with disable_current_modes(), _cuda_autocast_enabled(), _quiet():
        return classify(name)


def cuda_policies() -> Policies:
    """Every op of the installed PyTorch's CUDA autocast lists, classified (a few seconds)."""
    rules = {name: rule_for(name) for name in cuda_ops()}
    return Policies(
        {name: rule for name, rule in rules.items() if rule is not None},
        cpu_only_ops(),
        tuple(name for name, rule in rules.items() if rule is None),
    )


@contextlib.contextmanager
def _cuda_autocast_enabled() -> Iterator[None]:
    """CUDA autocast switched on at the C level: ``torch.autocast("cuda")`` refuses (with a
    warning) where no GPU is present, but the dispatcher's CUDA kernels run on fake tensors."""
    enabled, dtype = torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")
    torch.set_autocast_enabled("cuda", True)
    torch.set_autocast_dtype("cuda", torch.float16)
    try:
        yield
    finally:
        torch.set_autocast_enabled("cuda", enabled)
        torch.set_autocast_dtype("cuda", dtype)


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Probes that fail on purpose stay silent: Python warnings, fake-tensor error logs, and
    C++ warnings (deprecated ops), which PyTorch writes to the process's stderr directly."""
    logger = logging.getLogger(FAKE_TENSOR_LOGGER)
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        logger.setLevel(level)


class _Seen(Exception):
    """Raised by the probe at the first op below autocast, carrying what reached it."""


class _FirstCallBelowAutocast(TorchDispatchMode):
    """Sees the op the autocast kernel hands its (possibly cast) inputs to, and stops there;
    the casts themselves (``_to_copy``) and device queries pass."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func.namespace == "prim" or func is torch.ops.aten._to_copy.default:
            return func(*args, **kwargs)
        leaves = tree_leaves((args, kwargs))
        floats = [t.dtype for t in leaves if isinstance(t, torch.Tensor) and t.is_floating_point()]
        dtypes = [x for x in leaves if isinstance(x, torch.dtype)]
        raise _Seen(func, floats, dtypes)


# Tensor shapes tried in turn until an op accepts its probe (ops check ranks and sizes); with
# ``vectors``, a ``weight``/``bias`` is one value per channel and a ``target`` one per sample.
_PROFILES = (
    ((2, 2), False),
    ((2, 2, 2, 2), False),
    ((2, 2, 2, 2, 2), False),
    ((3,), False),
    ((2, 2, 2), False),
    ((2,), False),
    ((2, 2), True),
    ((2, 2, 2, 2), True),
)


def _probe_args(
    op: OpOverload, shape: tuple[int, ...], vectors: bool, dtypes: list[torch.dtype]
) -> Any:
    """Arguments for ``op`` from its schema: fake CUDA tensors of ``shape`` (the n-th tensor in
    ``dtypes[n]``, the last repeated), defaults elsewhere, small numbers where required."""
    made: list[torch.dtype] = []

    def tensor(name: str) -> torch.Tensor:
        dtype = dtypes[min(len(made), len(dtypes) - 1)]
        made.append(dtype)
        size = shape
        if vectors and name in ("weight", "bias") and len(shape) > 1:
            size = (shape[1],)
        elif vectors and name == "target":
            size = shape[:1]
        return torch.empty(size, device="cuda", dtype=dtype)

    def value(argument: Any) -> Any:
        kind = str(argument.type)
        if kind in ("Tensor", "Optional[Tensor]"):
            return tensor(argument.name)
        if kind in ("List[Tensor]", "List[Optional[Tensor]]"):
            return [tensor(argument.name), tensor(argument.name)]
        if argument.name == "dim" and kind == "Optional[int]":
            return -1  # an explicit dim: cross warns when it has to guess one
        if argument.has_default_value():
            return argument.default_value
        return {
            "int": 1,
            "SymInt": 1,
            "List[int]": [shape[-1]],
            "List[SymInt]": [shape[-1]],
            "float": 1.0,
            "bool": False,
            "str": "ij,jk->ik",
            "number": 2.0,
            "Scalar": 2.0,
        }.get(kind)

    positional = [value(a) for a in op_schema(op).arguments if not a.kwarg_only]
    keywords = {
        a.name: value(a)
        for a in op_schema(op).arguments
        if a.kwarg_only and not a.has_default_value()
    }
    return positional, keywords


def _observe(op: OpOverload, dtypes: list[torch.dtype]) -> tuple[Any, ...] | str:
    """What the CUDA autocast kernel of ``op`` passed below itself, for inputs of ``dtypes``:
    ``(func, float input dtypes, dtype arguments)``; or the error text if no shape worked."""
    error = ""
    for shape, vectors in _PROFILES:
        with FakeTensorMode(allow_non_fake_inputs=True):
            args, kwargs = _probe_args(op, shape, vectors, dtypes)
            try:
                with _FirstCallBelowAutocast():
                    op(*args, **kwargs)
            except _Seen as seen:
                return tuple(seen.args)
            except Exception as failure:  # a shape the op refuses: the next profile
                error = str(failure)
                if "autocast" in error and "unsafe" in error:
                    return error
    return error or "no op below autocast"


def _output_dtype(op: OpOverload, dtypes: list[torch.dtype]) -> torch.dtype | None:
    """The dtype ``op`` returns under CUDA autocast for inputs of ``dtypes`` (fake CUDA
    tensors); None where no probe shape runs."""
    for shape, vectors in _PROFILES:
        with FakeTensorMode(allow_non_fake_inputs=True):
            args, kwargs = _probe_args(op, shape, vectors, dtypes)
            try:
                out = op(*args, **kwargs)
            except Exception:
                continue
        first = next((t for t in tree_leaves(out) if isinstance(t, torch.Tensor)), None)
        return None if first is None else first.dtype
    return None


def classify(name: str) -> Rule | None:
    """``name``'s CUDA autocast policy, read off its real CUDA kernel; None if unprobeable.

    What comes out decides first: an fp16 result from fp32 inputs is ``lower_precision_fp``;
    an fp32 result from fp16 inputs is one of the fp32 policies, told apart by what the kernel
    passed below itself (inputs cast up: ``fp32``; a float32 ``dtype`` added: ``set_opt_dtype``
    when the op takes one, else ``append_dtype`` to the overload it called); fp16 in, fp16 out
    and an fp16 input cast up beside an fp32 one is ``promote``. (A composite's own internal
    casts, such as math attention's upcast, look like autocast's below the kernel, which is
    why the result is read first.) Ops that cannot run whole on fake tensors are read from
    what reached the op below alone."""
    op = overload(name)
    narrow = _observe(op, [torch.float32])
    if isinstance(narrow, str):
        if "autocast" in narrow and "unsafe" in narrow:
            return Rule(Policy.BANNED, message=narrow.splitlines()[0])
        return None
    out_narrow = _output_dtype(op, [torch.float32])
    if out_narrow in LOW_PRECISION or (
        out_narrow is None and narrow[1] and all(d == torch.float16 for d in narrow[1])
    ):
        return Rule(Policy.LOWER_PRECISION_FP)
    wide = _observe(op, [torch.float16])
    if isinstance(wide, str):
        return None
    func, floats, dtype_args = wide
    out_wide = _output_dtype(op, [torch.float16])
    takes_dtype = any(a.name == "dtype" for a in op_schema(op).arguments)
    if torch.float32 in dtype_args or (out_wide == torch.float32 and takes_dtype):
        if takes_dtype:
            return Rule(Policy.FP32_SET_OPT_DTYPE)
        return Rule(Policy.FP32_APPEND_DTYPE, redispatch=func.name())
    if floats and all(d == torch.float32 for d in floats) and out_wide != torch.float16:
        return Rule(Policy.FP32)
    mixed = _output_dtype(op, [torch.float16, torch.float32])
    mixed_inner = _observe(op, [torch.float16, torch.float32])
    if mixed == torch.float32 or (
        not isinstance(mixed_inner, str)
        and mixed_inner[1]
        and all(d == torch.float32 for d in mixed_inner[1])
    ):
        return Rule(Policy.PROMOTE)
    return None


class _CastCache:
    """Autocast's cache of cast weights (``cached_cast`` in autocast_mode.cpp): a leaf fp32
    tensor that requires grad, cast to the autocast dtype, is cast once per autocast region
    and the copy held until the region ends, which is why a weight used twice costs one copy
    and why the copies live until the outermost autocast exits."""

    def __init__(self) -> None:
        self.casts: dict[int, tuple[weakref.ref[torch.Tensor], torch.Tensor]] = {}

    def cast(self, tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        cacheable = (
            dtype == torch.get_autocast_dtype("cpu")
            and tensor.dtype == torch.float32
            and tensor.requires_grad
            and tensor.is_leaf
            and not is_view(tensor)
            and torch.is_autocast_cache_enabled()
        )
        if not cacheable:
            return tensor.to(dtype)
        found = self.casts.get(id(tensor))
        if found is not None and found[0]() is tensor:
            return found[1]
        cast = tensor.to(dtype)
        self.casts[id(tensor)] = (weakref.ref(tensor), cast)
        return cast

    def clear(self) -> None:
        self.casts.clear()


def _eligible(value: Any) -> bool:
    """``is_eligible`` of autocast_mode.h, for the CPU tensors the prediction runs on."""
    return (
        isinstance(value, torch.Tensor)
        and value.is_floating_point()
        and value.dtype != torch.float64
    )


def _promote_type(values: list[Any]) -> torch.dtype:
    """``promote_type`` of autocast_mode.h: fp32 wins over the autocast dtype; fp64 ignored."""
    current = torch.get_autocast_dtype("cpu")
    for value in values:
        tensors = value if isinstance(value, (list, tuple)) else [value]
        for tensor in tensors:
            if _eligible(tensor) and tensor.dtype == torch.float32:
                current = torch.float32
    return current


def _with_defaults(op: OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
    """Every positional argument of ``op``'s schema, defaults filled in: a C++ wrapper gets them
    all, a Python kernel only those the caller passed, and the overload redispatched to (with
    its dtype appended) requires them."""
    values = []
    for index, argument in enumerate(a for a in op_schema(op).arguments if not a.kwarg_only):
        if index < len(args):
            values.append(args[index])
        elif argument.name in kwargs:
            values.append(kwargs[argument.name])
        else:
            values.append(argument.default_value)
    return values


def _kernel(name: str, cache: _CastCache, unclassified: set[str]) -> Callable[..., Any]:
    """The ``AutocastCPU`` kernel applying ``name``'s CUDA rule as CUDA's wrapper does
    (autocast excluded below it, casts recorded by autograd); an op whose rule could not be
    learnt runs uncast and is reported in ``unclassified``."""
    op = overload(name)
    dtype_index = next(
        (i for i, a in enumerate(op_schema(op).arguments) if a.name == "dtype"), None
    )

    def cast_all(values: Any, dtype: torch.dtype) -> Any:
        if isinstance(values, (list, tuple)):
            return type(values)(cast_all(v, dtype) for v in values)
        return cache.cast(values, dtype) if _eligible(values) and values.dtype != dtype else values

    def run(*args: Any, **kwargs: Any) -> Any:
        rule = rule_for(name)
        with excluding_dispatch_key("AutocastCPU"):
            if rule is None:
                unclassified.add(name)
                return op(*args, **kwargs)
            policy = rule.policy
            if policy is Policy.BANNED:
                raise RuntimeError(rule.message)
            casts = {
                Policy.LOWER_PRECISION_FP: lambda: torch.get_autocast_dtype("cpu"),
                Policy.FP32: lambda: torch.float32,
                Policy.PROMOTE: lambda: _promote_type([*args, *kwargs.values()]),
            }
            if policy in casts:  # every floating input cast to one type, then the op
                dtype = casts[policy]()
                cast_kwargs = {k: cast_all(v, dtype) for k, v in kwargs.items()}
                return op(*cast_all(args, dtype), **cast_kwargs)
            first = args[0] if args else None
            if policy is Policy.FP32_SET_OPT_DTYPE:
                if not _eligible(first):
                    return op(*args, **kwargs)
                if dtype_index is not None and dtype_index < len(args):
                    if args[dtype_index] is None:
                        args = (*args[:dtype_index], torch.float32, *args[dtype_index + 1 :])
                elif kwargs.get("dtype") is None:
                    kwargs = {**kwargs, "dtype": torch.float32}
                return op(*args, **kwargs)
            assert rule.redispatch is not None  # fp32_append_dtype
            redispatch = overload(rule.redispatch)
            assert first is not None  # these ops (sum, softmax, cumsum, ...) take a tensor first
            out_type = torch.float32 if _eligible(first) else first.dtype
            return redispatch(*_with_defaults(op, args, kwargs), dtype=out_type)

    return run


@contextlib.contextmanager
def cuda_autocast_rules() -> Iterator[set[str]]:
    """While active, ``torch.autocast("cpu", ...)`` casts as CUDA autocast does.

    Kernels are registered at ``AutocastCPU`` through ``torch.library`` (which restores the
    CPU ones when the library is destroyed); ``torch.clear_autocast_cache`` (what autocast's
    ``__exit__`` calls when the outermost region ends) also empties this cast cache. Yields the
    set of ops that ran uncast for want of a rule (for the prediction's note)."""
    cache = _CastCache()
    unclassified: set[str] = set()
    libraries: dict[str, torch.library.Library] = {}
    original_clear = torch.clear_autocast_cache

    def register(name: str, kernel: Callable[..., Any]) -> None:
        # Each op in its own namespace's library: CUDA autocast also casts other libraries'
        # ops (torchvision::deform_conv2d), which ``aten`` would take as a second definition.
        namespace, _, op = name.partition("::")
        if namespace not in libraries:
            libraries[namespace] = torch.library.Library(namespace, "IMPL")
        libraries[namespace].impl(op, kernel, "AutocastCPU")

    def clear() -> None:
        cache.clear()
        original_clear()

    try:  # a registration that fails still leaves every one before it undone
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "Overriding a previously registered kernel"
            for name in cuda_ops():
                register(name, _kernel(name, cache, unclassified))
            for name in cpu_only_ops():
                register(name, torch.library.fallthrough_kernel)
        torch.clear_autocast_cache = clear
        yield unclassified
    finally:
        torch.clear_autocast_cache = original_clear
        cache.clear()
        for library in libraries.values():
            destroy_library(library)
