"""The layering rule (design notes §2) held by tests, not by habit.

The trial layer must run on a GPU box that has PyTorch and nothing else, so importing it, and
running a trial with it, must load none of the sweep layer's libraries. And no module of
``harness`` may import itself back through others: each step of the data flow builds only on
the steps below it (the contracts in pyproject.toml, checked by import-linter). The types are
``make lint``'s (pyright, 35 s of one core), which CI runs before this suite (``.ci/run``).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import grimp

from harness.compat.lint import private_torch_names
from harness.spec import parse_spec, trial_configs
from tests.conftest import REPO, expect_exit

SWEEP_LIBRARIES = (
    "optuna",
    "mlflow",
    "pandas",
    "pydantic",
    "click",
    "yaml",
    "rich",
    "matplotlib",
    "plotly",
    "moocore",
    "sqlalchemy",
    "sklearn",
)
SWEEP_PACKAGES = (
    "harness.spec",
    "harness.sweep",
    "harness.record",
    "harness.analyse",
    "harness.cli",
)


def loaded_roots(script: str) -> tuple[set[str], list[str]]:
    """Top-level packages and ``harness`` modules a fresh interpreter has after ``script``."""
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            script + "\nimport json, sys; print(json.dumps(sorted(sys.modules)))",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )
    expect_exit(done)
    modules = json.loads(done.stdout.strip().splitlines()[-1])
    return {m.partition(".")[0] for m in modules}, [m for m in modules if m.startswith("harness")]


def sweep_parts(roots: set[str], harness_modules: list[str]) -> list[str]:
    libraries = sorted(roots & set(SWEEP_LIBRARIES))
    ours = [m for m in harness_modules if m.startswith(SWEEP_PACKAGES) or m == "harness.results"]
    return libraries + ours


def test_importing_the_trial_layer_loads_no_sweep_library():
    roots, ours = loaded_roots(
        "import harness.trial, harness.trial.run, harness.trial.zygote\n"
        "harness.trial.zygote.preload()"  # what a warm trial starter holds: every family too
    )
    assert "torch" in roots
    assert sweep_parts(roots, ours) == []


def test_running_a_trial_loads_no_sweep_library(tmp_path, base_spec):
    config = trial_configs(parse_spec(base_spec))[0]
    config_path, result_path = tmp_path / "config.json", tmp_path / "result.json"
    config_path.write_text(config.to_json())
    roots, ours = loaded_roots(
        "from harness.trial.__main__ import main\n"
        f"assert main([{str(config_path)!r}, {str(result_path)!r}]) == 0"
    )
    assert json.loads(result_path.read_text())["status"] == "ok"
    assert "harness.trial.run" in ours and "harness.meters.memory" in ours
    assert sweep_parts(roots, ours) == []


def test_the_sweep_layer_plans_trials_without_torch():
    """Validating a spec and expanding its grid is the sweep's business: no model code."""
    roots, _ = loaded_roots(
        "from harness.spec import load_spec, trial_configs\n"
        "trial_configs(load_spec('experiments/default.yaml'))"
    )
    assert "torch" not in roots and "pydantic" in roots


def test_no_module_imports_itself_back():
    graph = grimp.build_graph("harness")
    cycles = set()
    for module in sorted(graph.modules):
        for imported in graph.find_modules_directly_imported_by(module):
            chain = graph.find_shortest_chain(imported=module, importer=imported)
            if chain:
                cycles.add(" -> ".join((module, *chain)))
    assert not cycles, "import cycles:\n" + "\n".join(sorted(cycles))


def test_the_layering_contracts_hold():
    lint_imports = Path(sys.executable).parent / "lint-imports"
    done = subprocess.run(
        [str(lint_imports), "--no-cache"], capture_output=True, text=True, cwd=REPO, timeout=300
    )
    expect_exit(done)
    assert "3 kept, 0 broken" in done.stdout


def test_private_torch_is_named_only_in_the_compat_boundary():
    """The issue's own check: no file outside harness/compat spells a private torch name."""
    pattern = re.compile(r"torch\._|torch\.utils\._|torch\.testing\._internal|_C\._")
    outside = sorted(
        str(path.relative_to(REPO))
        for path in (REPO / "harness").rglob("*.py")
        if pattern.search(path.read_text()) and "compat" not in path.relative_to(REPO).parts
    )
    assert outside == []


def test_the_private_torch_contract_reads_names_not_text():
    source = "\n".join(
        [
            "from torch.utils._pytree import tree_leaves",
            "import torch._C as C",
            "task = torch._C._current_graph_task_id()",
            "op = torch.ops.aten._to_copy.default  # an op's name, not a private module",
            "version = torch.__version__",
            "# torch._C in a comment",
            "text = 'torch._guards in a string'",
        ]
    )
    assert [line for line, _ in private_torch_names(source)] == [1, 2, 3]
