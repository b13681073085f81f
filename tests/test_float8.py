"""``float8`` (torchao's float8 training): predicted from this CPU for an fp8 card, its matmuls
priced at the card's fp8 peak, refused in one line on a card without fp8 tensor cores and in a
spec that cannot run it."""

from __future__ import annotations

import copy

import pytest
import torch

from harness.cuda.cards import CATALOGUE
from harness.spec import SpecError, parse_spec, trial_configs
from harness.trial.estimate import Predictor
from tests.conftest import BASE_SPEC

CPU = torch.device("cpu")
# Every Linear 256 wide (multiples of 16: torchao's kernels take them); the head is left alone.
GPT = {"n_layer": 2, "d_model": 256, "n_head": 4, "seq_len": 128}


def spec(strategy, card: str = "h100-80gb", **changes) -> dict:
    data = copy.deepcopy(BASE_SPEC)
    data["model"] = {"family": "gpt", "sizes": {"s": dict(GPT)}}
    data["data"] = {"dataset": "tokens", "vocab_size": 1000, "num_samples": 32}
    data["grid"].update(batch_size=[4], dtype=["bf16"], strategy=[strategy])
    data.update({"device": "cuda", "card": card, **changes})
    return data


def predicted(strategy, card: str = "h100-80gb"):
    (config,) = trial_configs(parse_spec(spec(strategy, card)))
    with Predictor(config, CPU, as_cuda=True) as predictor:
        prediction = predictor.predict(config.batch_size)
        calls = list(predictor.trace.costs.calls) if predictor.trace is not None else []
        notes = dict(predictor.setup.info) if predictor.setup is not None else {}
    return prediction, calls, notes


@pytest.mark.parametrize("recipe", ["float8", "float8:rowwise"])
def test_float8_matmuls_run_in_fp8_at_the_cards_fp8_peak(recipe):
    plain, plain_calls, _ = predicted("none")
    fp8, calls, notes = predicted(recipe)
    assert plain.ok and fp8.ok, fp8.reason
    # torchao's mm on fp8 tensors (torch._scaled_mm below them): 2 blocks x 4 Linear layers
    # (attention in and out, MLP up and down), forward and two in backward; the head in bf16
    fp8_mm = [c for c in calls if c.name == "mm" and c.dtype.startswith("float8")]
    assert len(fp8_mm) == 2 * 4 * 3, len(fp8_mm)
    assert not any(c.dtype.startswith("float8") for c in plain_calls)
    # the same multiply-adds, now counted at fp8 (the head stays a bf16 mm)
    assert fp8.speed.model_flops == pytest.approx(plain.speed.model_flops, rel=0.01)
    assert notes["float8_layers"].startswith("8 of 9 Linear layers in fp8")
    # the high-precision weights and their optimizer state stay; the peak about the same
    assert fp8.breakdown["param"] == plain.breakdown["param"]
    assert fp8.peak_bytes == pytest.approx(plain.peak_bytes, rel=0.1)


def test_float8_on_a_card_without_fp8_tensor_cores_is_refused_in_one_line():
    assert CATALOGUE["a100-80gb"].compute_capability == (8, 0)
    prediction, _, _ = predicted("float8", "a100-80gb")
    assert not prediction.ok
    assert prediction.reason == (
        "float8 needs compute capability 8.9+ (fp8 tensor cores: Ada, Hopper, Blackwell); "
        "a100-80gb is 8.0"
    )
    assert "\n" not in prediction.reason
    ada, _, _ = predicted("float8", "rtx-4090")  # 8.9: allowed
    assert ada.ok, ada.reason


@pytest.mark.parametrize(
    ("strategy", "changes", "words"),
    [
        ("float8:columnwise", {}, "unknown recipe 'columnwise' (allowed: float8:tensorwise, float8:rowwise)"),
        ("float8", {"device": "cpu"}, "strategy 'float8' needs device cuda"),
        (["lora:8", "float8"], {}, "'lora' and 'float8' cannot be combined"),
        (["tp:2", "float8"], {}, "'tp' and 'float8' cannot be combined"),
    ],
)  # fmt: skip
def test_float8_refusals_are_one_line_at_validation(strategy, changes, words):
    with pytest.raises(SpecError) as caught:
        trial_configs(parse_spec(spec(strategy, **changes)))
    assert words in str(caught.value) and "\n" not in str(caught.value)


def test_float8_under_fsdp_gathers_its_weights_in_fp8_in_the_tensorwise_recipe():
    """torchao's fp8 all-gather (``enable_fsdp_float8_all_gather``): the blocks' weights cross
    as fp8 bytes (uint8 all-gathers); the rowwise recipe gathers them in their own precision."""
    _, tensorwise, notes = predicted(["fsdp:2", "float8"])
    _, rowwise, _ = predicted(["fsdp:2", "float8:rowwise"])

    def gathered_dtypes(calls) -> set[str]:
        return {c.dtype for c in calls if c.name == "_allgather_base_"}

    assert notes["float8_layers"].startswith("8 of 9 Linear layers in fp8 (tensorwise)")
    assert "uint8" in gathered_dtypes(tensorwise)
    assert "uint8" not in gathered_dtypes(rowwise)
