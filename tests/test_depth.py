"""A deep model predicted from two shallow traces (``harness.trial.depth``) equals the full
trace to the byte: the allocated, reserved and device figures, the breakdown, the model state,
the parameter counts, the step's FLOPs and time. Each case traces the model whole too, at 8 or
9 blocks, and compares every field of the two predictions (the note aside, which says which
path was taken). Those comparisons trace each model three times: marked ``slow`` (``make test``
runs them; the other torch releases' fast runs take the fallback's test only)."""

from __future__ import annotations

import copy
from dataclasses import replace
from typing import Any

import pytest
import torch

from harness.spec.grid import trial_configs
from harness.spec.load import parse_spec
from harness.trial.config import TrialConfig
from harness.trial.depth import SHALLOW, deep_predictor, depth_of
from harness.trial.estimate import Predictor, estimate_peak, predictor_maker
from harness.trial.prediction import Prediction
from tests.conftest import BASE_SPEC

CPU = torch.device("cpu")
GPT = {"n_layer": 9, "d_model": 64, "n_head": 4, "seq_len": 64}
TOKENS = {"dataset": "tokens", "vocab_size": 512, "num_samples": 64}
LLAMA = {  # grouped-query attention: 4 query heads over 2 key/value heads
    "model_type": "llama",
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 9,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "seq_len": 64,
}
QWEN2 = {  # q/k/v biases, 8 heads over 2 key/value heads
    "preset": "qwen2.5-0.5b",
    "num_hidden_layers": 8,
    "hidden_size": 96,
    "intermediate_size": 160,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "vocab_size": 512,
    "seq_len": 32,
}
VIT = {"name": "vit_tiny_patch16_224", "patch_size": 4, "depth": 8, "embed_dim": 48}
IMAGES = {"dataset": "synthetic", "shape": [3, 16, 16], "num_classes": 10, "num_samples": 64}


def config_of(
    family: str, size: dict[str, Any], strategy: Any, data: dict[str, Any] = TOKENS
) -> TrialConfig:
    spec = copy.deepcopy(BASE_SPEC)
    spec["model"] = {"family": family, "sizes": {"s": dict(size)}}
    spec["data"] = dict(data)
    spec["grid"].update(batch_size=[4], dtype=["bf16"], strategy=[strategy])
    spec["card"] = "h100-80gb"
    return trial_configs(parse_spec(spec))[0]


def by_depth(config: TrialConfig) -> tuple[Prediction | None, str]:
    """The carried prediction, or None and why it was not carried."""
    make = predictor_maker(CPU, True, config.strategy.build())
    deep, why = deep_predictor(config, CPU, True, make, min_depth=SHALLOW + 2)
    if deep is None:
        return None, why
    with deep:
        prediction = deep.predict(config.batch_size)
    return (None, deep.why) if deep.whole is not None else (prediction, "")


def whole(config: TrialConfig) -> Prediction:
    with Predictor(config, CPU, as_cuda=True) as predictor:
        return predictor.predict(config.batch_size)


def assert_equal_to_the_byte(config: TrialConfig) -> None:
    deep, why = by_depth(config)
    assert deep is not None, why
    assert deep.ok and "blocks, the rest repeated" in deep.note, deep.note
    carried, traced = deep.to_dict(), whole(config).to_dict()
    assert carried.pop("note") != traced.pop("note")
    assert carried == traced


@pytest.mark.slow
@pytest.mark.parametrize(
    "strategy",
    [
        "none",
        "checkpoint",
        "lora:8",
        ["lora:8", "checkpoint"],
        "accumulate:2",
        "sac",
        "chunked_ce",
        "adafactor",
        "bf16_params",
    ],
)
def test_gpt(strategy):
    assert_equal_to_the_byte(config_of("gpt", GPT, strategy))


@pytest.mark.slow
@pytest.mark.parametrize("strategy", [["lora:8", "checkpoint"], "qlora:8"])
def test_hf_llama_with_grouped_query_attention(strategy):
    assert_equal_to_the_byte(config_of("hf", LLAMA, strategy))


@pytest.mark.slow
def test_hf_qwen2():
    assert_equal_to_the_byte(config_of("hf", QWEN2, "none"))


@pytest.mark.slow
@pytest.mark.parametrize(
    ("family", "size", "strategy"), [("gpt", GPT, "fsdp:2"), ("hf", LLAMA, "tp:2")]
)
def test_model_parallel_rank_zero(family, size, strategy):
    """Rank 0 of two, predicted with a fake process group (FSDP's blocks refer two blocks
    away: traced at 7 and 8 blocks)."""
    assert_equal_to_the_byte(config_of(family, size, strategy))


@pytest.mark.slow
def test_timm_vit():
    pytest.importorskip("timm")
    assert_equal_to_the_byte(config_of("timm", VIT, "none", IMAGES))


@pytest.mark.slow
def test_estimate_takes_the_shortcut_only_where_it_applies():
    """``estimate_peak`` takes it for a deep CUDA target (12 blocks and more), and not for a
    CPU target or a shallow model; its answer is the full trace's."""
    deep = config_of("gpt", {**GPT, "n_layer": 12}, "none")
    carried = estimate_peak(deep, CPU, as_cuda=True)
    assert "traced 5 and 6 of 12 blocks" in carried.note
    assert carried.peak_bytes == whole(deep).peak_bytes
    assert "blocks" not in estimate_peak(config_of("gpt", GPT, "none"), CPU, as_cuda=True).note


def test_blocks_that_differ_are_traced_whole_and_the_note_says_so():
    """A model whose blocks differ (sliding-window attention in some layers only) is not
    carried: its depth says why, and the estimate's note repeats it."""
    mixed = {
        **QWEN2,
        "use_sliding_window": True,
        "sliding_window": 16,
        "max_window_layers": 4,
        "num_hidden_layers": 12,
    }
    config = config_of("hf", mixed, "none")
    found = depth_of(config)
    assert isinstance(found, str) and "layer_types" in found
    prediction = estimate_peak(config, CPU, as_cuda=True)
    assert prediction.ok and "traced whole" in prediction.note and "layer_types" in prediction.note


def test_a_pipeline_is_traced_whole_and_the_note_says_so():
    """``pp:2``'s stages hold different blocks (the first the embeddings, the last the head):
    not carried from shallow traces; the estimate traces every stage whole and says so."""
    config = config_of("gpt", {**GPT, "n_layer": 12}, "pp:2")
    carried, why = by_depth(config)
    assert carried is None and why == "traced whole: pipeline stages"
    prediction = estimate_peak(config, CPU, as_cuda=True)
    assert prediction.ok and "traced whole: pipeline stages" in prediction.note


@pytest.mark.slow
def test_plan_carries_every_card_and_batch():
    """``harness plan``'s tool takes the same path: two shallow models per batch size, the
    carried trace replayed for every card that runs the same step; each row's figures equal
    the whole model's trace on that card at that batch."""
    from harness.cuda.cards import CATALOGUE
    from harness.trial.card_plan import plan_group

    config = config_of("gpt", {**GPT, "n_layer": 12}, "none")
    cards, batches = ("rtx-4090", "h100-80gb"), [2, 6]
    request = {
        "cards": {name: CATALOGUE[name].to_dict() for name in cards},
        "budgets": {name: CATALOGUE[name].memory_bytes for name in cards},
        "groups": [{"batches": {name: batches for name in cards}}],
    }
    rows = plan_group(config, 0, request, CPU, True)["rows"]
    assert len(rows) == 4
    for row in rows:
        assert "traced 5 and 6 of 12 blocks" in row["note"], row["note"]
        entry = CATALOGUE[row["card"]]
        point = replace(
            config,
            card=entry.to_dict(),
            batch_size=row["batch_size"],
            device_memory_bytes=entry.memory_bytes,
        )
        expected = whole(point).to_dict()
        for figure in ("predicted_peak_bytes", "predicted_reserved_bytes",
                       "predicted_device_bytes", "predicted_step_time_ms"):  # fmt: skip
            assert row[figure] == expected[figure], (row["card"], row["batch_size"], figure)


@pytest.mark.slow
def test_fit_answers_as_the_whole_trace_does(monkeypatch):
    """``harness fit``'s search on the carried model (its moments from the full-depth log)
    gives the answer the whole model's search gives, and at it the figures a fresh estimate at
    that batch gives. (The whole model's search warms up once, at its first batch, and its
    reserved figure at a far larger batch can differ from a fresh process's by a segment: 2 MiB
    at batch 116 of this model under 1 GiB; the carried one warms up at each batch, as a fresh process does.)"""
    from harness.trial.depth import TRACE_WHOLE
    from harness.trial.fit import fit_config

    config = config_of("gpt", {**GPT, "n_layer": 12, "seq_len": 128}, "none")
    budgets = [int(0.5 * 2**30)]
    keep = ("predicted_peak_bytes", "predicted_reserved_bytes", "predicted_device_bytes")
    carried = fit_config(config, "batch_size", budgets, 64, CPU, as_cuda=True)
    monkeypatch.setenv(TRACE_WHOLE, "1")
    traced = fit_config(config, "batch_size", budgets, 64, CPU, as_cuda=True)
    assert [row["value"] for row in carried] == [row["value"] for row in traced]
    for row, budget in zip(carried, budgets, strict=True):
        assert row["value"] > 0
        point = replace(config, batch_size=row["value"], device_memory_bytes=budget)
        fresh = whole(point).to_dict()
        assert {key: row[key] for key in keep} == {key: fresh[key] for key in keep}
