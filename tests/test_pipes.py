"""Answers read off a pipe a line at a time: two answers that arrive together are both
returned at once (a buffered readline() kept the second out of select()'s sight, so the
reader waited out its whole limit for it), a silent pipe gives up at the limit, an ended one
says so."""

from __future__ import annotations

import os
import time

import pytest

from harness.pipes import LineReader, PipeClosed


def test_two_lines_written_together_are_both_read_without_waiting():
    read_end, write_end = os.pipe()
    os.write(write_end, b'{"pid": 1}\n{"exit": 0}\n{"par')
    reader = LineReader(read_end)
    started = time.monotonic()
    assert reader.line(30) == b'{"pid": 1}'
    assert reader.line(30) == b'{"exit": 0}'
    assert time.monotonic() - started < 5  # not the 30 s limit
    assert reader.line(0.2) is None  # a partial line is not an answer
    os.write(write_end, b'tial": 1}\n')
    assert reader.line(30) == b'{"partial": 1}'
    os.close(write_end)
    with pytest.raises(PipeClosed):
        reader.line(30)
    os.close(read_end)
