"""Host-side memory: the trial process's resident-set high-water mark."""

from __future__ import annotations

import resource
import sys


def peak_rss_bytes() -> int:
    """``ru_maxrss`` of this process over its whole life (KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)
