"""EngineWatcher against live simulated engines: restart, LoRA, sleep/pause, outages."""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import uvloop
import zmq
import zmq.asyncio

from kvrelay.discovery import (
    ChangeEvent,
    EngineDiscovered,
    EngineReachable,
    EngineTarget,
    EngineUnreachableEvent,
    EngineUpdated,
    EngineWatcher,
    IncarnationChanged,
    LorasChanged,
    PauseChanged,
    SleepChanged,
    SourcesAdded,
    SourcesRemoved,
    StaticSourceConfig,
)
from kvrelay.discovery.watcher import snapshot_target
from kvrelay.sim import SimConfig, SimEngine
from kvrelay.sim.ports import free_port_block


def kinds(evs: list[ChangeEvent]) -> list[type]:
    return [type(e) for e in evs]


async def test_watcher_detects_every_kind_of_change() -> None:
    eng = SimEngine(SimConfig(dp_size=2))
    await eng.start()
    got: list[ChangeEvent] = []
    w = EngineWatcher([EngineTarget("127.0.0.1", eng.grpc_port)], got.append, timeout=1.0)
    name = f"127.0.0.1:{eng.grpc_port}"
    returned: list[ChangeEvent] = []

    async def poll() -> list[ChangeEvent]:
        evs = await w.poll_once(name)
        returned.extend(evs)
        return evs

    try:
        evs = await poll()
        assert kinds(evs) == [EngineDiscovered, SourcesAdded]
        assert [s.dp_rank for s in evs[1].sources] == [0, 1]  # type: ignore[union-attr]
        assert await poll() == []  # steady state: nothing
        eng.load_lora("ad-1")
        (ev,) = await poll()
        assert isinstance(ev, LorasChanged) and ev.added == ("ad-1",) and ev.removed == ()
        eng.unload_lora("ad-1")
        eng.sleep()
        evs = await poll()
        assert kinds(evs) == [LorasChanged, SleepChanged]
        assert evs[0].removed == ("ad-1",) and evs[1].sleeping  # type: ignore[union-attr]
        eng.wake()
        eng.pause()
        evs = await poll()
        assert kinds(evs) == [SleepChanged, PauseChanged]
        eng.cfg = replace(eng.cfg, aliases=("al",), block_size=32)  # nothing above says so
        (ev,) = await poll()
        assert isinstance(ev, EngineUpdated)
        assert ev.snapshot.served_model_aliases == ("al",) and ev.snapshot.kv_block_size == 32
        assert await poll() == []
        old_id = eng.instance_id
        await eng.restart(rebind=True)  # ephemeral ports: sources move too
        evs = await poll()
        assert kinds(evs) == [IncarnationChanged, SourcesRemoved, SourcesAdded, PauseChanged]
        inc = evs[0]
        assert isinstance(inc, IncarnationChanged)
        assert (inc.old_instance_id, inc.new_instance_id) == (old_id, eng.instance_id)
        assert {s.endpoint for s in evs[2].sources} == {  # type: ignore[union-attr]
            p.endpoint for p in eng.publishers
        }
        assert got == returned and len(got) == 2 + 1 + 2 + 2 + 1 + 4  # callback saw all, in order
    finally:
        await eng.stop()


async def test_outage_then_restart_on_same_port() -> None:
    eng = SimEngine(SimConfig())
    await eng.start()
    port = eng.grpc_port
    w = EngineWatcher([EngineTarget("127.0.0.1", port)], lambda e: None, timeout=0.5)
    name = f"127.0.0.1:{port}"
    await w.poll_once(name)
    old_id = eng.instance_id
    await eng.stop()
    evs = await w.poll_once(name)
    assert kinds(evs) == [EngineUnreachableEvent]
    assert await w.poll_once(name) == []  # one event per outage
    eng2 = SimEngine(replace(eng.cfg, grpc_port=port, name="engine-0b"))
    await eng2.start()
    try:
        evs = await w.poll_once(name)
        assert kinds(evs)[:2] == [EngineReachable, IncarnationChanged]
        assert evs[1].old_instance_id == old_id  # type: ignore[union-attr]
        assert SourcesAdded in kinds(evs) and SourcesRemoved in kinds(evs)
    finally:
        await eng2.stop()


async def test_background_loop_and_callback_errors_are_contained() -> None:
    eng = SimEngine(SimConfig())
    await eng.start()
    seen: list[ChangeEvent] = []
    flipped = asyncio.Event()

    async def cb(ev: ChangeEvent) -> None:
        seen.append(ev)
        if isinstance(ev, EngineDiscovered):
            raise RuntimeError("consumer bug")
        if isinstance(ev, PauseChanged):
            flipped.set()

    w = EngineWatcher([EngineTarget("127.0.0.1", eng.grpc_port)], cb, interval=0.05, timeout=1.0)
    try:
        w.start()
        while not seen:
            await asyncio.sleep(0.02)
        eng.pause()
        await asyncio.wait_for(flipped.wait(), timeout=5)
        assert w.callback_errors == 1 and w.polls >= 2
    finally:
        await w.stop()
        await eng.stop()


async def test_static_target_without_grpc() -> None:
    base = free_port_block(4)
    eng = SimEngine(SimConfig(dp_size=2, pub_port=base, replay_port=base + 2, grpc_port=None))
    await eng.start()
    static = StaticSourceConfig(f"tcp://*:{base}", f"tcp://*:{base + 2}", dp_ranks=(0, 1))
    other = StaticSourceConfig(f"tcp://*:{base + 3}")  # a second pre-0.27 engine, same host
    targets = [EngineTarget("127.0.0.1", static=static), EngineTarget("127.0.0.1", static=other)]
    w = EngineWatcher(targets, lambda e: None, timeout=0.5)
    assert len(w.targets) == 2, "two static engines on one host must stay two targets"
    name = targets[0].name
    evs = await w.poll_once(name)
    assert kinds(evs) == [EngineDiscovered, SourcesAdded]
    assert [s.endpoint for s in evs[1].sources] == [  # type: ignore[union-attr]
        f"tcp://127.0.0.1:{base}",
        f"tcp://127.0.0.1:{base + 1}",
    ]
    await eng.stop()
    assert kinds(await w.poll_once(name)) == [EngineUnreachableEvent]


async def test_a_static_port_that_accepts_and_drops_is_no_engine() -> None:
    """A static engine's port taken by something that accepts each connection and drops it,
    or answers with bytes that are not ZMTP (another service, a sidecar): a connect alone
    passed the probe, so the engine was reachable for ever (never declared down), or went
    down and came back, a new generation each time. The probe waits for the ZMTP greeting a
    ZMQ socket sends at once."""
    answers = [b"", b"HTTP/1.1 400 Bad Request\r\n\r\n"]

    async def handler(_r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        w.write(answers[0])
        await w.drain()
        w.close()

    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    target = EngineTarget("127.0.0.1", static=StaticSourceConfig(f"tcp://127.0.0.1:{port}"))
    try:
        for answer, why in zip(answers, ("no ZMTP greeting", "not a ZMQ publisher"), strict=True):
            answers[0] = answer
            snap = await snapshot_target(target, 0.5)
            assert not snap.reachable and snap.error is not None and why in snap.error, snap
    finally:
        server.close()
        await server.wait_closed()


@pytest.mark.parametrize("run", [asyncio.run, uvloop.run], ids=["asyncio", "uvloop"])
def test_a_static_engine_on_an_abstract_socket_is_reachable(run: Any) -> None:
    """``ipc://@name`` is a Linux abstract socket (libzmq's spelling, read through libzmq): the
    probe connected to a file ``@name``, which never exists, and the engine was never reachable
    (its pool never published). On both loops the daemon may run (uvloop refuses an abstract
    path as an address)."""
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    endpoint = f"ipc://@kvrelay-test-{os.getpid()}-{id(pub)}"
    pub.bind(endpoint)
    target = EngineTarget("127.0.0.1", static=StaticSourceConfig(endpoint))
    try:
        snap = run(snapshot_target(target, 0.5))
        assert snap.reachable, snap.error
        pub.close(linger=0)
        time.sleep(0.1)
        assert not run(snapshot_target(target, 0.5)).reachable
    finally:
        pub.close(linger=0)
        ctx.term()


async def test_a_static_ipc_engine_is_probed_on_its_unix_socket(tmp_path: Path) -> None:
    """vLLM binds an ``ipc://`` endpoint as readily as a TCP one, and check-config takes it for a
    static engine, but the liveness probe split it as a TCP endpoint: the engine was never
    reachable, no source was ever subscribed, and the pool never published. The probe connects
    to the Unix socket."""
    ctx = zmq.asyncio.Context()
    pub = ctx.socket(zmq.PUB)
    endpoint = f"ipc://{tmp_path}/e0.pub"
    pub.bind(endpoint)
    target = EngineTarget("127.0.0.1", static=StaticSourceConfig(endpoint))
    w = EngineWatcher([target], lambda e: None, timeout=0.5)
    try:
        evs = await w.poll_once(target.name)
        assert kinds(evs) == [EngineDiscovered, SourcesAdded], evs
        assert [s.endpoint for s in evs[1].sources] == [endpoint]  # type: ignore[union-attr]
        pub.close(linger=0)
        await asyncio.sleep(0.1)
        (gone,) = await w.poll_once(target.name)
        assert isinstance(gone, EngineUnreachableEvent) and "e0.pub" in gone.error
    finally:
        pub.close(linger=0)
        ctx.destroy(linger=0)
