"""Predict a trial's peak memory without allocating it: the real training step on fake tensors.

The trial's own code builds the model, applies the strategies and runs warm-up and memory-window
steps exactly as training does, but under ``FakeTensorMode``: every tensor has a shape, dtype
and device and no storage, so a 7B-parameter model costs nothing to "train". ``MemTracker``
accounts the fake storages as it accounts real ones (and rounds CUDA blocks to 512 B), so the
prediction and the CPU measurement share one accounting.

Not predicted (``None``): ``ddp``/``fsdp`` (need a process group), ``adam8bit`` (compiled
kernels), and any trial whose code reads a tensor's value (data-dependent control flow).
``compile`` is predicted eagerly, which is also what the memory window measures.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from harness.meters.memory import MemoryWindow, allocated_bytes, optimizer_state_bytes
from harness.strategies import build_strategies, parse_term
from harness.trial.config import TrialConfig
from harness.trial.distributed import Ranks
from harness.units import format_bytes
from harness.workloads import describe_dataset

UNPREDICTABLE = {"ddp", "fsdp", "adam8bit"}
EAGER_ONLY = {"compile"}
HOST_FRACTION = 0.8  # a CPU trial may use at most this share of the RAM available


def estimate_peak(config: TrialConfig, device: torch.device) -> dict[str, Any] | None:
    """``predicted_peak_bytes`` and the predicted breakdown, or ``None`` if not predictable."""
    names = {parse_term(term)[0] for term in config.strategy}
    if names & UNPREDICTABLE:
        return None
    from harness.trial.loop import Trial

    trial = Trial(config)
    trial.strategies = [s for s in build_strategies(config.strategy) if s.name not in EAGER_ONLY]
    trial.ranks = Ranks()
    trial.device = device
    try:
        with FakeTensorMode(allow_non_fake_inputs=True):
            info = describe_dataset(config.dataset, trial.data_options())
            trial.build(info, None)
            shape = (config.batch_size, *info.input_shape)

            def batch() -> tuple[torch.Tensor, torch.Tensor]:
                if info.tokens_per_sample > 1:
                    x = torch.randint(0, info.num_classes, shape)
                    y = torch.randint(0, info.num_classes, shape)
                else:
                    x = torch.randn(shape)
                    y = torch.randint(0, info.num_classes, (config.batch_size,))
                return trial.to_device((x, y))

            trial.train_step(*batch())  # one warm-up step: the optimizer state now exists
            staged = [batch() for _ in range(config.memory_steps)]
            window = MemoryWindow(
                device,
                trial.model,
                trial.optimizer,
                [t for b in staged for t in b],
                allocator_counters=False,
            )
            trial.after_micro_batch = window.step_done
            with window:
                for x, y in staged:
                    trial.train_step(x, y)
    except Exception as error:  # data-dependent code cannot run on fake tensors
        return {"unpredictable": f"{type(error).__name__}: {error}".splitlines()[0][:200]}
    assert window.reading is not None
    reading = window.reading.metrics()
    prediction = {"predicted_peak_bytes": reading.pop("peak_allocated_bytes")}
    prediction.update({f"predicted_{key}": value for key, value in reading.items()})
    prediction["num_params"] = trial.metrics["num_params"]
    # Parameters + one gradient each + the optimizer's persistent state, whatever the moment.
    param_bytes = sum(
        allocated_bytes(p.untyped_storage().nbytes(), device) for p in trial.model.parameters()
    )
    prediction["predicted_model_state_bytes"] = 2 * param_bytes + optimizer_state_bytes(
        trial.optimizer
    )
    return prediction


def available_host_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def host_guard(predicted_peak: float, device: torch.device) -> str | None:
    """Why a CPU trial must not run (it would swap or be OOM-killed), or ``None``."""
    if device.type != "cpu":
        return None
    available = available_host_bytes()
    if available is None or predicted_peak <= HOST_FRACTION * available:
        return None
    return (
        f"predicted peak {format_bytes(predicted_peak)} exceeds {HOST_FRACTION:.0%} of the "
        f"{format_bytes(available)} of host RAM available"
    )


def closed_form(config: TrialConfig, num_params: float, knobs: dict[str, int]) -> dict[str, float]:
    """Textbook cross-checks: model-state bytes from bytes per parameter, and (gpt) activations
    by Korthikanti et al. 2022, ``s*b*h*(34 + 5*a*s/h)`` per layer in 16-bit (full recomputation
    keeps ~``2*s*b*h``)."""
    names = [parse_term(t) for t in config.strategy]
    optimizer = next(
        (n for n, _ in names if n in ("sgd", "sgd_momentum", "adamw", "adafactor", "adam8bit")),
        config.optimizer["name"],
    )
    if optimizer == "sgd" and config.optimizer.get("momentum"):
        optimizer = "sgd_momentum"
    state = {"adam": 8, "adamw": 8, "sgd": 0, "sgd_momentum": 4, "adam8bit": 2, "adafactor": 0}
    scale = 0.5 if any(n == "bf16_params" for n, _ in names) else 1.0
    out = {"closed_form_model_state_bytes": num_params * (8 + state[optimizer]) * scale}
    if {"n_layer", "d_model", "n_head", "seq_len"} <= knobs.keys():
        s, b, h, a = knobs["seq_len"], config.batch_size, knobs["d_model"], knobs["n_head"]
        per_layer = (
            2 * s * b * h
            if any(n == "checkpoint" for n, _ in names)
            else s * b * h * (34 + 5 * a * s / h)
        )
        out["korthikanti_activation_bytes"] = math.ceil(per_layer * knobs["n_layer"])
    return out


def main(argv: list[str]) -> int:
    """``python -m harness.trial.estimate IN.json OUT.json``: estimate many trials in one process.

    IN holds ``{"device": "cpu"|"cuda", "configs": [TrialConfig dicts]}``; OUT gets one row per
    config: the prediction (or why there is none) and the closed-form cross-checks.
    """
    import json
    import time
    from pathlib import Path

    from harness.workloads import resolve_knobs

    request = json.loads(Path(argv[0]).read_text())
    device = torch.device(request["device"])
    note = ""
    if device.type == "cuda" and not torch.cuda.is_available():
        # Autograd's engine needs a real CUDA runtime even for fake CUDA tensors.
        device, note = torch.device("cpu"), "cuda predicted with CPU kernels (no GPU here)"
    rows = []
    for data in request["configs"]:
        config = TrialConfig.from_dict(data)
        started = time.perf_counter()
        prediction = estimate_peak(config, device) or {"unpredictable": "ddp/fsdp/adam8bit"}
        row = {"trial_key": config.trial_key, **prediction, "note": note}
        if "num_params" in prediction:
            knobs = resolve_knobs(config.model_family, config.model_knobs)
            row.update(closed_form(config, prediction["num_params"], knobs))
        row["estimate_seconds"] = time.perf_counter() - started
        rows.append(row)
        print(f"estimated {len(rows)}/{len(request['configs'])}", flush=True)
    Path(argv[1]).write_text(json.dumps(rows))
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))
