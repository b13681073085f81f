"""The LLM levers: ``chunked_ce`` (a loss that never holds the whole logits) and
``checkpoint:auto`` / ``sac:auto`` (recomputation chosen for the memory budget).

Every figure is a real measurement on CPU (tensor accounting) beside the prediction the trial
made before it trained; the loss and gradients are compared with the plain step's.
"""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch

from harness.spec import SpecError, parse_spec, trial_configs
from harness.strategies.base import StrategyError, TrialContext
from harness.strategies.chunked_loss import ChunkedCrossEntropy, default_chunks
from harness.strategies.combination import Combination
from harness.trial.estimate import estimate_peak
from harness.trial.fit import fit_config
from harness.trial.run import run_trial
from harness.units import format_bytes
from harness.workloads.gpt import GPT
from harness.workloads.task import Logits
from tests.conftest import BASE_SPEC

# Loss and gradients of the chunked step against the plain one: float32 sums in another order.
RTOL, ATOL = 1e-5, 1e-6


def lm_spec(strategy, *, vocab, d_model=32, n_layer=2, seq_len=64, batch_size=8, family="gpt"):
    data = copy.deepcopy(BASE_SPEC)
    knobs = {"n_layer": n_layer, "d_model": d_model, "n_head": 2, "seq_len": seq_len}
    data["model"] = {"family": family, "sizes": {"m": knobs}}
    data["data"] = {"dataset": "tokens", "vocab_size": vocab, "seq_len": seq_len, "num_samples": 64}
    data["grid"].update(batch_size=[batch_size], dtype=["fp32"], strategy=[strategy])
    data["train"]["budget"] = {"steps": 3}
    return data


def trial(config):
    result = run_trial(config)
    assert result.status == "ok", result.failure_reason
    return result


def context(task):
    return TrialContext(torch.device("cpu"), "fp32", "gpt", None, 4, task)


def grads(model):
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("chunks", [None, "3", "7"])
def test_chunked_ce_gives_the_plain_steps_loss_and_gradients(chunks):
    torch.manual_seed(0)
    plain = GPT(vocab=1000, n_layer=2, d_model=32, n_head=2, seq_len=16, tied=True)
    chunked = copy.deepcopy(plain)
    batch = {"x": torch.randint(0, 1000, (5, 16)), "y": torch.randint(0, 1000, (5, 16))}
    batch["y"][0, :4] = -100  # ignored labels count in neither loss
    loss, _ = Logits().forward(plain, batch)
    loss.backward()
    strategy = ChunkedCrossEntropy(chunks)
    ctx = context(Logits())
    model = strategy.prepare_model(chunked, ctx)
    task = strategy.prepare_task(Logits(), model, ctx)
    chunked_loss, kept = task.forward(model, batch)
    chunked_loss.backward()
    assert kept is None
    assert ctx.notes["loss_chunks"] == (int(chunks) if chunks else default_chunks(1000))
    torch.testing.assert_close(chunked_loss, loss, rtol=RTOL, atol=ATOL)
    expected, got = grads(plain), grads(chunked)
    assert expected.keys() == got.keys()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=RTOL, atol=ATOL, msg=name)
    # Evaluation runs the plain head: the same logits.
    torch.testing.assert_close(task.outputs(model, batch), Logits().outputs(plain, batch))


def test_chunked_ce_gives_a_hugging_face_causal_lms_own_loss_and_gradients():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=600,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        use_cache=False,
    )
    torch.manual_seed(0)
    plain = transformers.LlamaForCausalLM(config)
    chunked = copy.deepcopy(plain)
    from harness.workloads.hf import HuggingFace

    task = HuggingFace("causal-lm")
    batch = {"x": torch.randint(0, 600, (3, 20))}
    loss, _ = task.forward(plain, batch)
    loss.backward()
    strategy = ChunkedCrossEntropy("4")
    ctx = context(task)
    model = strategy.prepare_model(chunked, ctx)
    chunked_task = strategy.prepare_task(task, model, ctx)
    chunked_loss, _ = chunked_task.forward(model, batch)
    chunked_loss.backward()
    torch.testing.assert_close(chunked_loss, loss, rtol=RTOL, atol=ATOL)
    expected, got = grads(plain), grads(chunked)
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-4, atol=1e-6, msg=name)
    assert chunked_task.score(model, batch) == task.score(plain, batch)


def beyond_model_state(prediction, metrics):
    """(activations + other) at the peak: what is not parameters, gradients, optimizer state;
    predicted and measured."""
    predicted = prediction.breakdown["activation"] + prediction.breakdown["other"]
    return predicted, metrics["mem_activation_bytes"] + metrics["mem_other_bytes"]


@pytest.mark.slow
def test_chunked_ce_cuts_the_losss_share_of_a_large_vocabulary_peak_by_three_quarters():
    """131k vocabulary (Llama 3's size class): the default 8 chunks. The loss's share is what
    the vocabulary adds at the peak beyond model state (the logits, their fp32 copy, their
    gradient): the same model at a 256-token vocabulary is the reference."""
    shares = {}
    for strategy in ("none", "chunked_ce"):
        figures = []
        for vocab in (131072, 256):
            config = trial_configs(parse_spec(lm_spec(strategy, vocab=vocab)))[0]
            prediction = estimate_peak(config, torch.device("cpu"))
            metrics = trial(config).metrics
            assert prediction.peak_bytes == pytest.approx(metrics["peak_allocated_bytes"], rel=0.01)
            figures.append(beyond_model_state(prediction, metrics))
        (large_predicted, large_measured), (small_predicted, small_measured) = figures
        shares[strategy] = (large_predicted - small_predicted, large_measured - small_measured)
    for which in (0, 1):  # predicted, measured
        plain, chunked = shares["none"][which], shares["chunked_ce"][which]
        print(
            f"loss share {which=}: none {plain / 2**20:.1f} MiB, chunked_ce {chunked / 2**20:.1f} MiB"
        )
        assert 0 < chunked <= 0.25 * plain, (which, plain, chunked)


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"family": "mlp"}, "only applies to model families gpt, hf, module:attr"),
        ({"strategy": "fused_ce", "device": "cpu"}, "fused_ce' needs device cuda"),
        ({"strategy": ["chunked_ce", "compile"]}, "cannot be combined"),
        ({"strategy": "chunked_ce:0"}, "chunks must be positive"),
    ],
)
def test_chunked_loss_refusals_are_one_line_at_validation(change, words):
    data = lm_spec(change.get("strategy", "chunked_ce"), vocab=512)
    if "family" in change:
        data["model"] = {"family": "mlp", "sizes": {"m": {"width": 8, "depth": 1}}}
        data["data"] = {"dataset": "digits"}
    data["device"] = change.get("device", "cpu")
    with pytest.raises(SpecError, match=words):
        trial_configs(parse_spec(data))


def test_fused_ce_refuses_a_cpu_model_in_one_line_and_is_not_predicted():
    """A spec refuses it on a CPU host (above); a trial that reaches a CPU anyway (a CUDA spec
    run elsewhere) ends before training with the strategy's own line."""
    from harness.strategies.chunked_loss import FusedCrossEntropy

    model = GPT(vocab=64, n_layer=1, d_model=16, n_head=2, seq_len=8, tied=True)
    with pytest.raises(StrategyError, match=r"runs on CUDA only.*use chunked_ce"):
        FusedCrossEntropy().prepare_model(model, context(Logits()))
    config = trial_configs(parse_spec(lm_spec("chunked_ce", vocab=512)))[0]
    fused = replace(config, strategy=Combination.parse(["fused_ce"]))
    prediction = estimate_peak(fused, torch.device("cpu"))
    assert prediction.outcome == "unpredictable" and "Triton" in prediction.reason


def gpt_spec(strategy, budget=None, *, n_layer=8, d_model=32, batch_size=16):
    data = copy.deepcopy(BASE_SPEC)
    knobs = {"n_layer": n_layer, "d_model": d_model, "n_head": 2, "seq_len": 64}
    data["model"] = {"family": "gpt", "sizes": {"m": knobs}}
    data["data"] = {"dataset": "text", "test_fraction": 0.01, "seq_len": 64}
    data["grid"].update(batch_size=[batch_size], dtype=["fp32"], strategy=[strategy])
    data["train"]["budget"] = {"steps": 4}
    if budget is not None:
        data["device_memory"] = int(budget)
    return data


_PEAKS: dict[str, float] = {}


def measured_peak(data):
    """The trial's measured peak, measured once per configuration in this process (the
    budgets between two peaks reuse them: the same trial measures the same bytes)."""
    config = trial_configs(parse_spec(data))[0]
    if config.trial_key not in _PEAKS:
        _PEAKS[config.trial_key] = trial(config).metrics["peak_allocated_bytes"]
    return _PEAKS[config.trial_key]


def check_auto(data, budget, blocks):
    """The trial fits ``budget`` as measured, recomputes fewer than all ``blocks`` in full,
    and its prediction (the chosen plan's) is within 1 % of its measurement."""
    result = trial(trial_configs(parse_spec(data))[0])
    metrics, info = result.metrics, result.info
    assert metrics["peak_allocated_bytes"] <= budget, info["recomputation"]
    assert metrics["predicted_peak_bytes"] == pytest.approx(
        metrics["peak_allocated_bytes"], rel=0.01
    )
    assert info["checkpoint_full_blocks"] < blocks, info["recomputation"]
    assert f"for {format_bytes(budget)}" in info["recomputation"]
    return info


@pytest.mark.parametrize(
    ("strategy", "lower", "share"), [("checkpoint:auto", "none", 0.5), ("sac:auto", "sac", 0.5)]
)
def test_auto_trains_within_a_budget_between_its_bounds_with_fewer_blocks(strategy, lower, share):
    """checkpoint:auto between none's and checkpoint's measured peaks; sac:auto between
    sac's and checkpoint's: the fewest blocks recomputed in full that fit."""
    high = measured_peak(gpt_spec(lower))
    low = measured_peak(gpt_spec("checkpoint"))
    budget = low + share * (high - low)
    info = check_auto(gpt_spec(strategy, budget), budget, blocks=8)
    assert info["checkpoint_full_blocks"] > 0
    rest = "keep" if strategy.startswith("checkpoint") else "sac"
    assert f"{rest}: " in info["checkpoint_policy"]
    # Fewest: one block fewer in full would not have fit (the choice's own predictions say).
    assert "the fewest that fit" in info["recomputation"]


def test_auto_with_room_to_spare_recomputes_nothing_and_over_any_plan_is_infeasible():
    roomy = trial(trial_configs(parse_spec(gpt_spec("checkpoint:auto", 2**30)))[0])
    assert roomy.info["checkpoint_full_blocks"] == 0
    assert roomy.info["checkpoint_segments"] == 0
    smallest = measured_peak(gpt_spec("checkpoint"))
    tight = run_trial(trial_configs(parse_spec(gpt_spec("checkpoint:auto", smallest * 0.9)))[0])
    assert tight.status == "infeasible"
    assert "the smallest reachable: every block recomputed" in tight.failure_reason
    assert tight.metrics["predicted_peak_bytes"] == pytest.approx(smallest, rel=0.01)


LLAMA4 = {
    "preset": "llama-3.2-1b",
    "num_hidden_layers": 4,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "vocab_size": 512,
    "seq_len": 128,
}


def llama_spec(strategy, budget=None):
    data = copy.deepcopy(BASE_SPEC)
    data["model"] = {"family": "hf", "sizes": {"llama": dict(LLAMA4)}}
    data["data"] = {"dataset": "text", "test_fraction": 0.01}
    data["grid"].update(batch_size=[4], dtype=["bf16"], strategy=[strategy])
    data["train"]["budget"] = {"steps": 3}
    data["measure"] = {"warmup_steps": 2, "memory_steps": 1, "timed_steps": 2, "timeline": False}
    if budget is not None:
        data["device_memory"] = int(budget)
    return data


@pytest.mark.slow
@pytest.mark.parametrize("share", [0.4, 0.7])
@pytest.mark.parametrize(
    ("adapters", "auto", "upper"),
    [
        (["lora:8"], "checkpoint:auto", "none"),
        (["qlora:8", "chunked_ce"], "checkpoint:auto", "none"),
        (["lora:8"], "sac:auto", "sac"),
    ],
    ids=["lora", "qlora+chunked_ce", "lora+sac"],
)
def test_auto_on_a_held_out_llama_with_adapters_fits_with_fewer_blocks(
    adapters, auto, upper, share
):
    """Between the adapters' peaks with ``upper`` (no recomputation, or sac's policy) and
    with transformers' own full checkpointing."""
    pytest.importorskip("peft")
    with_upper = adapters if upper == "none" else [*adapters, upper]
    high = measured_peak(llama_spec(with_upper))
    low = measured_peak(llama_spec([*adapters, "checkpoint"]))
    budget = low + share * (high - low)
    check_auto(llama_spec([*adapters, auto], budget), budget, blocks=4)


@pytest.mark.slow
def test_auto_on_held_out_gpt_shapes_checkpoints_fewer_blocks_than_checkpoint():
    for n_layer, d_model, share in ((6, 48, 0.3), (12, 16, 0.8)):
        shape = {"n_layer": n_layer, "d_model": d_model}
        high = measured_peak(gpt_spec("none", **shape))
        low = measured_peak(gpt_spec("checkpoint", **shape))
        budget = low + share * (high - low)
        check_auto(gpt_spec("checkpoint:auto", budget, **shape), budget, blocks=n_layer)


@pytest.mark.parametrize(
    ("entry", "device_memory", "words"),
    [
        ("checkpoint:auto", None, "chooses how much to recompute for device_memory"),
        ("sac:2", "1GiB", "the argument may only be auto"),
        ("checkpoint:bogus", "1GiB", "must be an integer"),
    ],
)
def test_auto_refusals_are_one_line_at_validation(entry, device_memory, words):
    data = gpt_spec(entry)
    if device_memory:
        data["device_memory"] = device_memory
    with pytest.raises(SpecError, match=words):
        trial_configs(parse_spec(data))


def test_fit_answers_the_largest_batch_then_the_least_recomputation_there():
    """``harness fit``'s order: the largest batch that fits with every block recomputed, then
    at that batch the fewest blocks in full; the answer's figures are that plan's, what a
    trial at that batch and budget predicts."""
    config = trial_configs(parse_spec(gpt_spec("checkpoint:auto", 2**30)))[0]
    budget = 13 * 2**20
    (row,) = fit_config(config, "batch_size", [budget], 64, torch.device("cpu"))
    value = row["value"]
    full = fit_config(
        replace(config, strategy=Combination.parse(["checkpoint"])),
        "batch_size",
        [budget],
        64,
        torch.device("cpu"),
    )[0]["value"]
    assert value == full  # the batch is full recomputation's
    trial_at = estimate_peak(
        replace(config, batch_size=value, device_memory_bytes=budget), torch.device("cpu")
    )
    assert row["predicted_peak_bytes"] == trial_at.peak_bytes <= budget
    assert row["recomputation"].split(";")[0] == trial_at.recomputation.split(";")[0]


def test_plan_chooses_each_cards_recomputation_as_an_estimate_for_that_card_does():
    """CUDA targets: the plan traces each recomputation plan once for every card that shares
    the step and chooses per card, under each card's budget (the device figure: reserved +
    context); every figure equals a fresh estimate's for that card and budget."""
    from harness.cuda.cards import CATALOGUE
    from harness.trial.card_plan import plan_group

    data = gpt_spec("checkpoint:auto", 2**30, n_layer=4, d_model=64, batch_size=8)
    data.update(device="cuda", card="a100-80gb")
    config = trial_configs(parse_spec(data))[0]
    cards = ("a100-80gb", "h100-80gb")
    cpu = torch.device("cpu")

    def device_bytes(strategy, card):
        point = replace(
            config,
            strategy=Combination.parse([strategy]),
            card=CATALOGUE[card].to_dict(),
            device_memory_bytes=CATALOGUE[card].memory_bytes,
        )
        prediction = estimate_peak(point, cpu, as_cuda=True)
        assert prediction.on_card is not None
        return prediction.on_card.device_bytes

    budgets = {
        card: int((device_bytes("none", card) + device_bytes("checkpoint", card)) / 2)
        for card in cards
    }
    request = {
        "cards": {name: CATALOGUE[name].to_dict() for name in cards},
        "budgets": budgets,
        "groups": [{"batches": {name: [8] for name in cards}}],
    }
    rows = plan_group(config, 0, request, cpu, True)["rows"]
    for row in rows:
        card = row["card"]
        point = replace(config, card=CATALOGUE[card].to_dict(), device_memory_bytes=budgets[card])
        fresh = estimate_peak(point, cpu, as_cuda=True)
        assert row["predicted_device_bytes"] == fresh.on_card.device_bytes <= budgets[card]
        assert row["predicted_peak_bytes"] == fresh.peak_bytes
        assert row["recomputation"].split(";")[0] == fresh.recomputation.split(";")[0]
        assert "of 4 blocks in full, the fewest that fit" in row["recomputation"]


def predicted(data, strategy):
    config = trial_configs(parse_spec(data))[0]
    config = replace(config, strategy=Combination.parse(strategy))
    return estimate_peak(config, torch.device("cpu")).peak_bytes


@pytest.mark.slow
@pytest.mark.parametrize(
    "others",
    [["accumulate:2"], ["bf16_params", "chunked_ce"], ["fsdp:2", "chunked_ce"]],
    ids=["accumulate", "bf16_params+chunked_ce", "fsdp+chunked_ce"],
)
def test_auto_composes_with_the_strategies_the_table_says(others, tmp_path):
    """Between the combination's peaks with and without full checkpointing: the trial fits,
    recomputes fewer blocks than all, and measures what it predicted (fsdp: each rank)."""
    from harness.sweep.launch import launch_trial

    data = gpt_spec(["checkpoint:auto", *others], 2**30)
    high, low = predicted(data, others), predicted(data, [*others, "checkpoint"])
    # Between two plans' peaks (they fall linearly here: half way is a plan's own peak).
    budget = int(low + 0.45 * (high - low))
    config = trial_configs(parse_spec(gpt_spec(["checkpoint:auto", *others], budget)))[0]
    if config.world_size > 1:
        result = launch_trial(config, tmp_path / "trial", timeout_s=300)
    else:
        result = run_trial(config)
    assert result.status == "ok", result.failure_reason
    metrics = result.metrics
    assert metrics["peak_allocated_bytes"] <= budget
    assert metrics["predicted_peak_bytes"] == pytest.approx(
        metrics["peak_allocated_bytes"], rel=0.01
    )
    assert 0 < int(result.info["checkpoint_full_blocks"]) < 8
