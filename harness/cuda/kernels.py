"""CUDA's kernels where CPU's save other tensors: attention's backend and dropout's mask.

A CUDA target predicted on CPU kernels would otherwise save what CPU kernels save:

- **Attention.** ``scaled_dot_product_attention`` picks a backend per call. On a card that is
  cuDNN, flash, memory-efficient or math, by PyTorch's rules for the card's compute capability,
  dtype, head dim, mask, dropout and GQA (``select_sdp_backend`` in
  ``aten/src/ATen/native/transformers/cuda/sdp_utils.cpp``): the fused ones keep a log-sum-exp
  (fp32, one value per query row) for backward, math keeps the full score and probability
  matrices. On a CPU the same call runs CPU flash or math kernels. ``choose_backend`` applies
  the CUDA rules to the card, and the prediction then calls the CUDA backend's own aten op
  (``_scaled_dot_product_flash_attention`` and friends): their shape functions and autograd
  formulas are the real ones, so what is saved for backward is what the card saves, as the
  composite in ``aten/src/ATen/native/transformers/attention.cpp`` prepares it (boolean masks
  made additive in the query's dtype, padded for the efficient kernel; head dims padded to 8
  for flash).
- **Dropout.** On CUDA ``dropout`` runs the fused ``native_dropout`` (a one-byte bool mask saved
  for backward); on a CPU it multiplies by a noise tensor of the input's dtype (four bytes a
  value in fp32) and saves that.

``cuda_kernels(card)`` registers both as ``AutogradCPU`` kernels for the duration (removed when
the library is destroyed), so they take effect whatever code calls them (a model's own
attention, transformers' ``sdpa`` path, ``nn.Dropout``).
"""

from __future__ import annotations

import collections
import contextlib
import math
import warnings
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from harness.compat.internals import destroy_library, in_backward, op_schema
from harness.cuda.cards import CUBLASLT_WORKSPACE, Card

aten = torch.ops.aten
HALF_TYPES = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class AttentionCall:
    """What ``select_sdp_backend`` looks at, for one call."""

    dtype: torch.dtype
    head_dim_qk: int
    head_dim_v: int
    query_heads: int
    key_heads: int
    query_len: int
    key_len: int
    has_mask: bool
    dropout: float
    is_causal: bool
    enable_gqa: bool
    requires_grad: bool


def choose_backend(
    call: AttentionCall, capability: tuple[int, int], cudnn_version: int | None
) -> str:
    """``cudnn`` | ``flash`` | ``efficient`` | ``math``: what SDPA runs on a card of
    ``capability`` (sdp_utils.cpp: ``priority_order`` and the ``can_use_*`` checks).

    cuDNN attention goes first on sm90/sm100/sm103 with a cuDNN runtime newer than 9.15.0
    (``check_prefer_cudnn_attention``), else flash, memory-efficient, math in that order."""
    major, minor = capability
    order = ["flash", "efficient", "math"]
    prefer_cudnn = (
        cudnn_version is not None and cudnn_version > 91500 and major in (9, 10) and minor in (0, 3)
    )
    if prefer_cudnn:
        order.insert(0, "cudnn")
    checks = {
        "cudnn": _can_use_cudnn,
        "flash": _can_use_flash,
        "efficient": _can_use_efficient,
        "math": lambda *_: True,
    }
    for backend in order:
        if checks[backend](call, capability, cudnn_version):
            return backend
    return "math"


def _in_range(capability: tuple[int, int], low: tuple[int, int], high: tuple[int, int]) -> bool:
    return low <= capability <= high  # check_sm_version: inclusive on both ends


def _heads_ok(call: AttentionCall, gqa_supported: bool) -> bool:
    """``check_batch_size_and_num_heads_dense``: equal heads, or GQA where the backend and the
    call allow it (query heads a multiple of key heads)."""
    if call.query_heads == call.key_heads:
        return True
    return gqa_supported and call.enable_gqa and call.query_heads % call.key_heads == 0


def _can_use_flash(
    call: AttentionCall, capability: tuple[int, int], cudnn_version: int | None
) -> bool:
    major = capability[0]
    if call.has_mask or not _in_range(capability, (8, 0), (12, 1)):
        return False
    if call.head_dim_qk != call.head_dim_v or call.head_dim_qk > 256:
        return False
    sm86_89_or_120 = _in_range(capability, (8, 6), (8, 9)) or _in_range(
        capability, (12, 0), (12, 1)
    )
    head = call.head_dim_qk
    if (
        call.requires_grad
        and sm86_89_or_120
        and (192 < head <= 224 or (head > 224 and call.dropout > 0))
    ):
        return False
    if call.is_causal and call.query_len != call.key_len:
        return False
    allowed = HALF_TYPES if major >= 8 else (torch.float16,)
    return call.dtype in allowed and _heads_ok(call, gqa_supported=True)


def _can_use_efficient(
    call: AttentionCall, capability: tuple[int, int], cudnn_version: int | None
) -> bool:
    major = capability[0]
    if not _in_range(capability, (5, 0), (12, 1)):
        return False
    half = call.dtype in HALF_TYPES
    use_tensor_cores = major >= 8 or (major >= 7 and half)  # minimum_gemm_alignment
    alignment = max(
        4 if major >= 8 else 1, (128 // (16 if half else 32)) if use_tensor_cores else 1
    )
    if call.head_dim_qk % alignment or call.head_dim_v % alignment:
        return False
    allowed = (
        (torch.float16, torch.float32, torch.bfloat16)
        if major >= 8
        else (
            torch.float16,
            torch.float32,
        )
    )
    return call.dtype in allowed and _heads_ok(call, gqa_supported=False)


def _can_use_cudnn(
    call: AttentionCall, capability: tuple[int, int], cudnn_version: int | None
) -> bool:
    if cudnn_version is None or cudnn_version < 90000:
        return False
    if call.dropout > 0 and 91100 < cudnn_version < 91400:
        return False
    if not _in_range(capability, (8, 0), (12, 1)):
        return False
    allowed = HALF_TYPES if capability[0] >= 8 else (torch.float16,)
    if call.dtype not in allowed or not _heads_ok(call, gqa_supported=True):
        return False
    limit = 256 if capability == (9, 0) and cudnn_version >= 91000 else 128
    if (
        capability[0] == 10
        and cudnn_version >= 91100
        and (call.head_dim_qk, call.head_dim_v)
        == (
            192,
            128,
        )
    ):
        limit = 192
    if call.head_dim_qk > limit or call.head_dim_v > limit:
        return False
    if call.head_dim_qk % 8 or call.head_dim_v % 8:
        return False
    return call.key_len != 1 and not (call.query_len == 1 and call.dropout > 0)


class Kernels:
    """The replacement kernels and what they chose (for the prediction's note)."""

    def __init__(self, capability: tuple[int, int], cudnn_version: int | None) -> None:
        self.capability, self.cudnn_version = capability, cudnn_version
        self.backends: collections.Counter[str] = collections.Counter()
        self.choices: dict[AttentionCall, str] = {}  # each distinct call, the backend it got

    def retarget(self, capability: tuple[int, int]) -> None:
        """Choose as a card of ``capability`` does from now on (what was chosen is forgotten)."""
        self.capability = capability
        self.backends.clear()
        self.choices.clear()

    def chooses_alike(self, capability: tuple[int, int]) -> bool:
        """Whether a card of ``capability`` would have run every attention call seen so far on
        the same backend: then the step it ran is that card's step too (attention is the only
        kernel choice that depends on the card), and one trace serves both."""
        return all(
            choose_backend(call, capability, self.cudnn_version) == backend
            for call, backend in self.choices.items()
        )

    def attention(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        *,
        scale: float | None = None,
        enable_gqa: bool = False,
    ) -> torch.Tensor:
        """``scaled_dot_product_attention`` as the CUDA composite runs it on this card."""
        grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
        call = AttentionCall(
            dtype=query.dtype,
            head_dim_qk=query.shape[-1],
            head_dim_v=value.shape[-1],
            query_heads=query.shape[-3] if query.dim() >= 3 else 1,
            key_heads=key.shape[-3] if key.dim() >= 3 else 1,
            query_len=query.shape[-2],
            key_len=key.shape[-2],
            has_mask=attn_mask is not None,
            dropout=dropout_p,
            is_causal=is_causal,
            enable_gqa=enable_gqa,
            requires_grad=grad,
        )
        backend = choose_backend(call, self.capability, self.cudnn_version)
        self.backends[backend] += 1
        self.choices[call] = backend
        if backend == "cudnn":
            mask = _additive(attn_mask, query.dtype, fill=-65504.0)
            return aten._scaled_dot_product_cudnn_attention(
                query, key, value, mask, grad, dropout_p, is_causal, False, scale=scale
            )[0]
        if backend == "flash":
            head = query.shape[-1]
            padded = [_pad_last(t, 8) for t in (query, key, value)]
            og_scale = scale if scale is not None else 1.0 / math.sqrt(head)
            out = aten._scaled_dot_product_flash_attention(
                *padded, dropout_p, is_causal, False, scale=og_scale
            )[0]
            return out[..., :head] if out.shape[-1] != head else out
        mask = _additive(attn_mask, query.dtype)
        if backend == "efficient":
            if mask is not None:
                mask = _padded_bias(mask, 8).expand(
                    query.shape[0], query.shape[1], query.shape[2], key.shape[2]
                )
            return aten._scaled_dot_product_efficient_attention(
                query, key, value, mask, grad, dropout_p, is_causal, scale=scale
            )[0]
        return aten._scaled_dot_product_attention_math(
            query, key, value, mask, dropout_p, is_causal, None, scale=scale, enable_gqa=enable_gqa
        )[0]

    def dropout(self, input: torch.Tensor, p: float, train: bool) -> torch.Tensor:
        """``dropout`` as on CUDA (``is_fused_kernel_acceptable``: the fused kernel for
        0 < p < 1 on a non-empty tensor in training), else ``_dropout``'s shortcuts."""
        if train and 0 < p < 1 and input.numel() > 0:
            return aten.native_dropout(input, p, train)[0]
        if p == 0 or not train or input.numel() == 0:
            return input
        return input.mul(torch.zeros((), dtype=input.dtype, device=input.device))


def _additive(
    mask: torch.Tensor | None, dtype: torch.dtype, fill: float = -math.inf
) -> torch.Tensor | None:
    """``convert_boolean_attn_mask``: a boolean mask becomes 0 / ``fill`` in the query's dtype."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    zero = torch.zeros((), dtype=dtype, device=mask.device)
    return torch.where(mask.logical_not(), fill, zero)


def _pad_last(tensor: torch.Tensor, alignment: int) -> torch.Tensor:
    """``pad_last_dim<alignment, false>``: a copy only when the last dim is not aligned."""
    size = tensor.shape[-1]
    if size % alignment == 0:
        return tensor
    return torch.nn.functional.pad(tensor, (0, alignment - size % alignment))


def _padded_bias(mask: torch.Tensor, alignment: int) -> torch.Tensor:
    """``preprocess_mask``'s padding: the bias copied to an aligned row stride, then sliced."""
    aligned = mask.stride(-1) == 1 and all(
        mask.stride(i) % alignment == 0 for i in range(mask.dim() - 1)
    )
    if aligned:
        return mask
    size = mask.shape[-1]
    padded = torch.nn.functional.pad(mask, (0, alignment - size % alignment))
    return padded[..., :size]


@contextlib.contextmanager
def cuda_kernels(capability: tuple[int, int], cudnn_version: int | None) -> Iterator[Kernels]:
    """While active, CPU tensors' attention and dropout run as they would on the card."""
    kernels = Kernels(capability, cudnn_version)
    library = torch.library.Library("aten", "IMPL")
    try:  # a registration that fails still leaves the ones before it undone
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "Overriding a previously registered kernel"
            library.impl("scaled_dot_product_attention", kernels.attention, "AutogradCPU")
            library.impl("dropout", kernels.dropout, "AutogradCPU")
        yield kernels
    finally:
        destroy_library(library)


def installed_cudnn_version() -> int | None:
    """The cuDNN the installed PyTorch ships (what it would load on the card), or None."""
    try:
        return torch.backends.cudnn.version()
    except Exception:  # a build without cuDNN
        return None


def attention_note(backends: collections.Counter[str]) -> str:
    """``attention: flash x32`` for the prediction's note."""
    return ", ".join(f"{name} x{count}" for name, count in sorted(backends.items()))


class Workspaces:
    """cuBLAS and cuBLASLt workspaces a step allocates through the caching allocator, for the
    allocation log: one per (handle, stream), a handle per thread that runs GEMMs (the
    training loop's and autograd's device thread), allocated at each thread's first GEMM
    (``setWorkspaceForHandle``) and kept. cuBLASLt's (1 MiB) comes with the first GEMM that has a
    bias epilogue (``addmm``, e.g. ``nn.Linear`` with bias)."""

    GEMMS = frozenset(
        {"mm", "addmm", "bmm", "baddbmm", "addmv", "mv", "addbmm", "dot", "vdot", "addr"}
    )

    def __init__(self, card: Card) -> None:
        self.cublas = card.cublas_workspace_bytes
        self.seen: set[tuple[bool, str]] = set()
        self.kinds: list[str] = []  # cublas | cublaslt, in the order the sizes were given
        self.total = 0

    def __call__(self, func: object) -> list[int]:
        name = getattr(op_schema(func), "name", "").partition("::")[2]
        if name not in self.GEMMS:
            return []
        backward = in_backward()
        sizes = []
        if (backward, "cublas") not in self.seen:
            self.seen.add((backward, "cublas"))
            sizes.append(self.cublas)
            self.kinds.append("cublas")
        if name == "addmm" and (backward, "cublaslt") not in self.seen:
            self.seen.add((backward, "cublaslt"))
            sizes.append(CUBLASLT_WORKSPACE)
            self.kinds.append("cublaslt")
        self.total += sum(sizes)
        return sizes

    def bytes_on(self, card: Card) -> int:
        """What the workspaces made so far take on ``card`` (cuBLAS's size is the card's):
        made at a thread's first GEMM and kept, so all of them are live at any later peak."""
        sizes = {"cublas": card.cublas_workspace_bytes, "cublaslt": CUBLASLT_WORKSPACE}
        return sum(sizes[kind] for kind in self.kinds)
