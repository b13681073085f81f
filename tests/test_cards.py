"""Predicting for a named card: the catalogue and user cards, the spec's card/cards/allocator,
the allocation log the allocator replays, and fits judged on the device figure."""

from __future__ import annotations

import json

import pytest
import torch
import yaml

from harness.cuda.cards import CATALOGUE, card_from_mapping, find_card
from harness.cuda.device_memory import replay
from harness.spec import SpecError, parse_spec, trial_configs, with_card
from harness.trial.estimate import Predictor
from tests.conftest import expect_exit, run_cli, write_spec

GPT = {"n_layer": 2, "d_model": 64, "n_head": 4, "seq_len": 64}


def gpt_spec(base_spec: dict, **top: object) -> dict:
    data = dict(base_spec)
    data["model"] = {"family": "gpt", "sizes": {"tiny": GPT}}
    data["data"] = {"dataset": "text", "test_fraction": 0.05}
    data["grid"] = {"batch_size": [4], "dtype": ["bf16"], "strategy": ["none"]}
    data.update(top)
    return data


def test_unknown_cards_and_bad_card_files_are_one_line(base_spec, tmp_path):
    with pytest.raises(SpecError, match=r"card: unknown card 'h100' .*did you mean"):
        parse_spec({**base_spec, "card": "h100"})
    with pytest.raises(KeyError, match="did you mean 'rtx-4090'"):
        find_card("rtx-4900")
    with pytest.raises(ValueError, match=r"^mine\.sms: streaming multiprocessors"):
        card_from_mapping("mine", {"memory": "8GiB", "compute_capability": "8.6", "sms": 0}, "mine")
    bad = tmp_path / "cards.yaml"
    bad.write_text(yaml.safe_dump({"mine": {"memory": "8GiB", "sms": 80}}))
    with pytest.raises(SpecError, match=r"cards\.yaml: mine\.compute_capability: missing"):
        parse_spec({**base_spec, "card": "mine", "cards": str(bad)})
    with pytest.raises(SpecError, match=r"allocator: .*max_split_size_mb:1: too small"):
        parse_spec({**base_spec, "allocator": "max_split_size_mb:1"})


def test_the_budget_is_the_card_unless_device_memory_is_smaller(base_spec):
    card = CATALOGUE["rtx-4090"]
    assert parse_spec({**base_spec, "card": "rtx-4090"}).memory_budget == card.memory_bytes
    spec = parse_spec({**base_spec, "card": "rtx-4090", "device_memory": "16GiB"})
    assert spec.memory_budget == 16 * 2**30
    spec = parse_spec({**base_spec, "card": "rtx-4090", "device_memory": "80GiB"})
    assert spec.memory_budget == card.memory_bytes
    config = trial_configs(with_card(parse_spec(base_spec), "h100-80gb"))[0]
    assert config.card["name"] == "h100-80gb" and config.device_memory_bytes == 81082 * 2**20


def test_the_allocator_replay_sees_every_byte_the_prediction_counts(base_spec):
    """The allocation log and tensor accounting agree: replayed through the caching allocator,
    the log's allocated peak in the window holds every tensor byte and the cuBLAS workspaces
    (and the block remainders the allocator does not split off, which is what
    max_memory_allocated counts), and the reservation is never below it."""
    for extra in ({}, {"strategy": ["checkpoint"]}):
        data = gpt_spec(base_spec, card="a100-80gb")
        data["grid"].update(extra)
        config = trial_configs(parse_spec(data))[0]
        with Predictor(config, torch.device("cpu"), as_cuda=True) as predictor:
            prediction = predictor.predict(config.batch_size)
            assert predictor.log is not None
            start = predictor.history_end
            history = predictor.log.events[:start]
            tracked, workspaces = predictor.tracked_peak, predictor.workspaces.total
        allocator = replay(history, predictor.log.events[start:], predictor.target.allocator)
        assert allocator.peak_allocated_bytes == prediction.peak_bytes
        # every tensor byte and each workspace is in the log; blocks add unsplit remainders
        assert (
            tracked + workspaces <= allocator.peak_allocated_bytes <= 1.01 * (tracked + workspaces)
        )
        reserved = prediction.on_card.reserved_bytes
        assert prediction.peak_bytes <= reserved
        assert prediction.on_card.device_bytes == reserved + CATALOGUE["a100-80gb"].context


def test_expandable_segments_and_settings_change_the_reserved_prediction(base_spec):
    """The allocator settings reach the replay: expandable segments grow in pages (less
    reserved on this step), a small max_split_size keeps every large cached block whole and
    makes smaller requests take new segments (far more)."""
    reserved = {}
    for conf in (None, "expandable_segments:True", "max_split_size_mb:20"):
        data = gpt_spec(base_spec, card="a100-80gb", allocator=conf)
        data["model"]["sizes"]["tiny"] = {**GPT, "d_model": 256, "seq_len": 256, "n_layer": 4}
        data["grid"]["batch_size"] = [12]  # activations of 3 MiB and more: the large pool
        config = trial_configs(parse_spec(data))[0]
        with Predictor(config, torch.device("cpu"), as_cuda=True) as predictor:
            reserved[conf] = predictor.predict(config.batch_size).on_card.reserved_bytes
    assert reserved["expandable_segments:True"] < reserved[None]
    assert reserved["max_split_size_mb:20"] > reserved[None]


def test_estimate_judges_a_card_on_the_device_figure(base_spec, tmp_path):
    """A card whose memory lies between the allocated figure and the device figure: the tensors
    fit, the card does not (its context does not), and fits says NO."""
    spec = write_spec(tmp_path, gpt_spec(base_spec, device="cuda", card="a100-80gb"))
    done = run_cli("estimate", str(spec), "--format", "json", cwd=tmp_path)
    expect_exit(done)
    row = json.loads(done.stdout)[0]
    allocated, device = row["predicted_peak_bytes"], row["predicted_device_bytes"]
    assert allocated <= row["predicted_reserved_bytes"] < device and row["fits"] is True
    assert row["card"] == "a100-80gb" and "attention" in row["note"]
    tight = {
        "tight": {
            "memory": int((allocated + device) / 2),
            "compute_capability": "8.0",
            "sms": 1,
            "context": f"{int(device - row['predicted_reserved_bytes'])}",
        }
    }
    (tmp_path / "cards.yaml").write_text(yaml.safe_dump(tight))
    done = run_cli(
        "estimate", str(spec), "--card", "tight", "--cards", "cards.yaml", "--format", "json",
        cwd=tmp_path,
    )  # fmt: skip
    expect_exit(done)
    row = json.loads(done.stdout)[0]
    assert row["card"] == "tight" and row["fits"] is False
    table = run_cli("estimate", str(spec), "--card", "rtx-4090", cwd=tmp_path)
    expect_exit(table)
    for heading in ("allocated", "reserved", "device", "rtx-4090"):
        assert heading in table.stdout
    wrong = run_cli("estimate", str(spec), "--card", "rtx-4900", cwd=tmp_path)
    expect_exit(wrong, 2)
    assert len(wrong.stderr.strip().splitlines()) == 1
    assert "did you mean 'rtx-4090'" in wrong.stderr


def test_cards_lists_the_catalogue_and_a_users_cards(tmp_path):
    (tmp_path / "mine.yaml").write_text(
        yaml.safe_dump({"my-a6000": {"memory": "48GiB", "compute_capability": "8.6", "sms": 84}})
    )
    done = run_cli("cards", "--cards", "mine.yaml", "--format", "json", cwd=tmp_path)
    expect_exit(done)
    names = {row["card"]: row for row in json.loads(done.stdout)}
    assert set(CATALOGUE) < set(names)
    assert names["my-a6000"]["memory_bytes"] == 48 * 2**30
    assert "torch prints" in names["h100-80gb"]["sources"]


def test_fit_for_a_card_is_judged_on_the_device_figure(base_spec):
    """fit's answer b for a CUDA card: b fits the budget as a fresh estimate judges it (the
    device figure, the allocator's free-and-retry included) and the next allowed batch does
    not; the budget sits where the allocated figure alone would have allowed more."""
    from dataclasses import replace

    from harness.trial.fit import fit_config

    data = gpt_spec(base_spec, card="a100-80gb")
    data["model"]["sizes"]["tiny"] = {**GPT, "d_model": 128, "seq_len": 128}
    config = trial_configs(parse_spec(data))[0]
    cpu = torch.device("cpu")
    with Predictor(config, cpu, as_cuda=True) as predictor:
        at_32 = predictor.predict(32)
    budget = int(at_32.peak_bytes + at_32.on_card.context_bytes)
    (row,) = fit_config(config, "batch_size", [budget], 256, cpu, as_cuda=True)
    value = row["value"]
    assert 0 < value < 32  # the allocated figure fits 32; what the card holds does not
    assert row["predicted_device_bytes"] <= budget and row["margin_bytes"] >= 0

    def fresh(batch: int) -> float:
        sized = replace(config, batch_size=batch, device_memory_bytes=budget)
        with Predictor(sized, cpu, as_cuda=True) as predictor:
            return predictor.predict(batch).on_card.device_bytes

    assert fresh(value) <= budget
    assert fresh(value + 1) > budget
