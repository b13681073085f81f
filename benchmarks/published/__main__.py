"""``python -m benchmarks.published [--jobs N] [--out FILE]``: harness's CUDA memory predictions
against published GPU measurements.

Every spec under ``specs/`` is estimated by ``harness estimate`` in its own child process (N at a
time), for the card the spec names, and each published run is held against the row of its spec
that is configured as the source ran it: the figure the source printed against the prediction
of the same quantity (``max_memory_allocated`` and the active peak: ``predicted_peak_bytes``;
``max_memory_reserved``: ``predicted_reserved_bytes``). Nothing is scaled or corrected: a ratio
is harness's own prediction over the source's own figure. Runs of an informational source are
printed in a table of their own and never counted toward the targets. Prints markdown tables and
writes ``FILE`` (default ``results/published.json``). Works offline: every model is built from its
config with random weights. What each run is, and what could not be matched, is in README.md.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent  # user code is imported as benchmarks.published.* from here
SPECS = HERE / "specs"
UNITS = {"GB": 1e9, "GiB": 2**30, "MiB": 2**20}
# Which prediction answers which published quantity, and the tolerance it is held to (None:
# reported, no target). Active memory is allocated memory plus blocks freed but waiting for
# another stream; a single-stream step has none, so it is compared with the allocated peak.
PREDICTION = {
    "allocated": "predicted_peak_bytes",
    "active": "predicted_peak_bytes",
    "reserved": "predicted_reserved_bytes",
    "device": "predicted_device_bytes",
}
TARGETS: dict[str, float | None] = {
    "allocated": 0.03,
    "active": 0.03,
    "device": 0.08,
    "reserved": None,
}

LITGPT = "A: litgpt resource tables (Lightning-AI/litgpt 0cc02afa; lit-gpt 8641822)"
RASBT = "B: rasbt/pytorch-memory-optim f6eddcd"
TORCHTUNE = "C: torchtune README 1814feb17"
TRANSFORMERS_DOCS = (
    "T: transformers docs, perf_train_gpu_one.mdx @ 0016acf7 (now model_memory_anatomy.md and "
    "perf_train_gpu_one.md)"
)
# Why source T's runs are printed but not counted.
T_INFORMATIONAL = "informational (the issue's example; PyTorch < 1.11, transformers ~4.15)"


@dataclass(frozen=True)
class Run:
    """One published measurement and the grid row of the spec that configures it."""

    id: str
    source: str
    config: str  # the configuration, in a few words
    spec: str  # file under specs/
    batch_size: int
    strategy: str  # harness's canonical strategy text of the row
    metric: str  # allocated | active | reserved | device
    figure: float
    unit: str  # GB (1e9) | GiB (2^30), as the source printed it
    # A second row of the same spec shown beside the first, and what it is.
    alternative: str | None = None
    alternative_label: str = ""
    # Not None: printed apart and never counted toward a target, for this reason.
    informational: str | None = None
    # The spec's size (model) the run is; None where the spec has one.
    size: str | None = None
    # The alternative row's size where it is another size of the spec (else the run's own), and
    # the few words that name the alternative in the table.
    alternative_size: str | None = None
    alternative_short: str = "own loop"


@dataclass(frozen=True)
class OomCheck:
    """A configuration the source reports out of memory on its card: harness should predict
    more than the card holds (its ``fits`` is judged on the device figure)."""

    id: str
    config: str
    spec: str
    batch_size: int
    strategy: str
    size: str | None = None


OWN_LOOP = "harness's own loop (zero_grad before the forward)"
# lit-gpt's resource tables name commit 8641822 but landed in 0cc02afa, whose RMSNorm upcasts to
# fp32 (lit-gpt #606); the Llama runs are compared with the tree they landed in (README.md says
# why) and the 8641822 code is shown beside.
AT_8641822 = "lit-gpt 8641822's model code (RMSNorm in bf16), the commit the tables name"

RUNS = [
    Run("A1", LITGPT, "phi-1.5 LoRA, bf16-true, mb 1 x 1044", "A-phi-1_5.yaml", 1, "none", "allocated", 4.82, "GB"),
    Run("A2", LITGPT, "phi-1.5 LoRA, bf16-true, mb 2 x 1044", "A-phi-1_5.yaml", 2, "none", "allocated", 6.76, "GB"),
    Run("A3", LITGPT, "phi-1.5 LoRA, bf16-true, mb 4 x 1044", "A-phi-1_5.yaml", 4, "none", "allocated", 10.68, "GB"),
    Run("A4", LITGPT, "StableLM-3B LoRA, bf16-true, mb 1 x 1034", "A-stablelm-3b.yaml", 1, "none", "allocated", 9.69, "GB"),
    Run("A5", LITGPT, "StableLM-3B LoRA, bf16-true, mb 2 x 1034", "A-stablelm-3b.yaml", 2, "none", "allocated", 12.10, "GB"),
    Run("A6", LITGPT, "StableLM-3B LoRA, bf16-true, mb 4 x 1034", "A-stablelm-3b.yaml", 4, "none", "allocated", 16.92, "GB"),
    Run("A7", LITGPT, "Llama-2-7B LoRA, bf16-true, mb 1 x 1304", "A-llama-2-7b.yaml", 1, "none", "allocated", 21.30, "GB", size="Llama-2-7b-hf", alternative="none", alternative_size="Llama-2-7b-hf-at-8641822", alternative_label=AT_8641822, alternative_short="at 8641822"),
    Run("A8", LITGPT, "Llama-2-7B LoRA, bf16-true, mb 2 x 1304", "A-llama-2-7b.yaml", 2, "none", "allocated", 29.07, "GB", size="Llama-2-7b-hf", alternative="none", alternative_size="Llama-2-7b-hf-at-8641822", alternative_label=AT_8641822, alternative_short="at 8641822"),
    Run("A9", LITGPT, "Llama-2-13B LoRA, bf16-true, mb 1 x 1304", "A-llama-2-13b.yaml", 1, "none", "allocated", 38.12, "GB", size="Llama-2-13b-hf", alternative="none", alternative_size="Llama-2-13b-hf-at-8641822", alternative_label=AT_8641822, alternative_short="at 8641822"),
    Run("A10", LITGPT, "StableLM-3B LoRA, bf16-mixed, mb 1 x 1034", "A10-stablelm-3b-mixed.yaml", 1, "none", "allocated", 26.92, "GB"),
    Run("B1", RASBT, "ViT-L/16, fp32, Adam, batch 64", "B1.yaml", 64, "keep_grads", "reserved", 26.79, "GB", "none", OWN_LOOP),
    Run("B2", RASBT, "ViT-L/16, fp32 via Fabric 32-true, Adam, batch 64", "B1.yaml", 64, "keep_grads", "reserved", 26.84, "GB", "none", OWN_LOOP),
    Run("B3", RASBT, "ViT-L/16, fp16 AMP, Adam, batch 64", "B3.yaml", 64, "keep_grads", "reserved", 18.21, "GB", "none", OWN_LOOP),
    Run("B4", RASBT, "ViT-L/16, bf16-true, Adam, batch 64", "B4.yaml", 64, "bf16_params+keep_grads", "reserved", 13.82, "GB", "bf16_params", OWN_LOOP),
    Run("B5", RASBT, "ViT-L/16, bf16-true, Adam, batch 16", "B5.yaml", 16, "bf16_params+keep_grads", "reserved", 5.69, "GB", "bf16_params", OWN_LOOP),
    Run("B6", RASBT, "ViT-L/16, bf16-true, Adam, 4 x 4 accumulated", "B6.yaml", 16, "bf16_params+accumulate:4", "reserved", 3.91, "GB"),
    Run("B7", RASBT, "ViT-L/16, bf16-true, SGD, 4 x 4 accumulated", "B7.yaml", 16, "bf16_params+sgd+accumulate:4", "reserved", 2.02, "GB"),
    Run("C1", TORCHTUNE, "Llama-3.2-3B full FT, bf16, AdamW, packed 2 x 4096", "C1-llama-3.2-3b-packed.yaml", 2, "none", "active", 60.0, "GiB"),
    Run("T1", TRANSFORMERS_DOCS, "BERT-large cls, fp32, AdamW, batch 4 x 512", "T-bert-large-fp32.yaml", 4, "keep_grads", "device", 14949, "MiB", informational=T_INFORMATIONAL),
    Run("T2", TRANSFORMERS_DOCS, "BERT-large cls, fp32, AdamW, 4 x 1 accumulated", "T-bert-large-fp32.yaml", 4, "accumulate:4+keep_grads", "device", 8681, "MiB", informational=T_INFORMATIONAL),
    Run("T3", TRANSFORMERS_DOCS, "BERT-large cls, fp32, AdamW, 4 x 1 accumulated, checkpointing", "T-bert-large-fp32.yaml", 4, "checkpoint+accumulate:4+keep_grads", "device", 6775, "MiB", informational=T_INFORMATIONAL),
    Run("T4", TRANSFORMERS_DOCS, "BERT-large cls, fp16 AMP, AdamW, batch 4 x 512", "T-bert-large-fp16.yaml", 4, "keep_grads", "device", 13939, "MiB", informational=T_INFORMATIONAL),
    Run("T5", TRANSFORMERS_DOCS, "BERT-large cls, fp16 AMP, AdamW, 4 x 1 accumulated, checkpointing", "T-bert-large-fp16.yaml", 4, "checkpoint+accumulate:4+keep_grads", "device", 7275, "MiB", informational=T_INFORMATIONAL),
    Run("T6", TRANSFORMERS_DOCS, "BERT-large cls, fp32, torch Adafactor for HF's, batch 4 x 512", "T-bert-large-fp32.yaml", 4, "adafactor+keep_grads", "device", 12295, "MiB", informational=T_INFORMATIONAL),
    Run("T7", TRANSFORMERS_DOCS, "BERT-large cls, fp16 AMP, torch Adafactor for HF's, 4 x 1 accumulated, checkpointing", "T-bert-large-fp16.yaml", 4, "checkpoint+accumulate:4+adafactor+keep_grads", "device", 4847, "MiB", informational=T_INFORMATIONAL),
]  # fmt: skip

OOM_CHECKS = [
    OomCheck(
        "A-OOM1",
        "Llama-2-7B LoRA, bf16-true, mb 4 x 1304",
        "A-llama-2-7b.yaml",
        4,
        "none",
        "Llama-2-7b-hf",
    ),
    OomCheck(
        "A-OOM2",
        "Llama-2-13B LoRA, bf16-true, mb 2 x 1304",
        "A-llama-2-13b.yaml",
        2,
        "none",
        "Llama-2-13b-hf",
    ),
    OomCheck(
        "A-OOM3",
        "Llama-2-7B LoRA, bf16-mixed, mb 1 x 1304",
        "A-oom-llama-2-7b-mixed.yaml",
        1,
        "none",
    ),
]

# Published runs not compared, and why (README.md says more).
LEFT_OUT = {
    "A11": "2 GPUs under Lightning's FSDP1 (flat parameters) with activation checkpointing: "
    "harness shards with FSDP2 and cannot express FSDP1's flat-parameter buffers",
    "C2-C8": "torch.compile of every layer and the loss (harness predicts compiled code "
    "eagerly), plus optimizer-in-backward (C5-C6), activation offloading (C6-C8) and "
    "torchtune's own LoRA/NF4 modules (C7-C8); the '+ 8-bit AdamW' row uses bitsandbytes' paged "
    "optimizer, whose state lives outside every torch counter",
    "D1": "torch.compile(fullgraph=True) of the whole model and fused AdamW (harness's "
    "optimizers are foreach or per-tensor, never fused); an eager prediction is no honest "
    "comparison with a compiled measurement",
    "E1-E2": "8 x H100 (96 GB HBM2e, an unusual card) under FSDP2 with torchtitan's op-level "
    "selective checkpointing policy (harness's sac policy differs), E2 also compiled",
    "F1-F4": "Alpaca truncated to 512 and padded per batch: the shape of the peak batch is "
    "not known; the card is not stated",
    "G1-G3": "Alpaca2k padded per batch: the peak batch's length is not known",
    "H1-H2": "reserved memory over the whole run including generation at batch 50 and "
    "empty_cache() every 10 steps, with variable lengths",
    "T (8-bit Adam, Accelerate)": "bitsandbytes' Adam8bit (its own CUDA kernels and state layout; "
    "harness's adam8bit is torchao's compiled AdamW8bit), and the Accelerate loop that reuses it",
}


def estimate(spec: Path) -> tuple[list[dict[str, Any]], float]:
    """``harness estimate SPEC --format json`` in a child process, from the repository root
    (where ``benchmarks.published`` imports from); its rows and the seconds it took."""
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "harness", "estimate", str(spec), "--format", "json"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines()
        raise RuntimeError(f"{spec.name}: harness estimate failed: {lines[-1] if lines else ''}")
    return json.loads(done.stdout), time.perf_counter() - started


def row_of(
    rows: list[dict[str, Any]], batch_size: int, strategy: str, size: str | None = None
) -> dict[str, Any]:
    """The spec's row of that batch and strategy (and size, which a spec of several must name)."""
    found = [
        row
        for row in rows
        if row["batch_size"] == batch_size
        and row["strategy"] == strategy
        and size in (None, row["model_size"])
    ]
    what = f"batch {batch_size} {strategy}" + (f" size {size}" if size else "")
    if not found:
        raise RuntimeError(f"no row {what}")
    if len(found) > 1:
        raise RuntimeError(f"{len(found)} rows {what}: name the run's size")
    row = found[0]
    if row.get("predicted_peak_bytes") is None:
        why = row.get("unpredictable") or row.get("refused") or "no prediction"
        raise RuntimeError(f"{what}: {why}")
    return row


def compare(run: Run, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The run's figure against its row's prediction of the same quantity."""
    row = row_of(rows, run.batch_size, run.strategy, run.size)
    figure_bytes = run.figure * UNITS[run.unit]
    predicted = float(row[PREDICTION[run.metric]])
    target = TARGETS[run.metric]
    ratio = predicted / figure_bytes
    result: dict[str, Any] = {
        **asdict(run),
        "figure_bytes": figure_bytes,
        "predicted_bytes": predicted,
        "predicted": predicted / UNITS[run.unit],
        "ratio": ratio,
        "target": target,
        "within_target": None if target is None else abs(ratio - 1) <= target,
        "card": row.get("card"),
        "row": {k: row.get(k) for k in sorted(row) if k.startswith(("predicted_", "num_params"))},
    }
    if run.metric == "device":
        # What the device figure was before reserved memory was predicted: the allocated peak
        # plus the card's context (and NCCL's buffers).
        old = float(row["predicted_peak_bytes"]) + float(row.get("predicted_context_bytes") or 0)
        old += float(row.get("predicted_nccl_bytes") or 0)
        result["allocated_plus_context"] = old / UNITS[run.unit]
        result["allocated_plus_context_ratio"] = old / figure_bytes
    if run.alternative is not None:
        other = row_of(rows, run.batch_size, run.alternative, run.alternative_size or run.size)
        value = float(other[PREDICTION[run.metric]])
        result["alternative_predicted"] = value / UNITS[run.unit]
        result["alternative_ratio"] = value / figure_bytes
    return result


def oom_check(check: OomCheck, rows: list[dict[str, Any]]) -> dict[str, Any]:
    row = row_of(rows, check.batch_size, check.strategy, check.size)
    return {
        **asdict(check),
        "predicted_device_bytes": float(row["predicted_device_bytes"]),
        "card": row.get("card"),
        "fits": row.get("fits"),
        "predicted_oom": row.get("fits") is False,
    }


def validation_bound(run: Run, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Upper bounds, from shapes alone, on what lit-gpt's sanity check before training holds.

    ``finetune/lora.py`` runs ``validate()`` (under ``inference_mode``: nothing is saved for
    backward) before the first step, and its max-allocated figure covers it. Validation: the
    weights, one validation batch's logits in bf16, Fabric's fp32 copy of them, the copy a
    reshape of the sliced logits may make and the fp32 log-softmax, all at the longest training
    length (a longer validation sample would have raised: the model's ``max_seq_length`` is the
    longest training sample), plus four layer-wide temporaries. Generation: the weights, a
    batch-1 KV cache of that length, its causal mask, the same temporaries. Under
    ``bf16-mixed`` add three bf16 copies of the widest weight (autocast casts frozen weights
    per use). If both bounds stay under the source's figure, the figure is the training peak.
    """
    from benchmarks.published.litgpt_model import CONFIGS

    sizes = yaml.safe_load((SPECS / run.spec).read_text())["model"]["sizes"]
    knobs = sizes[run.size] if run.size else next(iter(sizes.values()))
    config, steps, batch = CONFIGS[knobs["config"]], int(knobs["seq_len"]), run.batch_size
    row = row_of(rows, run.batch_size, run.strategy, run.size)
    weights = float(row["predicted_mem_param_bytes"])
    widest = max(config.mlp_size, 3 * config.n_embd)
    temporaries = 4 * batch * steps * widest * 2
    if knobs.get("precision") == "bf16-mixed":
        temporaries += 3 * widest * config.n_embd * 2
    logits = batch * steps * config.padded_vocab * (2 + 4 + 4 + 4)
    cache = 2 * config.n_layer * config.n_head * steps * config.head_size * 2 + steps * steps
    figure = run.figure * UNITS[run.unit]
    validation = weights + logits + temporaries
    generation = weights + cache + temporaries / batch
    return {
        "id": run.id,
        "validation_bound_bytes": validation,
        "generation_bound_bytes": generation,
        "figure_bytes": figure,
        "below_figure": max(validation, generation) < figure,
    }


def verdict(result: dict[str, Any]) -> str:
    if result["within_target"] is None:
        return "-"
    return "pass" if result["within_target"] else "FAIL"


def informational_table(results: list[dict[str, Any]]) -> list[str]:
    """The informational runs: the device figure beside the allocated peak plus context that
    harness reported as its device figure before, and why the run is not counted."""
    lines = [
        "| run | source | configuration | metric | source figure | harness | ratio "
        "| allocated + context (old) | old ratio | target | result | counted |",
        "|---|---|---|---|---:|---:|---:|---:|---:|---|---|---|",
    ]
    for r in results:
        unit = r["unit"]
        target = "none (reported)" if r["target"] is None else f"±{r['target']:.0%}"
        old = old_ratio = "-"
        if "allocated_plus_context" in r:
            old = f"{r['allocated_plus_context']:.0f} {unit}"
            old_ratio = f"{r['allocated_plus_context_ratio']:.3f}"
        lines.append(
            f"| {r['id']} | {r['source'][:1]} | {r['config']} | {r['metric']} | "
            f"{r['figure']:.0f} {unit} | {r['predicted']:.0f} {unit} | {r['ratio']:.3f} | "
            f"{old} | {old_ratio} | {target} | {verdict(r)} | no: {r['informational']} |"
        )
    return lines


def markdown(
    results: list[dict[str, Any]], checks: list[dict[str, Any]], bounds: list[dict[str, Any]]
) -> str:
    """The comparison as a markdown table, then the informational runs, the out-of-memory
    checks and source A's validation bounds."""
    informational = [r for r in results if r["informational"]]
    results = [r for r in results if not r["informational"]]
    lines = [
        "| run | source | configuration | metric | source figure | harness | ratio | target "
        "| result |",
        "|---|---|---|---|---:|---:|---:|---|---|",
    ]
    for r in results:
        unit = r["unit"]
        target = "none (reported)" if r["target"] is None else f"±{r['target']:.0%}"
        cell = f"{r['predicted']:.2f} {unit}"
        if "alternative_predicted" in r:
            cell += (
                f" ({r['alternative_predicted']:.2f} {r['alternative_short']}, "
                f"{r['alternative_ratio']:.3f})"
            )
        lines.append(
            f"| {r['id']} | {r['source'][:1]} | {r['config']} | {r['metric']} | "
            f"{r['figure']:.2f} {unit} | {cell} | {r['ratio']:.3f} | {target} | {verdict(r)} |"
        )
    if informational:
        lines += ["", *informational_table(informational)]
    lines += ["", "| check | configuration | source | harness device figure | card | result |"]
    lines.append("|---|---|---|---:|---|---|")
    for c in checks:
        outcome = "pass (predicted OOM)" if c["predicted_oom"] else "FAIL (predicted to fit)"
        lines.append(
            f"| {c['id']} | {c['config']} | OOM | {c['predicted_device_bytes'] / 1e9:.2f} GB | "
            f"{c['card']} | {outcome} |"
        )
    lines += [
        "",
        "| run | validation bound | generation bound | source figure | bounds below it |",
        "|---|---:|---:|---:|---|",
    ]
    for b in bounds:
        lines.append(
            f"| {b['id']} | {b['validation_bound_bytes'] / 1e9:.2f} GB | "
            f"{b['generation_bound_bytes'] / 1e9:.2f} GB | {b['figure_bytes'] / 1e9:.2f} GB | "
            f"{'yes' if b['below_figure'] else 'NO'} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.published", description=__doc__)
    parser.add_argument("--jobs", type=int, default=2, help="estimates at once (default 2)")
    parser.add_argument("--out", type=Path, default=Path("results/published.json"))
    args = parser.parse_args(argv)
    started = time.perf_counter()
    specs = sorted({run.spec for run in RUNS} | {check.spec for check in OOM_CHECKS})
    with ThreadPoolExecutor(max(1, args.jobs)) as pool:
        answers = dict(zip(specs, pool.map(lambda s: estimate(SPECS / s), specs), strict=True))
    for spec, (_, seconds) in answers.items():
        print(f"estimated {spec} in {seconds:.0f} s", file=sys.stderr)
    results = [compare(run, answers[run.spec][0]) for run in RUNS]
    checks = [oom_check(check, answers[check.spec][0]) for check in OOM_CHECKS]
    bounds = [validation_bound(run, answers[run.spec][0]) for run in RUNS if run.source == LITGPT]
    compared = [r for r in results if not r["informational"]]
    counted = [r for r in compared if r["within_target"] is not None]
    passed = sum(bool(r["within_target"]) for r in counted)
    sources = sorted({r["source"] for r in compared})
    informational = [r for r in results if r["informational"]]
    informational_sources = sorted({r["source"] for r in informational})
    elapsed = time.perf_counter() - started
    print(markdown(results, checks, bounds))
    print(
        f"\n{len(compared)} runs from {len(sources)} sources compared; {passed} of "
        f"{len(counted)} allocated/active runs within their target; "
        f"{len(informational)} informational runs from {len(informational_sources)} source "
        f"printed, not counted ({sum(bool(r['within_target']) for r in informational)} within "
        f"their target); "
        f"{sum(c['predicted_oom'] for c in checks)} of {len(checks)} out-of-memory runs "
        f"predicted out of memory; {elapsed:.0f} s."
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    summary = {
        "machine": {"platform": platform.platform(), "python": platform.python_version()},
        "seconds": elapsed,
        "spec_seconds": {spec: seconds for spec, (_, seconds) in answers.items()},
        "sources": sources,
        "informational_sources": informational_sources,
        "counted": len(counted),
        "within_target": passed,
        "runs": results,
        "oom_checks": checks,
        "validation_bounds": bounds,
        "left_out": LEFT_OUT,
    }
    args.out.write_text(json.dumps(summary, indent=1))
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
