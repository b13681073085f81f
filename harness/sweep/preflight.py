"""Before any trial runs: can the sweep reach and write its stores? One clear line if not.

A sweep that fails on its first record after an hour of training has lost that hour; one that
hangs on an unreachable server looks dead. So the MLflow URI and the Optuna storage are tried
first, with short timeouts, and every failure names the spec field, the store and the cause.
What makes a store unusable (unreachable, missing, damaged, another program's) is decided in
``harness.record.store_checks``, which the read commands use too; this adds the spec's fields
and what only a writer needs (folders and files it can create and write).
"""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import urlparse

from harness.record.store_checks import (
    journal_file,
    note_store,
    storage_problem,
    tracking_problem,
)
from harness.record.stores import JOURNAL_PREFIX, redact
from harness.spec import Spec, SpecError


def problem(spec: Spec, field: str, store: str, cause: object) -> SpecError:
    text = str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause).__name__
    return SpecError(f"{spec._source or '<spec>'}: {field}: cannot use {redact(store)}: {text}")


def writable_folder(path: Path) -> str | None:
    """Why files cannot be created in ``path`` (made if missing), or None."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        return error.strerror or str(error)
    if not os.access(path, os.W_OK | os.X_OK):
        return "the folder is not writable"
    return None


def check_local_file(spec: Spec, field: str, store: str, path: Path) -> None:
    why = writable_folder(path.parent)
    if why is None and path.exists() and not os.access(path, os.R_OK | os.W_OK):
        why = "the file is not readable and writable"
    if why:
        raise problem(spec, field, store, why)


def device_problem(device: str) -> str | None:
    """Why this host cannot run trials on ``device`` (``cuda``, ``cuda:N``), or None.

    Imports torch, so it is asked only of specs that name a CUDA device."""
    if not device.startswith("cuda"):
        return None
    import torch

    from harness.compat.internals import TORCH_VERSION

    if not torch.cuda.is_available():
        build = f"CUDA {torch.version.cuda} build" if torch.version.cuda else "CPU-only build"
        return (
            f"{device}, but this host has no usable CUDA device (torch {TORCH_VERSION}, "
            f"{build}); use device: auto or cpu here, or `harness estimate --device cuda` to "
            "predict for a card"
        )
    index = int(device.partition(":")[2] or 0)
    if index >= torch.cuda.device_count():
        return f"{device}, but this host has {torch.cuda.device_count()} CUDA device(s)"
    return None


def check_device(spec: Spec) -> None:
    """Raise ``SpecError`` (exit 2, one line) if this host cannot run the spec's device."""
    why = device_problem(spec.device)
    if why:
        raise SpecError(f"{spec._source or '<spec>'}: device: {why}")


def check_stores(spec: Spec) -> None:
    """Raise ``SpecError`` (exit 2, one line) if a store cannot be reached or written, or is
    not what its field says (a damaged SQLite file, a journal that is not Optuna's, an MLflow
    file store that MLflow 3 refuses). Only folders are created, never a store."""
    results = Path(spec.tracking.results_dir)
    why = writable_folder(results)
    if why:
        raise problem(spec, "tracking.results_dir", str(results), why)
    for field, store, kind in (
        ("tracking.mlflow_uri", spec.tracking.mlflow_uri, "mlflow"),
        ("tracking.storage", spec.tracking.storage, "optuna"),
    ):
        note_store(f"{spec._source or '<spec>'}: {field}", store, kind)  # for a later error
        if store.startswith(JOURNAL_PREFIX):
            check_local_file(spec, field, store, journal_file(store))
        elif urlparse(store).scheme == "sqlite":
            check_local_file(spec, field, store, Path(store.removeprefix("sqlite:///")))
        why = tracking_problem(store) if kind == "mlflow" else storage_problem(store)
        if why:
            raise problem(spec, field, store, why)


def local_path(store: str) -> str | None:
    """The file a store lives in when that path means something on this host only (relative
    to its working directory, or in memory), else None."""
    if store.startswith(JOURNAL_PREFIX):
        raw = store.removeprefix(JOURNAL_PREFIX).removeprefix("//")
    elif urlparse(store).scheme == "sqlite":
        raw = store.removeprefix("sqlite:///") if store.startswith("sqlite:///") else ""
        if raw in ("", ":memory:"):
            return raw or ":memory:"
    elif urlparse(store).scheme in ("", "file"):
        raw = store.removeprefix("file://")
    else:
        return None  # a server: postgresql://, mysql://, http(s)://
    return None if Path(raw).is_absolute() else raw


def check_shared_stores(spec: Spec, launcher: str) -> None:
    """A launcher whose workers run on other hosts (``slurm``, ``ray``) needs stores they all
    reach: a server, or an absolute path on a filesystem every node mounts. A relative SQLite
    or journal path would give each node a store of its own (one line, exit 2)."""
    for field, store in (
        ("tracking.storage", spec.tracking.storage),
        ("tracking.mlflow_uri", spec.tracking.mlflow_uri),
    ):
        path = local_path(store)
        if path is None:
            continue
        shared = (
            "postgresql://USER@HOST/DB, or journal:/ABSOLUTE/PATH"
            if field == "tracking.storage"
            else "http://MLFLOW_HOST:5000 (an mlflow server), or sqlite:////ABSOLUTE/PATH"
        )
        raise SpecError(
            f"{spec._source or '<spec>'}: {field}: {redact(store)} is a path on this host only "
            f"({path}); the {launcher} launcher's workers run on the cluster's nodes and need a store "
            f"they all reach: {shared} on a filesystem every node mounts"
        )


def model_id_problem(model_id: str, cache_dir: str | None = None) -> str | None:
    """Why a trial could not read ``model_id``'s config without the network: neither a folder
    here nor in the local Hugging Face cache (``cache_dir``; default: huggingface_hub's); None
    when it can, or when huggingface_hub is not installed (the trial then says what is missing).

    Why ask before a sweep: transformers answers an uncached id offline, or a mistyped one, with
    "check your internet connection" from inside the first trial."""
    if Path(model_id).is_dir():
        return None
    try:
        from huggingface_hub import try_to_load_from_cache
        from huggingface_hub.constants import HF_HUB_CACHE
    except ImportError:
        return None
    try:
        found = try_to_load_from_cache(model_id, "config.json", cache_dir=cache_dir)
    except ValueError as error:  # huggingface_hub's HFValidationError: not a repo id at all
        return f"{model_id!r} is neither a folder nor a Hugging Face repo id ({error})"
    if isinstance(found, str):
        return None
    return (
        f"{model_id!r} is neither a folder nor in the local Hugging Face cache "
        f"({cache_dir or HF_HUB_CACHE}): its trials download its config from the Hub (network "
        "needed; a gated model also a token) and fail offline"
    )
