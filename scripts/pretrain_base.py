"""Pre-train the small language model that experiments/finetune_quality.yaml fine-tunes.

A 2-layer Llama over bytes (vocabulary 256, as the ``text`` dataset's tokens) trained on the
first half of pydoc's topics (``corpus: first_half``) and saved with ``save_pretrained``
(safetensors): real weights, made offline in about a minute, whose held-out loss on the other
half of the topics is far below a random model's, so fine-tuning on that other half starts from
something. ``make base-model`` runs it into ``results/base-model/``.

    python scripts/pretrain_base.py OUT_DIR [--steps N]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from harness.workloads.tensors import INPUTS, TARGETS, batches  # noqa: E402
from harness.workloads.text import load  # noqa: E402

SEQ_LEN = 64
BATCH = 16


def pretrain(out: Path, steps: int, seed: int = 0) -> float:
    """Train, save into ``out``; the held-out loss on the first half's test split."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=SEQ_LEN, tie_word_embeddings=False, use_cache=False,
    )  # fmt: skip
    model = LlamaForCausalLM(config)
    data = load({"corpus": "first_half", "seq_len": SEQ_LEN, "test_fraction": 0.05}, seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    stream = batches(data.train, BATCH, seed)
    start = time.perf_counter()
    for step in range(1, steps + 1):
        batch = next(stream)
        logits = model(input_ids=batch[INPUTS]).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[TARGETS].flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % 50 == 0 or step == steps:
            print(
                f"step {step}/{steps}: loss {loss.item():.3f} ({time.perf_counter() - start:.0f} s)"
            )
    model.eval()
    with torch.no_grad():
        test = data.test
        logits = model(input_ids=test[INPUTS][:256]).logits
        held_out = float(
            torch.nn.functional.cross_entropy(logits.flatten(0, 1), test[TARGETS][:256].flatten())
        )
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    print(f"saved to {out}: held-out loss {held_out:.3f} (a random model's: ln 256 = 5.545)")
    return held_out


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--steps", type=int, default=400)
    options = parser.parse_args(argv)
    pretrain(options.out_dir, options.steps)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
