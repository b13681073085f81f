"""torchtune's Llama 3.2 3B as ``full_finetune_single_device`` trained it at commit 1814feb17.

Source C (the torchtune README's "Optimization flags" table, A100) reports
``torch.cuda.memory_stats()["active_bytes.all.peak"]`` in GiB. A re-implementation written from
reading torchtune's ``torchtune/models/llama3_2/_component_builders.py``,
``_model_builders.py``, ``torchtune/modules/{attention,transformer,rms_norm,feed_forward,
attention_utils}.py``, ``torchtune/models/llama3_1/_position_embeddings.py`` and
``recipes/full_finetune_single_device.py`` at that commit. What decides memory, as torchtune has
it:

- the model built under a bf16 default dtype, so weights, gradients and AdamW's state are bf16,
  while the rotary cache is built explicitly in fp32 (``max_seq_len`` 131072: a 64 MiB buffer);
- ``RMSNorm`` computing in fp32 (``x.float()``, saved for backward) and casting back before the
  trainable scale;
- separate q/k/v projections, RoPE applied per head in fp32 on a cache gathered by the packed
  samples' positions (``cache[input_pos]``, a new tensor per call that the products keep), K
  and V expanded to every query head (``expand(...).flatten(1, 2)``: copies) before attention;
- attention: with packing torchtune calls ``flex_attention`` with a block-causal document mask
  (compiled; it cannot run on fake tensors). Here ``scaled_dot_product_attention(is_causal=True)``
  stands in: on an A100 in bf16 it is the flash kernel, which saves the same tensors flex
  attention saves (query, the expanded key and value, the output, an fp32 log-sum-exp per row)
  and, like flex attention since PyTorch 2.5 (pytorch PR 135882), returns its output in the
  query's stride order, so ``transpose(1, 2).contiguous()`` copies nothing in either. The block
  mask itself is a few KiB of block indices. What differs is arithmetic, not memory;
- SwiGLU MLP; the output projection tied to the token embedding, its logits upcast to fp32
  (``self.output(h).float()`` path: ``F.linear(h, tok_embeddings.weight).float()``);
- the recipe's loss step: labels shifted by ``hstack`` with an ignore column, logits flattened,
  ``nn.CrossEntropyLoss``, the logits released (``del logits``) before backward.

Weights are random: their values do not change memory.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.published.litgpt_model import default_dtype

IGNORE_INDEX = -100  # nn.CrossEntropyLoss's default, which the recipe reads


@dataclass(frozen=True)
class TuneConfig:
    """``llama3_2_3b()``'s arguments."""

    vocab_size: int = 128_256
    num_layers: int = 28
    num_heads: int = 24
    num_kv_heads: int = 8
    embed_dim: int = 3072
    max_seq_len: int = 131_072
    intermediate_dim: int = 8192
    norm_eps: float = 1e-5
    rope_base: int = 500_000
    scale_factor: int = 32

    @property
    def head_dim(self) -> int:
        return self.embed_dim // self.num_heads


class RMSNorm(nn.Module):
    """torchtune's RMSNorm: normalise in fp32, cast back, multiply by the (trainable) scale."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.scale = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_fp32 = x.float()
        normed = x_fp32 * torch.rsqrt(x_fp32.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.scale


def scaled_frequencies(config: TuneConfig, dim: int) -> torch.Tensor:
    """Llama 3.1's scaled RoPE frequencies (``Llama3ScaledRoPE.apply_scaling``; low/high
    frequency factors 1 and 4, original context 8192)."""
    freqs = 1.0 / (config.rope_base ** (torch.arange(0, dim, 2)[: dim // 2].float() / dim))
    low_wavelen, high_wavelen = 8192 / 1, 8192 / 4
    scaled = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            scaled.append(freq)
        elif wavelen > low_wavelen:
            scaled.append(freq / config.scale_factor)
        else:
            smooth = (8192 / wavelen - 1) / (4 - 1)
            scaled.append((1 - smooth) * freq / config.scale_factor + smooth * freq)
    return torch.tensor(scaled, dtype=torch.float32)


class ScaledRoPE(nn.Module):
    """``Llama3ScaledRoPE``: a (max_seq_len, dim/2, 2) fp32 cos/sin cache, applied in fp32."""

    def __init__(self, config: TuneConfig) -> None:
        super().__init__()
        theta = scaled_frequencies(config, config.head_dim)
        self.register_buffer("theta", theta, persistent=False)
        positions = torch.arange(config.max_seq_len, dtype=theta.dtype)
        # Same device in a real run; while harness estimates, the 131072 positions are built
        # on the meta device (no storage) and theta, 64 values, is real.
        angles = torch.einsum("i, j -> ij", positions, theta.to(positions.device)).float()
        cache = torch.stack([torch.cos(angles), torch.sin(angles)], dim=-1)
        self.register_buffer("cache", cache, persistent=False)

    def forward(self, x: torch.Tensor, input_pos: torch.Tensor | None) -> torch.Tensor:
        steps = x.size(1)
        table = self.cache[:steps] if input_pos is None else self.cache[input_pos]
        pairs = x.float().reshape(*x.shape[:-1], -1, 2)
        table = table.view(-1, pairs.size(1), 1, pairs.size(3), 2)
        rotated = torch.stack(
            [
                pairs[..., 0] * table[..., 0] - pairs[..., 1] * table[..., 1],
                pairs[..., 1] * table[..., 0] + pairs[..., 0] * table[..., 1],
            ],
            -1,
        )
        return rotated.flatten(3).type_as(x)


class Attention(nn.Module):
    """torchtune's ``MultiHeadAttention``, self-attention training path (no KV cache)."""

    def __init__(self, config: TuneConfig, rope: ScaledRoPE) -> None:
        super().__init__()
        d, h, kv = config.embed_dim, config.num_heads, config.num_kv_heads
        self.heads, self.kv_heads, self.head_dim = h, kv, config.head_dim
        self.q_proj = nn.Linear(d, h * self.head_dim, bias=False)
        self.k_proj = nn.Linear(d, kv * self.head_dim, bias=False)
        self.v_proj = nn.Linear(d, kv * self.head_dim, bias=False)
        self.output_proj = nn.Linear(d, d, bias=False)
        self.rope = rope

    def forward(self, x: torch.Tensor, input_pos: torch.Tensor | None) -> torch.Tensor:
        b, s, _ = x.shape
        per_kv = self.heads // self.kv_heads
        q = self.q_proj(x).view(b, s, self.heads, self.head_dim)
        q = self.rope(q, input_pos).transpose(1, 2)
        k = self.k_proj(x).view(b, s, -1, self.head_dim)
        v = self.v_proj(x).view(b, s, -1, self.head_dim)
        k = self.rope(k, input_pos).transpose(1, 2)
        v = v.transpose(1, 2)
        if self.heads != self.kv_heads:
            shape = (b, self.kv_heads, per_kv, -1, self.head_dim)
            k = k.unsqueeze(2).expand(shape).flatten(1, 2)
            v = v.unsqueeze(2).expand(shape).flatten(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.output_proj(out.transpose(1, 2).contiguous().view(b, s, -1))


class FeedForward(nn.Module):
    """SwiGLU: ``w2(silu(w1(x)) * w3(x))``."""

    def __init__(self, config: TuneConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(config.embed_dim, config.intermediate_dim, bias=False)
        self.w2 = nn.Linear(config.intermediate_dim, config.embed_dim, bias=False)
        self.w3 = nn.Linear(config.embed_dim, config.intermediate_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Layer(nn.Module):
    """``TransformerSelfAttentionLayer`` (scales are identities)."""

    def __init__(self, config: TuneConfig, rope: ScaledRoPE) -> None:
        super().__init__()
        self.sa_norm = RMSNorm(config.embed_dim, config.norm_eps)
        self.attn = Attention(config, rope)
        self.mlp_norm = RMSNorm(config.embed_dim, config.norm_eps)
        self.mlp = FeedForward(config)

    def forward(self, x: torch.Tensor, input_pos: torch.Tensor | None) -> torch.Tensor:
        h = self.attn(self.sa_norm(x), input_pos) + x
        return h + self.mlp(self.mlp_norm(h))


class TransformerDecoder(nn.Module):
    """Embeddings, layers, final norm, output tied to the embedding and upcast to fp32.

    Called as the recipe calls it on a packed batch, ``model(tokens=..., input_pos=...)``;
    harness passes the batch's ``labels`` too, which the model ignores (the recipe pops them).
    """

    def __init__(self, config: TuneConfig) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.embed_dim)
        rope = ScaledRoPE(config)  # one module shared by every layer, as the builder shares it
        self.layers = nn.ModuleList(Layer(config, rope) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.embed_dim, config.norm_eps)

    def forward(
        self, tokens: torch.Tensor, input_pos: torch.Tensor | None = None, **_: Any
    ) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, input_pos)
        return F.linear(self.norm(h), self.tok_embeddings.weight).float()


def torchtune_llama(data: Any, **overrides: int) -> nn.Module:
    """``llama3_2_3b()`` built as the recipe builds it: under ``set_default_dtype(bf16)``, so
    every parameter is bf16 and only the explicitly fp32 rotary cache is not."""
    config = TuneConfig(**overrides)
    with default_dtype(torch.bfloat16):
        return TransformerDecoder(config)


def torchtune_loss(outputs: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """``_loss_step`` and the line after it: shift the labels by stacking an ignore column,
    flatten, ``nn.CrossEntropyLoss``; the loss times the batch's unmasked tokens (the recipe
    divides the gradients by their total later, in place)."""
    labels = batch["labels"]
    ignore = torch.full((labels.shape[0], 1), IGNORE_INDEX, device=labels.device)
    shifted = torch.hstack((labels[..., 1:], ignore)).reshape(-1)
    logits = outputs.reshape(-1, outputs.size(-1))
    tokens = (labels != IGNORE_INDEX).sum()
    return F.cross_entropy(logits, shifted, ignore_index=IGNORE_INDEX) * tokens


def packed_tokens(
    seed: int, count: int = 8, seq_len: int = 4096, vocab_size: int = 128_256
) -> dict[str, torch.Tensor]:
    """Packed samples as torchtune's ``padded_collate_packed`` hands them to the model: token
    ids, labels and each token's position within its document (``input_pos``), every sample
    exactly ``seq_len`` long. Documents here are 512 tokens; only the shapes matter."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab_size, (count, seq_len), generator=generator)
    positions = (torch.arange(seq_len) % 512).expand(count, seq_len).clone()
    return {"tokens": tokens, "labels": tokens.clone(), "input_pos": positions}
