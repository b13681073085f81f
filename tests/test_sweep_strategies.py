"""Every strategy that can run on a CPU runs inside a real sweep and is recorded in MLflow; the
sweep runs on two workers, the suite's end-to-end test of ``--workers 2`` on one host."""

from __future__ import annotations

import copy
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from harness.record.stores import storage_for
from harness.results import load
from harness.strategies import STRATEGIES
from tests.conftest import BASE_SPEC, expect_exit, run_cli, write_spec

pytestmark = pytest.mark.slow

CPU_STRATEGIES = [
    "none",
    "checkpoint",
    "accumulate:2",
    "bf16_params",
    "sgd",
    "sgd_momentum",
    "adamw",
    "adafactor",
    "adam8bit",
    "prune:0.5",
    "prune_structured:0.5",
    "quantize_int8",
    "keep_grads",
    "compile",
    "ddp:2",
    "fsdp:2",
    ["fsdp:2", "fsdp_mixed"],
    "sac",
    "lora:4",
    "qlora:4",
    ["checkpoint", "accumulate:2", "adafactor"],
]


def both_workers_ran_trials(journal: Path) -> bool:
    """Whether the study in the sweep's journal file has finished trials of two owners."""
    storage = storage_for(f"journal:{journal}")
    (summary,) = optuna.get_all_study_summaries(storage)
    shared = optuna.load_study(study_name=summary.study_name, storage=storage)
    owners = {t.user_attrs.get("owner") for t in shared.trials if t.state == TrialState.COMPLETE}
    return len(owners) == 2


def test_every_cpu_strategy_runs_in_a_sweep(tmp_path):
    covered = {
        t.partition(":")[0] for e in CPU_STRATEGIES for t in (e if isinstance(e, list) else [e])
    }
    cuda_only = {n for n, info in STRATEGIES.items() if "cpu" not in info.devices}
    conv_only = {"channels_last"}  # covered on the cnn below
    # a language model's loss (tests/test_llm_levers.py); tensor and pipeline parallelism of
    # gpt and HF decoders (tests/test_model_parallel.py)
    lm_only = {"chunked_ce", "tp", "pp"}
    assert covered | cuda_only | conv_only | lm_only == set(STRATEGIES)

    spec = copy.deepcopy(BASE_SPEC)
    spec["name"] = "every-strategy"
    spec["model"] = {"family": "mlp", "sizes": {"m": {"width": 64, "depth": 2}}}
    spec["grid"].update(batch_size=[16], strategy=CPU_STRATEGIES)
    spec["train"]["budget"] = {"steps": 8}
    spec["measure"]["timeline"] = True  # every strategy as a user runs it: timeline on
    spec["limits"] = {"trial_timeout": "300s"}
    # Two workers: this test is about every strategy running and being recorded (throughput
    # is not compared), and it is also the suite's test of --workers 2 on one host: every
    # point run exactly once, by both workers, through the journal file (with multi-rank
    # trials among them).
    path = write_spec(tmp_path, spec)
    done = run_cli("sweep", str(path), "--workers", "2", cwd=tmp_path, timeout=1800)
    expect_exit(done)
    assert "distorted" in done.stdout  # the warning about workers sharing a CPU
    frame = load("every-strategy", f"sqlite:///{tmp_path}/results/mlflow.db").set_index("strategy")
    failed = frame[frame["status"] != "ok"]["failure_reason"].to_dict()
    assert not failed, failed
    assert len(frame) == len(CPU_STRATEGIES) and frame["trial_key"].is_unique
    assert both_workers_ran_trials(tmp_path / "results" / "optuna.journal")
    assert frame.loc["ddp:2", "world_size"] == 2
    assert frame.loc["sgd", "optimizer"] == "sgd"  # the optimizer the trial really used
    assert frame.loc["prune:0.5", "sparsity"] == pytest.approx(0.5, abs=0.01)
    assert frame.loc["quantize_int8", "int8_accuracy"] >= 0
    assert frame.loc["compile", "compile_time_s"] > 0

    cnn = copy.deepcopy(spec)
    cnn["name"] = "channels-last"
    cnn["model"] = {"family": "cnn", "sizes": {"s": {"width": 8}}}
    cnn["grid"]["strategy"] = ["channels_last"]
    done = run_cli("sweep", str(write_spec(tmp_path, cnn, "cnn.yaml")), cwd=tmp_path, timeout=600)
    expect_exit(done)
    assert (
        load("channels-last", f"sqlite:///{tmp_path}/results/mlflow.db")["status"] == "ok"
    ).all()
