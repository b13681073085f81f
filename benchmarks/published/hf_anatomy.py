"""The dummy data of the Hugging Face transformers docs' "Model training anatomy" runs.

``docs/source/en/perf_train_gpu_one.mdx`` @ ``0016acf7`` (later split into
``model_memory_anatomy.md`` and ``perf_train_gpu_one.md``) trains
``AutoModelForSequenceClassification`` (bert-large-uncased, 2 labels) with the ``Trainer`` on::

    seq_len, dataset_size = 512, 512
    dummy_data = {
        "input_ids": np.random.randint(100, 30000, (dataset_size, seq_len)),
        "labels": np.random.randint(0, 1, (dataset_size)),
    }

(later versions draw the labels from ``randint(0, 2)``). No attention mask and no token type
ids: the Trainer hands the model ``input_ids`` and ``labels`` only, which is what this returns,
as int64 tensors (numpy's default integer on Linux, kept by ``set_format("pt")``).
"""

from __future__ import annotations

import torch


def dummy_classification_data(
    seed: int, count: int = 512, seq_len: int = 512, low: int = 100, high: int = 30000
) -> dict[str, torch.Tensor]:
    """``count`` samples of ``seq_len`` token ids in ``[low, high)`` and one binary label each."""
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(low, high, (count, seq_len), generator=generator)
    labels = torch.randint(0, 2, (count,), generator=generator)
    return {"input_ids": input_ids, "labels": labels}
