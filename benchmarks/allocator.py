"""Truth beyond tensor accounting: what the CPU allocator itself saw in a memory window.

On CPU the measured peak and the prediction both come from tensor accounting (``MemTracker``),
so their agreement checks the wiring, not the memory. The allocator's own events
(``torch.profiler`` with ``profile_memory=True``: every allocation and free, scratch buffers
inside single ops included) are a second witness. For trials of each shipped experiment, in one
process: warm up, run the spec's memory window under tensor accounting, then as many identical
steps under the profiler; the allocator's peak is the window's starting bytes (tensor
accounting's baseline: parameters, gradients, optimizer state, staged batches) plus the highest
rise of the allocator's running total. The figure is the worst ``allocator peak / tracked peak``
per experiment, reported (a gap is memory the harness cannot see on CPU; on CUDA the allocator's
own counters give the peak, so there is none).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.figures import Figure, reported
from harness.meters.accounting import on_device
from harness.meters.memory import MemoryWindow
from harness.spec import load_spec, trial_configs
from harness.trial.config import TrialConfig
from harness.trial.distributed import Ranks
from harness.trial.setup import build_setup
from harness.workloads import load_dataset
from harness.workloads.tensors import batches

CPU = torch.device("cpu")
# Per experiment, which trials: single-process strategies the window measures eagerly.
EXPERIMENTS = {
    "experiments/digits_widths.yaml": lambda c: True,
    "experiments/gpt_memory.yaml": lambda c: (
        c.batch_size == 32 and c.strategy_text in ("none", "checkpoint", "accumulate:4")
    ),
    "experiments/hf_llama.yaml": lambda c: True,
    "experiments/timm_vision.yaml": lambda c: True,
}


def allocator_rise(lead_in: Callable[[], None], steps: Callable[[], None]) -> int:
    """The highest rise of the CPU allocator's running total while ``steps`` run.

    The allocator reports a free only for memory it saw allocated while profiling, so a
    ``lead_in`` step runs under the profiler first: the gradients the measured steps free
    (``zero_grad``) were then allocated in view, and their frees count.
    """
    activities = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=activities, profile_memory=True) as profiler:
        lead_in()
        start = time.time_ns()  # the profiler's records are stamped in Unix nanoseconds
        steps()
    # The raw allocation records (the summarised events attach allocations to their ops).
    events = sorted(
        (event.start_ns(), event.nbytes())
        for event in profiler.profiler.kineto_results.events()
        if event.name() == "[memory]" and event.device_type() == torch._C._autograd.DeviceType.CPU
    )
    running, at_start, highest = 0, None, 0
    for stamp, delta in events:
        if at_start is None and stamp >= start:
            at_start = highest = running
        running += delta
        if at_start is not None:
            highest = max(highest, running)
    return highest - (at_start if at_start is not None else running)


def measure(config: TrialConfig) -> dict[str, Any]:
    random.seed(config.seed)
    torch.manual_seed(config.seed)
    data = load_dataset(config.dataset, config.dataset_options, config.seed, config.python_path)
    setup = build_setup(config, CPU, Ranks(), data.info, data)
    stream = batches(data.train, config.batch_size, config.seed)
    for _ in range(config.warmup_steps):
        setup.train_step(setup.to_device(next(stream)))
    staged = [setup.to_device(next(stream)) for _ in range(config.memory_steps)]
    window = MemoryWindow(
        CPU, setup.model, setup.optimizer, [t for b in staged for t in b.values()]
    )
    with window:
        baseline = on_device(window.tracker.get_tracker_snapshot(), CPU).get("Total", 0)
        for batch in staged:
            setup.train_step(batch, on_micro_batch=window.micro_batch_done)
    assert window.reading is not None
    tracked = window.reading.peak_allocated_bytes
    del staged
    lead_in, *again = [setup.to_device(next(stream)) for _ in range(config.memory_steps + 1)]

    def steps() -> None:
        for batch in again:
            setup.train_step(batch)

    allocator = baseline + allocator_rise(lambda: setup.train_step(lead_in), steps)
    return {
        "trial": f"{config.model_size} b{config.batch_size} {config.dtype} {config.strategy_text}",
        "tracked_peak_bytes": tracked,
        "allocator_peak_bytes": allocator,
        "ratio": allocator / tracked,
    }


def run(log: Callable[[str], None]) -> list[Figure]:
    figures = []
    for path, wanted in EXPERIMENTS.items():
        configs = [c for c in trial_configs(load_spec(path)) if wanted(c)]
        rows = []
        for config in configs:
            row = measure(config)
            rows.append(row)
            log(
                f"  {path} {row['trial']}: allocator {row['allocator_peak_bytes']:,} B / "
                f"tracked {row['tracked_peak_bytes']:,} B = {row['ratio']:.4f}"
            )
        worst = max(rows, key=lambda r: r["ratio"])
        figures.append(
            reported(
                f"allocator_vs_tracked_peak[{path.split('/')[-1].removesuffix('.yaml')}]",
                worst["ratio"],
                note="worst CPU-allocator peak / tensor-accounting peak over the trials",
                worst_trial=worst["trial"],
                trials=rows,
            )
        )
    return figures
