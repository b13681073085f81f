"""The GPU check (``scripts/gpu_check.sh``) in its reduced CPU mode, as CI runs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO, expect_exit

SCRIPT = REPO / "scripts" / "gpu_check.sh"


def run_script(*args: str, timeout: float = 900) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHON": sys.executable}
    return subprocess.run(
        ["bash", str(SCRIPT), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=REPO,
    )


def test_it_needs_an_out_dir():
    done = run_script(timeout=60)
    expect_exit(done, 2)
    assert done.stderr.strip().startswith("usage: bash scripts/gpu_check.sh OUT_DIR")
    assert len(done.stderr.strip().splitlines()) == 1


@pytest.mark.slow
def test_cpu_reduced_check_passes_and_prints_its_table_last(tmp_path):
    pytest.importorskip("torch")
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA machine runs the full GPU check, not the reduced CPU one")
    done = run_script(str(tmp_path / "out"))
    expect_exit(done)

    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["mode"] == "cpu-reduced"
    assert summary["device"] == "cpu" and summary["torch_version"] == torch.__version__
    trials = summary["trials"]
    by_label = {t["label"]: t for t in trials}
    assert len(by_label) == len(trials)  # labels are unique (one folder each)

    # The OOM and the clean trial after it, in the same process.
    first, second = trials[0], trials[1]
    assert first["label"].startswith("oom-") and second["label"].startswith("after-oom/")
    assert first["launch"] == second["launch"] == "pair"
    assert first["status"] == "oom" and "exceeds device_memory" in first["reason"]
    assert first["metrics"]["predicted_peak_bytes"] > 2**20  # above the 1 MiB card
    assert second["status"] == "ok"

    for trial in trials:
        assert trial["as_expected"], trial
        if trial["status"] == "skipped":  # only for a missing optional package
            assert "not installed" in trial["reason"], trial
            continue
        assert trial["wall_s"] > 0
        assert (tmp_path / "out" / trial["folder"] / "result.json").exists()
        if trial["status"] == "ok":
            metrics = trial["metrics"]
            assert metrics["peak_allocated_bytes"] > 0 and metrics["throughput"] > 0
            assert metrics["prediction_ratio"] == pytest.approx(1.0, abs=0.05), trial
            assert trial["throughput_unit"] in ("tokens/s", "samples/s")
    for label in ("gpt/fp32/none", "gpt/bf16/checkpoint", "cnn-cifar/fp32/none"):
        assert by_label[label]["status"] == "ok"

    # The table is the last thing printed: its header, a rule, one row per trial, the verdict.
    lines = done.stdout.rstrip().splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("trial "))
    assert "mode: cpu-reduced" in lines[header - 1]
    assert set(lines[header + 1].replace(" ", "")) == {"-"}
    rows = lines[header + 2 : -1]
    assert [row.split()[0] for row in rows] == [t["label"] for t in trials]
    assert all(row.split()[1] == t["status"] for row, t in zip(rows, trials, strict=True))
    ran = sum(t["status"] != "skipped" for t in trials)
    assert lines[-1] == f"mode: cpu-reduced: all {ran} trials ended as expected"


def load_check_module():  # type: ignore[no-untyped-def]
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "scripts" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module
    spec.loader.exec_module(module)
    return module


def test_trials_that_ran_on_a_card_are_predicted_again_as_a_cpu_predicts_them(tmp_path):
    """The GPU check's cpu-hosted pass (what `harness estimate --card` says on a laptop), run
    here on trials that 'ran' on an H100: the estimator child with CUDA hidden gives all three
    figures for that card."""
    gpu_check = load_check_module()
    checks = [c for c in gpu_check.plan("cpu-reduced", {"transformers": True, "peft": True})]
    ran = [c for c in checks if c.label in ("gpt/bf16/none", "gpt/fp32/checkpoint")]
    for check in ran:
        check.status = "ok"
    gpu_check.cpu_hosted(ran, {"device_name": "NVIDIA H100 80GB HBM3"}, tmp_path, 600)
    for check in ran:
        allocated = check.metrics["cpu_predicted_peak_bytes"]
        reserved = check.metrics["cpu_predicted_reserved_bytes"]
        device = check.metrics["cpu_predicted_device_bytes"]
        assert 0 < allocated <= reserved < device
        assert allocated > 32 * 2**20  # the H100's 32 MiB cuBLAS workspaces are allocated


def test_recorded_snapshots_are_replayed_through_the_allocator_model(tmp_path):
    from harness.cuda.allocator import AllocatorConfig
    from tests.test_replay import record, training_steps, write

    gpu_check = load_check_module()
    check = gpu_check.Check("llama/bf16/none", None)
    snapshot, truth = record(training_steps(), AllocatorConfig(), start_at=40)
    (tmp_path / "trials" / check.folder_name).mkdir(parents=True)
    write(tmp_path / "trials" / check.folder_name / "memory_snapshot.pickle", snapshot)
    gpu_check.replay_snapshots([check], tmp_path)
    replayed = check.info["snapshot_replay"]
    assert replayed["recorded_peak_reserved_bytes"] == truth["peak_reserved"]
    assert replayed["predicted_peak_reserved_bytes"] == truth["peak_reserved"]
    assert replayed["segment_decisions_matched"] == replayed["segment_decisions_total"]
    assert any(note.startswith("snapshot replay:") for note in check.notes)


RECORDED_H200 = REPO / "docs" / "gpu-validation" / "h200-2026-12-04-summary.json"


def run_python(*args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(REPO / "scripts" / "gpu_check.py"), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )


def test_a_recorded_card_run_is_predicted_again_with_todays_code():
    """`--repredict`: the recorded H200 CNN trials predicted by this machine for that card, set
    against what the card measured (ratios predicted / measured, as the JSON contract says)."""
    recorded = json.loads(RECORDED_H200.read_text())
    measured = {t["label"]: t["metrics"] for t in recorded["trials"]}
    done = run_python("--repredict", str(RECORDED_H200), "--format", "json", "--only", "cnn-cifar")
    expect_exit(done)
    trials = json.loads(done.stdout)["trials"]
    assert [t["label"] for t in trials] == ["cnn-cifar/fp32/none", "cnn-cifar/fp16/none"]
    for entry in trials:
        truth = measured[entry["label"]]
        for key, metric, figure in (
            ("allocated_ratio", "peak_allocated_bytes", "predicted_peak_bytes"),
            ("reserved_ratio", "peak_reserved_bytes", "predicted_reserved_bytes"),
            ("device_ratio", "peak_device_bytes", "predicted_device_bytes"),
        ):
            assert entry[metric] == truth[metric]
            assert entry[key] == pytest.approx(entry[figure] / truth[metric])
        assert 0.9 < entry["allocated_ratio"] < 1.1  # a CNN: no workspace the model misses
        assert entry["workspace_bytes"] > 32 * 2**20  # two 32 MiB cuBLAS workspaces on sm90


def test_repredict_says_in_one_line_what_it_cannot_use(tmp_path):
    cpu_run = tmp_path / "summary.json"
    cpu_run.write_text(json.dumps({"mode": "cpu-reduced", "trials": []}))
    for path, says in ((tmp_path / "none.json", "no such file"), (cpu_run, "only a gpu run")):
        done = run_python("--repredict", str(path), timeout=60)
        expect_exit(done, 2)
        assert done.stderr.strip().startswith("repredict: ") and says in done.stderr
        assert len(done.stderr.strip().splitlines()) == 1


def test_the_gpu_plan_runs_the_real_size_trials_first_and_skips_what_it_lacks():
    gpu_check = load_check_module()
    have = {name: True for name in gpu_check.OPTIONAL}
    labels = [c.label for c in gpu_check.plan("gpu", have)]
    assert labels[:2] == ["llama-8b/bf16/lora:16+checkpoint", "llama-3b/bf16/checkpoint/b2x4096"]
    assert len(labels) == len(set(labels))
    # Every trial of the old run keeps its label (`--repredict` finds its config by it).
    recorded = json.loads(RECORDED_H200.read_text())
    assert {t["label"] for t in recorded["trials"]} <= set(labels)
    lacking = gpu_check.plan("gpu", {**have, "bitsandbytes": False})
    skipped = {c.label: c.skip for c in lacking if c.skip}
    assert set(skipped) == {"gpt/bf16/adam8bit", "llama/bf16/qlora:8"}
    assert all("bitsandbytes" in why for why in skipped.values())
    listing = gpu_check.gpu_plan_text(have)
    assert "llama-8b/bf16/lora:16+checkpoint" in listing and "41 trials" in listing
