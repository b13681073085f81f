"""The datasets beyond the built-in four: random tokens, Hugging Face datasets from local files
(tokenized by a tokenizer the test trains, or as bytes; images with labels) and user data."""

from __future__ import annotations

import copy

import pytest
import torch

from harness.spec import SpecError, parse_spec, trial_configs
from harness.trial.run import run_trial
from harness.workloads import describe_dataset, load_dataset
from tests.conftest import BASE_SPEC, copy_fixture

datasets = pytest.importorskip("datasets")
pytest.importorskip("tokenizers")

SENTENCES = [f"line {i}: the quick brown fox jumps over the lazy dog {i % 7}" for i in range(400)]


def test_tokens_are_random_ids_with_shifted_targets():
    options = {"vocab_size": 1000, "seq_len": 16, "num_samples": 50}
    data = load_dataset("tokens", options, seed=0)
    assert data.info == describe_dataset("tokens", options)
    assert data.info.input_shape == (16,) and data.info.num_classes == 1000
    assert data.train_size + len(data.test["x"]) == 50
    assert torch.equal(data.train["x"][:, 1:], data.train["y"][:, :-1])
    assert int(data.train["x"].max()) < 1000


def write_text_files(folder, kind):
    table = datasets.Dataset.from_dict({"text": SENTENCES})
    path = folder / f"lines.{kind}"
    {"parquet": table.to_parquet, "json": table.to_json, "csv": table.to_csv}[kind](str(path))
    return path


@pytest.mark.parametrize("kind", ["parquet", "json", "csv"])
def test_hf_dataset_text_files_are_packed_into_byte_windows(tmp_path, kind):
    write_text_files(tmp_path, kind)
    options = {"format": kind, "data_files": f"lines.{kind}", "seq_len": 32, "test_fraction": 0.1}
    data = load_dataset("hf_dataset", options, seed=0, search=[str(tmp_path)])
    assert data.info.num_classes == 256 and data.info.input_shape == (32,)
    text = bytes(data.train["x"][:4].flatten().tolist()).decode()
    assert "quick brown fox" in text
    assert torch.equal(data.train["x"][0, 1:], data.train["y"][0, :-1])
    total = (data.train_size + len(data.test["x"])) * 32
    assert total == pytest.approx(len("\n".join(SENTENCES).encode()), abs=2 * 33)


def train_tokenizer(folder):
    """A tiny BPE tokenizer, saved as transformers loads tokenizers (no download)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "<eos>"])
    tokenizer.train_from_iterator(SENTENCES, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", eos_token="<eos>")
    fast.save_pretrained(str(folder / "tok"))
    return len(fast)


def test_hf_dataset_text_through_a_local_tokenizer_trains_a_model(tmp_path):
    vocab = train_tokenizer(tmp_path)
    write_text_files(tmp_path, "parquet")
    options = {"format": "parquet", "data_files": ["lines.parquet"], "tokenizer": "tok"}
    data = load_dataset("hf_dataset", {**options, "seq_len": 16}, seed=0, search=[str(tmp_path)])
    assert data.info.num_classes == vocab
    assert int(data.train["x"].max()) < vocab
    spec = copy.deepcopy(BASE_SPEC)
    spec["model"] = {
        "family": "gpt",
        "sizes": {"s": {"n_layer": 1, "d_model": 32, "n_head": 2, "seq_len": 16}},
    }
    spec["data"] = {"dataset": "hf_dataset", **options}
    spec["measure"]["timeline"] = False
    result = run_trial(trial_configs(parse_spec(spec, str(tmp_path / "spec.yaml")))[0])
    assert result.status == "ok", result.failure_reason
    assert result.metrics["prediction_ratio"] == pytest.approx(1.0, abs=0.01)


def test_hf_dataset_images_with_labels(tmp_path):
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)) for _ in range(40)]
    table = datasets.Dataset.from_dict({"img": images, "label": [i % 4 for i in range(40)]})
    table = table.cast_column("img", datasets.Image())
    table.to_parquet(str(tmp_path / "images.parquet"))
    options = {"format": "parquet", "data_files": "images.parquet", "image_column": "img"}
    data = load_dataset("hf_dataset", options, seed=0, search=[str(tmp_path)])
    assert data.info.input_shape == (3, 8, 8) and data.info.num_classes == 4
    assert float(data.train["x"].min()) >= 0.0 and float(data.train["x"].max()) <= 1.0
    assert data.train_size + len(data.test["x"]) == 40


def test_user_data_as_datasets_of_dicts_and_as_one_tensor_pair(tmp_path):
    copy_fixture("user_models.py", tmp_path)
    search = [str(tmp_path)]
    named = load_dataset("user_models:dataset_pair", {}, seed=0, search=search)
    assert set(named.train) == {"pixel_values", "labels"} and named.train_size == 64
    assert named.info.input_shape == (1, 8, 8) and named.info.num_classes == 10
    assert {f.name for f in named.info.batch_fields()} == {"pixel_values", "labels"}
    pair = load_dataset(
        "user_models:tensor_pair", {"args": {"count": 40}, "test_fraction": 0.25}, 0, search
    )
    assert set(pair.train) == {"x", "y"} and pair.train_size == 30
    assert pair.info.num_classes == 5


def test_user_data_in_a_spec_and_what_is_refused():
    data = copy.deepcopy(BASE_SPEC)
    data["data"] = {"dataset": "my_data:load", "args": {"n": 3}, "test_fraction": 0.1}
    assert parse_spec(data).data.options() == {"args": {"n": 3}, "test_fraction": 0.1}
    data["data"] = {"dataset": "my_data:load", "seq_len": 8}
    with pytest.raises(SpecError, match=r"data\.seq_len: only applies to dataset text or tokens"):
        parse_spec(data)
    data["data"] = {"dataset": "hf_dataset"}
    with pytest.raises(SpecError, match=r"data\.data_files: required with dataset hf_dataset"):
        parse_spec(data)


@pytest.mark.parametrize(
    ("dataset", "options"),
    [
        ("digits", {}),
        ("digits", {"test_fraction": 0.5}),
        ("synthetic", {"shape": [4], "num_classes": 3, "num_samples": 101, "test_fraction": 0.3}),
        ("tokens", {"vocab_size": 50, "seq_len": 8, "num_samples": 77}),
        ("text", {"seq_len": 64}),
        ("text", {"seq_len": 1000, "test_fraction": 0.9}),
    ],
)
def test_training_sizes_known_before_loading_match_the_loaders(dataset, options):
    from harness.workloads.sizes import training_samples

    assert training_samples(dataset, options) == load_dataset(dataset, options, seed=3).train_size


def test_a_batch_larger_than_the_training_split_fails_validation():
    spec = copy.deepcopy(BASE_SPEC)
    spec["grid"] = {**spec["grid"], "batch_size": [8, 2000]}
    with pytest.raises(SpecError) as error:
        parse_spec(spec, "s.yaml")
    assert str(error.value).startswith("s.yaml: grid.batch_size[1]: 2000 is larger than")
    assert "training split of dataset digits (1438 samples" in str(error.value)
    text = {
        "name": "lm",
        "model": {"family": "gpt", "sizes": {"long": {"seq_len": 4096}}},
        "data": {"dataset": "text"},
        "grid": {"batch_size": [128], "dtype": ["fp32"], "strategy": ["none"]},
    }
    with pytest.raises(SpecError, match=r"windows of seq_len 4096 for model size long"):
        parse_spec(text, "lm.yaml")
    text["data"] = {"dataset": "hf_dataset", "data_files": "x.txt", "format": "text"}
    parse_spec(text, "lm.yaml")  # read from files: only known once loaded
