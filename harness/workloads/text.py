"""Byte-level language-modelling data from Python's own bundled documentation text.

``pydoc_data.topics`` ships with every CPython: ~466 KB of real English (with code samples), so
language-model trials run offline. Tokens are UTF-8 bytes (vocabulary 256). The text is cut into
non-overlapping windows of ``seq_len + 1`` bytes: inputs are the first ``seq_len``, targets the
same shifted by one. The last ``test_fraction`` of the text is held out, contiguous, so no
held-out window overlaps training text. ``corpus: first_half`` / ``second_half`` reads half of
the topics (by name): two texts on different subjects, to pre-train on one and fine-tune on the
other.
"""

from __future__ import annotations

from typing import Any

import torch

from harness.contract import DEFAULT_TEST_FRACTION
from harness.workloads.sizes import corpus_bytes
from harness.workloads.tensors import INPUTS, TARGETS, DataInfo, SplitData

VOCAB = 256


def windows(tokens: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    count = (len(tokens) - 1) // seq_len
    if count < 1:
        raise ValueError(f"text too short for seq_len {seq_len}")
    usable = tokens[: count * seq_len + 1]
    x = usable[:-1].reshape(count, seq_len)
    y = usable[1:].reshape(count, seq_len)
    return x, y


def describe(options: dict[str, Any]) -> DataInfo:
    seq_len = int(options.get("seq_len") or 128)
    return DataInfo((seq_len,), VOCAB, seq_len)


def load(options: dict[str, Any], seed: int) -> SplitData:
    seq_len = int(options.get("seq_len") or 128)
    text = corpus_bytes(options.get("corpus") or "all")
    tokens = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
    cut = int(len(tokens) * (1 - options.get("test_fraction", DEFAULT_TEST_FRACTION)))
    train, test = windows(tokens[:cut], seq_len), windows(tokens[cut:], seq_len)
    return SplitData(
        {INPUTS: train[0], TARGETS: train[1]}, {INPUTS: test[0], TARGETS: test[1]}, VOCAB
    )
