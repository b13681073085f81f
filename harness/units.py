"""Human-friendly byte sizes and durations, shared by both layers (standard library only)."""

from __future__ import annotations

import re

_BYTE_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")
_DURATION_UNITS = {"": 1.0, "s": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0}
BYTE_SIZE_HELP = "a size such as 512MiB, 16GiB, 80GB or a plain number of bytes"
DURATION_HELP = "a duration such as 90s, 10m, 1h or a plain number of seconds"


def parse_bytes(text: str | int | float) -> int:
    """Parse ``16GiB`` / ``80GB`` / ``1024`` into bytes; raise ``ValueError`` naming what is allowed."""
    if isinstance(text, bool):
        raise ValueError(f"expected {BYTE_SIZE_HELP}")
    if isinstance(text, int | float):
        if text <= 0:
            raise ValueError(f"must be positive; expected {BYTE_SIZE_HELP}")
        return int(text)
    match = _SIZE_RE.match(str(text))
    unit = match.group(2).lower() if match else None
    if not match or unit not in _BYTE_UNITS:
        raise ValueError(f"expected {BYTE_SIZE_HELP}")
    value = int(float(match.group(1)) * _BYTE_UNITS[unit])
    if value <= 0:
        raise ValueError(f"must be positive; expected {BYTE_SIZE_HELP}")
    return value


def parse_seconds(text: str | int | float) -> float:
    """Parse ``90s`` / ``10m`` / ``1h`` / ``600`` into seconds."""
    if isinstance(text, bool):
        raise ValueError(f"expected {DURATION_HELP}")
    if isinstance(text, int | float):
        seconds = float(text)
    else:
        match = _SIZE_RE.match(str(text))
        unit = match.group(2).lower() if match else None
        if not match or unit not in _DURATION_UNITS:
            raise ValueError(f"expected {DURATION_HELP}")
        seconds = float(match.group(1)) * _DURATION_UNITS[unit]
    if seconds <= 0:
        raise ValueError(f"must be positive; expected {DURATION_HELP}")
    return seconds


def format_bytes(num: float | None, short: bool = False) -> str:
    """Render bytes with a binary unit, e.g. ``1.50 MiB`` (``short``: three significant
    digits, ``1.5 MiB``, ``123 GiB``, for narrow tables); ``-`` when unknown."""
    if num is None or num != num:  # None or NaN
        return "-"
    value = float(num)
    # A value that would print as 1024 of a unit is shown as 1 of the next.
    limit = 1023.5 if short else 1024
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < limit or unit == "TiB":
            if unit == "B":
                return f"{value:.0f} {unit}"
            if not short:
                return f"{value:.2f} {unit}"
            # Three significant digits, but never in exponent form (1010 KiB, not 1.01e+03).
            return f"{value:.0f} {unit}" if abs(value) >= 100 else f"{value:.3g} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def format_count(num: float | None) -> str:
    """A count in decimal units as parameter counts are published, e.g. ``8.03 B``, ``41.9 M``."""
    if num is None or num != num:
        return "-"
    value = float(num)
    for unit, size in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(value) >= size:
            return f"{value / size:.3g} {unit}"
    return f"{value:.0f}"


def format_quantity(num: float | None, unit: str = "", digits: int = 3) -> str:
    """One number format for every table and picture: ``digits`` significant digits, a
    thousands prefix (k, M, G, T) from 1,000 up, and the unit, e.g. ``2.60k samples/s``,
    ``12.3 ms``, ``0.987``; ``-`` when unknown. (Bytes have ``format_bytes``.)"""
    if num is None or num != num:
        return "-"
    value = float(num)
    suffix = f" {unit}" if unit else ""
    if value == 0:
        return "0" + suffix
    if abs(value) < 10 ** -(digits - 1):  # tiny: scientific is the honest form
        return f"{value:.{digits - 1}e}{suffix}"
    for prefix, size in (("", 1.0), ("k", 1e3), ("M", 1e6), ("G", 1e9), ("T", 1e12)):
        scaled = float(f"{value / size:.{digits}g}")
        if abs(scaled) < 1000 or prefix == "T":
            return f"{scaled:#.{digits}g}".rstrip(".") + prefix + suffix
    raise AssertionError("unreachable")
