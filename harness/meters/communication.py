"""How long a training step spends communicating: its collectives, read from PyTorch's profiler.

A multi-rank step's time is compute plus whatever of its collectives (FSDP's all-gathers, tensor
parallelism's all-reduces, a pipeline's sends and receives) does not overlap with compute. The
step time alone cannot tell the two apart, so one step, run after the timed window (the timed
steps stay unprofiled), is profiled and its collectives' durations summed:

- CPU (gloo): the backend records each collective on its worker thread (``gloo:all_reduce``,
  ``gloo:send``, ...): the wall time the collective took there, waiting for peers included
  (the autograd profiler, without Kineto: it starts in milliseconds).
- CUDA (NCCL): the NCCL kernels' device time (``ncclDevKernel_*``); their host-side records only
  time the launch.

Collectives that run concurrently are each counted in full, so the sum can exceed the part of
the step they made longer; it is what the step spent in communication, not what it lost to it.
The profiler's native layer prints start/stop lines on stderr, which would read as errors in a
trial log; they are silenced for the profiled step.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch

from harness.meters.timing import synchronize

HOST_PREFIXES = ("gloo:", "mpi:", "ucc:")  # the CPU backends' records of their collectives


@contextlib.contextmanager
def quiet_stderr() -> Iterator[None]:
    """File descriptor 2 to /dev/null meanwhile (native code writes there, not to sys.stderr)."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def collective_ms(step: Callable[[], Any], device: torch.device) -> tuple[float, Any]:
    """Milliseconds ``step`` spent in collectives, and what ``step`` returned."""
    if device.type == "cuda":
        return _nccl_kernels_ms(step, device)
    # The autograd profiler without Kineto: it sees gloo's worker-thread records too, and
    # starts in milliseconds where Kineto takes a second (it probes for GPUs first).
    profiler: Any = torch.autograd.profiler.profile(use_kineto=False)
    with quiet_stderr(), profiler:
        result = step()
    events = profiler.function_events or []
    total_us = sum(e.cpu_time_total for e in events if e.name.startswith(HOST_PREFIXES))
    return total_us / 1000, result


def _nccl_kernels_ms(step: Callable[[], Any], device: torch.device) -> tuple[float, Any]:
    from torch.profiler import ProfilerActivity, profile

    with quiet_stderr(), profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        result = step()
        synchronize(device)
    total_us = sum(
        event.device_time_total
        for event in p.events() or []
        if event.device_type.name == "CUDA" and "nccl" in event.name.lower()
    )
    return total_us / 1000, result
