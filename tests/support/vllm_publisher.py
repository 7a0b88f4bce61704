"""Tiny test-local vLLM-style publisher: XPUB live stream + ROUTER replay (both reply shapes).

XPUB sends exactly like vLLM's PUB but also tells the test when a subscription has arrived, so
tests do not depend on sleeps to beat ZMQ's slow-joiner effect.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Callable

import zmq
import zmq.asyncio

from tests.support.timing import scaled

END = b"\xff" * 8


class TestPublisher:
    __test__ = False

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        *,
        topic: bytes = b"kv-events",
        replay: bool = True,
        reply_shape: int = 4,
        keep: int = 10_000,
        port: int | None = None,
        replay_port: int | None = None,
    ) -> None:
        """``port`` / ``replay_port``: bind these loopback ports (a DP rank's offsets) instead of
        random ones."""
        self.topic = topic
        self.reply_shape = reply_shape
        self.pub = ctx.socket(zmq.XPUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.setsockopt(zmq.SNDHWM, 100_000)
        if port is None:
            port = self.pub.bind_to_random_port("tcp://127.0.0.1")
        else:
            self.pub.bind(f"tcp://127.0.0.1:{port}")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.history: deque[tuple[int, bytes]] = deque(maxlen=keep)
        self.seq = 0
        self.requests: list[int] = []
        self.gate = asyncio.Event()
        self.gate.set()
        #: a replay stops after this many batches until ``mid`` is set (None: never); read when
        #: a request is received, so it pauses the requests that come after it is set, never one
        #: already taken (a request held at ``gate`` whose release the loop has not run yet)
        self.pause_after: int | None = None
        #: per reply to come, the batches it leaves out (a ROUTER past its send high-water mark
        #: drops what it cannot queue); each reply takes the first set
        self.reply_drops: deque[set[int]] = deque()
        self.mid = asyncio.Event()
        self.mid.set()
        self.router: zmq.asyncio.Socket | None = None
        self.replay_endpoint: str | None = None
        self._task: asyncio.Task[None] | None = None
        if replay:
            self.router = ctx.socket(zmq.ROUTER)
            self.router.setsockopt(zmq.LINGER, 0)
            if replay_port is None:
                replay_port = self.router.bind_to_random_port("tcp://127.0.0.1")
            else:
                self.router.bind(f"tcp://127.0.0.1:{replay_port}")
            self.replay_endpoint = f"tcp://127.0.0.1:{replay_port}"
            self._task = asyncio.create_task(self._serve())

    async def wait_subscribed(self, timeout: float = 5.0) -> None:
        frame = await asyncio.wait_for(self.pub.recv(), scaled(timeout))
        assert frame[:1] == b"\x01"

    async def publish(self, payload: bytes, *, live: bool = True) -> int:
        seq = self.seq
        self.seq += 1
        self.history.append((seq, payload))
        if live:
            await self.pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload])
        return seq

    async def send_raw(self, frames: list[bytes]) -> None:
        await self.pub.send_multipart(frames)

    def restart(self) -> None:
        """New engine incarnation: the sequence starts again at 0, history is gone."""
        self.seq = 0
        self.history.clear()

    async def _serve(self) -> None:
        assert self.router is not None
        while True:
            frames = await self.router.recv_multipart()
            if len(frames) != 3:
                continue  # vLLM logs and does not answer
            ident, _, start_b = frames
            start = int.from_bytes(start_b, "big")
            self.requests.append(start)
            await self._answer(ident, start, self.pause_after)

    async def _answer(self, ident: bytes, start: int, pause: int | None) -> None:
        """Answer one request before the next is taken (a subclass may answer on a task)."""
        await self._reply(ident, start, pause)

    async def _reply(self, ident: bytes, start: int, pause: int | None) -> None:
        """The batches from ``start`` (less the next ``reply_drops``), then the end marker;
        ``gate`` holds the reply, ``mid`` holds it after ``pause`` batches."""
        assert self.router is not None
        drops = self.reply_drops.popleft() if self.reply_drops else set()
        await self.gate.wait()
        lead = [ident, b""] + ([self.topic] if self.reply_shape == 4 else [])
        sent = 0
        for seq, payload in list(self.history):
            if seq >= start and seq not in drops:
                if sent == pause:
                    await self.mid.wait()
                await self.router.send_multipart([*lead, seq.to_bytes(8, "big"), payload])
                sent += 1
        end_lead = [ident, b""] + ([b""] if self.reply_shape == 4 else [])
        await self.router.send_multipart([*end_lead, END, b""])

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self.pub.close(linger=0)
        if self.router is not None:
            self.router.close(linger=0)


async def until(cond: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + scaled(timeout)
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.005)
