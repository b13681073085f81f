"""Which of a model's repeated blocks is at work: the tag ``AllocationLog`` files each event
under, so a shallow model's log can be extended to its full depth (``block_repeat``).

Forward: a block's forward pre- and post-hooks (recomputation under checkpointing runs the
block's forward again inside its backward, and the tag is the same block's). Backward: the
autograd node that made a block's output runs first of the block's nodes, and the block below
begins when the node of *its* output runs (a pre-hook on each node, public autograd API;
neither hook adds an op or a tensor). Outside every block (embeddings, head, loss, optimizer)
the tag is -1; in the optimizer's step the log tags an op's outputs by the block of the
parameter, gradient or state they stand for (``AllocationLog.inherited``): a ``_foreach`` op
makes one output per parameter, in parameter order, so its sweep over the parameters is a
sweep over the blocks. (Elsewhere an output of no block stays -1 even where its input is a
block's: the head's logits are the model's, not its last block's, and may be freed anywhere.)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from harness.meters.block_repeat import OUTSIDE


class BlockTags:
    """The block at work now (``current``): hooks on ``blocks`` (in execution order), the
    ``model`` (a forward begins outside every block) and the ``optimizer`` (its step is
    outside every block)."""

    def __init__(
        self, model: nn.Module, blocks: Sequence[nn.Module], optimizer: torch.optim.Optimizer
    ) -> None:
        self.blocks = list(blocks)
        self.forward: list[int] = []  # blocks whose forward is running, innermost last
        self.backward = OUTSIDE  # the block whose backward is running
        self.after = OUTSIDE  # in the model's forward, the block that ran last (none running)
        self.optimizing = False  # inside the optimizer's step
        self.stepping = OUTSIDE  # the block the optimizer's step last made an output for
        self.parameter_blocks: dict[int, int] = {}  # id(parameter) -> its block
        for index, block in enumerate(blocks):
            for parameter in block.parameters():
                self.parameter_blocks[id(parameter)] = index
        self.handles: list[Any] = []
        for index, block in enumerate(blocks):
            self.handles.append(block.register_forward_pre_hook(self._entered(index), prepend=True))
            self.handles.append(block.register_forward_hook(self._left(index)))
        self.handles.append(model.register_forward_pre_hook(self._outside, prepend=True))
        self.handles.append(model.register_forward_hook(self._outside))
        self.handles.append(optimizer.register_step_pre_hook(self._step_begins))
        self.handles.append(optimizer.register_step_post_hook(self._step_ends))

    @property
    def current(self) -> int:
        return self.forward[-1] if self.forward else self.backward

    @property
    def freeing(self) -> int:
        """The block a free now belongs to: the one at work, or between two blocks' forwards
        the one that just ran (what dies there is what its turn left behind); OUTSIDE where a
        free should go under its allocation's block."""
        current = self.current
        return current if current != OUTSIDE else self.after

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    def _outside(self, *_: Any) -> None:
        self.backward = self.after = OUTSIDE

    def _step_begins(self, *_: Any) -> None:
        self.backward, self.optimizing, self.stepping = OUTSIDE, True, OUTSIDE

    def _step_ends(self, *_: Any) -> None:
        self.optimizing = False

    def _entered(self, index: int) -> Callable[..., None]:
        def hook(*_: Any) -> None:
            self.forward.append(index)
            self.after = OUTSIDE

        return hook

    def _left(self, index: int) -> Callable[..., None]:
        def hook(_module: Any, _inputs: Any, output: Any) -> None:
            if self.forward and self.forward[-1] == index:
                self.forward.pop()
            if not self.forward:
                self.after = index
            node = _grad_fn(output)
            if node is not None:
                node.register_prehook(self._backward_of(index))

        return hook

    def _backward_of(self, index: int) -> Callable[..., None]:
        def hook(*_: Any) -> None:
            self.backward = index

        return hook


def _grad_fn(output: Any) -> Any:
    """The autograd node of a block's output (its first tensor that has one)."""
    if isinstance(output, torch.Tensor):
        return output.grad_fn
    if isinstance(output, tuple | list):
        for item in output:
            node = _grad_fn(item)
            if node is not None:
                return node
    return None
