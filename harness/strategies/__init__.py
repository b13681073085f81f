"""Registry of training strategies (memory techniques), each one small module.

A spec names a strategy as ``name`` or ``name:arg`` (e.g. ``accumulate:4``); a grid entry may
combine several (``[checkpoint, accumulate:4]``), written canonically as ``checkpoint+accumulate:4``.
The registry is plain data (no torch import) so specs validate without loading model code.
Adding a strategy: a module with a ``Strategy`` subclass plus one entry in ``STRATEGIES``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StrategyInfo:
    name: str
    doc: str
    impl: str  # "module:Class"
    arg: str | None = None  # None: takes no argument; else what the argument means
    arg_type: type | None = None


STRATEGIES: dict[str, StrategyInfo] = {
    "none": StrategyInfo(
        "none",
        "plain training: the baseline every other strategy is compared with",
        "harness.strategies.none:NoStrategy",
    ),
}


def parse_term(term: str) -> tuple[str, str | None]:
    """Split ``name:arg`` and check it against the registry; raise ``ValueError`` when wrong."""
    name, sep, arg = str(term).strip().partition(":")
    if name not in STRATEGIES:
        raise ValueError(f"unknown strategy {name!r}")
    info = STRATEGIES[name]
    if info.arg is None and sep:
        raise ValueError(f"strategy {name!r} takes no argument (got {term!r})")
    if info.arg is not None:
        if not sep or not arg:
            raise ValueError(f"strategy {name!r} needs an argument: {name}:<{info.arg}>")
        if info.arg_type is not None:
            try:
                value = info.arg_type(arg)
            except ValueError:
                raise ValueError(f"strategy {name!r}: {arg!r} is not a valid {info.arg}") from None
            if isinstance(value, int | float) and value <= 0:
                raise ValueError(f"strategy {name!r}: {info.arg} must be positive (got {arg})")
    return name, (arg if sep else None)


def canonical(terms: list[str]) -> list[str]:
    """Validate a combination; ``none`` only makes sense alone and a name may appear once."""
    names = [parse_term(term)[0] for term in terms]
    if not names:
        raise ValueError("an empty strategy combination; use 'none' for plain training")
    if "none" in names and len(names) > 1:
        raise ValueError("'none' cannot be combined with other strategies")
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"strategy {duplicates[0]!r} appears twice in one combination")
    return [str(term).strip() for term in terms]


def build_strategies(terms: list[str]) -> list[Any]:
    """Instantiate the strategies of a trial (imports their modules, hence torch)."""
    from harness.workloads import resolve

    built = []
    for term in terms:
        name, arg = parse_term(term)
        built.append(resolve(STRATEGIES[name].impl)(arg))
    return built
