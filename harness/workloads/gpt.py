"""A nanoGPT-style decoder-only transformer; size knobs n_layer, d_model, n_head, seq_len.

Pre-norm blocks (LayerNorm -> causal self-attention -> residual, LayerNorm -> 4x GELU MLP ->
residual), learned position embeddings, a final LayerNorm and a linear head over the vocabulary,
optionally tied to the token embedding. ``blocks`` is an ``nn.ModuleList`` so strategies such as
checkpointing can find the repeated unit.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from harness.workloads.tensors import DataInfo


class CausalSelfAttention(nn.Module):
    """Heads are counted from ``qkv``'s output, not fixed: under tensor parallelism each rank's
    ``qkv`` yields its own heads' queries, keys and values (``harness.strategies.tensor_parallel``)."""

    def __init__(self, d_model: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.head_dim = d_model // n_head
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        shape = (batch, seq, -1, self.head_dim)
        q, k, v = (t.reshape(shape).transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(out.transpose(1, 2).reshape(batch, seq, -1))


class MLP(nn.Module):
    def __init__(self, d_model: int, hidden: int | None = None) -> None:
        super().__init__()
        hidden = hidden or 4 * d_model
        self.fc = nn.Linear(d_model, hidden)
        self.proj = nn.Linear(hidden, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, d_model: int, n_head: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_head)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = MLP(d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(
        self, vocab: int, n_layer: int, d_model: int, n_head: int, seq_len: int, tied: bool
    ):
        super().__init__()
        self.seq_len = seq_len
        tok_emb = nn.Embedding(vocab, d_model)
        self.tok_emb: nn.Embedding | None = tok_emb
        self.pos_emb: nn.Embedding | None = nn.Embedding(seq_len, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)
        if tied:
            self.head.weight = tok_emb.weight

    def forward(self, idx: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """``positions``: each token's place in its sequence, where ``idx`` holds a part of
        each sequence (context parallelism); else 0, 1, ... A pipeline stage other than the
        first has no embeddings: it takes the previous stage's hidden states."""
        if self.tok_emb is None:
            x = idx
        else:
            assert self.pos_emb is not None
            if positions is None:
                positions = torch.arange(idx.shape[1], device=idx.device)
            x = self.tok_emb(idx) + self.pos_emb(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def build(
    data: DataInfo,
    n_layer: int = 4,
    d_model: int = 128,
    n_head: int = 4,
    seq_len: int = 128,
    tied: int = 1,
) -> nn.Module:
    if len(data.input_shape) != 1:
        raise ValueError(
            f"gpt needs token sequences (seq_len,); the dataset gives {data.input_shape}"
        )
    if data.input_shape[0] > seq_len:
        raise ValueError(
            f"the dataset's sequences ({data.input_shape[0]}) exceed seq_len {seq_len}"
        )
    if d_model % n_head:
        raise ValueError(f"d_model {d_model} must be a multiple of n_head {n_head}")
    return GPT(data.num_classes, n_layer, d_model, n_head, seq_len, bool(tied))
