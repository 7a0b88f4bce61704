"""A ``vllm.Control`` server that answers what no engine would: a reply that does not decode or
whose wire format is broken, parallelism no engine has, thousands of sources or one rank twice.
Each is a typed, counted failure of that engine's snapshot (unreachable, with the reason),
counted by kind, and its watcher goes on polling: real grpclib server on loopback, real client.
A reply whose length prefix claims gigabytes is refused before its body is read, and one of
hundreds of thousands of tiny fields from its wire format, before it is parsed."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from typing import Any

import grpclib.const
import pytest
from grpclib.server import Server

from kvrelay._aio import server_closed
from kvrelay._proto import vllm as vpb
from kvrelay.client.codec import RawCodec
from kvrelay.discovery.client import (
    FIELD_BUDGET,
    MAX_LIST_ENTRIES,
    MAX_PARALLEL,
    MAX_REPLY_BYTES,
    EngineClient,
)
from kvrelay.discovery.errors import REFUSED
from kvrelay.discovery.watcher import EngineTarget, EngineWatcher
from tests.support.timing import scaled


def _info(**par: int) -> bytes:
    p = {"data_parallel_size": 1, "data_parallel_size_local": 1} | par
    info = vpb.ServerInfo(engine_version="x", instance_id="inc-1", kv_block_size=16,
                          total_kv_blocks=1000, parallelism=vpb.ParallelismInfo(**p))  # fmt: skip
    return bytes(info)


def _sources(ranks: list[int]) -> bytes:
    return bytes(vpb.GetKvEventSourcesResponse(sources=[
        vpb.KvEventSource(transport="zmq", endpoint=f"tcp://127.0.0.1:{6000 + i}",
                          data_parallel_rank=r) for i, r in enumerate(ranks)]))  # fmt: skip


CASES: dict[str, dict[str, bytes]] = {
    "undecodable": {"GetServerInfo": b"\x1a\x02\xff\xfe"},  # instance_id: not UTF-8
    "too_large": {"GetServerInfo": _info() + b"\x0a\x00" * (MAX_REPLY_BYTES // 2 + 1)},
    "parallelism": {"GetServerInfo": _info(data_parallel_size_local=2**32 - 1)},
    "server_rank_at_limit": {"GetServerInfo": _info(data_parallel_rank=MAX_PARALLEL)},
    "many_sources": {"GetKvEventSources": _sources(list(range(MAX_PARALLEL + 1)))},
    "same_rank_twice": {"GetKvEventSources": _sources([0, 0])},
    "rank_out_of_range": {"GetKvEventSources": _sources([0, 2**32 - 1])},
    "many_aliases": {"GetModelInfo": bytes(vpb.ModelInfo(
        model_id="m", served_model_name="m",
        served_model_aliases=[f"a{i}" for i in range(MAX_LIST_ENTRIES + 1)]))},
    # broken wire format after a good ServerInfo (field 12 is not ServerInfo's): betterproto2
    # took each of these for a good reply, or stored what it could not convert as it came
    "tag_cut": {"GetServerInfo": _info() + b"\x80"},
    "length_past_end": {"GetServerInfo": _info() + b"\x62\x05ab"},
    "group": {"GetServerInfo": _info() + b"\x63\x64"},
    "wire_type_7": {"GetServerInfo": _info() + b"\x67"},
    "field_zero": {"GetServerInfo": _info() + b"\x00\x00"},
    "message_as_number": {"GetServerInfo": _info() + b"\x20\x05"},  # parallelism: 5
    "source_as_number": {"GetKvEventSources": b"\x08\x05"},
    "alias_as_number": {"GetModelInfo": b"\x0a\x01m\x12\x01m\x18\x05"},
}
KINDS = dict.fromkeys(CASES, "undecodable") | {
    "too_large": "too_large", "parallelism": "implausible", "many_sources": "implausible",
    "server_rank_at_limit": "implausible",
    "same_rank_twice": "implausible", "rank_out_of_range": "implausible",
    "many_aliases": "implausible"}  # fmt: skip


def _port(server: Server) -> int:
    listening = server._server
    assert isinstance(listening, asyncio.Server)
    return int(listening.sockets[0].getsockname()[1])


class _Control:
    def __init__(self, replies: dict[str, bytes]) -> None:
        self.replies = {"GetServerInfo": _info(),
                        "GetModelInfo": bytes(vpb.ModelInfo(model_id="m", served_model_name="m")),
                        "GetKvEventSources": _sources([0])} | replies  # fmt: skip

    def __mapping__(self) -> dict[str, grpclib.const.Handler]:
        def reply(name: str) -> Callable[[Any], Awaitable[None]]:
            async def handle(stream: Any) -> None:
                await stream.recv_message()
                await stream.send_message(self.replies.get(name, b""))

            return handle

        names = ("GetServerInfo", "GetModelInfo", "GetKvEventSources", "ListLoras",
                 "IsSleeping", "IsPaused")  # fmt: skip
        unary = grpclib.const.Cardinality.UNARY_UNARY
        return {f"/vllm.Control/{n}": grpclib.const.Handler(reply(n), unary, bytes, bytes)
                for n in names}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
async def test_a_hostile_control_reply_is_a_typed_failure_and_polling_goes_on(case: str) -> None:
    server = Server([_Control(CASES[case])], codec=RawCodec())
    await server.start("127.0.0.1", 0)
    port = _port(server)
    events: list[Any] = []
    before = dict(REFUSED)
    try:
        async with EngineClient("127.0.0.1", port) as client:
            snap = await client.snapshot()
        assert not snap.reachable and "INVALID_REPLY" in (snap.error or ""), snap.error
        assert REFUSED[KINDS[case]] == before[KINDS[case]] + 1
        w = EngineWatcher([EngineTarget("127.0.0.1", port)], events.append,
                          interval=0.05, timeout=2.0)  # fmt: skip
        w.start()
        for _ in range(200):
            if w.polls >= 3:
                break
            await asyncio.sleep(0.05)
        assert w.polls >= 3 and w.poll_errors == 0
        assert [type(e).__name__ for e in events] == ["EngineUnreachableEvent"]
        await w.stop()
    finally:
        server.close()
        await server_closed(server)


async def _serve(handlers: dict[str, Callable[[Any], Awaitable[None]]]) -> tuple[Server, int]:
    """A Control server answering ``handlers`` by method name, the rest as a good engine."""
    good = _Control({})
    unary = grpclib.const.Cardinality.UNARY_UNARY

    class _Svc:
        def __mapping__(self) -> dict[str, grpclib.const.Handler]:
            out = good.__mapping__()
            for n, h in handlers.items():
                out[f"/vllm.Control/{n}"] = grpclib.const.Handler(h, unary, bytes, bytes)
            return out

    server = Server([_Svc()], codec=RawCodec())
    await server.start("127.0.0.1", 0)
    return server, _port(server)


async def test_a_reply_claiming_gigabytes_is_refused_from_its_prefix() -> None:
    """A length prefix claiming 2 GiB, then data for as long as the client takes it: refused as
    ``too_large`` at once. grpclib's own reader buffered the body until the call's deadline
    (900 MiB in two seconds on loopback) before the size was looked at."""
    sent = 0

    async def claim(stream: Any) -> None:
        nonlocal sent
        await stream.recv_message()
        await stream.send_initial_metadata()
        await stream._stream.send_data((2**31 - 1).to_bytes(5, "big"))
        chunk = bytes(1 << 20)
        with contextlib.suppress(Exception):
            while sent < 2**31:
                await stream._stream.send_data(chunk)
                sent += len(chunk)

    server, port = await _serve({"GetServerInfo": claim})
    before = REFUSED["too_large"]
    try:
        t0 = time.monotonic()
        async with EngineClient("127.0.0.1", port, timeout=5.0) as client:
            snap = await client.snapshot()
        elapsed = time.monotonic() - t0
        assert not snap.reachable and "INVALID_REPLY" in (snap.error or ""), snap.error
        assert REFUSED["too_large"] == before + 1
        assert elapsed < 4.0, elapsed  # not the call's deadline
        await asyncio.sleep(0.2)
        assert sent <= 16 << 20, sent  # what flow control lets out, not what the prefix claims
    finally:
        server.close()
        await server_closed(server)


@pytest.mark.parametrize(
    ("method", "reply", "rpc"),
    [("ListLoras", b"\x08\x05", "loras"), ("IsSleeping", b"\x0f", "sleeping")],
    ids=["adapter_as_number", "wire_type_7"],
)
async def test_an_optional_reply_in_broken_wire_format_is_refused(
    method: str, reply: bytes, rpc: str
) -> None:
    """An adapter that is a number (betterproto2 kept the 5, and the snapshot then failed on it
    with an ``AttributeError``) and a field of wire type 7 (taken for ``sleeping=False``) are
    ``undecodable``, counted; the snapshot goes on with that value unknown."""

    async def answer(stream: Any) -> None:
        await stream.recv_message()
        await stream.send_message(reply)

    server, port = await _serve({method: answer})
    before = REFUSED["undecodable"]
    try:
        async with EngineClient("127.0.0.1", port) as client:
            snap = await client.snapshot()
        assert snap.reachable and snap.unknown == {rpc}, (snap.error, snap.unknown)
        assert REFUSED["undecodable"] == before + 1
    finally:
        server.close()
        await server_closed(server)


def _entries(field: int, inner: bytes, n: int) -> bytes:
    """``n`` entries in field ``field`` (length-delimited), each holding ``inner``."""
    length, size = bytearray(), len(inner)
    while size >= 0x80:
        length.append(size & 0x7F | 0x80)
        size >>= 7
    length.append(size)
    return (bytes([field << 3 | 2]) + bytes(length) + inner) * n


#: ~1 MiB replies of tiny fields: ``(method, reply, optional)``. ``optional``: the snapshot goes
#: on without the value (ListLoras) rather than failing.
TINY: dict[str, tuple[str, bytes, bool]] = {
    # half a million empty adapters: 2.2 s of CPU to parse, then refused for the count
    "empty_adapters": ("ListLoras", _entries(1, b"", MAX_REPLY_BYTES // 2 - 8), True),
    # five adapters of 100,000 unknown fields each (field 4, a varint): 1.8 s to parse
    "adapters_of_unknown_fields": ("ListLoras", _entries(1, b"\x20\x00" * 100_000, 5), True),
    "empty_aliases": ("GetModelInfo", _entries(3, b"", MAX_REPLY_BYTES // 2 - 8), False),
    # five sources of 100,000 empty unknown messages each (field 11): parsed, then taken for
    # sources without an endpoint (not even counted as a refusal)
    "sources_of_unknown_messages": (
        "GetKvEventSources", _entries(1, b"\x5a\x00" * 100_000, 5), False),
}  # fmt: skip


@pytest.mark.parametrize("case", list(TINY))
async def test_a_reply_of_many_tiny_fields_is_refused_before_it_is_parsed(case: str) -> None:
    """A reply under ``MAX_REPLY_BYTES`` made of hundreds of thousands of tiny entries, or of a
    few entries each holding 100,000 tiny unknown fields, cost seconds of CPU per poll to parse
    (in a worker thread, but holding the GIL: the event loop slowed with it), and was refused
    for its count only after. Its wire format is scanned first, at most ``FIELD_BUDGET``
    fields: refused as ``implausible`` and counted, in milliseconds, and the event loop keeps
    turning. Without ListLoras' answer the snapshot goes on with the adapters unknown."""
    method, reply, optional = TINY[case]
    assert len(reply) <= MAX_REPLY_BYTES

    async def answer(stream: Any) -> None:
        await stream.recv_message()
        await stream.send_message(reply)

    server, port = await _serve({method: answer})
    before = REFUSED["implausible"]
    gaps: list[float] = []

    async def ticker() -> None:
        while True:
            t = time.monotonic()
            await asyncio.sleep(0.01)
            gaps.append(time.monotonic() - t)

    tick = asyncio.ensure_future(ticker())
    try:
        async with EngineClient("127.0.0.1", port, timeout=30.0) as client:
            cpu = time.process_time()  # this process's, the worker thread and the server too
            snap = await client.snapshot()
            cpu = time.process_time() - cpu
        if optional:
            assert snap.reachable, snap.error
            assert "loras" in snap.unknown and snap.loras == ()
        else:
            assert not snap.reachable and "INVALID_REPLY" in (snap.error or ""), snap.error
        assert REFUSED["implausible"] == before + 1
        assert cpu < scaled(0.3), cpu  # ~0.03 s; parsing took 1.8 to 2.2 s
        assert max(gaps, default=0.0) < scaled(0.2), gaps
    finally:
        tick.cancel()
        server.close()
        await server_closed(server)


def _adapter(i: int) -> vpb.LoraAdapter:
    team = f"team-{i % 37}"
    return vpb.LoraAdapter(lora_id=i + 1, lora_name=f"{team}-sql-adapter-{i:05d}-v2",
                           source_path=f"/mnt/models/loras/{team}/{i:05d}/final")  # fmt: skip


async def test_replies_at_the_limits_are_accepted() -> None:
    """The largest replies a real engine sends pass the scan and are parsed whole:
    ``MAX_LIST_ENTRIES`` adapters with realistic names and paths (370 KB), as many aliases,
    and as many sources with every field set (the reply with the most fields there is)."""
    n = MAX_LIST_ENTRIES
    loras = bytes(vpb.ListLorasResponse(adapters=[_adapter(i) for i in range(n)]))
    model = bytes(vpb.ModelInfo(model_id="m", served_model_name="m",
                                served_model_aliases=[f"alias-{i:05d}" for i in range(n)]))
    sources = bytes(vpb.GetKvEventSourcesResponse(sources=[vpb.KvEventSource(
        transport="zmq", endpoint=f"tcp://127.0.0.1:{20000 + i}", topic="kv",
        replay_endpoint=f"tcp://127.0.0.1:{30000 + i}", data_parallel_rank=i, encoding="msgpack",
        schema_version=1, buffer_steps=10_000, hwm=100_000, max_queue_size=100_000)
        for i in range(n)]))  # fmt: skip
    assert max(len(loras), len(model), len(sources)) <= MAX_REPLY_BYTES

    def fixed(reply: bytes) -> Callable[[Any], Awaitable[None]]:
        async def answer(stream: Any) -> None:
            await stream.recv_message()
            await stream.send_message(reply)

        return answer

    server, port = await _serve({"ListLoras": fixed(loras), "GetModelInfo": fixed(model),
                                 "GetKvEventSources": fixed(sources)})  # fmt: skip
    before = dict(REFUSED)
    try:
        async with EngineClient("127.0.0.1", port, timeout=30.0) as client:
            snap = await client.snapshot()
        assert snap.reachable and not snap.unknown, (snap.error, snap.unknown)
        assert len(snap.loras) == n and snap.loras[-1].source_path == _adapter(n - 1).source_path
        assert len(snap.served_model_aliases) == n and len(snap.sources) == n
        assert snap.sources[-1].max_queue_size == 100_000
        assert before == REFUSED
        assert n * 11 < FIELD_BUDGET  # 4,096 sources of 10 fields, each with its own tag
    finally:
        server.close()
        await server_closed(server)


async def test_an_older_server_info_takes_its_local_ranks_from_its_sources() -> None:
    """``ParallelismInfo`` was renumbered: the older one has no field 7 (the local DP size), so a
    frontend of two local ranks read as one, and the serving-load plane's ``max_concurrency``
    counted half its slots. The ranks it publishes for are its local ones; a size it sends
    still wins."""
    older = vpb.ServerInfo(engine_version="x", instance_id="inc-1", kv_block_size=16,
                           total_kv_blocks=1000, max_running_requests=8,
                           parallelism=vpb.ParallelismInfo(data_parallel_size=4,
                                                           data_parallel_rank=2))  # fmt: skip
    for reply, want in ((bytes(older), 2), (_info(data_parallel_size_local=3), 3)):
        server = Server([_Control({"GetServerInfo": reply,
                                   "GetKvEventSources": _sources([2, 3])})], codec=RawCodec())
        await server.start("127.0.0.1", 0)
        try:
            async with EngineClient("127.0.0.1", _port(server)) as client:
                snap = await client.snapshot()
            assert snap.reachable, snap.error
            assert snap.data_parallel_size_local == want
        finally:
            server.close()
            await server_closed(server)


async def test_sources_as_a_released_frontend_may_send_them() -> None:
    """``GetKvEventSources`` fields the client must read as vLLM's server fills them: a source
    without ``data_parallel_rank`` takes its index in the list, a non-zmq transport is skipped,
    a wildcard host (``[::]`` too) becomes the host that reached the engine, an empty replay
    endpoint means no replay; and an empty list means events off (no sources, no fallback)."""
    listed = bytes(vpb.GetKvEventSourcesResponse(sources=[
        vpb.KvEventSource(transport="zmq", endpoint="tcp://*:5557", topic="kv",
                          replay_endpoint="tcp://[::]:5657"),
        vpb.KvEventSource(transport="nats", endpoint="tcp://*:5558"),
        vpb.KvEventSource(endpoint="tcp://0.0.0.0:5559", replay_endpoint=""),
    ]))  # fmt: skip
    for reply, want in ((listed, [(0, "tcp://127.0.0.1:5557", "tcp://127.0.0.1:5657", "kv"),
                                  (2, "tcp://127.0.0.1:5559", None, "")]),
                        (b"", [])):  # fmt: skip
        server = Server([_Control({"GetKvEventSources": reply})], codec=RawCodec())
        await server.start("127.0.0.1", 0)
        try:
            async with EngineClient("127.0.0.1", _port(server)) as client:
                snap = await client.snapshot()
            assert snap.reachable, snap.error
            assert snap.sources_via == "control"
            got = [(s.dp_rank, s.endpoint, s.replay_endpoint, s.topic) for s in snap.sources]
            assert got == want
        finally:
            server.close()
            await server_closed(server)


def _frame(kind: int, flags: int, payload: bytes = b"") -> bytes:
    return len(payload).to_bytes(3, "big") + bytes([kind, flags]) + bytes(4) + payload


FLOODS = [
    ("ping_flood", _frame(0x6, 0, bytes(8))),
    ("settings_flood", _frame(0x4, 0)),
    ("window_update_flood", _frame(0x8, 0, (1).to_bytes(4, "big"))),
]


@pytest.mark.parametrize(("flood", "one"), FLOODS)
async def test_a_control_server_flooding_frames_is_refused_and_the_loop_runs_on(
    flood: str, one: bytes
) -> None:
    """A raw HTTP/2 server that floods PING, SETTINGS or WINDOW_UPDATE frames and answers
    nothing. h2 acknowledged each and the loop spent seconds on them (a router on another
    connection got no delta for 4-9 s, nothing counted). The connection is now closed past a
    budget, before h2 reads the rest: the probe fails at once as a refused reply (``flood``),
    and the event loop, timed meanwhile, is never held long."""
    sent = 0

    async def serve(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        nonlocal sent
        blob = one * 4096
        with contextlib.suppress(ConnectionError):
            await r.readexactly(24)  # the client's preface
            w.write(_frame(0x4, 0))  # the server's SETTINGS
            while True:
                w.write(blob)
                sent += 4096
                await w.drain()

    srv = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    loop = asyncio.get_running_loop()
    worst = 0.0
    stop = asyncio.Event()

    async def tick() -> None:  # the loop's longest hold while the probe runs
        nonlocal worst
        while not stop.is_set():
            t0 = loop.time()
            await asyncio.sleep(0.005)
            worst = max(worst, loop.time() - t0 - 0.005)

    ticker = asyncio.ensure_future(tick())
    before = REFUSED["flood"]
    try:
        async with EngineClient("127.0.0.1", port, timeout=scaled(5)) as c:
            t0 = time.monotonic()
            with pytest.raises(Exception) as info:
                await c.server_info()
            took = time.monotonic() - t0
            assert getattr(info.value, "kind", None) == "flood", repr(info.value)
            assert flood in str(info.value) and c._channel.floods == {flood: 1}
    finally:
        stop.set()
        await ticker
        srv.close()
        await server_closed(srv)
    assert REFUSED["flood"] == before + 1
    assert took < scaled(2.0) and worst < scaled(0.5), (took, worst, sent)
