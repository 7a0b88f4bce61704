"""Which event loop the daemon and its fan-out workers run.

``auto`` (the default) runs uvloop where it is installed, as uvicorn's ``--loop auto`` does: the
relay's per-message work is short, so the loop's own overhead is a large share of its CPU at
light load, and uvloop's is lower. ``asyncio`` forces the standard loop; ``uvloop`` requires
the package (start-up fails without it).

Both also shorten how long another Python thread may keep the GIL while the loop waits for it
(:data:`GIL_SWITCH_INTERVAL_S`, 1 ms; CPython's default is 5 ms). The relay's threads do real Python
work: building a scrape's families and text, parsing engines' pages, a checkpoint's writer between
its reads and writes. A loop that wants the GIL back waits up to one interval each time, and more
than once while such a thread runs: at 64 pools, during one ``/metrics`` scrape the loop waited up
to 21.07 ms at 5 ms and 6.53 ms at 1 ms (``benchmarks/results/fleet_planes.json``). A switch is only
forced while another thread wants the GIL, so a relay without such work pays nothing.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable

LoopFactory = Callable[[], asyncio.AbstractEventLoop]

GIL_SWITCH_INTERVAL_S = 0.001


def tune_thread_switching() -> None:
    """Set the process's GIL switch interval to :data:`GIL_SWITCH_INTERVAL_S` (the daemon and
    each fan-out worker, before their loop starts)."""
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)


def loop_factory(name: str) -> LoopFactory | None:
    """The ``asyncio.Runner`` loop factory for ``relay.event_loop``; ``None`` is the standard
    loop. Raises ``ImportError`` for ``uvloop`` when it is not installed."""
    if name == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        if name == "uvloop":
            raise
        return None
    return uvloop.new_event_loop  # type: ignore[no-any-return]


def loop_name(loop: asyncio.AbstractEventLoop) -> str:
    """``uvloop`` or ``asyncio``: what a running loop is, for the start-up log line."""
    return "uvloop" if type(loop).__module__.startswith("uvloop") else "asyncio"
