"""A training step's time on a device, from its ops' work (``harness.meters.op_costs``).

Each op is priced by a roofline: the larger of its compute time (FLOPs at the achievable
matmul rate for its dtype) and its memory time (bytes at the achievable bandwidth). A matmul
that is too small to fill the device runs below that rate: it is priced as if it had
``matmul_half_flops`` more FLOPs to do, so one of exactly that size runs at half the rate
(the saturating curve a matmul benchmark over sizes traces). Every op that launches a kernel
also costs the host its dispatch (``host_overhead_s``: Python, the dispatcher, the launch).

- On a GPU the host runs ahead of the device: the step takes the longer of the device's
  kernels (plus ``launch_gap_s`` between consecutive kernels) and the host's dispatches.
- On a CPU the host is the device: the two add up.

Communication between ranks is priced on ``link_bandwidth`` (the bytes one rank sends, as ring
algorithms move them: ``op_costs.collective_traffic``); on a card it overlaps the kernels but for
the longest collective, on a CPU it adds; named as not modelled where the device has no link. What the model ignores: kernel fusion (``compile``), data
loading (a trial's batches are staged before the timed window), caches on a CPU beyond the
calibrated curve, clock boost and throttling, stragglers.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from harness.meters.op_costs import COLLECTIVE, FLOAT8, FLOPS, OpCall, StepCosts

CONVOLUTIONS = {"convolution", "convolution_backward", "_convolution", "cudnn_convolution",
                "_slow_conv2d_forward", "convolution_overrideable"}  # fmt: skip
# Fused attention kernels, each direction: priced at their own share of the matmul rate.
ATTENTIONS = {
    f"{name}{direction}"
    for name in ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
                 "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
                 "_flash_attention", "_efficient_attention")
    for direction in ("", "_backward", "_forward")
}  # fmt: skip
# The op dtypes' names (torch's) as the peak tables name them.
_PEAK_KEY = {
    "float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "float64": "fp64",
    **{str(dtype).removeprefix("torch."): "fp8" for dtype in FLOAT8},
}  # fmt: skip


@dataclass(frozen=True)
class Roofline:
    """What a device does per second, as the step-time prediction prices ops."""

    name: str  # the card's catalogue name, or "cpu"
    peak_flops: dict[str, float]  # FLOP/s per dtype (fp32, bf16, ...): MFU's denominator
    matmul_efficiency: float  # the fraction of peak a large matmul reaches
    matmul_half_flops: dict[str, float]  # per dtype: a matmul of this many FLOPs runs at half
    bandwidth: float  # bytes/s a large copy reaches
    # Per dtype: the share of the matmul rate convolutions reach (their own kernels: cuDNN,
    # oneDNN); 1 where not measured.
    conv_efficiency: dict[str, float] = field(default_factory=dict)
    # Per dtype: FLOPs a convolution call costs on top of its own (set-up per call, too few
    # tiles), like ``matmul_half_flops``; 0 where not measured.
    conv_half_flops: dict[str, float] = field(default_factory=dict)
    # The same two for fused attention, per dtype and, under ``<dtype>_backward``, for its
    # backward (the CPU's flash kernels reach a small share of its matmul rate, least in
    # bf16 and backward); 1 and the matmul's where not measured (a card's).
    attention_efficiency: dict[str, float] = field(default_factory=dict)
    attention_half_flops: dict[str, float] = field(default_factory=dict)
    host_overhead_s: float = 0.0  # per op that launches a kernel: the host's dispatch
    launch_gap_s: float = 0.0  # per kernel on the device (0 on a CPU)
    overlapped: bool = False  # the host runs ahead of the device (a GPU), else the two add
    link_bandwidth: float | None = None  # bytes/s between ranks; None: not modelled
    source: str = ""  # where the figures come from
    measured: dict[str, Any] = field(default_factory=dict)  # a calibration's raw figures

    def peak(self, dtype: str) -> float:
        """The peak FLOP/s for an op dtype (torch's name) or a trial dtype (fp32, bf16, ...):
        fp32's for anything without one of its own (integer ops, NF4 codes), else the highest
        given (a user's card may list one dtype only)."""
        key = _PEAK_KEY.get(dtype, dtype)
        return (
            self.peak_flops.get(key) or self.peak_flops.get("fp32") or max(self.peak_flops.values())
        )

    def half(self, dtype: str) -> float:
        """``matmul_half_flops`` for ``dtype`` (fp32's where it has none)."""
        key = _PEAK_KEY.get(dtype, dtype)
        return self.matmul_half_flops.get(key, self.matmul_half_flops.get("fp32", 0.0))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Roofline:
        return cls(**data)


@dataclass(frozen=True)
class StepTime:
    """One step's predicted time and what it is made of, in seconds."""

    seconds: float
    device_s: float  # the kernels (compute- or memory-bound, whichever is longer per op)
    host_s: float  # the host's dispatches
    compute_bound_s: float  # the share of device_s of ops priced by their FLOPs
    collective_s: float  # all of it; what shows in ``seconds`` is the part not overlapped
    flops: float  # per step, recomputation included
    model_flops: float  # per step, without recomputation
    unmodelled: tuple[str, ...]  # ops no rule covered (priced as memory traffic)
    collectives_unpriced: bool  # collectives ran but the device has no link bandwidth
    flops_dtype: str = ""  # the op dtype most of the model FLOPs ran in ("": none ran)

    def mfu(self, roofline: Roofline, dtype: str) -> float:
        """Model FLOPs per second over the device's peak for the dtype most of them ran in
        (a bf16 model under the fp32 axis runs its matmuls at the bf16 peak), else ``dtype``."""
        if not self.seconds:
            return 0.0
        return self.model_flops / self.seconds / roofline.peak(self.flops_dtype or dtype)


def attention_key(roofline: Roofline, key: str, head_dim: int) -> str:
    """The calibrated entry for fused attention of ``key`` (``bf16``, ``bf16_backward``) at
    ``head_dim``: ``<key>_d<D>`` for the calibrated head dim nearest it (in ratio), else ``key``
    (a card's, which are not per head dim). A CPU's flash kernels run 5-15x slower per FLOP at
    head dim 16 than at 64, so one rate per dtype cannot price both."""
    prefix = f"{key}_d"
    dims = [
        int(name[len(prefix) :])
        for name in roofline.attention_efficiency
        if name.startswith(prefix) and name[len(prefix) :].isdigit()
    ]
    if not dims or head_dim <= 0:
        return key
    nearest = min(dims, key=lambda dim: abs(math.log(dim / head_dim)))
    return f"{prefix}{nearest}"


def op_seconds(call: OpCall, roofline: Roofline) -> tuple[float, bool]:
    """The device time of one op, and whether its FLOPs (not its bytes) set it."""
    memory = call.bytes / roofline.bandwidth
    if call.rule != FLOPS or call.flops <= 0:
        return memory, False
    rate = roofline.peak(call.dtype) * roofline.matmul_efficiency
    half = roofline.half(call.dtype)
    key = _PEAK_KEY.get(call.dtype, call.dtype)
    if call.name in CONVOLUTIONS:
        rate *= roofline.conv_efficiency.get(key, 1.0)
        half = roofline.conv_half_flops.get(key, half)
    elif call.name in ATTENTIONS:
        key += "_backward" if call.name.endswith("_backward") else ""
        key = attention_key(roofline, key, call.head_dim)
        rate *= roofline.attention_efficiency.get(key, 1.0)
        half = roofline.attention_half_flops.get(key, half)
    compute = (call.flops + half) / rate
    return (compute, True) if compute >= memory else (memory, False)


def step_time(costs: StepCosts, roofline: Roofline) -> StepTime:
    """The predicted time of one step of ``costs`` on ``roofline`` (module docstring)."""
    device = compute_bound = collective = longest = 0.0
    by_dtype: dict[str, float] = {}
    kernels = 0
    unpriced = False
    for call in costs.calls:
        if call.rule == COLLECTIVE:
            if roofline.link_bandwidth:
                seconds = call.bytes / roofline.link_bandwidth
                collective += seconds
                longest = max(longest, seconds)
            elif call.bytes:
                unpriced = True
            continue
        if call.flops > 0 and not call.recompute:
            by_dtype[call.dtype] = by_dtype.get(call.dtype, 0.0) + call.flops
        seconds, by_flops = op_seconds(call, roofline)
        device += seconds
        compute_bound += seconds if by_flops else 0.0
        kernels += 1
    steps = costs.steps
    device = (device + kernels * roofline.launch_gap_s) / steps
    host = kernels * roofline.host_overhead_s / steps
    collective /= steps
    # On a card, collectives run on their own stream beside the compute (DDP's buckets during
    # the backward, FSDP's prefetched all-gathers and its reduce-scatters): only what the
    # kernels cannot hide shows, and never less than the longest one (the last bucket, the
    # first all-gather, which nothing runs beside). On a CPU they take the cores' time.
    exposed = max(longest / steps, collective - device) if roofline.overlapped else collective
    total = (max(device, host) if roofline.overlapped else device + host) + exposed
    return StepTime(
        seconds=total,
        device_s=device,
        host_s=host,
        compute_bound_s=compute_bound / steps,
        collective_s=collective,
        flops=costs.flops,
        model_flops=costs.model_flops,
        unmodelled=tuple(costs.unmodelled),
        collectives_unpriced=unpriced,
        flops_dtype=max(by_dtype, key=by_dtype.__getitem__) if by_dtype else "",
    )
