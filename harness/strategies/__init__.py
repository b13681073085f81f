"""Registry of training strategies (memory techniques), each one small module.

A spec names a strategy as ``name`` or ``name:arg`` (e.g. ``accumulate:4``); a grid entry may
combine several (``[checkpoint, accumulate:4]``), written canonically as ``checkpoint+accumulate:4``.
The registry is plain data (no torch import) so specs validate without loading model code.
``combination.py`` parses and checks terms and combinations against it (``Term``,
``Combination``), once, at spec validation; everything else asks those objects.

Adding a strategy: a module with a ``Strategy`` subclass plus one entry in ``STRATEGIES``; every
fact another layer needs about it (argument rules, clashes, devices, families, what it splits,
whether it can be predicted, its search cost, its closed-form effect) is a field of that entry.

Mixed precision is not a strategy: it is the ``dtype`` axis (``bf16``/``fp16`` autocast).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

ALL_DEVICES = ("cpu", "cuda")
# In ``StrategyInfo.families``: any user model (``family: module:attr``).
USER_FAMILY = "module:attr"


@dataclass(frozen=True)
class StrategyInfo:
    name: str
    doc: str  # what it does and the effect to expect (the README's strategy table)
    impl: str  # "module:Class"
    arg: str | None = None  # None: takes no argument; else what the argument means
    arg_type: type | None = None
    arg_optional: bool = False
    arg_max: float | None = None  # exclusive upper bound (fractions)
    # Words allowed after the number (``tp:2:sp``, ``pp:2:1f1b``); the first is the default.
    options: tuple[str, ...] = ()
    # The argument is one of these words instead of a number (``float8:rowwise``).
    words: tuple[str, ...] = ()
    # The argument may be ``auto``: how much to do is chosen before training, from the
    # estimator's predictions, for the trial's memory budget (``harness.trial.recompute``).
    auto: bool = False
    devices: tuple[str, ...] = ALL_DEVICES
    # The oldest CUDA compute capability whose kernels it needs, and which cards those are
    # (``float8``: (8, 9), "fp8 tensor cores: Ada, Hopper, Blackwell"); an older card is refused.
    min_capability: tuple[int, int] | None = None
    capability_why: str = ""
    group: str | None = None  # at most one strategy of a group per combination
    families: tuple[str, ...] | None = None  # None: every family
    bad_dtypes: tuple[str, ...] = ()  # dtype-axis values it cannot combine with
    conflicts: tuple[str, ...] = ()
    requires: str | None = None  # a strategy it modifies, which must be in the combination
    splits_batch: bool = False  # the argument must divide every batch size
    # The device-mesh dimension its argument sizes (``dp``: ddp/fsdp, ``tp``, ``pp``, ``cp``):
    # the trial runs on the product of them all (``combination.Layout``).
    mesh_dim: str | None = None
    micro_batches_from_arg: bool = False  # a step runs the argument's number of micro-batches
    # Applied in real trials only: the estimate predicts the step without it (compiled code
    # cannot run under tensor accounting, so it predicts the eager model, as the memory
    # window measures it).
    eager_only: bool = False
    # Why no step with it can run on fake tensors (None: predictable).
    unpredictable: str | None = None
    # What it multiplies a configuration's fit-search time by, roughly (an 8B Llama's, 2026-12:
    # none 20 s, checkpoint 28 s, sac 29 s, lora 53 s, qlora 97 s). Only the order in which
    # harness fit takes configurations depends on it.
    search_cost: float = 1.0
    # Its effect on the textbook closed form the estimate is cross-checked with: the factor on
    # model-state bytes (bf16_params: half), whether model state is split over the ranks
    # (fsdp), and whether only block inputs stay saved (checkpoint: ~2*s*b*h per layer).
    state_bytes_factor: float = 1.0
    shards_state: bool = False
    keeps_block_inputs_only: bool = False


def _info(name: str, doc: str, module: str, cls: str, **kw: Any) -> StrategyInfo:
    return StrategyInfo(name, doc, f"harness.strategies.{module}:{cls}", **kw)


# An optimizer swap's own learning rate (``sgd_momentum:0.05``): what suits Adam rarely suits
# SGD, so a grid comparing them gives each its own; left out, the strategy's default where it
# swaps to another family of optimizers, else the spec's train.optimizer.lr
# (``harness.strategies.optimizers``).
OPTIMIZER_LR: dict[str, Any] = {"arg": "learning rate", "arg_type": float, "arg_optional": True}

# Strategies that replace a block's Linear layers or their weights: a tensor-parallel plan
# (DTensor weights) and a pipeline stage's split cannot take them.
PARAMETER_REWRITERS = ("lora", "qlora", "compile", "quantize_int8", "prune", "prune_structured")

STRATEGIES: dict[str, StrategyInfo] = {
    info.name: info
    for info in [
        _info(
            "none",
            "plain training: the baseline every other strategy is compared with",
            "none",
            "NoStrategy",
        ),
        _info(
            "checkpoint",
            "activation recomputation: keep only block inputs, recompute the rest in backward "
            "(transformer blocks, ResNet stages, MLP layers); `checkpoint:K` checkpoints segments of K "
            "blocks (K = sqrt(n) is Chen et al.'s O(sqrt n)). Less activation memory, ~1/3 more "
            "compute. `checkpoint:auto`: the fewest blocks (those that save most per recomputed "
            "FLOP) whose predicted peak fits the budget",
            "checkpoint",
            "Checkpoint",
            arg="blocks per segment, or auto",
            arg_type=int,
            arg_optional=True,
            auto=True,
            search_cost=1.4,
            keeps_block_inputs_only=True,
        ),
        _info(
            "sac",
            "selective activation checkpointing (PyTorch's policy API): each block's matmul, "
            "attention and convolution outputs are kept, the cheap ops between them recomputed "
            "in backward. Activation memory between none and checkpoint, less extra compute "
            "than checkpoint. `sac:auto`: the fewest blocks recomputed in full instead whose "
            "predicted peak fits the budget",
            "selective",
            "SelectiveCheckpoint",
            arg="auto",
            arg_optional=True,
            auto=True,
            conflicts=("checkpoint",),
            search_cost=1.5,
        ),
        _info(
            "chunked_ce",
            "a causal LM's output projection and cross-entropy over C chunks of tokens, each "
            "chunk's logits recomputed in backward: no [batch, seq, vocab] logits (nor their "
            "fp32 copy or gradient) alive beyond one chunk's; the same loss and gradients. "
            "Default C: vocabulary / 16k, at least 2 (8 for Llama 3's 128k). Costs one more "
            "output projection per step",
            "chunked_loss",
            "ChunkedCrossEntropy",
            arg="chunks",
            arg_type=int,
            arg_optional=True,
            group="loss",
            families=("gpt", "hf", USER_FAMILY),
            conflicts=("compile",),
        ),
        _info(
            "fused_ce",
            "Liger's fused linear cross-entropy (liger-kernel, Triton): projection and loss "
            "in one CUDA kernel that never materialises the logits. CUDA only; not "
            "predictable (Triton kernels do not run on fake tensors): predict chunked_ce",
            "chunked_loss",
            "FusedCrossEntropy",
            devices=("cuda",),
            group="loss",
            families=("gpt", "hf", USER_FAMILY),
            conflicts=("compile",),
            unpredictable="Liger's Triton kernels cannot run on fake tensors",
        ),
        _info(
            "lora",
            "LoRA adapters of rank R (peft) on every Linear of the repeated blocks, base frozen "
            "(stored in the dtype axis' 16-bit type): gradients and optimizer state for the "
            "adapters only; activations stay near full fine-tuning's. train.lora sets alpha, "
            "dropout, targets, base_dtype",
            "lora",
            "Lora",
            arg="rank",
            arg_type=int,
            group="adapters",
            conflicts=("bf16_params", "prune", "prune_structured", "quantize_int8"),
            search_cost=2.5,
        ),
        _info(
            "qlora",
            "LoRA of rank R over a 4-bit base: the blocks' frozen Linear weights in NF4 with "
            "double-quantized blockwise scales (torchao NF4Tensor, ~0.52 B/param instead of 2), "
            "dequantized one layer at a time for compute; embeddings, norms, LM head in the "
            "base dtype",
            "lora",
            "QLora",
            arg="rank",
            arg_type=int,
            group="adapters",
            # torchao's NF4 sharding needs every inner tensor divisible by the ranks; not
            # measured here, so refused rather than left to crash mid-trial.
            conflicts=("bf16_params", "prune", "prune_structured", "quantize_int8", "fsdp"),
            search_cost=5.0,
        ),
        _info(
            "accumulate",
            "gradient accumulation: each optimizer step runs K micro-batches of batch/K, same effective "
            "batch; activation memory ~1/K, more steps of lower GPU utilisation",
            "accumulate",
            "Accumulate",
            arg="micro-batches per step",
            arg_type=int,
            splits_batch=True,
            micro_batches_from_arg=True,
        ),
        _info(
            "bf16_params",
            "parameters, gradients and optimizer state stored in bf16 (no fp32 master copy): halves "
            "model-state memory; may cost accuracy",
            "bf16_params",
            "Bf16Params",
            bad_dtypes=("fp16",),
            conflicts=("quantize_int8",),
            state_bytes_factor=0.5,
        ),
        _info(
            "sgd",
            "optimizer SGD without momentum: no optimizer state (0 B/param)",
            "optimizers",
            "Sgd",
            group="optimizer",
            **OPTIMIZER_LR,
        ),
        _info(
            "sgd_momentum",
            "optimizer SGD with momentum 0.9: one buffer (4 B/param in fp32)",
            "optimizers",
            "SgdMomentum",
            group="optimizer",
            **OPTIMIZER_LR,
        ),
        _info(
            "adamw",
            "optimizer AdamW: two moments (8 B/param in fp32), decoupled weight decay",
            "optimizers",
            "AdamW",
            group="optimizer",
            **OPTIMIZER_LR,
        ),
        _info(
            "adafactor",
            "optimizer Adafactor (torch.optim): factored second moment, row + column vectors per matrix "
            "instead of a full copy: optimizer state far below Adam's",
            "optimizers",
            "Adafactor",
            group="optimizer",
            **OPTIMIZER_LR,
        ),
        _info(
            "adam8bit",
            "AdamW with 8-bit blockwise-quantized moments (torchao AdamW8bit): ~2 B/param of "
            "optimizer state instead of 8 (2.3 B/param on a small mlp whose small tensors stay "
            "fp32); its step is compiled, so the first step takes seconds",
            "optimizers",
            "Adam8bit",
            group="optimizer",
            **OPTIMIZER_LR,
            unpredictable="its step is compiled code, which cannot run on fake tensors",
        ),
        _info(
            "prune",
            "global magnitude pruning (torch.nn.utils.prune) of AMOUNT of all weights at initialisation, "
            "masks kept through training; reports `sparsity`. Dense storage does NOT shrink: the masks "
            "and original weights make it larger",
            "pruning",
            "MagnitudePrune",
            arg="fraction pruned",
            arg_type=float,
            arg_max=1.0,
        ),
        _info(
            "prune_structured",
            "structured pruning: removes AMOUNT of the hidden neurons (mlp), conv channels (cnn) or "
            "transformer MLP units (gpt) with the lowest L2 norm before training, so parameters, "
            "gradients, optimizer state and activations really shrink (mlp at 0.5: -69% parameter "
            "bytes)",
            "pruning",
            "StructuredPrune",
            arg="fraction removed",
            arg_type=float,
            arg_max=1.0,
            families=("mlp", "cnn", "gpt"),
        ),
        _info(
            "quantize_int8",
            "post-training dynamic int8 quantization of Linear layers (CPU inference); records the "
            "int8 model's weight bytes, peak inference memory and accuracy beside the float model's",
            "quantize",
            "QuantizeInt8",
            conflicts=("fsdp",),
        ),
        _info(
            "offload_activations",
            "saved activations go to pinned CPU memory in forward and come back in backward "
            "(torch.autograd.graph.save_on_cpu); less GPU memory, PCIe traffic. CUDA only",
            "memory_management",
            "OffloadActivations",
            devices=("cuda",),
        ),
        _info(
            "expandable_segments",
            "CUDA caching allocator with expandable segments (PYTORCH_CUDA_ALLOC_CONF): less "
            "fragmentation, visible in peak_reserved_bytes. CUDA only",
            "memory_management",
            "ExpandableSegments",
            devices=("cuda",),
        ),
        _info(
            "keep_grads",
            "zero gradients in place (zero_grad(set_to_none=False)) instead of freeing them: the "
            "gradients stay allocated through the next forward, so a peak early in backward rises "
            "by up to the gradient bytes (4 B/param)",
            "memory_management",
            "KeepGrads",
        ),
        _info(
            "channels_last",
            "NHWC memory format for conv models and their inputs: same bytes, often faster convs "
            "on GPUs (tensor cores); little or no effect on CPU",
            "memory_management",
            "ChannelsLast",
            families=("cnn", "resnet", "timm"),
        ),
        _info(
            "float8",
            "torchao's float8 training: every Linear layer's matmuls in fp8 (aten _scaled_mm) "
            "with dynamic scales, `tensorwise` (default; under fsdp the weights are all-gathered "
            "in fp8) or `rowwise`; weights, gradients and optimizer state keep their precision. "
            "Faster matmuls (fp8 peak: 2x bf16) for about the same memory. CUDA cards of "
            "compute capability 8.9+ only (Ada, Hopper, Blackwell); predicted from a CPU",
            "float8",
            "Float8",
            arg="recipe",
            arg_type=str,
            arg_optional=True,
            words=("tensorwise", "rowwise"),
            devices=("cuda",),
            min_capability=(8, 9),
            capability_why="fp8 tensor cores: Ada, Hopper, Blackwell",
            conflicts=("lora", "qlora", "quantize_int8", "prune", "prune_structured", "tp"),
        ),
        _info(
            "compile",
            "torch.compile (inductor, in place): fused kernels, fewer intermediates; the first "
            "step's time is recorded apart as compile_time_s. Tensor accounting switches compiled "
            "code off, so the memory window reports the eager model's memory (throughput is the "
            "compiled model's)",
            "compile",
            "Compile",
            conflicts=("ddp", "fsdp"),
            eager_only=True,
        ),
        _info(
            "ddp",
            "DistributedDataParallel over N processes (torchrun; gloo on CPU, nccl on GPU): each rank "
            "keeps a full replica and 1/N of each batch; peak = max over ranks, throughput = sum",
            "parallel",
            "Ddp",
            arg="ranks",
            arg_type=int,
            group="parallel",
            splits_batch=True,
            mesh_dim="dp",
        ),
        _info(
            "fsdp",
            "FSDP2 fully_shard over N processes (torchrun): parameters, gradients and optimizer state "
            "sharded ~1/N per rank; peak = max over ranks, throughput = sum",
            "parallel",
            "Fsdp",
            arg="ranks",
            arg_type=int,
            group="parallel",
            splits_batch=True,
            search_cost=1.5,
            shards_state=True,
            mesh_dim="dp",
        ),
        _info(
            "tp",
            "tensor parallelism (parallelize_module) over N ranks: each block's attention and "
            "MLP projections split column-wise then row-wise (Megatron's layout), so the "
            "blocks' weights, gradients, optimizer state and most of their activations are "
            "~1/N per rank; two all-reduces per block in forward and two in backward. "
            "Embeddings, norms and the output head stay whole on every rank. `tp:N:sp` adds "
            "sequence parallelism: norms and residuals hold 1/N of the sequence. Families gpt "
            "and hf (Llama, Qwen2, Mistral)",
            "tensor_parallel",
            "TensorParallel",
            arg="ranks",
            arg_type=int,
            options=("", "sp"),
            families=("gpt", "hf"),
            conflicts=PARAMETER_REWRITERS,
            mesh_dim="tp",
            search_cost=1.5,
        ),
        _info(
            "pp",
            "pipeline parallelism (torch.distributed.pipelining) over N stages: the blocks "
            "split into N stages of about equal parameters (embeddings on the first, norm and "
            "head on the last), each batch into micro-batches (accumulate:K's K, else 2N) "
            "under a schedule: gpipe (all forwards, then all backwards), 1f1b (default: at "
            "most N micro-batches' activations on the first stage) or interleaved (two "
            "virtual stages per rank, a smaller bubble). Stages hold different memory: every "
            "stage is measured and predicted. Families gpt and hf (Llama, Qwen2, Mistral)",
            "pipeline_parallel",
            "PipelineParallel",
            arg="stages",
            arg_type=int,
            options=("1f1b", "gpipe", "interleaved"),
            families=("gpt", "hf"),
            bad_dtypes=("fp16",),
            conflicts=(*PARAMETER_REWRITERS, "chunked_ce", "fused_ce", "keep_grads"),
            mesh_dim="pp",
            search_cost=2.0,
        ),
        _info(
            "cp",
            "context parallelism (PyTorch's context_parallel: ring attention) over N ranks: "
            "each rank holds 1/N of every sequence, so every activation is ~1/N; keys and "
            "values rotate round the ranks inside attention; positions and shifted labels "
            "split with the tokens; gradients averaged over the cp ranks (with fsdp/ddp: over "
            "both). CUDA only (flash and memory-efficient attention); predicted anywhere. "
            "Families gpt and hf (causal LMs)",
            "context_parallel",
            "ContextParallel",
            arg="ranks",
            arg_type=int,
            devices=("cuda",),
            families=("gpt", "hf"),
            conflicts=PARAMETER_REWRITERS,
            mesh_dim="cp",
        ),
        _info(
            "fsdp_mixed",
            "with fsdp:N, FSDP2's MixedPrecisionPolicy: parameters all-gathered and computed in "
            "bf16 (half the gathered bytes and traffic), gradients reduced in fp32",
            "parallel",
            "FsdpMixed",
            requires="fsdp",
        ),
        _info(
            "fsdp_offload",
            "with fsdp:N, FSDP2's CPUOffloadPolicy: sharded parameters, gradients and optimizer "
            "state in pinned host memory, optimizer step on the CPU; the device holds only the "
            "parameters gathered in flight. CUDA only",
            "parallel",
            "FsdpOffload",
            requires="fsdp",
            devices=("cuda",),
        ),
    ]
}

# What each strategy lowers at a step's peak, by breakdown category (harness.metrics): how a
# table says which strategies can move a peak (harness.analyse.peak_phase). A peak in the
# optimizer step is parameters, gradients, optimizer state and the step's temporaries ("other"):
# nothing that lowers activations alone can move it. Strategies left out lower none of the five
# (they change speed, accuracy, reserved memory or inference only).
LOWERS: dict[str, tuple[str, ...]] = {
    "checkpoint": ("activation",),
    "sac": ("activation",),
    "accumulate": ("activation",),
    "chunked_ce": ("activation",),
    "fused_ce": ("activation",),
    "offload_activations": ("activation",),
    "cp": ("activation",),
    "adam8bit": ("optim", "other"),
    "adafactor": ("optim", "other"),
    "sgd_momentum": ("optim", "other"),
    "sgd": ("optim", "other"),
    "bf16_params": ("param", "grad", "optim", "other"),
    "fsdp": ("param", "grad", "optim", "other"),
    "lora": ("grad", "optim", "other"),
    "qlora": ("param", "grad", "optim", "other"),
    "fsdp_offload": ("param", "grad", "optim", "other"),
    "tp": ("param", "grad", "optim", "activation", "other"),
    "pp": ("param", "grad", "optim", "activation", "other"),
    "prune_structured": ("param", "grad", "optim", "activation", "other"),
}

# Names people reach for that the spec says another way.
ALIASES = {
    "amp_bf16": "mixed precision is the dtype axis: use grid.dtype: [bf16]",
    "amp_fp16": "mixed precision is the dtype axis: use grid.dtype: [fp16] (autocast + GradScaler)",
    "amp": "mixed precision is the dtype axis: use grid.dtype: [bf16] or [fp16]",
}
