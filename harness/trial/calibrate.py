"""The CPU as a card: its roofline measured once per host by short microbenchmarks, cached.

A CPU has no datasheet a step-time prediction can trust (vector units, cache sizes, whether
bf16 runs natively all vary), so its ``Roofline`` is measured, with the trial's own thread
count, in about ten seconds:

- matmul: square ``mm`` over growing sizes per dtype (fp32, bf16, fp16); the device time of
  each (its wall time less a 1x1 ``mm``'s, the dispatch) fitted to the roofline's saturating
  curve ``(flops + half) / rate``: the rate is the dtype's peak (calibrated, so its
  efficiency is 1), ``half`` its ``matmul_half_flops``;
- bandwidth: ``add(a, b, out=c)`` over growing sizes, fitted the same way (bytes / rate);
- convolutions: 3x3 convolutions' forward and backward over small images and growing channel
  counts, fitted the same way: their rate as a share of the matmul rate and their cost per
  call (oneDNN's convolutions on small images reach far less of the cores than its matmuls);
- attention: causal ``scaled_dot_product_attention`` forward and backward over growing
  sequences, fitted the same way per head dim (16, 32, 64, 128) and over all of them (the
  CPU's flash kernels reach a small share of its matmul rate, smallest at small head dims: a
  50x difference in bf16 on an AMD EPYC);
- host overhead: a tiny MLP's real training step (forward, backward, SGD) timed over many
  steps, divided by the ops it dispatches: Python, ``nn.Module`` calls, autograd and the
  dispatcher per op, as a trial's step pays them.

The result is cached under ``$XDG_CACHE_HOME/harness/calibration`` (``~/.cache``), keyed by
the CPU's name, core count, thread count and torch version; a lock makes a second trial
that needs it wait for the first's measurement instead of disturbing it.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import statistics
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from harness.compat.internals import TORCH_VERSION
from harness.meters.op_costs import OpCostCounter
from harness.meters.roofline import ATTENTIONS, Roofline
from harness.trial.hardware import cpu_name

VERSION = 5  # bump when what is measured changes: old caches are then ignored
MATMUL_SIZES = (16, 32, 64, 128, 256, 384, 512, 768, 1024)
CONV_SHAPES = ((8, 8), (8, 32), (16, 8), (16, 32), (16, 64))  # (image side, channels)
# Causal self-attention as small models run it, fitted per head dim (the CPU's bf16 backward
# runs at a twentieth of its rate at head dim 16 than at 64: docs/accuracy.md): per head dim,
# (batch x heads, sequence) growing.
ATTENTION_HEAD_DIMS = (16, 32, 64, 128)
ATTENTION_SIZES = ((16, 64), (32, 128), (32, 256))
COPY_ELEMENTS = tuple(2**k for k in range(12, 24, 2))  # 16 KiB .. 32 MiB per fp32 operand
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
SLOW_CALL_S = 0.05  # stop growing a benchmark once one call takes this long
ENOUGH_S = 0.02  # repeat a call until this much time is measured (best of the repeats)


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME", "").strip() or Path.home() / ".cache"
    return Path(base) / "harness" / "calibration"


def host_key(threads: int) -> str:
    identity = f"{cpu_name()}|{os.cpu_count()}|{threads}|{TORCH_VERSION}|{VERSION}"
    return hashlib.sha256(identity.encode()).hexdigest()[:16]


def cpu_roofline(threads: int | None = None) -> Roofline:
    """This host's roofline at ``threads`` (default: torch's current count), measured once
    and cached (module docstring)."""
    threads = threads or torch.get_num_threads()
    path = cache_dir() / f"cpu-{host_key(threads)}.json"
    with contextlib.suppress(OSError, ValueError, TypeError, KeyError):
        return Roofline.from_dict(json.loads(path.read_text()))
    path.parent.mkdir(parents=True, exist_ok=True)
    with _locked(path.with_suffix(".lock")):
        with contextlib.suppress(OSError, ValueError, TypeError, KeyError):
            return Roofline.from_dict(json.loads(path.read_text()))  # measured meanwhile
        roofline = measure(threads)
        partial = path.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(json.dumps(roofline.to_dict(), indent=1))
        partial.replace(path)
    return roofline


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    with path.open("w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _best_seconds(call: Callable[[], object]) -> float:
    """The fastest of enough repeats of ``call`` (the least disturbed by anything else)."""
    call()  # warm: first-call allocations, thread pool start
    times: list[float] = []
    while sum(times) < ENOUGH_S or len(times) < 3:
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
        if len(times) >= 200:
            break
    return min(times)


def fit_saturating(work: list[float], seconds: list[float]) -> tuple[float, float]:
    """``(rate, half)`` of ``seconds = (work + half) / rate``, least squares on relative error
    (small calls count as much as large ones); ``half`` is never negative."""
    weights = [1 / (s * s) for s in seconds]
    sw = sum(weights)
    mean_w = sum(w * x for w, x in zip(weights, work, strict=True)) / sw
    mean_s = sum(w * s for w, s in zip(weights, seconds, strict=True)) / sw
    var = sum(w * (x - mean_w) ** 2 for w, x in zip(weights, work, strict=True))
    cov = sum(
        w * (x - mean_w) * (s - mean_s) for w, x, s in zip(weights, work, seconds, strict=True)
    )
    slope = cov / var if var > 0 else mean_s / mean_w
    if slope <= 0:  # noise swamped the trend: the best single rate observed
        rate = max(x / s for x, s in zip(work, seconds, strict=True))
        return rate, 0.0
    intercept = mean_s - slope * mean_w
    return 1 / slope, max(0.0, intercept / slope)


def _matmul(dtype: torch.dtype, dispatch_s: float) -> tuple[float, float, list[list[float]]]:
    work, seconds, raw = [], [], []
    for n in MATMUL_SIZES:
        a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
        out = torch.empty(n, n, dtype=dtype)
        took = _best_seconds(lambda a=a, b=b, out=out: torch.mm(a, b, out=out))
        flops = 2.0 * n**3
        work.append(flops)
        seconds.append(max(took - dispatch_s, took * 0.1))
        raw.append([n, took])
        if took > SLOW_CALL_S and len(work) >= 4:
            break
    rate, half = fit_saturating(work, seconds)
    return rate, half, raw


def _bandwidth(dispatch_s: float) -> tuple[float, list[list[float]]]:
    work, seconds, raw = [], [], []
    for n in COPY_ELEMENTS:
        a, b, c = torch.randn(n), torch.randn(n), torch.empty(n)
        took = _best_seconds(lambda a=a, b=b, c=c: torch.add(a, b, out=c))
        work.append(3.0 * 4 * n)
        seconds.append(max(took - dispatch_s, took * 0.1))
        raw.append([n, took])
    rate, _ = fit_saturating(work, seconds)
    return rate, raw


def _conv(
    dtype: torch.dtype, peak: float, overhead_s: float
) -> tuple[float, float, list[list[float]]]:
    """The share of ``peak`` (the matmul rate) a convolution's forward and backward reach, and
    the FLOPs each call costs on top of its own (the saturating fit's ``half``, per call: a
    step of two kernels): 3x3 convolutions over 8x8 and 16x16 images, batch 16, growing
    channels, their FLOPs counted as the step prediction counts them."""
    work, seconds, raw = [], [], []
    for side, channels in CONV_SHAPES:
        layer = torch.nn.Conv2d(channels, channels, 3, padding=1).to(dtype)
        x = torch.randn(16, channels, side, side).to(dtype).requires_grad_()

        def step(layer: torch.nn.Module = layer, x: torch.Tensor = x) -> None:
            layer(x).sum().backward()

        with OpCostCounter() as counter:
            step()
        took = _best_seconds(step)
        work.append(counter.costs.flops)
        # less the dispatches the step model charges every op apart (``overhead_s``)
        seconds.append(max(took - len(counter.costs.calls) * overhead_s, took * 0.1))
        raw.append([side, channels, took])
        if took > SLOW_CALL_S and len(work) >= 3:
            break
    rate, half = fit_saturating(work, seconds)
    return min(1.0, rate / peak), half / 2, raw


def _attention(
    dtype: torch.dtype, peak: float, overhead_s: float
) -> tuple[dict[str, float], dict[str, float], list[list[float]]]:
    """The share of ``peak`` a fused attention's forward and, apart, its backward reach, and
    the FLOPs each call costs on top of its own, per head dim (keys ``forward_d64``,
    ``backward_d16``, ...) and over all of them (``forward``, ``backward``), as ``_conv``
    measures convolutions: causal ``scaled_dot_product_attention`` over growing sequences at
    each of ``ATTENTION_HEAD_DIMS``, FLOPs counted as the step prediction counts them. Apart,
    because the CPU's backward kernel runs several times slower per FLOP than its forward, and
    slower still at small head dims."""
    work: dict[str, list[float]] = {}
    seconds: dict[str, list[float]] = {}
    raw = []
    for dim in ATTENTION_HEAD_DIMS:
        for heads, length in ATTENTION_SIZES:
            shape = (1, heads, length, dim)
            q, k, v = (torch.randn(shape).to(dtype).requires_grad_() for _ in "qkv")

            def forward(q: torch.Tensor = q, k: torch.Tensor = k, v: torch.Tensor = v) -> Any:
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

            def step() -> None:
                forward().sum().backward()

            with OpCostCounter() as counter:
                step()
            attention = [c for c in counter.costs.calls if c.name in ATTENTIONS]
            ahead = _best_seconds(forward)
            took = _best_seconds(step)
            for direction, call, spent in (
                ("forward", attention[0], ahead),
                ("backward", attention[-1], took - ahead),
            ):
                for key in (direction, f"{direction}_d{dim}"):
                    work.setdefault(key, []).append(call.flops)
                    seconds.setdefault(key, []).append(max(spent - overhead_s, spent * 0.1))
            raw.append([heads, length, dim, ahead, took])
            if took > SLOW_CALL_S:
                break
    efficiency, halves = {}, {}
    for key in work:
        rate, half = fit_saturating(work[key], seconds[key])
        efficiency[key], halves[key] = min(1.0, rate / peak), half
    return efficiency, halves, raw


def _host_overhead() -> tuple[float, int]:
    """Seconds per dispatched op of a tiny model's training step, and the ops per step."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, foreach=True)
    x, y = torch.randn(2, 4), torch.tensor([0, 1])

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()

    step()
    with OpCostCounter() as counter:
        step()
    ops = len(counter.costs.calls)
    took = statistics.median(_best_seconds(step) for _ in range(5))
    return took / ops, ops


def measure(threads: int) -> Roofline:
    """Measure this host's roofline at ``threads`` (module docstring); ~10 s."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.no_grad():
            tiny = torch.ones(1, 1)
            dispatch_s = _best_seconds(lambda: torch.mm(tiny, tiny))
            peaks, halves, raw = {}, {}, {}
            for name, dtype in DTYPES.items():
                peaks[name], halves[name], raw[name] = _matmul(dtype, dispatch_s)
            bandwidth, raw["add"] = _bandwidth(dispatch_s)
        overhead, ops = _host_overhead()
        conv, conv_half, attention, attention_half = {}, {}, {}, {}
        for name, dtype in DTYPES.items():
            conv[name], conv_half[name], raw[f"conv_{name}"] = _conv(dtype, peaks[name], overhead)
            share, half, raw[f"attention_{name}"] = _attention(dtype, peaks[name], overhead)
            for key in share:  # forward -> bf16, backward_d16 -> bf16_backward_d16
                entry = name + key.removeprefix("forward").replace("backward", "_backward")
                attention[entry], attention_half[entry] = share[key], half[key]
    finally:
        torch.set_num_threads(previous)
    return Roofline(
        name="cpu",
        peak_flops=peaks,
        matmul_efficiency=1.0,
        matmul_half_flops=halves,
        bandwidth=bandwidth,
        conv_efficiency=conv,
        conv_half_flops=conv_half,
        attention_efficiency=attention,
        attention_half_flops=attention_half,
        host_overhead_s=overhead,
        launch_gap_s=0.0,
        overlapped=False,
        source=f"calibrated on {cpu_name()} with {threads} thread(s), torch {TORCH_VERSION}",
        measured={
            "threads": threads,
            "dispatch_s": dispatch_s,
            "tiny_step_ops": ops,
            "mm_seconds_by_size": {k: raw[k] for k in DTYPES},
            "add_seconds_by_elements": raw["add"],
            "conv_seconds_by_side_and_channels": {k: raw[f"conv_{k}"] for k in DTYPES},
            "attention_seconds_by_heads_length_dim": {k: raw[f"attention_{k}"] for k in DTYPES},
        },
    )
