"""Is the predicted step time right on this machine? (issue 31: validation on the CPU)

Sweeps the shipped experiments' own grids on this CPU, shortened to their measurement windows
(``BUDGET_STEPS`` steps, a 1 % held-out split): the digits CNNs (``digits_widths.yaml``: 3 widths x 2
batches x fp32/bf16), the 8-block GPTs (``gpt_memory.yaml`` without ``fsdp:2``, whose two ranks
would share these two cores: 2 sizes x 2 batches x 2 dtypes x none/checkpoint/accumulate/
adafactor) and the small Llama (``finetune_small.yaml``: none, checkpoint, sac, LoRA, QLoRA, with
and without checkpointing). Every trial records the step time predicted before it trained
(``predicted_step_time_ms``, the CPU's calibrated roofline) and its measured median
(``step_time_ms_p50``).

Figures: the Spearman rank correlation of predicted and measured step times over every
trial (target >= 0.85: does the prediction order configurations as they run?), the median
|predicted / measured - 1| (target <= 30 %) and the worst (reported), each also over the trials
the noise rule calls steady (``harness.analyse.noise``); and the calibration the predictions
were priced on.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pandas as pd
import yaml

from benchmarks.figures import Figure, at_least, at_most, reported
from harness.analyse.noise import noise_reason
from harness.results import load

ROOT = Path(__file__).resolve().parent.parent
BUDGET_STEPS = 16  # warm-up 2 + memory window 2 + timed 10, and a little beyond
SPEARMAN_TARGET = 0.85
MEDIAN_TARGET = 0.30
# experiment file -> strategies left out (and why: the docstring)
SPECS: dict[str, tuple[str, ...]] = {
    "digits_widths.yaml": (),
    "gpt_memory.yaml": ("fsdp:2",),
    "finetune_small.yaml": (),
}


def shortened(name: str, dropped: tuple[str, ...], folder: Path) -> Path:
    """The experiment as this benchmark runs it: its grid, a short budget, its own stores."""
    data = yaml.safe_load((ROOT / "experiments" / name).read_text())
    data["train"]["budget"] = {"steps": BUDGET_STEPS}
    data["measure"] = {**data.get("measure", {}), "timed_steps": 10, "timeline": False}
    data["data"] = {**data["data"], "test_fraction": 0.01}
    data["grid"]["strategy"] = [s for s in data["grid"]["strategy"] if s not in dropped]
    data["device"] = "cpu"
    data.pop("device_memory", None)
    path = folder / name
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def sweep(path: Path, folder: Path, echo: Callable[[str], None]) -> pd.DataFrame:
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "harness", "sweep", path.name],
        cwd=folder,
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"harness sweep {path.name} failed: {done.stderr.strip()[-300:]}")
    frame = load(yaml.safe_load(path.read_text())["name"], f"sqlite:///{folder}/results/mlflow.db")
    echo(f"  {path.name}: {len(frame)} trials in {time.perf_counter() - started:.0f} s")
    return frame


def spearman(frame: pd.DataFrame) -> float:
    return float(frame["predicted_step_time_ms"].rank().corr(frame["step_time_ms_p50"].rank()))


def summary(frame: pd.DataFrame) -> dict[str, float]:
    error = (frame["predicted_step_time_ms"] / frame["step_time_ms_p50"] - 1).abs()
    return {
        "trials": float(len(frame)),
        "spearman": spearman(frame),
        "median_abs_error": float(error.median()),
        "worst_abs_error": float(error.max()),
    }


def run(echo: Callable[[str], None]) -> list[Figure]:
    frames = []
    with tempfile.TemporaryDirectory(prefix="bench-step-time-") as name:
        folder = Path(name)
        for spec, dropped in SPECS.items():
            frame = sweep(shortened(spec, dropped, folder), folder, echo)
            frames.append(frame.assign(experiment=spec))
    trials = pd.concat(frames, ignore_index=True)
    trials = trials[trials["status"].eq("ok")]
    trials = trials[trials["predicted_step_time_ms"].notna() & trials["step_time_ms_p50"].notna()]
    steady = trials[[noise_reason(row) is None for _, row in trials.iterrows()]]
    every, calm = summary(trials), summary(steady) if len(steady) > 2 else {}
    ratio = trials["predicted_step_time_ms"] / trials["step_time_ms_p50"]
    table = trials.assign(ratio=ratio, noisy=[noise_reason(r) or "" for _, r in trials.iterrows()])
    columns = ["experiment", "model_size", "batch_size", "dtype", "strategy",
               "predicted_step_time_ms", "step_time_ms_p50", "ratio", "noisy"]  # fmt: skip
    for line in table[columns].to_string(index=False, float_format="{:.3g}".format).splitlines():
        echo(f"  {line}")
    calibration = calibration_figures()
    detail = {"every": every, "steady": calm, "calibration": calibration,
              "trials": json.loads(table[columns].to_json(orient="records"))}  # fmt: skip
    figures = [
        at_least("step time: Spearman rank correlation, predicted vs measured (CPU)",
                 every["spearman"], SPEARMAN_TARGET, "", **detail),
        at_most("step time: median |predicted/measured - 1| (CPU)",
                every["median_abs_error"], MEDIAN_TARGET, ""),
        reported("step time: worst |predicted/measured - 1| (CPU)", every["worst_abs_error"]),
        reported("step time: trials compared (noisy ones flagged)", every["trials"],
                 noisy=int(len(trials) - len(steady))),
    ]  # fmt: skip
    if calm:
        figures += [
            reported("step time: Spearman over the steady trials", calm["spearman"]),
            reported("step time: median |ratio - 1| over the steady trials",
                     calm["median_abs_error"]),
        ]  # fmt: skip
    return figures


def calibration_figures() -> dict[str, Any]:
    """The CPU roofline the predictions were priced on (the cached calibration)."""
    from harness.trial.calibrate import cpu_roofline

    roofline = cpu_roofline()
    return {
        "peak_flops": roofline.peak_flops,
        "matmul_efficiency": roofline.matmul_efficiency,
        "matmul_half_flops": roofline.matmul_half_flops,
        "bandwidth": roofline.bandwidth,
        "conv_efficiency": roofline.conv_efficiency,
        "host_overhead_s": roofline.host_overhead_s,
        "source": roofline.source,
    }


if __name__ == "__main__":
    for figure in run(print):
        print(figure.name, figure.value, figure.target, figure.met)
