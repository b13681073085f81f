"""Reading a spec file: YAML, then the pydantic models, every problem as one line.

Pydantic's errors name a location and a type; here they become ``file: field.path: message``
with what is allowed (the keys a mapping takes, the values a field takes) and a suggestion for
close misspellings. ``SpecError`` carries the lines; the CLI prints them and exits 2.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import re
import sys
import types
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError
from pydantic_core import ErrorDetails

from harness.cuda.cards import CATALOGUE, Card, card_from_mapping
from harness.spec.errors import FieldProblem, SpecError, did_you_mean
from harness.spec.schema import Spec
from harness.workloads import FAMILIES, find_file, is_user_code

# What a results column holds (pandas Int64, MLflow params read back): an integer outside
# this range validates in Python but breaks every table built from the sweep's records.
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1

FRIENDLY = {
    "missing": "required key is missing",
    "too_short": "must list at least one value",
    "greater_than": "must be greater than {gt}",
    "greater_than_equal": "must be at least {ge}",
    "less_than": "must be less than {lt}",
    "less_than_equal": "must be at most {le}",
    "int_type": "must be an integer",
    "int_parsing": "must be an integer",
    "int_from_float": "must be an integer",
    "int_parsing_size": f"is too large (at most {INT64_MAX})",
    "float_type": "must be a number",
    "float_parsing": "must be a number",
    "bool_type": "must be true or false",
    "bool_parsing": "must be true or false",
    "string_type": "must be a string",
    "list_type": "must be a list",
    "dict_type": "must be a mapping of keys to values",
    "model_type": "must be a mapping of keys to values",
    "model_attributes_type": "must be a mapping of keys to values",
}


def _dotted(loc: typing.Sequence[str | int]) -> str:
    text = ""
    for part in loc:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text or "(top level)"


def _model_at(loc: typing.Sequence[str | int]) -> type[BaseModel] | None:
    """The pydantic model that owns the mapping at ``loc`` (to list its allowed keys)."""
    annotation: Any = Spec
    for part in loc:
        model = _find_model(annotation)
        if model is not None and isinstance(part, str) and part in model.model_fields:
            annotation = model.model_fields[part].annotation
        elif model is None:
            annotation = _inner(annotation)
    return _find_model(annotation)


def _inner(annotation: Any) -> Any:
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    return args[-1] if args else annotation


def _find_model(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(annotation):
            found = _find_model(arg)
            if found is not None:
                return found
    return None


def format_error(source: str, error: ErrorDetails) -> str:
    loc = list(error["loc"])
    kind = error["type"]
    problem = (error.get("ctx") or {}).get("error")
    if isinstance(problem, FieldProblem):
        loc += problem.subpath
        message = problem.message
    elif kind == "extra_forbidden":
        key = str(loc[-1])
        model = _model_at(loc[:-1])
        allowed = list(model.model_fields) if model else []
        hint = f" (allowed: {', '.join(allowed)}){did_you_mean(key, allowed)}" if allowed else ""
        return f"{source}: {_dotted(loc)}: unknown key{hint}"
    elif kind in FRIENDLY:
        message = FRIENDLY[kind].format(**(error.get("ctx") or {}))
    else:
        message = error["msg"].removeprefix("Value error, ")
        if kind == "literal_error":
            expected_text = str((error.get("ctx") or {}).get("expected", ""))
            message = f"must be one of {expected_text}"
            if isinstance(error.get("input"), str):
                message += did_you_mean(error["input"], re.findall(r"'([^']*)'", expected_text))
    value = error.get("input")
    # Echo the bad value unless it is a whole section or a list the message already names.
    echo = not isinstance(value, dict) and not (isinstance(value, list) and value)
    if kind != "missing" and echo and repr(value) not in message:
        message += f" (got {value!r})"
    return f"{source}: {_dotted(loc)}: {message}"


def parse_spec(data: Any, source: str = "<spec>") -> Spec:
    """Validate an already-parsed YAML document; raise ``SpecError`` with one line per problem."""
    if not isinstance(data, dict):
        raise SpecError(
            f"{source}: the spec must be a YAML mapping of keys (name, model, grid, ...)"
        )
    check_int_range(data, source)
    try:
        spec = Spec.model_validate(data)
    except ValidationError as error:
        raise SpecError("\n".join(format_error(source, e) for e in error.errors())) from None
    # Again on what the schema made of it: "1e30 B" or a string of digits becomes an int too.
    check_int_range(spec.model_dump(), source)
    spec._source = source
    resolve_cards(spec, source)
    return spec


def load_cards(path: Path) -> dict[str, Card]:
    """Your own cards (a YAML file: name -> entry, see ``harness.cuda.cards.card_from_mapping``
    and docs/cards.md) by lower-case name; a name of the catalogue replaces that entry.
    ``SpecError`` with one line naming the file, the card and the field on anything wrong."""
    data = read_yaml(path, "cards")
    if not isinstance(data, dict) or not data:
        raise SpecError(f"{path}: a cards file maps card names to their entries")
    check_int_range(data, str(path))
    cards = {}
    for name, entry in data.items():
        try:
            card = card_from_mapping(str(name).lower(), entry, str(name))
        except ValueError as error:
            raise SpecError(f"{path}: {error}") from None
        check_int_range(
            {"memory": card.memory_bytes, "context": card.context_bytes}, str(path), [str(name)]
        )
        cards[str(name).lower()] = card
    return cards


def out_of_range_ints(data: Any, loc: list[str | int]) -> Iterator[tuple[list[str | int], int]]:
    """Every integer in ``data`` (mappings and lists, walked) outside ``INT64_MIN..INT64_MAX``."""
    if isinstance(data, dict):
        for key, value in data.items():
            yield from out_of_range_ints(value, [*loc, str(key)])
    elif isinstance(data, list | tuple):
        for index, value in enumerate(data):
            yield from out_of_range_ints(value, [*loc, index])
    elif isinstance(data, int) and not INT64_MIN <= data <= INT64_MAX:
        yield loc, data


def check_int_range(data: Any, source: str, loc: list[str | int] | None = None) -> None:
    """``SpecError`` (one line each) for any integer no results column can hold: it would
    validate, run, and then break the results table of every command that reads the sweep."""
    lines = [
        f"{source}: {_dotted(where)}: {value} is too large (at most {INT64_MAX})"
        if value > 0
        else f"{source}: {_dotted(where)}: {value} is too small (at least {INT64_MIN})"
        for where, value in out_of_range_ints(data, loc or [])
    ]
    if lines:
        raise SpecError("\n".join(lines))


def resolve_cards(spec: Spec, source: str) -> None:
    """Read the spec's ``cards`` file (relative to the spec's folder) and check ``card`` names
    one of them or the catalogue."""
    if spec.cards is None:
        return
    base = Path(source).resolve().parent if source not in ("", "<spec>") else Path.cwd()
    path = Path(spec.cards) if Path(spec.cards).is_absolute() else base / spec.cards
    spec._cards = load_cards(path)
    known = sorted({*CATALOGUE, *spec._cards})
    if spec.card is not None and spec.card.lower() not in known:
        raise SpecError(
            f"{source}: card: unknown card {spec.card!r} (known: {', '.join(known)})"
            f"{did_you_mean(spec.card, known)}"
        )


class DuplicateKeyError(yaml.MarkedYAMLError):
    """A mapping names the same key twice (the mark is the second one)."""


class SafeLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a key given twice in one mapping: PyYAML keeps the last
    without a word, so a second ``batch_size:`` would silently replace the first."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        first: dict[Any, yaml.Node] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # `<<: *base` may override what it merges: that is its point
            key = self.construct_object(key_node, deep=True)
            try:
                seen = first.setdefault(key, key_node)
            except TypeError:
                continue  # an unhashable key: the base class says so
            if seen is not key_node:
                raise DuplicateKeyError(
                    problem=f"duplicate key {key!r} (first at line {seen.start_mark.line + 1}); "
                    "keep one",
                    problem_mark=key_node.start_mark,
                )
        return super().construct_mapping(node, deep)


def read_yaml(path: Path, what: str) -> Any:
    """A YAML file's data; ``SpecError`` with one line (``file:line:column`` for bad YAML or a
    key given twice)."""
    if not path.is_file():
        raise SpecError(f"{path}: no such {what} file")
    try:
        return yaml.load(path.read_text(), Loader=SafeLoader)  # still safe: a SafeLoader
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        problem = getattr(error, "problem", None) or str(error).splitlines()[0]
        kind = "" if isinstance(error, DuplicateKeyError) else "invalid YAML: "
        raise SpecError(f"{where}: {kind}{problem}") from None
    except (OSError, UnicodeDecodeError) as error:
        raise SpecError(f"{path}: cannot read: {error}") from None


def load_spec(path: str | Path) -> Spec:
    path = Path(path)
    data = read_yaml(path, "spec")
    if data is None:
        raise SpecError(f"{path}: the spec is empty")
    spec = parse_spec(data, str(path))
    check_user_code(spec, path)
    check_weight_files(spec, path)
    return spec


def check_weight_files(spec: Spec, path: Path) -> None:
    """A pretrained size's local weights must be where its trials will look (the spec's
    folder, the working directory): a folder for ``config``, a file for ``pretrained_file``.
    A ``model_id`` is transformers' to resolve (its cache, or the Hub) and is not checked."""
    family = FAMILIES.get(spec.model.family)
    if family is None:
        return
    folders = list(dict.fromkeys([str(path.resolve().parent), str(Path.cwd())]))
    for size, knobs in spec.model.sizes.items():
        if knobs.get("pretrained") is not True:
            continue
        for knob, folder in (("config", True), ("pretrained_file", False)):
            if knob not in family.weights or knob not in knobs:
                continue
            field = f"model.sizes.{size}.{knob}"
            try:  # the trial's own lookup, in its order
                found = Path(find_file(str(knobs[knob]), folders, knob))
            except FileNotFoundError:
                raise SpecError(
                    f"{path}: {field}: {knobs[knob]!r} not found (looked in "
                    f"{' and '.join(folders)})"
                ) from None
            if folder and not found.is_dir():
                raise SpecError(
                    f"{path}: {field}: pretrained: true loads a folder saved by "
                    f"save_pretrained; {str(found)!r} is a file"
                )
            if not folder and not found.is_file():
                raise SpecError(f"{path}: {field}: {str(found)!r} is not a weights file")


def check_user_code(spec: Spec, path: Path) -> None:
    """Every ``package.module:attr`` the spec names must be findable from where its trials
    will look (the spec's folder, the working directory, the installed packages): found, not
    imported, so validating runs none of the user's code."""
    folders = [str(path.resolve().parent), str(Path.cwd())]
    named = (
        ("model.family", spec.model.family),
        ("model.loss", spec.model.loss),
        ("data.dataset", spec.data.dataset),
    )
    for field, reference in named:
        if reference is None or not is_user_code(reference):
            continue
        module = reference.partition(":")[0]
        if not module_findable(module, folders):
            raise SpecError(
                f"{path}: {field}: module {module!r} not found (looked in {folders[0]}, "
                f"{folders[1]} and the installed packages)"
            )


def module_findable(name: str, folders: list[str]) -> bool:
    """Whether ``import name`` would find a file, without importing it or its packages."""
    locations = [*folders, *sys.path]
    for depth, part in enumerate(name.split(".")):
        found = importlib.machinery.PathFinder.find_spec(part, locations)
        if found is None:
            break
        locations = list(found.submodule_search_locations or [])
        if depth == name.count("."):
            return True
    try:  # packages found another way (editable installs' own finders): ask import itself
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False
