"""``python -m benchmarks.published.speed [--jobs N] [--out FILE]``: harness's predicted GPU
training throughput against published, measured GPU training speeds.

Every spec under ``speed_specs/`` configures one or more published runs as their sources ran
them (each file's header quotes the source, its address and the figure). Each spec is estimated
by ``harness estimate SPEC --card CARD --format json`` in its own child process (N at a time,
default 2), for the card the spec names, and each run is held against the grid row configured
as it ran: ``ratio = predicted / published`` throughput, both as samples/s or tokens/s of all
GPUs together (a figure published per GPU is multiplied by the GPUs that ran it). A run counts
as matched when ``1/1.5 <= ratio <= 1.5``; the target is 75 % of runs matched.

The rule, as for the memory runs (README.md): no per-model, per-source or per-card constant,
correction or calibration anywhere. Every prediction is harness's own, from the card's
catalogue figures (or, for a card the catalogue lacks, ``speed_specs/cards.yaml``'s figures,
taken from what the source states about its hardware). Runs that cannot be configured as they
ran are listed in ``LEFT_OUT`` and in SPEED.md, with the reason. Prints a markdown table and
writes ``FILE`` (default ``results/published_speed.json``). Works offline.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import yaml

from benchmarks.figures import Figure

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent  # user code is imported as benchmarks.published.* from here
SPECS = HERE / "speed_specs"
DEFAULT_OUT = REPO / "results" / "published_speed.json"
FACTOR = 1.5  # a run is matched when predicted / published is within [1/1.5, 1.5]
TARGET_SHARE = 0.75  # of runs matched
TARGET = "within 1.5x on >= 3 of 4 (75 %) of runs"

TORCHTUNE = "TT: torchtune README @ 1814feb17, 'Optimization flags'"
HF_DOCS = "HF: transformers docs, perf_train_gpu_one.mdx @ 0016acf7"
TIMM = "M: timm benchmark-train-amp-nchw-pt112-cu113-rtx3090.csv @ c865028c"
PEFT = "P: PEFT method_comparison/MetaMathQA results @ 0a179c1e"
TORCHTITAN = "X: torchtitan benchmarks/llama3_h100_202412_torchtitan.md"

SOURCE_URLS = {
    TORCHTUNE: "https://github.com/pytorch/torchtune/blob/1814feb17/README.md",
    HF_DOCS: "https://github.com/huggingface/transformers/blob/"
    "0016acf7ef421c7fe8eff7945de52c71896c3b01/docs/source/en/perf_train_gpu_one.mdx",
    TIMM: "https://github.com/huggingface/pytorch-image-models/blob/c865028c/results/"
    "benchmark-train-amp-nchw-pt112-cu113-rtx3090.csv",
    PEFT: "https://github.com/huggingface/peft/tree/0a179c1e8659ab4f7df0369b9b03943cfe470ff1/"
    "method_comparison/MetaMathQA/results",
    TORCHTITAN: "https://github.com/pytorch/torchtitan/blob/main/benchmarks/"
    "llama3_h100_202412_torchtitan.md",
}


@dataclass(frozen=True)
class SpeedRun:
    """One published speed and the grid row of the spec that configures it."""

    id: str
    source: str
    config: str  # the configuration, in a few words
    spec: str  # file under speed_specs/
    batch_size: int  # the grid row's batch (all ranks together, every micro-batch of a step)
    strategy: str  # harness's canonical strategy text of the row
    figure: float  # as the source printed it
    unit: str  # samples/s | tokens/s (for every GPU of the run together, after ``gpus``)
    quote: str  # the source's own words or row
    gpus: int = 1  # a figure published per GPU is multiplied by this
    size: str | None = None  # the spec's size (model) the run is; None where it has one

    @property
    def published_total(self) -> float:
        return self.figure * self.gpus

    @property
    def shown_unit(self) -> str:
        return f"{self.unit}/GPU" if self.gpus > 1 else self.unit


RUNS = [
    SpeedRun("TT1", TORCHTUNE, "Llama-3.2-3B full FT, bf16 weights, AdamW, packed 2 x 4096, no AC", "TT1-llama-3.2-3b-packed.yaml", 2, "none", 7075, "tokens/s", "| + Packed Dataset | 60.0 | +135.16% | 7075 | +238.40% |"),
    SpeedRun("HF1", HF_DOCS, "BERT-large cls, fp32, AdamW, batch 4 x 512", "HF-bert-large-fp32.yaml", 4, "keep_grads", 8.86, "samples/s", "Time: 57.82 / Samples/second: 8.86"),
    SpeedRun("HF2", HF_DOCS, "BERT-large cls, fp32, AdamW, 1 x 512, 4 accumulated", "HF-bert-large-fp32.yaml", 4, "accumulate:4+keep_grads", 7.75, "samples/s", "Time: 66.03 / Samples/second: 7.75"),
    SpeedRun("HF3", HF_DOCS, "BERT-large cls, fp32, AdamW, 1 x 512, 4 accumulated, checkpointing", "HF-bert-large-fp32.yaml", 4, "checkpoint+accumulate:4+keep_grads", 5.99, "samples/s", "Time: 85.47 / Samples/second: 5.99"),
    SpeedRun("HF4", HF_DOCS, "BERT-large cls, fp16 AMP, AdamW, batch 4 x 512", "HF-bert-large-fp16.yaml", 4, "keep_grads", 18.64, "samples/s", "Time: 27.46 / Samples/second: 18.64"),
    SpeedRun("HF5", HF_DOCS, "BERT-large cls, fp16 AMP, AdamW, 1 x 512, 4 accumulated, checkpointing", "HF-bert-large-fp16.yaml", 4, "checkpoint+accumulate:4+keep_grads", 10.09, "samples/s", "Time: 50.76 / Samples/second: 10.09"),
    SpeedRun("M1", TIMM, "resnet18, fp16 AMP, SGD, batch 512", "M1-timm-resnet18.yaml", 512, "none", 2764.22, "samples/s", "resnet18,2764.22,184.877,512,224,11.69"),
    SpeedRun("M2", TIMM, "resnet50, fp16 AMP, SGD, batch 512", "M2-timm-resnet50.yaml", 512, "none", 826.06, "samples/s", "resnet50,826.06,618.983,512,224,25.56"),
    SpeedRun("M3", TIMM, "convnext_tiny, fp16 AMP, SGD, batch 256", "M3-timm-convnext_tiny.yaml", 256, "none", 813.16, "samples/s", "convnext_tiny,813.16,313.859,256,224,28.59"),
    SpeedRun("M4", TIMM, "efficientnet_b0, fp16 AMP, SGD, batch 384", "M4-timm-efficientnet_b0.yaml", 384, "none", 1459.11, "samples/s", "efficientnet_b0,1459.11,262.1,384,224,5.29"),
    SpeedRun("M5", TIMM, "vit_base_patch16_224, fp16 AMP, SGD, batch 192", "M5-timm-vit_base_patch16_224.yaml", 192, "none", 390.86, "samples/s", "vit_base_patch16_224,390.86,490.391,192,224,86.57"),
    SpeedRun("P1", PEFT, "Llama-3.2-3B LoRA r32 (q,v), bf16 base, AdamW, batch 4 x ~210", "P1-llama-3.2-3b-lora-r32.yaml", 4, "lora:32", 6776.3, "tokens/s", '"tokens / sec": 6776.307695418065 (step 5000)'),
    SpeedRun("P2", PEFT, "Llama-3.2-3B full FT, bf16 weights + AdamW state, batch 4 x ~210", "P2-llama-3.2-3b-full-bf16.yaml", 4, "bf16_params", 2300.2, "tokens/s", '"tokens / sec": 2300.2003545895063 (step 5000)'),
    SpeedRun("X1", TORCHTITAN, "Llama-3.1-8B, 8 GPUs FSDP2 bf16/fp32-reduce, op SAC, 2 x 8192 per GPU", "X1-torchtitan-llama-3.1-8b-fsdp8.yaml", 16, "fsdp:8+fsdp_mixed+sac", 5762, "tokens/s", "| FSDP | 5,762 | 82.4 |", gpus=8),
]  # fmt: skip

# Published speeds looked at and not compared, and why (SPEED.md says more).
LEFT_OUT = {
    "TT baseline": "torchtune README 'Baseline' (2091 tokens/s): unpacked Alpaca padded per batch "
    "of 2; the lengths of the batches are not published",
    "TT compile rows": "torchtune README '+ Compile' ... 'QLoRA' (6960-9174 tokens/s): every row "
    "after '+ Packed Dataset' is torch.compile'd; harness prices compiled code as its eager ops",
    "TT 2024 tables": "torchtune README @ 0217d44c2 / 30b8519e8 (Llama2-7B / Llama 3.1 8B on "
    "RTX 4090, A6000, 8 x A100): configs use unpacked Alpaca (length per batch unknown), "
    "bitsandbytes' paged optimizers, optimizer-in-backward, compile for QLoRA and CPU offload",
    "HF6-HF7": "transformers docs' Adafactor runs (7.96, 9.06 samples/s): transformers' own "
    "Adafactor (a per-parameter Python loop), which harness cannot build",
    "HF 8-bit Adam": "bitsandbytes' Adam8bit (its own CUDA kernels); harness's adam8bit is "
    "torchao's",
    "X compile/float8": "torchtitan Tables 1-6 other than 'FSDP': torch.compile, Float8, "
    "context/tensor/pipeline parallelism over up to 512 GPUs",
    "rasbt ViT-L": "rasbt/pytorch-memory-optim epoch times: the card is not stated",
    "litgpt": "litgpt config_hub finetune tables (training runtime per epoch): Alpaca 2k padded "
    "per batch, token counts not published",
}


def spec_card(spec: Path) -> str:
    return str(yaml.safe_load(spec.read_text())["card"])


def estimate(spec: Path) -> tuple[list[dict[str, Any]], float]:
    """``harness estimate SPEC --card CARD --format json`` in a child process, from the
    repository root (where ``benchmarks.published`` imports from); its rows and seconds."""
    started = time.perf_counter()
    command = [sys.executable, "-m", "harness", "estimate", str(spec), "--card", spec_card(spec)]
    done = subprocess.run(
        [*command, "--format", "json"], cwd=REPO, capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines()
        raise RuntimeError(f"{spec.name}: harness estimate failed: {lines[-1] if lines else ''}")
    return json.loads(done.stdout), time.perf_counter() - started


def row_of(rows: list[dict[str, Any]], run: SpeedRun) -> dict[str, Any]:
    found = [
        row
        for row in rows
        if row["batch_size"] == run.batch_size
        and row["strategy"] == run.strategy
        and run.size in (None, row["model_size"])
    ]
    what = f"batch {run.batch_size} {run.strategy}" + (f" size {run.size}" if run.size else "")
    if len(found) != 1:
        raise RuntimeError(f"{run.id}: {len(found)} rows {what}")
    row = found[0]
    if row.get("predicted_throughput") is None:
        why = row.get("unpredictable") or row.get("refused") or "no speed prediction"
        raise RuntimeError(f"{run.id}: {what}: {why}")
    return row


def seq_len(run: SpeedRun, row: dict[str, Any]) -> int:
    """The run's sequence length, from its spec's size (to turn tokens/s into samples/s)."""
    sizes = yaml.safe_load((SPECS / run.spec).read_text())["model"]["sizes"]
    return int(sizes[row["model_size"]]["seq_len"])


def compare(run: SpeedRun, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The run's published throughput against its row's prediction, in the run's unit."""
    row = row_of(rows, run)
    predicted = float(row["predicted_throughput"])
    unit = str(row.get("throughput_unit") or "samples/s")
    if unit != run.unit:  # the same step's count, in the source's unit
        length = seq_len(run, row)
        if (unit, run.unit) == ("tokens/s", "samples/s"):
            predicted /= length
        elif (unit, run.unit) == ("samples/s", "tokens/s"):
            predicted *= length
        else:
            raise RuntimeError(f"{run.id}: cannot turn {unit} into {run.unit}")
    ratio = predicted / run.published_total
    return {
        **asdict(run),
        "url": SOURCE_URLS[run.source],
        "published_total": run.published_total,
        "shown_unit": run.shown_unit,
        "predicted_total": predicted,
        "predicted_per_gpu": predicted / run.gpus,
        "harness_unit": unit,
        "ratio": ratio,
        "within": 1 / FACTOR <= ratio <= FACTOR,
        "card": row.get("card"),
        "predicted_step_time_ms": row.get("predicted_step_time_ms"),
        "predicted_mfu": row.get("predicted_mfu"),
        "speed_unmodelled_ops": row.get("speed_unmodelled_ops") or "",
        "row": {k: row.get(k) for k in sorted(row) if k.startswith(("predicted_", "speed_"))},
    }


def number(value: float) -> str:
    """A throughput as the sources print theirs: whole numbers from 100 up, else 2 decimals."""
    return f"{value:,.0f}" if value >= 100 else f"{value:.2f}"


def markdown(results: list[dict[str, Any]], errors: dict[str, str]) -> list[str]:
    lines = [
        "| run | source | configuration | card | published | harness | ratio | within 1.5x |",
        "|---|---|---|---|---:|---:|---:|---|",
    ]
    for r in results:
        lines.append(
            f"| {r['id']} | {r['source'].split(':')[0]} | {r['config']} | {r['card']} | "
            f"{r['figure']:,.6g} {r['shown_unit']} | "
            f"{number(r['predicted_per_gpu'])} {r['shown_unit']} | {r['ratio']:.2f} | "
            f"{'yes' if r['within'] else 'no'} |"
        )
    for run_id, error in errors.items():
        lines.append(f"| {run_id} | - | error: {error} | - | - | - | - | no |")
    return lines


def main(argv: list[str] | None = None, echo: Callable[[str], None] = print) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.published.speed")
    parser.add_argument("--jobs", type=int, default=2, help="estimates at once (default 2)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="the result JSON")
    parser.add_argument("--only", nargs="*", help="run ids to compare (default: all)")
    args = parser.parse_args(argv)
    runs = [r for r in RUNS if not args.only or r.id in args.only]
    started = time.perf_counter()
    specs = sorted({run.spec for run in runs})
    by_spec: dict[str, tuple[list[dict[str, Any]], float] | Exception] = {}

    def one(name: str) -> None:
        try:
            by_spec[name] = estimate(SPECS / name)
            echo(f"  estimated {name} ({by_spec[name][1]:.0f} s)")  # type: ignore[index]
        except Exception as error:  # reported in the table, never hidden
            by_spec[name] = error
            echo(f"  {name}: {error}")

    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        list(pool.map(one, specs))
    results: list[dict[str, Any]] = []
    errors: dict[str, str] = {}
    for run in runs:
        got = by_spec[run.spec]
        if isinstance(got, Exception):
            errors[run.id] = str(got)
            continue
        try:
            results.append(compare(run, got[0]))
        except Exception as error:
            errors[run.id] = str(error)
    within = sum(r["within"] for r in results)
    total = len(results) + len(errors)  # a run that errored counts as not matched
    seconds = time.perf_counter() - started
    lines = markdown(results, errors)
    lines += [
        "",
        f"**{within} of {total} within a factor 1.5** (target: {TARGET}); "
        f"{len({r.source for r in runs})} sources; {seconds:.0f} s.",
    ]
    for line in lines:
        echo(line)
    summary = {
        "machine": {"platform": platform.platform(), "python": sys.version.split()[0]},
        "seconds": seconds,
        "spec_seconds": {
            name: got[1] for name, got in by_spec.items() if not isinstance(got, Exception)
        },
        "factor": FACTOR,
        "target": TARGET,
        "within": within,
        "runs_compared": total,
        "share_within": within / total if total else 0.0,
        "sources": {source: SOURCE_URLS[source] for source in sorted({r.source for r in runs})},
        "runs": results,
        "errors": errors,
        "left_out": LEFT_OUT,
        "markdown": "\n".join(lines),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=1))
    echo(f"wrote {args.out}")
    return summary


def run(echo: Callable[[str], None]) -> list[Figure]:
    """``make bench``-style figure: the share of published runs predicted within 1.5x."""
    summary = main([], echo)
    share = summary["share_within"]
    return [
        Figure(
            "published_speed_runs_within_1.5x",
            share,
            TARGET,
            share >= TARGET_SHARE,
            "",
            {
                "within": summary["within"],
                "runs": summary["runs_compared"],
                "ratios": {r["id"]: r["ratio"] for r in summary["runs"]},
                "errors": summary["errors"],
                "seconds": summary["seconds"],
            },
        )
    ]


if __name__ == "__main__":
    main()
