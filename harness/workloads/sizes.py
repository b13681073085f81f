"""How many training samples a built-in dataset has, known without loading it (or torch).

Why: a batch larger than the training split cannot be drawn, and finding out in the trial
costs a sweep its first minutes per point; the spec is checked against these numbers before
anything runs. They follow the loaders' own split rules exactly (``tensors.split_batch``,
``text.load``, ``tokens.load``), which the tests hold them to. Datasets read from files or
user code (``hf_dataset``, ``module:function``) are only known once loaded: ``None``.
"""

from __future__ import annotations

from typing import Any

from harness.contract import DEFAULT_TEST_FRACTION

DIGITS_SAMPLES = 1797  # scikit-learn's bundled digits
CIFAR10_TRAIN_SAMPLES = 50_000  # CIFAR-10's own training split (its test split is held out)
SYNTHETIC_SAMPLES = 2048  # harness.workloads.synthetic's default num_samples
TOKENS_SAMPLES = 512  # harness.workloads.tokens' default num_samples
DEFAULT_SEQ_LEN = 128


# The ``text`` dataset's ``corpus`` option: which of pydoc's topics (sorted by name) it reads.
# Two halves are two texts on different subjects: pre-train on one, fine-tune on the other.
CORPUS_PARTS = ("all", "first_half", "second_half")


def corpus_bytes(part: str = "all") -> bytes:
    """The ``text`` dataset's corpus: Python's bundled pydoc topics, as UTF-8 bytes; ``part``
    (``CORPUS_PARTS``) the first or second half of the topics by name, or all of them."""
    from pydoc_data.topics import topics

    names = sorted(topics)
    half = len(names) // 2
    chosen = {"all": names, "first_half": names[:half], "second_half": names[half:]}[part]
    return "\n\n".join(topics[key] for key in chosen).encode("utf-8")


def held_out(count: int, test_fraction: float) -> int:
    """Samples a seeded split holds out for evaluation (at least one)."""
    return max(1, round(count * test_fraction))


def training_samples(dataset: str, options: dict[str, Any]) -> int | None:
    """Samples in ``dataset``'s training split under ``options`` (a trial's dataset options:
    the spec's ``data`` keys, ``seq_len`` from the model where it has one), or None."""
    test_fraction = options.get("test_fraction") or DEFAULT_TEST_FRACTION
    if dataset == "digits":
        return DIGITS_SAMPLES - held_out(DIGITS_SAMPLES, test_fraction)
    if dataset == "cifar10":
        return CIFAR10_TRAIN_SAMPLES
    if dataset in ("synthetic", "tokens"):
        default = SYNTHETIC_SAMPLES if dataset == "synthetic" else TOKENS_SAMPLES
        count = int(options.get("num_samples") or default)
        return count - held_out(count, test_fraction)
    if dataset == "text":
        seq_len = int(options.get("seq_len") or DEFAULT_SEQ_LEN)
        cut = int(len(corpus_bytes(options.get("corpus") or "all")) * (1 - test_fraction))
        return max(0, (cut - 1) // seq_len)
    return None
