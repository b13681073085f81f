"""The safety margin a card prediction carries (``harness.cuda.margin``): derived from the
recorded card run as re-predicted today, and held back from every card budget."""

from __future__ import annotations

import json

import pytest

from harness.cuda.margin import CARD_MARGIN, derive
from tests.conftest import REPO

REPREDICTED = REPO / "docs" / "gpu-validation" / "h200-2026-12-04-repredicted.json"


def test_the_shipped_margin_is_what_the_recorded_card_run_supports():
    trials = json.loads(REPREDICTED.read_text())["trials"]
    assert derive(trials, CARD_MARGIN.source) == CARD_MARGIN


def test_a_budget_is_held_back_by_the_larger_miss():
    small, large = 4 * 2**30, 80 * 2**30
    # A small card: the miss in bytes is the larger; a large one: the miss in proportion.
    assert CARD_MARGIN.of(small) == pytest.approx(
        max(CARD_MARGIN.miss_bytes, small - small / (1 + CARD_MARGIN.miss_fraction))
    )
    assert CARD_MARGIN.of(large) == pytest.approx(large - large / (1 + CARD_MARGIN.miss_fraction))
    # A prediction at the usable budget, off by the worst miss seen, still fits the card.
    for budget in (small, large):
        usable = CARD_MARGIN.usable(budget)
        assert usable + CARD_MARGIN.miss_bytes <= budget
        assert usable * (1 + CARD_MARGIN.miss_fraction) <= budget * (1 + 1e-12)


def test_derive_needs_a_trained_trial():
    with pytest.raises(ValueError, match="no trained trial"):
        derive([{"label": "x", "notes": ["no prediction"]}], "nothing")
