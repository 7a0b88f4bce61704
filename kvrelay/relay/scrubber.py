"""Runs the online scrub (``pool/scrub.py``) of every pool: one full pass per pool every
``scrub_interval_s``, one bounded step per event-loop turn, so ingest and fan-out never wait for
more than one step. A pass whose generation is replaced meanwhile is abandoned (the next one
checks the new generation). The outcome goes to the pool (``PoolRuntime.on_scrubbed``: a
divergence fences the generation and rebuilds it), and the last full pass's time and result are
kept for the gauges."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence

from kvrelay.pool.scrub import Finding, ScrubPass
from kvrelay.relay.pool_runtime import PoolRuntime

__all__ = ["Scrubber"]


class Scrubber:
    def __init__(
        self, pools: Callable[[], Sequence[PoolRuntime]], interval: Callable[[], float]
    ) -> None:
        self._pools = pools
        self._interval = interval
        #: pool → (unix time of its last full pass, whether it found nothing wrong)
        self.last: dict[str, tuple[float, bool]] = {}
        self._since: dict[str, float] = {}  # pool → when its last pass started (or first seen)

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
        check, or the generation was replaced meanwhile)."""
        gen = p.generation
        if gen is None:
            return None
        sp = ScrubPass(gen.pool)
        while not sp.step():
            await asyncio.sleep(0)  # one bounded step per event-loop turn
            if p.generation is not gen:
                return None
        self.last[p.name] = (time.time(), sp.finding is None)
        p.on_scrubbed(gen, sp.finding)
        return sp.finding
