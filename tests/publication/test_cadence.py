"""Pacing arithmetic (no clocks: times are given) and the held-delta cap."""

from __future__ import annotations

import pytest

from kvrelay.contract.limits import QUEUE_FRAME_OVERHEAD, LimitsError, RelayLimits
from kvrelay.publication import cbi1
from kvrelay.publication.cadence import Pacer, held_bucket_cap


def test_cheap_publications_are_never_held() -> None:
    p = Pacer(RelayLimits(publication_cpu_percent=10, publication_max_delay_s=0.005))
    assert p.wait(100.0, 100.0) == 0.0  # nothing published yet
    p.record(100.0, 100.0001)  # 0.1 ms: next cut allowed 0.9 ms later
    assert p.wait(100.0002, 100.0002) == pytest.approx(0.0008)
    assert p.wait(100.0011, 100.0005) == 0.0


def test_expensive_publications_are_spaced_to_the_share_but_capped() -> None:
    p = Pacer(RelayLimits(publication_cpu_percent=25, publication_max_delay_s=0.005))
    p.record(10.0, 10.001)  # 1 ms publishing at 25 %: 3 ms before the next cut
    assert p.wait(10.001, 10.001) == pytest.approx(0.003)
    assert p.wait(10.002, 10.001) == pytest.approx(0.002)
    p.record(20.0, 20.01)  # 10 ms: would be 30 ms, capped 5 ms after the first pending command
    assert p.wait(20.011, 20.011) == pytest.approx(0.005)
    assert p.wait(20.017, 20.011) == 0.0


def test_hundred_percent_never_waits() -> None:
    p = Pacer(RelayLimits(publication_cpu_percent=100))
    p.record(1.0, 2.0)
    assert p.wait(2.0, 2.0) == 0.0


def test_percent_bounds() -> None:
    with pytest.raises(LimitsError):
        RelayLimits(publication_cpu_percent=101)
    with pytest.raises(LimitsError):
        RelayLimits(publication_cpu_percent=0)


def test_held_bucket_cap_fits_a_full_queue_in_its_byte_bound() -> None:
    for lim in (RelayLimits(), RelayLimits(publication_queue_capacity=64),
                RelayLimits(publication_queue_capacity=1)):
        cap = held_bucket_cap(lim)
        frame = cbi1.delta_frame_len(cap) + QUEUE_FRAME_OVERHEAD
        assert 1 <= cap <= cbi1.MAX_DELTA_IMAGES
        assert frame * lim.publication_queue_capacity <= lim.publication_queue_bytes or (
            cap == cbi1.MAX_DELTA_IMAGES
        )
        if cap < cbi1.MAX_DELTA_IMAGES:  # and one more image would not fit
            bigger = cbi1.delta_frame_len(cap + 1) + QUEUE_FRAME_OVERHEAD
            assert bigger * lim.publication_queue_capacity > lim.publication_queue_bytes
