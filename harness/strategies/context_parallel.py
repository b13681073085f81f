"""``cp:N``: context parallelism, every sequence split over N ranks (PyTorch's ring attention).

Each rank keeps 1/N of every sequence of its batch, so every activation is 1/N; attention,
the one op that needs the whole sequence, becomes ring attention: each rank's queries meet
the other ranks' keys and values as they rotate round the ranks (PyTorch's
``torch.distributed.tensor.experimental.context_parallel``, which patches
``scaled_dot_product_attention`` while a step runs). Its kernels are CUDA's flash and
memory-efficient attention, so a trial runs on CUDA only; the estimator predicts it anywhere (a
CUDA target's attention runs through those kernels' shapes on fake tensors).

What is ours: what must be split along with the tokens. A position's identity must survive the
split (ring attention balances the causal work by giving rank r chunks r and 2N - 1 - r), so
the positions are split beside the tokens and handed to the model (``gpt``'s ``positions``, a
Hugging Face model's ``position_ids``); a causal LM's labels are shifted *before* the split
(``shift_labels``), not inside each rank's part. The parameters are whole on every rank and
each rank's gradient covers its part of the sequences: they are averaged over the ``cp`` ranks
with the data-parallel ones (FSDP or DDP over both dimensions; DDP over ``cp`` alone without
either).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from harness.compat.internals import CP_OPTIONS, Missing, cp_options
from harness.strategies.base import Strategy, StrategyError, TrialContext
from harness.strategies.mesh import require_group, submesh
from harness.strategies.parallel import Ddp
from harness.workloads.task import IGNORE
from harness.workloads.tensors import INPUTS, Batch


@contextlib.contextmanager
def balanced(enabled: bool) -> Iterator[None]:
    """Ring attention's causal load balancing on or off (PyTorch keeps it a module option)."""
    options = cp_options()
    before = options.enable_load_balance
    options.enable_load_balance = enabled
    try:
        yield
    finally:
        options.enable_load_balance = before


class ContextParallel(Strategy):
    name = "cp"

    def __init__(self, arg: str | None = None) -> None:
        super().__init__(arg)
        self.extra: dict[str, torch.Tensor] = {}  # what the model is handed in this step
        self.ctx: TrialContext | None = None
        self.hf = False

    def prepare_model(self, model: nn.Module, ctx: TrialContext) -> nn.Module:
        try:
            CP_OPTIONS.load()
        except Missing as missing:  # torch 2.8: another context parallelism, refused here
            raise StrategyError(str(missing)) from None
        require_group("cp")
        hf = ctx.family == "hf"
        if hf and not getattr(ctx.task, "causal", False):
            raise StrategyError("cp: Hugging Face models are split for causal LMs only")
        self.ctx, self.hf = ctx, hf
        if ctx.layout.size("tp") > 1 or ctx.layout.size("pp") > 1:
            raise StrategyError("cp: combined with tp or pp is not built; use cp with fsdp/ddp")
        model.register_forward_pre_hook(self._hand_over, with_kwargs=True)
        if "dp" in ctx.layout.names:
            return model  # ddp/fsdp average the gradients over dp and cp together
        # Alone, the context ranks are one another's replicas: DDP over them.
        return Ddp().wrap(model, ctx, submesh(ctx, "cp").get_group())

    def _hand_over(self, module: nn.Module, args: Any, kwargs: dict[str, Any]) -> Any:
        """The split positions (and pre-shifted labels) go in beside the split tokens."""
        return args, {**kwargs, **self.extra}

    @contextlib.contextmanager
    def batch_context(self, batch: Batch) -> Iterator[None]:
        """While one micro-batch's forward and backward run: its sequences split over the
        ``cp`` ranks (in place, with the positions and labels that must split with them) and
        attention made ring attention."""
        from torch.distributed.tensor.experimental import context_parallel

        assert self.ctx is not None
        tokens = batch[INPUTS] if INPUTS in batch else batch["input_ids"]
        width, ranks = tokens.shape[1], self.ctx.layout.size("cp")
        # gpt: balanced causal work, chunks r and 2N - 1 - r per rank; a Hugging Face model
        # contiguous parts (it reads a jump in its positions as a new packed sequence).
        parts = ranks if self.hf else 2 * ranks
        if width % parts:
            raise StrategyError(
                f"cp:{ranks}: sequences of {width} tokens do not split into {parts} equal parts"
            )
        positions = torch.arange(width, device=tokens.device).expand(tokens.shape[0], width)
        buffers = {name: t.clone() for name, t in batch.items() if t.dim() >= 2}
        batch.update(buffers)  # split in place: copies, not the staged batch's views
        extra = {"position_ids" if self.hf else "positions": positions.clone()}
        if self.hf:
            labels = buffers.get("labels", buffers.get(INPUTS, buffers.get("input_ids")))
            assert labels is not None, "a causal LM's batch holds its token ids"
            shifted = torch.full_like(labels, IGNORE)
            shifted[:, :-1] = labels[:, 1:]
            extra["shift_labels"] = shifted
        everything = [*buffers.values(), *extra.values()]
        mesh = submesh(self.ctx, "cp")
        with (
            balanced(not self.hf),
            context_parallel(
                mesh,
                buffers=everything,
                buffer_seq_dims=[1] * len(everything),
                no_restore_buffers=set(everything),
            ),
        ):
            self.extra = extra
            try:
                yield
            finally:
                self.extra = {}
