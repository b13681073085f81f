"""Random token ids: language-model memory and speed at any vocabulary, without a corpus.

Windows of ``seq_len + 1`` ids drawn uniformly from ``vocab_size`` (seeded): inputs are the
first ``seq_len``, targets the same shifted by one, as in ``text``. Accuracy means nothing
here; memory and throughput are those of real tokens.
"""

from __future__ import annotations

from typing import Any

import torch

from harness.contract import DEFAULT_TEST_FRACTION
from harness.workloads.tensors import INPUTS, TARGETS, DataInfo, SplitData

DEFAULTS = {
    "vocab_size": 32000,
    "seq_len": 128,
    "num_samples": 512,
    "test_fraction": DEFAULT_TEST_FRACTION,
}


def settings(options: dict[str, Any]) -> dict[str, Any]:
    return {k: options.get(k) or default for k, default in DEFAULTS.items()}


def describe(options: dict[str, Any]) -> DataInfo:
    chosen = settings(options)
    return DataInfo((chosen["seq_len"],), chosen["vocab_size"], chosen["seq_len"])


def load(options: dict[str, Any], seed: int) -> SplitData:
    chosen = settings(options)
    count, seq_len = int(chosen["num_samples"]), int(chosen["seq_len"])
    generator = torch.Generator().manual_seed(seed)
    windows = torch.randint(0, chosen["vocab_size"], (count, seq_len + 1), generator=generator)
    n_test = max(1, round(count * chosen["test_fraction"]))
    train, test = windows[n_test:], windows[:n_test]
    return SplitData(
        {INPUTS: train[:, :-1], TARGETS: train[:, 1:]},
        {INPUTS: test[:, :-1], TARGETS: test[:, 1:]},
        int(chosen["vocab_size"]),
    )
