"""What the alerting rules need from ``/metrics``, scraped over real HTTP from a real relay and a
real mirror: every known reason of a by-reason counter from the start (at 0), and a mirror's
upstream session and channel resets.

Oracles: the lower layers' own lists of reasons (``ResetReason``, the pool's and the decoder's
error classes, the contract's ``RelayErrorReason``), the mirror's ``in_session``, and what the
test does to the upstream (closed under the mirror).
"""

from __future__ import annotations

import re
from pathlib import Path

from grpclib.client import Channel
from prometheus_client import CollectorRegistry

from kvrelay._proto.dynamo.kvrelay import v1 as pb
from kvrelay.contract.errors import reason_name
from kvrelay.ingest.errors import DecodeError
from kvrelay.ingest.sink import ResetReason
from kvrelay.mirror.settings import UpstreamAddress
from kvrelay.ops import metrics as relay_metrics
from kvrelay.ops.metrics import RelayMetrics
from kvrelay.ops.mirror_metrics import MirrorMetrics
from kvrelay.pool.errors import PoolError
from kvrelay.service.server import RelayServer
from kvrelay.sim.config import SimConfig
from tests.support.mem_relay import MemRelayView, sub_request
from tests.support.mirror_rig import UPSTREAM_LIMITS, mirrored
from tests.support.rig import collect_end
from tests.support.scrape import POOL, eventually, fleet_and_relay, scrape, value, wait_subscribed

REPO = Path(__file__).resolve().parents[2]


def _raised_kinds(base: type) -> set[str]:
    """The ``kind`` of every class that derives from ``base`` and has no subclass of its own."""
    out: set[str] = set()
    todo: list[type] = list(base.__subclasses__())
    while todo:
        cls = todo.pop()
        subs: list[type] = cls.__subclasses__()
        todo += subs
        if not subs:
            out.add(cls.kind)  # type: ignore[attr-defined]
    return out


REASONS = {reason_name(r) for r in pb.RelayErrorReason if r != pb.RelayErrorReason.UNSPECIFIED}


async def test_reason_counters_are_exported_at_zero_before_their_first_count() -> None:
    """Before, each by-reason series appeared at its first count, so ``increase()`` missed that
    count and a single lagging router or member reset never raised its alert."""
    async with fleet_and_relay([SimConfig(name="z0", seed=4, dp_size=1)]) as (
        _engines, relay, server,
    ):  # fmt: skip
        metrics = RelayMetrics(relay, CollectorRegistry())
        metrics.attach_service(server.service)
        port = await metrics.start_http("127.0.0.1", 0)
        try:
            await wait_subscribed(relay, 1)
            s = await scrape(port)
            member = {"pool": POOL, "worker": "z0", "dp_rank": "0"}
            for reason in {r.value for r in ResetReason}:
                assert value(s, "kvrelay_pool_member_resets_total", pool=POOL, reason=reason) == 0
            for kind in _raised_kinds(PoolError):
                assert value(s, "kvrelay_pool_errors_total", pool=POOL, kind=kind) == 0
            for kind in _raised_kinds(DecodeError):
                assert value(s, "kvrelay_ingest_decode_rejections_total", **member, kind=kind) == 0
            for reason in REASONS:
                assert value(s, "kvrelay_stream_errors_total", reason=reason) == 0
            # the first error of a reason moves its series from 0 to 1
            async with Channel("127.0.0.1", server.port) as ch:
                _m, end = await collect_end(
                    ch, "SubscribeKvPool", sub_request(None, marker=1), pb.FilterUpdate
                )
            first = end.trailers.get("kv-relay-error-reason")
            assert first in REASONS, end
            s2 = await scrape(port)
            assert value(s2, "kvrelay_stream_errors_total", reason=str(first)) == 1
        finally:
            await metrics.close()


def test_every_pool_reset_reason_the_relay_counts_is_exported_at_zero() -> None:
    """The pool's own reasons are string literals in relay/: each must be in the collector's list
    (one missing would appear only at its first count again)."""
    found: set[str] = set()
    call = re.compile(r"(?:\.reset|count_reset|_retire_members)\((?:\w+, )?\"(\w+)\"\)")
    for path in (REPO / "kvrelay" / "relay").glob("*.py"):
        found |= set(call.findall(path.read_text()))
    assert {"source_failed", "engine_down", "incarnation"} <= found  # the scan finds them
    assert found <= set(relay_metrics.POOL_RESET_REASONS), found - set(
        relay_metrics.POOL_RESET_REASONS
    )
    assert {r.value for r in ResetReason} <= set(relay_metrics.POOL_RESET_REASONS)


async def test_a_mirror_that_loses_its_upstream_says_so_on_its_page() -> None:
    """``kvrelay_mirror_synced`` stays 1 once a mirror synchronized; nothing said that it lost
    its upstream since, nor how often its upstream channel was reset."""
    from kvrelay.ops.mirror_metrics import in_session  # (what a worker's report holds too)

    view = MemRelayView(UPSTREAM_LIMITS)
    upstream = RelayServer(view, UPSTREAM_LIMITS)
    await upstream.start("127.0.0.1", 0)
    closed = False
    try:
        async with mirrored(UpstreamAddress(host="127.0.0.1", port=upstream.port)) as m:
            metrics = MirrorMetrics(m.mirror, CollectorRegistry())
            metrics.attach_service(m.server.service)
            port = await metrics.start_http("127.0.0.1", 0)
            try:
                s = await scrape(port)
                assert m.mirror.in_session and in_session(m.mirror.stats())
                assert value(s, "kvrelay_mirror_upstream_session", worker="") == 1
                assert value(s, "kvrelay_mirror_upstream_channel_resets_total", worker="") == 0
                for reason in REASONS:
                    assert value(s, "kvrelay_stream_errors_total", reason=reason) == 0
                await upstream.close(grace_s=0.5)
                closed = True
                await eventually(lambda: not m.mirror.in_session, what="session lost")
                await eventually(lambda: m.mirror.upstream.resets > 0, what="channel reset")
                assert not in_session(m.mirror.stats())
                s = await scrape(port)
                assert value(s, "kvrelay_mirror_synced", worker="") == 1  # as before
                assert value(s, "kvrelay_mirror_upstream_session", worker="") == 0
                assert value(s, "kvrelay_mirror_upstream_channel_resets_total", worker="") >= 1
            finally:
                await metrics.close()
    finally:
        if not closed:
            await upstream.close(grace_s=0.5)
