"""Registries of model families and datasets.

The registries themselves are plain data (no torch import), so the sweep layer can validate a spec
against them without loading model code; ``build_workload`` / ``load_dataset`` import the one module
they need. Adding a family or dataset: one module plus one entry here.
"""

from __future__ import annotations

import importlib
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.workloads.hf_presets import ATTENTION, HF_PRESETS, SOURCES, TASKS


@dataclass(frozen=True)
class Knob:
    """One size knob of a model family: an integer >= ``minimum``, optionally from a fixed set."""

    name: str
    doc: str
    choices: tuple[int, ...] = ()
    minimum: int = 1


@dataclass(frozen=True)
class Family:
    name: str
    doc: str
    builder: str  # "module:function" taking (data: DataInfo, **knobs)
    knobs: tuple[Knob, ...]
    defaults: dict[str, Any] = field(default_factory=dict)
    # Named sizes: a spec size may say {preset: NAME} and override single knobs beside it.
    presets: dict[str, dict[str, Any]] = field(default_factory=dict)
    datasets: tuple[str, ...] = ("digits", "cifar10", "synthetic")  # what it can train on
    divisible: tuple[tuple[str, str], ...] = ()  # (a, b): knob a must be a multiple of knob b
    # String knobs: name -> allowed values (empty: any text).
    text_knobs: dict[str, tuple[str, ...]] = field(default_factory=dict)
    # Any other knob is passed through to the library (a config attribute, a constructor
    # keyword); a size must then name one of `sources` (or a preset).
    free_knobs: bool = False
    sources: tuple[str, ...] = ()
    exclusive: tuple[str, ...] = ()  # sources of which a size may give only one
    # The builder also gets python_path=[spec folder, working directory] to find files.
    locates_files: bool = False
    # Knobs that name where `pretrained: true` loads weights from (empty: no weights to load).
    weights: tuple[str, ...] = ()

    @property
    def knob_names(self) -> list[str]:
        return [k.name for k in self.knobs] + list(self.text_knobs)


@dataclass(frozen=True)
class DatasetInfo:
    name: str
    doc: str
    loader: str  # "module:function" taking (options, seed) -> SplitData
    options: tuple[str, ...] = ()
    locates_files: bool = False  # the loader also gets search=[spec folder, working directory]


FAMILIES: dict[str, Family] = {
    "cnn": Family(
        "cnn",
        "the seed article's CNN: two conv+ReLU+maxpool blocks, then a linear head",
        "harness.workloads.cnn:build",
        (Knob("width", "channels of the first conv block (the second has 2x)"),),
        {"width": 16},
    ),
    "mlp": Family(
        "mlp",
        "flatten, then `depth` hidden Linear+ReLU layers of `width` units, then a linear head",
        "harness.workloads.mlp:build",
        (Knob("width", "units per hidden layer"), Knob("depth", "number of hidden layers")),
        {"width": 128, "depth": 2},
    ),
    "resnet": Family(
        "resnet",
        "torchvision ResNet (18/34/50/101/152), stem adapted to the dataset's channels",
        "harness.workloads.resnet:build",
        (Knob("depth", "ResNet depth", (18, 34, 50, 101, 152)),),
        {"depth": 18},
    ),
}

GPT_PRESETS: dict[str, dict[str, int]] = {
    # Byte-level vocabulary (256): parameters are ~12 * n_layer * d_model^2 plus embeddings.
    "tiny": {"n_layer": 2, "d_model": 64, "n_head": 2, "seq_len": 64},
    "small": {"n_layer": 4, "d_model": 128, "n_head": 4, "seq_len": 128},
    "medium": {"n_layer": 8, "d_model": 256, "n_head": 8, "seq_len": 256},
    "gpt2-124m": {"n_layer": 12, "d_model": 768, "n_head": 12, "seq_len": 1024},
    "gpt2-350m": {"n_layer": 24, "d_model": 1024, "n_head": 16, "seq_len": 1024},
    "gpt2-774m": {"n_layer": 36, "d_model": 1280, "n_head": 20, "seq_len": 1024},
    "gpt2-1.5b": {"n_layer": 48, "d_model": 1600, "n_head": 25, "seq_len": 1024},
    "7b": {"n_layer": 32, "d_model": 4096, "n_head": 32, "seq_len": 2048},
    "13b": {"n_layer": 40, "d_model": 5120, "n_head": 40, "seq_len": 2048},
}
FAMILIES["gpt"] = Family(
    "gpt",
    "decoder-only transformer: token + position embeddings, n_layer pre-norm blocks of causal "
    "self-attention + 4*d_model GELU MLP, final LayerNorm, head tied to the token embedding or not",
    "harness.workloads.gpt:build",
    (
        Knob("n_layer", "transformer blocks"),
        Knob("d_model", "hidden size (divisible by n_head)"),
        Knob("n_head", "attention heads"),
        Knob("seq_len", "tokens per sample (also the text dataset's window)"),
        Knob("tied", "1: the output head shares the token embedding; 0: its own matrix", (0, 1), 0),
    ),
    {"n_layer": 4, "d_model": 128, "n_head": 4, "seq_len": 128, "tied": 1},
    GPT_PRESETS,
    datasets=("text", "tokens", "hf_dataset"),
    divisible=(("d_model", "n_head"),),
)

FAMILIES["hf"] = Family(
    "hf",
    "any Hugging Face transformers architecture from its config: a shipped preset, a local "
    "config (file or folder, relative to the spec) or a model id; random weights, or with "
    "pretrained: true those of the model id or config folder; any other knob overrides a "
    "config attribute",
    "harness.workloads.hf:build",
    (Knob("seq_len", "tokens per sample (the text or tokens dataset's window)"),),
    {"attn_implementation": "sdpa"},
    HF_PRESETS,
    datasets=("text", "tokens", "hf_dataset", "digits", "cifar10", "synthetic"),
    text_knobs={"task": TASKS, "attn_implementation": ATTENTION, "config": (), "model_id": ()},
    free_knobs=True,
    sources=(*SOURCES, "model_type"),
    exclusive=SOURCES,
    locates_files=True,
    weights=("model_id", "config"),
)
FAMILIES["timm"] = Family(
    "timm",
    "any timm image model by name (timm.create_model), untrained or with pretrained: true "
    "loaded from pretrained_file; the dataset sets num_classes, in_chans and img_size; any "
    "other knob is a create_model keyword",
    "harness.workloads.timm_models:build",
    (),
    datasets=("digits", "cifar10", "synthetic", "hf_dataset"),
    text_knobs={"name": (), "pretrained_file": ()},
    free_knobs=True,
    sources=("name",),
    locates_files=True,
    weights=("pretrained_file",),
)

DATASETS: dict[str, DatasetInfo] = {
    "digits": DatasetInfo(
        "digits",
        "scikit-learn's bundled 8x8 handwritten digits (1,797 images, 10 classes); offline",
        "harness.workloads.digits:load",
        ("test_fraction",),
    ),
    "cifar10": DatasetInfo(
        "cifar10",
        "CIFAR-10 (50,000 + 10,000 32x32 colour images, its own test split held out); "
        "downloaded by torchvision into data_dir",
        "harness.workloads.cifar10:load",
        ("data_dir", "download"),
    ),
    "synthetic": DatasetInfo(
        "synthetic",
        "random tensors of a given shape and class count, for pure memory/speed runs",
        "harness.workloads.synthetic:load",
        ("shape", "num_classes", "num_samples", "test_fraction"),
    ),
    "text": DatasetInfo(
        "text",
        "byte-level tokens of Python's bundled pydoc_data topics (about 466 KB of English); "
        "windows of seq_len + 1 bytes, the last test_fraction of the text held out; offline; "
        "corpus: first_half or second_half of the topics (by name) for two texts",
        "harness.workloads.text:load",
        ("test_fraction", "seq_len", "corpus"),
    ),
    "tokens": DatasetInfo(
        "tokens",
        "random token ids (vocab_size, seq_len, num_samples) for pure memory/speed runs of "
        "large-vocabulary models",
        "harness.workloads.tokens:load",
        ("vocab_size", "seq_len", "num_samples", "test_fraction"),
    ),
    "hf_dataset": DatasetInfo(
        "hf_dataset",
        "a Hugging Face datasets dataset from local files (parquet, json, csv or text): text "
        "tokenized by a local tokenizer (or bytes) and packed into seq_len windows, or images "
        "with labels; the last test_fraction held out",
        "harness.workloads.hf_dataset:load",
        (
            "format",
            "data_files",
            "text_column",
            "image_column",
            "label_column",
            "tokenizer",
            "seq_len",
            "test_fraction",
        ),
        locates_files=True,
    ),
}


def is_user_code(name: str) -> bool:
    """User code (a model family, a dataset, a loss) is named ``package.module:attribute``."""
    module, sep, attr = name.partition(":")
    return bool(sep and module and attr)


def find_file(path: str, search: list[str], what: str) -> str:
    """``path`` as given (absolute, or from the working directory), else relative to each of
    ``search`` (the spec's folder first): where a spec's files are looked for."""
    for candidate in [Path(path)] + [Path(folder) / path for folder in search]:
        if candidate.exists():
            return str(candidate)
    raise FileNotFoundError(f"{what} {path!r} not found (looked in: {', '.join(search)})")


def resolve(path: str, python_path: list[str] | None = None) -> Any:
    """Import ``module:attr``, looking also in ``python_path`` (user code next to a spec).

    Those folders go to the end of ``sys.path``: a user file named like a standard-library or
    installed module (``types.py``, ``torch.py``) must not replace it for the whole trial.
    """
    for entry in python_path or []:
        if entry not in sys.path:
            sys.path.append(entry)
    module_name, _, attr = path.partition(":")
    module = importlib.import_module(module_name)
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ImportError(f"module {module_name!r} has no attribute {attr!r}") from None


def resolve_knobs(family: str, knobs: dict[str, Any]) -> dict[str, Any]:
    """The family's defaults, then the named preset (if any), then the knobs given explicitly."""
    if family not in FAMILIES:
        return dict(knobs)  # user code: passed through as given
    known = FAMILIES[family]
    given = dict(knobs)
    preset = known.presets.get(given.pop("preset", None) or "", {})
    return {**known.defaults, **preset, **given}


def without_weights(knobs: dict[str, Any]) -> dict[str, Any]:
    """The knobs of the same model built from its config alone: what the estimate builds, since
    weights' values change no byte and reading them (gigabytes) would cost more than the
    estimate itself."""
    return {k: v for k, v in knobs.items() if k != "pretrained"}


def build_workload(
    family: str,
    knobs: dict[str, Any],
    data: Any,
    python_path: list[str] | None = None,
    loss: str | None = None,
) -> Any:
    """Build the family's model for the dataset described by ``data`` (a ``DataInfo``), with
    the task it trains on (``harness.workloads.task``).

    A family's builder returns an ``nn.Module`` that maps ``x`` to logits, or a whole
    ``Workload``. A user family ``module:attr`` is called as ``attr(data=DataInfo, **knobs)``
    and trains as ``UserModel`` says, with the user's ``loss`` (``module:function``) if given.
    """
    from harness.workloads.task import Logits, UserModel, Workload

    if family in FAMILIES:
        known = FAMILIES[family]
        paths = {"python_path": python_path or []} if known.locates_files else {}
        built = resolve(known.builder)(data, **resolve_knobs(family, knobs), **paths)
        task = Logits()
    elif is_user_code(family):
        built = resolve(family, python_path)(data=data, **knobs)
        task = UserModel(resolve(loss, python_path) if loss else None)
    else:
        raise ValueError(f"unknown model family {family!r}")
    return built if isinstance(built, Workload) else Workload(built, task)


def describe_dataset(
    name: str, options: dict[str, Any], search: list[str] | None = None, seed: int = 0
) -> Any:
    """The dataset's ``DataInfo`` (shapes, classes) without loading it where it can: what
    estimates need. User data is loaded to be described."""
    if is_user_code(name):
        return load_dataset(name, options, seed, search).info
    info = known_dataset(name)
    paths = {"search": search or []} if info.locates_files else {}
    return resolve(info.loader.replace(":load", ":describe"))(options, **paths)


def load_dataset(
    name: str, options: dict[str, Any], seed: int, search: list[str] | None = None
) -> Any:
    """Load the dataset's train/held-out ``SplitData`` on the CPU; ``search`` is where
    relative paths and user code are looked for (the spec's folder, the working directory)."""
    if is_user_code(name):
        from harness.workloads.user_data import load_user_data

        return load_user_data(resolve(name, search), options, seed)
    info = known_dataset(name)
    paths = {"search": search or []} if info.locates_files else {}
    return resolve(info.loader)(options, seed, **paths)


def known_dataset(name: str) -> DatasetInfo:
    if name not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}; allowed: {', '.join(DATASETS)}")
    return DATASETS[name]
