"""A ``vllm.Control`` server that answers what no engine would: a reply that does not decode, a
reply too large to decode on the event loop, parallelism no engine has, thousands of sources or
one rank twice. Each is a typed, counted failure of that engine's snapshot (unreachable, with the
reason), counted by kind, and its watcher goes on polling: real grpclib server on loopback, real
client. A reply whose length prefix claims gigabytes is refused before its body is read, and one
of many tiny entries is decoded off the event loop."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from typing import Any

import grpclib.const
import pytest
from grpclib.server import Server

from kvrelay._proto import vllm as vpb
from kvrelay.client.codec import RawCodec
from kvrelay.discovery.client import MAX_LIST_ENTRIES, MAX_PARALLEL, MAX_REPLY_BYTES, EngineClient
from kvrelay.discovery.errors import REFUSED
from kvrelay.discovery.watcher import EngineTarget, EngineWatcher


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
    "many_sources": {"GetKvEventSources": _sources(list(range(MAX_PARALLEL + 1)))},
    "same_rank_twice": {"GetKvEventSources": _sources([0, 0])},
    "many_aliases": {"GetModelInfo": bytes(vpb.ModelInfo(
        model_id="m", served_model_name="m",
        served_model_aliases=[f"a{i}" for i in range(MAX_LIST_ENTRIES + 1)]))},
}
KINDS = {"undecodable": "undecodable", "too_large": "too_large", "parallelism": "implausible",
         "many_sources": "implausible", "same_rank_twice": "implausible",
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
        await server.wait_closed()


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
        await server.wait_closed()


async def test_a_reply_of_many_tiny_entries_is_decoded_off_the_loop_and_refused() -> None:
    """ListLoras answering 1 MiB of empty adapters (half a million): decoding it on the event
    loop held the loop for three seconds and put every one in the catalog. It is decoded in a
    worker thread, refused as ``implausible`` (over ``MAX_LIST_ENTRIES``) and counted, and the
    snapshot goes on with the adapters unknown."""
    many = b"\x0a\x00" * (MAX_REPLY_BYTES // 2 - 8)

    async def loras(stream: Any) -> None:
        await stream.recv_message()
        await stream.send_message(many)

    server, port = await _serve({"ListLoras": loras})
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
            snap = await client.snapshot()
        assert snap.reachable, snap.error
        assert "loras" in snap.unknown and snap.loras == ()
        assert REFUSED["implausible"] == before + 1
        assert max(gaps) < 1.0, max(gaps)  # the loop kept turning (it stopped for ~3 s)
    finally:
        tick.cancel()
        server.close()
        await server.wait_closed()
