"""The card catalogue: what a named GPU holds and does, with where each number comes from.

A prediction for a card needs its memory as PyTorch sees it (``total_memory``, less than the
marketed size: the driver keeps some), its compute capability (autocast, attention kernels and
workspace sizes depend on it), what lives on it outside PyTorch's allocator (the CUDA context),
and, for the speed estimate, its dense peak TFLOPS per dtype, memory bandwidth and
interconnect. Standard library only: the spec and the trial layer both read it.

Sources (``SOURCES``) are public prints of ``torch.cuda.get_device_properties`` /
``deviceQuery`` for memory, capability and SM count (the smallest value seen on Linux: it moves
0.1-1 % with the driver), and vendor datasheets for peaks (dense, never the sparse figure) and
bandwidth. The CUDA context is a documented assumption (``context_assumption``) unless a card
states it. A user adds or overrides a card in a YAML file (``cards:`` in the spec, ``--cards``
on the commands); ``card_from_mapping`` checks it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

MIB = 2**20

# CUDA context with lazy module loading (PyTorch's default since CUDA 11.7): the driver reserves
# a stack for every thread the card can keep resident (SMs x threads per SM x cudaLimitStackSize,
# 1 KiB by default; 216 MB on an A100, EMDC_llvm issue #13), plus a base for the driver and the
# modules loaded on first use. The base is what an RTX 3090 showed beyond its stack reservation
# (256 MiB idle context, torch 2.7.1+cu128, lazy loading: InvokeAI issue #9413; 82 SMs x 1536 x
# 1 KiB = 123 MiB), and the result lands inside PyTorch maintainers' "~300-400 MB with lazy
# loading" (pytorch issues #107667, #109888). An assumption: +-150 MiB, and more as a run loads
# more kernels (cuDNN, NCCL, flash attention modules).
# Measured on a card: what a training process held outside the caching allocator on an H200
# (cudaMemGetInfo's used - memory_reserved after the memory window, 30 single-process trials of
# the GPU check, 2026-12-04): 751 MiB (fp32 trials) to 767 MiB (bf16/fp16: more kernel modules
# loaded). The assumption below says 397 MiB for this card: its base came from an idle RTX 3090
# context on CUDA 12.8; a training process on CUDA 13 loads ~370 MiB more (docs/gpu-validation.md).
H200_CONTEXT_MIB = 767
H200_CONTEXT_SOURCE = (
    "measured: 767 MiB outside the allocator in training (GPU check on an H200, torch "
    "2.11.0+cu130, driver 580.159.04, 2026-12-04)"
)
STACK_BYTES_PER_THREAD = 1024
CONTEXT_BASE_BYTES = 133 * MIB
AMD_CONTEXT_BYTES = 512 * MIB  # no published HIP context size was found: an assumption
THREADS_PER_SM = {
    (7, 0): 2048,
    (7, 5): 1024,
    (8, 0): 2048,
    (8, 6): 1536,
    (8, 7): 1536,
    (8, 9): 1536,
    (9, 0): 2048,
    (10, 0): 2048,
    (10, 3): 2048,
    (12, 0): 1536,
    (12, 1): 1536,
}  # fmt: skip  (CUDA programming guide, "Compute Capabilities")

# cuBLAS workspace per (handle, stream), allocated through the caching allocator
# (CublasHandlePool.cpp, parseChosenWorkspaceSize): CUBLAS_WORKSPACE_CONFIG's default
# ":4096:2:16:8" = 2 x 4096 KiB + 8 x 16 KiB, and 32 MiB on compute capability 9.x, 10.x, 12.x;
# hipBLAS 32 MiB, 128 MiB on gfx94x/95x (MI300). cuBLASLt's own workspace: 1 MiB
# (parseCUDABlasLtWorkspaceSize, CUBLASLT_WORKSPACE_SIZE default 1024 KiB).
CUBLAS_WORKSPACE_DEFAULT = 4096 * 1024 * 2 + 16 * 1024 * 8
CUBLAS_WORKSPACE_LARGE = 32 * MIB
CUBLASLT_WORKSPACE = 1024 * 1024
HIPBLAS_WORKSPACE_GFX94 = 128 * MIB


@dataclass(frozen=True)
class Card:
    """One GPU model as a prediction needs it."""

    name: str  # the catalogue key, e.g. "h100-80gb"
    device_name: str  # what torch.cuda.get_device_name() reports
    memory_bytes: int  # torch.cuda.get_device_properties().total_memory
    compute_capability: tuple[int, int]
    sms: int  # streaming multiprocessors (AMD: compute units)
    peak_tflops: dict[str, float]  # dense, per dtype: fp32, tf32, bf16, fp16, fp8
    bandwidth_tbs: float  # memory bandwidth, TB/s
    interconnect: str
    vendor: str = "nvidia"  # nvidia | amd
    context_bytes: int | None = None  # measured CUDA context; None: context_assumption()
    sources: dict[str, str] = field(default_factory=dict)

    @property
    def context(self) -> int:
        """Bytes the CUDA context holds outside PyTorch's allocator (see module docstring)."""
        return self.context_bytes if self.context_bytes is not None else context_assumption(self)

    @property
    def cublas_workspace_bytes(self) -> int:
        if self.vendor == "amd":
            return HIPBLAS_WORKSPACE_GFX94 if self.compute_capability == (9, 4) else 32 * MIB
        if self.compute_capability[0] in (9, 10, 12):
            return CUBLAS_WORKSPACE_LARGE
        return CUBLAS_WORKSPACE_DEFAULT

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["compute_capability"] = list(self.compute_capability)
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Card:
        values = dict(data)
        values["compute_capability"] = tuple(values["compute_capability"])
        return cls(**values)


def context_assumption(card: Card) -> int:
    """The CUDA context assumed for ``card``: thread stacks for every resident thread plus the
    base the RTX 3090 measurement leaves (module docstring); AMD: a flat assumption."""
    if card.vendor == "amd":
        return AMD_CONTEXT_BYTES
    threads = THREADS_PER_SM.get(card.compute_capability, 2048)
    return card.sms * threads * STACK_BYTES_PER_THREAD + CONTEXT_BASE_BYTES


PEAKS = "vendor datasheet, dense (no sparsity)"


def _card(
    name: str,
    device_name: str,
    mib: float,
    cc: tuple[int, int],
    sms: int,
    peaks: dict[str, float],
    bandwidth: float,
    interconnect: str,
    memory_source: str,
    peak_source: str = PEAKS,
    vendor: str = "nvidia",
    context: tuple[int, str] | None = None,
) -> Card:
    """A catalogue row as a Card: the row is Card's fields in Card's order (memory in MiB, as
    torch prints it), then where its numbers come from; ``context``: a measured CUDA context
    (MiB, where it was measured), else the assumption."""
    sources = {
        "memory_bytes, compute_capability, sms": memory_source,
        "peak_tflops, bandwidth_tbs, interconnect": peak_source,
        "context": context[1] if context else "assumption (harness.cuda.cards.context_assumption)",
    }
    memory = int(mib * MIB)
    return Card(
        name, device_name, memory, cc, sms, peaks, bandwidth, interconnect, vendor,
        context_bytes=context[0] * MIB if context else None, sources=sources,
    )  # fmt: skip


CATALOGUE: dict[str, Card] = {
    card.name: card
    for card in (
        _card(
            "h100-80gb",
            "NVIDIA H100 80GB HBM3",
            81082,
            (9, 0),
            132,
            {"fp32": 67, "tf32": 494.7, "bf16": 989.4, "fp16": 989.4, "fp8": 1978.9},
            3.35,
            "NVLink 4 (900 GB/s), PCIe Gen5 x16",
            "torch prints total_memory=81082-81090MB (MiB); deviceQuery 85045477376 B",
            "NVIDIA H100 datasheet (SXM5), dense",
        ),
        _card(
            "h100-pcie",
            "NVIDIA H100 PCIe",
            81008,
            (9, 0),
            114,
            {"fp32": 51, "tf32": 378, "bf16": 756, "fp16": 756, "fp8": 1513},
            2.0,
            "PCIe Gen5 x16 (NVLink bridge 600 GB/s)",
            "torch prints total_memory=81008MB",
            "NVIDIA H100 datasheet (PCIe), dense",
        ),
        _card(
            "h200",
            "NVIDIA H200",
            143156,
            (9, 0),
            132,
            {"fp32": 67, "tf32": 494.7, "bf16": 989.4, "fp16": 989.4, "fp8": 1978.9},
            4.8,
            "NVLink 4 (900 GB/s), PCIe Gen5 x16",
            "torch prints total_memory=143156MB (nvidia-smi 143771 MiB)",
            "NVIDIA H200 datasheet (SXM), dense",
            context=(H200_CONTEXT_MIB, H200_CONTEXT_SOURCE),
        ),
        _card(
            "b200",
            "NVIDIA B200",
            182631,
            (10, 0),
            148,
            {"fp32": 75, "tf32": 1100, "bf16": 2250, "fp16": 2250, "fp8": 4500},
            7.7,
            "NVLink 5 (1800 GB/s), PCIe Gen5 x16",
            "torch prints total_memory=182631-182642MB",
            "NVIDIA HGX B200 datasheet, dense",
        ),
        _card(
            "a100-40gb",
            "NVIDIA A100-SXM4-40GB",
            40339,
            (8, 0),
            108,
            {"fp32": 19.5, "tf32": 156, "bf16": 312, "fp16": 312},
            1.555,
            "NVLink 3 (600 GB/s), PCIe Gen4 x16",
            "deviceQuery 42298834944 B (40339 MiB); torch prints 40441-40654MB on newer drivers",
            "NVIDIA A100 datasheet (SXM4 40GB), dense",
        ),
        _card(
            "a100-80gb",
            "NVIDIA A100-SXM4-80GB",
            81158,
            (8, 0),
            108,
            {"fp32": 19.5, "tf32": 156, "bf16": 312, "fp16": 312},
            2.039,
            "NVLink 3 (600 GB/s), PCIe Gen4 x16",
            "deviceQuery 85100068864 B (81158 MiB); torch prints 81222-81251MB",
            "NVIDIA A100 datasheet (SXM4 80GB), dense",
        ),
        _card(
            "l40s",
            "NVIDIA L40S",
            47803596800 / MIB,
            (8, 9),
            142,
            {"fp32": 91.6, "tf32": 183, "bf16": 362.05, "fp16": 362.05, "fp8": 733},
            0.864,
            "PCIe Gen4 x16 (no NVLink)",
            "deviceQuery 47803596800 B (45589 MiB)",
            "NVIDIA L40S datasheet, dense",
        ),
        _card(
            "l4",
            "NVIDIA L4",
            22563,
            (8, 9),
            58,
            {"fp32": 30.3, "tf32": 60, "bf16": 121, "fp16": 121, "fp8": 242.5},
            0.3,
            "PCIe Gen4 x16 (no NVLink)",
            "torch prints total_memory=22563-22574MB",
            "NVIDIA L4 datasheet, dense (unverified here: from the datasheet's sparse/2)",
        ),
        _card(
            "rtx-4090",
            "NVIDIA GeForce RTX 4090",
            24563,
            (8, 9),
            128,
            {"fp32": 82.6, "tf32": 82.6, "bf16": 165.2, "fp16": 165.2, "fp8": 330.3},
            1.008,
            "PCIe Gen4 x16 (no NVLink)",
            "torch prints total_memory=24563MB on Linux (24217 seen on another host)",
            "NVIDIA Ada whitepaper, tensor cores with FP32 accumulate (what PyTorch uses)",
        ),
        _card(
            "rtx-3090",
            "NVIDIA GeForce RTX 3090",
            24259,
            (8, 6),
            82,
            {"fp32": 35.6, "tf32": 35.6, "bf16": 71, "fp16": 71},
            0.936,
            "PCIe Gen4 x16 (NVLink bridge 112.5 GB/s)",
            "torch prints total_memory=24259MB on Linux",
            "NVIDIA Ampere GA102 whitepaper, FP32 accumulate (unverified here)",
        ),
        _card(
            "a10g",
            "NVIDIA A10G",
            22587,
            (8, 6),
            80,
            {"fp32": 35, "bf16": 70, "fp16": 70},
            0.6,
            "PCIe Gen4 x16 (no NVLink)",
            "torch prints total_memory=22587-22723MB, multi_processor_count=80",
            "no NVIDIA datasheet for the A10G (AWS): an estimate from the A10's clocks and SMs",
        ),
        _card(
            "a10",
            "NVIDIA A10",
            23609475072 / MIB,
            (8, 6),
            72,
            {"fp32": 31.2, "tf32": 62.5, "bf16": 125, "fp16": 125},
            0.6,
            "PCIe Gen4 x16",
            "deviceQuery 23609475072 B; 72 SMs from the datasheet",
            "NVIDIA A10 datasheet, dense",
        ),
        _card(
            "t4",
            "Tesla T4",
            14930,
            (7, 5),
            40,
            {"fp32": 8.1, "fp16": 65},
            0.32,
            "PCIe Gen3 x16",
            "torch prints total_memory=14930-15109MB (15109 on Colab)",
            "NVIDIA T4 datasheet (no bf16 in hardware)",
        ),
        _card(
            "v100-16gb",
            "Tesla V100-SXM2-16GB",
            16130,
            (7, 0),
            80,
            {"fp32": 15.7, "fp16": 125},
            0.9,
            "NVLink 2 (300 GB/s), PCIe Gen3 x16",
            "torch prints total_memory=16130-16160MB",
            "NVIDIA V100 datasheet (SXM2)",
        ),
        _card(
            "v100-32gb",
            "Tesla V100-SXM2-32GB",
            32494,
            (7, 0),
            80,
            {"fp32": 15.7, "fp16": 125},
            0.9,
            "NVLink 2 (300 GB/s), PCIe Gen3 x16",
            "torch prints total_memory=32494-32510MB",
            "NVIDIA V100 datasheet (SXM2)",
        ),
        _card(
            "mi300x",
            "AMD Instinct MI300X",
            196592,
            (9, 4),
            304,
            {"fp32": 163.4, "tf32": 653.7, "bf16": 1307.4, "fp16": 1307.4, "fp8": 2614.9},
            5.3,
            "Infinity Fabric (7 x 128 GB/s), PCIe Gen5 x16",
            "torch prints total_memory=196592MB (gfx942, 304 CUs)",
            "AMD MI300X datasheet, dense",
            vendor="amd",
        ),
    )
}

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20,
          "gib": 2**30}  # fmt: skip
FIELDS = {
    "device_name": "the name torch.cuda.get_device_name() reports",
    "memory": "total_memory as torch reports it, e.g. 48GiB or 51527024640",
    "compute_capability": "major.minor, e.g. 8.6",
    "sms": "streaming multiprocessors, a positive integer",
    "peak_tflops": "dense peak TFLOPS per dtype, e.g. {bf16: 154.8, fp32: 38.7}",
    "bandwidth_tbs": "memory bandwidth in TB/s",
    "interconnect": "free text, e.g. PCIe Gen4 x16",
    "vendor": "nvidia or amd",
    "context": "measured CUDA context size, e.g. 450MiB (optional)",
}


def card_from_mapping(name: str, data: Any, where: str) -> Card:
    """A user's card from a YAML mapping; ``ValueError`` with one line naming ``where`` and the
    field on anything wrong. Required: memory, compute_capability, sms."""
    if not isinstance(data, Mapping):
        raise ValueError(f"{where}: a card is a mapping of {', '.join(FIELDS)}")
    unknown = sorted(set(data) - set(FIELDS))
    if unknown:
        raise ValueError(f"{where}.{unknown[0]}: unknown field (allowed: {', '.join(FIELDS)})")
    for required in ("memory", "compute_capability", "sms"):
        if required not in data:
            raise ValueError(f"{where}.{required}: missing ({FIELDS[required]})")
    memory = _bytes(data["memory"], f"{where}.memory")
    capability = _capability(data["compute_capability"], f"{where}.compute_capability")
    sms = data["sms"]
    if not isinstance(sms, int) or isinstance(sms, bool) or sms <= 0:
        raise ValueError(f"{where}.sms: {FIELDS['sms']}")
    peaks = data.get("peak_tflops", {})
    if not isinstance(peaks, Mapping) or not all(
        isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 for v in peaks.values()
    ):
        raise ValueError(f"{where}.peak_tflops: {FIELDS['peak_tflops']}")
    bandwidth = data.get("bandwidth_tbs", 0.0)
    if not isinstance(bandwidth, (int, float)) or isinstance(bandwidth, bool) or bandwidth < 0:
        raise ValueError(f"{where}.bandwidth_tbs: {FIELDS['bandwidth_tbs']}")
    vendor = data.get("vendor", "nvidia")
    if vendor not in ("nvidia", "amd"):
        raise ValueError(f"{where}.vendor: {FIELDS['vendor']}")
    context = _bytes(data["context"], f"{where}.context") if "context" in data else None
    return Card(
        name=name,
        device_name=str(data.get("device_name", name)),
        memory_bytes=memory,
        compute_capability=capability,
        sms=sms,
        peak_tflops={str(k): float(v) for k, v in peaks.items()},
        bandwidth_tbs=float(bandwidth),
        interconnect=str(data.get("interconnect", "")),
        vendor=vendor,
        context_bytes=context,
        sources={"all": f"user card ({where})"},
    )


def _bytes(value: Any, where: str) -> int:
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    match = _SIZE.match(str(value)) if isinstance(value, str) else None
    unit = match.group(2).lower() if match else None
    if not match or unit not in _UNITS or float(match.group(1)) <= 0:
        raise ValueError(f"{where}: expected a size such as 48GiB, 450MiB or a number of bytes")
    return int(float(match.group(1)) * _UNITS[unit])


def _capability(value: Any, where: str) -> tuple[int, int]:
    text = str(value)
    match = re.fullmatch(r"(\d+)\.(\d+)", text.strip())
    if not match:
        raise ValueError(f"{where}: {FIELDS['compute_capability']} (got {text!r})")
    return int(match.group(1)), int(match.group(2))


def find_card(name: str, extra: Mapping[str, Card] | None = None) -> Card:
    """The card called ``name`` (user cards first); ``KeyError`` with a one-line message that
    lists the names and suggests the closest."""
    cards = {**CATALOGUE, **(extra or {})}
    key = name.strip().lower()
    if key in cards:
        return cards[key]
    close = _closest(key, list(cards))
    hint = f"; did you mean {close!r}?" if close else ""
    raise KeyError(f"unknown card {name!r} (known: {', '.join(sorted(cards))}){hint}")


def _closest(word: str, names: list[str]) -> str | None:
    import difflib

    found = difflib.get_close_matches(word, names, n=1, cutoff=0.5)
    return found[0] if found else None


def card_for_device_name(device_name: str) -> Card | None:
    """The catalogue entry for a card torch names ``device_name`` (on a GPU host)."""
    for card in CATALOGUE.values():
        if card.device_name == device_name:
            return card
    return None


def describe(card: Card) -> str:
    """One line: ``h100-80gb: 79.2 GiB, sm90, 132 SMs, context ~0.40 GiB (assumed)``."""
    context = "measured" if card.context_bytes is not None else "assumed"
    return (
        f"{card.name}: {card.memory_bytes / 2**30:.1f} GiB, sm{card.compute_capability[0]}"
        f"{card.compute_capability[1]}, {card.sms} SMs, context ~{card.context / 2**30:.2f} GiB "
        f"({context})"
    )
