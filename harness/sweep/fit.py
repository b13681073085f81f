"""``harness fit``: the largest batch (or sequence length) each configuration allows on each
card, predicted, before any GPU time.

The grid without the chosen axis (model size × dtype × strategy) is searched by the trial
layer (``python -m harness.trial.fit``: the estimator at a few values of the axis, see its
notes) in one child process, so this one never imports model code. One row per configuration
and budget; ``matrix`` turns them into configurations × cards.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import pandas as pd

from harness.contract import DEFAULT_FIT_MAX
from harness.cuda.margin import CARD_MARGIN
from harness.spec import Spec, trial_config
from harness.sweep.estimate import run_trial_tool
from harness.trial.config import TrialConfig
from harness.workloads.sizes import training_samples


def configurations(spec: Spec) -> list[TrialConfig]:
    """One trial config per model size × dtype × strategy (the grid's first batch size)."""
    seen: dict[tuple[str, str, str], TrialConfig] = {}
    batch = next((b for b in spec.grid.batch_size if isinstance(b, int)), 1)
    for size in spec.model.sizes:
        for dtype in spec.grid.dtype:
            for strategy in spec.grid.strategy:
                point = {
                    "model_size": size,
                    "batch_size": batch,
                    "dtype": dtype,
                    "strategy": strategy.text,
                }
                seen.setdefault((size, dtype, strategy.text), trial_config(spec, point))
    return list(seen.values())


def upper_bound(config: TrialConfig, axis: str, maximum: int | None) -> int:
    """The axis' largest value to try: ``--max``, and for the batch the training split (a batch
    larger than it cannot be drawn)."""
    bound = maximum or DEFAULT_FIT_MAX[axis]
    if axis == "batch_size":
        samples = training_samples(config.dataset, config.dataset_options)
        if samples:
            bound = min(bound, samples)
    return bound


def fit_configs(
    configs: list[TrialConfig],
    target: str,
    budgets: list[int],
    axis: str,
    maximum: int | None,
    jobs: int = 1,
) -> list[dict[str, Any]]:
    """The trial layer's answers: per config, its rows (one per budget) and seconds. ``jobs``
    child processes search at once, each taking the next configuration not yet taken, the
    likely slowest first (``likely_cost``): a slow one started last would leave the other
    cores idle while it runs."""
    request = {
        "device": target,
        "axis": axis,
        "budgets": budgets,
        "max": [upper_bound(config, axis, maximum) for config in configs],
        "configs": [config.to_dict() for config in configs],
        "order": sorted(range(len(configs)), key=lambda i: -likely_cost(configs[i])),
    }
    return run_trial_tool("harness.trial.fit", request, "the fit search", processes=jobs)


def likely_cost(config: TrialConfig) -> float:
    """A configuration's search time relative to the same model without strategies (each
    strategy's ``search_cost``, times K for one that runs K micro-batches a step, twice for
    an ``auto`` one)."""
    cost = 1.0
    for term in config.strategy:
        cost *= term.info.search_cost
        if term.info.micro_batches_from_arg and term.number is not None:
            cost *= term.number
        if term.auto:  # a choice of plan at each answer: ~4 more predictions per budget
            cost *= 2
    return cost


def default_jobs() -> int:
    """One search process per core: a prediction is single-threaded Python."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def fit_grid(
    spec: Spec,
    target: str,
    budgets: list[int],
    axis: str = "batch_size",
    maximum: int | None = None,
    jobs: int = 1,
) -> pd.DataFrame:
    """One row per configuration and budget: the largest ``axis`` value that fits, the
    predicted peak and breakdown there, the margin, the next value's peak, the predictions."""
    configs = configurations(spec)
    print(
        f"fitting {axis} for {len(configs)} configuration(s) x {len(budgets)} budget(s) "
        f"on {target} in {min(jobs, len(configs))} process(es) ...",
        file=sys.stderr,
        flush=True,
    )
    # On a card, each budget is searched less the safety margin (harness.cuda.margin): an answer
    # never needs the margin to fit. Rows keep the budget asked for.
    usable = {b: int(CARD_MARGIN.usable(b)) if target == "cuda" else b for b in budgets}
    asked = {searched: budget for budget, searched in usable.items()}
    rows = []
    for config, found in zip(
        configs, fit_configs(configs, target, list(usable.values()), axis, maximum, jobs),
        strict=True,
    ):  # fmt: skip
        for row in found["rows"]:
            budget = asked[int(row["budget_bytes"])]
            if target == "cuda":
                row = {
                    **row,
                    "budget_bytes": budget,
                    "safety_margin_bytes": budget - usable[budget],
                }
                if row.get("margin_bytes") is not None:  # what the answer leaves of the budget
                    row["margin_bytes"] += row["safety_margin_bytes"]
            rows.append(
                {
                    "model_size": config.model_size,
                    "dtype": config.dtype,
                    "strategy": config.strategy_text,
                    "axis": axis,
                    **row,
                    "max_tried": upper_bound(config, axis, maximum),
                    "config_seconds": found["seconds"],
                }
            )
    return pd.DataFrame(rows)
