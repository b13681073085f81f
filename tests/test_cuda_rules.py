"""CUDA's rules on CPU kernels: autocast's lists and cast cache, attention's backend, dropout's
mask, cuBLAS workspaces, and the caching allocator replayed on a prediction's allocations."""

from __future__ import annotations

import warnings
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from harness.cuda.allocator import AllocatorConfig
from harness.cuda.autocast import (
    Policy,
    _cuda_autocast_enabled,
    _probe_args,
    cuda_autocast_rules,
    cuda_ops,
    overload,
    rule_for,
)
from harness.cuda.cards import CATALOGUE
from harness.cuda.device_memory import Replayable, nccl_bytes
from harness.cuda.kernels import AttentionCall, choose_backend, cuda_kernels

BF16 = torch.bfloat16


class CastCounter(TorchDispatchMode):
    """Counts ``_to_copy`` calls per source tensor shape (a cast autocast makes)."""

    def __init__(self) -> None:
        super().__init__()
        self.casts: Counter[tuple[int, ...]] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func is torch.ops.aten._to_copy.default:
            self.casts[tuple(args[0].shape)] += 1
        return func(*args, **(kwargs or {}))


def test_lower_precision_ops_run_in_16_bit_and_cast_each_weight_once_per_region():
    """lower_precision_fp (linear) and ``cached_cast``: a leaf weight used twice in one autocast
    region is cast once; a new region casts it again (the cache ends with the region)."""
    w = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(4, 8)
    with cuda_autocast_rules(), CastCounter() as counter:
        with torch.autocast("cpu", dtype=BF16):
            y = F.linear(x, w)
            F.linear(y, w)
        with torch.autocast("cpu", dtype=BF16):
            F.linear(x, w)
    assert y.dtype == BF16
    assert counter.casts[(8, 8)] == 2  # once per region, not once per call


def test_fp32_ops_run_in_fp32_where_cpu_autocast_keeps_16_bit():
    """fp32 (layer_norm): CUDA autocast computes it in fp32 (and saves fp32 for backward);
    plain CPU autocast does not - the gap this module exists for."""
    x = torch.randn(4, 8, requires_grad=True)
    with torch.autocast("cpu", dtype=BF16):
        plain = F.layer_norm(F.linear(x, torch.randn(8, 8)), (8,))
    with cuda_autocast_rules(), torch.autocast("cpu", dtype=BF16):
        ruled = F.layer_norm(F.linear(x, torch.randn(8, 8)), (8,))
    assert plain.dtype == BF16
    assert ruled.dtype == torch.float32
    with torch.autocast("cpu", dtype=BF16):  # the CPU kernels are back afterwards
        assert F.layer_norm(F.linear(x, torch.randn(8, 8)), (8,)).dtype == BF16


def test_set_opt_dtype_ops_default_to_fp32_unless_a_dtype_is_given():
    """fp32_set_opt_dtype (softmax): fp32 out of a 16-bit input, unless the caller names a
    dtype."""
    x = torch.randn(4, 8).to(BF16)
    with cuda_autocast_rules(), torch.autocast("cpu", dtype=BF16):
        assert torch.softmax(x, -1).dtype == torch.float32
        assert torch.softmax(x, -1, dtype=BF16).dtype == BF16
    assert rule_for("aten::softmax.int").policy is Policy.FP32_SET_OPT_DTYPE


def test_append_dtype_ops_redispatch_to_the_overload_that_takes_one():
    """fp32_append_dtype (norm.Scalar -> norm.ScalarOpt_dtype with float32)."""
    rule = rule_for("aten::norm.Scalar")
    assert rule.policy is Policy.FP32_APPEND_DTYPE
    assert rule.redispatch == "aten::norm.ScalarOpt_dtype"
    with cuda_autocast_rules(), torch.autocast("cpu", dtype=BF16):
        assert torch.ops.aten.norm.Scalar(torch.randn(4, 8).to(BF16)).dtype == torch.float32


def test_promote_ops_run_in_the_widest_input_type():
    """promote (addcmul): fp32 beside bf16 makes all fp32; all bf16 stays bf16."""
    a, b = torch.randn(8).to(BF16), torch.randn(8)
    with cuda_autocast_rules(), torch.autocast("cpu", dtype=BF16):
        assert torch.addcmul(a, b, a).dtype == torch.float32
        assert torch.addcmul(a, a, a).dtype == BF16


def test_banned_ops_refuse_as_on_cuda():
    with (
        cuda_autocast_rules(),
        torch.autocast("cpu", dtype=BF16),
        pytest.raises(RuntimeError, match="unsafe to autocast"),
    ):
        F.binary_cross_entropy(torch.rand(4), torch.rand(4))


def test_the_rules_are_the_installed_pytorchs_own():
    """Every op CUDA autocast registers gets a rule read off its CUDA kernel, and on CPU
    kernels under those rules it returns the dtype the CUDA kernel returns (fake CUDA tensors,
    real AutocastCUDA kernels: no GPU needed for a forward)."""
    policies = Counter()
    compared = 0
    for name in cuda_ops():
        rule = rule_for(name)
        if rule is None:
            continue
        policies[rule.policy] += 1
        if rule.policy is Policy.BANNED:
            continue
        op = overload(name)
        for dtypes in ([torch.float32], [torch.float16]):
            expected = got = None
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                with _cuda_autocast_enabled(), FakeTensorMode(allow_non_fake_inputs=True):
                    args, kwargs = _probe_args(op, (2, 2), False, dtypes)
                    try:
                        expected = op(*args, **kwargs)
                    except Exception:
                        continue
                with FakeTensorMode(allow_non_fake_inputs=True):
                    args, kwargs = _probe_args(op, (2, 2), False, dtypes)
                    args = [a.to("cpu") if isinstance(a, torch.Tensor) else a for a in args]
                    if any(isinstance(a, list) for a in args):
                        continue
                    with cuda_autocast_rules(), torch.autocast("cpu", dtype=torch.float16):
                        try:
                            got = op(*args, **kwargs)
                        except Exception:  # a CUDA-only op (cudnn_convolution)
                            continue
            first = lambda out: out[0] if isinstance(out, (tuple, list)) else out  # noqa: E731
            assert first(got).dtype == first(expected).dtype, name
            compared += 1
    assert policies[Policy.LOWER_PRECISION_FP] >= 30 and policies[Policy.FP32] >= 50
    assert policies[Policy.PROMOTE] >= 5 and policies[Policy.FP32_SET_OPT_DTYPE] >= 5
    assert compared >= 100


def call(**changes: object) -> AttentionCall:
    base = dict(
        dtype=BF16,
        head_dim_qk=128,
        head_dim_v=128,
        query_heads=32,
        key_heads=32,
        query_len=2048,
        key_len=2048,
        has_mask=False,
        dropout=0.0,
        is_causal=True,
        enable_gqa=False,
        requires_grad=True,
    )
    base.update(changes)
    return AttentionCall(**base)  # type: ignore[arg-type]


def test_attention_backend_follows_the_cards_capability_dtype_mask_and_heads():
    """``select_sdp_backend``'s order and checks (sdp_utils.cpp)."""
    a100, t4, h100 = (8, 0), (7, 5), (9, 0)
    assert choose_backend(call(), a100, 92400) == "flash"
    assert choose_backend(call(), h100, 92400) == "cudnn"  # preferred on sm90, cuDNN > 9.15
    assert choose_backend(call(), h100, 91000) == "flash"
    assert choose_backend(call(dtype=torch.float16), t4, 92400) == "efficient"  # no flash < sm80
    assert choose_backend(call(dtype=torch.float32), a100, 92400) == "efficient"
    assert choose_backend(call(has_mask=True), a100, 92400) == "efficient"
    # GQA: flash takes it when the call allows it; efficient never does, so with a mask: math.
    assert choose_backend(call(key_heads=8, enable_gqa=True), a100, 92400) == "flash"
    assert choose_backend(call(key_heads=8, enable_gqa=True, has_mask=True), a100, 92400) == "math"
    # sm86/89 cannot train flash with head dims in (192, 224]
    assert choose_backend(call(head_dim_qk=208, head_dim_v=208), (8, 9), 92400) == "efficient"
    assert choose_backend(call(head_dim_qk=208, head_dim_v=208), a100, 92400) == "flash"
    # efficient needs the head dim aligned (8 for 16-bit with tensor cores), math otherwise
    assert choose_backend(call(head_dim_qk=36, head_dim_v=36, has_mask=True), a100, None) == "math"


def test_fused_attention_saves_a_log_sum_exp_where_cpu_saves_scores():
    """On CPU kernels under the card's rules, SDPA runs CUDA's flash op: its backward node keeps
    (batch, heads, seq) fp32 log-sum-exps, not a (seq x seq) matrix."""
    with FakeTensorMode(), cuda_kernels((8, 0), 92400) as kernels:
        q = torch.empty(1, 4, 256, 64, dtype=BF16, requires_grad=True)
        out = F.scaled_dot_product_attention(q, q, q, is_causal=True)
        saved = [
            getattr(out.grad_fn, name)
            for name in dir(out.grad_fn)
            if name.startswith("_saved_") and isinstance(getattr(out.grad_fn, name), torch.Tensor)
        ]
    assert type(out.grad_fn).__name__ == "ScaledDotProductFlashAttentionBackward0"
    assert kernels.backends == Counter({"flash": 1})
    assert all(t.numel() // 4 < 256 * 256 for t in saved)  # nothing of seq^2 per head
    assert any(t.dtype == torch.float32 and t.shape == (1, 4, 256) for t in saved)


def test_dropout_saves_a_one_byte_mask_as_cudas_fused_kernel_does():
    x = torch.randn(64, 64, requires_grad=True)
    plain = F.dropout(x, 0.1, True)
    with cuda_kernels((8, 0), None):
        fused = F.dropout(x, 0.1, True)
        unchanged = F.dropout(x, 0.0, True)
    assert type(plain.grad_fn).__name__ != "NativeDropoutBackward0"
    assert type(fused.grad_fn).__name__ == "NativeDropoutBackward0"
    assert fused.grad_fn._saved_result1.dtype == torch.bool
    assert unchanged is x


def test_cards_name_their_sources_and_assume_a_documented_context():
    for name, card in CATALOGUE.items():
        assert card.name == name and card.memory_bytes > 10 * 2**30, name
        assert card.sources and card.peak_tflops, name
        assert 100 * 2**20 < card.context < 2**30, name  # "300-400 MB with lazy loading"
    assert CATALOGUE["h100-80gb"].cublas_workspace_bytes == 32 * 2**20
    assert CATALOGUE["a100-80gb"].cublas_workspace_bytes == 8_519_680  # :4096:2:16:8


def test_nccl_buffers_only_for_several_ranks():
    card = CATALOGUE["h100-80gb"]
    assert nccl_bytes(card, 1) == 0
    assert nccl_bytes(card, 8) > nccl_bytes(CATALOGUE["rtx-4090"], 8) > 0


MiB = 2**20


def test_device_memory_is_reserved_plus_context_and_judged_with_free_and_retry():
    """A step that frees a 30 MiB block then asks for 40 MiB: unbounded, the allocator keeps
    the cached 30 MiB segment and adds 40 (70 reserved); capped, it releases the cache and
    retries, so it fits a budget the unbounded replay exceeds."""
    card = CATALOGUE["a100-80gb"]
    history = [(0, 30 * MiB)]
    window = [(0, -1), (1, 40 * MiB)]
    step = Replayable(history, window, AllocatorConfig(), card, 1)
    free = step.device_memory(None)
    assert free.reserved == 70 * MiB and free.allocated == 40 * MiB
    assert free.device == free.reserved + card.context
    budget = card.context + 50 * MiB
    capped = step.device_memory(budget)
    assert capped.fits and capped.reserved == 40 * MiB and capped.alloc_retries == 1
    too_small = step.device_memory(card.context + 30 * MiB)
    assert too_small.fits is False and too_small.reserved == 70 * MiB
