"""Fine-tuning from real weights: ``pretrained: true`` on ``hf`` and ``timm`` sizes.

Tiny models are saved in each test's folder (no download): the trial's build must hold exactly
the saved values, its own evaluation must score them as the saved model scores itself, LoRA must
wrap them, and the estimate must neither read them nor count a byte differently.
"""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch
from torch.nn.functional import cross_entropy

from harness.meters.accuracy import evaluate
from harness.spec import SpecError, load_spec, parse_spec, trial_configs
from harness.trial.distributed import Ranks
from harness.trial.fit import predict_fresh
from harness.trial.run import run_trial
from harness.trial.setup import build_setup
from harness.workloads import build_workload, load_dataset
from harness.workloads.tensors import INPUTS, TARGETS, DataInfo, batches
from tests.conftest import BASE_SPEC, SHORT_TEXT, write_spec

pytest.importorskip("transformers")
pytest.importorskip("timm")

SEQ_LEN = 16
TEXT = {**SHORT_TEXT, "seq_len": SEQ_LEN}
TEXT_INFO = DataInfo((SEQ_LEN,), 256, SEQ_LEN)
VIT = {"name": "vit_tiny_patch16_224", "patch_size": 4, "depth": 2, "embed_dim": 48}
VIT_CLASSES = 1000  # the class count of the architecture's own pretrained config
IMAGES = {"dataset": "synthetic", "shape": [3, 16, 16], "num_classes": VIT_CLASSES}


@pytest.fixture
def saved_llama(tmp_path):
    """A 2-layer Llama (byte vocabulary and a little more), trained a few steps on the text
    so that its loss is far from a random model's, saved as safetensors."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(1)
    config = LlamaConfig(
        vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, architectures=["LlamaForCausalLM"],
    )  # fmt: skip
    model = LlamaForCausalLM(config)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    train = load_dataset("text", TEXT, seed=0).train[INPUTS]
    for step in range(20):
        inputs = train[step * 16 : (step + 1) * 16]
        model(input_ids=inputs, labels=inputs).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()
    folder = tmp_path / "tiny-llama"
    model.save_pretrained(folder)
    assert (folder / "model.safetensors").exists()
    return folder, model


@pytest.fixture
def saved_vit(tmp_path):
    """A tiny timm ViT's state dict saved as one file, as timm's own checkpoints are; its head
    scaled so that its loss is far from a random model's."""
    import timm

    torch.manual_seed(2)
    model = timm.create_model(VIT["name"], img_size=16, num_classes=VIT_CLASSES, **knobs_of(VIT))
    with torch.no_grad():
        model.head.weight.mul_(50)
    path = tmp_path / "vit.pth"
    torch.save(model.state_dict(), path)
    return path, model.eval()


def knobs_of(knobs):
    return {k: v for k, v in knobs.items() if k != "name"}


def same_values(built, saved) -> bool:
    ours, theirs = built.state_dict(), saved.state_dict()
    return ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


def hf_loss(model, inputs) -> float:
    """The saved model's own held-out loss: every window at once, as transformers computes it."""
    with torch.no_grad():
        return float(model(input_ids=inputs, labels=inputs).loss)


def trial_eval(workload, test) -> float:
    return evaluate(workload.model, workload.task, test, torch.device("cpu"))["eval_loss"]


def test_an_hf_size_loads_the_saved_weights_and_the_trial_scores_them_as_saved(saved_llama):
    folder, saved = saved_llama
    test = load_dataset("text", TEXT, seed=0).test
    expected = hf_loss(saved, test[INPUTS])
    for source in ({"config": str(folder)}, {"model_id": str(folder)}):
        knobs = {**source, "pretrained": True, "seq_len": SEQ_LEN}
        loaded = build_workload("hf", knobs, TEXT_INFO)
        assert same_values(loaded.model, saved)
        assert loaded.model.dtype == torch.float32 and not loaded.model.config.use_cache
        assert trial_eval(loaded, test) == pytest.approx(expected, rel=1e-5)
    random = build_workload("hf", {"config": str(folder), "seq_len": SEQ_LEN}, TEXT_INFO)
    assert not same_values(random.model, saved)
    assert trial_eval(random, test) != pytest.approx(expected, rel=0.05)


def test_an_override_that_changes_a_shape_is_named_not_half_loaded(saved_llama):
    folder, _ = saved_llama
    knobs = {"config": str(folder), "pretrained": True, "intermediate_size": 48}
    with pytest.raises(ValueError, match=r"do not fit the size's config .*mismatched"):
        build_workload("hf", knobs, TEXT_INFO)
    with pytest.raises(ValueError, match="a folder saved by save_pretrained"):
        build_workload("hf", {"config": str(folder / "config.json"), "pretrained": True}, TEXT_INFO)


def test_a_timm_size_loads_its_weights_file_and_the_trial_scores_them_as_saved(saved_vit):
    path, saved = saved_vit
    test = load_dataset("synthetic", IMAGES, seed=0).test
    with torch.no_grad():
        expected = float(cross_entropy(saved(test[INPUTS]), test[TARGETS]))
    info = DataInfo((3, 16, 16), VIT_CLASSES)
    loaded = build_workload("timm", {**VIT, "pretrained": True, "pretrained_file": str(path)}, info)
    assert same_values(loaded.model, saved)
    assert trial_eval(loaded, test) == pytest.approx(expected, rel=1e-5)
    random = build_workload("timm", VIT, info)
    assert not same_values(random.model, saved)
    assert trial_eval(random, test) != pytest.approx(expected, rel=0.05)
    # Fewer classes: timm starts the head fresh and loads the rest, as it does for ImageNet
    # weights on a small dataset.
    knobs = {**VIT, "pretrained": True, "pretrained_file": str(path)}
    ten = build_workload("timm", knobs, DataInfo((3, 16, 16), 10)).model.state_dict()
    body = {k: v for k, v in saved.state_dict().items() if not k.startswith("head.")}
    assert all(torch.equal(ten[k], v) for k, v in body.items())
    assert ten["head.weight"].shape == (10, 48)


def hf_spec(folder, strategies=("none",), **size):
    data = copy.deepcopy(BASE_SPEC)
    knobs = {"config": str(folder), "pretrained": True, "seq_len": SEQ_LEN, **size}
    data["model"] = {"family": "hf", "sizes": {"tiny": knobs}}
    data["data"] = dict(SHORT_TEXT)
    data["grid"].update(batch_size=[4], strategy=list(strategies))
    data["train"]["budget"] = {"steps": 2}
    data["measure"] = {"warmup_steps": 1, "memory_steps": 1, "timed_steps": 1, "timeline": False}
    return data


def test_the_estimate_counts_the_same_bytes_without_reading_the_weights(saved_llama):
    folder, _ = saved_llama
    pretrained = trial_configs(parse_spec(hf_spec(folder, ["none", "lora:8"])))
    cpu = torch.device("cpu")
    (folder / "model.safetensors").write_bytes(b"not weights")  # reading them would fail
    for config in pretrained:
        knobs = {k: v for k, v in config.model_knobs.items() if k != "pretrained"}
        random = replace(config, model_knobs=knobs)
        assert predict_fresh(config, cpu, False) == predict_fresh(random, cpu, False)


def test_lora_wraps_the_loaded_weights(saved_llama):
    folder, saved = saved_llama
    config = trial_configs(parse_spec(hf_spec(folder, ["lora:8"])))[0]
    split = load_dataset("text", TEXT, seed=0)
    setup = build_setup(config, torch.device("cpu"), Ranks(), split.info, split)
    base = setup.model.get_base_model()
    assert same_values_where_saved(base, saved)
    frozen = [n for n, p in setup.model.named_parameters() if not p.requires_grad]
    assert frozen and all("lora_" not in n for n in frozen)


def test_qlora_quantizes_the_loaded_weights(saved_llama):
    folder, saved = saved_llama
    config = trial_configs(parse_spec(hf_spec(folder, ["qlora:8"])))[0]
    split = load_dataset("text", TEXT, seed=0)
    setup = build_setup(config, torch.device("cpu"), Ranks(), split.info, split)
    theirs = saved.state_dict()
    quantized = 0
    for name, value in setup.model.get_base_model().state_dict().items():
        if "lora_" in name:
            continue
        expected = theirs[name.replace(".base_layer", "")]
        if type(value).__name__ == "NF4Tensor":  # 4-bit codes of the saved values
            quantized += 1
            error = (value.get_original_weight().float() - expected).norm() / expected.norm()
            assert error < 0.15, name
        else:  # embeddings, norms, the head: as saved
            assert torch.equal(value, expected), name
    assert quantized == 2 * 7  # q k v o gate up down of both layers


def same_values_where_saved(base, saved) -> bool:
    """The frozen base of a LoRA model holds the saved values (peft renames the wrapped linear
    layers' weights ``base_layer.weight``)."""
    ours = {
        k.replace(".base_layer", ""): v for k, v in base.state_dict().items() if "lora_" not in k
    }
    theirs = saved.state_dict()
    return ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


@pytest.mark.slow
def test_a_lora_trial_fine_tunes_the_saved_weights(saved_llama):
    folder, saved = saved_llama
    config = trial_configs(parse_spec(hf_spec(folder, ["lora:8"])))[0]
    result = run_trial(config)
    assert result.status == "ok", result.failure_reason
    assert result.metrics["prediction_ratio"] == pytest.approx(1.0, abs=0.01)
    train = load_dataset("text", TEXT, seed=0).train
    first = next(batches(train, config.batch_size, config.seed))[INPUTS]
    # LoRA's B starts at zero: the first step's loss is the saved model's on that batch.
    assert result.loss_history[0] == pytest.approx(hf_loss(saved, first), rel=1e-5)


@pytest.mark.parametrize(
    ("family", "size", "where", "words"),
    [
        ("mlp", {"width": 8, "pretrained": True}, "sizes.s.pretrained", "no pretrained weights"),
        ("hf", {"preset": "gpt2", "pretrained": True}, "sizes.s.pretrained", "model_id or config"),
        ("hf", {"model_id": "x/y", "pretrained": "yes"}, "sizes.s.pretrained", "true or false"),
        ("timm", {"name": "resnet18", "pretrained": True}, "sizes.s.pretrained", "pretrained_file"),
        ("timm", {"name": "resnet18", "pretrained_file": "w.pth"}, "pretrained_file", "loads no"),
    ],
)
def test_pretrained_sizes_are_checked_before_anything_runs(family, size, where, words):
    data = copy.deepcopy(BASE_SPEC)
    data["model"] = {"family": family, "sizes": {"s": size}}
    if family == "hf":
        data["data"] = dict(SHORT_TEXT)
    with pytest.raises(SpecError) as error:
        parse_spec(data, "x.yaml")
    message = str(error.value)
    assert where in message and words in message and "\n" not in message


@pytest.mark.parametrize(
    ("family", "size", "words"),
    [
        ("hf", {"config": "missing", "pretrained": True}, "model.sizes.s.config: 'missing' not"),
        ("hf", {"config": "cfg.json", "pretrained": True}, "is a file"),
        (
            "timm",
            {"name": "resnet18", "pretrained_file": "no.pth", "pretrained": True},
            "not found",
        ),
    ],
)
def test_a_missing_weights_path_is_one_line_naming_the_field(tmp_path, family, size, words):
    (tmp_path / "cfg.json").write_text("{}")
    data = copy.deepcopy(BASE_SPEC)
    data["model"] = {"family": family, "sizes": {"s": size}}
    data["data"] = dict(SHORT_TEXT) if family == "hf" else {"dataset": "digits"}
    with pytest.raises(SpecError) as error:
        load_spec(write_spec(tmp_path, data))
    assert words in str(error.value) and "\n" not in str(error.value)


@pytest.mark.slow
def test_a_pretrained_trials_first_held_out_loss_is_the_saved_models(saved_llama):
    """The trial's own held-out curve (train.budget.eval_every) at step 0, before any training:
    the saved model's loss when the size is pretrained, a random model's otherwise."""
    folder, saved = saved_llama
    expected = hf_loss(saved, load_dataset("text", TEXT, seed=0).test[INPUTS])
    first = {}
    for pretrained in (True, False):
        data = hf_spec(folder, pretrained=pretrained)
        data["train"]["budget"] = {"steps": 2, "eval_every": 2}
        result = run_trial(trial_configs(parse_spec(data))[0])
        assert result.status == "ok", result.failure_reason
        assert result.eval_history[0]["step"] == 0
        first[pretrained] = result.eval_history[0]["eval_loss"]
    assert first[True] == pytest.approx(expected, rel=1e-5)
    assert first[False] != pytest.approx(expected, rel=0.05)
