"""The 30-second soak (``make soak`` runs the same thing for 10 minutes): 64 subscribers, steady
traffic, flat RSS, no lag terminations, stable latency, subscriber 0 exact at the end."""

from __future__ import annotations

from tests.reliability.soak import run_soak


async def test_soak_30_seconds() -> None:
    res = await run_soak(30.0, rate=10.0, subscribers=64, log=False)
    assert res.ok, "; ".join(res.failures)
    assert res.subscribers == 64 and res.lag_terminations == 0 and res.streams_ended == 0
    assert res.deltas_received >= 64 * 100, "the soak did not exercise the fan-out"
    assert res.rss_last_mb <= res.rss_middle_mb * 1.10
