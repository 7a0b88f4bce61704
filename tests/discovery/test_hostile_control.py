"""A ``vllm.Control`` server that answers what no engine would: a reply that does not decode, a
reply too large to decode on the event loop, parallelism no engine has, thousands of sources or
one rank twice. Each is a typed, counted failure of that engine's snapshot (unreachable, with the
reason), and its watcher goes on polling: real grpclib server on loopback, real client."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import grpclib.const
import pytest
from grpclib.server import Server

from kvrelay._proto import vllm as vpb
from kvrelay.client.codec import RawCodec
from kvrelay.discovery.client import MAX_PARALLEL, MAX_REPLY_BYTES, EngineClient
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
}


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
    port = server._server.sockets[0].getsockname()[1]
    events: list[Any] = []
    try:
        async with EngineClient("127.0.0.1", port) as client:
            snap = await client.snapshot()
        assert not snap.reachable and "INVALID_REPLY" in (snap.error or ""), snap.error
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
