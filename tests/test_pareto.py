"""Pareto fronts, hypervolume and dominance against cases worked out by hand."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from harness.analyse.pareto import (
    Objective,
    analyse,
    dominated_share,
    gives_up,
    hypervolume,
    parse_objectives,
    recommend,
)

MIN_MIN = [Objective("peak_allocated_bytes", "minimize"), Objective("step_time_ms_p50", "minimize")]
MEM_SPEED = [Objective("peak_allocated_bytes", "minimize"), Objective("throughput", "maximize")]


def trials(rows, columns=("peak_allocated_bytes", "step_time_ms_p50"), **extra):
    frame = pd.DataFrame(rows, columns=list(columns))
    frame["status"] = extra.pop("status", "ok")
    frame["strategy"] = extra.pop("strategy", "none")
    frame["model_size"], frame["batch_size"], frame["dtype"] = "s", 8, "fp32"
    return frame


def front_points(analysis, columns):
    return sorted(map(tuple, analysis.front[list(columns)].to_numpy().tolist()))


def test_two_minimised_objectives_front_and_hypervolume():
    # C (3, 3) is dominated by B (2, 2); A, B, D trade off.
    analysis = analyse(trials([(1, 4), (2, 2), (3, 3), (4, 1)]), MIN_MIN, by=None)
    assert front_points(analysis, ["peak_allocated_bytes", "step_time_ms_p50"]) == [
        (1, 4),
        (2, 2),
        (4, 1),
    ]
    # Normalised to [0, 1] over x in [1, 4] and y in [1, 4]: A (0, 1), B (1/3, 1/3), D (1, 0);
    # reference 1.1: slabs 1/3 * 0.1 + 2/3 * (1.1 - 1/3) + 0.1 * 1.1, over the 1.1^2 box.
    expected = (1 / 30 + (2 / 3) * (1.1 - 1 / 3) + 0.11) / 1.21
    assert analysis.groups.loc[0, "hypervolume"] == pytest.approx(expected)
    assert analysis.groups.loc[0, "front_size"] == 3


def test_mixed_directions():
    # Less memory and more throughput are better: (2, 20) dominates (2, 15) and (3, 20).
    frame = trials(
        [(1, 10), (2, 20), (2, 15), (3, 20)], columns=("peak_allocated_bytes", "throughput")
    )
    analysis = analyse(frame, MEM_SPEED, by=None)
    assert front_points(analysis, ["peak_allocated_bytes", "throughput"]) == [(1, 10), (2, 20)]


def test_ties_and_duplicates():
    # Two identical trials are both on the front (neither dominates the other); a trial equal in
    # memory but slower is dominated.
    frame = trials([(1, 5), (1, 5), (1, 6), (2, 1)])
    analysis = analyse(frame, MIN_MIN, by=None)
    assert front_points(analysis, ["peak_allocated_bytes", "step_time_ms_p50"]) == [
        (1, 5),
        (1, 5),
        (2, 1),
    ]


def test_a_single_point_is_its_own_front_with_full_hypervolume():
    analysis = analyse(trials([(7, 3)]), MIN_MIN, by=None)
    assert len(analysis.front) == 1
    # Alone it is best in every objective: it dominates the whole reference box.
    assert analysis.groups.loc[0, "hypervolume"] == pytest.approx(1.0)


def test_hypervolume_of_nothing_is_zero():
    assert hypervolume(np.empty((0, 2))) == 0.0


def test_infeasible_and_over_budget_trials_are_not_on_the_front():
    frame = trials([(1, 9), (2, 2), (5, 1), (9, 9)])
    frame.loc[3, "status"] = "oom"
    analysis = analyse(frame, MIN_MIN, by=None, budget=4)
    assert front_points(analysis, ["peak_allocated_bytes", "step_time_ms_p50"]) == [
        (1, 9),
        (2, 2),
    ]
    assert analysis.feasible.tolist() == [True, True, False, False]


def test_per_group_fronts_and_pairwise_dominance():
    frame = trials([(1, 1), (3, 3), (2, 4), (4, 2)])
    frame["strategy"] = ["fast", "fast", "slow", "slow"]
    analysis = analyse(frame, MIN_MIN, by="strategy")
    groups = analysis.groups.set_index("group")
    assert groups.loc["fast", "front_size"] == 1  # (1, 1) dominates (3, 3)
    assert groups.loc["slow", "front_size"] == 2
    assert groups.loc["fast", "hypervolume"] == pytest.approx(1.0)  # best in both
    assert analysis.dominance.loc["fast", "slow"] == pytest.approx(1.0)
    assert analysis.dominance.loc["slow", "fast"] == pytest.approx(0.0)


def test_dominated_share_counts_strict_dominance_only():
    a = np.array([[0.0, 0.5]])
    b = np.array([[0.2, 0.6], [0.0, 0.5], [0.0, 0.4]])
    assert dominated_share(a, b) == pytest.approx(1 / 3)


def test_recommend_best_within_budget_and_what_the_runner_up_gives_up():
    frame = trials(
        [(10, 100.0), (20, 300.0), (15, 300.0), (50, 900.0)],
        columns=("peak_allocated_bytes", "throughput"),
    )
    ranked = recommend(frame, budget=30, objective="throughput")
    # 300 twice: the one with less memory first; 900 does not fit.
    assert ranked["peak_allocated_bytes"].tolist() == [15, 20]
    assert recommend(frame, budget=5).empty
    text = gives_up(ranked.iloc[0], frame.iloc[0], "throughput")
    assert text.startswith("throughput -66.7%, peak memory -33.3%")


def test_objectives_parse_and_complain():
    assert parse_objectives("peak_allocated_bytes:min,accuracy:max") == [
        Objective("peak_allocated_bytes", "minimize"),
        Objective("accuracy", "maximize"),
    ]
    with pytest.raises(ValueError, match="unknown metric 'acuracy'"):
        parse_objectives("acuracy:max")
    with pytest.raises(ValueError, match="give a direction"):
        parse_objectives("accuracy")
