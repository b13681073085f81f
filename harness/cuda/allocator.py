"""PyTorch's CUDA caching allocator, modelled in pure Python so any machine can replay it.

What a card runs out of is the allocator's *reserved* segments, not the bytes tensors hold
(docs/cards.md). This module re-implements, decision for decision, the default pool of
``DeviceCachingAllocator`` in ``c10/cuda/CUDACachingAllocator.cpp`` and the settings parser of
``c10/core/AllocatorConfig.cpp`` / ``c10/cuda/CUDAAllocatorConfig.cpp`` (PYTORCH_CUDA_ALLOC_CONF),
for one device, streams as plain ints, no CUDA graphs or private pools. A replay of a recorded
allocation sequence (``torch.cuda.memory._snapshot()``) drives :class:`CachingAllocator` and
compares its :class:`Decision` log (``segment_alloc``/``segment_free``/``segment_map``/
``segment_unmap``, the snapshot trace's action names) with the card's.

Source followed: the newest ``CUDACachingAllocator.cpp`` in the reference store (the version that
reads ``AcceleratorAllocatorConfig::large_segment_size()`` for the 1-10 MiB segment and the
expandable large-pool page, and ``CUDAAllocatorConfig::per_process_memory_fraction()`` in the
``DeviceCachingAllocator`` constructor), with the settings of the installed torch 2.14.1 headers
(``c10/core/AllocatorConfig.h``, ``c10/cuda/CUDAAllocatorConfig.h``: the key list, the
``large_segment_size_mb`` and ``max_non_split_rounding_mb`` knobs). Function and constant names
below are the source's, so a reader can put the two side by side. No code is copied.

Standard library only (the sweep layer and CPU-only boxes import it); never imports torch.
"""

from __future__ import annotations

import difflib
import math
import random
import time
from bisect import bisect_left, insort
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple, overload

MiB = 1024 * 1024

# The source's constants (c10/core/AllocatorConfig.h and CUDACachingAllocator.cpp).
kMinBlockSize = 512  # every request is rounded up to a multiple of 512 B
kSmallSize = 1 * MiB  # the largest request the small pool serves
kSmallBuffer = 2 * MiB  # small-pool segments (and small expandable pages) are 2 MiB
kMinLargeAlloc = 10 * MiB  # requests in (1 MiB, 10 MiB) get a large_segment_size segment
kRoundLarge = 2 * MiB  # larger requests get a segment rounded up to 2 MiB
kLargeBuffer = 20 * MiB  # default large_segment_size (large_segment_size_ in AllocatorConfig.h)

# AcceleratorAllocatorConfig::roundup_power2_divisions keeps one entry per power-of-two interval
# from 1 MiB (kRoundUpPowerOfTwoStart) to 64 GiB (kRoundUpPowerOfTwoEnd): 16 entries, the first
# also covering everything below 2 MiB and the last everything from 32 GiB up.
kRoundUpPowerOfTwoIntervals = 16
_INTERVAL_START_LOG2 = 20  # log2(1 MiB)
_SIZE_MAX = (1 << 64) - 1  # the source's "no limit" for max_split_size
_NO_ROUNDUP: tuple[int, ...] = (0,) * kRoundUpPowerOfTwoIntervals
_SEGMENT_ALIGN = 2 * MiB  # simulated cudaMalloc addresses are 2 MiB aligned
_ADDRESS_BASE = 0x7F00_0000_0000  # where simulated device addresses start
_DEFAULT_VA_BASIS = 1 << 40  # device memory assumed for an expandable VA range when unknown

# Decision kinds: TraceEntry::SEGMENT_ALLOC/FREE/MAP/UNMAP as the memory snapshot names them.
SEGMENT_ALLOC = "segment_alloc"
SEGMENT_FREE = "segment_free"
SEGMENT_MAP = "segment_map"
SEGMENT_UNMAP = "segment_unmap"

ENV_NAME = "PYTORCH_CUDA_ALLOC_CONF"

# Keys PyTorch 2.14 accepts (AcceleratorAllocatorConfig::getKeys plus CUDAAllocatorConfig's)
# that change nothing this model decides: host/pinned memory, locking, graph capture. They are
# validated as the source does and kept, so text() gives the setting back.
_INERT_KEYS: dict[str, str] = {
    "pinned_use_background_threads": "bool",
    "pinned_max_round_threshold_mb": "size",
    "pinned_max_cached_size_mb": "size",
    "release_lock_on_cudamalloc": "bool",
    "release_lock_on_hipmalloc": "bool",
    "pinned_use_cuda_host_register": "bool",
    "pinned_use_hip_host_register": "bool",
    "graph_capture_record_stream_reuse": "bool",
    "pinned_reserve_segment_size_mb": "positive",
    "pinned_num_register_threads": "threads",
    "pinned_free_catch_all": "bool",
    # Preemptive OOM rejection before cudaMalloc (off by default): not modelled.
    "throw_on_cudamalloc_oom": "bool",
}
_MODELLED_KEYS = (
    "large_segment_size_mb",
    "max_split_size_mb",
    "max_non_split_rounding_mb",
    "garbage_collection_threshold",
    "roundup_power2_divisions",
    "expandable_segments",
    "per_process_memory_fraction",
    "backend",
)
_ALL_KEYS = (*_MODELLED_KEYS, *_INERT_KEYS)
_ALLOWED_BY_KIND = {
    "bool": "True or False",
    "size": "a non-negative integer",
    "positive": "an integer > 0",
    "threads": "a power of 2 <= 128",
}


# ---------------------------------------------------------------------------------------------
# Settings: PYTORCH_CUDA_ALLOC_CONF
# ---------------------------------------------------------------------------------------------


def _error(key: str, value: str, problem: str, allowed: str) -> ValueError:
    """One line naming the key, its value and what is allowed (the spec's error style)."""
    shown = f"{key}:{value}" if value else key
    return ValueError(f"{ENV_NAME}: {shown}: {problem} (allowed: {allowed})")


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _tokenize(text: str) -> list[str]:
    """Split as ``ConfigTokenizer`` does: ``, : [ ]`` are tokens of their own, whitespace is
    dropped, everything else accumulates into words."""
    tokens: list[str] = []
    buf: list[str] = []
    for ch in text:
        if ch in ",:[]":
            if buf:
                tokens.append("".join(buf))
                buf = []
            tokens.append(ch)
        elif not ch.isspace():
            buf.append(ch)
    if buf:
        tokens.append("".join(buf))
    return tokens


def _entries(text: str) -> list[tuple[str, str | list[tuple[str, str]]]]:
    """``key:value`` or ``key:[k:v,...]`` pairs separated by commas (a trailing comma is fine,
    as ``CUDAAllocatorConfig::parseArgs`` checks a comma only before another token)."""
    tokens = _tokenize(text)
    out: list[tuple[str, str | list[tuple[str, str]]]] = []
    i, n = 0, len(tokens)
    while i < n:
        key = tokens[i]
        if key in ",:[]":
            raise _error(key, "", "expected a key here", "key:value pairs separated by commas")
        if i + 1 >= n or tokens[i + 1] != ":":
            raise _error(key, "", "has no ':value'", "key:value pairs separated by commas")
        i += 2
        if i >= n or tokens[i] in ",:]":
            raise _error(key, "", "has no value", "key:value pairs separated by commas")
        if tokens[i] == "[":
            items: list[tuple[str, str]] = []
            i += 1
            while i < n and tokens[i] != "]":
                if i + 2 >= n or tokens[i + 1] != ":" or tokens[i + 2] in ",:[]":
                    raise _error(key, "[...", "malformed list entry", "[interval:value,...]")
                items.append((tokens[i], tokens[i + 2]))
                i += 3
                if i < n and tokens[i] == ",":
                    i += 1
                elif i < n and tokens[i] != "]":
                    raise _error(key, "[...", "malformed list", "[interval:value,...]")
            if i >= n:
                raise _error(key, "[...", "the list has no closing ']'", "[interval:value,...]")
            i += 1
            out.append((key, items))
        else:
            out.append((key, tokens[i]))
            i += 1
        if i < n:
            if tokens[i] != ",":
                raise _error(key, "", f"expected ',' before {tokens[i]!r}", "comma-separated")
            i += 1
    return out


def _to_int(key: str, value: str, allowed: str) -> int:
    if not value.isdigit():
        raise _error(key, value, "not an integer", allowed)
    return int(value)


def _to_float(key: str, value: str, allowed: str) -> float:
    try:
        number = float(value)
    except ValueError:
        raise _error(key, value, "not a number", allowed) from None
    if not math.isfinite(number):
        raise _error(key, value, "not a finite number", allowed)
    return number


def _to_bool(key: str, value: str) -> bool:
    """``ConfigTokenizer::toBool``: exactly ``True`` or ``False``."""
    if value == "True":
        return True
    if value == "False":
        return False
    raise _error(key, value, "not a bool", "True or False")


def _scalar(key: str, value: str | list[tuple[str, str]]) -> str:
    if isinstance(value, list):
        raise _error(key, "[...]", "takes a single value, not a list", "a single value")
    return value


def _parse_divisions(value: str | list[tuple[str, str]]) -> tuple[int, ...]:
    """``AcceleratorAllocatorConfig::parseRoundUpPower2Divisions``.

    A single value applies to every interval (it must be a power of 2). The list form sets the
    interval that starts at each ``N`` MiB (``N`` a power of 2; index log2(N), clamped to the
    16 entries); the first entry also fills every interval below it, ``>`` fills every interval
    after the last one named, and unnamed gaps keep 0 (no rounding). Values are powers of 2 or 0.
    """
    key = "roundup_power2_divisions"
    if not isinstance(value, list):
        number = _to_int(key, value, "a power of 2, or [MiB:divisions,...,>:divisions]")
        if not _is_pow2(number):
            raise _error(key, value, "not a power of 2", "a power of 2 (1, 2, 4, 8, ...)")
        return (number,) * kRoundUpPowerOfTwoIntervals
    divisions = [0] * kRoundUpPowerOfTwoIntervals
    first, last_index = True, 0
    for boundary, raw in value:
        shown = f"[{boundary}:{raw}]"
        number = _to_int(key, raw, "a power of 2 or 0 for each interval")
        if number != 0 and not _is_pow2(number):
            raise _error(key, shown, "divisions not a power of 2 or 0", "1, 2, 4, ... or 0")
        if boundary == ">":
            for k in range(last_index + 1, kRoundUpPowerOfTwoIntervals):
                divisions[k] = number
            continue
        start = _to_int(key, boundary, "interval starts in MiB, powers of 2, or '>'")
        if not _is_pow2(start):
            raise _error(key, shown, "interval start not a power of 2", "1, 2, 4, ... MiB or >")
        index = min(start.bit_length() - 1, kRoundUpPowerOfTwoIntervals - 1)
        if first:
            for k in range(index):
                divisions[k] = number
            first = False
        divisions[index] = number
        last_index = index
    return tuple(divisions)


def _divisions_text(divisions: tuple[int, ...]) -> str:
    """The shortest text ``_parse_divisions`` reads back to ``divisions``: one value when every
    interval agrees, else the leading run as its first entry, the middle one by one, ``>`` for
    the trailing run."""
    if len(set(divisions)) == 1:
        return str(divisions[0])
    last = kRoundUpPowerOfTwoIntervals - 1
    head = 0
    while head < last and divisions[head + 1] == divisions[0]:
        head += 1
    tail = last
    while tail > head + 1 and divisions[tail - 1] == divisions[last]:
        tail -= 1
    parts = [f"{1 << head}:{divisions[head]}"]
    parts += [f"{1 << k}:{divisions[k]}" for k in range(head + 1, tail)]
    if tail > head:
        parts.append(f">:{divisions[tail]}")
    return "[" + ",".join(parts) + "]"


def _normalise_divisions(value: Any) -> tuple[int, ...]:
    if isinstance(value, bool):
        raise ValueError(f"roundup_power2_divisions: {value!r} is not a number of divisions")
    if isinstance(value, int):
        divisions = (value,) * kRoundUpPowerOfTwoIntervals
    else:
        divisions = tuple(int(v) for v in value)
    if len(divisions) != kRoundUpPowerOfTwoIntervals:
        raise ValueError(
            f"roundup_power2_divisions: {len(divisions)} entries "
            f"(allowed: one int or {kRoundUpPowerOfTwoIntervals}, one per power-of-2 interval "
            "from 1 MiB)"
        )
    for d in divisions:
        if d != 0 and not _is_pow2(d):
            raise ValueError(f"roundup_power2_divisions: {d} (allowed: a power of 2 or 0)")
    return divisions


def roundup_power2_next_division(size: int, divisions: int) -> int:
    """``roundup_power2_next_division``: round ``size`` up to the next of ``divisions`` equal
    steps between the powers of 2 around it (1200 with 4 divisions: 1024, 1280, ... -> 1280);
    a power of 2 stays itself; a step below one byte means the next power of 2."""
    if size & (size - 1) == 0:
        return size
    floor = 1 << (size.bit_length() - 1)
    step = floor >> (divisions.bit_length() - 1)
    if step == 0:
        return floor << 1
    low = size & ~(step - 1)
    return size if low == size else low + step


@dataclass(frozen=True)
class AllocatorConfig:
    """The caching allocator's settings, as PYTORCH_CUDA_ALLOC_CONF sets them (bytes, not MiB).

    Defaults are the source's: no split limit (``SIZE_MAX``), no power-of-2 rounding, no garbage
    collection, no expandable segments, 20 MiB (``kLargeBuffer``) large segments and
    non-split rounding, the whole card (fraction 1.0).
    """

    max_split_size: int | None = None  # bytes; None = no limit (the source's SIZE_MAX)
    # One entry per power-of-2 interval from 1 MiB (an int here means every interval).
    roundup_power2_divisions: tuple[int, ...] = _NO_ROUNDUP
    garbage_collection_threshold: float = 0.0
    expandable_segments: bool = False
    large_segment_size: int = kLargeBuffer
    # None: the same as large_segment_size (parseArgs resets it to that before reading keys).
    max_non_split_rounding_size: int | None = None
    per_process_memory_fraction: float = 1.0
    # Accepted keys with no effect on the model, kept (key, raw value) so text() is faithful.
    inert: tuple[tuple[str, str], ...] = field(default=())

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "roundup_power2_divisions", _normalise_divisions(self.roundup_power2_divisions)
        )
        large = self.large_segment_size
        if large % MiB or large <= kMinLargeAlloc:
            raise ValueError(
                f"large_segment_size: {large} (allowed: whole MiB > {kMinLargeAlloc // MiB} MiB)"
            )
        for name in ("max_split_size", "max_non_split_rounding_size"):
            value = getattr(self, name)
            if value is not None and (value % MiB or value < large):
                raise ValueError(
                    f"{name}: {value} (allowed: None or whole MiB >= large_segment_size, "
                    f"{large // MiB} MiB)"
                )
        if self.max_non_split_rounding_size == large:
            object.__setattr__(self, "max_non_split_rounding_size", None)
        if not (
            self.garbage_collection_threshold == 0.0 or 0 < self.garbage_collection_threshold < 1
        ):
            raise ValueError(
                f"garbage_collection_threshold: {self.garbage_collection_threshold} "
                "(allowed: 0 for off, or in (0.0, 1.0))"
            )
        if not 0.0 <= self.per_process_memory_fraction <= 1.0:
            raise ValueError(
                f"per_process_memory_fraction: {self.per_process_memory_fraction} "
                "(allowed: [0.0, 1.0])"
            )

    @property
    def non_split_rounding_size(self) -> int:
        """``max_non_split_rounding_size()``: how much larger than an oversize request a cached
        oversize block may be and still serve it."""
        if self.max_non_split_rounding_size is None:
            return self.large_segment_size
        return self.max_non_split_rounding_size

    # -- parsing ------------------------------------------------------------------------------

    @classmethod
    def parse(cls, text: str) -> AllocatorConfig:
        """Read PYTORCH_CUDA_ALLOC_CONF text, validating every key as PyTorch 2.14 does.

        ``expandable_segments:True,max_split_size_mb:128,roundup_power2_divisions:4,
        garbage_collection_threshold:0.8``. An unknown key or a bad value raises ``ValueError``
        with one line naming the key and what is allowed.
        """
        return cls._parse(text, strict=True)

    @classmethod
    def _parse(cls, text: str, strict: bool) -> AllocatorConfig:
        entries = _entries(text)
        # parseArgs reads large_segment_size_mb first: the other sizes are checked against it.
        large_mb = kLargeBuffer // MiB
        for key, value in entries:
            if key == "large_segment_size_mb":
                large_mb = _to_int(key, _scalar(key, value), "an integer number of MiB > 10")
                if large_mb <= kMinLargeAlloc // MiB:
                    raise _error(key, str(value), "too small", "an integer number of MiB > 10")
        kwargs: dict[str, Any] = {"large_segment_size": large_mb * MiB}
        inert: list[tuple[str, str]] = []
        for key, value in entries:
            if key == "large_segment_size_mb":
                continue
            if key in ("max_split_size_mb", "max_non_split_rounding_mb"):
                allowed = f"an integer number of MiB >= {large_mb}, the large segment size"
                mb = _to_int(key, _scalar(key, value), allowed)
                if mb < large_mb:
                    raise _error(key, str(value), "too small", allowed)
                name = (
                    "max_split_size"
                    if key == "max_split_size_mb"
                    else "max_non_split_rounding_size"
                )
                kwargs[name] = mb * MiB
            elif key == "garbage_collection_threshold":
                allowed = "a number in (0.0, 1.0)"
                threshold = _to_float(key, _scalar(key, value), allowed)
                if not 0.0 < threshold < 1.0:
                    raise _error(key, str(value), "out of range", allowed)
                kwargs["garbage_collection_threshold"] = threshold
            elif key == "roundup_power2_divisions":
                kwargs["roundup_power2_divisions"] = _parse_divisions(value)
            elif key == "expandable_segments":
                kwargs["expandable_segments"] = _to_bool(key, _scalar(key, value))
            elif key == "per_process_memory_fraction":
                allowed = "a number in [0.0, 1.0]"
                fraction = _to_float(key, _scalar(key, value), allowed)
                if not 0.0 <= fraction <= 1.0:
                    raise _error(key, str(value), "out of range", allowed)
                kwargs["per_process_memory_fraction"] = fraction
            elif key == "backend":
                backend = _scalar(key, value)
                if backend == "cudaMallocAsync":
                    raise _error(key, backend, "not modelled (no caching allocator)", "native")
                if backend != "native":
                    raise _error(key, backend, "unknown backend", "native or cudaMallocAsync")
            elif key in _INERT_KEYS:
                inert.append((key, _check_inert(key, _scalar(key, value))))
            elif strict:
                close = difflib.get_close_matches(key, _ALL_KEYS, n=1)
                hint = f"; did you mean '{close[0]}'?" if close else ""
                raise ValueError(
                    f"{ENV_NAME}: unknown key '{key}' (allowed: {', '.join(_ALL_KEYS)}){hint}"
                )
        return cls(inert=tuple(inert), **kwargs)

    @classmethod
    def from_snapshot(cls, settings: Mapping[str, Any]) -> AllocatorConfig:
        """The settings a recorded run used: ``torch.cuda.memory._snapshot()["allocator_settings"]``.

        That dict (torch/csrc/cuda/Module.cpp, from ``SnapshotInfo::config_metadata``) holds the
        last settings text under ``PYTORCH_CUDA_ALLOC_CONF`` and the effective values under
        ``max_split_size`` (bytes; -1 for no limit, SIZE_MAX cast to int64),
        ``garbage_collection_threshold``, ``expandable_segments`` and
        ``roundup_power2_divisions`` (``{"1": d, "2": d, ..., "32768": d}``, keyed by each
        interval's start in MiB). The effective values win; the text supplies what the dict
        lacks (large_segment_size_mb, max_non_split_rounding_mb, per_process_memory_fraction).
        """
        base = cls._parse(str(settings.get(ENV_NAME) or ""), strict=False)
        changes: dict[str, Any] = {}
        if "max_split_size" in settings:
            raw = settings["max_split_size"]
            limit = None if raw is None or int(raw) < 0 or int(raw) >= _SIZE_MAX >> 1 else int(raw)
            changes["max_split_size"] = limit
        if "garbage_collection_threshold" in settings:
            changes["garbage_collection_threshold"] = float(
                settings["garbage_collection_threshold"]
            )
        if "expandable_segments" in settings:
            changes["expandable_segments"] = bool(settings["expandable_segments"])
        raw_div = settings.get("roundup_power2_divisions")
        if isinstance(raw_div, Mapping):
            divisions = [0] * kRoundUpPowerOfTwoIntervals
            for interval, value in raw_div.items():
                index = min(int(interval).bit_length() - 1, kRoundUpPowerOfTwoIntervals - 1)
                divisions[index] = int(value)
            changes["roundup_power2_divisions"] = tuple(divisions)
        elif isinstance(raw_div, Sequence) and not isinstance(raw_div, str):
            changes["roundup_power2_divisions"] = tuple(int(v) for v in raw_div)
        return replace(base, **changes)

    def text(self) -> str:
        """Canonical PYTORCH_CUDA_ALLOC_CONF text (``""`` for the defaults); ``parse`` reads it
        back to an equal config."""
        parts: list[str] = []
        if self.large_segment_size != kLargeBuffer:
            parts.append(f"large_segment_size_mb:{self.large_segment_size // MiB}")
        if self.max_split_size is not None:
            parts.append(f"max_split_size_mb:{self.max_split_size // MiB}")
        if self.max_non_split_rounding_size is not None:
            parts.append(f"max_non_split_rounding_mb:{self.max_non_split_rounding_size // MiB}")
        if self.garbage_collection_threshold:
            parts.append(f"garbage_collection_threshold:{self.garbage_collection_threshold!r}")
        if self.roundup_power2_divisions != _NO_ROUNDUP:
            divisions = _divisions_text(self.roundup_power2_divisions)
            parts.append(f"roundup_power2_divisions:{divisions}")
        if self.expandable_segments:
            parts.append("expandable_segments:True")
        if self.per_process_memory_fraction != 1.0:
            parts.append(f"per_process_memory_fraction:{self.per_process_memory_fraction!r}")
        parts += [f"{key}:{value}" for key, value in self.inert]
        return ",".join(parts)

    # -- the size rules -----------------------------------------------------------------------

    def divisions_for(self, size: int) -> int:
        """``AcceleratorAllocatorConfig::roundup_power2_divisions(size)``: the entry of the
        power-of-2 interval ``size`` falls in (log2(size) - 20, clamped to 0..15)."""
        index = size.bit_length() - 1 - _INTERVAL_START_LOG2
        index = 0 if index < 0 else min(index, kRoundUpPowerOfTwoIntervals - 1)
        return self.roundup_power2_divisions[index]

    def round_size(self, size: int) -> int:
        """``round_size``: at least kMinBlockSize; power-of-2 divisions where configured and the
        size exceeds ``kMinBlockSize * divisions``; else the next multiple of 512 B."""
        if size < kMinBlockSize:
            return kMinBlockSize
        divisions = self.divisions_for(size)
        if divisions > 1 and size > kMinBlockSize * divisions:
            return roundup_power2_next_division(size, divisions)
        return (size + kMinBlockSize - 1) // kMinBlockSize * kMinBlockSize

    def allocation_size(self, size: int) -> int:
        """``get_allocation_size`` of a rounded request: the cudaMalloc a miss asks for."""
        if size <= kSmallSize:
            return kSmallBuffer
        if size < kMinLargeAlloc:
            return self.large_segment_size
        return (size + kRoundLarge - 1) // kRoundLarge * kRoundLarge


def _check_inert(key: str, value: str) -> str:
    """Validate a key that does not change the model as the source does, and keep it."""
    kind = _INERT_KEYS[key]
    allowed = _ALLOWED_BY_KIND[kind]
    if kind == "bool":
        _to_bool(key, value)
    else:
        number = _to_int(key, value, allowed)
        if kind == "positive" and number <= 0:
            raise _error(key, value, "must be > 0", allowed)
        # parsePinnedNumRegisterThreads: a power of 2, at most pinned_max_register_threads().
        if kind == "threads" and not (_is_pow2(number) and number <= 128):
            raise _error(key, value, "not a power of 2 <= 128", allowed)
    return value


DEFAULT_CONFIG = AllocatorConfig()


# ---------------------------------------------------------------------------------------------
# The allocator
# ---------------------------------------------------------------------------------------------


class OutOfMemory(Exception):
    """``malloc`` found no block after every fallback (the source's ``OutOfMemoryError``)."""

    def __init__(self, message: str, size: int, alloc_size: int) -> None:
        super().__init__(message)
        self.size = size
        self.alloc_size = alloc_size


@dataclass(frozen=True, slots=True)
class Decision:
    """One segment-level decision, named as the memory snapshot's trace names it."""

    kind: str  # segment_alloc | segment_free | segment_map | segment_unmap
    address: int
    size: int
    stream: int


class BlockInfo(NamedTuple):
    address: int
    size: int
    allocated: bool


class SegmentInfo(NamedTuple):
    """A segment as the snapshot lists it (for an expandable segment: one mapped range)."""

    address: int
    size: int
    stream: int
    is_small: bool
    blocks: list[BlockInfo]


class _Segment:
    """A cudaMalloc'd segment, or an ``ExpandableSegment`` (a VA range mapped page by page)."""

    __slots__ = ("base", "expandable", "mapped", "page", "size", "small", "stream")

    def __init__(
        self, base: int, size: int, stream: int, small: bool, expandable: bool, page: int
    ) -> None:
        self.base = base
        self.size = size  # bytes of the segment; for an expandable one, its whole VA range
        self.stream = stream
        self.small = small
        self.expandable = expandable
        self.page = page  # segment_size_ of an ExpandableSegment (kSmallBuffer or large)
        self.mapped = 0  # mapped bytes (getMappedSize) of an expandable segment


class _Block:
    """``Block``: a piece of a segment, allocated or free, mapped or (expandable) not."""

    __slots__ = (
        "addr",
        "allocated",
        "gc_base",
        "mapped",
        "next",
        "prev",
        "requested",
        "seg",
        "size",
        "small",
        "stream",
    )

    def __init__(
        self, addr: int, size: int, stream: int, small: bool, seg: _Segment, mapped: bool = True
    ) -> None:
        self.addr = addr
        self.size = size
        self.stream = stream
        self.small = small
        self.seg = seg
        self.mapped = mapped
        self.allocated = False
        self.prev: _Block | None = None
        self.next: _Block | None = None
        self.gc_base = 0  # gc_count_base: the pool's get_free_blocks_call_count at insertion
        self.requested = 0


class _Pool:
    """``BlockPool``: free mapped blocks ordered as ``BlockComparatorSize`` (stream, size,
    address) and unmapped expandable ranges as ``BlockComparatorAddress`` (stream, address)."""

    __slots__ = ("blocks", "calls", "small", "unmapped")

    def __init__(self, small: bool) -> None:
        self.small = small
        self.blocks: list[tuple[int, int, int]] = []
        self.unmapped: list[tuple[int, int]] = []
        self.calls = 0  # get_free_blocks_call_count


class _Counter:
    """A read-only statistic of :class:`CachingAllocator` that reads one of its private
    counters (``allocated_bytes`` reads ``_allocated``): one line a statistic, not a property
    each. Assigning to it raises ``AttributeError``, as a property without a setter does."""

    __slots__ = ("attr",)

    def __init__(self, attr: str) -> None:
        self.attr = attr

    @overload
    def __get__(self, obj: None, owner: type | None = None) -> _Counter: ...
    @overload
    def __get__(self, obj: object, owner: type | None = None) -> int: ...
    def __get__(self, obj: object | None, owner: type | None = None) -> int | _Counter:
        return self if obj is None else getattr(obj, self.attr)

    def __set__(self, obj: object, value: int) -> None:
        raise AttributeError(f"read-only: the allocator keeps {self.attr} itself")


def _align(n: int) -> int:
    return (n + _SEGMENT_ALIGN - 1) // _SEGMENT_ALIGN * _SEGMENT_ALIGN


class CachingAllocator:
    """``DeviceCachingAllocator`` for one device: the default pools, decision for decision.

    ``capacity`` is what cudaMalloc (and cuMemCreate for expandable pages) can get in all (None:
    unlimited); ``memory_fraction`` of ``device_total`` is ``set_per_process_memory_fraction``
    (None: the config's ``per_process_memory_fraction``); ``device_total`` also sizes an
    expandable segment's VA range (1 1/8 of the card, as ``ExpandableSegment`` reserves).
    Addresses are simulated: each new segment at the next 2 MiB boundary above the last, as a
    card whose cudaMalloc returns increasing addresses.
    """

    def __init__(
        self,
        config: AllocatorConfig = DEFAULT_CONFIG,
        capacity: int | None = None,
        memory_fraction: float | None = None,
        device_total: int | None = None,
    ) -> None:
        if capacity is not None and capacity < 0:
            raise ValueError(f"capacity: {capacity} (allowed: bytes >= 0, or None)")
        if device_total is not None and device_total <= 0:
            raise ValueError(f"device_total: {device_total} (allowed: bytes > 0, or None)")
        self._capacity = capacity
        self._device_total = device_total
        self._small = _Pool(True)
        self._large = _Pool(False)
        self._by_addr: dict[int, _Block] = {}
        self._segments: dict[int, _Segment] = {}
        self._n_expandable = 0
        self._next_addr = _ADDRESS_BASE
        self._placed: int | None = None  # place_next_segment's address, for one cudaMalloc
        self._decisions: list[Decision] = []
        self._mark = 0
        self._allocated = 0
        self._requested = 0
        self._reserved = 0  # total_allocated_memory (== reserved_bytes: no private pools)
        self._peak_allocated = 0
        self._peak_reserved = 0
        self._peak_pending = False
        self._fragmentation = 0
        self.num_alloc_retries = 0
        self.num_ooms = 0
        self.num_device_alloc = 0
        self.num_device_free = 0
        self._allowed: int | None = None
        self.set_config(config)
        fraction = (
            config.per_process_memory_fraction if memory_fraction is None else memory_fraction
        )
        if memory_fraction is not None or fraction < 1.0:
            self.set_memory_fraction(fraction)

    # -- settings -----------------------------------------------------------------------------

    def set_config(self, config: AllocatorConfig) -> None:
        """``_set_allocator_settings``: new rules from the next call on; what is cached stays
        (blocks of expandable segments stay usable only while expandable_segments is on)."""
        self._config = config
        self._rounding = config.roundup_power2_divisions != _NO_ROUNDUP
        self._max_split = _SIZE_MAX if config.max_split_size is None else config.max_split_size
        self._non_split = config.non_split_rounding_size
        self._gc_threshold = config.garbage_collection_threshold
        self._expandable = config.expandable_segments

    @property
    def config(self) -> AllocatorConfig:
        return self._config

    def set_memory_fraction(self, fraction: float) -> None:
        """``setMemoryFraction``: below 1.0, cudaMalloc may hold at most
        ``int(fraction * device_total)`` (``allowed_memory_maximum``); 1.0 lifts the limit."""
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"memory_fraction: {fraction} (allowed: [0.0, 1.0])")
        if fraction >= 1.0:
            self._allowed = None
            return
        if self._device_total is None:
            raise ValueError("memory_fraction below 1.0 needs device_total (the card's bytes)")
        self._allowed = int(fraction * self._device_total)

    @property
    def allowed_memory_maximum(self) -> int | None:
        return self._allowed

    # -- the public calls ---------------------------------------------------------------------

    def place_next_segment(self, address: int | None) -> None:
        """The next fixed segment cudaMalloc makes goes at ``address`` (once), not above the
        others: a replay follows a recorded card whose driver returned lower or reused
        addresses, which decides best fit's ties (the lowest address wins). The caller makes
        sure the range is free; None withdraws it."""
        if address is not None and address % kSmallBuffer:
            raise ValueError(f"segment address {address:#x} (allowed: a multiple of 2 MiB)")
        self._placed = address

    def malloc(self, size: int, stream: int = 0) -> int:
        """``DeviceCachingAllocator::malloc``: the address of a block of at least ``size``.

        Best fit from the pool, else (after garbage collection, when a fraction and a threshold
        are set) a new segment, else free oversize cached blocks and retry, else free every
        cached unsplit segment and retry, else :class:`OutOfMemory`. A ``size`` of 0 is served
        as 512 B here (torch never passes 0 down: it returns a null pointer first).
        """
        self._mark = len(self._decisions)
        if size < 0:
            raise ValueError(f"size: {size} (allowed: bytes >= 0)")
        if self._rounding:
            rsize = self._config.round_size(size)
        elif size < kMinBlockSize:
            rsize = kMinBlockSize
        else:
            rsize = (size + kMinBlockSize - 1) & -kMinBlockSize
        small = rsize <= kSmallSize
        pool = self._small if small else self._large
        block = self._get_free_block(pool, rsize, stream)
        if block is None:
            block = self._malloc_slow(pool, rsize, stream, small)
        # should_split, then alloc_found_block: the remainder is the upper part.
        remaining = block.size - rsize
        if small or self._expandable:
            split = remaining >= kMinBlockSize
        else:
            split = rsize < self._max_split and remaining > kSmallSize
        if split:
            rest = _Block(block.addr + rsize, remaining, stream, small, block.seg)
            self._link_after(block, rest)
            block.size = rsize
            self._cache(rest, pool)
        block.allocated = True
        block.requested = size
        allocated = self._allocated + block.size
        self._allocated = allocated
        self._requested += size
        if allocated > self._peak_allocated:
            self._peak_allocated = allocated
        if self._peak_pending:
            self._peak_pending = False
            self._fragmentation = self._reserved - allocated
        return block.addr

    def free(self, address: int) -> None:
        """``free`` then ``free_block``: the block returns to its pool, merged with free
        neighbours of its segment (``try_merge_blocks``). Nothing is released to the device."""
        self._mark = len(self._decisions)
        block = self._by_addr.get(address)
        if block is None or not block.allocated:
            raise ValueError(f"free: {address:#x} is not an allocated block (invalid pointer)")
        block.allocated = False
        self._allocated -= block.size
        self._requested -= block.requested
        block.requested = 0
        pool = self._small if block.small else self._large
        self._merge_free_neighbours(block, pool)
        self._cache(block, pool)

    def empty_cache(self) -> None:
        """``emptyCache`` -> ``release_cached_blocks``: cudaFree every free unsplit segment and
        unmap every whole free page of expandable segments (large pool first, then small)."""
        self._mark = len(self._decisions)
        self._release_cached_blocks()

    def reset_peak(self) -> None:
        """``reset_peak_memory_stats``: the peaks become the current values."""
        self._peak_allocated = self._allocated
        self._peak_reserved = self._reserved
        self._fragmentation = self._reserved - self._allocated
        self._peak_pending = False

    # -- statistics ---------------------------------------------------------------------------

    # ``allocated_bytes.all.current``: rounded sizes of allocated blocks.
    allocated_bytes = _Counter("_allocated")
    # ``requested_bytes.all.current``: the sizes asked for, before rounding.
    requested_bytes = _Counter("_requested")
    # ``reserved_bytes.all.current``: cudaMalloc'd segments plus mapped expandable pages.
    reserved_bytes = _Counter("_reserved")
    peak_allocated_bytes = _Counter("_peak_allocated")
    peak_reserved_bytes = _Counter("_peak_reserved")
    # ``active_bytes``: allocated plus blocks freed while another stream still uses them; with
    # no record_stream events in a replay, the same as allocated.
    active_bytes = allocated_bytes
    peak_active_bytes = peak_allocated_bytes
    # Reserved minus allocated when the peak reservation was reached (measured as the call that
    # raised the peak returned, its own block counted).
    fragmentation_bytes = _Counter("_fragmentation")

    @property
    def fragmentation_share(self) -> float:
        """``fragmentation_bytes`` as a share of the peak reservation (0 when none)."""
        return self._fragmentation / self._peak_reserved if self._peak_reserved else 0.0

    def memory_stats(self) -> dict[str, int]:
        """The counters under ``torch.cuda.memory_stats()``'s names (aggregate pool only)."""
        return {
            "allocated_bytes.all.current": self._allocated,
            "allocated_bytes.all.peak": self._peak_allocated,
            "active_bytes.all.current": self._allocated,
            "active_bytes.all.peak": self._peak_allocated,
            "requested_bytes.all.current": self._requested,
            "reserved_bytes.all.current": self._reserved,
            "reserved_bytes.all.peak": self._peak_reserved,
            "num_alloc_retries": self.num_alloc_retries,
            "num_ooms": self.num_ooms,
            "num_device_alloc": self.num_device_alloc,
            "num_device_free": self.num_device_free,
        }

    @property
    def decisions(self) -> list[Decision]:
        """Every segment decision so far, in order (the live list: do not mutate)."""
        return self._decisions

    @property
    def last_decisions(self) -> tuple[Decision, ...]:
        """The decisions of the last ``malloc``/``free``/``empty_cache`` call (an OutOfMemory
        call's releases included); empty when it was served from the cache."""
        return tuple(self._decisions[self._mark :])

    def segments(self) -> list[SegmentInfo]:
        """The segments as ``memory_snapshot()`` lists them, by address: a cudaMalloc'd segment
        whole, an expandable segment as one entry per contiguous mapped range."""
        out: list[SegmentInfo] = []
        for seg in self._segments.values():
            block: _Block | None = self._by_addr[seg.base]
            run: list[BlockInfo] = []
            while block is not None:
                if block.mapped:
                    run.append(BlockInfo(block.addr, block.size, block.allocated))
                if run and (not block.mapped or block.next is None):
                    total = sum(b.size for b in run)
                    out.append(SegmentInfo(run[0].address, total, seg.stream, seg.small, run))
                    run = []
                block = block.next
        out.sort(key=lambda s: s.address)
        return out

    # -- starting from a recorded state -------------------------------------------------------

    def add_segment(
        self,
        address: int,
        size: int,
        stream: int = 0,
        pool_is_small: bool = False,
        allocated_blocks: Iterable[tuple[int, int]] = (),
        expandable: bool = False,
    ) -> None:
        """Register a segment a recorded run already held (a snapshot's ``segments`` entry).

        The listed ``(address, size)`` blocks are allocated; the gaps between them are free,
        one merged block each. ``free`` accepts the listed addresses and ``malloc`` reuses the
        gaps. ``expandable``: a mapped range of an expandable segment (page-aligned); it joins
        an existing expandable segment of the same stream and pool whose unmapped range holds
        it, else starts a new one at ``address``. Records no decision.
        """
        if size <= 0:
            raise ValueError(f"add_segment: size {size} (allowed: bytes > 0)")
        blocks = sorted((int(a), int(s)) for a, s in allocated_blocks)
        cursor = address
        for a, s in blocks:
            if s <= 0 or a < cursor or a + s > address + size:
                raise ValueError(
                    f"add_segment: block ({a:#x}, {s}) outside [{address:#x}, "
                    f"{address + size:#x}) or overlapping another"
                )
            cursor = a + s
        small = pool_is_small
        pool = self._small if small else self._large
        if expandable:
            prev_link, next_link, seg = self._carve_expandable(address, size, stream, small, pool)
        else:
            self._refuse_overlap(address, size, f"[{address:#x}, {address + size:#x})")
            seg = _Segment(address, size, stream, small, False, 0)
            self._segments[address] = seg
            prev_link = next_link = None
            self._next_addr = max(self._next_addr, _align(address + size))
        # Lay the blocks out: allocated as listed, free gaps between them.
        pieces: list[_Block] = []
        cursor = address
        for a, s in [*blocks, (address + size, 0)]:
            if a > cursor:
                pieces.append(_Block(cursor, a - cursor, stream, small, seg))
            if s:
                block = _Block(a, s, stream, small, seg)
                block.allocated = True
                block.requested = s
                pieces.append(block)
            cursor = a + s
        previous = prev_link
        for block in pieces:
            block.prev = previous
            if previous is not None:
                previous.next = block
            self._by_addr[block.addr] = block
            previous = block
        if previous is not None:
            previous.next = next_link
        if next_link is not None:
            next_link.prev = previous
        for block in pieces:  # a free piece's neighbours among the pieces are allocated
            if not block.allocated:
                self._merge_free_neighbours(block, pool)
                self._cache(block, pool)
        allocated = sum(s for _, s in blocks)
        self._allocated += allocated
        self._requested += allocated
        self._peak_allocated = max(self._peak_allocated, self._allocated)
        self._add_reserved(size)
        if self._peak_pending:
            self._peak_pending = False
            self._fragmentation = self._reserved - self._allocated

    def _carve_expandable(
        self, address: int, size: int, stream: int, small: bool, pool: _Pool
    ) -> tuple[_Block | None, _Block | None, _Segment]:
        """Make [address, address+size) a mapped range of an expandable segment and return the
        blocks around it (to link the recorded blocks between) and the segment."""
        holder: _Block | None = None
        for st, addr in pool.unmapped:
            candidate = self._by_addr[addr]
            if st == stream and addr <= address and address + size <= addr + candidate.size:
                holder = candidate
                break
        if holder is None:
            page = kSmallBuffer if small else self._config.large_segment_size
            if size % page:
                raise ValueError(
                    f"add_segment: expandable range of {size} bytes is not a whole number of "
                    f"{page}-byte pages"
                )
            seg = self._new_expandable_segment(stream, small, pool, base=address, at_least=size)
            holder = self._by_addr[address]
        seg = holder.seg
        if (address - seg.base) % seg.page or size % seg.page:
            raise ValueError(
                f"add_segment: expandable range [{address:#x}, {address + size:#x}) is not "
                f"aligned to its segment's {seg.page}-byte pages"
            )
        holder_end = holder.addr + holder.size
        next_link = holder.next
        del pool.unmapped[bisect_left(pool.unmapped, (stream, holder.addr))]
        prev_link: _Block | None
        if address > holder.addr:  # the holder keeps [holder.addr, address), still unmapped
            holder.size = address - holder.addr
            insort(pool.unmapped, (stream, holder.addr))
            prev_link = holder
        else:
            del self._by_addr[holder.addr]
            prev_link = holder.prev
        end = address + size
        if end < holder_end:  # [end, holder_end) stays unmapped as a block of its own
            right = _Block(end, holder_end - end, stream, small, seg, mapped=False)
            right.next = next_link
            if next_link is not None:
                next_link.prev = right
            self._by_addr[end] = right
            insort(pool.unmapped, (stream, end))
            next_link = right
        seg.mapped += size
        return prev_link, next_link, seg

    # -- malloc's fallbacks -------------------------------------------------------------------

    def _get_free_block(self, pool: _Pool, size: int, stream: int) -> _Block | None:
        """``get_free_block``: the smallest free block of this stream and pool that fits,
        lowest address on ties; the max_split_size rules may refuse it."""
        if self._allowed is not None and self._gc_threshold > 0.0:
            pool.calls += 1  # block ages count only when garbage collection can run
        blocks = pool.blocks
        i = bisect_left(blocks, (stream, size, 0))
        n = len(blocks)
        if i == n or blocks[i][0] != stream:
            return None
        block = self._by_addr[blocks[i][2]]
        if self._n_expandable and block.seg.expandable:
            if self._expandable:
                # Best fit by the size a block could grow to with the unmapped range after it.
                grow = block.size + (
                    block.next.size if block.next is not None and not block.next.mapped else 0
                )
                while block.seg.expandable and i + 1 < n and blocks[i + 1][0] == stream:
                    other = self._by_addr[blocks[i + 1][2]]
                    nxt = other.next
                    other_grow = other.size + (
                        nxt.size if nxt is not None and not nxt.mapped else 0
                    )
                    if other_grow >= grow:
                        break
                    i += 1
                    block, grow = other, other_grow
            else:
                # Expandable segments switched off: only blocks of ordinary segments qualify.
                i += 1
                while (
                    i < n and blocks[i][0] == stream and self._by_addr[blocks[i][2]].seg.expandable
                ):
                    i += 1
                if i == n or blocks[i][0] != stream:
                    return None
                block = self._by_addr[blocks[i][2]]
        max_split = self._max_split
        if size < max_split:
            if block.size >= max_split:  # no oversize block for a request below the limit
                return None
        elif block.size >= size + self._non_split:  # oversize: only within the rounding limit
            return None
        del blocks[i]
        return block

    def _malloc_slow(self, pool: _Pool, size: int, stream: int, small: bool) -> _Block:
        """The misses of ``malloc``, in the source's order."""
        alloc_size = self._config.allocation_size(size)
        # trigger_free_memory_callbacks: none registered here, so no second search.
        if self._allowed is not None and self._gc_threshold > 0.0:
            self._garbage_collect_cached_blocks()
        block = self._alloc_block(pool, size, alloc_size, stream, small, False)
        if block is None and self._release_available_cached_blocks(pool, size, stream):
            block = self._alloc_block(pool, size, alloc_size, stream, small, False)
        if block is None:
            self._release_cached_blocks()
            block = self._alloc_block(pool, size, alloc_size, stream, small, True)
        if block is None:
            self.num_ooms += 1
            limit = "" if self._allowed is None else f"; {self._allowed} bytes allowed"
            cap = "" if self._capacity is None else f" of a {self._capacity}-byte capacity"
            raise OutOfMemory(
                f"CUDA out of memory. Tried to allocate {alloc_size / MiB:.2f} MiB "
                f"(a {size}-byte block): {self._reserved} bytes reserved{cap}{limit}, "
                f"{self._allocated} allocated",
                size,
                alloc_size,
            )
        return block

    def _alloc_block(
        self, pool: _Pool, size: int, alloc_size: int, stream: int, small: bool, retry: bool
    ) -> _Block | None:
        """``alloc_block``: refuse past the memory fraction (checked against the allocation
        size even for expandable segments, as the source does), else grow an expandable segment
        or cudaMalloc a new one; cudaMalloc fails past ``capacity``."""
        if retry:
            self.num_alloc_retries += 1
        if self._allowed is not None and self._reserved + alloc_size > self._allowed:
            return None
        if self._expandable:
            return self._try_allocate_expandable_block(pool, size, stream, small)
        if self._capacity is not None and self._reserved + alloc_size > self._capacity:
            return None
        address = self._placed if self._placed is not None else _align(self._next_addr)
        self._placed = None
        self._next_addr = max(self._next_addr, _align(address + alloc_size))
        seg = _Segment(address, alloc_size, stream, small, False, 0)
        self._segments[address] = seg
        block = _Block(address, alloc_size, stream, small, seg)
        self._by_addr[address] = block
        self._add_reserved(alloc_size)
        self.num_device_alloc += 1
        self._decisions.append(Decision(SEGMENT_ALLOC, address, alloc_size, stream))
        return block

    def _add_reserved(self, nbytes: int) -> None:
        reserved = self._reserved + nbytes
        self._reserved = reserved
        if reserved > self._peak_reserved:
            self._peak_reserved = reserved
            self._peak_pending = True

    def _garbage_collect_cached_blocks(self) -> None:
        """``garbage_collect_cached_blocks``: past ``threshold * allowed``, free the large
        pool's unsplit cached segments whose age (``gc_count``: free-block searches since they
        were cached) is at least the average, pass after pass, until the excess is reclaimed."""
        assert self._allowed is not None
        gc_threshold = int(self._gc_threshold * self._allowed)
        if self._reserved <= gc_threshold:
            return
        target = self._reserved - gc_threshold
        large = self._large
        by_addr = self._by_addr
        total_age = 0
        count = 0
        for _, _, addr in large.blocks:
            block = by_addr[addr]
            if block.prev is None and block.next is None:
                total_age += large.calls - block.gc_base
                count += 1
        if count == 0:
            return
        reclaimed = 0
        freed = True
        while reclaimed < target and freed and count > 0:
            age_threshold = total_age / count
            freed = False
            for _, _, addr in list(large.blocks):
                block = by_addr[addr]
                age = large.calls - block.gc_base
                if (
                    block.prev is None
                    and block.next is None
                    and not block.seg.expandable
                    and age >= age_threshold
                ):
                    freed = True
                    reclaimed += block.size
                    total_age -= age
                    count -= 1
                    self._release_block(block, large)

    def _release_available_cached_blocks(self, pool: _Pool, size: int, stream: int) -> bool:
        """``release_available_cached_blocks``: with max_split_size set, cudaFree one cached
        oversize segment large enough, else the largest ones of the stream until enough bytes
        are back. (Only unsplit segments are freed; the source never meets a split one here.)"""
        max_split = self._max_split
        if max_split == _SIZE_MAX:
            return False
        blocks = pool.blocks
        by_addr = self._by_addr
        key = max(size, max_split)
        i = bisect_left(blocks, (stream, key, 0))
        if i < len(blocks) and blocks[i][0] == stream:
            block = by_addr[blocks[i][2]]
            if not block.seg.expandable:
                if block.prev is not None or block.next is not None:
                    return False
                self._release_block(block, pool)
                return True
        if i == 0:
            return False
        released = 0
        i -= 1
        while released < key and blocks[i][1] >= max_split and blocks[i][0] == stream:
            current = i
            first = current == 0
            if not first:
                i -= 1
            block = by_addr[blocks[current][2]]
            if not block.seg.expandable and block.prev is None and block.next is None:
                released += block.size
                self._release_block(block, pool)
            if first:
                break
        return released >= key

    def _release_cached_blocks(self) -> None:
        """``release_cached_blocks`` (default pool, no capture): ``release_blocks`` of the large
        pool, then of the small one."""
        self._release_blocks(self._large)
        self._release_blocks(self._small)

    def _release_blocks(self, pool: _Pool) -> None:
        """``release_blocks``: cudaFree every free unsplit segment; unmap the whole free pages
        of every free expandable block, and drop an expandable segment left wholly unmapped."""
        to_unmap: list[_Block] = []
        by_addr = self._by_addr
        for _, _, addr in list(pool.blocks):
            block = by_addr[addr]
            if block.seg.expandable:
                to_unmap.append(block)
            elif block.prev is None and block.next is None:
                self._release_block(block, pool)
        for block in to_unmap:
            self._unmap_block(block, pool)
            if block.prev is None and block.next is None and not block.mapped:
                self._release_expandable_segment(block, pool)

    def _release_block(self, block: _Block, pool: _Pool) -> None:
        """``release_block``: cudaFree a cached unsplit segment."""
        blocks = pool.blocks
        del blocks[bisect_left(blocks, (block.stream, block.size, block.addr))]
        del self._by_addr[block.addr]
        del self._segments[block.addr]
        self._reserved -= block.size
        self.num_device_free += 1
        self._decisions.append(Decision(SEGMENT_FREE, block.addr, block.size, block.stream))

    def _refuse_overlap(self, base: int, size: int, what: str) -> None:
        """``ValueError`` naming ``what`` when [base, base+size) overlaps a segment the model
        holds (a recorded segment to adopt, or the range of a new expandable one)."""
        for other in self._segments.values():
            if base < other.base + other.size and other.base < base + size:
                raise ValueError(f"add_segment: {what} overlaps the segment at {other.base:#x}")

    def _link_after(self, block: _Block, new: _Block) -> None:
        """Put ``new`` right after ``block`` in its segment's chain and index it by address (a
        split's upper part, or what stays of a range when its first pages are (un)mapped)."""
        after = block.next
        new.prev = block
        new.next = after
        if after is not None:
            after.prev = new
        block.next = new
        self._by_addr[new.addr] = new

    def _link_before(self, block: _Block, new: _Block) -> None:
        """Put ``new`` right before ``block`` in its segment's chain and index it by address."""
        before = block.prev
        new.prev = before
        if before is not None:
            before.next = new
        new.next = block
        block.prev = new
        self._by_addr[new.addr] = new

    @staticmethod
    def _cache(block: _Block, pool: _Pool) -> None:
        """A free mapped block joins its pool's best-fit list (stream, size, address); its
        garbage-collection age counts from now."""
        block.gc_base = pool.calls
        insort(pool.blocks, (block.stream, block.size, block.addr))

    def _merge_free_neighbours(self, block: _Block, pool: _Pool, mapped: bool = True) -> None:
        """``try_merge_blocks`` with the block before, then the one after: each that is free and
        of ``block``'s mapped state (``mapped``) is absorbed into ``block``."""
        before = block.prev
        if before is not None and not before.allocated and before.mapped == mapped:
            self._merge(block, before, pool)
        after = block.next
        if after is not None and not after.allocated and after.mapped == mapped:
            self._merge(block, after, pool)

    def _merge(self, dst: _Block, src: _Block, pool: _Pool) -> None:
        """``try_merge_blocks`` once its checks passed: ``dst`` absorbs its neighbour ``src``
        (a free block of the same mapped state), which leaves its pool list."""
        if src.mapped:
            blocks = pool.blocks
            del blocks[bisect_left(blocks, (src.stream, src.size, src.addr))]
        else:
            unmapped = pool.unmapped
            del unmapped[bisect_left(unmapped, (src.stream, src.addr))]
        by_addr = self._by_addr
        if src is dst.prev:
            del by_addr[dst.addr]
            dst.addr = src.addr
            by_addr[dst.addr] = dst
            before = src.prev
            dst.prev = before
            if before is not None:
                before.next = dst
        else:
            del by_addr[src.addr]
            after = src.next
            dst.next = after
            if after is not None:
                after.prev = dst
        dst.size += src.size

    # -- expandable segments ------------------------------------------------------------------

    def _new_expandable_segment(
        self, stream: int, small: bool, pool: _Pool, base: int | None = None, at_least: int = 0
    ) -> _Segment:
        """A new ``ExpandableSegment``: pages of kSmallBuffer (small pool) or
        large_segment_size (large pool), a VA range of ``numSegments(total + total / 8)`` pages,
        one unmapped block covering it."""
        page = kSmallBuffer if small else self._config.large_segment_size
        basis = self._device_total or self._capacity or _DEFAULT_VA_BASIS
        pages = max(-(-(basis + basis // 8) // page), -(-at_least // page))
        size = pages * page
        if base is None:
            base = _align(self._next_addr)
        else:
            self._refuse_overlap(base, size, f"expandable range at {base:#x}")
        self._next_addr = max(self._next_addr, _align(base + size))
        seg = _Segment(base, size, stream, small, True, page)
        self._segments[base] = seg
        self._n_expandable += 1
        block = _Block(base, size, stream, small, seg, mapped=False)
        self._by_addr[base] = block
        insort(pool.unmapped, (stream, base))
        return seg

    def _find_expandable_block(self, pool: _Pool, size: int, stream: int, small: bool) -> _Block:
        """``find_expandable_block``: the lowest-address unmapped range of this stream (or the
        free block just before it) with ``size`` allocatable bytes from there on; else a new
        expandable segment's whole range."""
        unmapped = pool.unmapped
        by_addr = self._by_addr
        i = bisect_left(unmapped, (stream, 0))
        while i < len(unmapped) and unmapped[i][0] == stream:
            candidate = by_addr[unmapped[i][1]]
            before = candidate.prev
            if before is not None and not before.allocated:
                candidate = before
            room = 0
            walk: _Block | None = candidate
            while room < size and walk is not None and not walk.allocated:
                room += walk.size
                walk = walk.next
            if room >= size:
                return candidate
            i += 1
        seg = self._new_expandable_segment(stream, small, pool)
        return by_addr[seg.base]

    def _try_allocate_expandable_block(
        self, pool: _Pool, size: int, stream: int, small: bool
    ) -> _Block | None:
        """``try_allocate_expandable_block``: map pages at the candidate until one free block
        of at least ``size`` (the rounded request, not the allocation size) exists; pages
        mapped before a failure stay mapped (cached)."""
        candidate = self._find_expandable_block(pool, size, stream, small)
        if not candidate.mapped and not self._map_block(candidate, min(candidate.size, size), pool):
            return None
        while candidate.size < size:
            nxt = candidate.next
            if nxt is None or not self._map_block(nxt, min(size - candidate.size, nxt.size), pool):
                return None
            candidate = nxt
        blocks = pool.blocks
        del blocks[bisect_left(blocks, (candidate.stream, candidate.size, candidate.addr))]
        return candidate

    def _map_block(self, block: _Block, size: int, pool: _Pool) -> bool:
        """``map_block``: map the pages covering the first ``size`` bytes of an unmapped range
        (cuMemCreate fails past ``capacity``), split off the rest, merge with free neighbours."""
        seg = block.seg
        page = seg.page
        begin = (block.addr - seg.base) // page
        end = -(-(block.addr + size - seg.base) // page)
        nbytes = (end - begin) * page
        if nbytes == 0 or (self._capacity is not None and self._reserved + nbytes > self._capacity):
            return False
        stream = block.stream
        unmapped = pool.unmapped
        del unmapped[bisect_left(unmapped, (stream, block.addr))]
        block.mapped = True
        if nbytes < block.size:
            rest = _Block(block.addr + nbytes, block.size - nbytes, stream, block.small, seg, False)
            self._link_after(block, rest)
            block.size = nbytes
            insort(unmapped, (stream, rest.addr))
        mapped_at = block.addr
        self._merge_free_neighbours(block, pool)
        self._cache(block, pool)
        seg.mapped += nbytes
        self._add_reserved(nbytes)
        self.num_device_alloc += 1
        self._decisions.append(Decision(SEGMENT_MAP, mapped_at, nbytes, stream))
        return True

    def _unmap_block(self, block: _Block, pool: _Pool) -> None:
        """``unmap_block``: unmap the whole pages inside a free expandable block; the partial
        pages before and after stay mapped as free blocks of their own."""
        seg = block.seg
        page = seg.page
        begin = -(-(block.addr - seg.base) // page)
        end = (block.addr + block.size - seg.base) // page
        if begin >= end:
            return
        start = seg.base + begin * page
        nbytes = (end - begin) * page
        stream = block.stream
        blocks = pool.blocks
        by_addr = self._by_addr
        del blocks[bisect_left(blocks, (stream, block.size, block.addr))]
        before_size = start - block.addr
        if before_size > 0:
            head = _Block(block.addr, before_size, stream, block.small, seg)
            self._link_before(block, head)
            self._cache(head, pool)
        after_size = block.size - before_size - nbytes
        if after_size > 0:
            tail = _Block(start + nbytes, after_size, stream, block.small, seg)
            self._link_after(block, tail)
            self._cache(tail, pool)
        if before_size <= 0:
            del by_addr[block.addr]
        block.addr = start
        block.size = nbytes
        block.mapped = False
        by_addr[start] = block
        self._merge_free_neighbours(block, pool, mapped=False)
        insort(pool.unmapped, (stream, block.addr))
        seg.mapped -= nbytes
        self._reserved -= nbytes
        self.num_device_free += 1
        self._decisions.append(Decision(SEGMENT_UNMAP, start, nbytes, stream))

    def _release_expandable_segment(self, block: _Block, pool: _Pool) -> None:
        """``release_expandable_segment``: an expandable segment wholly unmapped goes away."""
        unmapped = pool.unmapped
        del unmapped[bisect_left(unmapped, (block.stream, block.addr))]
        del self._by_addr[block.addr]
        del self._segments[block.seg.base]
        self._n_expandable -= 1

    # -- self-check ---------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Raise ``RuntimeError`` where the model's bookkeeping disagrees with itself: blocks
        tile each segment, no two free blocks of one mapped state touch, the pools list exactly
        the free blocks, the counters add up. For tests and replay debugging (O(blocks))."""
        seen = 0
        allocated = 0
        mapped_total = 0
        free_mapped: set[tuple[int, int, int]] = set()
        free_unmapped: set[tuple[int, int]] = set()
        for seg in self._segments.values():
            block: _Block | None = self._by_addr.get(seg.base)
            if block is None or block.prev is not None:
                raise RuntimeError(f"segment {seg.base:#x} has no head block")
            cursor = seg.base
            previous: _Block | None = None
            seg_mapped = 0
            while block is not None:
                seen += 1
                if block.addr != cursor or block.size <= 0 or block.seg is not seg:
                    raise RuntimeError(f"block at {block.addr:#x} breaks segment {seg.base:#x}")
                if self._by_addr.get(block.addr) is not block or block.prev is not previous:
                    raise RuntimeError(f"block at {block.addr:#x} is badly linked")
                if block.stream != seg.stream or block.small != seg.small:
                    raise RuntimeError(f"block at {block.addr:#x} has the wrong stream or pool")
                if (
                    previous is not None
                    and not previous.allocated
                    and not block.allocated
                    and previous.mapped == block.mapped
                ):
                    raise RuntimeError(f"free blocks at {previous.addr:#x} and after not merged")
                if block.allocated:
                    allocated += block.size
                    if not block.mapped:
                        raise RuntimeError(f"allocated block at {block.addr:#x} is unmapped")
                elif block.mapped:
                    free_mapped.add((block.stream, block.size, block.addr))
                else:
                    free_unmapped.add((block.stream, block.addr))
                if block.mapped:
                    seg_mapped += block.size
                cursor += block.size
                previous = block
                block = block.next
            if cursor != seg.base + seg.size:
                raise RuntimeError(f"segment {seg.base:#x} is not covered by its blocks")
            if seg.expandable and seg_mapped != seg.mapped:
                raise RuntimeError(f"expandable segment {seg.base:#x} mapped bytes disagree")
            mapped_total += seg_mapped
        if seen != len(self._by_addr):
            raise RuntimeError("blocks outside every segment")
        pools_mapped = set(self._small.blocks) | set(self._large.blocks)
        pools_unmapped = set(self._small.unmapped) | set(self._large.unmapped)
        if pools_mapped != free_mapped or pools_unmapped != free_unmapped:
            raise RuntimeError("the pools do not list exactly the free blocks")
        for pool in (self._small, self._large):
            if pool.blocks != sorted(pool.blocks) or pool.unmapped != sorted(pool.unmapped):
                raise RuntimeError("a pool list is out of order")
        if allocated != self._allocated or mapped_total != self._reserved:
            raise RuntimeError(
                f"counters disagree: allocated {allocated} vs {self._allocated}, "
                f"reserved {mapped_total} vs {self._reserved}"
            )


# ---------------------------------------------------------------------------------------------
# Speed check for the integrator (no timed assertions in the tests)
# ---------------------------------------------------------------------------------------------


def synthetic_step(calls: int = 100_000, seed: int = 0) -> list[tuple[int, int]]:
    """A training-step-like sequence of ``(size, 0)`` mallocs and ``(0, index)`` frees:
    mostly small and mid-sized activations freed in LIFO-ish order, some large buffers."""
    rng = random.Random(seed)
    ops: list[tuple[int, int]] = []
    live: list[int] = []
    made = 0
    while len(ops) < calls:
        if live and (rng.random() < 0.48 or len(live) > 3000):
            pick = len(live) - 1 - min(int(rng.expovariate(0.2)), len(live) - 1)
            ops.append((0, live.pop(pick)))
        else:
            r = rng.random()
            if r < 0.5:
                size = rng.randrange(1, kSmallSize)
            elif r < 0.9:
                size = rng.randrange(kSmallSize, 64 * MiB)
            else:
                size = rng.randrange(64 * MiB, 512 * MiB)
            ops.append((size, made))
            live.append(made)
            made += 1
    return ops


def benchmark(calls: int = 100_000, config: AllocatorConfig = DEFAULT_CONFIG) -> float:
    """Calls per second of ``malloc``/``free`` over :func:`synthetic_step` on this core."""
    ops = synthetic_step(calls)
    alloc = CachingAllocator(config)
    addresses: dict[int, int] = {}
    start = time.perf_counter()
    for size, index in ops:
        if size:
            addresses[index] = alloc.malloc(size)
        else:
            alloc.free(addresses.pop(index))
    elapsed = time.perf_counter() - start
    return len(ops) / elapsed


if __name__ == "__main__":
    for name, cfg in (
        ("default", DEFAULT_CONFIG),
        ("expandable_segments:True", AllocatorConfig(expandable_segments=True)),
        ("max_split_size_mb:128", AllocatorConfig(max_split_size=128 * MiB)),
    ):
        print(f"{name}: {benchmark(100_000, cfg):,.0f} malloc/free calls per second")
