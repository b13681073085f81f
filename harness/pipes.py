"""Reading a child process's answers, a line each, with a time limit.

The warm trial starter (``sweep/launch.py``) and the tests' command server answer on a pipe,
one JSON line per answer, and the reader must give up after a limit. ``select()`` on a
buffered file object cannot do that reliably: ``readline()`` may pull two answers off the pipe
at once and keep the second in its buffer, where ``select()`` does not see it, so the reader
waits out the whole limit for an answer it already has (a trial that ends right after it
starts would look hung). This reads the pipe's descriptor directly and keeps whole lines itself.
"""

from __future__ import annotations

import os
import select
import time

CHUNK_BYTES = 65536


class PipeClosed(EOFError):
    """The writer closed the pipe (it exited) before a whole line came."""


class LineReader:
    """Whole lines from the pipe ``fd``, oldest first."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.pending = b""  # read from the pipe, not yet returned

    def line(self, limit_s: float) -> bytes | None:
        """The next line (without its newline), or None if none came within ``limit_s``;
        PipeClosed if the pipe ended first."""
        deadline = time.monotonic() + limit_s
        while b"\n" not in self.pending:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.fd], [], [], left)[0]:
                return None
            chunk = os.read(self.fd, CHUNK_BYTES)
            if not chunk:
                raise PipeClosed(f"the pipe ended after {len(self.pending)} more bytes")
            self.pending += chunk
        line, self.pending = self.pending.split(b"\n", 1)
        return line
