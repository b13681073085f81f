"""``harness cards``: the card catalogue a prediction can be made for, and your own cards."""

from __future__ import annotations

from pathlib import Path

import click

from harness.cli.common import emit, format_option


@click.command()
@click.option(
    "--cards",
    "cards_file",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Also list the cards of this YAML file (see docs/cards.md).",
)
@format_option
def cards(cards_file: Path | None, fmt: str) -> None:
    """List the cards `--card` and the spec's `card` accept: memory as PyTorch sees it, compute
    capability, dense peaks, bandwidth, the CUDA context assumed, and where each number is from."""
    import pandas as pd

    from harness.cuda.cards import CATALOGUE
    from harness.spec.load import load_cards

    found = dict(CATALOGUE)
    if cards_file is not None:
        found.update(load_cards(cards_file))
    frame = pd.DataFrame(
        [
            {
                "card": card.name,
                "device_name": card.device_name,
                "memory_bytes": card.memory_bytes,
                "compute_capability": ".".join(map(str, card.compute_capability)),
                "sms": card.sms,
                "bf16_tflops": card.peak_tflops.get("bf16") or card.peak_tflops.get("fp16"),
                "bandwidth_tbs": card.bandwidth_tbs,
                "interconnect": card.interconnect,
                "context_bytes": card.context,
                "context": "measured" if card.context_bytes is not None else "assumed",
                "cublas_workspace_bytes": card.cublas_workspace_bytes,
                "sources": "; ".join(f"{k}: {v}" for k, v in card.sources.items()),
            }
            for card in found.values()
        ]
    )
    emit(frame, fmt, lambda: show_cards(frame))


def show_cards(frame: object) -> None:
    from rich import box

    from harness.cli.common import make_console, print_table
    from harness.units import format_bytes

    headings = ("card", "memory", "sm", "SMs", "16-bit TFLOPS", "TB/s", "context", "link")
    rows = [
        [
            row["card"],
            format_bytes(row["memory_bytes"], short=True),
            row["compute_capability"],
            str(row["sms"]),
            f"{row['bf16_tflops']:g}" if row["bf16_tflops"] else "-",
            f"{row['bandwidth_tbs']:g}",
            f"{format_bytes(row['context_bytes'], short=True)}"
            + ("" if row["context"] == "measured" else " *"),
            row["interconnect"],
        ]
        for row in frame.to_dict("records")  # type: ignore[attr-defined]
    ]
    console = make_console()
    print_table(
        console,
        headings,
        [heading not in ("card", "link") for heading in headings],
        rows,
        "--format json shows every field",
        title="cards (memory: what PyTorch reports as total_memory)",
        box=box.SIMPLE_HEAD,
        pad_edge=False,
    )
    console.print(
        "peaks are dense (no sparsity); * context assumed: SMs x resident threads x 1 KiB of "
        "stack + 133 MiB (docs/cards.md); --format json gives every number's source",
        highlight=False,
    )
