"""A catalogue card's roofline for the step-time prediction (``harness.meters.roofline``).

The datasheet gives peaks; what a training step reaches is less, and these factors say how
much less, each with where it comes from:

- ``MATMUL_EFFICIENCY``: the fraction of the dense bf16 peak the best-shaped ``torch.matmul``
  reaches (Maximum Achievable Matmul FLOPS, S. Bekman, *Machine Learning Engineering*,
  compute/accelerator "MAMF comparison table", torch 2.5-2.7): A100 SXM 271.2/312 TFLOPS,
  A100 PCIe 252.9/312, H100 SXM 794.5/989, GH200 (the H200's die and memory) 828.6/989,
  B200 1745/2250, MI300X 781.9/1300. A card without a measurement: 0.80 (NVIDIA) or 0.60
  (AMD), an assumption.
- ``BANDWIDTH_EFFICIENCY`` 0.85: the share of datasheet bandwidth a large copy reaches
  (STREAM-like runs on A100/H100 land at 85-92 %); an assumption, lower end.
- ``MATMUL_HALF_S`` 2.5 us: a matmul that would take this long at the full rate runs at half
  of it (too few tiles to fill the SMs, the kernel's ramp and tail); so the half-rate size in
  FLOPs scales with the card's speed. An assumption, to be checked by the GPU check.
- ``HOST_OVERHEAD_S`` 23 us per op: eager PyTorch's Python, module, dispatcher and launch
  cost per aten op that runs a kernel, measured on the first card lent (an H200's host,
  torch 2.11, 2026-12-04, docs/gpu-validation.md): ten launch-bound trials of the GPU check
  (small gpt and Llama steps, checkpointed and LoRA ones, a CNN) took 19-33 us per op counted,
  median 23. (It was 10 us, H. He's "overhead-bound below ~10 us of GPU work per op", 2022:
  the steps ran 1.5-5.6x longer than predicted.) A host's CPU moves it; ``LAUNCH_GAP_S`` 2 us
  between back-to-back kernels on the device.
- The link between ranks: the interconnect's first quoted bandwidth (NVLink's is both
  directions: half of it each way), else the PCIe generation's x16 rate.
"""

from __future__ import annotations

import re

from harness.cuda.cards import Card
from harness.meters.roofline import Roofline

MATMUL_EFFICIENCY = {
    "a100-40gb": 271.2 / 312,
    "a100-80gb": 271.2 / 312,
    "h100-80gb": 794.5 / 989.4,
    "h100-pcie": 0.80,  # not measured; the SXM part's figure
    "h200": 828.6 / 989.4,
    "b200": 1745.0 / 2250,
    "mi300x": 781.9 / 1300,
}
DEFAULT_EFFICIENCY = {"nvidia": 0.80, "amd": 0.60}
BANDWIDTH_EFFICIENCY = 0.85
MATMUL_HALF_S = 2.5e-6
HOST_OVERHEAD_S = 23e-6
LAUNCH_GAP_S = 2e-6
PCIE_X16_GBS = {3: 16.0, 4: 32.0, 5: 64.0, 6: 128.0}


def link_bandwidth(card: Card) -> float | None:
    """Bytes/s one way between two of these cards (module docstring); None when the
    interconnect names no figure and no PCIe generation."""
    quoted = re.search(r"\((\d+(?:\.\d+)?) GB/s\)", card.interconnect)
    if quoted:
        both_ways = "nvlink" in card.interconnect.lower()
        return float(quoted.group(1)) * 1e9 / (2 if both_ways else 1)
    generation = re.search(r"PCIe Gen(\d)", card.interconnect)
    if generation and int(generation.group(1)) in PCIE_X16_GBS:
        return PCIE_X16_GBS[int(generation.group(1))] * 1e9
    return None


def card_roofline(card: Card) -> Roofline | None:
    """The roofline a step-time prediction for ``card`` uses (module docstring); None for a
    card (a user's) that gives no peak or no bandwidth: nothing to price ops on."""
    if not card.peak_tflops or card.bandwidth_tbs <= 0:
        return None
    measured = card.name in MATMUL_EFFICIENCY
    efficiency = MATMUL_EFFICIENCY.get(card.name, DEFAULT_EFFICIENCY.get(card.vendor, 0.8))
    peaks = {dtype: tflops * 1e12 for dtype, tflops in card.peak_tflops.items()}
    halves = {dtype: peak * efficiency * MATMUL_HALF_S for dtype, peak in peaks.items()}
    how = "MAMF-measured" if measured else "assumed"
    return Roofline(
        name=card.name,
        peak_flops=peaks,
        matmul_efficiency=efficiency,
        matmul_half_flops=halves,
        bandwidth=card.bandwidth_tbs * 1e12 * BANDWIDTH_EFFICIENCY,
        host_overhead_s=HOST_OVERHEAD_S,
        launch_gap_s=LAUNCH_GAP_S,
        overlapped=True,
        link_bandwidth=link_bandwidth(card),
        source=f"{card.name}: datasheet peaks, {how} matmul efficiency {efficiency:.2f} "
        "(harness.cuda.speed)",
    )
