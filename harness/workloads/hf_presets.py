"""Shipped configs of well-known Hugging Face models, written from their public ``config.json``
numbers (no download needed): a spec size says ``{preset: NAME}`` and may override any
attribute beside it. Plain data, so a spec validates without importing transformers.

``PUBLISHED_PARAMS`` is each model's published parameter count; a test builds every preset
(on the meta device) and checks ``num_params`` within 1 % of it, so a wrong number here is
caught.
"""

from __future__ import annotations

from typing import Any, Literal, get_args

_LLAMA3_ROPE = {"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0}

HF_PRESETS: dict[str, dict[str, Any]] = {
    "llama-3.2-1b": {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 128256,
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": {**_LLAMA3_ROPE, "factor": 32.0, "original_max_position_embeddings": 8192},
        "tie_word_embeddings": True,
    },
    "llama-3.2-3b": {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 128256,
        "hidden_size": 3072,
        "intermediate_size": 8192,
        "num_hidden_layers": 28,
        "num_attention_heads": 24,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": {**_LLAMA3_ROPE, "factor": 32.0, "original_max_position_embeddings": 8192},
        "tie_word_embeddings": True,
    },
    "llama-3.1-8b": {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 128256,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": {**_LLAMA3_ROPE, "factor": 8.0, "original_max_position_embeddings": 8192},
        "tie_word_embeddings": False,
    },
    "qwen2.5-0.5b": {
        "model_type": "qwen2",
        "architectures": ["Qwen2ForCausalLM"],
        "vocab_size": 151936,
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": True,
    },
    "qwen2.5-7b": {
        "model_type": "qwen2",
        "architectures": ["Qwen2ForCausalLM"],
        "vocab_size": 152064,
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": False,
    },
    "mistral-7b": {  # Mistral-7B-v0.1
        "model_type": "mistral",
        "architectures": ["MistralForCausalLM"],
        "vocab_size": 32000,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "sliding_window": 4096,
        "tie_word_embeddings": False,
    },
    "gpt2": {
        "model_type": "gpt2",
        "architectures": ["GPT2LMHeadModel"],
        "vocab_size": 50257,
        "n_positions": 1024,
        "n_embd": 768,
        "n_layer": 12,
        "n_head": 12,
    },
    "vit-base": {  # google/vit-base-patch16-224 (ImageNet-1k head)
        "model_type": "vit",
        "architectures": ["ViTForImageClassification"],
        "hidden_size": 768,
        "num_hidden_layers": 12,
        "num_attention_heads": 12,
        "intermediate_size": 3072,
        "image_size": 224,
        "patch_size": 16,
        "num_channels": 3,
        "num_labels": 1000,
    },
}

PUBLISHED_PARAMS: dict[str, float] = {
    "llama-3.2-1b": 1.24e9,
    "llama-3.2-3b": 3.21e9,
    "llama-3.1-8b": 8.03e9,
    "qwen2.5-0.5b": 0.494e9,
    "qwen2.5-7b": 7.62e9,
    "mistral-7b": 7.24e9,
    "gpt2": 124e6,
    "vit-base": 86.6e6,
}

TASKS = ("causal-lm", "sequence-classification", "image-classification")
HFDatasetFormat = Literal["parquet", "json", "csv", "text"]
HF_DATASET_FORMATS: tuple[HFDatasetFormat, ...] = get_args(HFDatasetFormat)
ATTENTION = ("sdpa", "eager", "flash_attention_2", "flash_attention_3", "flex_attention")
# Knobs the harness reads itself; every other knob of an `hf` size overrides a config attribute.
SOURCES = ("preset", "config", "model_id")
HARNESS_KNOBS = (*SOURCES, "task", "attn_implementation", "seq_len", "pretrained")
