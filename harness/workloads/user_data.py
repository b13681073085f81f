"""Your own data: ``dataset: package.module:function`` in a spec.

The function is called as ``function(seed=SEED, **data.args)`` and returns the data in any of
these forms:

- ``(train, held_out)``: two parts, each one of the forms below;
- one part: then the last ``test_fraction`` (seeded shuffle) is held out.

A part is a tuple ``(x, y)`` of tensors (the model is called as ``model(x)``), a dict of
tensors (``input_ids``, ``attention_mask``, ``labels``, ``pixel_values``, ...: the model is
called as ``model(**batch)``), or a map-style ``torch.utils.data.Dataset`` whose samples are
such tuples or dicts (stacked into tensors once, at load: every dataset lives in memory).
``data.num_classes`` is given or taken as the largest label (``y`` / ``labels``, else
``input_ids``) plus one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from harness.contract import DEFAULT_TEST_FRACTION
from harness.workloads.tensors import INPUTS, TARGETS, Batch, SplitData, split_batch


def as_batch(part: Any, what: str) -> Batch:
    """One part of the user's data as named tensors."""
    if isinstance(part, dict):
        return {str(k): torch.as_tensor(v) for k, v in part.items()}
    if (
        isinstance(part, tuple | list)
        and len(part) == 2
        and all(isinstance(t, torch.Tensor) for t in part)
    ):
        return {INPUTS: part[0], TARGETS: part[1]}
    if hasattr(part, "__getitem__") and hasattr(part, "__len__"):
        samples = [part[i] for i in range(len(part))]
        if not samples:
            raise ValueError(f"{what} is empty")
        first = samples[0]
        if isinstance(first, dict):
            return {k: torch.stack([torch.as_tensor(s[k]) for s in samples]) for k in first}
        if isinstance(first, tuple | list) and len(first) == 2:
            columns = list(zip(*samples, strict=True))
            return {
                INPUTS: torch.stack([torch.as_tensor(v) for v in columns[0]]),
                TARGETS: torch.stack([torch.as_tensor(v) for v in columns[1]]),
            }
    raise ValueError(
        f"{what} must be a tuple (x, y) of tensors, a dict of tensors or a map-style Dataset "
        f"of such samples (got {type(part).__name__})"
    )


def label_count(*batches: Batch) -> int:
    for name in (TARGETS, "labels", "input_ids"):
        values = [b[name] for b in batches if name in b]
        if values:
            return int(max(int(v.max()) for v in values)) + 1
    raise ValueError("give data.num_classes: the data has no y, labels or input_ids to count")


def load_user_data(function: Callable[..., Any], options: dict[str, Any], seed: int) -> SplitData:
    returned = function(seed=seed, **options.get("args", {}))
    two_parts = (
        isinstance(returned, tuple | list)
        and len(returned) == 2
        and not all(isinstance(t, torch.Tensor) for t in returned)
    )
    if two_parts:
        train, test = (
            as_batch(returned[0], "the training part"),
            as_batch(returned[1], "the held-out part"),
        )
        classes = options.get("num_classes") or label_count(train, test)
        return SplitData(train, test, int(classes))
    data = as_batch(returned, "the data")
    classes = options.get("num_classes") or label_count(data)
    return split_batch(
        data, int(classes), options.get("test_fraction", DEFAULT_TEST_FRACTION), seed
    )
