"""lit-gpt's GPT with LoRA, as ``finetune/lora.py`` trained it for lit-gpt's resource tables.

Source A (litgpt ``tutorials/resource-tables.md``, A100-SXM4-40GB, PyTorch 2.1.0, Lightning
2.1.0.rc0) measured ``torch.cuda.max_memory_allocated()``. What a step allocates depends on the
model code, so this is a re-implementation written from reading lit-gpt's ``lit_gpt/model.py``,
``lit_gpt/lora.py``, ``lit_gpt/rmsnorm.py``, ``lit_gpt/config.py``, ``lit_gpt/utils.py`` and
``finetune/lora.py`` at commit 8641822, which the tables name, and at 0cc02afa, the tree they
landed in (``tree``: the two differ, for these runs, only in RMSNorm's fp32 upcast and where the
rotary tables are first built), plus Lightning Fabric's precision plugins and ``_FabricModule``
at 2.1.0.rc0. The parts that decide memory, each kept as the source has it:

- one fused ``attn`` Linear for Q, K and V; LoRA on Q and V through ``LoRAQKVLinear``: dropout
  on the LoRA input, ``lora_A`` as a Linear, ``lora_B`` as a grouped ``conv1d``, and
  ``zero_pad``, which builds a zero tensor as wide as the fused QKV output and ``index_copy``s
  the Q/V updates into it;
- the frozen weights and the LoRA weights in the model's dtype (bf16 under ``bf16-true``), so
  AdamW's state is bf16 too;
- partial rotary embeddings on slices of Q and K, with the rotary tables rebuilt in fp32 when
  the script sets ``model.max_seq_length`` after Fabric's setup (Fabric forwards the attribute
  to the module; the default dtype is fp32 there), so ``x * cos`` computes in fp32;
- ``F.scaled_dot_product_attention(is_causal=True)`` (the flash-attn package is optional and
  not in lit-gpt's requirements, so the default install takes this path), its output
  transposed back and reshaped (a copy) before ``proj``;
- the LM head applied to 128-token slices of the final hidden state (``lm_head_chunk_size=128``)
  and every chunk kept for backward;
- Fabric's ``_FabricModule.forward``: ``convert_output`` casts the model's outputs to the default
  dtype (fp32) under both ``bf16-true`` and ``bf16-mixed``, so the kept logit chunks are fp32;
  ``bf16-mixed`` autocasts the model's forward only, not the loss;
- Llama's RMSNorm: in bf16 at 8641822; from lit-gpt #606 (in 0cc02afa) x is upcast to fp32
  first, so the fp32 copy is what its multiplications keep for backward;
- ``chunked_cross_entropy``: the last chunk sliced to drop its final position, each chunk
  reshaped to rows (a copy where the slice is not contiguous), ``cross_entropy`` per chunk with
  ``reduction="none"``, then the mean of their concatenation.

Values (weights, tokens) do not change memory, so nothing is loaded: the weights are random.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

# The lit-gpt trees whose model code can run: the commit the resource tables name, and the tree
# they landed in (the same code for these runs but for RMSNorm's fp32 upcast, lit-gpt #606).
TREES = ("8641822", "0cc02afa")

# lit_gpt.config.Config defaults at 8641822 (StableLM-Alpha's shape), overridden per model below.


@dataclass(frozen=True)
class LitConfig:
    """The fields of lit-gpt's ``Config`` that shape the model (``lit_gpt/config.py``)."""

    name: str
    block_size: int = 4096
    vocab_size: int = 50254
    padding_multiple: int = 512
    padded_vocab_size: int | None = None
    n_layer: int = 16
    n_head: int = 32
    n_embd: int = 4096
    rotary_percentage: float = 0.25
    parallel_residual: bool = True
    bias: bool = True
    lm_head_bias: bool = False
    n_query_groups: int | None = None
    shared_attention_norm: bool = False
    norm_class: str = "LayerNorm"
    norm_eps: float = 1e-5
    mlp_class: str = "GptNeoxMLP"
    gelu_approximate: str = "none"
    intermediate_size: int | None = None
    rope_base: int = 10000
    rope_condense_ratio: int = 1

    @property
    def padded_vocab(self) -> int:
        """The embedding and head rows: the vocabulary rounded up to ``padding_multiple``."""
        if self.padded_vocab_size is not None:
            return self.padded_vocab_size
        return math.ceil(self.vocab_size / self.padding_multiple) * self.padding_multiple

    @property
    def query_groups(self) -> int:
        return self.n_query_groups or self.n_head

    @property
    def head_size(self) -> int:
        return self.n_embd // self.n_head

    @property
    def rope_n_elem(self) -> int:
        return int(self.rotary_percentage * self.head_size)

    @property
    def mlp_size(self) -> int:
        return self.intermediate_size or 4 * self.n_embd


CONFIGS = {
    config.name: config
    for config in (
        LitConfig(name="stablelm-base-alpha-3b"),
        LitConfig(
            name="phi-1_5",
            vocab_size=50257,
            padded_vocab_size=51200,
            block_size=2048,
            n_embd=2048,
            n_layer=24,
            rotary_percentage=0.5,
            shared_attention_norm=True,
            lm_head_bias=True,
            gelu_approximate="tanh",
        ),
        LitConfig(
            name="Llama-2-7b-hf",
            vocab_size=32000,
            padding_multiple=64,
            n_layer=32,
            rotary_percentage=1.0,
            parallel_residual=False,
            bias=False,
            norm_class="RMSNorm",
            mlp_class="LLaMAMLP",
            intermediate_size=11008,
        ),
        LitConfig(
            name="Llama-2-13b-hf",
            vocab_size=32000,
            padding_multiple=64,
            n_layer=40,
            n_head=40,
            n_embd=5120,
            rotary_percentage=1.0,
            parallel_residual=False,
            bias=False,
            norm_class="RMSNorm",
            mlp_class="LLaMAMLP",
            intermediate_size=13824,
        ),
    )
}


@dataclass(frozen=True)
class LoraSettings:
    """``finetune/lora.py``'s module constants (r, alpha, dropout, which projections)."""

    r: int = 8
    alpha: int = 16
    dropout: float = 0.05
    query: bool = True
    key: bool = False
    value: bool = True


class RMSNorm(nn.Module):
    """lit-gpt's RMSNorm: mean of ``x * x``, ``rsqrt``, then the weight.

    At 8641822 all of it runs in x's dtype (bf16 here). lit-gpt #606 ("Half precision fixes",
    6178c7cc, merged 2023-10-24, three days before the resource tables landed in 0cc02afa)
    upcasts x to fp32 first and casts the result back: the fp32 copy of x is what the two
    multiplications keep for backward, twice the bytes of the bf16 x they kept before.
    """

    def __init__(self, size: int, eps: float, upcast: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.upcast = upcast

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        if self.upcast:
            x = x.float()
        mean_square = torch.mean(x * x, dim=-1, keepdim=True)
        normed = self.weight * (x * torch.rsqrt(mean_square + self.eps))
        return normed.to(dtype=dtype) if self.upcast else normed


def norm(config: LitConfig, tree: str) -> nn.Module:
    """The block's norm as the lit-gpt tree ``tree`` (a commit in ``TREES``) writes it."""
    if config.norm_class == "RMSNorm":
        return RMSNorm(config.n_embd, config.norm_eps, upcast=tree != "8641822")
    return nn.LayerNorm(config.n_embd, eps=config.norm_eps)


class FrozenLinear(nn.Module):
    """``LoRALinear`` with r = 0 (every projection but QKV here): the pretrained Linear, held as
    ``self.linear`` as lit-gpt holds it."""

    def __init__(self, n_in: int, n_out: int, bias: bool) -> None:
        super().__init__()
        self.linear = nn.Linear(n_in, n_out, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


class LoRAQKV(nn.Module):
    """The fused QKV projection with LoRA on the enabled parts (lit-gpt's ``LoRAQKVLinear``)."""

    def __init__(self, config: LitConfig, lora: LoraSettings) -> None:
        super().__init__()
        n_in = config.n_embd
        n_out = (config.n_head + 2 * config.query_groups) * config.head_size
        self.linear = nn.Linear(n_in, n_out, bias=config.bias)
        self.enabled = (lora.query, lora.key, lora.value)
        self.n_head, self.groups = config.n_head, config.query_groups
        self.dropout = nn.Dropout(lora.dropout) if lora.dropout > 0 else nn.Identity()
        self.scaling = lora.alpha / lora.r
        kv_size = n_in // (config.n_head // config.query_groups)
        widths = (n_in * lora.query, kv_size * lora.key, kv_size * lora.value)
        self.widths = [w for w in widths if w]
        self.lora_A = nn.Parameter(torch.zeros(lora.r * sum(self.enabled), n_in))
        self.lora_B = nn.Parameter(torch.zeros(sum(self.widths), lora.r))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        # Where each enabled part's update lands in the fused output (Q, then K, then V).
        starts = (0, n_in, n_in + kv_size)
        ends = (n_in, n_in + kv_size, n_out)
        self.positions = [
            i
            for on, lo, hi in zip(self.enabled, starts, ends, strict=True)
            if on
            for i in range(lo, hi)
        ]

    def grouped_conv(self, after_a: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """lora_B as lit-gpt applies it: one grouped conv1d when Q, K and V are equal in size,
        else one conv1d per enabled part, concatenated."""
        if self.n_head == self.groups:
            return F.conv1d(after_a, weight, groups=sum(self.enabled))
        parts = after_a.chunk(sum(self.enabled), dim=1)
        weights = weight.split(self.widths)
        return torch.cat([F.conv1d(a, w) for a, w in zip(parts, weights, strict=True)], dim=1)

    def zero_pad(self, update: torch.Tensor) -> torch.Tensor:
        """Scatter the Q/V updates into a zero tensor as wide as the fused output."""
        if all(self.enabled):
            return update
        update = update.transpose(0, 1)
        out_features = self.linear.out_features
        padded = update.new_zeros((*update.shape[:-1], out_features)).view(-1, out_features)
        index = torch.tensor(self.positions, device=padded.device)
        padded = padded.index_copy(1, index, update.reshape(-1, sum(self.widths)))
        return padded.view((*update.shape[:-1], out_features)).transpose(0, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pretrained = self.linear(x)
        after_a = F.linear(self.dropout(x), self.lora_A)
        after_b = self.grouped_conv(after_a.transpose(-2, -1), self.lora_B.unsqueeze(-1))
        return pretrained + self.zero_pad(after_b.transpose(-2, -1)) * self.scaling


def rope_tables(
    config: LitConfig, seq_len: int, device: torch.device | None, tree: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """``build_rope_cache``: cos and sin per position. At 8641822 in the default dtype (fp16 when
    that is a 16-bit type, as lit-gpt mimics complex32); from #606 on always fp32. Either way the
    tables training uses are fp32: they are rebuilt at the longest length under Fabric's fp32
    default dtype."""
    n_elem = config.rope_n_elem
    arange = torch.arange(0, n_elem, 2, device=device)
    if tree != "8641822":
        arange = arange.float()
    theta = 1.0 / (config.rope_base ** (arange / n_elem))
    positions = torch.arange(seq_len, device=device) / config.rope_condense_ratio
    angles = torch.outer(positions, theta).repeat(1, 2)
    cos, sin = torch.cos(angles), torch.sin(angles)
    if tree == "8641822" and torch.get_default_dtype() in (torch.float16, torch.bfloat16):
        return cos.half(), sin.half()
    return cos, sin


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.size(-1) // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return ((x * cos) + (rotated * sin)).type_as(x)


class Attention(nn.Module):
    """lit-gpt's ``CausalSelfAttention`` (training path: no KV cache, no mask)."""

    def __init__(self, config: LitConfig, lora: LoraSettings) -> None:
        super().__init__()
        self.attn = LoRAQKV(config, lora)
        self.proj = FrozenLinear(config.n_embd, config.n_embd, config.bias)
        self.config = config

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        c = self.config
        batch, steps, width = x.size()
        per_group = c.n_head // c.query_groups
        qkv = self.attn(x).view(batch, steps, c.query_groups, per_group + 2, c.head_size)
        qkv = qkv.permute(0, 2, 3, 1, 4)  # (B, groups, per_group + 2, T, hs)
        q, k, v = qkv.split((per_group, 1, 1), dim=2)
        if c.query_groups != 1:
            k = k.expand(batch, c.query_groups, per_group, steps, c.head_size)
            v = v.expand(batch, c.query_groups, per_group, steps, c.head_size)
        q = q.reshape(batch, -1, steps, c.head_size)
        k = k.reshape(batch, -1, steps, c.head_size)
        v = v.reshape(batch, -1, steps, c.head_size)
        n = c.rope_n_elem
        q = torch.cat((apply_rope(q[..., :n], cos, sin), q[..., n:]), dim=-1)
        k = torch.cat((apply_rope(k[..., :n], cos, sin), k[..., n:]), dim=-1)
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=0.0, scale=1.0 / math.sqrt(c.head_size), is_causal=True
        )
        return self.proj(y.transpose(1, 2).reshape(batch, steps, width))


class NeoxMLP(nn.Module):
    def __init__(self, config: LitConfig) -> None:
        super().__init__()
        self.fc = FrozenLinear(config.n_embd, config.mlp_size, config.bias)
        self.proj = FrozenLinear(config.mlp_size, config.n_embd, config.bias)
        self.approximate = config.gelu_approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x), approximate=self.approximate))


class LlamaMLP(nn.Module):
    def __init__(self, config: LitConfig) -> None:
        super().__init__()
        self.fc_1 = FrozenLinear(config.n_embd, config.mlp_size, config.bias)
        self.fc_2 = FrozenLinear(config.n_embd, config.mlp_size, config.bias)
        self.proj = FrozenLinear(config.mlp_size, config.n_embd, config.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.silu(self.fc_1(x)) * self.fc_2(x))


class Block(nn.Module):
    def __init__(self, config: LitConfig, lora: LoraSettings, tree: str) -> None:
        super().__init__()
        self.norm_1 = norm(config, tree)
        self.attn = Attention(config, lora)
        self.norm_2 = None if config.shared_attention_norm else norm(config, tree)
        self.mlp = LlamaMLP(config) if config.mlp_class == "LLaMAMLP" else NeoxMLP(config)
        self.parallel = config.parallel_residual

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        n_1 = self.norm_1(x)
        h = self.attn(n_1, cos, sin)
        if self.parallel:
            n_2 = n_1 if self.norm_2 is None else self.norm_2(x)
            return x + h + self.mlp(n_2)
        assert self.norm_2 is not None
        x = x + h
        return x + self.mlp(self.norm_2(x))


class GPT(nn.Module):
    """lit-gpt's LoRA ``GPT``: embeddings, blocks, final norm, an untied LM head."""

    def __init__(self, config: LitConfig, lora: LoraSettings, tree: str) -> None:
        super().__init__()
        self.config = config
        self.tree = tree
        self.lm_head = FrozenLinear(config.n_embd, config.padded_vocab, config.lm_head_bias)
        self.transformer = nn.ModuleDict(
            {
                "wte": nn.Embedding(config.padded_vocab, config.n_embd),
                "h": nn.ModuleList(Block(config, lora, tree) for _ in range(config.n_layer)),
                "ln_f": norm(config, tree),
            }
        )
        self.set_max_seq_length(config.block_size)

    def set_max_seq_length(self, value: int) -> None:
        """The ``max_seq_length`` setter: (re)builds the rotary tables in the default dtype."""
        device = self.cos.device if hasattr(self, "cos") else None
        cos, sin = rope_tables(self.config, value, device, self.tree)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(
        self, idx: torch.Tensor, lm_head_chunk_size: int = 0
    ) -> torch.Tensor | list[torch.Tensor]:
        steps = idx.size(1)
        cos, sin = self.cos[:steps], self.sin[:steps]
        x = self.transformer.wte(idx)
        for block in self.transformer.h:
            x = block(x, cos, sin)
        x = self.transformer.ln_f(x)
        if lm_head_chunk_size > 0:
            return [self.lm_head(part) for part in x.split(lm_head_chunk_size, dim=1)]
        return self.lm_head(x)


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Fabric's ``_DtypeContextManager`` (``init_module`` and the ``bf16-true`` forward)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


class FabricWrapped(nn.Module):
    """``fabric.setup_module(model)`` as Lightning 2.1's ``_FabricModule.forward`` runs it.

    ``bf16-true``: the forward runs with bf16 as the default dtype. ``bf16-mixed``: the forward
    runs under bf16 autocast, which harness's ``dtype: bf16`` supplies around the whole step
    (so the loss switches it off again, as Fabric never autocasts the loss). Either way the
    outputs are cast to the default dtype, fp32, on the way out (``convert_output``). The
    training call passes ``lm_head_chunk_size=128`` (``finetune/lora.py``); validation does
    not, and gets full logits.
    """

    def __init__(self, module: GPT, precision: str, lm_head_chunk_size: int) -> None:
        super().__init__()
        self.module = module
        self.precision = precision
        self.lm_head_chunk_size = lm_head_chunk_size

    def forward(self, idx: torch.Tensor) -> torch.Tensor | list[torch.Tensor]:
        chunk = self.lm_head_chunk_size if self.training else 0
        context = default_dtype(torch.bfloat16) if self.precision == "bf16-true" else None
        with context or contextlib.nullcontext():
            output = self.module(idx, lm_head_chunk_size=chunk)
        target = torch.get_default_dtype()
        if isinstance(output, list):
            return [t.to(target) if t.is_floating_point() else t for t in output]
        return output.to(target) if output.is_floating_point() else output


def litgpt_lora(
    data: Any,
    config: str,
    seq_len: int,
    precision: str = "bf16-true",
    lora_r: int = 8,
    lora_alpha: int = 16,
    lora_dropout: float = 0.05,
    lm_head_chunk_size: int = 128,
    tree: str = "0cc02afa",
) -> nn.Module:
    """The model ``finetune/lora.py`` trains, set up as it sets it up.

    ``config`` names a lit-gpt config; ``seq_len`` is the longest training sample, which the
    script assigns to ``model.max_seq_length`` after Fabric's setup. ``precision`` is Fabric's:
    ``bf16-true`` builds under a bf16 default dtype and converts the module to bf16;
    ``bf16-mixed`` keeps fp32. Only the LoRA matrices train (``mark_only_lora_as_trainable``).
    ``tree`` is the lit-gpt commit whose model code runs (``TREES``).
    """
    if precision not in ("bf16-true", "bf16-mixed"):
        raise ValueError(f"precision must be bf16-true or bf16-mixed (got {precision!r})")
    if tree not in TREES:
        raise ValueError(f"tree must be one of {', '.join(TREES)} (got {tree!r})")
    lora = LoraSettings(r=lora_r, alpha=lora_alpha, dropout=lora_dropout)
    shape = CONFIGS[config]
    build_dtype = torch.bfloat16 if precision == "bf16-true" else torch.get_default_dtype()
    with default_dtype(build_dtype):  # fabric.init_module()
        model = GPT(shape, lora, tree)
    for name, parameter in model.named_parameters():
        parameter.requires_grad = "lora_" in name
    if precision == "bf16-true":  # fabric.setup_module -> HalfPrecision.convert_module
        model = model.to(dtype=torch.bfloat16)
    model.set_max_seq_length(seq_len)  # train(): model.max_seq_length = longest_seq_length
    return FabricWrapped(model, precision, lm_head_chunk_size)


def litgpt_chunked_loss(outputs: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """``finetune/lora.py``'s loss: drop the last position's logits, shift the targets, then
    ``chunked_cross_entropy`` (chunks of the head's 128 positions; no chunking of a full
    logits tensor at validation, chunk_size=0). Fabric never autocasts the loss, so autocast
    is switched off here (a no-op under ``bf16-true``)."""
    targets = batch["y"] if "y" in batch else batch["labels"]
    first = outputs[0] if isinstance(outputs, list) else outputs
    with torch.autocast(device_type=first.device.type, enabled=False):
        if not isinstance(outputs, list):  # validation: the whole logits at once
            logits = outputs[..., :-1, :].reshape(-1, outputs.size(-1))
            return F.cross_entropy(logits, targets[..., 1:].reshape(-1), ignore_index=-1)
        outputs[-1] = outputs[-1][..., :-1, :]
        rows = [chunk.reshape(-1, chunk.size(-1)) for chunk in outputs]
        labels = [t.reshape(-1) for t in targets[..., 1:].split(outputs[0].size(1), dim=1)]
        losses = [
            F.cross_entropy(r, t, ignore_index=-1, reduction="none")
            for r, t in zip(rows, labels, strict=True)
        ]
        return torch.cat(losses).mean()
