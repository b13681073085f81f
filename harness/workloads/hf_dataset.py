"""``hf_dataset``: a Hugging Face ``datasets`` dataset read from local files.

``datasets.load_dataset(format, data_files=...)`` with ``format`` one of parquet, json, csv or
text (paths relative to the spec's folder or the working directory). Two kinds:

- **text** (``text_column``, default ``text``): every row tokenized, by a local tokenizer
  folder (``tokenizer: PATH``, read with ``AutoTokenizer``) or as UTF-8 bytes (``tokenizer:
  bytes``, the default), rows joined (with the tokenizer's end-of-text token, if it has one)
  and packed into non-overlapping windows of ``seq_len + 1`` tokens: inputs the first
  ``seq_len``, targets shifted by one, as in ``text``; the last ``test_fraction`` of the
  windows held out. The vocabulary is the tokenizer's.
- **images** (``image_column`` with ``label_column``, default ``label``): pixels scaled to
  [0, 1] as (channels, height, width), labels as classes; a seeded ``test_fraction`` held out.

Nothing is cached on disk (the data is read into memory, like every dataset here). datasets
(and transformers, for a tokenizer folder) are imported here only.
"""

from __future__ import annotations

import tempfile
from typing import Any

import torch

from harness.contract import DEFAULT_TEST_FRACTION
from harness.workloads import find_file
from harness.workloads.libraries import import_library
from harness.workloads.tensors import INPUTS, TARGETS, DataInfo, SplitData, split
from harness.workloads.text import windows

BYTES = "bytes"


def _import(name: str) -> Any:
    return import_library(name, "dataset hf_dataset")


def read_rows(options: dict[str, Any], search: list[str]) -> Any:
    datasets = _import("datasets")
    datasets.disable_progress_bars()
    files = options.get("data_files")
    if not files:
        raise ValueError("hf_dataset needs data.data_files (a file or a list of files)")
    files = [files] if isinstance(files, str) else list(files)
    with tempfile.TemporaryDirectory() as cache:
        return datasets.load_dataset(
            options.get("format") or "parquet",
            data_files=[find_file(f, search, "hf_dataset file") for f in files],
            split="train",
            cache_dir=cache,
            keep_in_memory=True,
        )


def tokenizer_for(options: dict[str, Any], search: list[str]) -> Any:
    name = options.get("tokenizer") or BYTES
    if name == BYTES:
        return None
    transformers = _import("transformers")
    return transformers.AutoTokenizer.from_pretrained(find_file(name, search, "tokenizer"))


def vocabulary(tokenizer: Any) -> int:
    return 256 if tokenizer is None else len(tokenizer)


def token_stream(texts: list[str], tokenizer: Any) -> torch.Tensor:
    if tokenizer is None:
        joined = "\n".join(texts).encode("utf-8")
        return torch.frombuffer(bytearray(joined), dtype=torch.uint8).long()
    ids: list[int] = []
    separator = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    for encoded in tokenizer(texts, add_special_tokens=False)["input_ids"]:
        ids.extend(encoded + separator)
    return torch.tensor(ids, dtype=torch.long)


def describe(options: dict[str, Any], search: list[str]) -> DataInfo:
    if options.get("image_column"):
        return load(options, 0, search).info
    seq_len = int(options.get("seq_len") or 128)
    return DataInfo((seq_len,), vocabulary(tokenizer_for(options, search)), seq_len)


def load(options: dict[str, Any], seed: int, search: list[str]) -> SplitData:
    rows = read_rows(options, search)
    fraction = options.get("test_fraction", DEFAULT_TEST_FRACTION)
    image_column = options.get("image_column")
    if image_column:
        import numpy as np

        label_column = options.get("label_column") or "label"
        images = [
            torch.as_tensor(np.asarray(image, dtype=np.float32)) for image in rows[image_column]
        ]
        pixels = torch.stack(
            [i.unsqueeze(0) if i.dim() == 2 else i.permute(2, 0, 1) for i in images]
        )
        labels = torch.as_tensor(rows[label_column], dtype=torch.long)
        return split(pixels / 255.0, labels, int(labels.max()) + 1, fraction, seed)
    texts = rows[options.get("text_column") or "text"]
    tokenizer = tokenizer_for(options, search)
    tokens = token_stream([t for t in texts if t], tokenizer)
    seq_len = int(options.get("seq_len") or 128)
    train, test = packed_split(tokens, seq_len, fraction)
    return SplitData(
        {INPUTS: train[0], TARGETS: train[1]},
        {INPUTS: test[0], TARGETS: test[1]},
        vocabulary(tokenizer),
    )


def packed_split(
    tokens: torch.Tensor, seq_len: int, fraction: float
) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """Windows of the token stream; the last ``fraction`` of it held out (contiguous)."""
    cut = int(len(tokens) * (1 - fraction))
    return windows(tokens[:cut], seq_len), windows(tokens[cut:], seq_len)
