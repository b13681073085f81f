"""``harness doctor``: what the installed torch and libraries let harness do, before a sweep.

A torch outside the tested range, a private piece a release dropped, a torchao built for
another torch: each costs a feature, not the whole product (``harness.compat``), and each is
cheaper to read here than in a failed trial's log.
"""

from __future__ import annotations

import importlib.metadata
import platform
import sys
from typing import Any

import click

from harness.cli.common import choice_option, make_console

# The libraries a trial may ask for, what asks for each, and how to install it.
LIBRARIES = (
    ("transformers", "model family hf", "pip install 'harness[models]'"),
    ("peft", "strategies lora, qlora", "pip install 'harness[models]'"),
    ("timm", "model family timm", "pip install 'harness[models]'"),
    ("datasets", "dataset hf_dataset", "pip install 'harness[models]'"),
    ("torchao.optim", "strategy adam8bit", "pip install torchao"),
    ("torchao.quantization", "strategy qlora", "pip install torchao"),
    ("liger_kernel.transformers", "strategy fused_ce", "pip install liger-kernel"),
)


def torch_requirement() -> str | None:
    """The torch range harness declares (its installed metadata), e.g. ``>=2.8,<3``."""
    try:
        requires = importlib.metadata.requires("harness") or []
    except importlib.metadata.PackageNotFoundError:
        return None
    for line in requires:
        name, _, rest = line.partition(";")[0].strip().partition("torch")
        if not name and rest[:1] in "<>=!~ ":
            lower_first = sorted(rest.replace(" ", "").split(","), key=lambda s: s[0] != ">")
            return ",".join(lower_first)
    return None


def in_range(version: str, requirement: str | None) -> bool | None:
    if requirement is None:
        return None
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    return Version(version.partition("+")[0]) in SpecifierSet(requirement)


def diagnose(with_libraries: bool = True) -> dict[str, Any]:
    """Everything ``doctor`` says, as plain data (``--format json``)."""
    from harness.compat import memtracker
    from harness.compat.internals import TORCH_VERSION, support
    from harness.workloads.libraries import import_library

    requirement = torch_requirement()
    features = [
        {
            "feature": item.feature,
            "usable": item.usable,
            "as_expected": item.as_expected,
            "missing": [
                {"piece": str(piece), "optional": piece.optional, "since": piece.since, "why": why}
                for piece, why in item.missing
            ],
        }
        for item in support()
    ]
    try:
        chosen = memtracker.choice()
        tracker = {"engine": chosen.kind, "why": chosen.why}
    except memtracker.TrackerUnavailable as error:
        tracker = {"engine": None, "why": str(error)}
    libraries = []
    for module, needed_by, install in LIBRARIES if with_libraries else ():
        try:
            import_library(module, needed_by, install)
            version = importlib.metadata.version(module.partition(".")[0].replace("_", "-"))
            libraries.append({"library": module, "for": needed_by, "ok": True, "detail": version})
        except Exception as error:
            libraries.append(
                {"library": module, "for": needed_by, "ok": False, "detail": str(error)}
            )
    import torch

    return {
        "torch": TORCH_VERSION,
        "torch_required": requirement,
        "torch_in_range": in_range(TORCH_VERSION, requirement),
        "python": platform.python_version(),
        "cuda": {
            "available": torch.cuda.is_available(),
            "build": torch.version.cuda,
            "devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        },
        "features": features,
        "tensor_accounting": tracker,
        "libraries": libraries,
    }


def healthy(found: dict[str, Any]) -> bool:
    """Every feature usable (but those this torch release is too old for), tensor accounting
    available and torch within the declared range (libraries are optional: a missing one
    costs only what asks for it)."""
    return (
        found["torch_in_range"] is not False
        and all(item["as_expected"] for item in found["features"])
        and found["tensor_accounting"]["engine"] is not None
    )


@click.command()
@choice_option("--format", "fmt", choices=("table", "json"), default="table")
@click.option(
    "--no-libraries", is_flag=True, help="Skip importing the model libraries (seconds each)."
)
def doctor(fmt: str, no_libraries: bool) -> None:
    """Check what the installed torch and libraries support: every feature that needs a private
    part of PyTorch, the tensor-accounting engine, the model libraries (importable, or why not)
    and CUDA. Exit code 1 when a feature this torch should have is unusable, or torch is outside
    the declared range."""
    found = diagnose(with_libraries=not no_libraries)
    if fmt == "json":
        import json

        click.echo(json.dumps(found, indent=1))
    else:
        show(found)
    sys.exit(0 if healthy(found) else 1)


def show(found: dict[str, Any]) -> None:
    from rich.markup import escape

    console = make_console()
    ok, bad, note = "[green]ok     [/]", "[red]missing[/]", "[yellow]note   [/]"
    span = found["torch_required"] or "(not declared: harness is not installed)"
    verdict = {
        True: "[green]within it[/]",
        False: "[red]outside it[/]",
        None: "[yellow]unknown[/]",
    }[found["torch_in_range"]]
    console.print(
        f"torch {found['torch']} (declared: torch{span}, {verdict}), Python {found['python']}"
    )
    cuda = found["cuda"]
    devices = ", ".join(cuda["devices"]) or "no device"
    build = f"CUDA {cuda['build']} build" if cuda["build"] else "CPU-only build"
    console.print(f"CUDA: {build}, {devices}")
    console.print("\n[bold]Features that need private PyTorch[/] (harness/compat)")
    for item in found["features"]:
        status = ok if item["usable"] else "[yellow]n/a    [/]" if item["as_expected"] else bad
        console.print(f"  {status} {escape(item['feature'])}")
        for gone in item["missing"]:
            label = "absent, nothing to do" if gone["optional"] else "lacks"
            if gone["since"]:
                label = f"lacks (torch {gone['since']} or newer has it)"
            console.print(f"          {label}: {escape(gone['piece'])} ({escape(gone['why'])})")
    tracker = found["tensor_accounting"]
    engine = tracker["engine"]
    console.print("\n[bold]Tensor accounting[/] (CPU memory and every prediction)")
    if engine is None:
        console.print(f"  {bad} {escape(tracker['why'])}")
    else:
        why = f": {escape(tracker['why'])}" if tracker["why"] else ""
        console.print(f"  {ok} the {engine} engine{why}")
    if found["libraries"]:
        console.print("\n[bold]Model libraries[/] (imported only by the trials that ask for them)")
        for lib in found["libraries"]:
            status = ok if lib["ok"] else note
            console.print(f"  {status} {lib['library']} ({lib['for']}): {escape(lib['detail'])}")
    console.print(
        "\nhealthy" if healthy(found) else "\n[red]unhealthy[/]: a feature above is unusable"
    )
