"""Runs the online scrub (``pool/scrub.py``) of every pool: one full pass per pool every
``scrub_interval_s``.

A pass needs one consistent state of the pool while ingest goes on. The relay forks between two
batches (``relay/forked.py``) and the child runs the pass, in bounded steps, over its frozen
copy-on-write image of the pool: the event loop pays for the fork only, never for the pass nor
for a copy of the state, and memory grows only by the pages ingest writes meanwhile. The child
reports what it found; a pass whose generation was replaced meanwhile is dropped (the next one
checks the new generation). The finding goes to the pool (``PoolRuntime.on_scrubbed``: a
divergence fences the generation and rebuilds it), and the last full pass's time and result are
kept for the gauges."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Sequence

from kvrelay.logging import get_logger
from kvrelay.pool.scrub import Finding, ScrubPass
from kvrelay.relay.forked import Child
from kvrelay.relay.pool_runtime import PoolRuntime

__all__ = ["Scrubber"]

_log = get_logger(__name__)


class Scrubber:
    def __init__(
        self, pools: Callable[[], Sequence[PoolRuntime]], interval: Callable[[], float]
    ) -> None:
        self._pools = pools
        self._interval = interval
        #: pool → (unix time of its last full pass, whether it found nothing wrong)
        self.last: dict[str, tuple[float, bool]] = {}
        self._since: dict[str, float] = {}  # pool → when its last pass started (or first seen)

    def keep_only(self, names: set[str]) -> None:
        """Forget the pools not in ``names`` (removed by a reload): their entries, and the
        scrub gauges exported from them, would otherwise stay for the relay's life."""
        for d in (self.last, self._since):
            for name in [n for n in d if n not in names]:
                del d[name]

    async def run(self) -> None:
        while True:
            interval = self._interval()
            if interval <= 0:
                await asyncio.sleep(1.0)
                continue
            now = time.monotonic()
            for p in list(self._pools()):
                if now - self._since.setdefault(p.name, now) >= interval:
                    self._since[p.name] = now
                    await self.scrub(p)
            await asyncio.sleep(min(1.0, interval))

    async def scrub(self, p: PoolRuntime) -> Finding | None:
        """One full pass over ``p``'s current generation (None: nothing found, or nothing to
        check, or the generation was replaced meanwhile, or the pass itself failed: logged)."""
        gen = p.generation
        if gen is None:
            return None
        pool = gen.pool

        def work() -> str:
            f = ScrubPass(pool, copy=False).run()
            return json.dumps(None if f is None else [f.why, f.exact_state])

        try:
            child = Child(work)
        except OSError as exc:  # no fork (EAGAIN, ENOMEM): the next pass tries again
            _log.error("scrub_failed", pool=p.name, error=str(exc))
            return None
        try:
            ok, text = await asyncio.shield(child.done)
        except asyncio.CancelledError:  # the relay stops: the pass goes with it
            child.kill()
            raise
        if not ok:
            _log.error("scrub_failed", pool=p.name, error=text)
            return None
        if p.generation is not gen:
            return None
        raw = json.loads(text)
        finding = None if raw is None else Finding(str(raw[0]), bool(raw[1]))
        self.last[p.name] = (time.time(), finding is None)
        p.on_scrubbed(gen, finding)
        return finding
