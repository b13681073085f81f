"""Fine-tuning techniques on a small Hugging Face Llama: lora, qlora, sac, fsdp's policies.

Each technique is compared with ``none`` of the same trial, on the real libraries (peft,
torchao's NF4, PyTorch's selective-checkpoint policy API), and every prediction made before
training must equal what the memory window measured.
"""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest

from harness.spec import SpecError, parse_spec, trial_configs
from harness.sweep.launch import launch_trial
from harness.trial.estimate import closed_form
from harness.trial.prediction import Prediction
from harness.trial.run import run_trial
from tests.conftest import BASE_SPEC, SHORT_TEXT, expect_exit, run_cli, write_spec

pytest.importorskip("transformers")
pytest.importorskip("peft")

# Wide enough that rank-8 adapters are a few percent of the model (as on real models, where
# they are far less), small enough for seconds per trial. GQA: 8 query heads, 2 key/value heads.
LLAMA = {
    "preset": "llama-3.2-1b",
    "num_hidden_layers": 2,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "vocab_size": 512,
    "seq_len": 32,
}


# Narrow and long: activations, not model state, make the peak (where recomputation shows).
LONG_LLAMA = {
    **LLAMA,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_attention_heads": 4,
    "head_dim": 32,
    "seq_len": 128,
}


def llama_spec(strategies, dtype="bf16", size=LLAMA, batch_size=4, **train):
    data = copy.deepcopy(BASE_SPEC)
    data["model"] = {"family": "hf", "sizes": {"llama": dict(size)}}
    data["data"] = dict(SHORT_TEXT)
    data["grid"].update(batch_size=[batch_size], dtype=[dtype], strategy=list(strategies))
    data["train"]["budget"] = {"steps": 3}
    data["train"].update(train)
    data["measure"] = {"warmup_steps": 2, "memory_steps": 1, "timed_steps": 2, "timeline": False}
    return data


def run_each(data):
    results = {}
    for config in trial_configs(parse_spec(data)):
        result = run_trial(config)
        assert result.status == "ok", f"{config.strategy_text}: {result.failure_reason}"
        assert result.metrics["prediction_ratio"] == pytest.approx(1.0, abs=0.01), (
            f"{config.strategy_text}: every ok CPU trial is predicted within 1 %"
        )
        results[config.strategy_text] = result
    return results


@pytest.fixture(scope="module")
def measured():
    """One trial per adapter technique and its baseline, bf16 autocast, all else equal."""
    return run_each(llama_spec(["none", "lora:8", "qlora:8"]))


@pytest.fixture(scope="module")
def recomputed():
    """Full vs selective vs no recomputation where activations make the peak."""
    return run_each(llama_spec(["none", "checkpoint", "sac"], size=LONG_LLAMA, batch_size=16))


def test_lora_trains_only_adapters(measured):
    none, lora = measured["none"].metrics, measured["lora:8"].metrics
    state = lora["mem_grad_bytes"] + lora["mem_optim_bytes"]
    assert 0 < state <= 0.05 * (none["mem_grad_bytes"] + none["mem_optim_bytes"])
    # num_params counts what trains; the frozen base is still there, and still counted.
    assert lora["num_params"] < 0.05 * none["num_params"]
    assert lora["num_params_total"] == none["num_params"] + lora["num_params"]
    assert none["num_params_total"] == none["num_params"]
    # The frozen base is stored in bf16 (the dtype axis), the parameters of none in fp32.
    assert lora["block_linear_bytes_per_param"] == 2.0
    assert lora["mem_param_bytes"] < 0.6 * none["mem_param_bytes"]


def test_qlora_stores_the_blocks_linear_weights_in_nf4(measured):
    lora, qlora = measured["lora:8"].metrics, measured["qlora:8"].metrics
    assert qlora["block_linear_weight_bytes"] <= 0.3 * lora["block_linear_weight_bytes"]
    # 4-bit codes + an 8-bit scale per 64 values + an fp32 scale per 256 scales.
    assert qlora["block_linear_bytes_per_param"] == pytest.approx(0.516, abs=0.002)
    assert qlora["mem_param_bytes"] < lora["mem_param_bytes"]
    assert measured["qlora:8"].info["qlora_nf4_linears"] == 2 * 7  # q k v o gate up down


def test_sac_keeps_activations_between_none_and_checkpoint(recomputed):
    activation = {s: r.metrics["mem_activation_bytes"] for s, r in recomputed.items()}
    assert activation["checkpoint"] < activation["sac"] < activation["none"]
    assert recomputed["sac"].info["checkpoint_segments"] == 2


def test_lora_options_choose_targets_rank_and_base_dtype():
    data = llama_spec(["lora:4"], dtype="fp32", lora={"targets": ["q_proj", "v_proj"]})
    data["train"]["lora"]["base_dtype"] = "bf16"
    result = run_trial(trial_configs(parse_spec(data))[0])
    assert result.status == "ok", result.failure_reason
    assert result.info["lora_targets"] == 4  # 2 blocks x (q_proj, v_proj)
    assert result.info["lora_base_dtype"] == "bfloat16"
    q, v = 4 * (256 + 256), 4 * (256 + 128)  # rank x (in + out) per adapted Linear
    assert result.metrics["num_params"] == 2 * (q + v)
    assert result.metrics["prediction_ratio"] == pytest.approx(1.0, abs=0.01)


def test_lora_targets_that_match_nothing_end_the_trial_before_training():
    data = llama_spec(["lora:4"], lora={"targets": ["no_such_proj"]})
    result = run_trial(trial_configs(parse_spec(data))[0])
    assert result.status == "crash"
    assert "no Linear module matches train.lora.targets ['no_such_proj']" in result.failure_reason
    assert "peak_allocated_bytes" not in result.metrics


def test_train_lora_keys_only_the_trials_that_use_adapters():
    plain = trial_configs(parse_spec(llama_spec(["none", "lora:8"])))
    tuned = trial_configs(parse_spec(llama_spec(["none", "lora:8"], lora={"alpha": 64})))
    assert plain[0].lora is None and plain[0].trial_key == tuned[0].trial_key
    assert plain[1].trial_key != tuned[1].trial_key


@pytest.mark.parametrize(
    ("lora", "words"),
    [
        ({"dropout": 1.5}, "train.lora.dropout: "),
        ({"targets": []}, "train.lora.targets: "),
        ({"rank": 8}, "train.lora.rank: "),
        ({"base_dtype": "int4"}, "train.lora.base_dtype: "),
    ],
)
def test_bad_lora_options_are_one_line(lora, words):
    with pytest.raises(SpecError) as caught:
        parse_spec(llama_spec(["lora:8"], lora=lora), "ft.yaml")
    assert "\n" not in str(caught.value) and f"ft.yaml: {words}" in str(caught.value)


def test_closed_forms_of_lora_and_qlora():
    """16 B per trainable parameter with Adam; the frozen base at 2 B (bf16) or NF4's 0.516."""
    lora, qlora = trial_configs(parse_spec(llama_spec(["lora:8", "qlora:8"])))
    counts = Prediction(num_params=1e6, num_params_total=101e6, num_params_nf4=0.0)
    assert closed_form(lora, counts)["closed_form_model_state_bytes"] == 16e6 + 200e6
    counts = replace(counts, num_params_nf4=80e6)
    expected = 16e6 + 80e6 * (0.5 + 1 / 64 + 4 / (64 * 256)) + 20e6 * 2
    assert closed_form(qlora, counts)["closed_form_model_state_bytes"] == pytest.approx(expected)


def test_estimate_table_names_each_part_and_why_a_row_is_missing(tmp_path):
    data = llama_spec(["none", "lora:8", "adam8bit"])
    data["device_memory"] = "1GiB"
    done = run_cli("estimate", str(write_spec(tmp_path, data)), cwd=tmp_path)
    expect_exit(done)
    out = done.stdout
    for heading in ("peak", "params", "grads", "optim", "activ.", "closed", "fits", "1 GiB"):
        assert heading in out, heading
    assert "adam8bit [1]" in out
    assert "not predicted [1] adam8bit: adam8bit: its step is compiled code" in out
    # What is the same on every row, once, in the title (which folds at the table's width).
    assert "every row: size llama, batch 4, dtype bf16" in " ".join(out.split())


@pytest.mark.slow
def test_fsdp_mixed_gathers_bf16_parameters(tmp_path):
    """MixedPrecisionPolicy on 2 gloo ranks: bf16 all-gathers from fp32 shards.

    On gloo the real peak moves from run to run (a reduce-scatter buffer lives until gloo's
    thread lets it go: plain fsdp:2 of this trial measured 1.000 and 0.878 of the prediction in
    two runs, fsdp_mixed 0.86-0.92), so the measured side is held to a lower bound: the
    prediction never exceeds it and stays within 20 %. What the policy changes is compared on
    the predictions, which are deterministic."""
    results = {}
    for strategy in ("fsdp:2", "fsdp:2+fsdp_mixed"):
        data = llama_spec([strategy.split("+")], dtype="fp32")
        config = trial_configs(parse_spec(data))[0]
        result = launch_trial(config, tmp_path / strategy.replace(":", "_"), timeout_s=300)
        assert result.status == "ok", result.failure_reason
        assert 0.8 <= result.metrics["prediction_ratio"] <= 1.01, strategy
        results[strategy] = result.metrics
    plain, mixed = results["fsdp:2"], results["fsdp:2+fsdp_mixed"]
    assert mixed["predicted_peak_bytes"] < plain["predicted_peak_bytes"]
