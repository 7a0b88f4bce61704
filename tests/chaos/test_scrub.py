"""The online scrub on an injected corruption in a live relay (real sockets, the simulator's
ground truth as the oracle): a flipped filter word fences the generation and rebuilds its filter
from the exact state at once (sources go on, nothing replayed); a refcount that disagrees with
the lineage fences it and rebuilds from replay. Both are counted, logged and shown by the
gauges of the last full pass."""

from __future__ import annotations

import dataclasses

import grpclib.const
import numpy as np

from kvrelay.sim.config import SimConfig
from tests.pool.test_pool_vs_model import _pay, _set_pay, _used_slots
from tests.support.fleet import eventually, ground_truth, relay_view
from tests.support.rig import Rig, rig, subscribe, verify, wait_live

POOL = "ns/backend/generate"


def _exact(r: Rig) -> bool:
    if r.pool.generation is None:
        return False
    truth, view = ground_truth(r.engines), relay_view(r.relay)
    return all(view.get(k, set()) == v for k, v in truth.items())


async def test_a_flipped_filter_word_is_found_fenced_and_rebuilt_from_the_exact_state() -> None:
    async with rig([SimConfig(name="sc0", seed=601, dp_size=2)]) as r, r.channel() as ch:
        await wait_live(r.relay, 2)
        await r.engines[0].step(8)
        await eventually(lambda: _exact(r), what="exact")
        assert await r.relay.scrubber.scrub(r.pool) is None
        assert r.metric("kvrelay_pool_scrub_last_pass_ok", pool=POOL) == 1
        consumer = await subscribe(r, ch)
        old = r.pool.generation
        assert old is not None
        subs = dict(r.pool.subscribers)
        x = int(np.flatnonzero(old.pool.table)[0])
        old.pool.table[x] ^= np.uint64(1 << 3)  # a bit flip in RAM
        finding = await r.relay.scrubber.scrub(r.pool)
        assert finding is not None and not finding.exact_state
        new = r.pool.generation
        assert new is not None and new is not old and old.retired
        assert r.pool.counters.scrub_divergences == 1 and r.pool.counters.fences == 1
        assert r.metric("kvrelay_pool_scrub_last_pass_ok", pool=POOL) == 0
        assert r.metric("kvrelay_pool_scrub_divergences_total", pool=POOL) == 1
        assert r.pool.subscribers == subs and r.pool.counters.member_resets == {}
        end = await consumer.wait_end()
        assert end.status == grpclib.const.Status.UNAVAILABLE
        assert end.reason == "RELAY_ERROR_REASON_PUBLICATION_UNAVAILABLE"
        assert _exact(r), "rebuilt from the exact state at once"
        fresh = await subscribe(r, ch)
        await r.engines[0].step(3)
        await verify(r, fresh, probes=2_000)
        assert await r.relay.scrubber.scrub(r.pool) is None
        assert r.metric("kvrelay_pool_scrub_last_pass_ok", pool=POOL) == 1
        assert r.metric("kvrelay_pool_scrub_last_pass_age_seconds", pool=POOL) < 60
        await fresh.stop()


async def test_periodic_passes_find_an_exact_state_corruption_and_rebuild_from_replay() -> None:
    async with rig([SimConfig(name="sc1", seed=602, dp_size=1)]) as r:
        await wait_live(r.relay, 1)
        await r.engines[0].step(6)
        await eventually(lambda: _exact(r), what="exact")
        old = r.pool.generation
        assert old is not None
        tm, w = old.pool._own.tm, old.pool._own.w
        s = next(int(s) for s in _used_slots(tm, w) if _pay(tm, w, s) & 7 == 0)
        _set_pay(tm, w, s, _pay(tm, w, s) + np.uint64(1))  # a refcount the lineage does not have
        r.relay.settings = dataclasses.replace(r.relay.settings, scrub_interval_s=0.2)
        await eventually(lambda: r.pool.counters.scrub_divergences == 1, timeout=20,
                         what="a periodic pass finds it")  # fmt: skip
        await eventually(lambda: r.pool.generation not in (None, old), timeout=20,
                         what="rebuilt from replay")  # fmt: skip
        assert r.pool.counters.fences == 1
        await wait_live(r.relay, 1)
        await r.engines[0].step(2)
        await eventually(lambda: r.pool.counters.scrub_passes >= 2, timeout=20,
                         what="a clean pass of the rebuilt generation")  # fmt: skip
        await eventually(lambda: r.metric("kvrelay_pool_scrub_last_pass_ok", pool=POOL) == 1,
                         timeout=20, what="ok again")  # fmt: skip
        assert r.pool.counters.scrub_divergences == 1
