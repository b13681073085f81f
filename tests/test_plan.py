"""``harness plan``: every point on several cards from as few traces as possible, each figure
what a fresh estimate gives on that card; what fits ranked by predicted throughput; the front
drawn; ``--gpus``; and the communication a data-parallel step is priced for."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from harness.cuda.cards import CATALOGUE
from harness.cuda.kernels import installed_cudnn_version
from harness.cuda.margin import CARD_MARGIN
from harness.meters.op_costs import COLLECTIVE, FLOPS, OpCall, StepCosts, collective_traffic
from harness.meters.roofline import step_time
from harness.spec import SpecError, load_spec, parse_spec, trial_configs
from harness.sweep.card_plan import with_gpus
from harness.trial.card_plan import plan_group
from harness.trial.estimate import Predictor, estimate_peak
from tests.conftest import run_cli, write_spec
from tests.test_cards import GPT, gpt_spec
from tests.test_speed import roofline

CPU = torch.device("cpu")
CARDS = ("rtx-4090", "a100-80gb", "h100-80gb")
FIGURES = ("predicted_peak_bytes", "predicted_reserved_bytes", "predicted_device_bytes",
           "predicted_step_time_ms", "predicted_mfu")  # fmt: skip


def fresh_row(config, card: str, batch: int) -> dict:
    """What ``harness estimate`` predicts for the point: its own build at its own batch."""
    entry = CATALOGUE[card]
    point = replace(
        config, card=entry.to_dict(), batch_size=batch, device_memory_bytes=entry.memory_bytes
    )
    return estimate_peak(point, CPU, as_cuda=True).to_dict()


@pytest.mark.parametrize("strategy", ["none", "lora:4"])
def test_one_trace_serves_every_card_that_runs_the_same_step(base_spec, strategy):
    """The plan builds once, warms up again at each batch size, and replays one trace for every
    card whose attention runs on the same backend: every figure equals a fresh estimate's for
    that card and batch, to the byte (reserved and device included)."""
    data = gpt_spec(base_spec, device="cuda", card="rtx-4090")
    data["grid"]["strategy"] = [strategy]
    config = trial_configs(parse_spec(data))[0]
    batches = [2, 6]
    request = {
        "cards": {name: CATALOGUE[name].to_dict() for name in CARDS},
        "budgets": {name: CATALOGUE[name].memory_bytes for name in CARDS},
        "groups": [{"batches": {name: batches for name in CARDS}}],
    }
    # Fresh estimates first: a process's first LoRA prediction has two 8-byte tensors more
    # (made once per process), so both sides are compared as later predictions.
    expected_rows = {(c, b): fresh_row(config, c, b) for c in CARDS for b in batches}
    answer = plan_group(config, 0, request, CPU, True)
    rows = answer["rows"]
    assert [(r["card"], r["batch_size"]) for r in rows] == [(c, b) for c in CARDS for b in batches]
    # sm80 and sm89 run this attention on flash: one trace for both; sm90 too where the torch
    # ships a cuDNN that SDPA does not prefer there (torch 2.8's 9.10).
    cudnn = installed_cudnn_version()
    alike = CARDS if cudnn is None or cudnn <= 91500 else CARDS[:2]
    assert answer["traces"][0] == list(alike)
    assert answer["progress_note"].startswith(f"traced once for {len(alike)} cards: ")
    for row in rows:
        expected = expected_rows[row["card"], row["batch_size"]]
        for figure in FIGURES:
            assert row[figure] == expected[figure], (row["card"], row["batch_size"], figure)
    assert len({row["trial_key"] for row in rows}) == len(rows)


def test_batches_beyond_one_that_exceeds_a_card_are_not_predicted_on_it(base_spec):
    """Memory grows with the batch: once a point exceeds a card's budget, the configuration's
    larger batches are skipped on that card (their rows say which batch did not fit), while
    the other cards go on; ``every`` predicts them all the same."""
    data = gpt_spec(base_spec, device="cuda", card="rtx-4090")
    config = trial_configs(parse_spec(data))[0]
    cards = ("rtx-4090", "a100-80gb")
    request = {
        "cards": {name: CATALOGUE[name].to_dict() for name in cards},
        "budgets": {"rtx-4090": 2**20, "a100-80gb": CATALOGUE["a100-80gb"].memory_bytes},
        "groups": [{"batches": {name: [2, 4, 6] for name in cards}}],
    }
    rows = {
        (r["card"], r["batch_size"]): r for r in plan_group(config, 0, request, CPU, True)["rows"]
    }
    assert "skipped" not in rows["rtx-4090", 2] and rows["rtx-4090", 2]["predicted_device_bytes"]
    for batch in (4, 6):
        assert rows["rtx-4090", batch]["skipped"].startswith("not predicted: batch 2 already needs")
        assert "predicted_peak_bytes" not in rows["rtx-4090", batch]
        assert rows["a100-80gb", batch]["predicted_device_bytes"] > 0
    every = plan_group(config, 0, {**request, "every": True}, CPU, True)["rows"]
    assert all("skipped" not in row for row in every)


def test_a_warm_up_again_at_another_batch_is_a_fresh_process(base_spec):
    """``rewarm``: the state goes back to what the build left and is warmed up at the new batch,
    so what the allocator saw is a fresh process's; without it, the window after another
    batch's warm-up sees another cache (the fit search's reuse, judged on allocated bytes)."""
    data = gpt_spec(base_spec, device="cuda", card="a100-80gb")
    data["model"]["sizes"]["tiny"] = {**GPT, "d_model": 128, "seq_len": 128}
    config = trial_configs(parse_spec(data))[0]
    with Predictor(replace(config, batch_size=2), CPU, True, rewarm=True) as predictor:
        predictor.predict(2)
        again = predictor.predict(24)
        assert predictor.warmed_at == 24
    expected = fresh_row(config, "a100-80gb", 24)
    assert again.to_dict()["predicted_reserved_bytes"] == expected["predicted_reserved_bytes"]
    assert again.peak_bytes == expected["predicted_peak_bytes"]


def test_tensors_a_step_leaves_behind_do_not_make_the_plan_build_again():
    """PEFT's gradient checkpointing leaves each step's embedding output and its gradient
    alive, held from outside Python: the plan still goes back to the build's state and warms
    up at the next batch (an 8B QLoRA model is not quantized again per batch), and what it
    predicts is a fresh estimate's."""
    pytest.importorskip("peft")
    from tests.test_finetune import llama_spec

    data = llama_spec(["lora:4", "checkpoint"], batch_size=1)
    data["data"] = {"dataset": "tokens", "vocab_size": 512}
    data.update(device="cuda", card="a100-80gb")
    config = trial_configs(parse_spec(data))[0]
    with Predictor(config, CPU, True, rewarm=True) as predictor:
        predictor.predict(1)
        built = predictor.setup.model
        again = predictor.predict(2).to_dict()
        assert predictor.setup.model is built and predictor.warmed_at == 2
        assert predictor.window_made & set(predictor.log.live_ids()), "nothing was left behind"
    expected = fresh_row(config, "a100-80gb", 2)
    for figure in FIGURES:
        assert again[figure] == expected[figure], figure


def test_the_values_mode_records_for_the_cost_counter_what_the_counter_records(base_spec):
    """A prediction's op costs are filed by the fake world's values mode (one dispatch mode
    fewer per op): the same calls, in order, as the counter running as a mode of its own."""
    data = gpt_spec(base_spec, device="cuda", card="a100-80gb")
    data["grid"]["strategy"] = [["checkpoint"]]
    config = trial_configs(parse_spec(data))[0]
    calls = []
    for hosted in (True, False):
        with Predictor(config, CPU, True) as predictor:
            predictor.build()
            if not hosted:
                predictor.values = None  # the counter enters as a mode
            predictor.predict(config.batch_size)
            assert predictor.trace is not None
            calls.append(predictor.trace.costs.calls)
    assert calls[0] == calls[1] and any(call.recompute for call in calls[0])


def canonical(events: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Events with their ids renamed in order of first appearance: the replay sees only which
    event names which block, not the numbers."""
    names: dict[int, int] = {}
    return [(names.setdefault(ident, len(names)), size) for ident, size in events]


@pytest.mark.parametrize(
    ("family", "strategies"),
    [("llama", ["lora:4", "checkpoint"]), ("llama", ["qlora:4"]), ("gpt", ["accumulate:2"]),
     ("gpt", ["fsdp:2"])],
)  # fmt: skip
def test_a_windows_later_steps_are_its_first_filed_again(
    base_spec, family, strategies, monkeypatch
):
    """A window's steps after the first are not run: the first step's allocations are filed
    again (``repeated_step``), so the allocator replay sees every step of the window. They are
    what running the steps files, event for event, and so are every figure (a LoRA under
    checkpointing keeps two tensors alive per step: they stay alive in the repeats too)."""
    if family == "llama":
        pytest.importorskip("peft")
        from tests.test_finetune import llama_spec

        data = llama_spec(strategies)
        data.update(device="cuda", card="a100-80gb")
    else:
        data = gpt_spec(base_spec, device="cuda", card="a100-80gb")
        data["grid"]["strategy"] = [strategies]
    data["measure"] = {**data.get("measure", {}), "memory_steps": 3}
    config = trial_configs(parse_spec(data))[0]
    found = {}
    for repeat in (True, False):
        if not repeat:
            monkeypatch.setattr(Predictor, "repeated", lambda self, start, times: None)
        with Predictor(config, CPU, True) as predictor:
            prediction = predictor.predict(config.batch_size)
            assert predictor.trace is not None
            found[repeat] = (prediction.to_dict(), canonical(predictor.trace.events))
    (repeated, repeated_events), (run, run_events) = found[True], found[False]
    assert repeated_events == run_events
    for figure in ("predicted_peak_bytes", "predicted_reserved_bytes", "predicted_device_bytes"):
        assert repeated[figure] == run[figure]


def plan_json(folder: Path, spec: Path, *args: str) -> list[dict]:
    done = run_cli("plan", str(spec), *args, "--format", "json", cwd=folder)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.mark.slow
def test_plan_ranks_what_fits_each_card_by_predicted_throughput(base_spec, tmp_path):
    data = gpt_spec(base_spec, device="cuda", card="rtx-4090")
    data["grid"] = {"batch_size": [2, 32], "dtype": ["bf16"], "strategy": ["none", "checkpoint"]}
    path = write_spec(tmp_path, data)
    rows = plan_json(tmp_path, path, "--card", "rtx-4090,cpu")
    assert {r["card"] for r in rows} == {"rtx-4090", "cpu"} and len(rows) == 8
    # A budget whose usable part (less the safety margin) lies between the smallest and the
    # largest device figure on the card: some fit.
    on_card = sorted(r["predicted_device_bytes"] for r in rows if r["card"] == "rtx-4090")
    usable = (on_card[1] + on_card[2]) // 2
    budget = int(max(usable + CARD_MARGIN.miss_bytes, usable * (1 + CARD_MARGIN.miss_fraction)))
    data["device_memory"] = budget
    rows = plan_json(tmp_path, write_spec(tmp_path, data), "--card", "rtx-4090")
    assert all(r["budget_bytes"] == budget for r in rows)
    for row in rows:
        assert row["safety_margin_bytes"] == pytest.approx(budget - CARD_MARGIN.usable(budget))
        assert row["fits"] == (row["predicted_device_bytes"] <= budget - row["safety_margin_bytes"])
        assert (row["rank"] is None) == (not row["fits"])
    ranked = sorted((r for r in rows if r["fits"]), key=lambda r: r["rank"])
    assert [r["rank"] for r in ranked] == list(range(1, len(ranked) + 1))
    throughputs = [r["predicted_throughput"] for r in ranked]
    assert throughputs == sorted(throughputs, reverse=True) and 1 <= len(ranked) < 4

    # The table, the runner-up's trade in one line, and the front drawn in PNG and HTML.
    done = run_cli("plan", str(path), "--card", "rtx-4090,cpu", "--out", "front", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    trade = [line for line in done.stdout.splitlines() if line.startswith("rtx-4090 (")]
    assert len(trade) == 1 and "% slower than" in trade[0] and "runner-up" in trade[0]
    assert (tmp_path / "front" / "front.png").stat().st_size > 10_000
    assert "plotly" in (tmp_path / "front" / "front.html").read_text()


def test_plan_refuses_an_unknown_card_in_one_line(base_spec, tmp_path):
    path = write_spec(tmp_path, gpt_spec(base_spec))
    done = run_cli("plan", str(path), "--card", "rtx-4090,h100", cwd=tmp_path)
    assert done.returncode == 2
    assert "unknown card 'h100'" in done.stderr and "Traceback" not in done.stderr


def test_gpus_puts_every_configuration_on_that_many_cards(base_spec, tmp_path):
    data = gpt_spec(base_spec, device="cuda", card="a100-80gb")
    data["grid"] = {"batch_size": [2, 4], "dtype": ["bf16"],
                    "strategy": ["none", "lora:4", "fsdp:2", ["checkpoint", "ddp:2"]]}  # fmt: skip
    spec = with_gpus(load_spec(write_spec(tmp_path, data)), 8)
    texts = [combination.text for combination in spec.grid.strategy]
    assert texts == ["ddp:8", "lora:4+ddp:8", "fsdp:8", "checkpoint+ddp:8"]
    assert spec.grid.batch_size == [16, 32]  # per card as written, 8 cards
    assert with_gpus(load_spec(write_spec(tmp_path, data)), 1).grid.batch_size == [2, 4]


def test_gpus_leaves_tensor_and_pipeline_ranks_and_replicates_the_rest(base_spec, tmp_path):
    data = gpt_spec(base_spec, device="cuda", card="a100-80gb")
    data["grid"] = {"batch_size": [8], "dtype": ["bf16"],
                    "strategy": ["tp:2", ["fsdp:2", "tp:2"], ["pp:2", "ddp:2"], "pp:4"]}  # fmt: skip
    spec = with_gpus(load_spec(write_spec(tmp_path, data)), 8)
    texts = [combination.text for combination in spec.grid.strategy]
    assert texts == ["tp:2+fsdp:4", "fsdp:4+tp:2", "pp:2+ddp:4", "pp:4+ddp:2"]
    assert {c.world_size for c in spec.grid.strategy} == {8}
    with pytest.raises(SpecError, match="a multiple of its 4 tensor x pipeline ranks"):
        with_gpus(load_spec(write_spec(tmp_path, data)), 6)


def test_collectives_are_priced_as_a_ring_moves_them_and_overlap_on_a_card():
    # One rank of four sends 2 x 3/4 of an all-reduced tensor, 3/4 of a gathered output, 3/4
    # of a reduce-scattered input; waiting moves nothing; one rank alone sends nothing.
    assert collective_traffic("allreduce_", 100.0, 100.0, 4) == 150.0
    assert collective_traffic("all_gather_into_tensor", 25.0, 100.0, 4) == 75.0
    assert collective_traffic("_reduce_scatter_base_", 100.0, 25.0, 4) == 75.0
    assert collective_traffic("wait_tensor", 100.0, 100.0, 4) == 0.0
    assert collective_traffic("allreduce_", 100.0, 100.0, 1) == 0.0
    matmul = OpCall("mm", FLOPS, "float32", flops=1e12, bytes=1e6, recompute=False)
    gather = OpCall("_allgather_base_", COLLECTIVE, "float32", 0.0, bytes=1e9, recompute=False)
    line = roofline(link_bandwidth=1e11)
    timed = step_time(StepCosts([matmul, gather, gather]), line)
    compute = timed.device_s
    assert timed.collective_s == pytest.approx(2e-2)
    # On a card the collectives hide behind the kernels but for the longest one.
    assert timed.seconds == pytest.approx(max(compute, timed.host_s) + max(1e-2, 2e-2 - compute))
    serial = step_time(StepCosts([matmul, gather]), roofline(link_bandwidth=1e11, overlapped=False))
    assert serial.seconds == pytest.approx(serial.device_s + serial.host_s + 1e-2)


def test_ddp_and_fsdp_steps_carry_their_communication(base_spec):
    """The estimator's DDP hook all-reduces each gradient bucket on the fake group, so the step
    time sees it: about twice the gradients' bytes x (N-1)/N per rank; FSDP's all-gathers and
    reduce-scatters are the step's own."""
    data = gpt_spec(base_spec, device="cuda", card="a100-80gb")
    data["grid"] = {"batch_size": [4], "dtype": ["fp32"], "strategy": ["ddp:2", "fsdp:2"]}
    ddp, fsdp = trial_configs(parse_spec(data))
    with Predictor(ddp, CPU, True) as predictor:
        predictor.predict(4)
        assert predictor.trace is not None
        moved = sum(c.bytes for c in predictor.trace.costs.calls if c.rule == COLLECTIVE)
        gradients = sum(p.numel() * 4 for p in predictor.setup.model.parameters())
    assert moved == pytest.approx(2 * 0.5 * gradients, rel=0.05)
    with Predictor(fsdp, CPU, True) as predictor:
        prediction = predictor.predict(4)
        names = {c.name for c in predictor.trace.costs.calls if c.rule == COLLECTIVE}
    assert {"_allgather_base_", "_reduce_scatter_base_"} <= names
    assert prediction.speed is not None and "collectives" not in prediction.speed.unmodelled_ops


@pytest.mark.slow
def test_sweep_top_runs_the_plans_shortlist_first_and_records_its_ranks(base_spec, tmp_path):
    from mlflow.tracking import MlflowClient

    data = dict(base_spec)
    data["grid"] = {"batch_size": [8, 64], "dtype": ["fp32"], "strategy": ["none", "checkpoint"]}
    data["train"]["budget"] = {"steps": 4}
    path = write_spec(tmp_path, data)
    planned = plan_json(tmp_path, path, "--card", "cpu")
    best = sorted((r for r in planned if r["rank"] is not None), key=lambda r: r["rank"])[:2]
    done = run_cli("sweep", str(path), "--top", "2", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "--top 2: the 2 point(s) predicted fastest" in done.stderr
    client = MlflowClient(f"sqlite:///{tmp_path}/results/mlflow.db")
    experiment = client.get_experiment_by_name("unit")
    runs = client.search_runs([experiment.experiment_id], "tags.harness_role = 'trial'")
    assert len(runs) == 4
    runs = sorted(runs, key=lambda run: run.info.start_time)
    first = [(int(r.data.params["batch_size"]), r.data.params["strategy"]) for r in runs[:2]]
    assert first == [(r["batch_size"], r["strategy"]) for r in best]
    assert [r.data.tags.get("planned_rank") for r in runs] == ["1", "2", None, None]
    # A cluster launcher is refused in one line (its workers would not see the shortlist).
    remote = run_cli("sweep", str(path), "--top", "1", "--launcher", "slurm", cwd=tmp_path)
    assert remote.returncode == 2 and "--top runs on this host's launcher only" in remote.stderr
