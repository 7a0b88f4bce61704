"""``tests/support/timing.py``: the deadline scale of every waiting test, bounded and settable."""

from __future__ import annotations

import pytest

from tests.support import timing


def test_a_set_slowdown_is_used_within_its_bounds(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(timing.ENV, "2.5")
    assert timing.slowdown() == 2.5 and timing.scaled(4.0) == 10.0
    monkeypatch.setenv(timing.ENV, "0.2")  # a fast machine keeps the written deadline
    assert timing.scaled(4.0) == 4.0
    monkeypatch.setenv(timing.ENV, "1000")
    assert timing.slowdown() == timing.MAX_SLOWDOWN


def test_the_measurement_is_bounded_and_cached() -> None:
    got = timing.measure()
    assert 1.0 <= got <= timing.MAX_SLOWDOWN
    timing.refresh_if_stale()
    first = timing.slowdown()
    timing.refresh_if_stale()  # not stale yet: the same factor
    assert timing.slowdown() == first
