"""Several sweeps side by side: the same spec on two cards, before and after a change, two models.

The sweeps' trials go into one table with a ``sweep`` column naming each, and the Pareto
analysis (``harness.analyse.pareto``) groups by it: every front is normalised over the feasible
trials of all the sweeps together, so the hypervolumes share one reference point and compare
directly, and the dominance matrix says how much of each sweep's front another's dominates.
Beside the fronts, the configurations (model, size, batch, dtype, strategy) are matched across
the sweeps: for each one every sweep finished ``ok`` with its objectives measured, each sweep's
value over the first sweep's (``H100 / A100 throughput 2.1-2.7x``); the configurations one sweep
has and another lacks (or did not finish ``ok``) are listed apart.
"""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd

from harness.analyse.pareto import ParetoAnalysis, analyse, feasible
from harness.contract import AXES
from harness.metrics import Objective

SWEEP = "sweep"  # the column naming each compared sweep
CONFIG = ("model", *AXES)  # what makes two trials of different sweeps the same configuration
ABSENT = "absent"


@dataclass
class Comparison:
    labels: list[str]  # the sweeps, the first the baseline of every ratio
    objectives: list[Objective]
    frame: pd.DataFrame  # every trial of every sweep, ``sweep`` naming its own
    analysis: ParetoAnalysis  # grouped by ``sweep``
    matched: pd.DataFrame  # per configuration every sweep has: values, and ratios to the first
    missing: pd.DataFrame  # per configuration some sweep lacks: each sweep's status or "absent"

    def ratios(self) -> pd.DataFrame:
        """Per sweep after the first and objective: the range and median of its ratio to the
        first sweep over the matched configurations."""
        rows = []
        for label in self.labels[1:]:
            for objective in self.objectives:
                column = ratio_column(objective.metric, label, self.labels[0])
                values = self.matched[column].dropna()
                rows.append(
                    {
                        "sweep": label,
                        "versus": self.labels[0],
                        "metric": objective.metric,
                        "configs": len(values),
                        "min_ratio": values.min() if len(values) else None,
                        "median_ratio": values.median() if len(values) else None,
                        "max_ratio": values.max() if len(values) else None,
                    }
                )
        return pd.DataFrame(rows)

    def ratio_lines(self) -> list[str]:
        """``h100 / a100 throughput: 2.10-2.70x (median 2.40x) over 6 configurations``."""
        lines = []
        for row in self.ratios().to_dict("records"):
            name = f"{row['sweep']} / {row['versus']} {row['metric']}"
            if not row["configs"]:
                lines.append(f"{name}: no configuration in both")
                continue
            low, high = f"{row['min_ratio']:.2f}", f"{row['max_ratio']:.2f}"
            median = f"{row['median_ratio']:.2f}"
            span = f"{low}x" if low == high else f"{low}-{high}x (median {median}x)"
            plural = "s" if row["configs"] > 1 else ""
            lines.append(f"{name}: {span} over {row['configs']} configuration{plural}")
        return lines

    def dominance_lines(self) -> list[str]:
        """Which sweep's front dominates which, in words (shares of the other's front)."""
        lines = []
        for a, row in self.analysis.dominance.to_dict(orient="index").items():
            for b, share in row.items():
                if a != b and share > 0:
                    lines.append(f"{a}'s front dominates {share:.0%} of {b}'s")
        return lines or ["no sweep's front dominates any point of another's"]


def compare(
    sweeps: dict[str, pd.DataFrame],
    objectives: list[Objective],
    budget: float | None = None,
) -> Comparison:
    """Compare the sweeps' trial tables (``harness.results`` frames), labelled by the keys in
    order: the first is the baseline of every ratio."""
    if len(sweeps) < 2:
        raise ValueError("compare needs two sweeps or more")
    labels = list(sweeps)
    frame = pd.concat(
        [table.assign(**{SWEEP: label}) for label, table in sweeps.items()], ignore_index=True
    )
    analysis = analyse(frame, objectives, SWEEP, budget)
    metrics = [o.metric for o in objectives]
    keys = [c for c in CONFIG if c in frame]
    done = frame[feasible(frame, objectives, None)]  # matched whatever the budget
    per_sweep = {
        label: done[done[SWEEP] == label].drop_duplicates(keys).set_index(keys)[metrics]
        for label in labels
    }
    matched = pd.concat(
        {label: values for label, values in per_sweep.items()}, axis=1, join="inner"
    )
    out = pd.DataFrame(index=matched.index)
    for metric in metrics:
        for label in labels:
            out[f"{metric} {label}"] = matched[(label, metric)]
    for label in labels[1:]:
        for metric in metrics:
            column = ratio_column(metric, label, labels[0])
            out[column] = matched[(label, metric)] / matched[(labels[0], metric)]
    missing = _missing(frame, labels, keys, set(matched.index))
    return Comparison(labels, objectives, frame, analysis, out.reset_index(), missing)


def ratio_column(metric: str, label: str, baseline: str) -> str:
    """The matched table's column of ``label``'s ``metric`` over the baseline sweep's."""
    return f"{metric} {label}/{baseline}"


def _missing(
    frame: pd.DataFrame, labels: list[str], keys: list[str], matched: set[object]
) -> pd.DataFrame:
    """The configurations not matched in every sweep: each sweep's status there, or absent."""
    status = frame.drop_duplicates([*keys, SWEEP]).set_index([*keys, SWEEP])["status"]
    wide = status.unstack(SWEEP).reindex(columns=labels).fillna(ABSENT)
    return wide[[index not in matched for index in wide.index]].reset_index()
