"""``python -m benchmarks.record_grid``: run experiments/search_grid.yaml in full and ship its
results as ``benchmarks/data/search_grid.csv``, the recorded grid the search benchmark replays.

Run it on an idle machine (about 20 minutes on 2 CPU cores): the throughputs in the file are
objectives the samplers compete on.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from harness.results import load

SPEC = Path("experiments/search_grid.yaml")
OUT = Path("benchmarks/data/search_grid.csv")
COLUMNS = [
    "trial_key",
    "model_size",
    "batch_size",
    "dtype",
    "strategy",
    "status",
    "peak_allocated_bytes",
    "predicted_peak_bytes",
    "throughput",
    "accuracy",
    "device_name",
    "torch_version",
]


def main() -> None:
    subprocess.run([sys.executable, "-m", "harness", "sweep", str(SPEC)], check=True)
    frame = load("search-grid")
    OUT.parent.mkdir(parents=True, exist_ok=True)
    frame[COLUMNS].to_csv(OUT, index=False)
    print(f"wrote {len(frame)} trials to {OUT}")


if __name__ == "__main__":
    main()
