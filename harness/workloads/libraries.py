"""The model ecosystems a trial may ask for, imported when asked, failures said in one line.

A library that is missing and one that is installed but fails to import are different
problems with different fixes: the second is usually a version that does not match the
installed torch (a torchao built for a newer torch makes peft, which imports it, fail too).
Saying "needs peft" when peft is installed sends the user the wrong way, so the line names the
installed version and the import's own error.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
from types import ModuleType

EXTRA = "pip install 'harness[models]'"


def import_library(
    module: str, needed_by: str, install: str = EXTRA, error: type[Exception] = RuntimeError
) -> ModuleType:
    """``module`` imported, or ``error`` saying why not: not installed (with ``install``), or
    installed at a version whose import failed (with that failure)."""
    top = module.partition(".")[0]
    distribution = top.replace("_", "-")  # liger_kernel is pip's liger-kernel
    try:
        return importlib.import_module(module)
    except Exception as failure:  # a broken install raises anything at import, not only ImportError
        if importlib.util.find_spec(top) is None:
            raise error(
                f"{needed_by} needs {distribution} ({install}), which is not installed"
            ) from None
        why = f"{type(failure).__name__}: {failure}".strip().splitlines()[0]
        raise error(
            f"{needed_by} needs {distribution}, and {distribution} {_version(distribution)} is "
            f"installed but importing "
            f"{module} failed: {why}"
        ) from None


def _version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "(version unknown)"
