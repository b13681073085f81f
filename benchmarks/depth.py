"""Answers in seconds (issue 48): a deep model's card estimate and plan from two shallow traces
(``harness.trial.depth``) against the same answers traced whole (``HARNESS_TRACE_WHOLE=1``),
measured in one run, fresh processes.

- the Llama-3.1-8B LoRA estimate (bf16, lora:16, 1 x 2048, an H100): target 10 s after imports
  (the row's own ``estimate_seconds``: the model, its trace and the replay; not Python's import
  of torch and transformers);
- ``harness plan experiments/llama8b_plan.yaml`` on three cards: target 120 s;
- ``harness fit`` of the same plan on 24/80/141 GiB: target 120 s.

Each carried figure is also compared with the whole trace's (they must be equal).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from benchmarks.estimator import LLAMA_8B_LORA
from benchmarks.figures import Figure, at_most
from harness.spec.grid import trial_configs
from harness.spec.load import parse_spec
from harness.trial.depth import TRACE_WHOLE

REPO = Path(__file__).resolve().parents[1]
PLAN = "experiments/llama8b_plan.yaml"
CARDS = "rtx-4090,a100-80gb,h100-80gb"
FIGURES = ("predicted_peak_bytes", "predicted_reserved_bytes", "predicted_device_bytes")


def environment(whole: bool) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != TRACE_WHOLE}
    if whole:
        env[TRACE_WHOLE] = "1"
    return env


def estimate(workdir: Path, whole: bool) -> tuple[float, dict]:
    """A fresh ``python -m harness.trial.estimate`` of the 8B LoRA for an H100: its own time
    after imports (``estimate_seconds``), and its row."""
    from harness.cuda.cards import CATALOGUE

    config = trial_configs(parse_spec(LLAMA_8B_LORA))[0]
    card = dataclasses.replace(config, card=CATALOGUE["h100-80gb"].to_dict())
    name = "whole" if whole else "carried"
    request, answer = workdir / f"{name}-in.json", workdir / f"{name}-out.json"
    request.write_text(json.dumps({"device": "cuda", "configs": [card.to_dict()]}))
    subprocess.run(
        [sys.executable, "-m", "harness.trial.estimate", str(request), str(answer)],
        check=True,
        stdout=subprocess.DEVNULL,
        env=environment(whole),
    )
    row = json.loads(answer.read_text())[0]
    return float(row["estimate_seconds"]), row


def command(arguments: list[str], whole: bool) -> float:
    """Wall time of a ``harness`` command run from the repository (``plan`` writes its front
    under ``results/plan/``, as a user's would)."""
    started = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "harness", *arguments],
        check=True,
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=environment(whole),
    )
    return time.perf_counter() - started


def run(log: Callable[[str], None]) -> list[Figure]:
    figures: list[Figure] = []
    with tempfile.TemporaryDirectory(prefix="harness-bench-depth-") as folder:
        workdir = Path(folder)
        carried_s, carried = estimate(workdir, whole=False)
        whole_s, whole = estimate(workdir, whole=True)
        equal = all(carried[f] == whole[f] for f in FIGURES)
        log(
            f"  llama-3.1-8b lora:16 on h100-80gb: {carried_s:.1f} s carried "
            f"({carried['note'].split('; ')[-1]}), {whole_s:.1f} s traced whole; figures "
            f"{'equal' if equal else 'DIFFER'}"
        )
        figures.append(
            at_most(
                "estimate_llama_8b_lora_card_seconds_after_imports",
                carried_s,
                10,
                "s",
                whole_trace_seconds=whole_s,
                figures_equal=equal,
                **{f: carried[f] for f in FIGURES},
            )
        )
        for name, arguments, target in (
            ("plan", ["plan", PLAN, "--card", CARDS, "--format", "csv"], 120),
            ("fit", ["fit", PLAN, "--budget", "24GiB,80GiB,141GiB", "--format", "csv"], 120),
        ):
            carried_s = command(arguments, False)
            whole_s = command(arguments, True)
            log(f"  {name} {PLAN}: {carried_s:.0f} s carried, {whole_s:.0f} s traced whole")
            figures.append(
                at_most(
                    f"{name}_llama8b_plan_seconds", carried_s, target, "s",
                    whole_trace_seconds=whole_s,
                )
            )  # fmt: skip
    return figures
