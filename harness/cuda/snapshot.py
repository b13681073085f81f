"""A user's recorded CUDA memory snapshot, replayed through the caching-allocator model.

``torch.cuda.memory._record_memory_history()`` then ``_dump_snapshot(path)`` writes a pickle of
plain data: the allocator's segments at dump time and, per device, a trace of what happened
before it (``alloc``, ``free_requested``, ``free_completed``, ``segment_alloc``/``free``/
``map``/``unmap``, ``oom``, ...). This module reads one without running code
(:func:`load_snapshot`), rebuilds the allocator's state at the trace's first event by walking
the trace backwards from the final state (:func:`rebuild_start`: a recording usually starts
mid-run, after the model was built), and replays the trace's requests through
:class:`~harness.cuda.allocator.CachingAllocator` (:func:`replay`): under the recorded settings
the model's segment decisions and peaks are compared with the card's, under other settings the
same requests answer "what would this setting have done to my run?".

What a trace cannot tell, and what is done about it (docs/estimate.md, "Replaying a recorded
snapshot"):

- a run of ``segment_free``/``segment_unmap`` events is either the user's ``empty_cache()`` or
  the allocator's own release before retrying a failed cudaMalloc; both free every cached
  unsplit segment (large pool, then small), so each run is replayed as ``empty_cache()`` at
  that point, under every setting;
- the size of a block allocated before the trace and freed inside it: the free names the
  requested bytes, so the block is that size rounded as the recorded settings round it, plus a
  remainder of at most 1 MiB up to the next block (the large pool never splits one off);
- under a setting with a different segment kind (``expandable_segments`` on a run without it,
  or off on a run with it) the recorded segments cannot be adopted: the replay starts from an
  empty allocator that allocates the blocks alive at the first event in address order.

Standard library only (the sweep layer and CPU-only machines read snapshots); never torch.
"""

from __future__ import annotations

import io
import pickle
from bisect import bisect_left, bisect_right, insort
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Generic, TypeAlias, TypeVar

from harness.cuda.allocator import (
    SEGMENT_ALLOC,
    SEGMENT_MAP,
    AllocatorConfig,
    CachingAllocator,
    OutOfMemory,
    kLargeBuffer,
    kSmallBuffer,
    kSmallSize,
)

# The trace's action names (torch/csrc/cuda/memory_snapshot.cpp, TraceEntry::Action).
ALLOC = "alloc"
FREE_REQUESTED = "free_requested"
FREE_COMPLETED = "free_completed"
SEGMENT_FREE = "segment_free"
SEGMENT_UNMAP = "segment_unmap"
OOM = "oom"
KNOWN_ACTIONS = frozenset(
    {
        ALLOC,
        FREE_REQUESTED,
        FREE_COMPLETED,
        SEGMENT_ALLOC,
        SEGMENT_FREE,
        SEGMENT_MAP,
        SEGMENT_UNMAP,
        "snapshot",
        OOM,
        "workspace_snapshot",
    }
)
_NEW_SEGMENT = (SEGMENT_ALLOC, SEGMENT_MAP)
_RELEASE = (SEGMENT_FREE, SEGMENT_UNMAP)
# Block states that hold memory: an allocated block, or one freed while a stream still uses it.
_FREE_STATE = "inactive"
PROGRESS_EVERY = 2048  # events between two progress callbacks

# PYTORCH_CUDA_ALLOC_CONF keys and the AllocatorConfig field each sets (override_settings).
_FIELD_OF_KEY = {
    "max_split_size_mb": "max_split_size",
    "max_non_split_rounding_mb": "max_non_split_rounding_size",
    "large_segment_size_mb": "large_segment_size",
    "garbage_collection_threshold": "garbage_collection_threshold",
    "roundup_power2_divisions": "roundup_power2_divisions",
    "expandable_segments": "expandable_segments",
    "per_process_memory_fraction": "per_process_memory_fraction",
}


class SnapshotError(ValueError):
    """A file that is not a usable memory snapshot, said in one line naming the file."""


# ---------------------------------------------------------------------------------------------
# Loading: plain data only
# ---------------------------------------------------------------------------------------------


class _RefusedClass(pickle.UnpicklingError):
    """The pickle asked for a class or function: what a snapshot never holds."""


class _PlainDataUnpickler(pickle.Unpickler):
    """Loads dicts, lists, tuples, strings, numbers, bools and None, nothing else.

    A pickle can call any importable function while it loads (``GLOBAL`` + ``REDUCE``); every
    such callable comes through ``find_class`` (the ``EXT`` opcodes too), so refusing every
    class there means loading runs no code. Persistent ids are refused as well."""

    def find_class(self, module: str, name: str) -> Any:
        raise _RefusedClass(f"{module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        raise _RefusedClass(f"persistent id {str(pid)[:40]!r}")


def load_snapshot(path: str | Path) -> dict[str, Any]:
    """The snapshot dict in ``path``, read without running code; :class:`SnapshotError` (one
    line naming the file) for anything else: a class, a truncated file, another structure."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as error:
        raise SnapshotError(f"{path}: {error.strerror or error}") from None
    return read_snapshot(data, str(path))


def read_snapshot(data: bytes, name: str = "snapshot") -> dict[str, Any]:
    """:func:`load_snapshot` of bytes already read (``name`` says where they came from)."""
    if not data:
        raise SnapshotError(f"{name}: not a memory snapshot: the file is empty")
    try:
        obj = _PlainDataUnpickler(io.BytesIO(data)).load()
    except _RefusedClass as error:
        raise SnapshotError(
            f"{name}: not a memory snapshot: the pickle names a class ({error}); snapshots hold "
            "only plain data"
        ) from None
    except (EOFError, pickle.UnpicklingError) as error:
        # EOFError, or "pickle data was truncated": the bytes stop inside the pickle.
        if isinstance(error, EOFError) or "truncated" in str(error):
            why = "the pickle ends early (truncated)"
        else:
            why = f"not a readable pickle ({error})"
        raise SnapshotError(f"{name}: not a memory snapshot: {why}") from None
    except (RecursionError, MemoryError):
        raise SnapshotError(
            f"{name}: not a memory snapshot: nested too deeply or too large"
        ) from None
    except Exception as error:  # any corrupt byte stream: one line, no traceback
        raise SnapshotError(
            f"{name}: not a memory snapshot: not a readable pickle "
            f"({type(error).__name__}: {error})"
        ) from None
    if not isinstance(obj, dict):
        raise SnapshotError(
            f"{name}: not a memory snapshot: the pickle holds a {type(obj).__name__}, not the "
            "dict _dump_snapshot writes"
        )
    if "segments" not in obj:
        raise SnapshotError(f"{name}: not a memory snapshot: no 'segments' key")
    return obj


# ---------------------------------------------------------------------------------------------
# The recording: one device's segments, trace and settings, checked
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Event:
    """One trace entry: ``size`` is the requested bytes for alloc and frees (not rounded)."""

    index: int
    action: str
    addr: int
    size: int
    stream: int


@dataclass(frozen=True, slots=True)
class RecordedBlock:
    """A block of the final state, as the snapshot lists it."""

    address: int
    size: int  # the block's bytes (rounded, any unsplit remainder included)
    requested: int
    allocated: bool  # active_allocated or active_pending_free: not reusable


BlockT = TypeVar("BlockT")


@dataclass(frozen=True)
class Segment(Generic[BlockT]):
    """A segment (for an expandable segment: one contiguous mapped range) and its blocks: the
    final state's as the snapshot lists them (``RecordedSegment``), or the state at the
    trace's first event that the backward walk rebuilds (``StartSegment``)."""

    address: int
    size: int
    stream: int
    small: bool
    expandable: bool
    blocks: tuple[BlockT, ...]


RecordedSegment: TypeAlias = Segment[RecordedBlock]


@dataclass(frozen=True)
class Recording:
    """What one device's part of a snapshot says."""

    name: str
    device: int
    devices: int  # devices the file has a trace or a segment for
    segments: tuple[RecordedSegment, ...]  # the state at dump time
    events: tuple[Event, ...]
    settings: AllocatorConfig
    settings_recorded: bool  # False: torch < 2.4 wrote none, PyTorch's defaults assumed
    unknown_actions: Counter[str] = field(default_factory=Counter)


def _where(name: str, path: str) -> str:
    return f"{name}: not a memory snapshot: {path}"


def _int(value: Any, name: str, path: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise SnapshotError(f"{_where(name, path)} is {type(value).__name__}, not an integer")
    return value


def _get_int(entry: Mapping[str, Any], key: str, name: str, path: str, default: int = 0) -> int:
    value = entry.get(key, default)
    return default if value is None else _int(value, name, f"{path}.{key}")


def _list(value: Any, name: str, path: str) -> list[Any]:
    if not isinstance(value, list | tuple):
        raise SnapshotError(f"{_where(name, path)} is {type(value).__name__}, not a list")
    return list(value)


def _dict(value: Any, name: str, path: str) -> Mapping[str, Any]:
    if not isinstance(value, dict):
        raise SnapshotError(f"{_where(name, path)} is {type(value).__name__}, not a dict")
    return value


def _segment(raw: Any, name: str, path: str) -> tuple[int, RecordedSegment]:
    entry = _dict(raw, name, path)
    for key in ("address", "total_size", "blocks"):
        if key not in entry:
            raise SnapshotError(f"{_where(name, path)} has no {key!r}")
    address = _int(entry["address"], name, f"{path}.address")
    size = _int(entry["total_size"], name, f"{path}.total_size")
    kind = entry.get("segment_type")
    # Small-pool segments are exactly kSmallBuffer (2 MiB); large ones at least 10 MiB.
    small = kind == "small" if kind in ("small", "large") else size == kSmallBuffer
    blocks: list[RecordedBlock] = []
    cursor = address  # torch 2.0's blocks carry no address: they tile the segment in order
    for j, raw_block in enumerate(_list(entry["blocks"], name, f"{path}.blocks")):
        where = f"{path}.blocks[{j}]"
        block = _dict(raw_block, name, where)
        if "size" not in block:
            raise SnapshotError(f"{_where(name, where)} has no 'size'")
        bsize = _int(block["size"], name, f"{where}.size")
        baddr = _get_int(block, "address", name, where, cursor)
        requested = _get_int(block, "requested_size", name, where, bsize) or bsize
        state = block.get("state", "active_allocated")
        if not isinstance(state, str):
            raise SnapshotError(f"{_where(name, where)}.state is not a string")
        blocks.append(RecordedBlock(baddr, bsize, requested, state != _FREE_STATE))
        cursor = baddr + bsize
    segment = RecordedSegment(
        address=address,
        size=size,
        stream=_get_int(entry, "stream", name, path),
        small=small,
        expandable=bool(entry.get("is_expandable", False)),
        blocks=tuple(blocks),
    )
    return _get_int(entry, "device", name, path), segment


def parse_snapshot(snapshot: Mapping[str, Any], name: str, device: int | None = None) -> Recording:
    """One device's segments, trace and settings; :class:`SnapshotError` where the structure is
    not a snapshot's or the file has no ``device``. ``device`` None: the one with the most trace
    entries (the lowest on a tie)."""
    raw_traces = snapshot.get("device_traces", [])
    traces = [_list(t, name, f"device_traces[{i}]") for i, t in enumerate(raw_traces or [])]
    raw_segments = _list(snapshot["segments"], name, "segments")
    segments = [_segment(s, name, f"segments[{i}]") for i, s in enumerate(raw_segments)]
    seen_devices = {d for d, _ in segments}
    count = max(len(traces), max(seen_devices, default=-1) + 1, 1)
    if device is None:
        device = max(range(len(traces)), key=lambda d: (len(traces[d]), -d)) if traces else 0
    elif not 0 <= device < count:
        raise SnapshotError(
            f"{name}: --device {device}: the snapshot has devices 0-{count - 1}"
            if count > 1
            else f"{name}: --device {device}: the snapshot has only device 0"
        )
    trace = traces[device] if device < len(traces) else []
    events: list[Event] = []
    unknown: Counter[str] = Counter()
    for i, raw in enumerate(trace):
        path = f"device_traces[{device}][{i}]"
        entry = _dict(raw, name, path)
        action = entry.get("action")
        if not isinstance(action, str):
            raise SnapshotError(f"{_where(name, path)} has no 'action'")
        if action not in KNOWN_ACTIONS:
            unknown[action] += 1
        events.append(
            Event(
                i,
                action,
                _get_int(entry, "addr", name, path),
                _get_int(entry, "size", name, path),
                _get_int(entry, "stream", name, path),
            )
        )
    settings_raw = snapshot.get("allocator_settings")
    if settings_raw is None:
        settings, recorded = AllocatorConfig(), False
    else:
        try:
            settings = AllocatorConfig.from_snapshot(
                _dict(settings_raw, name, "allocator_settings")
            )
        except (ValueError, TypeError, KeyError, AttributeError) as error:
            raise SnapshotError(f"{name}: allocator_settings: {error}") from None
        recorded = True
    return Recording(
        name=name,
        device=device,
        devices=count,
        segments=tuple(s for d, s in segments if d == device),
        events=tuple(events),
        settings=settings,
        settings_recorded=recorded,
        unknown_actions=unknown,
    )


# ---------------------------------------------------------------------------------------------
# The state at the trace's first event
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class StartBlock:
    """A block alive at the first event: ``address`` and ``size`` as the card held it,
    ``requested`` the bytes asked for (what a fresh allocator is asked again)."""

    address: int
    size: int
    requested: int


StartSegment: TypeAlias = Segment[StartBlock]


@dataclass(frozen=True)
class StartState:
    """The allocator at the trace's first event, and what the trace contradicted on the way."""

    segments: tuple[StartSegment, ...]
    problems: Counter[str]

    @property
    def reserved_bytes(self) -> int:
        return sum(s.size for s in self.segments)

    @property
    def allocated_bytes(self) -> int:
        return sum(b.size for s in self.segments for b in s.blocks)

    @property
    def blocks(self) -> int:
        return sum(len(s.blocks) for s in self.segments)

    @property
    def mid_run(self) -> bool:
        """The recording began with memory already reserved (after the model was built, or a
        ring buffer that dropped its oldest entries)."""
        return bool(self.segments)


class _Range:
    """A segment (or mapped range) during the backward walk."""

    __slots__ = ("addr", "expandable", "size", "small", "stream")

    def __init__(self, addr: int, size: int, stream: int, small: bool, expandable: bool) -> None:
        self.addr = addr
        self.size = size
        self.stream = stream
        self.small = small
        self.expandable = expandable

    @property
    def end(self) -> int:
        return self.addr + self.size


class _Ranges:
    """Non-overlapping ranges by start address (bisect: a long trace of a big run stays
    linear-ish, not ranges x events)."""

    def __init__(self) -> None:
        self.starts: list[int] = []
        self.by_start: dict[int, _Range] = {}

    def add(self, r: _Range) -> None:
        insort(self.starts, r.addr)
        self.by_start[r.addr] = r

    def remove(self, r: _Range) -> None:
        del self.starts[bisect_left(self.starts, r.addr)]
        del self.by_start[r.addr]

    def at_or_below(self, addr: int) -> _Range | None:
        """The range starting last at or below ``addr`` (the only one that may hold it)."""
        i = bisect_right(self.starts, addr) - 1
        return self.by_start[self.starts[i]] if i >= 0 else None

    def overlaps(self, addr: int, size: int) -> bool:
        r = self.at_or_below(addr + max(size, 1) - 1)
        return r is not None and r.end > addr

    def values(self) -> list[_Range]:
        return [self.by_start[a] for a in self.starts]


class _Live:
    """Blocks alive during the backward walk: address -> (size if known, requested size)."""

    def __init__(self) -> None:
        self.blocks: dict[int, tuple[int | None, int]] = {}
        self.order: list[int] = []

    def add(self, address: int, known: int | None, requested: int) -> None:
        if address not in self.blocks:
            insort(self.order, address)
        self.blocks[address] = (known, requested)

    def pop(self, address: int) -> bool:
        if self.blocks.pop(address, None) is None:
            return False
        del self.order[bisect_left(self.order, address)]
        return True

    def drop_new_range(self, start: int, end: int, problems: Counter[str]) -> None:
        """Forget the blocks in [start, end), a range the event being undone created (a
        segment_alloc or segment_map): before it, no block there can have been alive, so each
        one found is counted in ``problems``."""
        i, j = bisect_left(self.order, start), bisect_left(self.order, end)
        for address in self.order[i:j]:
            del self.blocks[address]
        del self.order[i:j]
        if j > i:
            problems["blocks alive in a segment before it was allocated"] += j - i


def rebuild_start(recording: Recording) -> StartState:
    """Walk the trace backwards from the final state to the state at its first event.

    Undo each event: an ``alloc`` (its block was free before), a ``free_completed`` (the block
    was allocated: its requested size), a ``segment_alloc`` (the segment did not exist yet), a
    ``segment_free`` (it existed, all free, the event's size), a ``segment_map`` (the range was
    unmapped) and a ``segment_unmap`` (it was mapped). What the trace contradicts (an alloc of
    a block the end state does not hold and no later free explains, a segment freed twice, a
    block outside every segment ...) is counted in ``problems`` and skipped, never raised."""
    problems: Counter[str] = Counter()
    ranges = _Ranges()
    live = _Live()
    for seg in recording.segments:
        if ranges.overlaps(seg.address, seg.size):
            problems["final segments that overlap"] += 1
            continue
        ranges.add(_Range(seg.address, seg.size, seg.stream, seg.small, seg.expandable))
        for block in seg.blocks:
            if block.allocated:
                live.add(block.address, block.size, block.requested)
    for event in reversed(recording.events):
        action = event.action
        if action == ALLOC:
            if not live.pop(event.addr):
                problems["allocs the end state and later frees do not explain"] += 1
        elif action == FREE_COMPLETED:
            if event.addr in live.blocks:
                problems["frees of a block allocated again without a free"] += 1
            else:
                live.add(event.addr, None, event.size)
        elif action == SEGMENT_ALLOC:
            seg = ranges.by_start.get(event.addr)
            if seg is None or seg.expandable:
                problems["segment_alloc of a segment the end state and later frees lack"] += 1
                continue
            ranges.remove(seg)
            live.drop_new_range(seg.addr, seg.end, problems)
        elif action == SEGMENT_FREE:
            if event.size <= 0 or ranges.overlaps(event.addr, event.size):
                problems["segment_free of a segment that overlaps another"] += 1
                continue
            small = event.size == kSmallBuffer
            ranges.add(_Range(event.addr, event.size, event.stream, small, False))
        elif action == SEGMENT_MAP:
            if not _unmap_range(ranges, event.addr, event.size):
                problems["segment_map of a range not mapped later"] += 1
                continue
            live.drop_new_range(event.addr, event.addr + event.size, problems)
        elif action == SEGMENT_UNMAP:
            if event.size <= 0 or ranges.overlaps(event.addr, event.size):
                problems["segment_unmap of a range that overlaps a mapped one"] += 1
                continue
            _map_range(ranges, event, _pool_of_unmapped(ranges, event))
    return StartState(
        _lay_out(ranges.values(), live.blocks, recording.settings, problems), problems
    )


def _unmap_range(ranges: _Ranges, addr: int, size: int) -> bool:
    """Remove [addr, addr+size) from the mapped range holding it (splitting it in two)."""
    r = ranges.at_or_below(addr)
    if r is None or not r.expandable or addr + size > r.end:
        return False
    ranges.remove(r)
    if addr > r.addr:
        ranges.add(_Range(r.addr, addr - r.addr, r.stream, r.small, True))
    if addr + size < r.end:
        tail = addr + size
        ranges.add(_Range(tail, r.end - tail, r.stream, r.small, True))
    return True


def _map_range(ranges: _Ranges, event: Event, small: bool) -> None:
    """Add an unmapped range back as mapped, one range with the mapped ranges of the same
    segment it touches (an earlier map may span what stayed mapped beside it)."""
    addr, end = event.addr, event.addr + event.size
    key = (event.stream, small)
    before = ranges.at_or_below(addr - 1)
    if (
        before is not None
        and before.expandable
        and before.end == addr
        and (before.stream, before.small) == key
    ):
        ranges.remove(before)
        addr = before.addr
    after = ranges.by_start.get(end)
    if after is not None and after.expandable and (after.stream, after.small) == key:
        ranges.remove(after)
        end = after.end
    ranges.add(_Range(addr, end - addr, event.stream, small, True))


def _pool_of_unmapped(ranges: _Ranges, event: Event) -> bool:
    """Whether a range mapped before an unmap was a small-pool page: the pool of the nearest
    expandable range of the same stream below it, else the page size (large pages: 20 MiB)."""
    i = bisect_right(ranges.starts, event.addr) - 1
    while i >= 0:
        r = ranges.by_start[ranges.starts[i]]
        if r.expandable and r.stream == event.stream:
            return r.small
        i -= 1
    return event.size % kLargeBuffer != 0


def _lay_out(
    ranges: Sequence[_Range],
    live: Mapping[int, tuple[int | None, int]],
    settings: AllocatorConfig,
    problems: Counter[str],
) -> tuple[StartSegment, ...]:
    """The start segments, adjacent mapped ranges of one expandable segment merged, with their
    blocks. A block known only from a free gets its requested size rounded as ``settings``
    round it, plus a remainder up to the next block of at most 1 MiB in the large pool of
    fixed segments (``should_split`` never splits one off, so no free block that small
    exists there)."""
    merged: list[_Range] = []
    for r in ranges:  # by address
        last = merged[-1] if merged else None
        if (
            last is not None
            and r.expandable
            and last.expandable
            and last.end == r.addr
            and (last.stream, last.small) == (r.stream, r.small)
        ):
            last.size += r.size
        else:
            merged.append(_Range(r.addr, r.size, r.stream, r.small, r.expandable))
    starts = [r.addr for r in merged]
    inside: dict[int, list[tuple[int, int | None, int]]] = {r.addr: [] for r in merged}
    for address, (size, requested) in live.items():
        i = bisect_right(starts, address) - 1
        if i < 0 or address >= merged[i].end:
            problems["blocks alive outside every segment"] += 1
            continue
        inside[merged[i].addr].append((address, size, requested))
    out: list[StartSegment] = []
    for r in merged:
        blocks: list[StartBlock] = []
        listed = sorted(inside[r.addr])
        for k, (address, known, requested) in enumerate(listed):
            limit = listed[k + 1][0] if k + 1 < len(listed) else r.end
            if known is None:
                size = settings.round_size(requested)
                gap = limit - (address + size)
                if (
                    0 < gap <= kSmallSize
                    and not r.small
                    and not r.expandable
                    and not settings.expandable_segments
                ):
                    size += gap
            else:
                size = known
            if address + size > limit:
                problems["blocks that overlap the next one"] += 1
                size = limit - address
            if size > 0:
                blocks.append(StartBlock(address, size, requested))
        out.append(StartSegment(r.addr, r.size, r.stream, r.small, r.expandable, tuple(blocks)))
    return tuple(out)


# ---------------------------------------------------------------------------------------------
# What the recording itself says: reserved and allocated over the trace
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RecordedRun:
    """The card's own figures over the trace, from the start state and the segment events."""

    peak_reserved_bytes: int
    peak_allocated_bytes: int
    fragmentation_bytes: int  # reserved - allocated when the reserved peak was first reached
    releases: int  # runs of segment_free/segment_unmap (empty_cache or an OOM retry)
    likely_retries: int  # of those, directly followed by a new segment and its alloc, or an OOM
    ooms: int
    allocs: int


def recorded_run(recording: Recording, start: StartState) -> RecordedRun:
    """Reserved = the start segments plus segment_alloc - segment_free + map - unmap; allocated
    = the start blocks plus each alloc's requested size rounded as the recorded settings round
    it (the trace holds requested sizes only) minus each freed block."""
    settings = recording.settings
    reserved = start.reserved_bytes
    allocated = start.allocated_bytes
    sizes = {b.address: b.size for s in start.segments for b in s.blocks}
    peak_reserved, peak_allocated = reserved, allocated
    fragmentation = reserved - allocated
    pending = False  # the peak was raised by a segment event: measure after its alloc
    releases = retries = ooms = allocs = 0
    events = recording.events
    for i, event in enumerate(events):
        action = event.action
        if action == ALLOC:
            allocs += 1
            size = settings.round_size(event.size)
            sizes[event.addr] = size
            allocated += size
            peak_allocated = max(peak_allocated, allocated)
            if pending:
                fragmentation, pending = reserved - allocated, False
        elif action == FREE_COMPLETED:
            allocated -= sizes.pop(event.addr, settings.round_size(event.size))
        elif action in _NEW_SEGMENT:
            reserved += event.size
            if reserved > peak_reserved:
                peak_reserved, pending = reserved, True
        elif action in _RELEASE:
            reserved -= event.size
            if i == 0 or events[i - 1].action not in _RELEASE:
                releases += 1
                retries += _followed_by_new_segment(events, i)
        elif action == OOM:
            ooms += 1
    if pending:
        fragmentation = reserved - allocated
    return RecordedRun(
        peak_reserved, peak_allocated, fragmentation, releases, retries, ooms, allocs
    )


def _followed_by_new_segment(events: Sequence[Event], i: int) -> bool:
    """Whether the release run at ``i`` is directly followed by an OOM, or a new segment and
    then an alloc: the shape of malloc's release-and-retry after a failed cudaMalloc."""
    j = i
    while j < len(events) and events[j].action in _RELEASE:
        j += 1
    if j < len(events) and events[j].action == OOM:
        return True
    if j >= len(events) or events[j].action not in _NEW_SEGMENT:
        return False
    while j < len(events) and events[j].action in _NEW_SEGMENT:
        j += 1
    return j < len(events) and events[j].action == ALLOC


# ---------------------------------------------------------------------------------------------
# Replay
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Mismatch:
    """One alloc where the model decided otherwise than the card (event index in the trace)."""

    index: int
    size: int
    recorded: str
    predicted: str


@dataclass(frozen=True)
class Replayed:
    """The model's run of the trace under one setting."""

    settings: AllocatorConfig
    start: str  # "adopted": the recorded segments; "re-allocated": blocks into an empty one
    start_reserved_bytes: int
    peak_reserved_bytes: int
    peak_allocated_bytes: int
    fragmentation_bytes: int
    alloc_retries: int
    ooms: int
    releases: int  # empty_cache() calls replayed
    unadopted: int  # start segments or blocks the model refused, frees it refused (skipped)
    # Decisions (compare=True only): per alloc, "cache", "segment_alloc N" or "segment_map N".
    segment_decisions_matched: int = 0
    segment_decisions_total: int = 0
    alloc_decisions_matched: int = 0
    alloc_decisions_total: int = 0
    mismatches: tuple[Mismatch, ...] = ()


@dataclass
class _Tally:
    """How often the model's segment decision for an alloc equals the card's (``compare``),
    with the first ``keep`` mismatches."""

    keep: int
    segment_matched: int = 0
    segment_total: int = 0
    alloc_matched: int = 0
    alloc_total: int = 0
    mismatches: list[Mismatch] = field(default_factory=list)

    def add(self, event: Event, recorded: str, predicted: str) -> None:
        """One alloc: every alloc counts; those where either side made a segment also count
        as segment decisions."""
        same = recorded == predicted
        self.alloc_total += 1
        self.alloc_matched += same
        if recorded != "cache" or predicted != "cache":
            self.segment_total += 1
            self.segment_matched += same
            if not same and len(self.mismatches) < self.keep:
                self.mismatches.append(Mismatch(event.index, event.size, recorded, predicted))


ProgressCallback = Callable[[int, int], None]


def _decision(kinds: Iterable[tuple[str, int]]) -> str:
    """An alloc's segment decision in a comparable form: "cache" when it made none, else the
    kind (segment_alloc wins over map) and the bytes of every new segment or mapped page."""
    found = [(kind, size) for kind, size in kinds if kind in _NEW_SEGMENT]
    if not found:
        return "cache"
    kind = SEGMENT_ALLOC if any(k == SEGMENT_ALLOC for k, _ in found) else SEGMENT_MAP
    return f"{kind} {sum(size for _, size in found)}"


def adopts(start: StartState, settings: AllocatorConfig) -> bool:
    """Whether a replay under ``settings`` can start from the recorded segments: all of the
    kind ``settings`` makes (fixed, or expandable), or none at all."""
    return all(s.expandable == settings.expandable_segments for s in start.segments)


def replay(
    recording: Recording,
    start: StartState,
    settings: AllocatorConfig,
    capacity: int | None = None,
    device_total: int | None = None,
    compare: bool = False,
    progress: ProgressCallback | None = None,
    keep_mismatches: int = 20,
    place_segments: bool = True,
) -> Replayed:
    """Run the trace's requests through a :class:`CachingAllocator` under ``settings``.

    Starts from ``start`` (adopted when :func:`adopts`, else its blocks re-allocated in
    address order), then mallocs each ``alloc``'s requested size on its stream and frees at
    ``free_completed`` (when the card could reuse the block); a run of segment releases is an
    ``empty_cache()``. ``capacity``: what cudaMalloc can get in all (a card's memory less its
    context), so a retry or an OOM can happen; None: unlimited. ``compare``: count how often
    the model's segment decision for an alloc equals the card's (the segment events between
    the previous alloc and it). ``place_segments``: where the card made a new segment for an
    alloc and the model makes one too, put the model's where the card's cudaMalloc put it
    (:class:`_Placement`); otherwise above every other segment."""
    if settings.per_process_memory_fraction < 1.0 and device_total is None:
        raise ValueError(
            f"per_process_memory_fraction:{settings.per_process_memory_fraction} is a share of "
            "the card's memory: give the card (harness replay --card NAME)"
        )
    adopted = adopts(start, settings)
    if adopted and any(s.expandable for s in start.segments):
        device_total = _expandable_basis(start, device_total)
    model = CachingAllocator(settings, capacity=capacity, device_total=device_total)
    where: dict[int, int] = {}  # recorded address of a live block -> the model's address
    unadopted = 0
    if adopted:
        for seg in start.segments:  # by address: an expandable segment's lowest range first
            try:
                model.add_segment(
                    seg.address,
                    seg.size,
                    seg.stream,
                    seg.small,
                    [(b.address, b.size) for b in seg.blocks],
                    expandable=seg.expandable,
                )
            except ValueError:
                unadopted += 1 + len(seg.blocks)
                continue
            where.update((b.address, b.address) for b in seg.blocks)
    else:
        for seg in start.segments:
            for block in seg.blocks:
                try:
                    where[block.address] = model.malloc(block.requested, seg.stream)
                except OutOfMemory:
                    unadopted += 1
    start_reserved = model.reserved_bytes
    placement = None
    if place_segments:
        placement = _Placement.of(model, start, settings)
    unserved: set[int] = set()
    pending: list[Event] = []  # the card's segment events since the previous alloc
    releases = 0
    tally = _Tally(keep_mismatches)
    events = recording.events
    total = len(events)
    previous = ""
    for n, event in enumerate(events):
        if progress is not None and n % PROGRESS_EVERY == 0:
            progress(n, total)
        action = event.action
        if action == ALLOC:
            try:
                if placement is not None and pending:
                    address = placement.malloc(event.size, event.stream, pending)
                else:
                    address = model.malloc(event.size, event.stream)
            except OutOfMemory:
                unserved.add(event.addr)
                predicted = "oom"
            else:
                where[event.addr] = address
                predicted = _decision((d.kind, d.size) for d in model.last_decisions)
            if compare:
                tally.add(event, _decision((e.action, e.size) for e in pending), predicted)
            pending.clear()
        elif action == FREE_COMPLETED:
            address = where.pop(event.addr, None)
            if address is None:
                unserved.discard(event.addr)  # an alloc the model could not serve
            else:
                try:
                    model.free(address)
                except ValueError:  # the trace allocated one address twice: freed already
                    unadopted += 1
        elif action in _NEW_SEGMENT:
            pending.append(event)
        elif action in _RELEASE:
            if previous not in _RELEASE:
                model.empty_cache()
                releases += 1
        elif action == OOM:
            pending.clear()  # pages a failed request mapped belong to it, not the next alloc
        previous = action
    if progress is not None:
        progress(total, total)
    return Replayed(
        settings=settings,
        start="adopted" if adopted else "re-allocated",
        start_reserved_bytes=start_reserved,
        peak_reserved_bytes=model.peak_reserved_bytes,
        peak_allocated_bytes=model.peak_allocated_bytes,
        fragmentation_bytes=model.fragmentation_bytes,
        alloc_retries=model.num_alloc_retries,
        ooms=model.num_ooms,
        releases=releases,
        unadopted=unadopted,
        segment_decisions_matched=tally.segment_matched,
        segment_decisions_total=tally.segment_total,
        alloc_decisions_matched=tally.alloc_matched,
        alloc_decisions_total=tally.alloc_total,
        mismatches=tuple(tally.mismatches),
    )


class _Placement:
    """Puts the model's next cudaMalloc where the card's went.

    The model gives each new segment the next address above the last; best fit breaks ties
    between free blocks of one size by the lowest address, so on a card whose cudaMalloc
    returns lower addresses (or reuses a freed range) the model picks other blocks and drifts
    (qwen2_layerwise, torch 2.5.1: peak reserved 1.071x under its own settings, and a setting
    that changes nothing, garbage_collection_threshold without a memory fraction, 1.071x too;
    both exact with placement). Where the card made a segment for an alloc and the model makes
    one, it goes at the card's address if that range is free in the model (other settings: the
    driver would most likely have returned the same address); elsewhere above the rest.
    ``CachingAllocator.place_next_segment`` says where; fixed segments only (an expandable one
    reserves its range once)."""

    def __init__(self, model: CachingAllocator, settings: AllocatorConfig) -> None:
        self.model = model
        self.settings = settings
        self.starts: list[int] = []
        self.sizes: dict[int, int] = {}
        self.seen = len(model.decisions)

    @classmethod
    def of(
        cls, model: CachingAllocator, start: StartState, settings: AllocatorConfig
    ) -> _Placement | None:
        if settings.expandable_segments:
            return None
        if any(s.expandable for s in start.segments):
            return None
        placement = cls(model, settings)
        for seg in model.segments():
            placement._add(seg.address, seg.size)
        return placement

    def _add(self, address: int, size: int) -> None:
        if address not in self.sizes:
            self.starts.insert(bisect_right(self.starts, address), address)
        self.sizes[address] = size

    def _sync(self) -> None:
        """Follow the model's segments through its decisions since the last call."""
        decisions = self.model.decisions
        for decision in decisions[self.seen :]:
            if decision.kind == SEGMENT_ALLOC:
                self._add(decision.address, decision.size)
            elif decision.kind == SEGMENT_FREE and decision.address in self.sizes:
                del self.sizes[decision.address]
                self.starts.remove(decision.address)
        self.seen = len(decisions)

    def _is_free(self, address: int, size: int) -> bool:
        i = bisect_right(self.starts, address + size - 1) - 1
        return i < 0 or self.starts[i] + self.sizes[self.starts[i]] <= address

    def malloc(self, size: int, stream: int, recorded: Sequence[Event]) -> int:
        """``model.malloc(size, stream)``, a new segment at the card's address where it had
        one (``recorded``: the card's segment events for this alloc)."""
        model = self.model
        self._sync()
        target = next((e for e in recorded if e.action == SEGMENT_ALLOC), None)
        if target is None or target.addr % kSmallBuffer:
            return model.malloc(size, stream)
        expected = self.settings.allocation_size(self.settings.round_size(size))
        if not self._is_free(target.addr, max(expected, target.size)):
            return model.malloc(size, stream)
        model.place_next_segment(target.addr)
        try:
            return model.malloc(size, stream)
        finally:
            model.place_next_segment(None)  # unused when the malloc was served from the cache


def _expandable_basis(start: StartState, device_total: int | None) -> int | None:
    """The device memory to size adopted expandable segments' address ranges by.

    The card reserves 1 1/8 of its memory of address space per expandable segment (one per
    stream and pool) and maps pages into it; adopting the recorded ranges needs every range of
    a segment inside its reservation and no reservation over another segment's ranges. From
    the recorded layout: a reservation at least as long as the farthest range of each segment
    and shorter than the distance to the next segment's first range."""
    groups: dict[tuple[int, bool], tuple[int, int]] = {}
    for seg in start.segments:
        if seg.expandable:
            key = (seg.stream, seg.small)
            low, high = groups.get(key, (seg.address, seg.address + seg.size))
            groups[key] = (min(low, seg.address), max(high, seg.address + seg.size))
    others = sorted(s.address for s in start.segments)
    need = max(high - low for low, high in groups.values())
    room = min(
        (
            min((a for a in others if a >= high), default=1 << 62) - low
            for low, high in groups.values()
        ),
        default=1 << 62,
    )
    if device_total is not None and need <= _reservation(device_total) <= room:
        return device_total
    if room >= 1 << 62:
        return device_total if device_total and _reservation(device_total) >= need else None
    # The largest device whose reservation (rounded up to a 20 MiB page) still fits the room.
    basis = max((room - kLargeBuffer) * 8 // 9, 1)
    return basis if _reservation(basis) >= need else None


def _reservation(device_total: int) -> int:
    """An expandable segment's address range for a device of ``device_total`` bytes."""
    return device_total + device_total // 8


# ---------------------------------------------------------------------------------------------
# Settings given on the command line
# ---------------------------------------------------------------------------------------------


def _keys_in(text: str) -> list[str]:
    """The keys of PYTORCH_CUDA_ALLOC_CONF text (the word before each top-level ':')."""
    keys: list[str] = []
    depth = 0
    expecting_key = True
    word: list[str] = []
    for ch in text:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        elif depth == 0 and ch == ",":
            expecting_key, word = True, []
        elif depth == 0 and ch == ":" and expecting_key:
            keys.append("".join(word).strip())
            expecting_key = False
        elif expecting_key:
            word.append(ch)
    return keys


def override_settings(recorded: AllocatorConfig, text: str) -> AllocatorConfig:
    """``recorded`` with every key ``text`` names replaced by its value there, the others
    kept (``expandable_segments:True`` on a run with ``max_split_size_mb:128`` keeps the
    split limit). ``ValueError`` with one line for a bad key or value."""
    given = AllocatorConfig.parse(text)
    keys = _keys_in(text)
    changes: dict[str, Any] = {}
    for key in keys:
        name = _FIELD_OF_KEY.get(key)
        if name is not None:
            changes[name] = getattr(given, name)
    inert_given = {k for k, _ in given.inert}
    changes["inert"] = tuple((k, v) for k, v in recorded.inert if k not in inert_given) + tuple(
        given.inert
    )
    return replace(recorded, **changes)


def settings_label(settings: AllocatorConfig) -> str:
    """PYTORCH_CUDA_ALLOC_CONF text of the modelled keys, "defaults" when there is none."""
    text = replace(settings, inert=()).text()
    return text or "defaults"


# ---------------------------------------------------------------------------------------------
# The report `harness replay` prints
# ---------------------------------------------------------------------------------------------

ReportProgress = Callable[[str, int, int], None]


def _row(label: str, given: str | None, run: Replayed) -> dict[str, Any]:
    return {
        "settings": label,
        "given": given,
        "start": run.start,
        "start_reserved_bytes": run.start_reserved_bytes,
        "peak_reserved_bytes": run.peak_reserved_bytes,
        "peak_allocated_bytes": run.peak_allocated_bytes,
        "fragmentation_bytes": run.fragmentation_bytes,
        "alloc_retries": run.alloc_retries,
        "ooms": run.ooms,
    }


def replay_report(
    recording: Recording,
    overrides: Sequence[str] = (),
    capacity: int | None = None,
    device_total: int | None = None,
    progress: ReportProgress | None = None,
) -> dict[str, Any]:
    """The recorded-settings comparison and one ``what_if`` row per setting (the recorded
    settings first, then each of ``overrides`` applied to them), as plain data.

    ``ValueError`` (one line) for a bad override; the settings are checked before any replay.
    """
    configs = [(text, override_settings(recording.settings, text)) for text in overrides]
    start = rebuild_start(recording)
    recorded = recorded_run(recording, start)

    def step(label: str) -> ProgressCallback | None:
        report = progress
        if report is None:
            return None
        return lambda done, total: report(label, done, total)

    label = settings_label(recording.settings)
    base = replay(
        recording,
        start,
        recording.settings,
        capacity=capacity,
        device_total=device_total,
        compare=True,
        progress=step(label),
    )
    rows = [_row(label, None, base)]
    for text, config in configs:
        run = replay(recording, start, config, capacity, device_total, progress=step(text))
        rows.append(_row(settings_label(config), text, run))
    problems = Counter(start.problems)
    for action, count in recording.unknown_actions.items():
        problems[f"entries of an unknown action {action!r} (ignored)"] += count
    if base.unadopted:
        problems["start segments or blocks the model could not adopt, or frees it refused"] += (
            base.unadopted
        )
    ratio = (
        base.peak_reserved_bytes / recorded.peak_reserved_bytes
        if recorded.peak_reserved_bytes
        else None
    )
    return {
        "snapshot": recording.name,
        "device": recording.device,
        "devices": recording.devices,
        "trace_entries": len(recording.events),
        "allocs": recorded.allocs,
        "starts_mid_run": start.mid_run,
        "start_segments": len(start.segments),
        "start_blocks": start.blocks,
        "start_reserved_bytes": start.reserved_bytes,
        "start_allocated_bytes": start.allocated_bytes,
        "settings": label,
        "settings_recorded": recording.settings_recorded,
        "capacity_bytes": capacity,
        "recorded_peak_reserved_bytes": recorded.peak_reserved_bytes,
        "predicted_peak_reserved_bytes": base.peak_reserved_bytes,
        "peak_reserved_ratio": ratio,
        "recorded_peak_allocated_bytes": recorded.peak_allocated_bytes,
        "predicted_peak_allocated_bytes": base.peak_allocated_bytes,
        "recorded_fragmentation_bytes": recorded.fragmentation_bytes,
        "predicted_fragmentation_bytes": base.fragmentation_bytes,
        "segment_decisions_matched": base.segment_decisions_matched,
        "segment_decisions_total": base.segment_decisions_total,
        "alloc_decisions_matched": base.alloc_decisions_matched,
        "alloc_decisions_total": base.alloc_decisions_total,
        "mismatches": [
            {"index": m.index, "size": m.size, "recorded": m.recorded, "predicted": m.predicted}
            for m in base.mismatches
        ],
        "releases": recorded.releases,
        "likely_alloc_retries": recorded.likely_retries,
        "recorded_ooms": recorded.ooms,
        "inconsistencies": dict(problems),
        "what_if": rows,
    }
