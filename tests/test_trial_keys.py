"""Trial identity is pinned: a ``TrialConfig``'s JSON (what crosses the process boundary and is
logged beside every recorded trial) and its ``trial_key`` (what a sweep resumes by) must not
move when the code that builds them changes shape. The expected values were computed on the
code before ``TrialConfig`` held typed strategy combinations and settings; a change here orphans
every recorded sweep, so it is never a test to update lightly."""

from __future__ import annotations

import copy
import hashlib
from dataclasses import replace
from typing import Any

import pytest

from harness.spec import SweepPlan, parse_spec, trial_configs
from harness.trial.config import TrialConfig
from tests.conftest import BASE_SPEC

HARDWARE = {"device": "cuda", "device_name": "NVIDIA H200"}


def spec_of(**changes: Any) -> dict[str, Any]:
    data = copy.deepcopy(BASE_SPEC)
    # The pins were computed with the memory timeline on (BASE_SPEC has it off since; it is in
    # the trial JSON, not in the key).
    data["measure"]["timeline"] = True
    for section, value in changes.items():
        if isinstance(value, dict) and isinstance(data.get(section), dict):
            data[section].update(value)
        else:
            data[section] = value
    return data


def configs(case: str) -> list[TrialConfig]:
    """Each case's trial configs, with the one machine-dependent field (``python_path``)
    fixed so the JSON is the same on every checkout."""
    if case == "base":
        spec = parse_spec(spec_of())
    elif case == "combinations":
        spec = parse_spec(
            spec_of(
                grid={
                    "batch_size": [8, 32],
                    "dtype": ["fp32", "bf16"],
                    "strategy": [
                        "checkpoint",
                        "checkpoint:2",
                        ["accumulate:4", "sgd_momentum"],
                        ["prune:0.5", "keep_grads"],
                        " adafactor ",
                    ],
                },
                train={
                    "optimizer": {"name": "sgd", "lr": 0.1, "momentum": 0.9, "foreach": True},
                    "budget": {"epochs": 2},
                },
            )
        )
    elif case == "adapters":
        spec = parse_spec(
            spec_of(
                model={"family": "gpt", "sizes": {"g": {"n_layer": 2, "d_model": 32, "n_head": 2}}},
                data={"dataset": "text"},
                grid={"batch_size": [4], "dtype": ["bf16"], "strategy": ["none", "lora:8"]},
                train={
                    "optimizer": {"name": "adamw", "lr": 1, "weight_decay": 0.01},
                    "lora": {"alpha": 16, "targets": ["attn"], "dropout": 0.1},
                    "budget": {"steps": 5},
                },
            )
        )
    elif case == "cuda":
        data = spec_of(
            model={"family": "gpt", "sizes": {"g": {"n_layer": 2, "d_model": 32, "n_head": 2}}},
            data={"dataset": "text"},
            grid={
                "batch_size": [4, "max"],
                "dtype": ["bf16"],
                "strategy": [["fsdp:2", "fsdp_mixed"], "ddp:2", ["qlora:4", "ddp:1"]],
            },
            train={"lora": {"base_dtype": "bf16"}},
            card="h100-80gb",
            allocator="expandable_segments:True",
            device="cuda",
        )
        plan = SweepPlan(parse_spec(data)).on_hardware(HARDWARE)
        found = {
            (p["model_size"], p["dtype"], p["strategy"]): {"batch_size": 64, "search": "max: 64"}
            for p in plan.points
        }
        return [
            replace(config, python_path=["/spec"]) for config in plan.with_max_batch(found).configs
        ]
    else:
        raise ValueError(case)
    return [replace(config, python_path=["/spec"]) for config in trial_configs(spec)]


def fingerprint(config: TrialConfig) -> tuple[str, str]:
    return hashlib.sha256(config.to_json().encode()).hexdigest()[:16], config.trial_key


# case -> [(sha256 of to_json()[:16], trial_key)] in grid order, computed before the change.
PINNED: dict[str, list[tuple[str, str]]] = {
    "adapters": [
        ("6c0f135d41026260", "2bf92c34bc511945"),
        ("32631a1df41c0d67", "cbcb1de4f4e0e098"),
    ],
    "base": [
        ("d10a9aea6265bb6f", "64d39c459130f463"),
    ],
    "combinations": [
        ("96dd7d32ae7ffeb0", "0be8b5469aeffb87"),
        ("502dba63d1642f21", "8b53cb31981bfd09"),
        ("64b42656cce0fd4b", "5e7dc41e16b0f23f"),
        ("f0b25b4777d68512", "89af6b0d761d5af4"),
        ("ec2068f1f5d96232", "9e3f9d78fcc952a8"),
        ("4a4d59f695a1414e", "342aceb8cb5eac0b"),
        ("3d3a4bdc36443276", "96421c954140544a"),
        ("db90920bfe4d0487", "7f9dfacf9898aca5"),
        ("b1af5a0e84777d10", "ab1ce6434c034702"),
        ("92384f56babb035e", "7c16e8b2d8964abb"),
        ("632ace400d9f11c6", "779077c11049d904"),
        ("2332a719ea18ec0a", "8e687088407719b6"),
        ("8569e64ead7dbbe4", "bc463f03e676d7c6"),
        ("2d3b239d07fa7e15", "0ffc70b8dbabf586"),
        ("2f6a83f2031ff555", "9f014169a82ae43f"),
        ("26056c6999f5b08d", "5f9413d2d1082ec3"),
        ("70863e732f76c64b", "5e90508787cc0ccd"),
        ("dc32b295798ec6e4", "b5659c6a87466247"),
        ("f5809452e6aa7607", "4390aaf62ac029c5"),
        ("29de01db9609a7f4", "c9b0f1a11521fad3"),
    ],
    "cuda": [
        ("ce3c188cbb6bce0f", "16b2b5916cd5e02c"),
        ("c9e464ef73c3e640", "f974657c19bc2664"),
        ("dc1b09630ee16395", "73ff8efb9edd4655"),
        ("78d873676710e741", "d27de2a3dcb6a680"),
        ("3a8ccc63fb9f62ad", "6a21be4342930446"),
        ("9a68e0eedaa1eb0d", "d443643ff3eef35c"),
    ],
}

BASE_JSON = """\
{
  "allocator": null,
  "allocator_snapshot": false,
  "batch_size": 32,
  "batch_size_search": null,
  "budget": {
    "steps": 20
  },
  "card": null,
  "data_options": {
    "test_fraction": 0.2
  },
  "dataset": "digits",
  "device": "cpu",
  "device_memory_bytes": null,
  "dtype": "fp32",
  "experiment": "unit",
  "hardware": null,
  "lora": null,
  "memory_steps": 2,
  "model_family": "mlp",
  "model_knobs": {
    "depth": 1,
    "width": 16
  },
  "model_loss": null,
  "model_size": "tiny",
  "optimizer": {
    "foreach": false,
    "lr": 0.001,
    "momentum": 0.0,
    "name": "adam",
    "weight_decay": 0.0
  },
  "python_path": [
    "/spec"
  ],
  "run_infeasible": false,
  "seed": 0,
  "strategy": [
    "none"
  ],
  "timed_steps": 3,
  "timeline": true,
  "warmup_steps": 1
}"""


@pytest.mark.parametrize("case", sorted(PINNED))
def test_trial_json_and_keys_are_pinned(case):
    assert [fingerprint(config) for config in configs(case)] == PINNED[case]


def test_the_base_trial_json_is_pinned_byte_for_byte():
    assert configs("base")[0].to_json() == BASE_JSON


@pytest.mark.parametrize("case", sorted(PINNED))
def test_trial_json_crosses_the_process_boundary_unchanged(case):
    for config in configs(case):
        again = TrialConfig.from_json(config.to_json())
        assert again == config
        assert again.to_json() == config.to_json() and again.trial_key == config.trial_key
