"""Which trials are worth having: Pareto fronts, hypervolume, dominance, and budget advice.

Works on the results table (``harness.results.load``), one row per trial. A trial is
*feasible* when it finished ``ok``, has every objective, and its peak fits the memory budget
(the sweep's ``device_memory`` unless another is given). Fronts and hypervolumes are computed by
``moocore`` (non-dominated filtering and exact hypervolume, any number of objectives, mixed
directions); this module decides what goes in and how it is scaled.

Hypervolume is normalised so groups compare on one scale: each objective is mapped to [0, 1]
over the feasible trials of the whole sweep (0 = best seen, 1 = worst seen), the reference point
is 1.1 in every objective (10 % beyond the worst), and the volume is divided by the reference
box's (1.1^k). 1.0 would be one trial best in everything at once; a group's share says how much
of the sweep's best trade-off space its own front covers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import moocore
import numpy as np
import pandas as pd

from harness.analyse.noise import throughputs_tie
from harness.contract import AXES
from harness.metrics import DEFAULT_OBJECTIVES, METRICS, Objective
from harness.strategies.combination import recorded_names
from harness.units import format_bytes

REFERENCE = 1.1  # normalised reference point, per objective
MEMORY = "peak_allocated_bytes"


def feasible(frame: pd.DataFrame, objectives: list[Objective], budget: float | None) -> pd.Series:
    """``ok`` trials with every objective measured and, given a budget, a peak within it."""
    mask = frame["status"].eq("ok")
    for objective in objectives:
        mask &= frame[objective.metric].notna() if objective.metric in frame else False
    if budget is not None and MEMORY in frame:
        mask &= frame[MEMORY].le(budget).fillna(False)
    return mask.astype(bool)


def values(frame: pd.DataFrame, objectives: list[Objective]) -> np.ndarray:
    return frame[[o.metric for o in objectives]].to_numpy(dtype=float)


def non_dominated(frame: pd.DataFrame, objectives: list[Objective]) -> pd.Series:
    """True for rows no other row dominates (ties and duplicates of a front point stay in)."""
    if frame.empty:
        return pd.Series([], dtype=bool, index=frame.index)
    maximise = [o.maximise for o in objectives]
    keep = moocore.is_nondominated(values(frame, objectives), maximise=maximise, keep_weakly=True)
    return pd.Series(keep, index=frame.index)


def bounds(frame: pd.DataFrame, objectives: list[Objective]) -> tuple[np.ndarray, np.ndarray]:
    data = values(frame, objectives)
    return data.min(axis=0), data.max(axis=0)


def normalise(
    frame: pd.DataFrame, objectives: list[Objective], low: np.ndarray, high: np.ndarray
) -> np.ndarray:
    """Every objective to "smaller is better" in [0, 1]: 0 the best value seen, 1 the worst."""
    data = values(frame, objectives)
    span = np.where(high > low, high - low, 1.0)  # one value seen: it is the best, 0
    maximise = np.array([o.maximise for o in objectives])
    return np.where(maximise, high - data, data - low) / span


def hypervolume(points: np.ndarray) -> float:
    """Share of the reference box dominated by ``points`` (already normalised, minimised)."""
    if len(points) == 0:
        return 0.0
    k = points.shape[1]
    return float(moocore.hypervolume(points, ref=[REFERENCE] * k)) / REFERENCE**k


def dominates(a: np.ndarray, b: np.ndarray, equal: int | None = None) -> bool:
    """``a`` is no worse than ``b`` anywhere and better somewhere (both minimised); objective
    ``equal`` (an index) counted as equal in both (throughputs within noise)."""
    if equal is not None:
        a = a.copy()
        a[equal] = b[equal]
    return bool(np.all(a <= b) and np.any(a < b))


@dataclass(frozen=True)
class Front:
    """A front's normalised points and its trials' rows, in one order."""

    points: np.ndarray
    rows: pd.DataFrame


def dominated_share(front_a: Front, front_b: Front, objectives: list[Objective]) -> float:
    """Share of ``front_b``'s points that some point of ``front_a`` dominates, never by a
    throughput difference the noise rule cannot tell apart (``throughputs_tie``): such a pair
    counts as equal there, and dominance must come from another objective."""
    if len(front_b.points) == 0:
        return 0.0
    metrics = [o.metric for o in objectives]
    speed = metrics.index("throughput") if "throughput" in metrics else None
    rows_a = [row for _, row in front_a.rows.iterrows()]
    hit = 0
    for b, (_, row_b) in zip(front_b.points, front_b.rows.iterrows(), strict=True):
        hit += any(
            dominates(a, b, speed if speed is not None and throughputs_tie(row_a, row_b) else None)
            for a, row_a in zip(front_a.points, rows_a, strict=True)
        )
    return hit / len(front_b.points)


@dataclass
class ParetoAnalysis:
    objectives: list[Objective]
    by: str | None
    budget: float | None
    front: pd.DataFrame  # the overall front: feasible, non-dominated trials
    groups: pd.DataFrame  # per group: trials, feasible, front size, hypervolume
    dominance: pd.DataFrame  # row A, column B: share of B's front that A's front dominates
    feasible: pd.Series  # per trial of the input frame

    @property
    def reference(self) -> str:
        return (
            f"normalised per objective over the sweep's feasible trials (0 best, 1 worst); "
            f"reference point {REFERENCE} in each; 1.0 = everything best at once"
        )

    def front_table(self) -> pd.DataFrame:
        """The front's grid points and objective values, best in the first objective first."""
        columns = [*AXES, *[o.metric for o in self.objectives]]
        seen = [c for c in dict.fromkeys(columns) if c in self.front]
        ordered = self.front.sort_values(self.objectives[0].metric)
        return ordered[seen].reset_index(drop=True)

    def dominance_table(self) -> pd.DataFrame:
        """The dominance matrix in percent, for printing."""
        percent = (self.dominance * 100).round(0).astype(int).astype(str) + "%"
        return percent.reset_index().rename(columns={"front A": "front A dominates ->"})


# Columns that group a sweep's fronts under --by auto, in order of preference.
GROUPABLE = ("strategy", "dtype", "model_size", "batch_size")


def group_column(frame: pd.DataFrame, by: str) -> str | None:
    """``auto``: the first of strategy, dtype, model_size, batch_size that varies in the sweep;
    ``none``: no groups; else the column named."""
    if by == "none":
        return None
    if by != "auto":
        return by
    return next((c for c in GROUPABLE if c in frame and frame[c].nunique() > 1), None)


def analyse(
    frame: pd.DataFrame,
    objectives: list[Objective] | None = None,
    by: str | None = None,
    budget: float | None = None,
) -> ParetoAnalysis:
    """The overall front and, with ``by``, each group's front, hypervolume and dominance."""
    objectives = list(objectives or DEFAULT_OBJECTIVES)
    missing = [o.metric for o in objectives if o.metric not in frame.columns]
    if by is not None and by not in frame.columns:
        missing.append(by)
    if missing:
        raise ValueError(f"the results have no column {', '.join(map(repr, missing))}")
    ok = feasible(frame, objectives, budget)
    usable = frame[ok]
    front = usable[non_dominated(usable, objectives)] if not usable.empty else usable
    group_rows: list[dict[str, Any]] = []
    fronts: dict[str, Front] = {}
    if not usable.empty:
        low, high = bounds(usable, objectives)
        groups = [("all", frame)] if by is None else list(frame.groupby(by, sort=True))
        for name, members in groups:
            member_ok = members[ok.loc[members.index]]
            member_front = member_ok[non_dominated(member_ok, objectives)]
            points = normalise(member_front, objectives, low, high)
            fronts[str(name)] = Front(points, member_front)
            group_rows.append(
                {
                    "group": str(name),
                    "trials": len(members),
                    "feasible": len(member_ok),
                    "front_size": len(member_front),
                    "hypervolume": hypervolume(points),
                }
            )
    groups_frame = pd.DataFrame(
        group_rows, columns=["group", "trials", "feasible", "front_size", "hypervolume"]
    )
    names = list(fronts)
    dominance = pd.DataFrame(
        [[dominated_share(fronts[a], fronts[b], objectives) for b in names] for a in names],
        index=pd.Index(names, name="front A"),
        columns=pd.Index(names, name="dominates share of front B"),
    )
    return ParetoAnalysis(objectives, by, budget, front, groups_frame, dominance, ok)


def unusable(frame: pd.DataFrame, objectives: list[Objective]) -> str | None:
    """Why no trial of ``frame`` can be compared on ``objectives`` (one phrase, e.g. ``no trial
    finished ok (12 crash)``), or None when one can: finished ``ok`` with every objective
    measured. A decision, a plot or a page drawn from nothing would only look like an answer."""
    if frame.empty:
        return "no trial recorded yet"
    if feasible(frame, objectives, None).any():
        return None
    counts = frame["status"].value_counts()
    statuses = ", ".join(f"{n} {status}" for status, n in counts.items())
    ok = frame[frame["status"].eq("ok")]
    if ok.empty:
        return f"no trial finished ok ({statuses})"
    never = [o.metric for o in objectives if o.metric not in ok or ok[o.metric].isna().all()]
    if never:
        return f"none of its {len(ok)} ok trials measured {' or '.join(never)} ({statuses})"
    wanted = " and ".join(o.metric for o in objectives)
    return f"none of its {len(ok)} ok trials measured {wanted} together ({statuses})"


@dataclass(frozen=True)
class Ranking:
    """Trials best first for a recommendation, and which of them the objective could not tell
    apart (``tier``: equal numbers tie on the objective; 0 is the first place)."""

    trials: pd.DataFrame
    tier: pd.Series  # per row of ``trials``, same index
    objective: str

    def tied_in(self, top: int) -> bool:
        """Whether a tie on the objective decided the order of the first ``top`` trials."""
        shown = set(self.tier.iloc[:top])
        return bool(self.tier.isin(shown).sum() > len(shown))

    def tie_note(self, top: int) -> str | None:
        """The one line a table or page shows when ties decided its first ``top`` trials."""
        if not self.tied_in(top):
            return None
        by = "lower peak memory, then fewer strategies"
        by = f"accuracy, then {by}" if self.has_accuracy else by
        return f"throughputs within noise (their measured spreads overlap): ranked by {by}"

    @property
    def has_accuracy(self) -> bool:
        return "accuracy" in self.trials and bool(self.trials["accuracy"].notna().any())


def throughput_tiers(frame: pd.DataFrame) -> pd.Series:
    """Per trial, its place on throughput when differences within noise do not count (0 is
    the first place): the fastest leads tier 0 with every trial whose throughput interval
    overlaps its own (``throughputs_tie``: a noisy trial's is wider, by what its measured
    spread and the competition it met can explain); the fastest of the rest leads tier 1, and
    so on (judged against each tier's leader, so a chain of small steps never merges a clearly
    slower trial into the first place, and a trial 10x slower never competes for it whatever
    its flag). ``frame``: trials with a throughput, a unique index."""
    order = frame.assign(_memory=frame.get(MEMORY, 0.0)).sort_values(
        ["throughput", "_memory"], ascending=[False, True], kind="stable"
    )
    rows = list(order.iterrows())
    tiers: dict[Any, int] = {}
    tier = 0
    for index, leader in rows:
        if index in tiers:
            continue
        for other, row in rows:
            if other not in tiers and (other == index or throughputs_tie(leader, row)):
                tiers[other] = tier
        tier += 1
    return pd.Series(tiers, dtype=int).reindex(frame.index)


def strategy_terms(strategy: Any) -> int:
    """How much a configuration adds to plain training: its strategies (``none``: 0;
    ``checkpoint+accumulate:4``: 2). A tie on everything measured goes to the fewer: a
    strategy that changed nothing (checkpoint where the peak is in the optimizer step) only
    adds recomputation or code."""
    return len([name for name in recorded_names(strategy) if name != "none"])


def rank_within_noise(frame: pd.DataFrame) -> Ranking:
    """``frame``'s trials by throughput, best first, never by a difference the noise rule
    cannot tell apart: trials in one ``throughput_tiers`` tier are ranked by accuracy (higher
    first), then by peak memory (lower first), then by the fewer strategies
    (``strategy_terms``), then by throughput. Pure: the same trials give the same order."""
    if not frame.index.is_unique:
        frame = frame.reset_index(drop=True)
    tier = throughput_tiers(frame)
    keys = frame.assign(_tier=tier)
    by, ascending = ["_tier"], [True]
    if "strategy" in keys:
        keys = keys.assign(_terms=keys["strategy"].map(strategy_terms))
    for column, up in (
        ("accuracy", False),
        (MEMORY, True),
        ("_terms", True),
        ("throughput", False),
    ):
        if column in keys:
            by.append(column)
            ascending.append(up)
    ordered = keys.sort_values(by, ascending=ascending, na_position="last", kind="stable")
    trials = ordered.drop(columns=[c for c in ("_tier", "_terms") if c in ordered])
    return Ranking(trials, ordered["_tier"], "throughput")


# What ``recommend`` ranks by: throughput (within noise), or another quality or time to a
# target, each the way its metric is better (higher accuracy; lower loss, time, steps).
RANKABLE = (
    "throughput",
    "accuracy",
    "eval_loss",
    "perplexity",
    "time_to_target_s",
    "steps_to_target",
)


def rank_fits(frame: pd.DataFrame, budget: float, objective: str = "throughput") -> Ranking:
    """The ``ok`` trials whose measured peak fits ``budget``, best first: by throughput within
    noise (``rank_within_noise``) or by another metric the way it is better (ties: less
    memory). A trial without the metric (a target not reached: no ``time_to_target_s``) is
    left out, never ranked as if it had a value. Empty when nothing fits; the caller says
    so."""
    if objective not in frame.columns:
        raise ValueError(f"the results have no column {objective!r}")
    fits = frame[
        frame["status"].eq("ok") & frame[MEMORY].le(budget).fillna(False) & frame[objective].notna()
    ]
    if objective == "throughput":
        return rank_within_noise(fits)
    higher = METRICS[objective].better == "higher"
    ranked = fits.sort_values([objective, MEMORY], ascending=[not higher, True], kind="stable")
    return Ranking(ranked, pd.Series(range(len(ranked)), index=ranked.index), objective)


def recommend(
    frame: pd.DataFrame, budget: float, objective: str = "throughput", top: int = 2
) -> pd.DataFrame:
    """The best ``top`` of ``rank_fits``: throughputs within noise ranked by accuracy, then by
    less memory. Empty when nothing fits; the caller says so."""
    return rank_fits(frame, budget, objective).trials.head(top)


def best_per_budget(frame: pd.DataFrame) -> pd.DataFrame:
    """The sweep's answer to "which strategy for my memory?": for each budget at which the
    best measured configuration changes, that configuration (``rank_fits``: the fastest
    within noise, then accuracy, then less memory), with the budget in column ``budget``.
    The budgets tried are each strategy's smallest measured peak among the ``ok`` trials:
    from the least memory any strategy needs up to the point where a larger budget buys
    nothing more. Empty without an ``ok`` trial that has a peak and a throughput."""
    ok = frame[frame["status"].eq("ok") & frame[MEMORY].notna() & frame["throughput"].notna()]
    if ok.empty:
        return ok.assign(budget=pd.Series(dtype=float))
    chosen: list[Any] = []  # row labels of ok
    budgets: list[float] = []
    for budget in sorted(set(ok.groupby("strategy")[MEMORY].min())):
        ranked = rank_fits(ok, budget).trials
        if ranked.empty or (chosen and ranked.index[0] == chosen[-1]):
            continue
        chosen.append(ranked.index[0])
        budgets.append(float(budget))
    return ok.loc[chosen].assign(budget=budgets)


def gives_up(best: pd.Series, runner_up: pd.Series, objective: str, tied: bool = False) -> str:
    """What choosing the runner-up instead of the best costs and saves, in words. ``tied``:
    their throughputs are within noise, so the change in it is no measured difference, and the
    accuracy that ranked them is said too."""

    def change(metric: str) -> str:
        a, b = float(best[metric]), float(runner_up[metric])
        return f"{(b - a) / a:+.1%}" if a else "n/a"

    said = f"{objective} {change(objective)}"
    if tied:
        said += " (within noise)"
        a, b = best.get("accuracy"), runner_up.get("accuracy")
        if objective != "accuracy" and not (pd.isna(a) or pd.isna(b)):
            said += f", accuracy {float(b) - float(a):+.3f}"
    return (
        f"{said}, peak memory {change(MEMORY)} "
        f"({format_bytes(runner_up[MEMORY], short=True)} vs {format_bytes(best[MEMORY], short=True)})"
    )
