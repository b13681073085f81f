"""A spec from one command line: ``harness plan --model llama-3.1-8b --card rtx-4090``.

A person asking "will this model fine-tune on my card, and how?" should not have to write YAML
first. ``--model`` names a shipped Hugging Face preset (``llama-3.1-8b``), a folder holding a
``config.json`` (a ``save_pretrained`` folder), or a hub id (``Qwen/Qwen2.5-7B``: read from
transformers' local cache); the rest is what a fine-tuning plan usually compares. The spec is
written out (``results/specs/NAME.yaml``) and loaded like any other, so the answer is the
same one a spec file gives, and the file is there to edit when one flag is not enough.

Plain data, no torch: the spec layer stays importable without it.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from harness.spec.errors import SpecError
from harness.workloads.hf_presets import HF_PRESETS

# What a fine-tuning plan compares when --strategies is not given: full fine-tuning with and
# without recomputation, LoRA and QLoRA with and without it (llama8b_plan.yaml's first seven,
# less sac and chunked_ce, which it keeps for a spec that asks for them).
DEFAULT_STRATEGIES: tuple[str, ...] = (
    "none",
    "checkpoint",
    "lora:16",
    "lora:16+checkpoint",
    "qlora:16",
    "qlora:16+checkpoint",
)
DEFAULT_BATCH_SIZES: tuple[int, ...] = (1, 2, 4, 8)
DEFAULT_SEQ_LEN = 2048
DEFAULT_VOCAB = 32000  # a hub model's tokens when its vocabulary is not known here
SPECS_DIR = Path("results") / "specs"


def model_knobs(model: str) -> tuple[str, dict[str, Any], int]:
    """``--model`` as an hf size: its name, its knobs and its vocabulary size (for the
    synthetic token data)."""
    name = model.strip()
    if name in HF_PRESETS:
        return name, {"preset": name}, int(HF_PRESETS[name].get("vocab_size", DEFAULT_VOCAB))
    folder = Path(name).expanduser()
    if folder.is_dir():
        if not (folder / "config.json").is_file():
            raise SpecError(f"--model {model}: the folder has no config.json")
        vocab = read_vocab(folder / "config.json")
        return size_name(folder.resolve().name), {"config": str(folder.resolve())}, vocab
    if re.fullmatch(r"[\w.-]+/[\w.-]+", name):
        return size_name(name.split("/")[-1]), {"model_id": name}, DEFAULT_VOCAB
    presets = ", ".join(HF_PRESETS)
    raise SpecError(
        f"--model {model}: not a preset ({presets}), a folder with a config.json, nor a hub "
        "id ORG/NAME"
    )


def read_vocab(config: Path) -> int:
    import json

    try:
        vocab = json.loads(config.read_text()).get("vocab_size")
    except (OSError, ValueError) as error:
        raise SpecError(f"{config}: not a readable config.json ({error})") from None
    return int(vocab) if isinstance(vocab, int) and vocab > 1 else DEFAULT_VOCAB


def positions(knobs: dict[str, Any], preset: dict[str, Any]) -> int:
    """How many positions the model embeds (a preset's or a config folder's), so the default
    sequence fits a model of fewer than 2048 (gpt2: 1024); DEFAULT_SEQ_LEN where unknown."""
    config = preset
    if "config" in knobs:
        import json

        try:
            config = json.loads((Path(knobs["config"]) / "config.json").read_text())
        except (OSError, ValueError):
            config = {}
    for key in ("max_position_embeddings", "n_positions"):
        value = config.get(key)
        if isinstance(value, int) and value > 0:
            return value
    return DEFAULT_SEQ_LEN


def size_name(text: str) -> str:
    """A size or experiment name the spec allows (letters, digits, ``_-.``, starting with a
    letter or digit)."""
    cleaned = re.sub(r"[^A-Za-z0-9_.-]+", "-", text).strip("-_.")
    return cleaned.lower() or "model"


def strategy_entries(text: str | None) -> list[Any]:
    """``--strategies none,checkpoint,lora:16+checkpoint``: entries by comma, a combination's
    strategies joined by ``+`` (as tables print them)."""
    entries = [e.strip() for e in (text.split(",") if text else DEFAULT_STRATEGIES)]
    out: list[Any] = []
    for entry in filter(None, entries):
        parts = [p.strip() for p in entry.split("+") if p.strip()]
        out.append(parts[0] if len(parts) == 1 else parts)
    if not out:
        raise SpecError("--strategies: no strategy given (e.g. none,lora:16+checkpoint)")
    return out


def oneshot_spec(
    model: str,
    *,
    seq_len: int | None = None,
    strategies: str | None = None,
    batch_sizes: list[int] | None = None,
    dtype: str = "bf16",
    card: str | None = None,
) -> dict[str, Any]:
    """The spec ``--model`` stands for, as a YAML-ready mapping."""
    size, knobs, vocab = model_knobs(model)
    preset = HF_PRESETS.get(knobs.get("preset", ""), {})
    if "image_size" in preset:  # a vision preset (vit-base): images of its size, its classes
        if seq_len is not None:
            raise SpecError(f"--seq-len: {model} takes images, not sequences")
        side = int(preset["image_size"])
        data: dict[str, Any] = {
            "dataset": "synthetic",
            "shape": [int(preset.get("num_channels", 3)), side, side],
            "num_classes": int(preset.get("num_labels", 1000)),
        }
    else:
        knobs["seq_len"] = seq_len or min(DEFAULT_SEQ_LEN, positions(knobs, preset))
        data = {"dataset": "tokens", "vocab_size": vocab}
    spec: dict[str, Any] = {
        "name": f"plan-{size}",
        "description": f"{model}: what fits and trains fastest (written by --model)",
        "model": {"family": "hf", "sizes": {size: knobs}},
        "data": data,
        "grid": {
            "batch_size": list(batch_sizes or DEFAULT_BATCH_SIZES),
            "dtype": [dtype],
            "strategy": strategy_entries(strategies),
        },
        "train": {
            "optimizer": {"name": "adamw", "lr": 2.0e-4},
            "lora": {"alpha": 32, "dropout": 0.0},
            "budget": {"steps": 100},
        },
        "device": "cuda",
    }
    if card:
        spec["card"] = card
    return spec


def write_oneshot(spec: dict[str, Any], folder: Path = SPECS_DIR) -> Path:
    """The spec as a file (``folder/NAME.yaml``), so it loads, reads and edits as any other."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{spec['name']}.yaml"
    header = (
        f"# Written by harness --model {spec['description'].split(':')[0]}; edit it and pass it "
        "as SPEC to change what one flag cannot.\n"
    )
    path.write_text(header + yaml.safe_dump(spec, sort_keys=False, default_flow_style=None))
    return path
