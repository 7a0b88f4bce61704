"""Which event loop the daemon and its fan-out workers run.

``auto`` (the default) runs uvloop where it is installed, as uvicorn's ``--loop auto`` does: the
relay's per-message work is short, so the loop's own overhead is a large share of its CPU at
light load, and uvloop's is lower. ``asyncio`` forces the standard loop; ``uvloop`` requires
the package (start-up fails without it).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

LoopFactory = Callable[[], asyncio.AbstractEventLoop]


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
