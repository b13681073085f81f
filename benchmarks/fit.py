"""``harness fit`` against its targets: how long it takes over two shipped specs, and how many
predictions an answer needs.

Why these: "what is the biggest batch that fits?" is answered today by crashing a GPU until it
stops crashing; ``fit`` answers from predictions, so its cost is the number of predictions
times one prediction's cost. Plain bisection over 1..512 needs ~9 predictions per answer; the
search's curve-then-confirm needs ~4.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from pathlib import Path

from benchmarks.figures import Figure, at_most
from harness.spec import load_spec
from harness.sweep.fit import default_jobs, fit_grid

REPO = Path(__file__).resolve().parents[1]
GIB = 2**30
CASES = (
    # spec, budgets, target seconds
    ("experiments/gpt_memory.yaml", [64 * 2**20, 256 * 2**20, GIB], 120),
    ("experiments/llama8b_plan.yaml", [24 * GIB, 80 * GIB, 141 * GIB], 600),
)
BISECTION_PREDICTIONS = 9  # ceil(log2(512)): plain bisection over batch 1..512


def run(log: Callable[[str], None]) -> list[Figure]:
    figures: list[Figure] = []
    counts: list[float] = []
    for path, budgets, target in CASES:
        spec = load_spec(REPO / path)
        target_device = "cuda" if spec.device.startswith("cuda") else "cpu"
        started = time.perf_counter()
        frame = fit_grid(spec, target_device, budgets, jobs=default_jobs())
        seconds = time.perf_counter() - started
        name = Path(path).stem
        answers = frame["predictions"].dropna().tolist()
        counts += answers
        log(
            f"fit {path}: {len(frame)} answers in {seconds:.0f} s, "
            f"median {statistics.median(answers):g} predictions per answer"
        )
        figures.append(
            at_most(
                f"fit_{name}_seconds",
                seconds,
                target,
                "s",
                answers=len(frame),
                device=target_device,
                processes=default_jobs(),
            )
        )
    median = statistics.median(counts)
    figures.append(
        at_most(
            "fit_predictions_per_answer_median", median, 4, "predictions",
            plain_bisection=BISECTION_PREDICTIONS, ratio_to_bisection=median / BISECTION_PREDICTIONS,
        )
    )  # fmt: skip
    return figures
