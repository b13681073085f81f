"""``pp:N[:SCHEDULE]``: pipeline parallelism, the model cut into N stages, one per rank.

The repeated blocks are split into contiguous stages of about equal parameters (the first
stage also holds the embeddings, the last the final norm and the output head); each rank keeps
only its stage(s) and trains them under a ``torch.distributed.pipelining`` schedule over
micro-batches (``accumulate:K``'s K, else 2N): ``gpipe`` (all forwards, then all backwards:
every micro-batch's activations alive at once), ``1f1b`` (the default: a stage runs one
backward per forward once the pipeline is full, so stage s holds at most N - s micro-batches'
activations) or ``interleaved`` (two virtual stages per rank, round robin: a smaller bubble, a
little more activation memory). A weight the embedding and the head share becomes a copy on
each end, their gradients summed every step, so the pipeline trains the model unsplit training
would.

What is ours: where to cut a model (``gpt`` and Hugging Face decoders; a stage is the model
with the other stages' parts removed, so its own ``forward`` still runs it), the static shapes
each stage sends (so a step needs no shape handshake, and the estimator can run a stage alone
on its fake process group), and the glue to the training loop (``PipelineTask``: a schedule
runs the whole step, forward and backward). The schedules, stages and their p2p are PyTorch's.
"""

from __future__ import annotations

import copy
import itertools
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from harness.strategies.base import Strategy, StrategyError, TrialContext
from harness.strategies.mesh import require_group, submesh
from harness.workloads.task import IGNORE, Task
from harness.workloads.tensors import INPUTS, TARGETS, Batch

SCHEDULES = ("1f1b", "gpipe", "interleaved")


def balanced_cuts(sizes: list[int], parts: int) -> list[tuple[int, int]]:
    """Contiguous ranges of ``sizes`` (blocks' parameter counts), ``parts`` of them, each
    ending as close to its equal share of the total as whole blocks allow; none empty."""
    if parts > len(sizes):
        raise StrategyError(f"pp: {parts} stages need at least {parts} blocks (got {len(sizes)})")
    cumulative = list(itertools.accumulate(sizes))
    ends, start = [], 0
    for part in range(1, parts):
        share = cumulative[-1] * part / parts
        # Leave at least one block for each later stage; ties go to the earlier cut.
        candidates = range(start + 1, len(sizes) - (parts - part) + 1)
        start = min(candidates, key=lambda end: abs(cumulative[end - 1] - share))
        ends.append(start)
    bounds = [0, *ends, len(sizes)]
    return list(itertools.pairwise(bounds))


def _parameters(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


class Stage(nn.Module):
    """One stage of a model: ``forward`` takes the previous stage's hidden states (token ids on
    the first stage) and returns the next's (logits on the last)."""

    def __init__(self, model: nn.Module, hf: bool, first: bool) -> None:
        super().__init__()
        self.model, self.hf, self.first = model, hf, first

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.hf:
            return self.model(x)
        named = {"input_ids": x} if self.first else {"inputs_embeds": x}
        return self.model(**named, use_cache=False).logits


def _cut_gpt(model: nn.Module, start: int, end: int, first: bool, last: bool) -> nn.Module:
    # harness.workloads.gpt.GPT, whose forward skips the parts a stage does not hold
    whole: Any = model
    stage: Any = copy.copy(model)
    stage._modules = dict(model._modules)
    stage.blocks = nn.ModuleList(list(whole.blocks)[start:end])
    if not first:
        stage.tok_emb, stage.pos_emb = None, None
    if not last:
        stage.ln_f, stage.head = nn.Identity(), nn.Identity()
    return stage


def _cut_hf(model: nn.Module, start: int, end: int, first: bool, last: bool) -> nn.Module:
    inner: Any = getattr(model, "model", None)
    if inner is None or not isinstance(getattr(inner, "layers", None), nn.ModuleList):
        kind = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
        raise StrategyError(
            f"pp: no pipeline cut for {kind!r} (covered: gpt and Hugging Face decoders with "
            "model.layers: Llama, Qwen2, Qwen3, Mistral)"
        )
    stage = copy.copy(model)
    stage._modules = dict(model._modules)
    body = copy.copy(inner)
    body._modules = dict(inner._modules)
    body.layers = nn.ModuleList(list(inner.layers)[start:end])
    if not first:
        body.embed_tokens = None
    if not last:
        body.norm = nn.Identity()
        stage.lm_head = nn.Identity()
    stage.model = body
    return stage


def _tied(model: nn.Module, hf: bool) -> tuple[tuple[nn.Module, str], tuple[nn.Module, str]] | None:
    """The (module, attribute) of the input embedding's and the output head's weight where the
    two are one tensor, else None."""
    hf_model: Any = model
    if hf:
        embedding, head = hf_model.get_input_embeddings(), hf_model.get_output_embeddings()
    else:
        embedding, head = getattr(model, "tok_emb", None), getattr(model, "head", None)
    if embedding is None or head is None or embedding.weight is not head.weight:
        return None
    return (embedding, "weight"), (head, "weight")


def _in(module: nn.Module, part: nn.Module) -> bool:
    return any(module is child for child in part.modules())


def _blocks_of(model: nn.Module, hf: bool) -> list[nn.Module]:
    if hf:
        inner: Any = getattr(model, "model", None)
        layers = getattr(inner, "layers", None)
        return list(layers) if isinstance(layers, nn.ModuleList) else []
    return list(getattr(model, "blocks", []))


class PipelineModel(nn.Module):
    """What a rank holds: its stage(s) (two under ``interleaved``). ``blocks`` lists their
    blocks, so checkpointing and FSDP find them as in a whole model; ``parts`` are the stages,
    each one FSDP root or DDP replica (the schedule calls them)."""

    def __init__(self, parts: list[Stage], indices: list[int], stages: int) -> None:
        super().__init__()
        self.parts = nn.ModuleList(parts)  # DDP may wrap them
        self.stage_modules = tuple(parts)  # as cut: what their shapes are read from
        self.blocks = nn.ModuleList(
            block for part in parts for block in _blocks_of(part.model, part.hf)
        )
        self.indices, self.stages = indices, stages
        # The whole model's embedding and head were one weight (every rank knows), and where
        # this rank holds a copy: (module, attribute) each.
        self.had_tied = False
        self.tied: list[tuple[nn.Module, str]] = []

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("pp: a stage is run by its schedule (PipelineTask.step), not called")


class PipelineParallel(Strategy):
    name = "pp"

    @property
    def schedule(self) -> str:
        written = (self.arg or "").partition(":")[2].strip()
        return written or SCHEDULES[0]

    def prepare_model(self, model: nn.Module, ctx: TrialContext) -> nn.Module:
        require_group("pp")
        ranks = ctx.layout.size("pp")
        stage = ctx.layout.coordinates(ctx.rank).get("pp", 0)
        virtual = 2 if self.schedule == "interleaved" else 1
        total = ranks * virtual
        hf = ctx.family == "hf"
        if hf and not getattr(ctx.task, "causal", False):
            raise StrategyError(
                "pp: Hugging Face models are cut for causal language modelling only "
                f"(this one's task: {getattr(ctx.task, 'task', 'unknown')})"
            )
        blocks = _blocks_of(model, hf)
        cut = _cut_hf if hf else _cut_gpt
        if hf:
            cut(model, 0, 0, True, True)  # refuses what it cannot cut, in one line
        cuts = balanced_cuts([_parameters(block) for block in blocks], total)
        indices = [stage + k * ranks for k in range(virtual)]  # round robin (interleaved)
        tied = _tied(model, hf)
        parts = [
            Stage(cut(model, *cuts[i], i == 0, i == total - 1), hf, first=i == 0) for i in indices
        ]
        ctx.notes["pp_stages"] = total
        ctx.notes["pp_blocks"] = ", ".join(f"{a}-{b - 1}" for a, b in cuts)
        pipeline = PipelineModel(parts, indices, total)
        if tied is not None and total > 1:
            # The first stage's embedding and the last stage's head were one weight: each end
            # keeps a copy (same initial values) and their gradients are summed every step.
            pipeline.had_tied = True
            pipeline.tied = [t for t in tied if any(_in(t[0], part) for part in parts)]
        return pipeline

    def prepare_task(self, task: Any, model: nn.Module, ctx: TrialContext) -> Any:
        if not isinstance(model, PipelineModel):
            raise StrategyError("pp: the model was replaced after it was cut into stages")
        return PipelineTask(model, ctx, self.schedule)


def _hidden_dtype(model: PipelineModel) -> torch.dtype:
    """The residual stream's dtype between stages: the parameters' (autocast computes in 16
    bits, but the residual additions promote back to the stored dtype)."""
    for parameter in model.parameters():
        if parameter.is_floating_point():
            return parameter.dtype
    return torch.float32


class PipelineTask(Task):
    """The step of a pipeline stage: its schedule runs every micro-batch's forward and backward
    (``runs_step``); the loss (known on the last stage) is shared with every stage."""

    runs_step = True

    def __init__(self, model: PipelineModel, ctx: TrialContext, schedule: str):
        self.model, self.ctx, self.kind = model, ctx, schedule
        self.hf = ctx.family == "hf"
        self.group = submesh(ctx, "pp").get_group()
        self.micro_batches = ctx.pipeline_micro_batches
        self.schedules: dict[tuple[int, ...], Any] = {}  # by input shape
        self.ends = ends_group(ctx) if model.had_tied else None

    @property
    def last(self) -> bool:
        return self.model.stages - 1 in self.model.indices

    def tokens_and_targets(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        if INPUTS in batch:
            tokens = batch[INPUTS]
            return tokens, tokens if self.hf else batch[TARGETS]
        tokens = batch["input_ids"]
        return tokens, batch.get("labels", tokens)

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if self.hf:  # a causal LM's labels are its inputs: position t predicts t + 1
            logits, targets = logits[:, :-1], targets[:, 1:]
        return F.cross_entropy(
            logits.flatten(0, -2).float(), targets.flatten(), ignore_index=IGNORE
        )

    def schedule_for(self, tokens: torch.Tensor) -> Any:
        """The schedule for micro-batches of this shape, with every stage's shapes given (no
        handshake at the first step; the estimator's peers do not exist)."""
        key = tuple(tokens.shape)
        if key in self.schedules:
            return self.schedules[key]
        from torch.distributed.pipelining import (
            PipelineStage,
            Schedule1F1B,
            ScheduleGPipe,
            ScheduleInterleaved1F1B,
        )

        if tokens.shape[0] % self.micro_batches:
            raise StrategyError(
                f"pp: this rank's batch ({tokens.shape[0]}) does not split into "
                f"{self.micro_batches} micro-batches"
            )
        micro = (tokens.shape[0] // self.micro_batches, *tokens.shape[1:])
        hidden = (*micro, self.width())
        dtype = _hidden_dtype(self.model)
        out_dtype = (
            torch.get_autocast_dtype(tokens.device.type) if self.ctx.dtype != "fp32" else dtype
        )
        meta = torch.device("meta")  # examples: a stage keeps their shapes and dtypes only
        stages = []
        for index, part in zip(self.model.indices, self.model.parts, strict=True):
            first, last = index == 0, index == self.model.stages - 1
            # Hidden states require grad, as the real ones do: a stage sends its input's
            # gradient back, and receives its output's, only for tensors that require it.
            if first:
                inputs = torch.empty(micro, dtype=tokens.dtype, device=meta)
            else:
                inputs = torch.empty(hidden, dtype=dtype, device=meta, requires_grad=True)
            vocab = (self.vocabulary(),) if last else ()
            outputs = torch.empty(
                (*micro, *vocab) if last else hidden,
                dtype=out_dtype if last else dtype,
                device=meta,
                requires_grad=True,
            )
            stages.append(
                PipelineStage(
                    part,
                    index,
                    self.model.stages,
                    self.ctx.device,
                    input_args=inputs,
                    output_args=outputs,
                    group=self.group,
                )
            )
        options: dict[str, Any] = {"loss_fn": self.loss, "scale_grads": True}
        if self.kind == "interleaved":
            schedule = ScheduleInterleaved1F1B(stages, self.micro_batches, **options)
        else:
            kind = ScheduleGPipe if self.kind == "gpipe" else Schedule1F1B
            schedule = kind(stages[0], self.micro_batches, **options)
        self.schedules[key] = schedule
        return schedule

    def width(self) -> int:
        config: Any = getattr(self.model.stage_modules[0].model, "config", None)
        if config is not None:
            return int(config.hidden_size)
        block: Any = self.model.blocks[0]
        return int(block.ln1.normalized_shape[0])

    def vocabulary(self) -> int:
        part: Any = self.model.stage_modules[-1].model
        if self.hf:
            return int(part.config.vocab_size)
        return int(part.head.out_features)

    def step(self, batch: Batch) -> torch.Tensor:
        """One optimizer step's forwards and backwards: the mean loss over micro-batches."""
        tokens, targets = self.tokens_and_targets(batch)
        losses: list[torch.Tensor] = []
        self.schedule_for(tokens).step(tokens, target=targets, losses=losses)
        self.sum_tied_gradients()
        total = torch.zeros((), device=tokens.device)
        for loss in losses:
            total += loss.detach().float()
        return self.shared(total / self.micro_batches)

    def sum_tied_gradients(self) -> None:
        """The embedding's and the head's gradients summed at both ends of the pipeline: the
        gradient of the one tied weight, so both copies take the same optimizer step."""
        for module, name in self.model.tied:
            weight = getattr(module, name)
            if weight.grad is None:
                continue
            grad = weight.grad
            local = grad.to_local() if hasattr(grad, "to_local") else grad
            dist.all_reduce(local, group=self.ends)

    def shared(self, value: torch.Tensor) -> torch.Tensor:
        """A figure only the last stage knows, on every stage (a sum: the others give 0)."""
        value = value.detach().float().reshape(()).clone()
        dist.all_reduce(value, group=self.group)
        return value

    def forward(self, model: nn.Module, batch: Batch) -> tuple[torch.Tensor, Any]:
        raise RuntimeError("a pipeline stage's step is PipelineTask.step")

    def score(self, model: nn.Module, batch: Batch) -> tuple[int, float, int]:
        """A forward-only pass through the stages in order (p2p, one batch): the last stage
        scores it as the wrapped task would, and every stage reports the same numbers."""
        tokens, targets = self.tokens_and_targets(batch)
        ranks = dist.get_process_group_ranks(self.group)
        per_rank = len(ranks)
        held = dict(zip(self.model.indices, self.model.parts, strict=True))
        device = tokens.device
        x: torch.Tensor = tokens
        with torch.no_grad():
            for index in range(self.model.stages):
                owner = ranks[index % per_rank]
                before = ranks[(index - 1) % per_rank]
                if index in held:
                    if index > 0 and before != owner:
                        x = self._receive(before, device)
                    x = held[index](x)
                    after = ranks[(index + 1) % per_rank]
                    if index < self.model.stages - 1 and after != owner:
                        self._send(x, after)
            figures = torch.zeros(3, dtype=torch.float64, device=device)
            if self.last:
                logits = x
                shift = 1 if self.hf else 0
                predicted = logits[:, : logits.shape[1] - shift] if logits.dim() == 3 else logits
                labels = targets[:, shift:] if logits.dim() == 3 else targets
                valid = labels != IGNORE
                figures[0] = ((predicted.argmax(dim=-1) == labels) & valid).sum()
                figures[2] = valid.sum()
                figures[1] = self.loss(logits, targets).double() * figures[2]
            dist.all_reduce(figures, group=self.group)
        return int(figures[0].item()), float(figures[1].item()), int(figures[2].item())

    def _send(self, tensor: torch.Tensor, peer: int) -> None:
        shape = torch.tensor([*tensor.shape, _DTYPES.index(tensor.dtype)], device=tensor.device)
        dist.send(torch.tensor([shape.numel()], device=tensor.device), peer, group=self.group)
        dist.send(shape, peer, group=self.group)
        dist.send(tensor.contiguous(), peer, group=self.group)

    def _receive(self, peer: int, device: torch.device) -> torch.Tensor:
        length = torch.zeros(1, dtype=torch.int64, device=device)
        dist.recv(length, peer, group=self.group)
        shape = torch.zeros(int(length.item()), dtype=torch.int64, device=device)
        dist.recv(shape, peer, group=self.group)
        *dims, code = (int(v) for v in shape.tolist())
        tensor = torch.empty(dims, dtype=_DTYPES[code], device=device)
        dist.recv(tensor, peer, group=self.group)
        return tensor


def ends_group(ctx: TrialContext) -> Any:
    """The process group of this rank's pipeline's first and last stage. Every rank makes
    every pipeline's (``new_group`` is collective), in the same order."""
    mine = None
    for pipeline in ctx.layout.pipelines():
        group = dist.new_group([pipeline[0], pipeline[-1]])
        if ctx.rank in (pipeline[0], pipeline[-1]):
            mine = group
    return mine


_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int64)
