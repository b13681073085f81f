"""The card a CUDA prediction is for, and the rules it is predicted under.

A CUDA target is a named card (the spec's ``card``, ``--card``), else the GPU this process
runs on, else an assumed A100-80GB (said in the prediction's note): its compute capability
picks attention kernels and workspace sizes, its memory is the default budget, its context is
part of the device figure. Allocator settings come from the spec's ``allocator`` and the
strategies that set them (``expandable_segments``), merged as the environment variable would
be. On a machine without a GPU the step runs CPU kernels under CUDA's autocast lists and with
CUDA's attention and dropout kernels (``harness.cuda.autocast``, ``harness.cuda.kernels``).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from harness.cuda.allocator import AllocatorConfig
from harness.cuda.autocast import cuda_autocast_rules
from harness.cuda.cards import CATALOGUE, Card, card_for_device_name
from harness.cuda.kernels import Kernels, attention_note, cuda_kernels, installed_cudnn_version
from harness.strategies.base import Strategy
from harness.strategies.memory_management import ALLOC_CONF_VARS, merge_conf
from harness.trial.config import TrialConfig

ASSUMED_CARD = "a100-80gb"


@dataclass(frozen=True)
class CudaTarget:
    card: Card
    card_named: bool  # False: assumed (no card in the spec, no GPU here)
    allocator: AllocatorConfig
    emulated: bool  # CPU kernels under CUDA's rules (no GPU here)

    def budget(self, config: TrialConfig) -> int:
        """Bytes the device may use: ``device_memory`` when set, else the card's memory."""
        return config.device_memory_bytes or self.card.memory_bytes


def allocator_text(config: TrialConfig, strategies: tuple[Strategy, ...]) -> str:
    """PYTORCH_CUDA_ALLOC_CONF as the trial sets it (``run.train``): this process's own, the
    spec's ``allocator`` over it, then each strategy's setting (``expandable_segments``)."""
    text = merge_conf(os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""), config.allocator or "")
    for strategy in strategies:
        env = strategy.environment()
        for var in ALLOC_CONF_VARS:
            if var in env:
                text = merge_conf(text, env[var])
                break
    return text


def cuda_target(
    config: TrialConfig, as_cuda: bool, strategies: tuple[Strategy, ...] | None = None
) -> CudaTarget:
    """The target of a CUDA prediction of ``config`` (``strategies``: its strategy objects,
    when the caller holds them)."""
    strategies = strategies or config.strategy.build()
    if config.card is not None:
        card, named = Card.from_dict(config.card), True
    else:
        card, named = host_card() or CATALOGUE[ASSUMED_CARD], torch.cuda.is_available()
    return CudaTarget(
        card, named, AllocatorConfig.parse(allocator_text(config, strategies)), as_cuda
    )


def host_card() -> Card | None:
    """The GPU this process runs on, as a card (catalogue entry where its name is known)."""
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    known = card_for_device_name(name)
    if known is not None:
        return known
    props = torch.cuda.get_device_properties(0)
    return Card(
        name=name.lower().replace(" ", "-"),
        device_name=name,
        memory_bytes=props.total_memory,
        compute_capability=(props.major, props.minor),
        sms=props.multi_processor_count,
        peak_tflops={},
        bandwidth_tbs=0.0,
        interconnect="",
        sources={"all": "this host's torch.cuda.get_device_properties"},
    )


@contextlib.contextmanager
def cuda_rules(target: CudaTarget) -> Iterator[Kernels | None]:
    """CUDA's autocast lists and kernels for CPU tensors, when the prediction runs on CPU
    kernels; nothing on a GPU (its own dispatch is the truth)."""
    if not target.emulated:
        yield None
        return
    capability = target.card.compute_capability
    with cuda_autocast_rules(), cuda_kernels(capability, installed_cudnn_version()) as kernels:
        yield kernels


def target_note(target: CudaTarget, kernels: Kernels | None) -> str:
    """What the prediction assumed about the card, for its note."""
    card = target.card
    cc = f"sm{card.compute_capability[0]}{card.compute_capability[1]}"
    named = "" if target.card_named else " (assumed: no card named; pass --card)"
    parts = [f"card {card.name}{named}, {cc}"]
    if target.emulated:
        parts.append("CUDA autocast lists and kernels on CPU")
    if kernels is not None and kernels.backends:
        parts.append(f"attention {attention_note(kernels.backends)}")
    settings = target.allocator.text()
    parts.append(f"allocator {settings}" if settings else "allocator defaults")
    return "; ".join(parts)
