"""Where one engine message's CPU goes inside a running relay: per-stage thread CPU time.

A diagnostic of the benchmark's own relay process (``_relay_proc`` with ``KVR_BENCH_STAGES=1``):
SIGUSR2 wraps each stage below with a thread-CPU timer, the next SIGUSR2 removes the timers, and
the counters go into the relay's stats dump. Thread CPU time (not wall time) is what the relay
spends on a message whatever else runs on its core, so it is comparable with the process CPU a
benchmark reports. The timers cost two clock reads per wrapped call (about 1 µs); a run that
reports the relay's CPU has them off.

Stages nest: ``message`` contains ``decode`` and ``apply``; ``cut`` contains ``take`` and
``publish``, which contains ``send``. ``write`` is the socket write of a connection's buffered
frames, at the end of the loop iteration (after ``cut``). Reading the ZMQ socket and the event loop
itself are in no stage.
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Callable
from typing import Any

#: (stage, module, class, method), each looked up on its class at every call (a bound method an
#: event loop already holds, such as a reader callback, would not see a timer).
STAGES: tuple[tuple[str, str, str, str], ...] = (
    ("message", "kvrelay.ingest.subscriber", "Subscriber", "_on_live"),
    ("decode", "kvrelay.ingest.decoder", "Decoder", "decode"),
    ("apply", "kvrelay.pool.pool", "Pool", "apply"),
    ("cut", "kvrelay.relay.generation", "Generation", "flush"),
    ("take", "kvrelay.pool.pool", "Pool", "take_publication"),
    ("publish", "kvrelay.publication.hub", "PublicationHub", "publish"),
    ("send", "kvrelay.publication.hub", "Subscription", "_offer"),
    ("write", "grpclib.protocol", "Connection", "flush"),
)


class StageTimers:
    """Installs and removes the stage timers; ``summary`` gives calls and µs per call."""

    def __init__(self) -> None:
        self.calls: dict[str, int] = {s: 0 for s, *_ in STAGES}
        self.cpu_s: dict[str, float] = {s: 0.0 for s, *_ in STAGES}
        self._orig: list[tuple[type, str, Callable[..., Any]]] = []
        self.seconds = 0.0
        self._since = 0.0

    @property
    def on(self) -> bool:
        return bool(self._orig)

    def toggle(self) -> None:
        if self.on:
            self.remove()
        else:
            self.install()

    def install(self) -> None:
        for stage, mod, cls_name, meth in STAGES:
            cls = getattr(importlib.import_module(mod), cls_name)
            orig = getattr(cls, meth)
            self._orig.append((cls, meth, orig))
            setattr(cls, meth, self._timed(stage, orig))
        self._since = time.monotonic()

    def remove(self) -> None:
        for cls, meth, orig in reversed(self._orig):
            setattr(cls, meth, orig)
        self._orig.clear()
        self.seconds += time.monotonic() - self._since

    def _timed(self, stage: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        clock, calls, cpu = time.thread_time, self.calls, self.cpu_s

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                cpu[stage] += clock() - t0
                calls[stage] += 1

        return timed

    def summary(self) -> dict[str, Any]:
        return {
            "seconds": round(self.seconds, 2),
            "stages": {
                s: {"calls": self.calls[s],
                    "us_per_call": round(self.cpu_s[s] / self.calls[s] * 1e6, 1)
                    if self.calls[s] else None}
                for s, *_ in STAGES
            },
        }
