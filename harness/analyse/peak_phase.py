"""Why a trial's peak is where it is, and which strategies can move it.

A peak has a moment (the phase of the step it falls in: ``peak_phase``, recorded by the memory
window) and a make-up (the breakdown at that moment). Together they say which strategies can
lower it: a peak in the optimizer step holds parameters, gradients, optimizer state and the
step's temporaries, so checkpointing or accumulation leave it exactly where it was, however
much activation memory they save elsewhere. Without saying so, a table shows ``checkpoint``
with ``none``'s peak and leaves the reader to guess why.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pandas as pd

from harness.metrics import BREAKDOWN_CATEGORIES, breakdown_metric
from harness.strategies import LOWERS, STRATEGIES
from harness.strategies.combination import recorded_names

PHASE_WORDS = {
    "forward": "the forward pass",
    "backward": "the backward pass",
    "recompute": "backward's recomputation",
    "optimizer": "the optimizer step",
}
CATEGORY_WORDS = {
    "param": "parameters",
    "grad": "gradients",
    "optim": "optimizer state",
    "activation": "activations",
    "other": "temporaries",
}
MODEL_STATE = ("param", "grad", "optim")
MAX_NAMED = 6  # strategies named per line


def activation_only() -> list[str]:
    """Strategies that lower activations and nothing else."""
    return [name for name, lowered in LOWERS.items() if lowered == ("activation",)]


def peak_shares(row: Mapping[Any, Any]) -> dict[str, float]:
    """Each breakdown category's share of the peak (empty when the row has no breakdown)."""
    parts: dict[str, float] = {}
    for category in BREAKDOWN_CATEGORIES:
        value = row.get(breakdown_metric(category))
        if value is None or pd.isna(value):
            return {}
        parts[category] = float(value)
    total = sum(parts.values())
    return {c: v / total for c, v in parts.items()} if total > 0 else {}


def applicable(name: str, row: Mapping[Any, Any]) -> bool:
    """Whether strategy ``name`` applies to the row's model and device, and is not in use."""
    info = STRATEGIES[name]
    used = set(recorded_names(row.get("strategy")))
    device = str(row.get("device") or "cpu").partition(":")[0]
    family = row.get("model")
    return (
        name not in used
        and device in info.devices
        and (info.families is None or family in info.families)
    )


def peak_reason(row: Mapping[Any, Any]) -> str | None:
    """One line on the row's peak: its phase, what dominates it, the strategies that cannot
    lower it and those that can (applicable to its model and device, not already used); None
    when the trial recorded no phase (it ended before its memory window, or predates it)."""
    phase = row.get("peak_phase")
    shares = peak_shares(row)
    if not isinstance(phase, str) or phase not in PHASE_WORDS or not shares:
        return None
    biggest = max(shares, key=shares.__getitem__)
    if phase == "optimizer":  # nothing of the forward pass is alive: model state and temporaries
        targets: tuple[str, ...] = (*MODEL_STATE, "other")
    else:
        targets = (biggest,)
    can = [
        name
        for name, lowered in LOWERS.items()
        if set(lowered) & set(targets) and applicable(name, row)
    ]
    if phase == "optimizer":
        state = sum(shares[c] for c in MODEL_STATE)
        made_of = f"model state {state:.0%}, temporaries {shares['other']:.0%}"
    else:
        made_of = f"{CATEGORY_WORDS[biggest]} {shares[biggest]:.0%} of it"
    line = f"peak in {PHASE_WORDS[phase]} ({made_of})"
    if "activation" not in targets:
        blind = [n for n in activation_only() if STRATEGIES[n].families is None][:3]
        line += f": activation strategies ({', '.join(blind)}, ...) cannot lower it"
    if can:
        more = f" and {len(can) - MAX_NAMED} more" if len(can) > MAX_NAMED else ""
        line += f"; try {', '.join(can[:MAX_NAMED])}{more}"
    return line


def optimizer_peak_note(frame: pd.DataFrame) -> str | None:
    """Under a results table: how many finished trials peak in the optimizer step, and what
    that means for the strategies compared (None when none does)."""
    if "peak_phase" not in frame:
        return None
    done = frame[frame["status"].eq("ok")]
    in_step = done[done["peak_phase"].eq("optimizer")]
    if in_step.empty:
        return None
    used = {name for text in in_step["strategy"] for name in recorded_names(text)}
    tried = sorted(used & set(activation_only()))
    blind = f" ({', '.join(tried)} among them)" if tried else ""
    return (
        f"{len(in_step)} of {len(done)} finished trials peak in the optimizer step: activation "
        f"strategies{blind} cannot lower those peaks; harness recommend names what can"
    )
