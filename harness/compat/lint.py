"""The import-linter contract that keeps private PyTorch inside ``harness.compat``.

import-linter's own ``forbidden`` contract sees an external package only as a whole
(``torch``), not its private submodules, so this contract reads each module's code instead:
every dotted name in it (``from torch.utils._pytree import ...``, ``torch._C._dispatch_dump``),
strings and comments left out, is refused where a part after ``torch`` is private (starts with
one underscore; op names under ``torch.ops`` are the dispatcher's, not Python's, and pass).
Used by ``lint-imports`` only (``pyproject.toml``: ``contract_types``); nothing imports it.
"""

from __future__ import annotations

import importlib.util
import io
import tokenize
from pathlib import Path

from importlinter import Contract, ContractCheck, fields, output


def private_torch_names(source: str) -> list[tuple[int, str]]:
    """Each private torch name ``source`` spells, with its line."""
    found: list[tuple[int, str]] = []
    chain: list[str] = []
    line, after_dot = 0, False

    def close() -> None:
        private = any(part.startswith("_") and not part.startswith("__") for part in chain[1:])
        if len(chain) > 1 and chain[0] == "torch" and chain[1] != "ops" and private:
            found.append((line, ".".join(chain)))
        chain.clear()

    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.NAME and after_dot:
            chain.append(token.string)
            after_dot = False
        elif token.type == tokenize.NAME:
            close()
            chain.append(token.string)
            line = token.start[0]
        elif token.type == tokenize.OP and token.string == "." and chain and not after_dot:
            after_dot = True
        else:
            close()
            after_dot = False
    close()
    return found


def _source_of(module: str) -> Path | None:
    """The file of ``module``, found from its top package's folder without importing it (a
    module's import may run torch, or fail on the very name this contract reports)."""
    top, _, rest = module.partition(".")
    spec = importlib.util.find_spec(top)
    if spec is None or not spec.submodule_search_locations:
        return None
    base = Path(next(iter(spec.submodule_search_locations))).joinpath(
        *filter(None, rest.split("."))
    )
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


class PrivateTorchContract(Contract):
    """No module outside ``allowed_modules`` names a private part of torch."""

    allowed_modules = fields.ListField(subfield=fields.StringField())

    def check(self, graph, verbose: bool) -> ContractCheck:
        roots = [str(name) for name in self.session_options["root_packages"]]
        allowed = [str(name) for name in self.allowed_modules]  # type: ignore[attr-defined]
        breaches: list[tuple[str, int, str]] = []
        for module in sorted(graph.modules):
            inside = any(module == root or module.startswith(f"{root}.") for root in roots)
            if not inside or any(module == a or module.startswith(f"{a}.") for a in allowed):
                continue
            path = _source_of(module)
            if path is None:
                continue
            source = path.read_text()
            breaches.extend((module, line, name) for line, name in private_torch_names(source))
        return ContractCheck(kept=not breaches, metadata={"breaches": breaches})

    def render_broken_contract(self, check: ContractCheck) -> None:
        for module, line, name in check.metadata["breaches"]:
            output.print_error(f"{module}:{line} names {name} (private torch belongs in compat)")
            output.new_line()
