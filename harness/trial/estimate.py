"""Predict a trial's peak memory without allocating it: the real training step on fake tensors.

The trial's own code builds the model, applies the strategies and runs warm-up and memory-window
steps exactly as training does, but under ``FakeTensorMode``: every tensor has a shape, dtype
and device and no storage, so a 7B-parameter model costs nothing to "train". ``MemTracker``
accounts the fake storages as it accounts real ones (and rounds CUDA blocks to 512 B), so the
prediction and the CPU measurement share one accounting.

What fake tensors lack (values read by a step or a constructor, libraries that take a fake
tensor for a trace, other ranks) is supplied by ``harness.trial.fake``.

Not predicted: ``adam8bit`` (its step is compiled code, which cannot run on fake tensors) and any
trial whose tensor *shapes* depend on values (``nonzero``, boolean masks). ``compile`` is
predicted eagerly, which is also what the memory window measures.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from harness.contract import OPTIMIZER_STATE_BYTES
from harness.meters.accounting import cuda_accounting, optimizer_state_bytes, storage_bytes
from harness.meters.memory import MemoryWindow
from harness.strategies import STRATEGIES, needs_process_group, parse_term
from harness.strategies.base import StrategyError
from harness.strategies.lora import NF4_BYTES_PER_PARAM, base_dtype, is_nf4
from harness.trial.config import TrialConfig
from harness.trial.distributed import Ranks
from harness.trial.fake import ValuesReadAsOne, fake_process_group, libraries_run_eagerly
from harness.trial.setup import build_setup
from harness.units import format_bytes
from harness.workloads import describe_dataset
from harness.workloads.tensors import Batch

UNPREDICTABLE = {"adam8bit": "its step is compiled code, which cannot run on fake tensors"}
HOST_FRACTION = 0.8  # a CPU trial may use at most this share of the RAM available


def estimate_peak(
    config: TrialConfig, device: torch.device, as_cuda: bool = False
) -> dict[str, Any]:
    """``predicted_peak_bytes`` and the predicted breakdown; ``{"unpredictable": why}`` when the
    step cannot run on fake tensors; ``{"refused": why}`` when a strategy cannot apply to the
    model (the trial would end before training with the same message).

    ``as_cuda``: run on ``device``'s kernels (the CPU) but account storages as CUDA allocates
    them, for a CUDA target predicted on a machine without a GPU. A multi-rank trial is predicted for rank 0, which holds the largest slice of each batch;
    every rank computes the same prediction, so all take the same feasibility decision.
    """
    names = {parse_term(term)[0] for term in config.strategy}
    for name in sorted(names & UNPREDICTABLE.keys()):
        return {"unpredictable": f"{name}: {UNPREDICTABLE[name]}"}
    ranks = Ranks(rank=0, size=config.world_size, launched=needs_process_group(config.strategy))
    try:
        # Real tensors: user data is loaded (and a tokenizer read) to learn the batch's shape.
        info = describe_dataset(
            config.dataset, config.dataset_options, config.python_path, config.seed
        )
        with (
            cuda_accounting() if as_cuda else contextlib.nullcontext(),
            fake_process_group(ranks),
            FakeTensorMode(allow_non_fake_inputs=True),
            ValuesReadAsOne(),
            contextlib.ExitStack() as stack,
        ):
            setup = build_setup(config, device, ranks, info, None)
            stack.enter_context(libraries_run_eagerly())  # now that the model's code is loaded

            def batch() -> Batch:
                return setup.to_device(info.example_batch(config.batch_size))

            setup.train_step(batch())  # one warm-up step: the optimizer state now exists
            staged = [batch() for _ in range(config.memory_steps)]
            window = MemoryWindow(
                device,
                setup.model,
                setup.optimizer,
                [t for staged_batch in staged for t in staged_batch.values()],
                allocator_counters=False,
            )
            with window:
                for staged_batch in staged:
                    setup.train_step(staged_batch, on_micro_batch=window.micro_batch_done)
            # This rank's parameters (frozen ones too) + a gradient for each trainable one +
            # the optimizer's persistent state.
            parameters = list(setup.model.parameters())
            model_state = (
                storage_bytes(parameters)
                + storage_bytes(p for p in parameters if p.requires_grad)
                + optimizer_state_bytes(setup.optimizer)
            )
            nf4_params = sum(p.numel() for p in parameters if is_nf4(p))
    except StrategyError as error:  # the trial cannot run either: it ends before training
        return {"refused": str(error)}
    except Exception as error:  # data-dependent code cannot run on fake tensors
        return {"unpredictable": f"{type(error).__name__}: {error}".splitlines()[0][:200]}
    assert window.reading is not None
    reading = window.reading.metrics()
    prediction = {"predicted_peak_bytes": reading.pop("peak_allocated_bytes")}
    prediction.update({f"predicted_{key}": value for key, value in reading.items()})
    prediction["num_params"] = float(setup.num_params)
    prediction["num_params_total"] = float(setup.num_params_total)
    prediction["num_params_nf4"] = float(nf4_params)
    prediction["predicted_model_state_bytes"] = model_state
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


def closed_form(config: TrialConfig, prediction: dict[str, float]) -> dict[str, float]:
    """Textbook cross-checks: model-state bytes from bytes per parameter, and (gpt) activations
    by Korthikanti et al. 2022, ``s*b*h*(34 + 5*a*s/h)`` per layer in 16-bit (full recomputation
    keeps ~``2*s*b*h``).

    Model state: each trainable parameter costs its weight and gradient (4 + 4 B in fp32) plus
    the optimizer's state; a frozen one (lora/qlora base) only its stored bytes: 2 B in bf16,
    and under qlora NF4's 4 bits plus one 8-bit scale per 64 values plus one fp32 scale per 256
    scales (Dettmers et al. 2023: 0.127 bit/param) = 0.5159 B/param.
    """
    num_params = prediction["num_params"]
    frozen = prediction.get("num_params_total", num_params) - num_params
    nf4 = prediction.get("num_params_nf4", 0.0)
    names = [parse_term(t) for t in config.strategy]
    optimizer = next(
        (n for n, _ in names if STRATEGIES[n].group == "optimizer"), config.optimizer["name"]
    )
    if optimizer == "sgd" and config.optimizer.get("momentum"):
        optimizer = "sgd_momentum"
    scale = 0.5 if any(n == "bf16_params" for n, _ in names) else 1.0
    if any(n == "fsdp" for n, _ in names):  # per rank: a 1/N shard of everything
        scale /= config.world_size
    state = OPTIMIZER_STATE_BYTES[optimizer]
    base_bytes = base_dtype(config.lora or {}, config.dtype).itemsize
    frozen_bytes = nf4 * NF4_BYTES_PER_PARAM + (frozen - nf4) * base_bytes
    out = {"closed_form_model_state_bytes": (num_params * (8 + state) + frozen_bytes) * scale}
    knobs = config.knobs
    if {"n_layer", "d_model", "n_head", "seq_len"} <= knobs.keys():
        s, b, h, a = knobs["seq_len"], config.batch_size, knobs["d_model"], knobs["n_head"]
        per_layer = (
            2 * s * b * h
            if any(n == "checkpoint" for n, _ in names)
            else s * b * h * (34 + 5 * a * s / h)
        )
        out["korthikanti_activation_bytes"] = math.ceil(per_layer * knobs["n_layer"])
    return out


def device_note(config: TrialConfig, as_cuda: bool) -> str:
    """Which device-specific choices the prediction made, so a reader can judge it."""
    foreach = bool(config.optimizer.get("foreach", False))
    choices = f"optimizer foreach={foreach} fused=False (fixed, as in training)"
    if as_cuda:
        return f"cuda target on CPU kernels (no GPU here): 512-B block rounding; {choices}"
    return choices


def prediction_device(name: str) -> tuple[torch.device, bool]:
    """The device predictions run on for target ``name``, and whether storages are accounted
    as CUDA allocates them: autograd's engine needs a real CUDA runtime even for fake CUDA
    tensors, so without a GPU CPU kernels run for a ``cuda`` target."""
    device = torch.device(name)
    as_cuda = device.type == "cuda" and not torch.cuda.is_available()
    return (torch.device("cpu") if as_cuda else device), as_cuda


def main(argv: list[str]) -> int:
    """``python -m harness.trial.estimate IN.json OUT.json``: estimate many trials in one process.

    IN holds ``{"device": "cpu"|"cuda", "configs": [TrialConfig dicts]}``; OUT gets one row per
    config: the prediction (or why there is none) and the closed-form cross-checks.
    """
    import json
    import time
    from pathlib import Path

    request = json.loads(Path(argv[0]).read_text())
    device, as_cuda = prediction_device(request["device"])
    rows = []
    for data in request["configs"]:
        config = TrialConfig.from_dict(data)
        started = time.perf_counter()
        prediction = estimate_peak(config, device, as_cuda)
        row = {"trial_key": config.trial_key, **prediction, "note": device_note(config, as_cuda)}
        if "num_params" in prediction:
            row.update(closed_form(config, prediction))
        row["estimate_seconds"] = time.perf_counter() - started
        rows.append(row)
        print(
            f"estimated {len(rows)}/{len(request['configs'])}: {config.model_size} "
            f"batch {config.batch_size} {config.dtype} {config.strategy_text} "
            f"({row['estimate_seconds']:.1f} s)",
            flush=True,
        )
    Path(argv[1]).write_text(json.dumps(rows))
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))
