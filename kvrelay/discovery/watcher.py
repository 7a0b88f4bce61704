"""Periodic engine discovery: one asyncio task per engine, diffs snapshots into change events.

The callback (sync or async) receives events in a deterministic order per poll: reachability,
incarnation, removed sources, added sources, LoRAs, sleep, pause. A callback exception is logged
and counted, never kills the watcher. Diffs are always against the last *reachable* snapshot, so
an outage followed by a restart still reports ``IncarnationChanged``.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from kvrelay._aio import bounded, cancel_all, cancel_and_wait
from kvrelay.discovery.client import EngineClient
from kvrelay.discovery.endpoints import StaticSourceConfig, split_tcp, static_sources
from kvrelay.discovery.errors import InvalidEndpoint
from kvrelay.discovery.events import (
    ChangeEvent,
    EngineDiscovered,
    EngineReachable,
    EngineUnreachableEvent,
    EngineUpdated,
    IncarnationChanged,
    LorasChanged,
    PauseChanged,
    SleepChanged,
    SourcesAdded,
    SourcesRemoved,
)
from kvrelay.discovery.snapshot import EngineSnapshot
from kvrelay.logging import get_logger

_log = get_logger(__name__)

Callback = Callable[[ChangeEvent], Awaitable[None] | None]


@dataclass(frozen=True, slots=True)
class EngineTarget:
    """An engine to watch: gRPC frontend (``grpc_port``) and/or static sources (vLLM < 0.27)."""

    host: str
    grpc_port: int | None = None
    static: StaticSourceConfig | None = None

    def __post_init__(self) -> None:
        if self.grpc_port is None and self.static is None:
            raise ValueError("EngineTarget needs grpc_port or static sources")

    @property
    def name(self) -> str:
        if self.grpc_port is not None:
            return f"{self.host}:{self.grpc_port}"
        assert self.static is not None
        # Two pre-0.27 engines on one host differ only by their endpoint: keep both.
        return f"{self.host}/static/{self.static.endpoint}"


#: A ZMTP 3 peer's first bytes: 0xFF, eight bytes of padding, 0x7F (it sends them at once).
_ZMTP_SIGNATURE_BYTES = 10


async def _open_abstract(
    name: str,
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A connection to the Linux abstract socket ``name``, connected here (a Unix socket's
    connect does not wait): uvloop refuses an abstract path (``\\0name``) as an address."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.setblocking(False)
        sock.connect("\0" + name)
        return await asyncio.open_unix_connection(sock=sock)
    except BaseException:
        sock.close()
        raise


async def _alive(endpoint: str, host: str, timeout: float) -> str | None:
    """None if the static endpoint answers as a ZMQ socket does (TCP, or the Unix socket of an
    ``ipc://`` one, as vLLM binds either): it accepts the connection and sends the ZMTP
    signature; else the error text. A connect alone passed for a port that accepts and drops
    every connection (another service, a sidecar): such an engine was reachable for ever, or
    went down and back again, each time a new generation. Another transport libzmq reads
    (``inproc://``, ``pgm://``) has nothing to connect to here: its stream decides."""
    try:
        if endpoint.startswith("ipc://"):
            path = endpoint[len("ipc://") :]
            if path.startswith("@"):  # a Linux abstract socket (libzmq's spelling)
                connecting = _open_abstract(path[1:])
            else:
                connecting = asyncio.open_unix_connection(path)
        elif endpoint.startswith("tcp://"):
            h, port = split_tcp(endpoint)
            connecting = asyncio.open_connection(h.strip("[]") or host, port)
        else:
            return None
    except InvalidEndpoint as exc:
        return str(exc)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    try:
        r, w = await bounded(connecting, timeout)
    except (TimeoutError, OSError) as exc:
        return f"{endpoint}: {exc!r}"
    try:
        head = await bounded(r.readexactly(_ZMTP_SIGNATURE_BYTES), deadline - loop.time())
    except (TimeoutError, OSError, asyncio.IncompleteReadError) as exc:
        return f"{endpoint}: no ZMTP greeting ({type(exc).__name__}): not a ZMQ publisher"
    finally:
        w.close()
        with contextlib.suppress(OSError):
            await w.wait_closed()
    if head[0] != 0xFF or head[-1] != 0x7F:
        return f"{endpoint}: not a ZMQ publisher (its first bytes are not a ZMTP greeting)"
    return None


async def snapshot_target(
    target: EngineTarget, timeout: float, previous: EngineSnapshot | None = None
) -> EngineSnapshot:
    """One discovery pass for ``target`` (never raises for engine-side failures)."""
    if target.grpc_port is not None:
        async with EngineClient(target.host, target.grpc_port, timeout, target.static) as c:
            return await c.snapshot(previous)
    assert target.static is not None
    sources = static_sources(target.static, target.host)
    err = await _alive(sources[0].endpoint, target.host, timeout) if sources else None
    if err is not None:
        return EngineSnapshot(host=target.host, port=None, reachable=False, error=err)
    return EngineSnapshot(
        host=target.host,
        port=None,
        reachable=True,
        sources=sources,
        sources_via="static",
        data_parallel_size=len(sources),
    )


def diff_snapshots(
    target: str,
    prev_good: EngineSnapshot | None,
    prev: EngineSnapshot | None,
    cur: EngineSnapshot,
) -> list[ChangeEvent]:
    """Events turning the previous view into ``cur`` (pure function; unit-testable)."""
    if not cur.reachable:
        if prev is None or prev.reachable:
            return [EngineUnreachableEvent(target, cur, cur.error or "unreachable")]
        return []
    if prev_good is None:
        out: list[ChangeEvent] = [EngineDiscovered(target, cur)]
        if cur.sources:
            out.append(SourcesAdded(target, cur, cur.sources))
        return out
    out = []
    if prev is not None and not prev.reachable:
        out.append(EngineReachable(target, cur))
    if prev_good.instance_id != cur.instance_id:
        out.append(IncarnationChanged(target, cur, prev_good.instance_id, cur.instance_id))
    old = {s.key: s for s in prev_good.sources}
    new = {s.key: s for s in cur.sources}
    gone = tuple(s for k, s in old.items() if k not in new)
    added = tuple(s for k, s in new.items() if k not in old)
    if gone:
        out.append(SourcesRemoved(target, cur, gone))
    if added:
        out.append(SourcesAdded(target, cur, added))
    la, lb = prev_good.lora_names, cur.lora_names
    if la != lb:
        out.append(LorasChanged(target, cur, tuple(sorted(lb - la)), tuple(sorted(la - lb))))
    if prev_good.sleeping != cur.sleeping:
        out.append(SleepChanged(target, cur, cur.sleeping))
    if prev_good.paused != cur.paused:
        out.append(PauseChanged(target, cur, cur.paused))
    if not out and cur != prev_good:
        # what no event above names (a renamed model, another block size or model source, an
        # optional RPC failing or answering again): the snapshot is stored all the same
        out.append(EngineUpdated(target, cur))
    return out


class EngineWatcher:
    """Polls every target each ``interval`` seconds and reports changes to ``callback``."""

    def __init__(
        self,
        targets: list[EngineTarget],
        callback: Callback,
        interval: float = 5.0,
        timeout: float = 2.0,
    ) -> None:
        if interval <= 0 or timeout <= 0:
            raise ValueError("interval and timeout must be positive")
        self.callback = callback
        self.interval = interval
        self.timeout = timeout
        self.targets: dict[str, EngineTarget] = {t.name: t for t in targets}
        self.last: dict[str, EngineSnapshot] = {}
        self.last_good: dict[str, EngineSnapshot] = {}
        self.callback_errors = 0
        self.poll_errors = 0  # passes that raised (each retried at the next interval)
        self.polls = 0
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._started = False

    async def poll_once(self, name: str) -> list[ChangeEvent]:
        """Run one discovery pass for a target, deliver and return its events."""
        target = self.targets[name]
        snap = await snapshot_target(target, self.timeout, self.last_good.get(name))
        events = diff_snapshots(name, self.last_good.get(name), self.last.get(name), snap)
        self.polls += 1
        self.last[name] = snap
        if snap.reachable:
            self.last_good[name] = snap
        for ev in events:
            await self._deliver(ev)
        return events

    async def _deliver(self, ev: ChangeEvent) -> None:
        try:
            res = self.callback(ev)
            if inspect.isawaitable(res):
                await res
        except Exception:  # a consumer bug must not stop discovery
            self.callback_errors += 1
            _log.exception("discovery_callback_failed", change=type(ev).__name__)

    async def _loop(self, name: str) -> None:
        me = asyncio.current_task()
        while True:
            try:
                await self.poll_once(name)
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug must not end this engine's discovery for good
                self.poll_errors += 1
                _log.exception("discovery_poll_failed", target=name)
            if me is not None and me.cancelling():
                # a stop() arrived while polling and was swallowed on the way (Python 3.11's
                # wait_for can do that): honour it instead of polling forever
                raise asyncio.CancelledError
            await asyncio.sleep(self.interval)

    def start(self) -> None:
        self._started = True
        for name in self.targets:
            if name not in self._tasks:
                self._tasks[name] = asyncio.create_task(self._loop(name))

    def add_target(self, target: EngineTarget) -> None:
        """Watch one more engine (polled at once when the watcher runs)."""
        self.targets[target.name] = target
        if self._started and target.name not in self._tasks:
            self._tasks[target.name] = asyncio.create_task(self._loop(target.name))

    async def remove_target(self, name: str) -> None:
        task = self._tasks.pop(name, None)
        if task is not None:
            await cancel_and_wait(task)
        self.targets.pop(name, None)
        self.last.pop(name, None)
        self.last_good.pop(name, None)

    async def stop(self) -> None:
        self._started = False
        tasks = list(self._tasks.values())
        self._tasks.clear()
        await cancel_all(tasks)
