"""``--model``: estimate, fit and plan without a spec file (harness.spec.oneshot)."""

from __future__ import annotations

import json

import pytest
import yaml

from harness.spec import SpecError, load_spec, points
from harness.spec.oneshot import DEFAULT_STRATEGIES, oneshot_spec, write_oneshot
from tests.conftest import expect_exit, run_cli


def test_a_preset_becomes_a_fine_tuning_plan_that_loads_as_any_spec(tmp_path):
    spec = oneshot_spec("llama-3.1-8b", card="rtx-4090")
    path = write_oneshot(spec, tmp_path)
    loaded = load_spec(path)
    assert loaded.experiment == "plan-llama-3.1-8b" and loaded.card == "rtx-4090"
    assert loaded.data.vocab_size == 128256  # the preset's own vocabulary
    # 6 strategies x 4 batch sizes, the written file says how to go on from it
    assert len(points(loaded)) == len(DEFAULT_STRATEGIES) * 4
    assert path.read_text().startswith("# Written by harness --model llama-3.1-8b")
    assert yaml.safe_load(path.read_text())["model"]["sizes"]["llama-3.1-8b"]["seq_len"] == 2048


def test_the_flags_shape_the_spec():
    spec = oneshot_spec(
        "qwen2.5-0.5b",
        seq_len=512,
        strategies="none, lora:8+checkpoint",
        batch_sizes=[2],
        dtype="fp16",
    )
    assert spec["grid"] == {
        "batch_size": [2],
        "dtype": ["fp16"],
        "strategy": ["none", ["lora:8", "checkpoint"]],
    }
    assert spec["model"]["sizes"]["qwen2.5-0.5b"]["seq_len"] == 512
    vision = oneshot_spec("vit-base")
    assert vision["data"] == {"dataset": "synthetic", "shape": [3, 224, 224], "num_classes": 1000}
    with pytest.raises(SpecError, match="takes images, not sequences"):
        oneshot_spec("vit-base", seq_len=128)
    # The default sequence is 2048 tokens, or fewer where the model embeds fewer positions.
    assert oneshot_spec("gpt2")["model"]["sizes"]["gpt2"]["seq_len"] == 1024


def test_a_config_folder_or_a_hub_id(tmp_path):
    folder = tmp_path / "My Model"
    folder.mkdir()
    (folder / "config.json").write_text(
        json.dumps({"model_type": "llama", "vocab_size": 4096, "max_position_embeddings": 512})
    )
    spec = oneshot_spec(str(folder))
    assert spec["model"]["sizes"] == {"my-model": {"config": str(folder), "seq_len": 512}}
    assert spec["data"]["vocab_size"] == 4096
    hub = oneshot_spec("Qwen/Qwen2.5-7B")
    assert hub["model"]["sizes"] == {"qwen2.5-7b": {"model_id": "Qwen/Qwen2.5-7B", "seq_len": 2048}}
    with pytest.raises(SpecError, match=r"not a preset .*llama-3\.1-8b.*nor a hub id"):
        oneshot_spec("llama-9")
    (tmp_path / "empty").mkdir()
    with pytest.raises(SpecError, match=r"the folder has no config\.json"):
        oneshot_spec(str(tmp_path / "empty"))
    with pytest.raises(SpecError, match="--strategies: no strategy"):
        oneshot_spec("gpt2", strategies=" , ")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["plan"], "give a SPEC file or --model NAME"),
        (["estimate", "--model", "gpt2"], "--model needs --card NAME"),
        (["fit", "spec.yaml", "--model", "gpt2", "--card", "t4"], "not both"),
        (["plan", "spec.yaml", "--seq-len", "64"], "--seq-len: only with --model"),
        (["plan", "--model", "llama-9", "--card", "t4"], "not a preset"),
        (["plan", "--model", "gpt2", "--card", "t4", "--batch", "one"], "whole numbers"),
    ],
)
def test_wrong_combinations_are_one_line(tmp_path, args, message):
    done = run_cli(*args, cwd=tmp_path)
    assert done.returncode == 2 or (done.returncode == 1 and "Error" in done.stderr), done.stderr
    assert message in done.stderr and "Traceback" not in done.stderr


@pytest.mark.slow
def test_plan_a_model_without_a_spec_file(tmp_path):
    """The ranked table from one command line: a small preset, two strategies, one batch."""
    args = "--model qwen2.5-0.5b --card rtx-4090 --seq-len 32 --batch 1"
    args += " --strategies none,lora:8+checkpoint"
    done = expect_exit(run_cli("plan", *args.split(), cwd=tmp_path, timeout=900))
    assert "rtx-4090: 2 points, ranked by predicted throughput" in done.stdout
    assert "rtx-4090 (24 GiB): 2 of 2 points fit; best " in done.stdout
    assert (tmp_path / "results" / "specs" / "plan-qwen2.5-0.5b.yaml").is_file()
    # progress in the order answers come, with the time left
    assert "[1/2] qwen2.5-0.5b bf16 " in done.stderr and "[2/2] " in done.stderr
