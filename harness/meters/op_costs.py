"""What one training step asks of the hardware, op by op: FLOPs and bytes moved.

The speed prediction (``harness.meters.roofline``) prices these on a card. They are counted
on the same step the memory prediction runs on fake tensors (``harness.trial.estimate``), so
one pass gives both, and what is priced is what the trial runs: its strategies, its autocast
dtypes, its optimizer step, its recomputation.

Every aten op the step dispatches gets one rule, and the rule is recorded with it:

- ``flops``: torch's own FLOP formulas (``torch.utils.flop_counter``: matmuls, convolutions,
  attention), plus the CPU's fused attention, which torch has no formula for; priced by the
  larger of compute time and memory time.
- ``memory``: pointwise ops, reductions, copies, indexing, norms, softmax, the optimizer's
  ``_foreach`` ops: bytes read and written, priced on memory bandwidth.
- ``free``: views and bare allocations, which launch no kernel.
- ``collective``: communication between ranks (priced on the interconnect).
- ``no rule``: anything else; priced as memory traffic all the same, and named, so a
  prediction never hides that it guessed (``StepCosts.unmodelled``).

FLOPs done again because activations were not kept (``checkpoint``, ``sac``) are told apart:
a recomputation is a forward op run inside the backward pass with autograd recording (the
backward itself runs with it off). They count in the step's time, not in its *model* FLOPs,
the numerator of MFU (Chowdhery et al. 2022, PaLM, appendix B).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

from harness.compat.internals import (
    OpOverload,
    TorchDispatchMode,
    flop_formula_of_tensors,
    in_backward,
    tree_leaves,
)

FLOPS, MEMORY, FREE, COLLECTIVE, NO_RULE = "flops", "memory", "free", "collective", "no rule"

aten = torch.ops.aten


def _shape(value: Any) -> Any:
    return value.shape if isinstance(value, torch.Tensor) else value


def _cpu_attention(query: Any, key: Any, value: Any, *args: Any, **kwargs: Any) -> int:
    return sdpa_flop_count(_shape(query), _shape(key), _shape(value))


def _cpu_attention_backward(
    grad_out: Any, query: Any, key: Any, value: Any, *args: Any, **kwargs: Any
) -> int:
    return sdpa_backward_flop_count(_shape(grad_out), _shape(query), _shape(key), _shape(value))


def _heads_broadcast(formula: Any, query_at: int) -> Any:
    """An SDPA formula that counts grouped-query attention (key/value with fewer heads than the
    query, ``enable_gqa``) as the kernel computes it: every query head against its group's
    key/value head, i.e. key and value broadcast to the query's heads. torch's own formulas
    learnt this after 2.11, whose assertion crashed the first card run's Llama trials; shapes
    (``torch.Size``) stand in for the tensors, which torch's formulas only read shapes of."""

    def count(*args: Any, **kwargs: Any) -> Any:
        query, key, value = args[query_at : query_at + 3]
        shaped = all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in (query, key, value))
        if shaped and key.shape[1] != query.shape[1]:
            heads = query.shape[1]
            args = (
                *args[: query_at + 1],
                torch.Size((key.shape[0], heads, *key.shape[2:])),
                torch.Size((value.shape[0], heads, *value.shape[2:])),
                *args[query_at + 3 :],
            )
        return formula(*args, **kwargs)

    return flop_formula_of_tensors(count)


def _scaled_mm(mat1: Any, mat2: Any, *args: Any, **kwargs: Any) -> int:
    """fp8 matmul (torchao's float8): ``mat1 @ mat2``'s multiply-adds, its scales aside."""
    m, k = _shape(mat1)
    n = _shape(mat2)[-1]
    return 2 * m * k * n


# torch's formulas take the op's tensors (they are wrapped to read shapes); these are missing.
_FORMULAS: dict[Any, Any] = {
    **flop_registry,
    aten._scaled_dot_product_flash_attention_for_cpu: _cpu_attention,
    aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_attention_backward,
    aten._scaled_mm: _scaled_mm,
}
# The fused attention ops (query, key, value as batch, heads, sequence, head dim; a backward's
# after its output gradient) take grouped-query shapes.
for _op, _formula in list(_FORMULAS.items()):
    if _op.__name__.startswith("_scaled_dot_product_"):
        _FORMULAS[_op] = _heads_broadcast(_formula, 1 if _op.__name__.endswith("_backward") else 0)

# torch's own FLOP formulas with grouped-query attention counted, for ``FlopCounterMode``'s
# ``custom_mapping`` (``trial/recompute.py``): torch 2.11's assert on it otherwise.
ATTENTION_FORMULAS: dict[Any, Any] = {
    op: formula for op, formula in _FORMULAS.items() if op.__name__.startswith("_scaled_dot_")
}

# Memory-bound ops by tag; ``torch.Tag.reduction`` is younger than torch 2.9, so an older torch
# gets the ops torch 2.14 tags reduction (and not pointwise) by name.
_MEMORY_TAGS = frozenset(
    getattr(torch.Tag, name) for name in ("pointwise", "reduction") if hasattr(torch.Tag, name)
)
_UNTAGGED_REDUCTIONS = (
    frozenset()
    if hasattr(torch.Tag, "reduction")
    else frozenset(
        {
            "all", "amax", "amin", "aminmax", "any", "argmax", "argmin", "count_nonzero",
            "linalg__powsum", "linalg_vector_norm", "logsumexp", "max", "mean", "min", "nansum",
            "norm", "prod", "std", "std_mean", "sum", "var", "var_mean",
        }
    )
)  # fmt: skip

# Memory-bound ops torch tags neither pointwise nor reduction.
_MEMORY_OPS = {
    "copy_", "_to_copy", "clone", "contiguous", "fill_", "zero_", "zeros_like", "ones_like",
    "full_like", "zeros", "ones", "full", "scalar_tensor", "arange", "cat", "stack", "split",
    "index", "index_select", "index_put_", "index_put", "index_add_", "_index_put_impl_",
    "gather", "scatter", "scatter_", "scatter_add", "scatter_add_", "embedding",
    "embedding_dense_backward", "masked_fill", "masked_fill_", "where", "tril", "triu",
    "constant_pad_nd", "slice_backward", "select_backward", "expand_copy",
    "native_layer_norm", "native_layer_norm_backward", "_fused_rms_norm",
    "_fused_rms_norm_backward", "native_batch_norm", "native_batch_norm_backward",
    "_native_batch_norm_legit", "_native_batch_norm_legit_functional",
    "_native_batch_norm_legit_no_training", "native_group_norm", "native_group_norm_backward",
    "_softmax", "_softmax_backward_data", "_log_softmax", "_log_softmax_backward_data",
    "nll_loss_forward", "nll_loss_backward", "nll_loss2d_forward", "nll_loss2d_backward",
    "native_dropout", "native_dropout_backward", "bernoulli_", "uniform_", "normal_",
    "max_pool2d_with_indices", "max_pool2d_with_indices_backward", "avg_pool2d",
    "avg_pool2d_backward", "_adaptive_avg_pool2d", "_adaptive_avg_pool2d_backward",
    "topk", "sort", "cumsum", "repeat", "roll", "flip", "_fused_adam_", "_fused_adamw_",
    "_fused_sgd_", "linalg_vector_norm", "_amp_foreach_non_finite_check_and_unscale_",
    "_amp_update_scale_", "masked_scatter", "_local_scalar_dense", "rand", "randn", "randint",
    "randperm", "new_zeros", "new_ones", "new_full", "lift_fresh_copy", "_pin_memory", "silu",
    "silu_backward", "gelu", "gelu_backward", "threshold_backward", "nonzero",
    "all_gather_copy_in", "split_with_sizes_copy", "chunk_cat", "_chunk_cat",
}  # fmt: skip
# No kernel: allocations without a write, metadata.
_FREE_OPS = {
    "_unsafe_view",  # a view without autograd's view tracking: no copy, no kernel
    "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "lift_fresh",
    "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "is_same_size", "set_",
    "resize_", "record_stream", "_has_compatible_shallow_copy_type", "detach_", "_version",
    "device", "_record_function_enter", "_record_function_enter_new", "_record_function_exit",
}  # fmt: skip
_COLLECTIVE_NAMESPACES = {"c10d", "_c10d_functional", "c10d_functional", "_dtensor"}


@dataclass(frozen=True, slots=True)
class OpCall:
    """One dispatched op: its rule, the dtype it computes in, its work."""

    name: str  # "mm", "_foreach_add_", ...
    rule: str  # FLOPS, MEMORY, FREE, COLLECTIVE, NO_RULE
    dtype: str  # of its first floating-point input (else its first tensor): the peak it runs at
    flops: float
    bytes: float  # read + written; a collective's: what one rank sends (collective_traffic)
    recompute: bool  # a forward op run again in the backward (checkpointing)
    head_dim: int = 0  # fused attention's (its first input's last size): its speed depends on it


@dataclass
class StepCosts:
    """Every op of the steps counted, and how many steps that was."""

    calls: list[OpCall] = field(default_factory=list)
    steps: int = 1

    @property
    def flops(self) -> float:
        """FLOPs of one step as executed, recomputation included."""
        return sum(call.flops for call in self.calls) / self.steps

    @property
    def model_flops(self) -> float:
        """FLOPs of one step without recomputation: the numerator of MFU."""
        return sum(call.flops for call in self.calls if not call.recompute) / self.steps

    @property
    def bytes(self) -> float:
        return sum(call.bytes for call in self.calls) / self.steps

    @property
    def unmodelled(self) -> list[str]:
        """The ops no rule covers (priced as memory traffic), most called first."""
        counts = Counter(call.name for call in self.calls if call.rule == NO_RULE)
        return [name for name, _ in counts.most_common()]


def _tensors(tree: Any) -> list[torch.Tensor]:
    """The tensors in an op's arguments or outputs: a tensor, or flat sequences of them as
    nearly every op takes and returns, without pytree's walk (a fifth of the counter's cost
    per op); anything nested deeper is walked."""
    if isinstance(tree, torch.Tensor):
        return [tree]
    found: list[torch.Tensor] = []
    for item in tree.values() if isinstance(tree, dict) else tree:
        if isinstance(item, torch.Tensor):
            found.append(item)
        elif isinstance(item, (list, tuple, dict)):
            found.extend(leaf for leaf in tree_leaves(item) if isinstance(leaf, torch.Tensor))
    return found


FLOAT8 = frozenset(
    getattr(torch, name)
    for name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
    if hasattr(torch, name)
)


def _stored(tensor: torch.Tensor) -> torch.Tensor:
    """What a kernel reads of ``tensor``: the fp8 payload of a wrapper that holds one (torchao's
    ``Float8TrainingTensor`` says its high-precision dtype, but its ``mm`` runs
    aten ``_scaled_mm`` on the fp8 data, below this mode), else the tensor itself."""
    flatten = getattr(tensor, "__tensor_flatten__", None)
    if flatten is None:
        return tensor
    for name in flatten()[0]:
        inner = getattr(tensor, name, None)
        if isinstance(inner, torch.Tensor) and inner.dtype in FLOAT8:
            return inner
    return tensor


def _nbytes(tensors: list[torch.Tensor]) -> float:
    return float(sum(t.numel() * t.element_size() for t in map(_stored, tensors)))


_RULES: dict[Any, str] = {}  # an op's rule, found once


def rule_of(func: OpOverload) -> str:
    """Which rule prices ``func`` (module docstring)."""
    rule = _RULES.get(func)
    if rule is None:
        rule = _RULES[func] = _find_rule(func)
    return rule


def _find_rule(func: OpOverload) -> str:
    packet = func.overloadpacket
    if packet in _FORMULAS:
        return FLOPS
    if func.namespace in _COLLECTIVE_NAMESPACES:
        return COLLECTIVE
    name = packet.__name__
    if func.is_view or name in _FREE_OPS:
        return FREE
    if (
        not _MEMORY_TAGS.isdisjoint(func.tags)
        or name in _UNTAGGED_REDUCTIONS
        or name in _MEMORY_OPS
        or name.startswith("_foreach_")
    ):
        return MEMORY
    return NO_RULE


def collective_traffic(name: str, read: float, written: float, ranks: int) -> float:
    """Bytes one rank sends over its link for a collective, as ring algorithms move them (NCCL's
    and gloo's for large messages): an all-reduce 2(N-1)/N of the tensor, an all-gather
    (N-1)/N of its output, a reduce-scatter (N-1)/N of its input, N the ranks (the default
    group's); waiting on one moves nothing; any other (broadcast, send) its input."""
    share = (ranks - 1) / ranks
    flat = name.replace("_", "")
    if "wait" in flat:
        return 0.0
    if "allreduce" in flat:
        return 2 * share * read
    if "allgather" in flat:
        return share * written
    if "reducescatter" in flat:
        return share * read
    return read


def _compute_dtype(tensors: list[torch.Tensor]) -> str:
    for tensor in map(_stored, tensors):
        if tensor.is_floating_point():
            return str(tensor.dtype).removeprefix("torch.")
    return str(tensors[0].dtype).removeprefix("torch.") if tensors else "none"


def _recomputing() -> bool:
    """Inside the backward pass with autograd recording: a checkpoint's recomputation (the
    backward's own ops run with grad mode off unless ``create_graph``, which no trial uses)."""
    return in_backward() and torch.is_grad_enabled()


class OpCostCounter(TorchDispatchMode):
    """Records an ``OpCall`` for every aten op dispatched while it is active (fake tensors
    too: only shapes and dtypes are read)."""

    def __init__(self) -> None:
        super().__init__()
        self.costs = StepCosts()
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        self.ranks = torch.distributed.get_world_size() if distributed else 1

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self.record(func, args, kwargs, out)
        return out

    def record(self, func: Any, args: Any, kwargs: Any, out: Any) -> None:
        """File one op that ran, with its arguments and what it returned: what the mode does
        for each op, for a dispatch mode already in place to call instead (each mode in the
        stack costs every op a Python round trip through the dispatcher: a fifth of a fake
        step)."""
        kwargs = kwargs or {}
        rule = rule_of(func)
        if rule == FREE:
            return
        inputs = _tensors(args)
        if kwargs:
            inputs.extend(_tensors(kwargs))
        outputs = _tensors(out) if isinstance(out, (torch.Tensor, list, tuple, dict)) else []
        flops = 0.0
        if rule == FLOPS:
            flops = float(_FORMULAS[func.overloadpacket](*args, **kwargs, out_val=out))
        name = func.overloadpacket.__name__
        moved = (
            collective_traffic(name, _nbytes(inputs), _nbytes(outputs), self.ranks)
            if rule == COLLECTIVE
            else _nbytes(inputs) + _nbytes(outputs)
        )
        self.costs.calls.append(
            OpCall(
                name=name,
                rule=rule,
                dtype=_compute_dtype(inputs or outputs),
                flops=flops,
                bytes=moved,
                recompute=_recomputing(),
                head_dim=inputs[0].shape[-1] if "attention" in name and inputs else 0,
            )
        )
