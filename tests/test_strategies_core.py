"""Core strategies against the `none` baseline of the same trial, on CPU (tensor accounting)."""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest

from harness.spec import SpecError, parse_spec, trial_configs
from harness.strategies.combination import Combination
from harness.sweep.launch import launch_trial
from harness.trial.run import run_trial
from tests.conftest import BASE_SPEC, SHORT_TEXT, expect_exit

GPT8 = {"n_layer": 8, "d_model": 32, "n_head": 2, "seq_len": 32}


def spec_for(strategy, *, family="mlp", knobs=None, batch_size=8, dtype="fp32", dataset=None):
    data = copy.deepcopy(BASE_SPEC)
    if family == "gpt":
        knobs = knobs or GPT8
        dataset = dataset or "text"
    data["model"] = {"family": family, "sizes": {"m": knobs or {"width": 256, "depth": 2}}}
    data["data"] = dict(SHORT_TEXT) if dataset == "text" else {"dataset": dataset or "digits"}
    data["grid"].update(batch_size=[batch_size], dtype=[dtype], strategy=[strategy])
    data["train"]["budget"] = {"steps": 6}
    return data


def measure(strategy, **kw):
    result = run_trial(trial_configs(parse_spec(spec_for(strategy, **kw)))[0])
    assert result.status == "ok", result.failure_reason
    return result.metrics


def model_state(m):
    return m["mem_param_bytes"] + m["mem_grad_bytes"] + m["mem_optim_bytes"]


def test_checkpoint_halves_activation_memory_of_an_8_block_gpt():
    none = measure("none", family="gpt", batch_size=16)
    every_block = measure("checkpoint", family="gpt", batch_size=16)
    segments = measure("checkpoint:4", family="gpt", batch_size=16)
    assert every_block["mem_activation_bytes"] <= 0.5 * none["mem_activation_bytes"]
    assert segments["mem_activation_bytes"] < none["mem_activation_bytes"]
    assert every_block["peak_allocated_bytes"] < none["peak_allocated_bytes"]
    assert every_block["num_params"] == none["num_params"]


def test_accumulate_4_cuts_activation_memory_at_the_same_effective_batch():
    none = measure("none", family="gpt", batch_size=16)
    accumulated = measure("accumulate:4", family="gpt", batch_size=16)
    assert accumulated["mem_activation_bytes"] <= 0.4 * none["mem_activation_bytes"]
    # Same effective batch: the same samples per optimizer step, so throughput stays comparable.
    assert accumulated["train_steps"] == none["train_steps"]


def test_bf16_params_halve_parameter_and_gradient_bytes():
    # Batch 8: the peak falls in the optimizer step, when every gradient exists.
    none = measure("none")
    low = measure("bf16_params")
    assert low["mem_param_bytes"] == none["mem_param_bytes"] / 2
    assert low["mem_param_bytes"] + low["mem_grad_bytes"] == pytest.approx(
        (none["mem_param_bytes"] + none["mem_grad_bytes"]) / 2, rel=1e-3
    )
    # Adam's moments follow the parameters' dtype; only the fp32 step counters stay.
    assert low["mem_optim_bytes"] == pytest.approx(none["mem_optim_bytes"] / 2, rel=1e-3)


def test_gpt_reports_tokens_and_next_token_accuracy():
    result = run_trial(trial_configs(parse_spec(spec_for("none", family="gpt")))[0])
    assert result.info["throughput_unit"] == "tokens/s"
    assert 0 <= result.metrics["accuracy"] <= 1


@pytest.mark.slow
@pytest.mark.parametrize("parallel", ["ddp:2", "fsdp:2"])
def test_data_parallel_model_state_per_rank(tmp_path: Path, parallel):
    """ddp keeps a full replica on each rank; fsdp shards it (2 ranks under torchrun)."""
    results = {}
    for strategy in ("none", parallel):
        config = trial_configs(parse_spec(spec_for(strategy, batch_size=16)))[0]
        result = launch_trial(config, tmp_path / strategy.replace(":", "_"), timeout_s=300)
        assert result.status == "ok", result.failure_reason
        results[strategy] = result.metrics
    baseline, ranked = results["none"], results[parallel]
    assert ranked["num_params"] == baseline["num_params"]
    if parallel.startswith("ddp"):
        assert ranked["mem_param_bytes"] == baseline["mem_param_bytes"]
        assert ranked["mem_optim_bytes"] == baseline["mem_optim_bytes"]
    else:
        assert model_state(ranked) <= 0.6 * model_state(baseline)
        assert ranked["mem_optim_bytes"] == pytest.approx(baseline["mem_optim_bytes"] / 2, rel=0.01)


INVALID = [
    (["sgd", "adamw"], "fp32", "'sgd' and 'adamw' cannot be combined"),
    (["ddp:2", "fsdp:2"], "fp32", "'ddp' and 'fsdp' cannot be combined"),
    (
        ["bf16_params", "quantize_int8"],
        "fp32",
        "'bf16_params' and 'quantize_int8' cannot be combined",
    ),
    ("bf16_params", "fp16", "strategy 'bf16_params' cannot be combined with dtype 'fp16'"),
    ("offload_activations", "fp32", "'offload_activations' needs device cuda"),
    ("expandable_segments", "fp32", "'expandable_segments' needs device cuda"),
    ("channels_last", "fp32", "only applies to model families cnn, resnet"),
    ("accumulate:3", "fp32", "batch_size 8 is not a multiple of 3"),
    ("amp_bf16", "fp32", "use grid.dtype: [bf16]"),
    ("prune:1.5", "fp32", "between 0 and 1"),
    ("accumulate:x", "fp32", "must be an integer"),
    (["none", "checkpoint"], "fp32", "'none' cannot be combined"),
    ("fsdp_mixed", "fp32", "'fsdp_mixed' modifies 'fsdp': combine them, e.g. [fsdp:2, fsdp_mixed]"),
    (["fsdp:2", "fsdp_offload"], "fp32", "'fsdp_offload' needs device cuda"),
    (
        ["lora:8", "qlora:8"],
        "bf16",
        "'lora' and 'qlora' cannot be combined: both choose the adapters",
    ),
    (["sac", "checkpoint"], "fp32", "'sac' and 'checkpoint' cannot be combined"),
    (["qlora:8", "fsdp:2"], "bf16", "'qlora' and 'fsdp' cannot be combined"),
    ("lora", "fp32", "strategy 'lora' needs an argument: lora:<rank>"),
]


@pytest.mark.parametrize(("strategy", "dtype", "words"), INVALID)
def test_invalid_combinations_fail_validation_naming_both(strategy, dtype, words):
    data = spec_for(strategy, dtype=dtype)
    data["device"] = "cpu"
    with pytest.raises(SpecError) as caught:
        parse_spec(data, "exp.yaml")
    message = str(caught.value)
    assert "\n" not in message and message.startswith("exp.yaml: grid.strategy[0]: "), message
    assert words in message, message


def test_family_and_dataset_must_fit():
    data = spec_for("none", family="gpt", dataset="digits")
    with pytest.raises(SpecError, match=r"data\.dataset: model family gpt trains on text"):
        parse_spec(data, "exp.yaml")


def test_harness_validate_names_both_strategies(tmp_path):
    from tests.conftest import run_cli, write_spec

    path = write_spec(tmp_path, spec_for(["adafactor", "sgd_momentum"]), "bad.yaml")
    done = run_cli("validate", str(path), cwd=tmp_path)
    expect_exit(done, 2)
    assert done.stderr.strip() == (
        f"{path}: grid.strategy[0]: 'adafactor' and 'sgd_momentum' cannot be combined: "
        "both choose the optimizer"
    )


def test_a_combination_keeps_the_text_as_written_and_asks_the_registry():
    written = ["checkpoint:", "accumulate: 4", "ddp:2"]
    combination = Combination.parse(written)
    assert combination.texts == written and combination.text == "checkpoint:+accumulate: 4+ddp:2"
    assert Combination.parse(combination.text) == combination  # the one-string form parses back
    assert [term.given for term in combination] == [None, " 4", "2"]  # what each strategy gets
    assert (combination.world_size, combination.batch_step) == (2, 8)
    assert combination.needs_process_group and not combination.has_group("adapters")
    assert Combination.parse(["none"]).world_size == 1
    assert Combination.parse("fsdp:1").needs_process_group  # one rank still runs under torchrun


@pytest.mark.parametrize(
    ("written", "message"),
    [
        ([], "an empty strategy combination"),
        ("chekpoint", "unknown strategy 'chekpoint'"),
        ("amp", "mixed precision is the dtype axis"),
        ("accumulate", "needs an argument: accumulate:<micro-batches per step>"),
        ("accumulate:x", "micro-batches per step must be an integer (got 'x')"),
        ("prune:1.5", "must be between 0 and 1 (exclusive) (got 1.5)"),
        ("keep_grads:2", "takes no argument"),
        ("none+checkpoint", "'none' cannot be combined"),
        ("sgd+adamw", "both choose the optimizer"),
        ("fsdp_mixed", "'fsdp_mixed' modifies 'fsdp'"),
    ],
)
def test_a_bad_combination_says_why(written, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        Combination.parse(written)
