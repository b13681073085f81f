"""Pruning and int8 quantization, each measured against the ``none`` baseline of the same trial.

Real trials on the CPU (tensor accounting is exact there), small models, a few steps.
"""

from __future__ import annotations

import copy

import pytest

from harness.spec import SpecError, parse_spec, trial_configs
from harness.trial.run import run_trial
from tests.conftest import BASE_SPEC, SHORT_TEXT

GPT = {"n_layer": 2, "d_model": 32, "n_head": 2, "seq_len": 32}


def spec_for(family: str, strategy: str | list[str], batch_size: int = 32) -> dict:
    spec = copy.deepcopy(BASE_SPEC)
    sizes = {"mlp": {"width": 256, "depth": 2}, "cnn": {"width": 16}, "gpt": GPT}
    spec["model"] = {"family": family, "sizes": {"m": sizes.get(family, {})}}
    if family == "gpt":
        spec["data"] = dict(SHORT_TEXT)
        batch_size = 8
    spec["grid"].update(batch_size=[batch_size], strategy=[strategy])
    spec["train"]["optimizer"] = {"name": "adam", "lr": 1e-3, "foreach": False}
    spec["train"]["budget"] = {"steps": 8}
    return spec


def trial(family: str, strategy: str | list[str]) -> dict:
    result = run_trial(trial_configs(parse_spec(spec_for(family, strategy)))[0])
    assert result.status == "ok", result.failure_reason
    return result.metrics


@pytest.fixture(scope="module")
def mlp_none() -> dict:
    return trial("mlp", "none")


def test_structured_pruning_shrinks_the_mlp(mlp_none):
    pruned = trial("mlp", "prune_structured:0.5")
    print("mlp param bytes", mlp_none["mem_param_bytes"], "->", pruned["mem_param_bytes"])
    assert pruned["mem_param_bytes"] <= 0.6 * mlp_none["mem_param_bytes"]
    assert pruned["num_params"] < mlp_none["num_params"]
    # Fewer parameters means fewer gradient and optimizer-state bytes too.
    assert pruned["mem_grad_bytes"] < mlp_none["mem_grad_bytes"]
    assert pruned["mem_optim_bytes"] < mlp_none["mem_optim_bytes"]
    assert 0 <= pruned["accuracy"] <= 1


@pytest.mark.parametrize("family", ["cnn", "gpt"])
def test_structured_pruning_shrinks_cnn_and_gpt(family):
    none, pruned = trial(family, "none"), trial(family, "prune_structured:0.5")
    print(family, "param bytes", none["mem_param_bytes"], "->", pruned["mem_param_bytes"])
    assert pruned["mem_param_bytes"] < 0.9 * none["mem_param_bytes"]
    assert pruned["num_params"] < none["num_params"]
    assert 0 <= pruned["accuracy"] <= 1


def test_magnitude_pruning_is_sparse_but_not_smaller(mlp_none):
    pruned = trial("mlp", "prune:0.5")
    print("sparsity", pruned["sparsity"], "param bytes", pruned["mem_param_bytes"])
    assert pruned["sparsity"] == pytest.approx(0.5, abs=0.01)
    # Dense storage: weight_orig is still a full parameter, and the masks come on top.
    assert pruned["mem_param_bytes"] >= mlp_none["mem_param_bytes"]
    assert pruned["num_params"] == mlp_none["num_params"]
    assert 0 <= pruned["accuracy"] <= 1


def test_magnitude_pruning_skips_a_tied_gpt_head():
    pruned = trial("gpt", "prune:0.5")
    assert pruned["sparsity"] == pytest.approx(0.5, abs=0.01)


def test_int8_quantization_shrinks_linear_weights(mlp_none):
    quant = trial("mlp", "quantize_int8")
    ratio = quant["float_linear_weight_bytes"] / quant["int8_linear_weight_bytes"]
    print(
        f"weight bytes {quant['float_linear_weight_bytes']:.0f} -> "
        f"{quant['int8_linear_weight_bytes']:.0f} ({ratio:.2f}x); peaks "
        f"{quant['float_peak_inference_bytes']:.0f} / {quant['int8_peak_inference_bytes']:.0f}; "
        f"accuracy {quant['accuracy']:.3f} / int8 {quant['int8_accuracy']:.3f}"
    )
    assert ratio >= 3
    assert 0 <= quant["int8_accuracy"] <= 1
    assert quant["float_peak_inference_bytes"] > 0
    assert quant["int8_peak_inference_bytes"] > 0
    # The peak counts the weights: the float copy's peak holds at least its Linear weights.
    assert quant["float_peak_inference_bytes"] >= quant["float_linear_weight_bytes"]
    assert quant["int8_peak_inference_bytes"] >= quant["int8_linear_weight_bytes"]
    # Training is untouched: the same metrics, the same model. (What competed for the CPU is
    # absent from a timed window shorter than /proc/stat's 10 ms tick, in either trial.)
    assert {m for m in mlp_none if not m.startswith("timing_")} <= set(quant)
    assert quant["num_params"] == mlp_none["num_params"]
    assert quant["mem_param_bytes"] == mlp_none["mem_param_bytes"]


def test_int8_quantization_of_gpt_after_pruning():
    # The pruning masks are folded into the float copy before quantizing.
    quant = trial("gpt", ["prune:0.5", "quantize_int8"])
    assert quant["float_linear_weight_bytes"] / quant["int8_linear_weight_bytes"] >= 3
    assert 0 <= quant["int8_accuracy"] <= 1


def test_structured_pruning_of_resnet_is_refused():
    spec = spec_for("resnet", "prune_structured:0.5")
    spec["model"]["sizes"] = {"m": {"depth": 18}}
    try:
        config = trial_configs(parse_spec(spec))[0]
    except SpecError as error:  # rejected at validation time (registry families)
        assert "prune_structured" in str(error)
        return
    with pytest.raises(ValueError, match="structured pruning of ResNet is not supported"):
        run_trial(config)
