"""The published-runs benchmark's lit-gpt model: the two lit-gpt trees differ by exactly what
docs/accuracy.md says they differ by (RMSNorm's fp32 upcast), counted from what autograd keeps."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from benchmarks.published import litgpt_model
from benchmarks.published.litgpt_model import CONFIGS, TREES, litgpt_lora


def saved_bytes(model: torch.nn.Module, tokens: torch.Tensor) -> int:
    """Bytes of the distinct storages autograd keeps for backward, parameters and buffers aside."""
    own = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
    kept: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in own:
            kept[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(tokens)
    return sum(kept.values())


@pytest.fixture
def tiny_llama(monkeypatch: pytest.MonkeyPatch) -> str:
    """A two-layer Llama-2-shaped lit-gpt config (RMSNorm, SwiGLU, no biases)."""
    shape = dataclasses.replace(
        CONFIGS["Llama-2-7b-hf"],
        name="tiny-llama",
        n_layer=2,
        n_head=4,
        n_embd=64,
        intermediate_size=96,
        vocab_size=128,
        block_size=64,
    )
    monkeypatch.setitem(litgpt_model.CONFIGS, "tiny-llama", shape)
    return "tiny-llama"


def test_the_landed_tree_keeps_an_fp32_copy_of_each_rmsnorm_input(tiny_llama: str) -> None:
    torch.manual_seed(0)
    batch, steps, width, layers = 2, 24, 64, 2
    tokens = torch.randint(0, 128, (batch, steps))
    kept = {}
    for tree in TREES:
        model = litgpt_lora(None, config=tiny_llama, seq_len=steps, tree=tree)
        kept[tree] = saved_bytes(model, tokens)
    # Two norms a block and the final one; the first block's first norm keeps nothing in either
    # tree (its input, the frozen embedding's output, needs no gradient).
    norms = 2 * layers + 1 - 1
    # Each keeps its input (batch, steps, width) and its rsqrt (batch, steps, 1) as fp32 (4 B)
    # instead of bf16 (2 B); nothing else differs.
    per_norm = batch * steps * (width + 1) * (4 - 2)
    assert kept["0cc02afa"] - kept["8641822"] == norms * per_norm


def test_the_tree_is_checked(tiny_llama: str) -> None:
    with pytest.raises(ValueError, match="tree must be one of 8641822, 0cc02afa"):
        litgpt_lora(None, config=tiny_llama, seq_len=8, tree="main")
