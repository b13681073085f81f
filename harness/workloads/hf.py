"""``hf``: any Hugging Face ``transformers`` architecture from its config, random or pretrained.

Memory and speed do not depend on the weights' values, so by default nothing is downloaded: a
size names a shipped preset (``harness.workloads.hf_presets``), a local config (``config: PATH``,
a directory holding ``config.json`` or the file itself, relative to the spec), or a model id
resolved by transformers' own config loading (``model_id: ORG/NAME``: the local cache or, where
there is a network, the Hub). Every other knob overrides a config attribute
(``num_hidden_layers: 2``). The model is built with ``AutoModelFor<Task>.from_config`` and
``config.use_cache = False`` (training: a KV cache would only add memory).

Accuracy does depend on them: ``pretrained: true`` loads the weights of the ``model_id`` or of
the ``config`` folder (one saved by ``save_pretrained``) with ``from_pretrained``, into the same
config (overrides and the dataset's fit applied) and the dtype ``from_config`` would give. The
estimate never reads them (``harness.workloads.without_weights``): it builds from the config.

It trains as Hugging Face's ``Trainer`` runs a step: ``outputs = model(input_ids=...,
labels=...)`` (causal LMs take unshifted labels and shift them inside), ``outputs.loss`` is
backpropagated while ``outputs`` (with its logits) is still alive, as in a training script.
transformers is imported here only, when an ``hf`` trial builds its model.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from harness.workloads import find_file
from harness.workloads.hf_presets import HARNESS_KNOBS
from harness.workloads.libraries import import_library
from harness.workloads.task import Task, Workload, count_correct
from harness.workloads.tensors import INPUTS, TARGETS, Batch, DataInfo

AUTO_CLASSES = {
    "causal-lm": "AutoModelForCausalLM",
    "sequence-classification": "AutoModelForSequenceClassification",
    "image-classification": "AutoModelForImageClassification",
}


def import_transformers() -> Any:
    transformers = import_library("transformers", "model family hf")
    transformers.logging.set_verbosity_error()
    return transformers


def load_config(knobs: dict[str, Any], search: list[str]) -> Any:
    """The config the knobs describe: preset attributes (already merged into the knobs), a
    local config file or directory, or a model id; then the overrides."""
    transformers = import_transformers()
    overrides = {k: v for k, v in knobs.items() if k not in HARNESS_KNOBS}
    if "config" in knobs:
        found = Path(find_file(str(knobs["config"]), search, "hf config"))
        if found.is_file():
            values = json.loads(found.read_text())
            config = transformers.AutoConfig.for_model(values.pop("model_type"), **values)
        else:
            config = transformers.AutoConfig.from_pretrained(str(found))
    elif "model_id" in knobs:
        config = transformers.AutoConfig.from_pretrained(str(knobs["model_id"]))
    else:
        if "model_type" not in overrides:
            raise ValueError("an hf size needs preset, config, model_id or model_type")
        return transformers.AutoConfig.for_model(overrides.pop("model_type"), **overrides)
    for key, value in overrides.items():
        setattr(config, key, value)
    return config


def weights_source(knobs: dict[str, Any], search: list[str]) -> str:
    """Where ``pretrained: true`` loads from: the model id, or the config folder (a config
    file alone holds no weights)."""
    if "model_id" in knobs:
        return str(knobs["model_id"])
    if "config" not in knobs:
        raise ValueError("pretrained: true needs model_id or config (a save_pretrained folder)")
    found = Path(find_file(str(knobs["config"]), search, "hf config"))
    if not found.is_dir():
        raise ValueError(
            f"pretrained: true needs config to name a folder saved by save_pretrained, not the "
            f"file {str(found)!r}"
        )
    return str(found)


def load_weights(auto: Any, config: Any, source: str, task: str, attention: str) -> Any:
    """``from_pretrained`` into ``config`` in the dtype ``from_config`` would build.

    A classifier may start its head fresh (a label count other than the dataset's, or a
    language model's checkpoint: transformers' ``ignore_mismatched_sizes``, as fine-tuning on
    new labels does); a causal LM must take every weight, else the trial ends naming them (an
    override that changes a shape would otherwise train a half-random model unnoticed).
    """
    model, loading = auto.from_pretrained(
        source,
        config=config,
        attn_implementation=attention,
        dtype=config.dtype or torch.get_default_dtype(),
        ignore_mismatched_sizes=True,  # checked below, naming the weights
        output_loading_info=True,
    )
    if task == "causal-lm":
        misfits = [
            f"{kind.removesuffix('_keys')}: {', '.join(sorted(map(str, keys))[:3])}"
            for kind, keys in loading.items()
            if keys and kind in ("missing_keys", "unexpected_keys", "mismatched_keys")
        ]
        if misfits:
            raise ValueError(
                f"the weights in {source} do not fit the size's config ({'; '.join(misfits)})"
            )
    return model


def default_task(config: Any) -> str:
    """From the architecture the config names, else causal-lm."""
    for architecture in getattr(config, "architectures", None) or []:
        if architecture.endswith("ForImageClassification"):
            return "image-classification"
        if architecture.endswith("ForSequenceClassification"):
            return "sequence-classification"
    return "causal-lm"


def fit_to_data(config: Any, task: str, data: DataInfo, seq_len: int) -> None:
    """Set what the dataset decides (labels, image size, channels) and check what it needs."""
    if task == "image-classification":
        channels, height, width = data.input_shape
        if height != width:
            raise ValueError(
                f"hf image models take square images; the dataset gives {height}x{width}"
            )
        config.num_labels, config.image_size, config.num_channels = (
            data.num_classes,
            height,
            channels,
        )
        return
    if task == "sequence-classification":
        config.num_labels = data.num_classes
        return
    vocab = getattr(config, "vocab_size", None)
    if vocab is not None and data.num_classes > vocab:
        raise ValueError(f"the dataset's {data.num_classes} tokens exceed vocab_size {vocab}")
    positions = getattr(config, "max_position_embeddings", None) or getattr(
        config, "n_positions", None
    )
    if positions is not None and seq_len > positions:
        raise ValueError(f"seq_len {seq_len} exceeds the model's {positions} positions")


def build(data: DataInfo, python_path: list[str] | None = None, **knobs: Any) -> Workload:
    transformers = import_transformers()
    config = load_config(knobs, python_path or [])
    task = str(knobs.get("task") or default_task(config))
    attention = str(knobs.get("attn_implementation", "sdpa"))
    fit_to_data(config, task, data, int(knobs.get("seq_len", data.input_shape[0])))
    config.use_cache = False  # training: no KV cache
    auto = getattr(transformers, AUTO_CLASSES[task])
    if knobs.get("pretrained"):
        source = weights_source(knobs, python_path or [])
        model = load_weights(auto, config, source, task, attention)
    else:
        model = auto.from_config(config, attn_implementation=attention)
    notes = {
        "hf_architecture": type(model).__name__,
        "hf_task": task,
        "attn_implementation": model.config._attn_implementation,
    }
    return Workload(model, HuggingFace(task), notes)


class HuggingFace(Task):
    """A transformers model called as its Trainer calls it: named inputs and labels in,
    ``outputs.loss`` out, ``outputs`` alive until backward is done.

    Built-in data (``x``, ``y``) become ``input_ids`` (``pixel_values`` for images) and
    ``labels`` (the input ids themselves for a causal LM: the model shifts them). Named data (a
    Hugging Face dataset's ``input_ids``, ``attention_mask``, ``labels``) are passed as they
    are. Accuracy counts next-token (causal LM) or class predictions where the label is not
    -100.
    """

    def __init__(self, task: str) -> None:
        self.task = task
        self.causal = task == "causal-lm"

    def inputs(self, batch: Batch, labels: bool) -> dict[str, torch.Tensor]:
        if INPUTS in batch:
            name = "pixel_values" if self.task == "image-classification" else "input_ids"
            named = {name: batch[INPUTS]}
            if labels:
                named["labels"] = batch[INPUTS] if self.causal else batch[TARGETS]
            return named
        named = {k: v for k, v in batch.items() if labels or k != "labels"}
        if labels and "labels" not in named and self.causal:
            named["labels"] = batch["input_ids"]
        return named

    def outputs(self, model: nn.Module, batch: Batch) -> Any:
        return model(**self.inputs(batch, labels=False))

    def forward(self, model: nn.Module, batch: Batch) -> tuple[torch.Tensor, Any]:
        outputs = model(**self.inputs(batch, labels=True))
        return outputs.loss, outputs

    def score(self, model: nn.Module, batch: Batch) -> tuple[int, float, int]:
        named = self.inputs(batch, labels=True)
        outputs = model(**named)
        correct, count = count_correct(outputs.logits, named["labels"], self.causal)
        return correct, float(outputs.loss.item()) * count, count
