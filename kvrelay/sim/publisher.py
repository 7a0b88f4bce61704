"""One DP rank's ZMQ publisher: PUB live stream + ROUTER replay, vLLM wire-compatible.

Live: ``[topic, seq8, payload]``. Replay (DEALER client): request ``[b"", start8]``; replies
``[b"", seq8, payload]`` (<= 0.25) or ``[b"", topic, seq8, payload]`` (>= 0.26), then the END
marker with seq 0xFF*8 and an empty payload. Malformed requests get no reply (counted). The replay
buffer keeps the last ``buffer_steps`` batches; older ones are silently dropped (as in vLLM).

``connect``: the PUB connects to that endpoint (rank offset applied) instead of binding, as the
engines do for an endpoint without a wildcard. It is an XPUB then (the same wire behaviour as a
PUB) so that tests can wait until the bound SUB's subscription has arrived (``wait_subscribed``):
a PUB drops what it sends before that. ``epoch``: SGLang's per-publisher epoch, appended
to the live topic frame after a NUL marker (replies keep the bare topic).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from dataclasses import dataclass

import zmq
import zmq.asyncio

from kvrelay._aio import cancel_and_wait
from kvrelay.sim.sglang_wire import EPOCH_MARKER
from kvrelay.sim.wire import END_SEQ, offset_endpoint, seq_bytes


@dataclass(slots=True)
class PublisherStats:
    published: int = 0
    dropped_live: int = 0  # deliberately not sent (drop_next)
    corrupted_live: int = 0  # sent with a garbled payload (corrupt_next)
    lost: int = 0  # dropped from live and replay
    replay_requests: int = 0
    replay_unanswered: int = 0  # requests dropped while the replay was muted
    invalid_replay_requests: int = 0


def _ipv6(endpoint: str) -> bool:
    """Whether ``endpoint`` names an IPv6 literal (``tcp://[::1]:5557``; ZMQ brackets them):
    libzmq reaches one only with ZMQ_IPV6 set, which vLLM sets for such a host."""
    return endpoint.startswith("tcp://") and "[" in endpoint


def _bind(sock: zmq.asyncio.Socket, endpoint: str, host_ip: str) -> str:
    """Bind like vLLM; ``tcp://*:0`` binds ``host_ip`` on an ephemeral port. Returns resolved."""
    _head, _, port = endpoint.rpartition(":")
    ephemeral = endpoint.startswith("tcp://") and port == "0"
    if ephemeral:
        endpoint = f"tcp://{host_ip}:0"
    sock.setsockopt(zmq.IPV6, int(_ipv6(endpoint)))
    sock.bind(endpoint)
    if not ephemeral:
        return endpoint
    last = sock.getsockopt(zmq.LAST_ENDPOINT)
    assert isinstance(last, bytes)
    return last.decode()


class RankPublisher:
    """Publisher for one DP rank. All methods run on the owning event loop."""

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        rank: int,
        endpoint: str,
        replay_endpoint: str | None,
        topic: str,
        buffer_steps: int,
        hwm: int,
        replay_frames: int,
        host_ip: str,
        connect: str | None = None,
        epoch: bytes | None = None,
    ) -> None:
        if replay_frames not in (3, 4):
            raise ValueError("replay_frames must be 3 (vLLM <= 0.25) or 4 (>= 0.26)")
        self.ctx = ctx
        self.rank = rank
        self.cfg_endpoint = offset_endpoint(endpoint, rank)
        self.cfg_replay = offset_endpoint(replay_endpoint, rank) if replay_endpoint else None
        self.topic = topic.encode()
        self.connect = offset_endpoint(connect, rank) if connect else None
        self.live_topic = self.topic
        self.set_epoch(epoch)
        self.buffer_steps = buffer_steps
        self.hwm = hwm
        self.replay_frames = replay_frames
        self.host_ip = host_ip
        self.seq = 0
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=max(buffer_steps, 1))
        self.stats = PublisherStats()
        self.endpoint = ""
        self.replay_endpoint = ""
        self._pub: zmq.asyncio.Socket | None = None
        self._router: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None
        self._drop: list[bool] = []  # queued drop decisions (keep_in_replay flag each)
        self._corrupt: list[bool] = []  # queued corruptions (replay keeps the good bytes flag)
        self.replay_muted = False  # a replay that takes requests and never answers (a hung engine)
        self.replay_delay_s = 0.0  # a slow replay: each answer starts this late (a busy engine)

    async def start(self) -> None:
        pub = self.ctx.socket(zmq.XPUB if self.connect else zmq.PUB)
        pub.setsockopt(zmq.LINGER, 0)
        pub.setsockopt(zmq.SNDHWM, self.hwm)
        if self.connect:
            # without ZMQ_IPV6 a connect to an IPv6 literal never connects, and says nothing
            pub.setsockopt(zmq.IPV6, int(_ipv6(self.connect)))
            pub.connect(self.connect)
            self.endpoint = self.connect
        else:
            self.endpoint = _bind(pub, self.cfg_endpoint, self.host_ip)
        self._pub = pub
        if self.cfg_replay:
            router = self.ctx.socket(zmq.ROUTER)
            router.setsockopt(zmq.LINGER, 0)
            router.setsockopt(zmq.SNDHWM, 2 * (self.buffer_steps + 1))
            self.replay_endpoint = _bind(router, self.cfg_replay, self.host_ip)
            self._router = router
            self._task = asyncio.create_task(self._serve_replay())

    async def close(self) -> None:
        if self._task is not None:
            await cancel_and_wait(self._task)
            self._task = None
        for s in (self._pub, self._router):
            if s is not None:
                s.close(linger=0)
        self._pub = self._router = None

    async def wait_subscribed(self, timeout: float = 10.0) -> None:
        """Connect mode: until the bound SUB's subscription has reached this publisher."""
        assert self._pub is not None and self.connect, "only a connecting publisher can tell"
        if not await self._pub.poll(int(timeout * 1000)):
            raise TimeoutError(f"no subscription from {self.connect} within {timeout} s")
        await self._pub.recv()

    def set_epoch(self, epoch: bytes | None) -> None:
        self.epoch = epoch
        self.live_topic = self.topic if epoch is None else self.topic + EPOCH_MARKER + epoch

    def reset(self, epoch: bytes | None = None) -> None:
        """New incarnation: sequence back to 0, replay history gone (and a new epoch)."""
        self.set_epoch(epoch)
        self.seq = 0
        self.buffer.clear()
        self._drop.clear()
        self._corrupt.clear()

    def drop_next(self, n: int, keep_in_replay: bool) -> None:
        self._drop.extend([keep_in_replay] * n)

    def corrupt_next(self, n: int, replay_good: bool) -> None:
        """Send the next ``n`` batches live with a payload that is not msgpack; the replay keeps
        the real bytes (``replay_good``: a corruption in transit) or the same garbage."""
        self._corrupt.extend([replay_good] * n)

    def publish(self, payload: bytes) -> int:
        """Assign the next seq and send (unless a drop is queued). Returns the seq used."""
        seq = self.seq
        self.seq += 1
        keep = True
        live = True
        sent = payload
        stored = payload
        if self._corrupt:
            replay_good = self._corrupt.pop(0)
            sent = b"\xc1" + payload  # 0xC1 is never valid msgpack
            stored = payload if replay_good else sent
            self.stats.corrupted_live += 1
        if self._drop:
            keep = self._drop.pop(0)
            live = False
            self.stats.dropped_live += 1
            if not keep:
                self.stats.lost += 1
        if live and self._pub is not None:
            # PUB never blocks: past SNDHWM ZeroMQ drops for slow subscribers, like vLLM
            with contextlib.suppress(zmq.Again):
                self._pub.send_multipart(
                    [self.live_topic, seq_bytes(seq), sent], flags=zmq.NOBLOCK
                )
            self.stats.published += 1
        if keep:
            self.buffer.append((seq, stored))
        return seq

    async def _serve_replay(self) -> None:
        router = self._router
        assert router is not None
        while True:
            frames = await router.recv_multipart()
            if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
                self.stats.invalid_replay_requests += 1
                continue
            self.stats.replay_requests += 1
            if self.replay_muted:
                self.stats.replay_unanswered += 1
                continue
            if self.replay_delay_s > 0:
                await asyncio.sleep(self.replay_delay_s)
            ident, start = frames[0], int.from_bytes(frames[2], "big")
            head = [ident, b""] + ([self.topic] if self.replay_frames == 4 else [])
            for seq, payload in list(self.buffer):
                if seq >= start:
                    await router.send_multipart([*head, seq_bytes(seq), payload])
            end_head = [ident, b""] + ([b""] if self.replay_frames == 4 else [])
            await router.send_multipart([*end_head, END_SEQ, b""])
