"""Spec problems as one line each: ``file: field.path: what is wrong (allowed: ...)``.

A user's typo must never cost them a sweep: every complaint names the place,
what was wrong and what is allowed, with a "did you mean" where a name is close.
"""

from __future__ import annotations

import difflib
import typing


class SpecError(Exception):
    """A spec problem, already formatted as one line: ``file: field.path: what is wrong``."""


class FieldProblem(ValueError):
    """A validator's complaint about a place *inside* the field it validates."""

    def __init__(self, subpath: list[str | int], message: str) -> None:
        super().__init__(message)
        self.subpath = subpath
        self.message = message


def did_you_mean(word: str, options: typing.Iterable[str]) -> str:
    close = difflib.get_close_matches(str(word), list(options), n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def require_known(kind: str, name: str, options: typing.Iterable[str], also: str = "") -> str:
    """``name`` if it is one of ``options``; else a ValueError listing them, with a suggestion."""
    options = list(options)
    if name in options:
        return name
    allowed = ", ".join(options) + (f", {also}" if also else "")
    raise ValueError(f"unknown {kind} {name!r} (allowed: {allowed}){did_you_mean(name, options)}")
