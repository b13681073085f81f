"""In-memory datasets as tensors: a train/held-out split and a seeded batch iterator.

Everything the trial needs is small enough to live on the device, so throughput measures the
model, not a data loader. A batch is a dict of tensors whose first dimension
is the sample: ``x`` and ``y`` for the built-in datasets (inputs, labels or next tokens), the
names a user's data or a Hugging Face dataset gives (``input_ids``, ``attention_mask``,
``labels``, ``pixel_values``, ...) otherwise.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

Batch = dict[str, torch.Tensor]
INPUTS, TARGETS = "x", "y"  # the built-in datasets' two fields
LABELS = (TARGETS, "labels")  # fields only a loss reads, never an inference pass


@dataclass(frozen=True)
class Field:
    """One tensor of a batch, per sample: what a fake batch of any size needs."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # a torch dtype's name: "float32", "int64", "bool", ...
    high: int | None = None  # integers: values lie in [0, high)

    def example(self, batch_size: int) -> torch.Tensor:
        """Random values of this field for ``batch_size`` samples (fake ones under the estimate)."""
        dtype = getattr(torch, self.dtype)
        shape = (batch_size, *self.shape)
        if dtype.is_floating_point:
            return torch.randn(shape).to(dtype)
        if dtype is torch.bool:
            return torch.ones(shape, dtype=torch.bool)
        return torch.randint(0, max(1, self.high or 1), shape, dtype=dtype)


@dataclass(frozen=True)
class DataInfo:
    """What a model builder needs to know about the data."""

    input_shape: tuple[int, ...]  # per sample, e.g. (1, 8, 8); (seq_len,) for token ids
    num_classes: int  # classes, or the vocabulary size for next-token prediction
    tokens_per_sample: int = 1  # > 1: one label per token, throughput in tokens/s
    # The batch's tensors; None: the built-in pair x (input_shape) and y (a class per sample,
    # or per token).
    fields: tuple[Field, ...] | None = None

    def batch_fields(self) -> tuple[Field, ...]:
        if self.fields is not None:
            return self.fields
        if self.tokens_per_sample > 1:
            tokens = Field(INPUTS, self.input_shape, "int64", self.num_classes)
            return tokens, Field(TARGETS, self.input_shape, "int64", self.num_classes)
        return (
            Field(INPUTS, self.input_shape, "float32"),
            Field(TARGETS, (), "int64", self.num_classes),
        )

    def example_batch(self, batch_size: int) -> Batch:
        return {f.name: f.example(batch_size) for f in self.batch_fields()}


@dataclass
class SplitData:
    train: Batch
    test: Batch
    num_classes: int

    @property
    def info(self) -> DataInfo:
        if set(self.train) == {INPUTS, TARGETS}:
            x, y = self.train[INPUTS], self.train[TARGETS]
            per_sample = y[0].numel() if y.dim() > 1 else 1
            return DataInfo(tuple(x.shape[1:]), self.num_classes, per_sample)
        return describe_batch(self.train, self.num_classes)

    @property
    def train_size(self) -> int:
        return num_samples(self.train)


def describe_batch(batch: Batch, num_classes: int) -> DataInfo:
    """The ``DataInfo`` of named tensors (a user's or a Hugging Face dataset's): the inputs are
    ``input_ids`` or ``pixel_values`` (else the first field), tokens per sample from ``labels``
    or ``input_ids`` when they are sequences."""
    fields = tuple(
        Field(
            name,
            tuple(t.shape[1:]),
            str(t.dtype).removeprefix("torch."),
            None if t.is_floating_point() or t.dtype is torch.bool else int(t.max()) + 1,
        )
        for name, t in batch.items()
    )
    inputs = next((batch[k] for k in ("input_ids", "pixel_values") if k in batch), None)
    if inputs is None:
        inputs = next(iter(batch.values()))
    sequence = next((batch[k] for k in ("labels", "input_ids") if k in batch), None)
    tokens = sequence[0].numel() if sequence is not None and sequence.dim() > 1 else 1
    return DataInfo(tuple(inputs.shape[1:]), num_classes, tokens, fields)


def num_samples(batch: Batch) -> int:
    return len(next(iter(batch.values())))


def take(batch: Batch, index: torch.Tensor | slice) -> Batch:
    return {name: tensor[index] for name, tensor in batch.items()}


def inputs_only(batch: Batch) -> Batch:
    """The batch without its labels: what an inference pass gets."""
    return {name: tensor for name, tensor in batch.items() if name not in LABELS}


def split(
    x: torch.Tensor, y: torch.Tensor, num_classes: int, test_fraction: float, seed: int
) -> SplitData:
    """Seeded shuffle, then hold out the last ``test_fraction`` of samples for evaluation."""
    return split_batch({INPUTS: x, TARGETS: y}, num_classes, test_fraction, seed)


def split_batch(batch: Batch, num_classes: int, test_fraction: float, seed: int) -> SplitData:
    count = num_samples(batch)
    order = torch.randperm(count, generator=torch.Generator().manual_seed(seed))
    n_test = max(1, round(count * test_fraction))
    test, train = order[:n_test], order[n_test:]
    return SplitData(take(batch, train), take(batch, test), num_classes)


def batches(data: Batch, batch_size: int, seed: int) -> Iterator[Batch]:
    """Endless epochs of shuffled full batches (the ragged tail is dropped so memory stays constant)."""
    count = num_samples(data)
    if batch_size > count:
        raise ValueError(
            f"batch_size {batch_size} is larger than the training split ({count} samples)"
        )
    generator = torch.Generator().manual_seed(seed)
    device = next(iter(data.values())).device
    while True:
        order = torch.randperm(count, generator=generator).to(device)
        for start in range(0, count - batch_size + 1, batch_size):
            yield take(data, order[start : start + batch_size])


def chunks(batch: Batch, parts: int) -> list[Batch]:
    """``parts`` micro-batches along the sample dimension."""
    pieces = {name: tensor.chunk(parts) for name, tensor in batch.items()}
    return [{name: pieces[name][i] for name in batch} for i in range(parts)]


def steps_per_epoch(num_samples: int, batch_size: int) -> int:
    return max(1, num_samples // batch_size)
