"""One trial, top to bottom: predict, set up, train, and report how it ended.

The estimate and the training loop are two users of the same ``Setup`` (``harness.trial.setup``);
this module is the one place that runs them in order, so neither imports the other:

1. the strategies' environment (allocator settings) before anything touches CUDA;
2. the prediction on fake tensors: a trial that cannot fit ends as ``infeasible``;
3. the device (one per rank under torchrun, which also joins the process group), the card's
   size emulated, the seed;
4. the dataset and the ``Setup``; then the training loop's phases and the evaluation.

Every way it can end becomes one ``TrialResult``: ``ok``; ``oom``, ``diverged`` or
``infeasible`` with what was measured so far. Any other exception propagates: the worker entry
point records it as ``crash``. Once a multi-rank trial's ranks have joined their group, any
failure (a crash too) is agreed on with the other ranks instead and raised as a
``GroupFailure`` carrying the trial's result (``harness.trial.distributed``): the rank that
failed may be the only one not waiting in a collective.
"""

from __future__ import annotations

import gc
import os
import random
import traceback
from pathlib import Path

import torch

from harness.meters.host import peak_rss_bytes
from harness.strategies.base import Strategy
from harness.strategies.memory_management import ALLOC_CONF_VARS, merge_conf
from harness.trial.config import TrialConfig
from harness.trial.device import device_name, emulate_card, resolve_device
from harness.trial.distributed import GroupFailure, Ranks
from harness.trial.estimate import estimate_peak, host_guard
from harness.trial.loop import Measurements, TrainingLoop
from harness.trial.prediction import Outcome
from harness.trial.result import Status, TrialFailure, TrialResult
from harness.trial.setup import build_setup
from harness.units import format_bytes
from harness.workloads import load_dataset


def run_trial(config: TrialConfig, output_dir: Path | None = None) -> TrialResult:
    """Run one trial in this process; ``output_dir`` gets its memory timeline, if any."""
    ranks = Ranks.from_env(config.strategy.layout)
    measured = Measurements()
    status, reason = Status.OK, ""
    try:
        train(config, ranks, measured, output_dir)
    except Exception as error:
        ending = how_it_ended(error)
        if ranks.in_group:
            raise group_failure(config, ranks, measured, error, ending) from error
        if ending is None:
            raise
        status, reason = ending
    if status is Status.OOM:
        # The failed step's frames (and the model and optimizer they held) went with the
        # exception; hand their memory back before the result is gathered.
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return measured.result(config.trial_key, status, reason, ranks)


def how_it_ended(error: Exception) -> tuple[Status, str] | None:
    """The status and reason an exception ends a trial with; None for a crash (a bug)."""
    if isinstance(error, TrialFailure):
        return error.status, error.reason
    if isinstance(error, torch.OutOfMemoryError):
        return Status.OOM, first_line(error) or "out of memory"
    # The CPU allocator's refusal is an allocation failure like CUDA's, not a crash. torch
    # raises no type of its own for it (2.14: a plain RuntimeError from c10's enforce in
    # alloc_cpu.cpp), so the allocator's own words are what tells it apart.
    if isinstance(error, RuntimeError) and "can't allocate memory" in str(error):
        return Status.OOM, first_line(error)[:300]
    return None


def group_failure(
    config: TrialConfig,
    ranks: Ranks,
    measured: Measurements,
    error: Exception,
    ending: tuple[Status, str] | None,
) -> GroupFailure:
    """The failure of a multi-rank trial as the ranks agree on it, with what was measured;
    ``ending`` is how ``error`` ends a trial, None for a crash (recorded as the worker does).

    Every rank holds the same combined measurements (they are gathered to all), so whichever
    rank failed first can report them; only host memory is each rank's own, and the worst of
    those that reported is kept. The result is built as for a process of its own (``Ranks()``):
    no collective, no leaving the group, either of which would wait for a stuck peer.
    """
    status, reason = ending or (Status.CRASH, first_line(f"{type(error).__name__}: {error}"))
    verdict = ranks.agree_on_failure(status, reason, float(peak_rss_bytes()))
    if ending is None and verdict.writes:  # the trial's crash: its traceback goes to the log
        traceback.print_exception(error)
    result = measured.result(config.trial_key, verdict.status, verdict.reason, Ranks())
    result.metrics["peak_rss_bytes"] = verdict.peak_rss_bytes
    return GroupFailure(result, verdict)


def train(
    config: TrialConfig, ranks: Ranks, measured: Measurements, output_dir: Path | None
) -> None:
    if config.allocator:  # the spec's allocator settings; strategies' settings merge in below
        for var in ALLOC_CONF_VARS:
            if var == "PYTORCH_CUDA_ALLOC_CONF" or var in os.environ:
                os.environ[var] = merge_conf(os.environ.get(var, ""), config.allocator)
    strategies = config.strategy.build()  # once: environment, prediction and training
    for strategy in strategies:
        os.environ.update(strategy.environment())  # must precede the first CUDA call
    target = ranks.local_device(resolve_device(config.device))
    # Recorded before the prediction: an infeasible trial names its hardware too.
    measured.info.update(
        device=str(target), device_name=device_name(target), torch_threads=torch.get_num_threads()
    )
    # Before joining the process group: a multi-rank estimate runs on a fake group of its own.
    with measured.clock("estimate_time_s"):
        predict(config, target, measured, strategies, ranks.rank)
    device = ranks.start(target)
    measured.info["device"] = str(device)
    emulate_card(device, config.device_memory_bytes, measured.outside_bytes)
    random.seed(config.seed)
    torch.manual_seed(config.seed)
    with measured.clock("setup_time_s", device):
        data = load_dataset(config.dataset, config.dataset_options, config.seed, config.python_path)
        setup = build_setup(config, device, ranks, data.info, data, strategies)
        if device.type == "cuda":  # what building left cached (dtype casts, quantization) is
            torch.cuda.empty_cache()  # not the training step's: the estimate does the same
    measured.info.update(setup.info)
    measured.metrics["num_params"] = float(setup.num_params)
    measured.metrics["num_params_total"] = float(setup.num_params_total)
    TrainingLoop(setup, data, measured, output_dir).run()


def predict(
    config: TrialConfig,
    device: torch.device,
    measured: Measurements,
    strategies: tuple[Strategy, ...] | None = None,
    rank: int = 0,
) -> None:
    """Predict the peak before training; a trial that cannot fit is not run (``infeasible``)."""
    prediction = estimate_peak(config, device, strategies=strategies)
    if prediction.outcome is Outcome.REFUSED:
        raise TrialFailure(Status.CRASH, prediction.reason)
    if prediction.outcome is Outcome.CANNOT_PREDICT:
        measured.info["prediction"] = prediction.reason
        return
    peak = prediction.peak_bytes
    assert peak is not None
    measured.metrics["predicted_peak_bytes"] = peak
    stage = config.strategy.layout.coordinates(rank).get("pp", 0)
    measured.own_prediction = prediction.stage_peaks[stage] if prediction.stage_peaks else peak
    if prediction.recomputation:  # checkpoint:auto / sac:auto: the plan chosen, and why
        measured.info["recomputation"] = prediction.recomputation
    speed = prediction.speed
    if speed is not None:  # the timed window compares (step_time_ratio) and derives mfu
        measured.metrics["predicted_step_time_ms"] = speed.step_time_ms
        measured.metrics["predicted_throughput"] = speed.throughput
        measured.metrics["predicted_mfu"] = speed.mfu
        measured.info["speed_device"] = speed.device
        if speed.unmodelled_ops:
            measured.info["speed_unmodelled_ops"] = speed.unmodelled_ops
    card = prediction.on_card
    if card is not None:  # a CUDA target: what the card holds, and what lives beside the allocator
        measured.metrics["predicted_reserved_bytes"] = card.reserved_bytes
        measured.metrics["predicted_device_bytes"] = card.device_bytes
        measured.outside_bytes = int(card.context_bytes + card.nccl_bytes)
        measured.info["prediction"] = card.note
    if config.run_infeasible:
        return
    budget = config.device_memory_bytes
    judged = card.device_bytes if card is not None else peak  # CUDA: what the card holds
    if budget is not None and judged > budget:
        what = "device bytes (reserved + context)" if card is not None else "peak"
        smallest = (
            " (the smallest reachable: every block recomputed)" if prediction.recomputation else ""
        )
        raise TrialFailure(
            Status.INFEASIBLE,
            f"predicted {what} {format_bytes(judged)}{smallest} exceeds device_memory "
            f"{format_bytes(budget)}",
        )
    reason = host_guard(peak, device)
    if reason:
        raise TrialFailure(Status.INFEASIBLE, reason)


def first_line(error: BaseException | str) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else ""
