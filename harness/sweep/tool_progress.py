"""What a long prediction says while it runs: every answered configuration in the order answers
come, counted, with the time so far and an estimate of the time left.

The trial layer's tools (``harness.trial.tool``) print one line per configuration they answer,
``estimated 3/6: llama-3.1-8b bf16 lora:16 (12.3 s)``, numbered by the configuration's place
in the request. With several children answering at once those numbers arrive out of order (6/6
before 1/6), which reads as chaos on an 8B plan that takes minutes. The sweep layer reads the
children's lines and says them again as ``[2/6] llama-3.1-8b bf16 lora:16: 12.3 s; 0:41
elapsed, about 1:20 left``: a count that only grows and a time left from the average so far
(configurations differ in cost, so it firms up as answers come). Other lines pass through.
"""

from __future__ import annotations

import queue
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterable
from typing import IO

# "VERB I/N: WHAT (S s)" as harness.trial.tool.serve prints it.
ANSWER_LINE = re.compile(
    r"^(?P<verb>\w+) \d+/(?P<total>\d+): (?P<what>.*) \((?P<seconds>[\d.]+) s\)$"
)


def clock(seconds: float) -> str:
    """``1:05`` (minutes:seconds), ``1:02:03`` past an hour."""
    whole = round(seconds)
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


class ProgressLines:
    """Turns the children's answer lines into counted lines with the time left."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.done = 0
        self.started = time.monotonic()

    def say(self, line: str) -> str:
        found = ANSWER_LINE.match(line.rstrip("\n"))
        if found is None:
            return line.rstrip("\n")
        self.done += 1
        elapsed = time.monotonic() - self.started
        left = self.total - self.done
        tail = f"{clock(elapsed)} elapsed"
        if left > 0:
            # The configurations still running are part done: the average per answer so far,
            # over the children answering at once, is the time left's best guess.
            tail += f", about {clock(elapsed / self.done * left)} left"
        what, seconds = found["what"], float(found["seconds"])
        return f"[{self.done}/{self.total}] {what}: {seconds:.1f} s; {tail}"


def relay(
    children: Iterable[subprocess.Popen[str]], total: int, out: IO[str] | None = None
) -> None:
    """Print the ``children``'s stdout lines to ``out`` (stderr) as ``ProgressLines`` says
    them, until every child has closed its stdout."""
    out = out or sys.stderr
    lines: queue.Queue[str | None] = queue.Queue()
    readers = []
    for child in children:
        assert child.stdout is not None
        reader = threading.Thread(target=_read, args=(child.stdout, lines), daemon=True)
        reader.start()
        readers.append(reader)
    progress = ProgressLines(total)
    open_streams = len(readers)
    while open_streams:
        line = lines.get()
        if line is None:
            open_streams -= 1
            continue
        print(progress.say(line), file=out, flush=True)


def _read(stream: IO[str], lines: queue.Queue[str | None]) -> None:
    for line in stream:
        lines.put(line)
    lines.put(None)
