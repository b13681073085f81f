"""Real models: Hugging Face transformers, timm, and user models with their own batches and loss.

Every trial here runs the real libraries on CPU; "exact" means the fake-tensor prediction made
before training equals the peak the memory window measured (the same tensor accounting).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import sys

import pytest
import torch

from harness.spec import SpecError, parse_spec, trial_configs
from harness.trial.fake import construct_on_meta, libraries_run_eagerly
from harness.trial.run import run_trial
from harness.workloads import build_workload, load_dataset
from harness.workloads.hf_presets import HF_PRESETS, PUBLISHED_PARAMS
from harness.workloads.tensors import DataInfo, take
from tests.conftest import BASE_SPEC, SHORT_TEXT, copy_fixture, expect_exit, run_cli, write_spec

pytest.importorskip("transformers")
pytest.importorskip("timm")

SMALL_LLAMA = {
    "preset": "llama-3.2-1b",
    "num_hidden_layers": 2,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 512,
    "seq_len": 32,
}


def spec_for(family, size, dataset="text", strategies=("none",), batch_size=8, **extra):
    data = copy.deepcopy(BASE_SPEC)
    data["model"] = {"family": family, "sizes": {"s": size}, **extra.pop("model", {})}
    short = SHORT_TEXT if dataset == "text" else {"dataset": dataset}
    data["data"] = {**short, **extra.pop("data", {})}
    data["grid"].update(batch_size=[batch_size], strategy=list(strategies))
    data["train"]["budget"] = {"steps": 5}
    data["measure"]["timeline"] = False
    return data


def run_all(data, source=None):
    spec = parse_spec(data, source) if source else parse_spec(data)
    results = {}
    for config in trial_configs(spec):
        result = run_trial(config)
        assert result.status == "ok", result.failure_reason
        results[config.strategy_text] = result
    return results


def exact(result) -> bool:
    return result.metrics["prediction_ratio"] == pytest.approx(1.0, abs=0.01)


@pytest.mark.parametrize("preset", sorted(HF_PRESETS))
def test_every_hf_preset_has_its_published_parameter_count(preset):
    vision = HF_PRESETS[preset]["model_type"] == "vit"
    info = DataInfo((3, 224, 224), 1000) if vision else DataInfo((128,), 256, 128)
    with torch.device("meta"):  # shapes only: an 8B model costs nothing
        model = build_workload("hf", {"preset": preset}, info).model
    count = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert count == pytest.approx(PUBLISHED_PARAMS[preset], rel=0.01)


def test_a_gqa_llama_is_predicted_exactly_and_checkpoint_halves_its_activations():
    results = run_all(spec_for("hf", SMALL_LLAMA, strategies=["none", "checkpoint"]))
    none, checkpointed = results["none"], results["checkpoint"]
    assert exact(none) and exact(checkpointed)
    assert none.info["hf_architecture"] == "LlamaForCausalLM"
    assert none.info["attn_implementation"] == "sdpa" and none.info["hf_task"] == "causal-lm"
    assert none.info["throughput_unit"] == "tokens/s"
    assert "transformers' gradient checkpointing" in checkpointed.info["checkpoint_blocks"]
    activations = (
        checkpointed.metrics["mem_activation_bytes"] / none.metrics["mem_activation_bytes"]
    )
    assert activations <= 0.5
    assert 0 < none.metrics["accuracy"] < 1 and none.metrics["num_params"] > 0


def test_hf_config_folder_file_and_model_id_build_the_same_model(tmp_path):
    from transformers import LlamaConfig

    LlamaConfig(
        vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, architectures=["LlamaForCausalLM"],
    ).save_pretrained(tmp_path / "tiny-llama")  # fmt: skip
    info = DataInfo((16,), 256, 16)
    sizes = [
        {"config": "tiny-llama"},  # a folder, relative to the spec's folder
        {"config": "tiny-llama/config.json"},  # the file itself
        {"model_id": str(tmp_path / "tiny-llama")},  # transformers' own config loading
    ]
    counts = {
        sum(
            p.numel()
            for p in build_workload(
                "hf", size, info, python_path=[str(tmp_path)]
            ).model.parameters()
        )
        for size in sizes
    }
    assert len(counts) == 1
    with pytest.raises(FileNotFoundError, match="not found"):
        build_workload("hf", {"config": "missing"}, info, python_path=[str(tmp_path)])


def test_transformers_sees_fake_tensors_as_the_eager_tensors_they_stand_for():
    from torch._subclasses.fake_tensor import FakeTensorMode
    from transformers import masking_utils

    with FakeTensorMode():
        mask = torch.ones(2, 8, dtype=torch.bool)
        assert masking_utils.is_tracing(mask)  # what made masks explicit under the estimate
        with libraries_run_eagerly():
            assert not masking_utils.is_tracing(mask)
        assert masking_utils.is_tracing(mask)


def test_a_user_hf_model_with_dict_batches_and_its_own_loss_is_predicted_exactly(tmp_path):
    """attention_mask in the batch: transformers' mask code runs, and the prediction follows
    the path the eager run takes (an explicit mask would cost +3-4 % here)."""
    copy_fixture("user_models.py", tmp_path)
    data = spec_for(
        "user_models:llama",
        {},
        dataset="user_models:token_data",
        strategies=["none", "checkpoint"],
        model={"loss": "user_models:shifted_loss"},
    )
    results = run_all(data, str(tmp_path / "spec.yaml"))
    assert all(exact(r) for r in results.values())
    assert results["none"].info["throughput_unit"] == "tokens/s"
    assert 0 <= results["none"].metrics["accuracy"] <= 1


def test_a_timm_vit_with_stochastic_depth_is_built_and_predicted_as_it_runs():
    import timm

    knobs = {"name": "vit_tiny_patch16_224", "patch_size": 4, "depth": 3, "drop_path_rate": 0.2}
    real = build_workload("timm", knobs, DataInfo((3, 16, 16), 10)).model
    with construct_on_meta():  # how the estimate builds it: real values where they are read
        estimated = build_workload("timm", knobs, DataInfo((3, 16, 16), 10)).model
    rates = [getattr(b.drop_path1, "drop_prob", 0.0) for b in real.blocks]
    assert rates == [getattr(b.drop_path1, "drop_prob", 0.0) for b in estimated.blocks]
    assert rates[0] == 0.0 and rates[-1] == pytest.approx(0.2)  # not DropPath(1.0) everywhere
    assert any(p.is_meta for p in estimated.parameters())  # the large ones cost nothing
    assert isinstance(real, timm.models.vision_transformer.VisionTransformer)
    data = spec_for(
        "timm", knobs, "synthetic", ["none", "checkpoint"], 64, data={"shape": [3, 16, 16]}
    )
    results = run_all(data)
    assert all(exact(r) for r in results.values())
    assert results["checkpoint"].info["checkpoint_blocks"] == "blocks: 3 x Block"
    assert (
        results["checkpoint"].metrics["mem_activation_bytes"]
        < results["none"].metrics["mem_activation_bytes"]
    )


def test_checkpoint_wraps_a_plain_transformer_encoder_without_renaming(tmp_path):
    copy_fixture("user_models.py", tmp_path)
    data = spec_for(
        "user_models:encoder", {}, "digits", ["none", "checkpoint", "checkpoint:2"], batch_size=16
    )
    results = run_all(data, str(tmp_path / "spec.yaml"))
    assert results["checkpoint"].info["checkpoint_blocks"] == (
        "encoder.layers: 3 x TransformerEncoderLayer"
    )
    assert results["checkpoint:2"].info["checkpoint_segments"] == 2
    for strategy in ("checkpoint", "checkpoint:2"):
        assert exact(results[strategy])
        assert (
            results[strategy].metrics["mem_activation_bytes"]
            < results["none"].metrics["mem_activation_bytes"]
        )
    assert results["checkpoint"].loss_history == pytest.approx(results["none"].loss_history)


def test_checkpoint_on_a_model_without_blocks_ends_before_training(tmp_path):
    copy_fixture("user_models.py", tmp_path)
    spec = parse_spec(
        spec_for("user_models:single_linear", {}, "digits", ["checkpoint"]),
        str(tmp_path / "spec.yaml"),
    )
    result = run_trial(trial_configs(spec)[0])
    assert result.status == "crash"
    assert result.failure_reason.startswith("checkpoint: no repeated blocks found in Sequential")
    assert result.loss_history == [] and "peak_allocated_bytes" not in result.metrics


@pytest.mark.parametrize(
    ("change", "where", "words"),
    [
        (lambda d: d["model"]["sizes"]["s"].update(task="chat"), "sizes.s.task", "causal-lm"),
        (lambda d: d["model"]["sizes"]["s"].update(model_id="x/y"), "sizes.s", "only one of"),
        (lambda d: d["model"]["sizes"]["s"].pop("preset"), "sizes.s", "needs one of"),
        (lambda d: d["model"]["sizes"]["s"].update(preset="llama-9"), "preset", "llama-3.2-1b"),
        (lambda d: d["grid"].update(strategy=["prune_structured:0.5"]), "strategy", "(not 'hf')"),
        (lambda d: d["model"].update(loss="x:y"), "model.loss", "your own model code"),
    ],
)
def test_hf_sizes_are_checked_before_anything_runs(tmp_path, change, where, words):
    data = spec_for("hf", dict(SMALL_LLAMA))
    change(data)
    with pytest.raises(SpecError) as error:
        parse_spec(data, "x.yaml")
    assert where in str(error.value) and words in str(error.value)


@pytest.mark.slow
def test_an_hf_sweep_and_its_estimate_through_the_cli(tmp_path):
    """The user's path: estimate, sweep, results (one short trial)."""
    from harness.results import load

    data = spec_for("hf", SMALL_LLAMA, strategies=["checkpoint"])
    data["name"] = "hf-cli"
    path = write_spec(tmp_path, data)
    estimated = run_cli("estimate", str(path), "--format", "json", cwd=tmp_path)
    expect_exit(estimated)
    row = json.loads(estimated.stdout)[0]
    done = run_cli("sweep", str(path), cwd=tmp_path)
    expect_exit(done)
    frame = load("hf-cli", f"sqlite:///{tmp_path}/results/mlflow.db")
    assert frame.loc[0, "status"] == "ok"
    assert frame.loc[0, "predicted_peak_bytes"] == row["predicted_peak_bytes"]
    assert frame.loc[0, "prediction_ratio"] == pytest.approx(1.0, abs=0.01)


def test_the_strategies_apply_to_an_hf_model():
    """Each CPU strategy on a transformers Llama: ok, and exactly predicted where predicted."""
    strategies = ["accumulate:2", "bf16_params", "adafactor", "keep_grads", "quantize_int8"]
    results = run_all(spec_for("hf", SMALL_LLAMA, strategies=strategies))
    assert all(exact(r) for r in results.values())
    int8 = results["quantize_int8"].metrics
    assert int8["int8_linear_weight_bytes"] < int8["float_linear_weight_bytes"] / 3
    assert 0 <= int8["int8_accuracy"] <= 1


def test_an_hf_step_holds_its_outputs_through_backward_as_a_training_script_does():
    """The optimistic loop (logits freed before backward) would report less than a Hugging
    Face script holds: the harness keeps ``outputs`` alive, so the peak includes the logits."""
    from harness.meters.memory import MemoryWindow
    from harness.trial.distributed import Ranks
    from harness.trial.setup import build_setup
    from harness.workloads.hf import HuggingFace

    class FreesOutputs(HuggingFace):
        def forward(self, model, batch):
            return super().forward(model, batch)[0], None

    size = {**SMALL_LLAMA, "vocab_size": 4096}
    config = trial_configs(parse_spec(spec_for("hf", size)))[0]
    data = load_dataset(config.dataset, config.dataset_options, 0)

    def peak(task):
        torch.manual_seed(0)
        setup = build_setup(config, torch.device("cpu"), Ranks(), data.info, data)
        setup = dataclasses.replace(setup, task=task)
        batch = setup.to_device(take(data.train, slice(0, 8)))
        setup.train_step(batch)
        window = MemoryWindow(setup.device, setup.model, setup.optimizer, list(batch.values()))
        with window:
            setup.train_step(batch, on_micro_batch=window.micro_batch_done)
        return window.reading.peak_allocated_bytes

    held, freed = peak(HuggingFace("causal-lm")), peak(FreesOutputs("causal-lm"))
    logits = 8 * 32 * 4096 * 4  # batch x tokens x vocabulary, fp32
    assert held - freed >= logits * 0.9


@pytest.mark.parametrize(("family", "size", "package"), [
    ("hf", {"preset": "gpt2"}, "transformers"),
    ("timm", {"name": "resnet18"}, "timm"),
])  # fmt: skip
def test_a_missing_ecosystem_package_is_one_line_naming_it(monkeypatch, family, size, package):
    monkeypatch.setitem(sys.modules, package, None)  # what `import` sees where it is absent
    info = DataInfo((3, 32, 32), 10) if family == "timm" else DataInfo((16,), 256, 16)
    with pytest.raises(RuntimeError, match=rf"^model family {family} needs {package} \(pip"):
        build_workload(family, size, info)
