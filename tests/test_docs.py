"""The docs say what the code does: every command, spec key, strategy, family, dataset and
metric is documented; the README stays short and links every page; the results table's column
order and dtypes and the timeline file's layout are the ones described; experiment headers
count their trials right. Each check here once caught a real drift."""

from __future__ import annotations

import re

import pytest
import yaml

from tests.conftest import REPO, ensure_base_model

README = REPO / "README.md"
DOCS = sorted((REPO / "docs").glob("*.md"))


def all_docs() -> str:
    return "\n".join(path.read_text() for path in [README, *DOCS])


def test_readme_is_short_and_every_page_it_links_exists():
    text = README.read_text()
    assert len(text.splitlines()) <= 400
    linked = set(re.findall(r"\]\((docs/[\w.-]+\.md)", text))
    assert {f"docs/{path.name}" for path in DOCS} <= linked, "a docs page the README never links"
    for path in [README, *DOCS]:
        for target, anchor in re.findall(r"\]\(([\w./-]*\.md)?#([\w-]+)\)", path.read_text()):
            page = (path.parent / target) if target else path
            headings = [
                re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
                for line in page.read_text().splitlines()
                if line.startswith("#")
            ]
            assert anchor in headings, f"{path.name}: link to {target}#{anchor} goes nowhere"


def test_every_strategy_family_dataset_and_metric_has_a_table_row():
    from harness.metrics import METRICS
    from harness.strategies import STRATEGIES
    from harness.workloads import DATASETS, FAMILIES

    text = all_docs()
    for name in [*STRATEGIES, *FAMILIES, *DATASETS, *METRICS]:
        assert f"| `{name}" in text, f"no table row for {name}"
    readme = README.read_text()
    family_line = next(line for line in readme.splitlines() if line.strip().startswith("family:"))
    dataset_line = next(line for line in readme.splitlines() if line.strip().startswith("dataset:"))
    for name in FAMILIES:
        assert name in family_line, f"the annotated spec's family list lacks {name}"
    for name in DATASETS:
        assert name in dataset_line, f"the annotated spec's dataset list lacks {name}"


def spec_keys(model: type, prefix: str = "") -> list[str]:
    from pydantic import BaseModel

    keys = []
    for name, field in model.model_fields.items():
        annotation = field.annotation
        inner = getattr(annotation, "__args__", (annotation,))
        nested = [a for a in inner if isinstance(a, type) and issubclass(a, BaseModel)]
        if nested and name not in ("budget", "lora", "optimizer", "objectives"):
            keys += spec_keys(nested[0], f"{prefix}{name}.")
        else:
            keys.append(f"{prefix}{name}")
    return keys


def test_every_spec_key_and_command_option_is_in_the_readme():
    import click

    from harness.cli import main
    from harness.spec.schema import Spec

    readme = README.read_text()
    for key in spec_keys(Spec):
        assert f"`{key}" in readme, f"spec key {key} is not documented in the README"
    for name, command in main.commands.items():
        assert f"harness {name}" in readme, f"command {name} is not in the README"
        for param in command.params:
            if isinstance(param, click.Option):
                flag = max(param.opts, key=len)
                assert flag in readme, f"harness {name} {flag} is not in the README"


def test_results_columns_and_dtypes_are_the_documented_ones():
    import pandas as pd

    from harness.record.results import tidy

    raw = pd.DataFrame(
        [
            {
                "run_id": "r", "sweep_run_id": "s", "sweep": "s 2026-12-05 15:22",
                "start_time": 0, "trial_key": "k",
                "status": "ok", "model": "mlp", "model_size": "s", "batch_size": "8",
                "dtype": "fp32", "strategy": "none", "optimizer": "adam", "dataset": "digits",
                "device": "cpu", "world_size": "1", "seed": "0", "budget": "steps=2",
                "lr": "0.001", "weight_decay": "0.0", "momentum": "0.0", "foreach": "False",
                "warmup_steps": "1", "memory_steps": "1", "timed_steps": "1",
                "device_memory_bytes": "1024", "knob_width": "16", "attempts": "1",
                "torch_threads": "2", "device_name": "cpu", "torch_version": "2",
                "throughput_unit": "samples/s", "git_commit": "abc", "trial_wall_time_s": "1.5",
                "failure_reason": "", "checkpoint_full_blocks": "2", "checkpoint_segments": "4",
                "checkpoint_policy": "checkpoint:auto (full: 0-1; keep: 2-3)", "loss_chunks": "8",
                "recomputation": "checkpoint:auto for 1.00 GiB: ...",
                "pp_blocks": "0-1, 2-3", "rank_memory": "[]", "peak_phase": "optimizer",
                "energy_counter": "absent: no GPU energy counter on cpu",
            }
        ]
    )  # fmt: skip
    frame = tidy(raw)
    text = (REPO / "docs" / "results.md").read_text()
    listed = text[text.index("3. The remaining columns") : text.index("The per-step history")]
    documented = [c for c in re.findall(r"`([a-z_*]+)`", listed) if c != "limits.retries"]
    from harness.metrics import METRICS
    from harness.record.columns import ID_COLUMNS

    rest = [c for c in frame.columns if c not in ID_COLUMNS and c not in METRICS]
    assert [c.replace("knob_width", "knob_*") for c in rest] == documented
    integers = ("batch_size", "attempts", "device_memory_bytes", "torch_threads", "knob_width",
                "checkpoint_full_blocks", "checkpoint_segments", "loss_chunks")  # fmt: skip
    for column in integers:
        assert str(frame[column].dtype) == "Int64", column
    assert str(frame["foreach"].dtype) == "boolean"
    for column in ("lr", "trial_wall_time_s", "peak_allocated_bytes"):
        assert frame[column].dtype == "float64", column


def test_the_timeline_file_is_laid_out_as_described():
    import torch

    from harness.meters.timeline import TimelineTracker

    data = TimelineTracker(torch.device("cpu")).to_json(steps=1, micro_batches=1)
    text = (REPO / "docs" / "deciding.md").read_text()
    described = text[
        text.index("`trial/timeline.json`:") : text.index("the peak and the last op kept")
    ]
    for key in [*data, "trial_key"]:
        assert f"`{key}`" in described, f"timeline.json key {key} is not described"
    for key in ("op", "phase", "micro_batch", "total"):
        assert key in data["samples"] and f"`{key}`" in described


@pytest.mark.parametrize(
    "path", sorted((REPO / "experiments").glob("*.yaml")), ids=lambda p: p.name
)
def test_experiment_headers_count_their_trials(path):
    from harness.spec import load_spec, points

    header = "".join(line for line in path.read_text().splitlines(True) if line.startswith("#"))
    claimed = re.search(r"=\s*(\d+)\s+trials", header.replace("\n#", " "))
    if claimed is None:
        pytest.skip("the header states no trial count")
    if path.name == "finetune_quality.yaml":
        pytest.importorskip("transformers")
        ensure_base_model()  # what it loads, made as `make base-model` makes it
    assert int(claimed.group(1)) == len(points(load_spec(path))), path.name
    assert yaml.safe_load(path.read_text())  # and it is a spec at all
