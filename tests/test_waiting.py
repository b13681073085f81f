"""The one clock wait: a condition re-checked until it holds, or a limit that names itself."""

from __future__ import annotations

import pytest

from harness.waiting import WaitTimeout, until


def test_until_returns_the_first_truthy_value_and_checks_at_once():
    answers = iter([0, None, "", "ready"])
    assert until(lambda: next(answers), every_s=0.001) == "ready"
    assert until(lambda: 7, every_s=60) == 7  # holds already: no wait


def test_until_gives_up_at_its_limit_naming_what_and_the_limit():
    checks = []
    with pytest.raises(WaitTimeout, match=r"the other workers after 0\.05 s"):
        until(lambda: checks.append(1), every_s=0.01, limit_s=0.05, what="the other workers")
    assert len(checks) >= 2  # checked again on the way, the last one at the limit
