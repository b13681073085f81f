"""Model families build for each dataset's shape; datasets load offline with a held-out split."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

from harness.workloads import FAMILIES, build_workload, load_dataset
from harness.workloads.cifar10 import FOLDER, TEST_FILE, TRAIN_FILES
from harness.workloads.tensors import DataInfo, batches
from tests.conftest import expect_exit


def build_model(family, knobs, info):
    return build_workload(family, knobs, info).model


def test_digits_loads_offline_with_a_held_out_split():
    data = load_dataset("digits", {"test_fraction": 0.2}, seed=0)
    assert len(data.train["x"]) + len(data.test["x"]) == 1797
    assert len(data.test["x"]) == round(1797 * 0.2)
    assert data.info == DataInfo((1, 8, 8), 10)
    assert float(data.train["x"].min()) >= 0.0 and float(data.train["x"].max()) <= 1.0
    assert set(data.train["y"].unique().tolist()) == set(range(10))


def test_split_is_seeded():
    a = load_dataset("digits", {}, seed=3)
    b = load_dataset("digits", {}, seed=3)
    c = load_dataset("digits", {}, seed=4)
    assert torch.equal(a.test["y"], b.test["y"])
    assert not torch.equal(a.test["y"], c.test["y"])


def test_synthetic_has_the_asked_shape():
    data = load_dataset(
        "synthetic", {"shape": [3, 16, 16], "num_classes": 5, "num_samples": 100}, seed=0
    )
    assert data.info == DataInfo((3, 16, 16), 5)
    assert len(data.train["x"]) + len(data.test["x"]) == 100


def _write_cifar_batch(path: Path, n: int, seed: int) -> tuple[np.ndarray, list[int]]:
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, size=(n, 3072), dtype=np.uint8)
    labels = rng.integers(0, 10, size=n).tolist()
    with path.open("wb") as handle:
        pickle.dump(
            {"batch_label": path.name, "labels": labels, "data": data, "filenames": []}, handle
        )
    return data, labels


def test_cifar10_reads_the_on_disk_format(tmp_path: Path):
    folder = tmp_path / FOLDER
    folder.mkdir()
    written = [_write_cifar_batch(folder / name, 4, seed) for seed, name in enumerate(TRAIN_FILES)]
    test_pixels, test_labels = _write_cifar_batch(folder / TEST_FILE, 3, 99)
    data = load_dataset("cifar10", {"data_dir": str(tmp_path), "download": False}, seed=0)
    assert data.info == DataInfo((3, 32, 32), 10)
    assert len(data.train["x"]) == 20 and len(data.test["x"]) == 3
    assert data.train["y"].tolist() == [label for _, labels in written for label in labels]
    assert data.test["y"].tolist() == test_labels
    # Pixel layout: row-major 3x32x32 per image, channel first, then normalised per channel.
    raw = torch.as_tensor(test_pixels[1].reshape(3, 32, 32), dtype=torch.float32) / 255
    mean = torch.tensor([0.4914, 0.4822, 0.4465]).view(3, 1, 1)
    std = torch.tensor([0.2470, 0.2435, 0.2616]).view(3, 1, 1)
    assert torch.allclose(data.test["x"][1], (raw - mean) / std)


def test_cifar10_missing_without_download_says_what_to_do(tmp_path: Path):
    with pytest.raises(FileNotFoundError, match=r"data\.download: true"):
        load_dataset("cifar10", {"data_dir": str(tmp_path), "download": False}, seed=0)


# The families built from knobs alone (hf and timm need a model named: tests/test_models.py).
IMAGE_FAMILIES = sorted(
    name for name, f in FAMILIES.items() if "digits" in f.datasets and not f.sources
)


@pytest.mark.parametrize("family", IMAGE_FAMILIES)
@pytest.mark.parametrize("shape", [(1, 8, 8), (3, 32, 32)])
def test_each_family_trains_one_step_on_each_image_shape(family, shape):
    info = DataInfo(shape, 10)
    model = build_model(family, {}, info)
    x = torch.randn(4, *shape)
    logits = model(x)
    assert logits.shape == (4, 10)
    logits.sum().backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_size_knobs_change_the_model():
    info = DataInfo((1, 8, 8), 10)
    small = sum(p.numel() for p in build_model("cnn", {"width": 8}, info).parameters())
    large = sum(p.numel() for p in build_model("cnn", {"width": 32}, info).parameters())
    assert large > 4 * small
    deeper = build_model("resnet", {"depth": 34}, info)
    assert sum(p.numel() for p in deeper.parameters()) > sum(
        p.numel() for p in build_model("resnet", {"depth": 18}, info).parameters()
    )


def test_batches_cover_each_epoch_without_repeats():
    x = torch.arange(10).float().unsqueeze(1)
    y = torch.arange(10)
    stream = batches({"x": x, "y": y}, batch_size=3, seed=0)
    epoch = [next(stream)["y"] for _ in range(3)]  # 3 full batches; the ragged 1 is dropped
    seen = torch.cat(epoch).tolist()
    assert len(seen) == len(set(seen)) == 9


def test_text_is_bytes_of_real_english_with_shifted_targets():
    data = load_dataset("text", {"seq_len": 32, "test_fraction": 0.1}, seed=0)
    assert data.info == DataInfo((32,), 256, 32)
    assert torch.equal(data.train["x"][0, 1:], data.train["y"][0, :-1])
    total = (len(data.train["x"]) + len(data.test["x"])) * 32
    assert 400_000 < total < 500_000
    text = bytes(data.train["x"][:20].flatten().tolist()).decode("utf-8", errors="replace")
    assert " the " in text


def test_gpt_predicts_every_next_token():
    info = DataInfo((16,), 256, 16)
    model = build_model("gpt", {"n_layer": 2, "d_model": 32, "n_head": 4, "seq_len": 16}, info)
    logits = model(torch.randint(0, 256, (3, 16)))
    assert logits.shape == (3, 16, 256)


def test_gpt_tied_head_shares_the_embedding():
    info = DataInfo((16,), 256, 16)
    knobs = {"n_layer": 1, "d_model": 32, "n_head": 2, "seq_len": 16}
    tied = build_model("gpt", {**knobs, "tied": 1}, info)
    untied = build_model("gpt", {**knobs, "tied": 0}, info)
    assert tied.head.weight is tied.tok_emb.weight
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    assert count(untied) - count(tied) == 256 * 32


def test_gpt_presets_reach_billions_of_parameters():
    from harness.workloads import resolve_knobs

    knobs = resolve_knobs("gpt", {"preset": "7b"})
    n, d = knobs["n_layer"], knobs["d_model"]
    assert 12 * n * d * d > 6e9
    assert resolve_knobs("gpt", {"preset": "tiny", "n_layer": 3})["n_layer"] == 3


def test_user_code_folders_do_not_shadow_installed_modules(tmp_path):
    """A spec's folder goes to the end of sys.path: a user file named like a standard-library
    module (here colorsys.py) does not replace it for the trial."""
    import subprocess
    import sys

    (tmp_path / "mymodel.py").write_text("import colorsys\nWHERE = colorsys.__file__\n")
    (tmp_path / "colorsys.py").write_text("raise SystemExit('the user file shadowed colorsys')\n")
    code = (
        "import sys; from harness.workloads import resolve; "
        f"print(resolve('mymodel:WHERE', [{str(tmp_path)!r}])); print(sys.path[-1])"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    expect_exit(done)
    where, last = done.stdout.split()
    assert not where.startswith(str(tmp_path)) and last == str(tmp_path)


def test_evaluation_batches_are_no_larger_than_the_training_batch():
    from harness.meters.accuracy import evaluate
    from harness.workloads.task import Logits

    seen = []

    class Probe(torch.nn.Linear):
        def forward(self, x):
            seen.append(len(x))
            return super().forward(x)

    test = {"x": torch.randn(100, 4), "y": torch.randint(0, 3, (100,))}
    model = Probe(4, 3)
    small = evaluate(model, Logits(), test, torch.device("cpu"), batch_size=16)
    assert max(seen) == 16 and sum(seen) == 100
    seen.clear()
    whole = evaluate(model, Logits(), test, torch.device("cpu"))
    assert seen == [100]
    assert small["accuracy"] == whole["accuracy"]
    assert small["eval_loss"] == pytest.approx(whole["eval_loss"], rel=1e-6)
