"""An optimizer swap's accuracy well below the spec's optimizer's is flagged as a possible
tuning artifact (``harness.analyse.tuning``), beside the trial in the report's table."""

from __future__ import annotations

import pandas as pd

from harness.analyse.tuning import optimizer_swap, tuning_note


def frame() -> pd.DataFrame:
    rows = [
        ("none", 0.95, 3e-3),
        ("checkpoint", 0.94, 3e-3),
        ("sgd", 0.31, 0.1),  # far below: flagged
        ("sgd_momentum:0.05+checkpoint", 0.93, 0.05),  # within the gap: not flagged
        ("adafactor", None, 0.01),  # no accuracy: nothing to say
    ]
    return pd.DataFrame(
        [{"strategy": s, "accuracy": a, "lr": lr, "status": "ok"} for s, a, lr in rows]
    )


def test_a_swap_far_below_the_spec_optimizer_is_flagged_with_its_learning_rate():
    trials = frame()
    notes = [tuning_note(row, trials) for _, row in trials.iterrows()]
    assert notes[:2] == [None, None]
    assert notes[2] == (
        "accuracy may be a tuning artifact: sgd trained at lr 0.1, untuned, 0.640 below the "
        "spec's optimizer; try sgd:LR with other rates"
    )
    assert notes[3] is None and notes[4] is None


def test_only_optimizer_strategies_count_as_swaps():
    assert optimizer_swap("sgd_momentum:0.05+checkpoint") == "sgd_momentum"
    assert optimizer_swap("checkpoint+accumulate:4") is None
    assert optimizer_swap(None) is None
    # a sweep of swaps only has no baseline to compare with
    swaps = frame().iloc[2:]
    assert all(tuning_note(row, swaps) is None for _, row in swaps.iterrows())
