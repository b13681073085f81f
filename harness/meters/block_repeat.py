"""A model's allocation log at a greater depth, made from the log of a shallow copy of it.

The blocks of a transformer (and of any model built as one block repeated) allocate and free
alike: a step at depth L files, block after block, the events one block files, in a forward
sweep (block 0 up), a backward sweep (down), the optimizer's sweeps over the parameters (up).
So a trace of the model at a depth ``n`` (every block traced, from the first to the last, which
may differ from the rest: the first block's input needs no gradient under LoRA) holds every
event a deeper model files, and the deeper log is the shallow one with the middle block's
events filed ``L - n`` times more, in its place in each sweep.

Each event carries the block it belongs to (its *tag*: ``harness.meters.block_tags``; -1
outside the blocks). Copying a block's events is the easy half; the other is what each free
refers to. A free refers to an allocation of its own block, of a neighbour (a block's backward
frees the input gradient the block above made) or of no block; so references are kept by
*distance in blocks*: the copy ``k`` of the middle block ``c``, standing at block ``c + k``,
frees what block ``c + k + d`` made where the traced block ``c`` freed what block ``c + d``
made, at the same place in that block's events (blocks ``c + d`` and ``c`` are checked to file
the same events). The blocks after ``c`` move ``L - n`` places up, their references with them.

``extend`` says why it cannot where the log is not so regular (blocks that file different
events, a middle block whose events do not stand between its neighbours', a library
workspace made inside it); a caller then traces the model whole. It is exact only where the
model's blocks are alike; the caller checks that the extension of depth ``n`` equals a real
trace at ``n + 1`` before it trusts an extension to ``L``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

FREE = -1  # AllocationLog's markers
EMPTY_CACHE = -2
OUTSIDE = -1  # the tag of an event of no block

Event = tuple[int, int]


class Irregular(Exception):
    """The log is not a repeat of one block's events (the message says where)."""


@dataclass(frozen=True)
class Extended:
    """A log at a greater depth: its events, their tags, and where a boundary of the original
    (the end of the history before a memory window) now falls."""

    events: list[Event]
    tags: list[int]
    boundary: int


def extend(
    events: Sequence[Event],
    tags: Sequence[int],
    middle: int,
    more: int,
    boundary: int = 0,
    fixed: frozenset[int] = frozenset(),
) -> Extended:
    """``events`` (tagged ``tags``) of a model with ``more`` blocks more, each a copy of block
    ``middle``'s events; ``boundary``: an index into ``events`` whose place in the result is
    wanted; ``fixed``: allocation ids that must not be copied (library workspaces, made once).
    ``Irregular`` when the log cannot be extended so."""
    if len(events) != len(tags):
        raise Irregular("a tag for every event is needed")
    layout = _Layout(events, tags)
    if middle not in layout.segments_of:
        raise Irregular(f"block {middle} filed no events")
    for index, (ident, size) in enumerate(events):
        if tags[index] == middle and size >= 0 and ident in fixed:
            raise Irregular(f"a library workspace is made inside block {middle}")
    return _Extender(events, tags, layout, middle, more).run(boundary)


class _Layout:
    """The log cut into runs of one tag (segments), and where every event stands in them."""

    def __init__(self, events: Sequence[Event], tags: Sequence[int]) -> None:
        self.starts: list[int] = []  # segment -> first event index
        self.tag_of: list[int] = []  # segment -> tag
        self.segment: list[int] = []  # event index -> segment
        for index, tag in enumerate(tags):
            if not self.tag_of or self.tag_of[-1] != tag:
                self.starts.append(index)
                self.tag_of.append(tag)
            self.segment.append(len(self.starts) - 1)
        self.starts.append(len(tags))
        self.segments_of: dict[int, list[int]] = {}
        for segment, tag in enumerate(self.tag_of):
            self.segments_of.setdefault(tag, []).append(segment)
        self.allocated_at: dict[int, int] = {}
        for index, (ident, size) in enumerate(events):
            if size >= 0:
                self.allocated_at[ident] = index
        self.events = events

    def span(self, segment: int) -> range:
        return range(self.starts[segment], self.starts[segment + 1])

    def signature(self, segment: int) -> tuple[int, ...]:
        """What a segment files: its sizes, frees as FREE."""
        return tuple(max(self.events[i][1], FREE) for i in self.span(segment))


class _Extender:
    """One extension: the log's segments in order, the middle block's filed again beside it."""

    def __init__(
        self,
        events: Sequence[Event],
        tags: Sequence[int],
        layout: _Layout,
        middle: int,
        more: int,
    ) -> None:
        self.events, self.tags, self.layout = events, tags, layout
        self.middle, self.more = middle, more
        self.made: dict[tuple[int, int], int] = {}  # (old event index, copy) -> new id
        self.next_id = max((ident for ident, _ in events), default=-1) + 1

    def run(self, boundary: int) -> Extended:
        out_events: list[Event] = []
        out_tags: list[int] = []
        new_boundary = None
        layout, middle = self.layout, self.middle
        for segment, tag in enumerate(layout.tag_of):
            span = layout.span(segment)
            if span.start == boundary:
                new_boundary = len(out_events)
            elif span.start < boundary < span.stop:
                if tag == middle and self.more:
                    raise Irregular("the window starts inside the middle block's events")
                new_boundary = len(out_events) + boundary - span.start
            copies = [0]
            if tag == middle and self.more:
                extra = list(range(1, self.more + 1))
                copies = [0, *extra] if self._ascending(segment) else [*reversed(extra), 0]
            for copy in copies:
                for index in span:
                    out_events.append(self._event(index, copy))
                    out_tags.append(self._new_block(tag, copy))
        if new_boundary is None:  # the boundary is the end
            new_boundary = len(out_events)
        return Extended(out_events, out_tags, new_boundary)

    def _ascending(self, segment: int) -> bool:
        """Whether the sweep the middle block's ``segment`` is in goes up the blocks: its
        neighbours' segments of the same turn stand below and above it."""
        layout, middle = self.layout, self.middle
        nth = layout.segments_of[middle].index(segment)
        places = []
        for neighbour in (middle - 1, middle + 1):
            theirs = layout.segments_of.get(neighbour, [])
            if len(theirs) != len(layout.segments_of[middle]):
                raise Irregular(f"blocks {middle} and {neighbour} take different turns")
            places.append(theirs[nth])
        below, above = places
        if below < segment < above:
            return True
        if above < segment < below:
            return False
        raise Irregular(
            f"block {middle}'s events at #{layout.starts[segment]} do not stand between its "
            "neighbours'"
        )

    def _new_block(self, tag: int, copy: int) -> int:
        if tag < 0 or tag < self.middle:
            return tag
        if tag == self.middle:
            return tag + copy
        return tag + self.more

    def _event(self, index: int, copy: int) -> Event:
        ident, size = self.events[index]
        if size == EMPTY_CACHE:
            return ident, size
        if size >= 0:
            if copy == 0:
                new = ident
            else:
                new = self.next_id
                self.next_id += 1
            self.made[(index, copy)] = new
            return new, size
        return self._referent(index, copy), FREE

    def _referent(self, index: int, copy: int) -> int:
        """The id the free at ``index`` (in copy ``copy`` of its block) frees in the deeper
        log: what the allocation it freed stands for at the same distance in blocks."""
        ident = self.events[index][0]
        allocated = self.layout.allocated_at.get(ident)
        if allocated is None:  # made before the log began: only the original frees it
            if copy:
                raise Irregular(f"block {self.middle} frees #{ident}, made before the log")
            return ident
        own, theirs = self.tags[index], self.tags[allocated]
        if own < 0 or theirs < 0:
            if copy:
                raise Irregular(f"a copy of block {self.middle} frees an allocation of no block")
            return self._made(allocated, 0)
        target = self._new_block(own, copy) + theirs - own
        if target <= self.middle:
            block, at_copy = target, 0
        elif target <= self.middle + self.more:
            block, at_copy = self.middle, target - self.middle
        else:
            block, at_copy = target - self.more, 0
        return self._made(self._counterpart(allocated, block), at_copy)

    def _made(self, index: int, copy: int) -> int:
        found = self.made.get((index, copy))
        if found is None:
            raise Irregular(f"a free at #{index} comes before its allocation in the deeper log")
        return found

    def _counterpart(self, index: int, block: int) -> int:
        """The event of ``block`` at the place ``index`` holds in its own block's events."""
        own = self.tags[index]
        if own == block:
            return index
        layout = self.layout
        segment = layout.segment[index]
        nth = layout.segments_of[own].index(segment)
        turns = layout.segments_of.get(block, [])
        if len(turns) != len(layout.segments_of[own]):
            raise Irregular(f"blocks {own} and {block} take different turns")
        theirs = turns[nth]
        if layout.signature(segment) != layout.signature(theirs):
            raise Irregular(f"blocks {own} and {block} file different events")
        return layout.starts[theirs] + index - layout.starts[segment]


def smoothed(events: Sequence[Event], tags: Sequence[int]) -> list[int]:
    """``tags`` with a free that stands alone between two events of a neighbouring block filed
    under that block: a step that goes parameter by parameter frees the last parameter's
    temporary while it works on the next (a variable assigned again), and that free belongs to
    the next parameter's turn (it refers back to the block before, which ``extend`` follows)."""
    out = list(tags)
    for index in range(1, len(tags) - 1):
        before, after = tags[index - 1], tags[index + 1]
        lone = before == after != tags[index] and before >= 0
        if lone and events[index][1] == FREE and abs(tags[index] - before) == 1:
            out[index] = before
    return out


def canonical(events: Sequence[Event]) -> list[Event]:
    """``events`` with allocation ids numbered in order of allocation: two logs of the same
    step compare equal whatever ids their runs drew."""
    names: dict[int, int] = {}
    out: list[Event] = []
    for ident, size in events:
        if size == EMPTY_CACHE:
            out.append((-1, size))
        elif size >= 0:
            names[ident] = len(names)
            out.append((names[ident], size))
        else:
            out.append((names.get(ident, -2 - ident), size))
    return out
