"""Tensor and pipeline parallelism (``tp:N``, ``pp:N``), alone and composed with FSDP/DDP.

Each layout runs for real on gloo ranks (torchrun) and is compared with ``none`` of the same
trial: what each rank holds (the blocks' state split over tensor ranks, the blocks cut into
stages), the loss (tensor parallelism computes the same numbers), and every rank's prediction,
made before training on the fake process group, against what that rank measured.
"""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
import torch

from harness.compat.internals import CP_OPTIONS
from harness.spec import SpecError, parse_spec, trial_configs
from harness.strategies.combination import Combination
from harness.strategies.layout import Layout
from harness.strategies.pipeline_parallel import balanced_cuts
from harness.sweep.launch import launch_trial
from harness.trial.estimate import estimate_peak
from tests.conftest import BASE_SPEC, SHORT_TEXT
from tests.test_llm_levers import LLAMA4

# Tied embedding and head (gpt's default): a pipeline keeps the two ends' copies one weight.
GPT = {"n_layer": 4, "d_model": 64, "n_head": 4, "seq_len": 32, "tied": 1}
# GQA: 4 query heads, 2 key/value heads, so tp:2 gives each rank one of each.
LLAMA = {**LLAMA4, "seq_len": 32}
# Not the shipped experiments' shapes: Qwen2's attention has q/k/v biases; 8 heads, 2 KV heads.
HELD_OUT = {
    "preset": "qwen2.5-0.5b",
    "num_hidden_layers": 4,
    "hidden_size": 96,
    "intermediate_size": 160,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "vocab_size": 384,
    "seq_len": 24,
}
WITHIN = 0.02  # every rank's prediction against its measurement


def spec(family: str, size: dict[str, Any], strategies: list[Any], batch_size: int = 8) -> dict:
    data = copy.deepcopy(BASE_SPEC)
    data["model"] = {"family": family, "sizes": {"s": dict(size)}}
    data["data"] = dict(SHORT_TEXT)
    data["grid"].update(batch_size=[batch_size], strategy=strategies)
    data["train"]["budget"] = {"steps": 6}
    data["measure"] = {"warmup_steps": 2, "memory_steps": 1, "timed_steps": 2, "timeline": False}
    return data


def run(tmp_path, family: str, size: dict[str, Any], strategies: list[Any]) -> dict[str, Any]:
    results = {}
    for config in trial_configs(parse_spec(spec(family, size, strategies))):
        name = config.strategy_text
        result = launch_trial(config, tmp_path / name.replace(":", "_"), timeout_s=400)
        assert result.status == "ok", f"{name}: {result.failure_reason}"
        results[name] = result
    return results


def ranks_of(result) -> list[dict[str, float]]:
    return json.loads(result.info["rank_memory"])


def assert_every_rank_predicted(result) -> None:
    for rank in ranks_of(result):
        ratio = rank["predicted_peak_bytes"] / rank["peak_allocated_bytes"]
        assert ratio == pytest.approx(1.0, abs=WITHIN), rank


def sharded_block_numel(model: torch.nn.Module) -> int:
    """Elements of the blocks' split projections (weights, and the biases of the column-wise
    ones; a row-wise bias stays whole on every rank)."""
    total = 0
    for name, module in model.named_modules():
        parts = name.split(".")
        in_block = any(part in parts for part in ("attn", "self_attn", "mlp"))
        if not isinstance(module, torch.nn.Linear) or not in_block:
            continue
        total += module.weight.numel()
        rowwise = name.endswith(("attn.proj", "mlp.proj", "o_proj", "down_proj"))
        if module.bias is not None and not rowwise:
            total += module.bias.numel()
    return total


def built(family: str, size: dict[str, Any]) -> torch.nn.Module:
    from harness.workloads import build_workload, describe_dataset

    config = trial_configs(parse_spec(spec(family, size, ["none"])))[0]
    info = describe_dataset(config.dataset, config.dataset_options, None, config.seed)
    return build_workload(config.model_family, config.knobs, info, None, config.model_loss).model


@pytest.fixture(scope="module")
def gpt_runs(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpt")
    strategies = ["none", "tp:2", "pp:2", "pp:2:gpipe", ["fsdp:2", "tp:2"]]
    return run(path, "gpt", GPT, strategies)


@pytest.fixture(scope="module")
def llama_runs(tmp_path_factory):
    return run(
        tmp_path_factory.mktemp("llama"),
        "hf",
        LLAMA,
        ["none", "tp:2", "pp:2"],
    )


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gpt", "hf"])
def test_tp_splits_the_blocks_state_and_keeps_the_loss(family, gpt_runs, llama_runs):
    runs, size = (gpt_runs, GPT) if family == "gpt" else (llama_runs, LLAMA)
    none, tp = runs["none"].metrics, runs["tp:2"].metrics
    halved = sharded_block_numel(built(family, size)) // 2 * 4  # fp32 bytes one rank sheds
    assert tp["mem_param_bytes"] == pytest.approx(none["mem_param_bytes"] - halved, rel=1e-3)
    # AdamW's two moments per parameter
    assert tp["mem_optim_bytes"] == pytest.approx(none["mem_optim_bytes"] - 2 * halved, rel=1e-3)
    assert tp["train_loss"] == pytest.approx(none["train_loss"], abs=1e-4)
    assert_every_rank_predicted(runs["tp:2"])
    assert [rank["tp"] for rank in ranks_of(runs["tp:2"])] == [0, 1]


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gpt", "hf"])
def test_tp_gradients_are_split_as_predicted(family, gpt_runs, llama_runs):
    """Parameters, gradients and optimizer state as built (the estimate's model state) fall by
    four copies of the shed half: the gradients split as the parameters do."""
    runs, size = (gpt_runs, GPT) if family == "gpt" else (llama_runs, LLAMA)
    configs = trial_configs(parse_spec(spec(family, size, ["none", "tp:2"])))
    none, tp = (estimate_peak(c, torch.device("cpu")) for c in configs)
    halved = sharded_block_numel(built(family, size)) // 2 * 4
    assert none.model_state_bytes is not None and tp.model_state_bytes is not None
    shed = none.model_state_bytes - tp.model_state_bytes
    assert shed == pytest.approx(4 * halved, rel=1e-3)
    assert tp.peak_bytes == runs["tp:2"].metrics["predicted_peak_bytes"]


def test_sequence_parallel_splits_the_norms_activations():
    """tp:2:sp on the Llama (the decoder layer's keyword-passed attention input included): the
    same weights, fewer activation bytes; measured equal to its prediction and its loss to
    none's by experiments/parallel_small.yaml's kind of run (docs/estimate.md)."""
    plain, sequence = (
        estimate_peak(c, torch.device("cpu"))
        for c in trial_configs(parse_spec(spec("hf", LLAMA, ["tp:2", "tp:2:sp"])))
    )
    assert sequence.breakdown["activation"] < plain.breakdown["activation"]
    assert sequence.breakdown["param"] == plain.breakdown["param"]


@pytest.mark.slow
def test_pp_stage_zero_holds_half_the_blocks(gpt_runs):
    model = built("gpt", GPT)
    blocks = sum(p.numel() for p in model.blocks.parameters()) * 4
    embeddings = sum(p.numel() for p in (model.tok_emb.weight, model.pos_emb.weight)) * 4
    first, last = ranks_of(gpt_runs["pp:2"])
    assert (first["pp"], last["pp"]) == (0, 1)
    assert first["mem_param_bytes"] - embeddings == pytest.approx(blocks / 2, rel=0.01)
    # the tied head's copy on the last stage trains as the one weight does
    loss = gpt_runs["pp:2"].metrics["train_loss"]
    assert loss == pytest.approx(gpt_runs["none"].metrics["train_loss"], abs=1e-4)
    assert_every_rank_predicted(gpt_runs["pp:2"])
    assert_every_rank_predicted(gpt_runs["pp:2:gpipe"])


@pytest.mark.slow
def test_1f1b_holds_no_more_activations_than_gpipe(gpt_runs):
    """Same 4 micro-batches: GPipe runs every forward before any backward, 1F1B starts
    backwards once the pipeline is full, so its first stage holds fewer micro-batches."""
    one_f_one_b = ranks_of(gpt_runs["pp:2"])[0]["mem_activation_bytes"]
    gpipe = ranks_of(gpt_runs["pp:2:gpipe"])[0]["mem_activation_bytes"]
    assert one_f_one_b <= gpipe
    assert gpt_runs["pp:2"].info["pp_blocks"] == "0-1, 2-3"


@pytest.mark.slow
def test_fsdp_with_tp_runs_on_four_ranks(gpt_runs):
    result = gpt_runs["fsdp:2+tp:2"]
    ranks = ranks_of(result)
    assert [(r["dp"], r["tp"]) for r in ranks] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert_every_rank_predicted(result)
    assert result.metrics["train_loss"] == pytest.approx(
        gpt_runs["none"].metrics["train_loss"], abs=1e-3
    )
    # a quarter of the blocks' state per rank, near enough: params below tp:2's
    assert result.metrics["mem_optim_bytes"] < gpt_runs["tp:2"].metrics["mem_optim_bytes"]


@pytest.mark.slow
def test_hf_pipeline_stages_are_predicted(llama_runs):
    """The preset ties its embedding and head: the two ends keep a copy each and sum their
    gradients, so the pipeline trains the model ``none`` trains."""
    assert_every_rank_predicted(llama_runs["pp:2"])
    loss = llama_runs["pp:2"].metrics["train_loss"]
    assert loss == pytest.approx(llama_runs["none"].metrics["train_loss"], abs=1e-4)
    first, last = ranks_of(llama_runs["pp:2"])
    assert first["mem_param_bytes"] != last["mem_param_bytes"]  # embeddings vs head


def test_tp_within_pipeline_stages_is_predicted():
    """[tp:2, pp:2] (run on 4 ranks by experiments/parallel_small.yaml): each stage's blocks
    split over its tensor pair, every stage predicted."""
    plain, both = trial_configs(parse_spec(spec("hf", LLAMA, ["pp:2", ["tp:2", "pp:2"]])))
    pipeline, split = (estimate_peak(c, torch.device("cpu")) for c in (plain, both))
    assert len(split.stage_peaks) == 2
    for alone, halved in zip(pipeline.stage_peaks, split.stage_peaks, strict=True):
        assert halved < alone


@pytest.mark.slow
def test_held_out_decoder(tmp_path):
    # pp:2 interleaved: 4 virtual stages, a block each; [fsdp:2, tp:2] runs on gpt above
    runs = run(tmp_path, "hf", HELD_OUT, ["tp:2", "pp:2:interleaved"])
    for result in runs.values():
        assert_every_rank_predicted(result)


def test_layout_and_world_size():
    combination = Combination.parse(["fsdp:2", "tp:2"])
    assert combination.world_size == 4
    assert combination.layout == Layout((("dp", 2), ("tp", 2)))
    assert combination.layout.coordinates(3) == {"dp": 1, "tp": 1}
    assert combination.batch_step == 2  # tensor ranks share their replica's part
    pipeline = Combination.parse(["pp:2", "tp:2"])
    assert pipeline.layout.roles() == [0, 2]  # one rank per stage
    assert pipeline.pipeline_micro_batches == 4 and pipeline.batch_step == 4
    assert Combination.parse(["pp:2", "accumulate:3"]).batch_step == 3
    assert Combination.parse(["pp:2:gpipe"]).term("pp").option == "gpipe"


@pytest.mark.parametrize(
    ("strategies", "message"),
    [
        (["ddp:2", "tp:2"], "'ddp' and 'tp' cannot be combined"),
        (["tp:2", "lora:8"], "'tp' and 'lora' cannot be combined"),
        (["pp:2:zigzag"], "unknown option"),
        (["pp:2:interleaved", "accumulate:3"], "a multiple of the 2 stages"),
        (["pp:2", "checkpoint:auto"], "'pp' cannot be combined"),
    ],
)
def test_invalid_layouts_are_refused_in_one_line(strategies, message):
    with pytest.raises(ValueError, match=message):
        Combination.parse(strategies)


def test_pipeline_batches_must_split_into_micro_batches():
    with pytest.raises(SpecError, match="splits each batch 4 ways"):
        parse_spec(spec("gpt", GPT, ["pp:2"], batch_size=6), "pp.yaml")


def test_tp_refuses_heads_it_cannot_split():
    config = trial_configs(parse_spec(spec("gpt", {**GPT, "n_head": 2, "d_model": 64}, ["tp:4"])))[
        0
    ]
    prediction = estimate_peak(config, torch.device("cpu"))
    assert (
        prediction.outcome == "refused"
        and "n_head (2) must be a multiple of 4" in prediction.reason
    )


def test_balanced_cuts():
    assert balanced_cuts([1, 1, 1, 1], 2) == [(0, 2), (2, 4)]
    assert balanced_cuts([4, 1, 1, 1, 1], 2) == [(0, 1), (1, 5)]
    assert balanced_cuts([1, 1, 1], 3) == [(0, 1), (1, 2), (2, 3)]


def test_fit_searches_the_worst_stage_of_a_pipeline():
    """harness fit on pp:2: batch sizes the pipeline can split (multiples of its 4
    micro-batches), judged on the stage that needs most."""
    from harness.trial.fit import fit_config

    config = trial_configs(parse_spec(spec("gpt", GPT, ["pp:2"])))[0]
    at_eight = estimate_peak(config, torch.device("cpu"))
    assert len(at_eight.stage_peaks) == 2 and at_eight.peak_bytes == max(at_eight.stage_peaks)
    budget = int(at_eight.peak_bytes * 1.3)
    (row,) = fit_config(config, "batch_size", [budget], 64, torch.device("cpu"))
    assert row["value"] >= 8 and row["value"] % 4 == 0
    assert row["predicted_peak_bytes"] <= budget


def test_pipeline_step_time_includes_the_bubble():
    from harness.trial.estimate import bubble_factor

    def factor(strategies):
        return bubble_factor(trial_configs(parse_spec(spec("gpt", GPT, strategies)))[0])

    assert factor(["none"]) == 1.0
    assert factor(["pp:2"]) == pytest.approx(5 / 4)  # 4 micro-batches, 1 slot of ramp
    assert factor(["pp:2:interleaved"]) == pytest.approx(4.5 / 4)
    assert factor([["pp:2", "accumulate:8"]]) == pytest.approx(9 / 8)


def cuda_configs(family: str, size: dict[str, Any], strategies: list[Any]) -> list:
    data = spec(family, size, strategies, batch_size=4)
    data.update(device="cuda", card="h100-80gb")
    data["grid"]["dtype"] = ["bf16"]
    return trial_configs(parse_spec(data))


@pytest.mark.skipif(not CP_OPTIONS.present(), reason="cp:N needs torch 2.9 or newer")
@pytest.mark.parametrize("family", ["gpt", "hf"])
def test_cp_is_predicted_for_a_card(family):
    """Context parallelism runs on CUDA only; its prediction for a card runs here: each rank's
    activations fall to about a half, its model state stays whole (with fsdp: sharded over
    data and context ranks together, a quarter on 4 ranks)."""
    size = GPT if family == "gpt" else LLAMA
    configs = cuda_configs(family, size, ["none", "cp:2", ["fsdp:2", "cp:2"]])
    none, cp, sharded = (estimate_peak(c, torch.device("cpu"), as_cuda=True) for c in configs)
    assert cp.ok and sharded.ok, (cp.reason, sharded.reason)
    activation = cp.breakdown["activation"] / none.breakdown["activation"]
    assert 0.2 < activation < 0.6
    assert cp.breakdown["optim"] == none.breakdown["optim"]
    # a quarter, and FSDP's padding of every shard to an equal size
    assert sharded.breakdown["optim"] == pytest.approx(none.breakdown["optim"] / 4, rel=0.12)


def test_cp_is_refused_where_it_cannot_run():
    with pytest.raises(SpecError, match="strategy 'cp' needs device cuda"):
        parse_spec(spec("gpt", GPT, ["cp:2"]), "cp.yaml")
    with pytest.raises(ValueError, match="'cp' and 'tp' cannot be combined"):
        Combination.parse(["cp:2", "tp:2"])
    (config,) = cuda_configs("gpt", {**GPT, "seq_len": 30}, ["cp:4"])
    prediction = estimate_peak(config, torch.device("cpu"), as_cuda=True)
    why = "do not split into 8 equal parts" if CP_OPTIONS.present() else "torch 2.9 or newer"
    assert prediction.outcome == "refused" and why in prediction.reason
