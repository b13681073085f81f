"""``make bench``'s published figures: harness's CUDA predictions against published GPU runs
(``python -m benchmarks.published``), as targets: every allocated/active run within ±3 %, every
run a source reports out of memory predicted not to fit."""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable
from pathlib import Path

from benchmarks.figures import Figure, at_least, reported
from benchmarks.published.__main__ import main


def run(log: Callable[[str], None]) -> list[Figure]:
    with tempfile.TemporaryDirectory(prefix="harness-published-") as folder:
        out = Path(folder) / "published.json"
        main(["--out", str(out)])
        summary = json.loads(out.read_text())
    # Runs of an informational source (source T) are printed by __main__ but never counted.
    compared = [r for r in summary["runs"] if not r.get("informational")]
    informational = [r for r in summary["runs"] if r.get("informational")]
    counted = [r for r in compared if r["within_target"] is not None]
    ratios = {r["id"]: r["ratio"] for r in compared}
    reserved = [r["ratio"] for r in compared if r["within_target"] is None]
    oom = summary["oom_checks"]
    log(
        f"  published: {summary['within_target']} of {len(counted)} allocated/active runs within "
        f"±3 %, {len(compared)} runs from {len(summary['sources'])} sources "
        f"(+{len(informational)} informational, not counted), {summary['seconds']:.0f} s"
    )
    share = summary["within_target"] / len(counted)
    return [
        at_least(
            "published_allocated_runs_within_3pct",
            share,
            1.0,
            "",
            runs=len(counted),
            ratios={r["id"]: r["ratio"] for r in counted},
        ),
        at_least(
            "published_oom_runs_predicted_not_to_fit",
            sum(c["predicted_oom"] for c in oom) / max(1, len(oom)),
            1.0,
            "",
            checks=oom,
        ),
        reported(
            "published_reserved_runs_worst_ratio",
            min(reserved) if reserved else float("nan"),
            "",
            ratios=ratios,
        ),
    ]
