"""The GPU check: one script that exercises the trial layer on a CUDA machine and says in a table
what it measured. ``scripts/gpu_check.sh OUT_DIR`` runs it; ``make gpu-check`` into
``results/gpu-check/``.

It needs PyTorch and nothing else (transformers and peft are optional: their trials are skipped
with a note). This process never imports torch: every trial runs in a process of its own, as a
sweep launches it (``harness.sweep.launch``: forked from the warm zygote, which imported torch
once, or torchrun for ``ddp:1``/``fsdp:1``), and one further process runs an out-of-memory
trial and a clean trial one after the other (``--pair``) to show the worker recovers.

Modes (``--mode auto`` picks one from ``torch.cuda.is_available()`` in a probe process):

- ``gpu``: gpt over {fp32, bf16, fp16} x {none, checkpoint, offload_activations,
  expandable_segments, lora:8}, a tiny Hugging Face Llama over every strategy in bf16 and
  none/checkpoint/lora:8 in fp16, none/lora:8 in fp32; a real CUDA OOM on an emulated 24 GiB card
  (then a clean trial in the same process); the seed article's CNN on CIFAR-shaped synthetic
  data, fp32 and fp16; ``ddp:1`` and ``fsdp:1`` on nccl; a fragmenting gpt under three allocator
  settings (defaults, expandable segments, ``max_split_size_mb:128``). Sized for < 8 min on one H200, with a
  deadline that skips (with a note) what would not start in time. Then every trial that ran is
  predicted again as a machine without a GPU predicts it for this card (CUDA hidden: CUDA's
  rules on CPU kernels), and two Llama trials' allocator snapshots are replayed through the
  allocator model: the table shows predicted / measured allocated, reserved and device bytes
  for both predictions, the notes the snapshot replays.
- ``cpu-reduced``: a handful of tiny trials (what CI runs): gpt none/checkpoint in fp32/bf16,
  the CNN, a budget OOM and a clean trial in one process, lora and the Llama where installed.

Writes ``OUT_DIR/trials/<label>/{config,result}.json`` (and the trial's log) per trial and
``OUT_DIR/summary.json``; prints one fixed-width table last. Exit 0 when every trial ended as
expected, 1 (with an ``UNEXPECTED`` line per trial) otherwise.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import platform
import re
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

# Standard library only (the registries are plain data): no torch in this process.
from harness.sweep.launch import launch_trial, warm_start_enabled  # noqa: E402
from harness.trial.config import TrialConfig  # noqa: E402
from harness.trial.hardware import cpu_name  # noqa: E402
from harness.units import format_bytes  # noqa: E402

GIB = 2**30
MIB = 2**20
CARD_24GIB = 24 * GIB
# After the OOM trial the worker must have handed its memory back: what may stay allocated.
HANDED_BACK_BYTES = 256 * MIB
DTYPES = ("fp32", "bf16", "fp16")
STRATEGIES = ("none", "checkpoint", "offload_activations", "expandable_segments", "lora:8")
ADAM = {"name": "adam", "lr": 1e-3, "weight_decay": 0.0, "momentum": 0.0, "foreach": False}
LORA = {"alpha": None, "dropout": 0.0, "targets": None, "base_dtype": "auto"}
CIFAR = {"shape": [3, 32, 32], "num_classes": 10, "num_samples": 2048}
CPU_TEXT = {"test_fraction": 0.05}

# Sizes. GPU: big enough that the step is not all launch overhead, small enough for seconds.
GPT_GPU = {"n_layer": 4, "d_model": 512, "n_head": 8, "seq_len": 512}
GPT_OOM = {"n_layer": 12, "d_model": 768, "n_head": 12, "seq_len": 1024}  # batch 64: ~40 GiB
GPT_CPU = {"preset": "tiny"}  # 2 layers, d_model 64, seq_len 64
# The allocator's settings on a workload whose blocks span many sizes (12 layers' activations
# and attention buffers, MLP intermediates, fp32 Adam state): how far reserved runs above
# allocated under each.
GPT_FRAGMENTING = GPT_OOM  # at batch 16: ~10 GiB allocated
ALLOCATOR_SETTINGS = {
    "default": None,
    "expandable": "expandable_segments:True",
    "max-split-128MiB": "max_split_size_mb:128",
}
LLAMA_GPU = {
    "preset": "llama-3.2-1b",
    "num_hidden_layers": 4,
    "hidden_size": 512,
    "intermediate_size": 1408,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "vocab_size": 512,
    "seq_len": 256,
}
LLAMA_CPU = {
    **LLAMA_GPU,
    "num_hidden_layers": 2,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "head_dim": 16,
    "seq_len": 32,
}

# Real-size trials (GPU check v2), first in the plan: what users ask about and no card has run
# yet. Random weights from the public configs (memory and speed do not depend on their values);
# built on the host, then moved to the card: the 8B's build takes most of its trial's time.
LLAMA_8B = {"preset": "llama-3.1-8b", "seq_len": 2048}
LLAMA_3B = {"preset": "llama-3.2-3b", "seq_len": 4096}
TOKENS_128K = {"vocab_size": 128256, "num_samples": 64, "test_fraction": 0.125}
VIT = {"name": "vit_base_patch16_224"}
IMAGENET = {"shape": [3, 224, 224], "num_classes": 1000, "num_samples": 512}
REAL_SIZE_TIMEOUT_S = 360.0
# Optional packages: a trial that needs one it lacks is skipped with a note.
OPTIONAL = {
    "transformers": "transformers",
    "peft": "peft (lora needs it)",
    "bitsandbytes": "bitsandbytes (adam8bit and qlora need it)",
    "liger_kernel": "liger-kernel (fused_ce needs it)",
    "timm": "timm",
}

PROBE = """
import json, torch
info = {"torch_version": torch.__version__, "cuda": torch.cuda.is_available()}
if info["cuda"]:
    props = torch.cuda.get_device_properties(0)
    info.update(
        device_name=props.name,
        device_total_bytes=props.total_memory,
        device_count=torch.cuda.device_count(),
        capability=f"{props.major}.{props.minor}",
        cuda_version=torch.version.cuda,
        nccl=torch.distributed.is_available() and torch.distributed.is_nccl_available(),
    )
print("PROBE " + json.dumps(info))
"""


@dataclass
class Check:
    """One planned trial: its config, how it is launched and how it should end."""

    label: str
    config: TrialConfig | None
    expect: str = "ok"
    launch: str = "worker"  # worker | torchrun | pair (a pair runs with the next check)
    skip: str = ""  # why it is not run (a missing package, the deadline)
    timeout_s: float | None = None  # None: the check's --trial-timeout-s
    # Filled in when it has run.
    status: str = "skipped"
    reason: str = ""
    metrics: dict[str, float] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)
    wall_s: float | None = None
    notes: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    @property
    def folder_name(self) -> str:
        return re.sub(r"[^A-Za-z0-9._-]+", "-", self.label).strip("-")


def trial(
    family: str,
    size: str,
    knobs: dict[str, Any],
    dataset: str,
    dtype: str,
    strategy: str,
    batch_size: int,
    *,
    steps: int,
    timed_steps: int,
    data_options: dict[str, Any] | None = None,
    **extra: Any,
) -> TrialConfig:
    """A TrialConfig as ``harness.spec.grid`` builds one (fields this TrialConfig lacks are
    dropped, so the check keeps working while the config grows)."""
    terms = strategy.split("+")
    values: dict[str, Any] = {
        "experiment": "gpu-check",
        "model_family": family,
        "model_size": size,
        "model_knobs": dict(knobs),
        "dataset": dataset,
        "data_options": dict(data_options or {}),
        "batch_size": batch_size,
        "dtype": dtype,
        "strategy": terms,
        "optimizer": dict(ADAM),
        "budget": {"steps": steps},
        "seed": 0,
        "warmup_steps": 2,
        "memory_steps": 1,
        "timed_steps": timed_steps,
        "device": "auto",
        "lora": dict(LORA) if any(t.split(":")[0] in ("lora", "qlora") for t in terms) else None,
        "python_path": [str(REPO)],
        "timeline": False,
        **extra,
    }
    known = {f.name for f in dataclasses.fields(TrialConfig)}
    return TrialConfig.from_dict({k: v for k, v in values.items() if k in known})


def real_size(needs: Any) -> list[Check]:
    """GPU check v2's first trials, in order of what they tell: a real-size Llama-3.1-8B LoRA
    fine-tune (the question users bring), Llama-3.2-3B full bf16 fine-tuning at 2 x 4096 with
    checkpointing (torchtune's published single-device row), then the strategies no card has
    run: ddp:1 after its fix, compile, adam8bit, qlora, fused_ce, a timm ViT."""
    steps, timed = 8, 4
    rows: list[tuple[str, str, str, dict[str, Any], str, str, int, dict[str, Any]]] = [
        ("llama-8b/bf16/lora:16+checkpoint", "hf", "llama-3.1-8b", LLAMA_8B, "tokens",
         "lora:16+checkpoint", 1, TOKENS_128K),
        ("llama-3b/bf16/checkpoint/b2x4096", "hf", "llama-3.2-3b", LLAMA_3B, "tokens",
         "checkpoint", 2, TOKENS_128K),
        ("gpt/bf16/compile", "gpt", "small", GPT_GPU, "text", "compile", 8, {}),
        ("gpt/bf16/adam8bit", "gpt", "small", GPT_GPU, "text", "adam8bit", 8, {}),
        ("llama/bf16/qlora:8", "hf", "tiny-llama", LLAMA_GPU, "text", "qlora:8", 8, {}),
        ("llama/bf16/fused_ce", "hf", "tiny-llama", LLAMA_GPU, "text", "fused_ce", 8, {}),
        ("vit-base/bf16/none", "timm", "vit-base", VIT, "synthetic", "none", 64, IMAGENET),
    ]  # fmt: skip
    checks = []
    for label, family, size, knobs, dataset, strategy, batch, data in rows:
        config = trial(family, size, knobs, dataset, "bf16", strategy, batch, steps=steps,
                       timed_steps=timed, data_options=data)  # fmt: skip
        big = size.startswith("llama-3")
        checks.append(
            Check(label, config, skip=needs(family, strategy),
                  timeout_s=REAL_SIZE_TIMEOUT_S if big else None)
        )  # fmt: skip
        if label.startswith("llama-3b"):  # one-rank DDP after its fix, early: it crashed before
            ddp = trial("gpt", "small", GPT_GPU, "text", "bf16", "ddp:1", 8, steps=14,
                        timed_steps=10)  # fmt: skip
            checks.append(Check("gpt/bf16/ddp:1", ddp, launch="torchrun"))
    return checks


def plan(mode: str, have: dict[str, bool]) -> list[Check]:
    """The trials of a mode, in the order they run (the most telling first)."""
    checks: list[Check] = []
    gpu = mode == "gpu"
    steps, timed = (14, 10) if gpu else (6, 3)

    def needs(family: str, strategy: str) -> str:
        """Why a trial cannot run here ("" when it can): the packages it needs and lacks."""
        wanted = {"hf": ["transformers"], "timm": ["timm"]}.get(family, [])
        terms = {term.split(":")[0] for term in strategy.split("+")}
        if terms & {"lora", "qlora"}:
            wanted.append("peft")
        if terms & {"qlora", "adam8bit"}:
            wanted.append("bitsandbytes")
        if "fused_ce" in terms:
            wanted.append("liger_kernel")
        lacking = [OPTIONAL[name] for name in wanted if not have.get(name, False)]
        return f"not installed: {', '.join(lacking)}" if lacking else ""

    # 0. Real-size trials, the most valuable first (GPU only).
    if gpu:
        checks.extend(real_size(needs))

    # 1. Out of memory, then a clean trial in the same worker process.
    if gpu:
        oom = trial("gpt", "oom", GPT_OOM, "text", "fp32", "none", 64, steps=4, timed_steps=2,
                    device_memory_bytes=CARD_24GIB, run_infeasible=True)  # fmt: skip
        clean = trial("gpt", "small", GPT_GPU, "text", "bf16", "none", 8, steps=steps,
                      timed_steps=timed, device_memory_bytes=CARD_24GIB)  # fmt: skip
        checks.append(Check("oom-24GiB/gpt-12x768/b64", oom, "oom", "pair"))
        checks.append(Check("after-oom/gpt/bf16/none", clean, "ok", "pair"))
    else:
        oom = trial("gpt", "tiny", GPT_CPU, "text", "fp32", "none", 8, steps=steps,
                    timed_steps=timed, device_memory_bytes=1 * MIB, run_infeasible=True)  # fmt: skip
        clean = trial("gpt", "tiny", GPT_CPU, "text", "fp32", "none", 8, steps=steps,
                      timed_steps=timed)  # fmt: skip
        checks.append(Check("oom-1MiB/gpt-tiny", oom, "oom", "pair"))
        checks.append(Check("after-oom/gpt/fp32/none", clean, "ok", "pair"))

    # 2. gpt over dtypes x strategies.
    if gpu:
        grid = [(d, s) for d in DTYPES for s in STRATEGIES]
    else:
        grid = [(d, s) for d in ("fp32", "bf16") for s in ("none", "checkpoint")]
        grid.append(("fp32", "lora:8"))
    gpt_knobs, gpt_size, gpt_batch = (GPT_GPU, "small", 8) if gpu else (GPT_CPU, "tiny", 8)
    for dtype, strategy in grid:
        config = trial("gpt", gpt_size, gpt_knobs, "text", dtype, strategy, gpt_batch,
                       steps=steps, timed_steps=timed)  # fmt: skip
        checks.append(Check(f"gpt/{dtype}/{strategy}", config, skip=needs("gpt", strategy)))

    # 3. The seed article's CIFAR-10 CNN on CIFAR-shaped synthetic data, fp32 (and fp16 AMP).
    for dtype in ("fp32", "fp16") if gpu else ("fp32",):
        config = trial("cnn", "seed", {"width": 16}, "synthetic", dtype, "none", 64,
                       steps=steps, timed_steps=timed, data_options=CIFAR)  # fmt: skip
        checks.append(Check(f"cnn-cifar/{dtype}/none", config))

    # 4. One-rank DDP and FSDP2 under torchrun (nccl).
    if gpu:
        for strategy in ("fsdp:1",):  # ddp:1 runs among the real-size trials
            config = trial("gpt", gpt_size, gpt_knobs, "text", "bf16", strategy, gpt_batch,
                           steps=steps, timed_steps=timed)  # fmt: skip
            checks.append(Check(f"gpt/bf16/{strategy}", config, launch="torchrun"))

    # 5. The caching allocator's settings on one fragmenting workload (CUDA only).
    if gpu:
        for name, allocator in ALLOCATOR_SETTINGS.items():
            config = trial("gpt", "fragmenting", GPT_FRAGMENTING, "text", "fp32", "none", 16,
                           steps=8, timed_steps=4, allocator=allocator)  # fmt: skip
            checks.append(Check(f"allocator/{name}/gpt-12x768/b16", config))

    # 6. A tiny Hugging Face Llama: every strategy in bf16 (what fine-tuning uses), the
    # precision-sensitive ones in fp16 and fp32 (the allocator and offload ones do not
    # depend on the dtype, and a trial that imports transformers costs seconds).
    llama = LLAMA_GPU if gpu else LLAMA_CPU
    hf_grid = [("bf16", "none")]
    if gpu:
        hf_grid = [("bf16", s) for s in STRATEGIES]
        hf_grid += [("fp16", s) for s in ("none", "checkpoint", "lora:8")]
        hf_grid += [("fp32", s) for s in ("none", "lora:8")]
    for dtype, strategy in hf_grid:
        # A memory snapshot of the window, replayed through the allocator model afterwards.
        snapshot = gpu and dtype == "bf16" and strategy in ("none", "expandable_segments")
        config = trial("hf", "tiny-llama", llama, "text", dtype, strategy, 8,
                       steps=steps, timed_steps=timed, allocator_snapshot=snapshot)  # fmt: skip
        checks.append(Check(f"llama/{dtype}/{strategy}", config, skip=needs("hf", strategy)))
    if not gpu:  # a CPU evaluates the held-out text slowly: 5 % of it, not 20 %
        for check in checks:
            if check.config is not None and check.config.dataset == "text":
                check.config = dataclasses.replace(check.config, data_options=CPU_TEXT)
    return checks


def gpu_plan_text(have: dict[str, bool]) -> str:
    """What ``--mode gpu`` runs, in order, for a CPU run to show (the real-size trials by name,
    with what would skip them on a card with this machine's packages)."""
    checks = plan("gpu", have)
    first = real_size(lambda family, strategy: "")
    names = {c.label for c in first}
    lines = [f"on a GPU this check runs {count_trials(len(checks))} in this order (the first "
             f"{len(first)} real-size or new, then the small ones):"]  # fmt: skip
    for check in checks:
        if check.label in names:
            skip = next(c.skip for c in checks if c.label == check.label)
            lines.append(
                f"  {check.label}" + (f"  (would be skipped here: {skip})" if skip else "")
            )
    small = [c.label for c in checks if c.label not in names]
    lines.append(f"  then {len(small)}: {', '.join(small[:4])}, ... {small[-1]}")
    return "\n".join(lines)


# --- running -------------------------------------------------------------------------------


# Environment the trial processes get on top of this one's (set by ``main`` for the mode).
CHILD_ENV: dict[str, str] = {}


def child_env() -> dict[str, str]:
    """This process's environment with the repository first on PYTHONPATH (once: ``main``
    copies the result into ``os.environ``, and later calls build on it)."""
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), *(p for p in paths if p != str(REPO))]),
        "PYTHONUNBUFFERED": "1",
        **CHILD_ENV,
    }


def probe() -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300, env=child_env()
    )
    for line in done.stdout.splitlines():
        if line.startswith("PROBE "):
            return json.loads(line[len("PROBE ") :])
    tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
    raise SystemExit(f"gpu-check: cannot import torch with {sys.executable}: {tail[0]}")


def run_process(command: list[str], log: Path, timeout_s: float) -> tuple[int | None, float]:
    """Run a trial process (its own session, so a timeout kills its whole tree)."""
    start = time.perf_counter()
    with log.open("w") as handle:
        process = subprocess.Popen(
            command, cwd=REPO, env=child_env(), stdout=handle, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
        try:
            code: int | None = process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, 9)
            process.wait()
            code = None
    return code, time.perf_counter() - start


def last_error(log: Path) -> str:
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    for line in reversed(lines):
        if re.match(r"^[A-Za-z_.]*(Error|Exception)\b", line):
            return line[:200]
    return lines[-1][:200] if lines else "no output"


def read_result(check: Check, folder: Path, code: int | None, log: Path) -> None:
    result_path = folder / "result.json"
    if result_path.exists():
        data = json.loads(result_path.read_text())
        check.status, check.reason = data["status"], data.get("failure_reason", "")
        check.metrics, check.info = data.get("metrics", {}), data.get("info", {})
    elif code is None:
        check.status, check.reason = "timeout", "killed at the check's time limit"
    else:
        check.status, check.reason = "crash", f"exit {code}, no result: {last_error(log)}"


def run_single(check: Check, folder: Path, timeout_s: float) -> None:
    """Launched as a sweep launches it (``harness.sweep.launch``): forked from the warm zygote
    that has imported torch, or by torchrun for a process-group strategy."""
    assert check.config is not None
    start = time.perf_counter()
    result = launch_trial(check.config, folder, timeout_s)
    check.wall_s = time.perf_counter() - start
    check.status, check.reason = result.status.value, result.failure_reason
    check.metrics, check.info = dict(result.metrics), dict(result.info)
    if not warm_start_enabled() and check.launch == "worker":
        check.notes.append("the warm start failed: this trial ran in a fresh process")


def run_pair(first: Check, second: Check, folders: list[Path], timeout_s: float) -> None:
    """Both trials in one process (``--pair``), as a warm worker would run them."""
    args = []
    for check, folder in zip((first, second), folders, strict=True):
        assert check.config is not None
        (folder / "config.json").write_text(check.config.to_json())
        args += [str(folder / "config.json"), str(folder / "result.json")]
    log = folders[0] / "trial.log"
    code, wall = run_process(
        [sys.executable, str(Path(__file__).resolve()), "--pair", *args], log, timeout_s
    )
    for check, folder in zip((first, second), folders, strict=True):
        read_result(check, folder, code, log)
        check.wall_s = wall  # one process for both
        check.notes.append("both pair trials ran in one process (the wall time is the pair's)")
    memory = folders[0] / "memory_after.json"
    after = json.loads(memory.read_text()) if memory.exists() else None
    if first.status != "oom" or after is None or not after["cuda"]:
        return  # on a CPU the OOM is the budget's verdict: nothing was held back to check
    allocated, reserved = after["allocated_bytes"], after["reserved_bytes"]
    first.metrics["allocated_after_bytes"] = allocated
    first.notes.append(
        f"after the OOM: {format_bytes(allocated)} allocated, {format_bytes(reserved)} reserved"
    )
    if allocated > HANDED_BACK_BYTES:
        first.problems.append(
            f"{format_bytes(allocated)} still allocated after the OOM (more than "
            f"{format_bytes(HANDED_BACK_BYTES)}): memory not handed back"
        )


def pair_main(args: list[str]) -> int:
    """``--pair CONFIG1 RESULT1 CONFIG2 RESULT2``: two trials in this one process."""
    import torch

    from harness.trial.__main__ import write_result
    from harness.trial.result import Status, TrialResult
    from harness.trial.run import run_trial

    code = 0
    for index in range(2):
        config_path, result_path = Path(args[2 * index]), Path(args[2 * index + 1])
        config = TrialConfig.from_json(config_path.read_text())
        try:
            result = run_trial(config, result_path.parent)
        except Exception as error:  # recorded as the worker records it
            import traceback

            traceback.print_exc()
            reason = f"{type(error).__name__}: {error}".strip().splitlines()[0]
            result = TrialResult.failure(config.trial_key, Status.CRASH, reason)
            code = 1
        write_result(result_path, result)
        print(f"pair trial {index + 1}: {result.status} {result.failure_reason}".rstrip())
        if index == 0:
            cuda = torch.cuda.is_available()
            after = {
                "cuda": cuda,
                "allocated_bytes": torch.cuda.memory_allocated() if cuda else 0,
                "reserved_bytes": torch.cuda.memory_reserved() if cuda else 0,
            }
            (result_path.parent / "memory_after.json").write_text(json.dumps(after))
    return code


def judge(check: Check, mode: str) -> None:
    """Add to ``check.problems`` whatever says the trial did not end as it should."""
    if check.skip:
        return
    if check.status != check.expect:
        why = f" ({check.reason})" if check.reason else ""
        check.problems.append(f"expected {check.expect}, got {check.status}{why}")
        return
    metrics = check.metrics
    if check.expect == "oom":
        budget = check.config.device_memory_bytes if check.config else None
        predicted = metrics.get("predicted_peak_bytes")
        if budget is not None and predicted is not None and predicted <= budget:
            check.problems.append(
                f"predicted peak {format_bytes(predicted)} is not above the "
                f"{format_bytes(budget)} card: not the trial this check means"
            )
        if mode == "gpu" and "out of memory" not in check.reason.lower():
            check.problems.append(f"not a CUDA allocator OOM: {check.reason}")
        return
    for name in ("peak_allocated_bytes", "throughput"):
        if not metrics.get(name, 0) > 0:
            check.problems.append(f"ok but no {name}")
    if mode == "gpu" and not metrics.get("peak_reserved_bytes", 0) > 0:
        check.problems.append("ok on CUDA but no peak_reserved_bytes")


def compare_after_oom(checks: list[Check]) -> None:
    """The clean trial after the OOM must measure what the same trial measures in a fresh
    process: memory the OOM left behind would raise its peak."""
    after = next((c for c in checks if c.label.startswith("after-oom/")), None)
    if after is None or after.status != "ok" or after.config is None:
        return
    twin_label = after.label.removeprefix("after-oom/")
    twin = next((c for c in checks if c.label == twin_label and c.status == "ok"), None)
    if twin is None:
        return
    mine, fresh = (c.metrics.get("peak_allocated_bytes", 0) for c in (after, twin))
    after.notes.append(
        f"peak {format_bytes(mine)} after the OOM vs {format_bytes(fresh)} in a process of its own "
        f"({twin.label})"
    )
    if fresh and mine > 1.05 * fresh:
        after.problems.append(
            f"peak {format_bytes(mine)} after the OOM is above the other process's "
            f"{format_bytes(fresh)} ({twin.label}): the OOM left memory behind"
        )


class PredictionFailed(Exception):
    """The estimator process timed out or failed (the message says which, and where its log is)."""


def predict_without_cuda(
    configs: list[TrialConfig], folder: Path, name: str, timeout_s: float | None = None
) -> list[dict[str, Any]]:
    """``configs`` predicted as a machine without a GPU predicts them for their card (the trial
    layer's estimator, CUDA hidden), one row each: ``folder/NAME_in.json``, ``_out.json`` and
    ``.log`` are kept beside the run."""
    request, answer = folder / f"{name}_in.json", folder / f"{name}_out.json"
    request.write_text(json.dumps({"device": "cuda", "configs": [c.to_dict() for c in configs]}))
    log = folder / f"{name}.log"
    with log.open("w") as handle:
        try:
            done = subprocess.run(
                [sys.executable, "-m", "harness.trial.estimate", str(request), str(answer)],
                stdout=handle,
                stderr=subprocess.STDOUT,
                env={**child_env(), "CUDA_VISIBLE_DEVICES": ""},
                timeout=timeout_s,
                cwd=REPO,
            )
        except subprocess.TimeoutExpired:
            raise PredictionFailed(f"timed out (log: {log})") from None
    if done.returncode != 0 or not answer.exists():
        raise PredictionFailed(f"failed: {last_error(log)}")
    return json.loads(answer.read_text())


def cpu_hosted(checks: list[Check], host: dict[str, Any], out: Path, seconds: float) -> None:
    """Predict the trials that ran as a machine without a GPU predicts them for this card (the
    trial layer's estimator with CUDA hidden: CPU kernels under CUDA's autocast lists, SDPA and
    dropout kernels, the allocator replayed), into ``cpu_predicted_*``: what ``harness
    estimate --card`` on a laptop says, checked against what this card measured."""
    from harness.cuda.cards import card_for_device_name

    card = card_for_device_name(str(host.get("device_name")))
    ran = [c for c in checks if c.status == "ok" and c.config is not None and not c.skip]
    if card is None or not ran or seconds < 30:
        why = "not in the card catalogue" if card is None else "no time or no trial"
        print(f"note: cpu-hosted predictions skipped ({host.get('device_name')}: {why})")
        return
    configs = [dataclasses.replace(c.config, card=card.to_dict()) for c in ran]
    print(f"  cpu-hosted predictions of {len(ran)} trials for {card.name} ...", flush=True)
    try:
        rows = predict_without_cuda(configs, out, "cpu_hosted", max(30.0, seconds))
    except PredictionFailed as error:
        print(f"note: cpu-hosted predictions {error}")
        return
    for check, row in zip(ran, rows, strict=True):
        for _, _, name in FIGURES:
            if row and name in row:
                check.metrics["cpu_" + name] = row[name]


def replay_snapshots(checks: list[Check], out: Path) -> None:
    """Each trial's recorded allocator history (``measure.allocator_snapshot``) replayed through
    the allocator model (``harness replay``'s code, standard library only): the segment
    decisions it reproduced, the recorded and replayed peak reservation, and what
    ``expandable_segments:True`` would have reserved."""
    from harness.cuda.snapshot import SnapshotError, load_snapshot, parse_snapshot, replay_report

    for check in checks:
        path = out / "trials" / check.folder_name / "memory_snapshot.pickle"
        if check.skip or not path.exists():
            continue
        try:
            recording = parse_snapshot(load_snapshot(path), path.name)
            report = replay_report(recording, ["expandable_segments:True"])
        except (SnapshotError, ValueError) as error:
            check.notes.append(f"snapshot replay failed: {error}")
            continue
        check.info["snapshot_replay"] = {
            key: report.get(key)
            for key in (
                "recorded_peak_reserved_bytes",
                "predicted_peak_reserved_bytes",
                "segment_decisions_matched",
                "segment_decisions_total",
                "trace_entries",
            )
        }
        expandable = report["what_if"][-1]["peak_reserved_bytes"]
        check.info["snapshot_replay"]["expandable_peak_reserved_bytes"] = expandable
        check.notes.append(
            f"snapshot replay: {report['segment_decisions_matched']}/"
            f"{report['segment_decisions_total']} segment decisions, peak reserved recorded "
            f"{size_text(report['recorded_peak_reserved_bytes'])} vs replayed "
            f"{size_text(report['predicted_peak_reserved_bytes'])}; expandable_segments "
            f"{size_text(expandable)}"
        )


# --- reporting -----------------------------------------------------------------------------


def size_text(num: float | None) -> str:
    """Bytes in a binary unit, three significant digits at most: ``7.17 MiB``, ``1023 MiB``."""
    if num is None:
        return "-"
    value = float(num)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            break
        value /= 1024
    if unit == "B":
        return f"{value:.0f} B"
    decimals = 2 if abs(value) < 10 else 1 if abs(value) < 100 else 0
    return f"{value:.{decimals}f} {unit}"


def throughput_text(check: Check) -> str:
    value = check.metrics.get("throughput")
    if value is None:
        return "-"
    unit = check.info.get("throughput_unit", "samples/s")
    for suffix, size in (("M", 1e6), ("k", 1e3)):
        if value >= size:
            return f"{value / size:.3g}{suffix} {unit}"
    return f"{value:.3g} {unit}"


# Each measured figure beside its predictions: the trial's own (on this GPU) and the one a
# machine without a GPU makes for this card (``cpu_*``, CUDA's rules on CPU kernels).
FIGURES = (
    ("alloc", "peak_allocated_bytes", "predicted_peak_bytes"),
    ("reserved", "peak_reserved_bytes", "predicted_reserved_bytes"),
    ("device", "peak_device_bytes", "predicted_device_bytes"),
)


def ratio(check: Check, measured: str, predicted: str) -> float | None:
    value, truth = check.metrics.get(predicted), check.metrics.get(measured)
    return value / truth if value and truth else None


def ratios_text(check: Check, prefix: str = "") -> str:
    """``1.000/1.012/0.998``: predicted / measured for allocated, reserved, device."""
    found = [ratio(check, m, prefix + p) for _, m, p in FIGURES]
    if not any(found):
        predicted = check.metrics.get(prefix + "predicted_peak_bytes")
        return f"pred {size_text(predicted)}" if predicted else "-"
    return "/".join("-" if r is None else f"{r:.3f}" for r in found)


def speed_text(check: Check) -> str:
    """``0.93/41%``: predicted / measured step time, and the measured MFU."""
    ratio, mfu = check.metrics.get("step_time_ratio"), check.metrics.get("mfu")
    if ratio is None:
        return "-"
    return f"{ratio:.2f}/{mfu:.0%}" if mfu is not None else f"{ratio:.2f}/-"


def energy_text(check: Check) -> str:
    """``41.2 J``: the GPU's energy over the timed window; ``-`` without a counter."""
    value = check.metrics.get("energy_j")
    if value is None:
        return "-"
    return f"{value:.3g} J" if value < 1000 else f"{value / 1000:.3g} kJ"


def wall_text(check: Check) -> str:
    return "-" if check.wall_s is None else f"{check.wall_s:.1f} s"


COLUMNS = (
    ("trial", 30, lambda c: c.label),
    ("status", 7, lambda c: c.status),
    ("peak alloc", 10, lambda c: size_text(c.metrics.get("peak_allocated_bytes"))),
    ("reserved", 9, lambda c: size_text(c.metrics.get("peak_reserved_bytes"))),
    ("device", 9, lambda c: size_text(c.metrics.get("peak_device_bytes"))),
    ("pred/meas a/r/d", 17, ratios_text),
    ("cpu-hosted a/r/d", 17, lambda c: ratios_text(c, "cpu_")),
    ("throughput", 16, throughput_text),
    ("step p/m, MFU", 13, speed_text),
    ("energy", 8, energy_text),
    ("wall", 7, wall_text),
)


def count_trials(count: int) -> str:
    return f"{count} trial" + ("" if count == 1 else "s")


def table(checks: list[Check], header: str, footer: str) -> str:
    def row(cells: list[str]) -> str:
        return "  ".join(
            cell.ljust(width) if i < 2 else cell.rjust(width)
            for i, (cell, (_, width, _)) in enumerate(zip(cells, COLUMNS, strict=True))
        ).rstrip()

    lines = [header, row([name for name, _, _ in COLUMNS])]
    lines.append(row(["-" * width for _, width, _ in COLUMNS]))
    for check in checks:
        status = check.status + ("!" if check.problems else "")
        cells = [fn(check) for _, _, fn in COLUMNS]
        cells[1] = status
        lines.append(row(cells))
    lines.append(footer)
    return "\n".join(lines)


def summary(
    checks: list[Check], host: dict[str, Any], elapsed: float, complete: bool = True
) -> dict[str, Any]:
    shown = (
        "peak_allocated_bytes", "peak_reserved_bytes", "peak_device_bytes", "throughput",
        "predicted_peak_bytes", "predicted_reserved_bytes", "predicted_device_bytes",
        "prediction_ratio", "reserved_prediction_ratio", "device_prediction_ratio",
        "cpu_predicted_peak_bytes", "cpu_predicted_reserved_bytes",
        "cpu_predicted_device_bytes", "allocated_after_bytes",
        "step_time_ms_p50", "predicted_step_time_ms", "step_time_ratio", "predicted_mfu", "mfu",
        "energy_j", "energy_per_sample_j",
    )  # fmt: skip
    return {
        **host,
        "complete": complete,
        "wall_s": round(elapsed, 2),
        "trials": [
            {
                "label": c.label,
                "trial_key": c.config.trial_key if c.config else None,
                "model": f"{c.config.model_family}/{c.config.model_size}" if c.config else None,
                "batch_size": c.config.batch_size if c.config else None,
                "strategy": c.config.strategy_text if c.config else None,
                "dtype": c.config.dtype if c.config else None,
                "device_memory_bytes": c.config.device_memory_bytes if c.config else None,
                "launch": c.launch,
                "expected": c.expect,
                "status": c.status,
                "reason": c.skip or c.reason,
                "as_expected": not c.problems,
                "problems": c.problems,
                "notes": c.notes,
                "throughput_unit": c.info.get("throughput_unit"),
                "snapshot_replay": c.info.get("snapshot_replay"),
                "energy_counter": c.info.get("energy_counter"),
                "allocator": c.config.allocator if c.config else None,
                "metrics": {k: c.metrics[k] for k in shown if k in c.metrics},
                "wall_s": None if c.wall_s is None else round(c.wall_s, 2),
                "folder": f"trials/{c.folder_name}" if not c.skip else None,
            }
            for c in checks
        ],
    }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path, help="where the JSON files go")
    parser.add_argument("--mode", choices=("auto", "gpu", "cpu-reduced"), default="auto")
    parser.add_argument(
        "--deadline-s", type=float, default=None,
        help="start no trial after this many seconds (gpu: 400, cpu-reduced: 600)",
    )  # fmt: skip
    parser.add_argument("--trial-timeout-s", type=float, default=150.0)
    parser.add_argument("--only", default="", help="run only trials whose label contains this")
    options = parser.parse_args(argv)
    start = time.perf_counter()

    found = probe()
    mode = options.mode
    if mode == "auto":
        mode = "gpu" if found["cuda"] else "cpu-reduced"
    if mode == "gpu" and not found["cuda"]:
        print("gpu-check: --mode gpu but torch.cuda.is_available() is false", file=sys.stderr)
        return 2
    deadline = options.deadline_s or (400.0 if mode == "gpu" else 600.0)
    if mode == "cpu-reduced" and "OMP_NUM_THREADS" not in os.environ:
        # One thread per trial: on a small shared CPU (CI) two threads' spin-waits make a
        # tiny model's steps up to 30x slower; this mode checks behaviour, not speed.
        CHILD_ENV["OMP_NUM_THREADS"] = "1"
    os.environ.update(child_env())  # what the sweep's launcher passes on to its trials
    have = {name: importlib.util.find_spec(name) is not None for name in OPTIONAL}
    host = {
        "mode": mode,
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch_version": found["torch_version"],
        "device": "cuda" if mode == "gpu" else "cpu",
        "device_name": found.get("device_name") if mode == "gpu" else cpu_name(),
        "cpu_count": os.cpu_count(),
        **{
            k: found[k]
            for k in ("device_total_bytes", "capability", "cuda_version", "nccl")
            if k in found
        },
        "packages": {name: have[name] for name in sorted(have)},
        "trial_env": dict(CHILD_ENV),
    }
    out = options.out_dir.resolve()
    (out / "trials").mkdir(parents=True, exist_ok=True)
    print(
        f"gpu-check: mode {mode} on {host['device_name']} (torch {host['torch_version']}); "
        f"JSON into {out}",
        flush=True,
    )

    if mode == "cpu-reduced":
        print(gpu_plan_text(have), flush=True)
    checks = [c for c in plan(mode, have) if options.only in c.label]
    index = 0
    while index < len(checks):
        check = checks[index]
        group = [check]
        if (
            check.launch == "pair"
            and index + 1 < len(checks)
            and checks[index + 1].launch == "pair"
        ):
            group.append(checks[index + 1])
        index += len(group)
        left = deadline - (time.perf_counter() - start)
        if not check.skip and left < 15:
            for member in group:
                member.skip = f"not started: the check's {deadline:.0f} s deadline had passed"
        if check.skip:
            for member in group:
                member.skip = member.skip or check.skip
                member.reason = member.skip
                print(f"  skip {member.label}: {member.skip}", flush=True)
            continue
        folders = []
        for member in group:
            folder = out / "trials" / member.folder_name
            folder.mkdir(parents=True, exist_ok=True)
            for stale in ("result.json", "memory_after.json"):  # an earlier run's, same OUT_DIR
                (folder / stale).unlink(missing_ok=True)
            folders.append(folder)
        timeout = max(30.0, min(check.timeout_s or options.trial_timeout_s, left + 60))
        if len(group) == 2:
            run_pair(group[0], group[1], folders, timeout)
        else:
            run_single(check, folders[0], timeout)
        for member, folder in zip(group, folders, strict=True):
            judge(member, mode)
            (folder / "check.json").write_text(
                json.dumps(summary([member], {}, 0)["trials"][0], indent=1)
            )
            mark = "ok " if not member.problems else "BAD"
            why = f" ({member.reason})" if member.reason else ""
            print(
                f"  {mark} {member.label}: {member.status}{why} [{wall_text(member)}]", flush=True
            )
        # What has run so far, should the check be stopped before its end (``complete``).
        partial = summary(checks, host, time.perf_counter() - start, complete=False)
        (out / "summary.json").write_text(json.dumps(partial, indent=1) + "\n")

    compare_after_oom(checks)
    if mode == "gpu":
        cpu_hosted(checks, host, out, deadline - (time.perf_counter() - start) + 120)
        replay_snapshots(checks, out)
    elapsed = time.perf_counter() - start
    (out / "summary.json").write_text(json.dumps(summary(checks, host, elapsed), indent=1) + "\n")
    ran = [c for c in checks if not c.skip]
    bad = [c for c in checks if c.problems]
    print()
    for check in checks:
        for note in check.notes:
            if "one process" not in note:
                print(f"note: {check.label}: {note}")
        if check.skip:
            print(f"note: {check.label}: skipped: {check.skip}")
    for check in bad:
        for problem in check.problems:
            print(f"UNEXPECTED: {check.label}: {problem}")
    if not ran:
        print("UNEXPECTED: no trial ran (see the skip notes above)")
    print(f"JSON: {out / 'summary.json'} (one folder per trial under {out / 'trials'})")
    print()
    header = (
        f"gpu-check  mode: {mode}  device: {host['device_name']}  torch {host['torch_version']}"
        f"  ({count_trials(len(ran))} run, {len(checks) - len(ran)} skipped, {elapsed:.0f} s)"
    )
    if bad:
        verdict = (
            f"mode: {mode}: {len(bad)} of {count_trials(len(ran))} UNEXPECTED (marked !, see above)"
        )
    elif not ran:
        verdict = f"mode: {mode}: UNEXPECTED: no trial ran"
    else:
        verdict = f"mode: {mode}: all {count_trials(len(ran))} ended as expected"
    print(table(checks, header, verdict), flush=True)
    return 1 if bad or not ran else 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--pair":
        if len(sys.argv) != 6:
            sys.exit("usage: gpu_check.py --pair CONFIG1 RESULT1 CONFIG2 RESULT2")
        sys.exit(pair_main(sys.argv[2:]))
    if len(sys.argv) > 1 and sys.argv[1] == "--repredict":
        import gpu_repredict  # this folder is first on sys.path when run as a script

        sys.exit(gpu_repredict.main(sys.argv[2:]))
    sys.exit(main(sys.argv[1:]))
