"""Does the Optuna search find the frontier with a fraction of the grid? (issue 5's targets)

Replays the search against a recorded grid of real measurements
(``benchmarks/data/search_grid.csv``, 120 trials of ``experiments/search_grid.yaml``): the
harness's own ``SearchPlan`` asks the sampler, and each proposed point is told the recorded
result through the harness's own ``plan.tell`` (values + memory constraint), exactly as in a
sweep, only without training. Deterministic: seeded samplers, in-memory studies.

Hypervolume is ``harness.analyse.pareto``'s (normalised over the full grid's feasible trials, reference
1.1). Figures: the median over 10 seeds of the trials the default sampler (TPE) needs to reach
95 % of the full grid's hypervolume (target <= 40 % of the grid), and its median hypervolume at
that 40 % budget against random search's at the same count (target: higher). The curves go to
``results/bench/search_hypervolume.png``.
"""

from __future__ import annotations

import copy
import statistics
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pandas as pd
import yaml

from benchmarks.figures import Figure, at_most
from harness.analyse.pareto import bounds, feasible, hypervolume, normalise
from harness.metrics import DEFAULT_OBJECTIVES
from harness.spec import Spec, SweepPlan, parse_spec
from harness.sweep import plan
from harness.trial.result import Status, TrialResult

SPEC = Path("experiments/search_grid.yaml")
DATA = Path("benchmarks/data/search_grid.csv")
SEEDS = range(10)
SHARE = 0.40  # of the grid: the trial budget the search must reach 95 % within
TARGET = 0.95
AXES = ["model_size", "batch_size", "dtype", "strategy"]


def spec_with(sampler: str, seed: int, n_trials: int) -> Spec:
    data = yaml.safe_load(SPEC.read_text())
    data = copy.deepcopy(data)
    data["train"]["seed"] = seed
    data["search"] = {"method": "optuna", "sampler": sampler, "n_trials": n_trials}
    return parse_spec(data, str(SPEC))


def recorded_result(row: pd.Series) -> TrialResult:
    metrics = {
        name: float(row[name])
        for name in ("peak_allocated_bytes", "predicted_peak_bytes", "throughput", "accuracy")
        if pd.notna(row[name])
    }
    return TrialResult(row["trial_key"], Status(row["status"]), metrics=metrics)


def replay(table: pd.DataFrame, sampler: str, seed: int, n_trials: int) -> list[int]:
    """The table rows the search visits, in order (each at most once)."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    spec = spec_with(sampler, seed, n_trials)
    directions = [o.direction for o in spec.search.objectives]
    study = optuna.create_study(directions=directions, sampler=plan.make_sampler(spec, 0))
    index = {tuple(str(row[a]) for a in AXES): i for i, row in table.iterrows()}
    visited = []
    for trial, point, _ in plan.SearchPlan(study, SweepPlan(spec), set(), n_trials):
        row_index = index[tuple(str(point[a]) for a in AXES)]
        plan.tell(study, trial, spec, recorded_result(table.loc[row_index]), "replay")
        visited.append(row_index)
    return visited


def hypervolume_curve(table: pd.DataFrame, visited: list[int], budget: float) -> list[float]:
    objectives = list(DEFAULT_OBJECTIVES)
    ok = feasible(table, objectives, budget)
    low, high = bounds(table[ok], objectives)
    points = normalise(table, objectives, low, high)
    curve, seen = [], []
    for row_index in visited:
        if ok.loc[row_index]:
            seen.append(points[row_index])
        curve.append(hypervolume(np.array(seen)) if seen else 0.0)
    return curve


def run(log: Callable[[str], None]) -> list[Figure]:
    table = pd.read_csv(DATA)
    size = len(table)
    budget = float(spec_with("tpe", 0, 1).device_memory or 0) or None
    objectives = list(DEFAULT_OBJECTIVES)
    ok = feasible(table, objectives, budget)
    low, high = bounds(table[ok], objectives)
    full = hypervolume(normalise(table[ok], objectives, low, high))
    allowed = int(SHARE * size)
    log(f"search: replaying {size} recorded trials ({int(ok.sum())} feasible), full HV {full:.4f}")
    curves: dict[str, list[list[float]]] = {}
    for sampler in ("tpe", "random"):
        curves[sampler] = []
        for seed in SEEDS:
            visited = replay(table, sampler, seed, size if sampler == "tpe" else allowed)
            curves[sampler].append([v / full for v in hypervolume_curve(table, visited, budget)])
        log(f"  {sampler}: {len(SEEDS)} seeds replayed")
    needed = [
        next((n + 1 for n, share in enumerate(curve) if share >= TARGET), size)
        for curve in curves["tpe"]
    ]
    at_budget = {s: statistics.median(c[allowed - 1] for c in curves[s]) for s in curves}
    plot(curves, allowed, Path("results/bench/search_hypervolume.png"))
    log(
        f"  TPE reaches {TARGET:.0%} of the grid's hypervolume after {statistics.median(needed):g} "
        f"trials (median; per seed {needed}); at {allowed} trials TPE {at_budget['tpe']:.3f} vs "
        f"random {at_budget['random']:.3f} of the full hypervolume"
    )
    return [
        at_most(
            "search_trials_to_95pct_hypervolume_share",
            statistics.median(needed) / size,
            SHARE,
            "of grid",
            per_seed=needed,
            grid=size,
            sampler="tpe",
        ),
        Figure(
            "search_tpe_minus_random_hypervolume_at_40pct",
            at_budget["tpe"] - at_budget["random"],
            "> 0",
            at_budget["tpe"] > at_budget["random"],
            "of full HV",
            {"tpe": at_budget["tpe"], "random": at_budget["random"], "trials": allowed},
        ),
    ]


def plot(curves: dict[str, list[list[float]]], allowed: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 4.5))
    for sampler, runs in curves.items():
        length = min(len(r) for r in runs)
        data = np.array([r[:length] for r in runs])
        x = np.arange(1, length + 1)
        axis.plot(x, np.median(data, axis=0), label=f"{sampler} (median of {len(runs)} seeds)")
        axis.fill_between(x, data.min(axis=0), data.max(axis=0), alpha=0.2)
    axis.axhline(TARGET, color="black", linestyle=":", label=f"{TARGET:.0%} of the full grid")
    axis.axvline(allowed, color="grey", linestyle="--", label=f"{SHARE:.0%} of the grid")
    axis.set_xlabel("trials run")
    axis.set_ylabel("hypervolume / full grid's")
    axis.set_ylim(0, 1.05)
    axis.legend(fontsize=8)
    axis.grid(True, alpha=0.3)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
