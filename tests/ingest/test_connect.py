"""Connect mode over real ZMQ: one bound SUB, publishers that connect, members by topic.

The oracle is the message list itself: each test publisher sends batches whose single remove
names ``(publisher, seq)``, so what the sink receives (and when it is reset) is checked against
exactly what was sent.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
import structlog
import zmq
import zmq.asyncio

from kvrelay.ingest.connect import ConnectSource, ConnectSpec
from kvrelay.ingest.counters import SubscriberCounters
from kvrelay.ingest.kinds import EngineKind
from kvrelay.ingest.sink import ResetReason, SourceKey
from kvrelay.ingest.topic_pattern import TopicPattern
from kvrelay.pool.batch import EventBatch
from tests.support import vllm_wire as W
from tests.support.timing import scaled
from tests.support.vllm_publisher import until

EPOCH = b"\x00sgl-kv-epoch="


class Sink:
    def __init__(self, refuse: frozenset[str] = frozenset()) -> None:
        self.refuse = refuse
        self.ids: dict[str, int] = {}
        self.log: list[tuple[str, Any]] = []

    def admit(self, engine: str, dp_rank: int) -> SourceKey | None:
        if engine in self.refuse:
            return None
        return SourceKey(self.ids.setdefault(engine, len(self.ids) + 1), dp_rank)

    def name(self, key: SourceKey) -> str:
        return next(n for n, i in self.ids.items() if i == key.worker_id)

    def on_batch(self, source: SourceKey, seq: int, batch: EventBatch) -> None:
        self.log.append(("batch", (self.name(source), source.dp_rank, seq,
                                   batch.ext_hashes.tolist())))  # fmt: skip

    def on_reset(self, source: SourceKey, reason: ResetReason) -> None:
        self.log.append(("reset", (self.name(source), source.dp_rank, reason)))

    def on_member_gone(self, source: SourceKey, counters: SubscriberCounters) -> None:
        self.log.append(("gone", (self.name(source), source.dp_rank, counters.batches)))

    def on_connect_failed(self, error: BaseException) -> None:
        self.log.append(("failed", repr(error)))

    def batches(self, name: str | None = None) -> list[tuple[str, int, int]]:
        return [v[:3] for k, v in self.log if k == "batch" and (name is None or v[0] == name)]

    def of(self, kind: str) -> list[Any]:
        return [v for k, v in self.log if k == kind]


def payload(tag: int, seq: int, dp: int | None = 0) -> bytes:
    """A batch whose content names its publisher and sequence."""
    return W.batch([W.removed("map", [tag * 1_000_000 + seq])], dp=dp)


class Pub:
    """A connecting publisher (XPUB: it sees the bound SUB's subscription arrive)."""

    def __init__(self, ctx: zmq.asyncio.Context, endpoint: str, topic: bytes) -> None:
        self.topic = topic
        self.sock = ctx.socket(zmq.XPUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.seq = 0

    async def ready(self) -> None:
        ms = int(scaled(5.0) * 1000)
        assert await self.sock.poll(ms), "the bound SUB's subscription never arrived"
        await self.sock.recv()

    async def send(
        self, body: bytes | None = None, *, seq: int | None = None, tag: int = 1,
        dp: int | None = 0, topic: bytes | None = None,
    ) -> int:  # fmt: skip
        s = self.seq if seq is None else seq
        self.seq = s + 1
        t = self.topic if topic is None else topic
        await self.sock.send_multipart([t, s.to_bytes(8, "big"), body or payload(tag, s, dp)])
        return s


@pytest.fixture
async def ctx() -> AsyncIterator[zmq.asyncio.Context]:
    c = zmq.asyncio.Context()
    yield c
    c.destroy(linger=0)


async def source(
    ctx: zmq.asyncio.Context,
    sink: Sink,
    pattern: str = "kv@{engine}@{model}",
    bind: str = "tcp://127.0.0.1:0",
    **kw: Any,
) -> ConnectSource:
    """A started connect source on ``bind`` (block size 4, model ``m`` unless given)."""
    spec = ConnectSpec(
        bind=(bind,), pattern=TopicPattern(pattern), kv_block_size=4,
        model=kw.pop("model", "m"), **kw,
    )  # fmt: skip
    src = ConnectSource(spec, sink, context=ctx)
    await src.start()
    return src


async def pub(ctx: zmq.asyncio.Context, src: ConnectSource, topic: bytes) -> Pub:
    p = Pub(ctx, src.endpoints[0], topic)
    await p.ready()
    return p


async def test_members_by_topic_each_with_its_own_sequence(ctx: zmq.asyncio.Context) -> None:
    sink = Sink()
    src = await source(ctx, sink)
    try:
        a = await pub(ctx, src, b"kv@10.0.0.1:8000@m")
        b = await pub(ctx, src, b"kv@pod-b@m")
        for _ in range(3):
            await a.send(tag=1)
            await b.send(tag=2)
        await b.send(tag=2, dp=1, seq=0)  # rank 1 of pod-b: its own sequence space
        await until(lambda: len(sink.batches()) == 7)
        assert sink.batches("10.0.0.1:8000") == [("10.0.0.1:8000", 0, s) for s in range(3)]
        assert sink.batches("pod-b") == [("pod-b", 0, 0), ("pod-b", 0, 1), ("pod-b", 0, 2),
                                         ("pod-b", 1, 0)]  # fmt: skip
        assert not sink.of("reset") and src.counters.members_added == 3
        assert sorted((k.dp_rank, n) for k, n, _ in src.members()) == [
            (0, "10.0.0.1:8000"), (0, "pod-b"), (1, "pod-b")]  # fmt: skip
    finally:
        await src.stop()


async def test_rank_from_the_topic(ctx: zmq.asyncio.Context) -> None:
    sink = Sink()
    src = await source(ctx, sink, "kv/{engine}/dp{rank}")
    try:
        p = await pub(ctx, src, b"kv/e1/dp3")
        await p.send(dp=3)
        # the batch names another rank than the topic that names the member: what it did is
        # unknown and the member's sequence moved past it (it was dropped with no reset: a
        # removal in it left a phantom for good), so the member is reset
        await p.send(dp=4)
        await p.send(dp=3)
        await until(lambda: len(sink.log) == 3)
        assert [kind for kind, _ in sink.log] == ["batch", "reset", "batch"]
        (counters,) = [c for _k, _n, c in src.members()]
        assert counters.rejections == {"dp_rank_mismatch": 1} and counters.bad_batches == 1
    finally:
        await src.stop()


async def test_gap_and_backwards_sequence_reset_the_member(ctx: zmq.asyncio.Context) -> None:
    sink = Sink()
    src = await source(ctx, sink)
    try:
        p = await pub(ctx, src, b"kv@e@m")
        for _ in range(3):
            await p.send()
        await p.send(seq=5)  # 3 and 4 lost: no replay, reset and go on from 5
        await p.send()
        await p.send(seq=0)  # the engine restarted
        await p.send()
        await until(lambda: len(sink.batches()) == 7)
        kinds = [(k, v[2]) for k, v in sink.log]
        assert kinds == [
            ("batch", 0), ("batch", 1), ("batch", 2), ("reset", ResetReason.GAP_NO_REPLAY),
            ("batch", 5), ("batch", 6), ("reset", ResetReason.INCARNATION), ("batch", 0),
            ("batch", 1),
        ]  # fmt: skip
        (c,) = [c for _k, _n, c in src.members()]
        assert c.gaps == 1 and c.resets_by_reason == {"gap_no_replay": 1, "incarnation": 1}
    finally:
        await src.stop()


async def test_first_message_late_counts_missing_history(ctx: zmq.asyncio.Context) -> None:
    sink = Sink()
    src = await source(ctx, sink)
    try:
        p = await pub(ctx, src, b"kv@late@m")
        await p.send(seq=40)
        await until(lambda: len(sink.batches()) == 1)
        (c,) = [c for _k, _n, c in src.members()]
        assert c.missing_history == 1 and c.resets == 0  # baseline, not a reset
    finally:
        await src.stop()


async def test_bad_topics_are_counted_and_dropped(ctx: zmq.asyncio.Context) -> None:
    sink = Sink(refuse=frozenset({"configured"}))
    src = await source(ctx, sink)
    try:
        p = await pub(ctx, src, b"kv@good@m")
        await p.send(topic=b"other@x@m")  # no "kv@" prefix: the SUB filters it (uncounted)
        await p.send(topic=b"kv@nomodel")  # the prefix matches, the pattern does not
        await p.send(topic=b"kv@@m")  # an empty engine: unmatched too
        await p.send(topic=b"kv@\xff\xfe@m")  # not UTF-8
        await p.send(topic=b"kv@ padded@m")  # an engine name with surrounding space
        await p.send(topic=b"kv@e@other-model")
        await p.send(topic=b"kv@configured@m")
        await p.sock.send_multipart([b"kv@good@m", b"\x00" * 7, payload(1, 0)])  # short seq
        await p.sock.send_multipart([b"kv@good@m", b"x"])  # 2 frames
        await p.send(seq=0)
        await until(lambda: len(sink.batches()) == 1)
        c = src.counters
        assert (c.topic_unmatched, c.topic_malformed, c.model_mismatch) == (2, 2, 1)
        assert c.members_refused == 1 and c.members_added == 1
        assert c.rejections == {"seq_length": 1, "frame_count": 1}
        assert c.messages == 9  # every message but the one with another prefix
    finally:
        await src.stop()


async def test_members_are_bounded(ctx: zmq.asyncio.Context) -> None:
    """A member past ``max_members`` is dropped, counted and said (an engine that leaves
    routing: it was only counted), at most once a period for the source."""
    sink = Sink()
    src = await source(ctx, sink, max_members=2)
    try:
        with structlog.testing.capture_logs() as logs:
            p = await pub(ctx, src, b"kv@a@m")
            await p.send(seq=0, topic=b"kv@a@m")
            await p.send(seq=0, topic=b"kv@b@m")
            await p.send(seq=0, topic=b"kv@c@m")  # a third member: counted, dropped
            await p.send(seq=0, topic=b"kv@d@m")  # a fourth: counted, in the next line
            await p.send(seq=1, topic=b"kv@a@m")  # known members go on
            await until(lambda: len(sink.batches()) == 3)
        assert {n for _k, n, _c in src.members()} == {"a", "b"}
        assert src.counters.members_over_limit == 2
        [line] = [x for x in logs if x["event"] == "connect_members_over_limit"]
        assert (line["engine"], line["limit"], line["dropped"]) == ("c", 2, 1)
    finally:
        await src.stop()


async def test_a_message_of_a_million_empty_frames_does_not_hold_the_loop(
    ctx: zmq.asyncio.Context,
) -> None:
    """One message of a topic frame and a million empty frames (2 bytes each on the wire, 2 MB
    in all, within ``max_batch_bytes``): every part was read on the event loop in one go, which
    held it for seconds at a few million frames. It is refused (``frame_count``) as before,
    and the loop runs between the parts it reads."""
    sink = Sink()
    src = await source(ctx, sink)
    gaps: list[float] = []
    loop = asyncio.get_running_loop()

    async def ticker() -> None:
        last = loop.time()
        while True:
            await asyncio.sleep(0)
            now = loop.time()
            gaps.append(now - last)
            last = now

    def send() -> None:  # (in a thread: sending a million parts holds its caller too)
        sync = zmq.Context()
        sock = sync.socket(zmq.XPUB)
        try:
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.connect(src.endpoints[0])
            assert sock.poll(int(scaled(5.0) * 1000)), "no subscription"
            sock.recv()
            sock.send_multipart([b"kv@a@m", *([b""] * 1_000_000)])
        finally:
            sock.close(linger=int(scaled(30.0) * 1000))
            sync.term()

    sending = asyncio.create_task(asyncio.to_thread(send))
    await asyncio.sleep(0)
    tick = asyncio.create_task(ticker())
    try:
        await until(lambda: src.counters.rejections.get("frame_count") == 1, timeout=60)
        await sending
        assert max(gaps) < scaled(0.25), max(gaps)
    finally:
        tick.cancel()
        await src.stop()


async def test_a_silent_member_is_removed(ctx: zmq.asyncio.Context) -> None:
    sink = Sink()
    silence = scaled(0.4)  # a busy machine's late wake-ups must not silence the busy member
    src = await source(ctx, sink, member_silence_s=silence)
    try:
        p = await pub(ctx, src, b"kv@quiet@m")
        q = await pub(ctx, src, b"kv@busy@m")
        await p.send()
        t0 = time.monotonic()
        while time.monotonic() - t0 < 2 * silence:
            await q.send()
            await asyncio.sleep(0.05)
        await until(lambda: sink.of("gone") == [("quiet", 0, 1)])
        assert {n for _k, n, _c in src.members()} == {"busy"}
        assert src.counters.members_expired == 1
        await p.send()  # it comes back: a new member, its first message the baseline
        await until(lambda: src.counters.members_added == 3)
    finally:
        await src.stop()


async def test_undecodable_payloads(ctx: zmq.asyncio.Context) -> None:
    sink = Sink()
    src = await source(ctx, sink)
    try:
        p = await pub(ctx, src, b"kv@e@m")
        await p.send()
        await p.send(body=W.batch([], dp=0)[:-1] + b"\xc1")  # rank unreadable: unattributed
        await p.send(seq=7)  # after it: a new baseline, not a gap
        await p.send(body=enc_bad_events())  # rank readable, events not: a bad batch
        await p.send()
        await until(lambda: len(sink.batches()) == 3)
        assert [k for k, _v in sink.log] == ["batch", "reset", "batch", "reset", "batch"]
        assert src.counters.unattributed == 1
        (c,) = [c for _k, _n, c in src.members()]
        assert c.bad_batches == 2 and c.gaps == 0
    finally:
        await src.stop()


async def test_deep_nesting_from_one_publisher_does_not_end_the_bound_sub(
    ctx: zmq.asyncio.Context,
) -> None:
    """Reading the rank of a topic without ``{rank}`` decoded the envelope with msgspec, which
    skips nested values recursively: one message nested 3,000 deep raised ``RecursionError``
    out of the message loop and ended the pool's one SUB (every engine of the pool stopped
    being read). It is an undecodable payload of that engine now: its members are reset."""
    sink = Sink()
    src = await source(ctx, sink)
    try:
        p = await pub(ctx, src, b"kv@e@m")
        await p.send()
        await p.send(body=b"\x93" + W.batch([], dp=0)[1:10] + b"\x91" * 3000 + b"\xc0\x00")
        await p.send()
        await until(lambda: len(sink.batches()) == 2)
        assert src.state == "live" and not sink.of("failed")
        assert [k for k, _v in sink.log] == ["batch", "reset", "batch"]
        assert src.counters.unattributed == 1
    finally:
        await src.stop()


def enc_bad_events() -> bytes:
    import msgspec

    return msgspec.msgpack.encode([1.0, 5, 0])  # events is not a list


async def test_sglang_epochs_in_connect_mode(ctx: zmq.asyncio.Context) -> None:
    sink = Sink()
    src = await source(ctx, sink, kind=EngineKind.SGLANG)
    try:
        p = await pub(ctx, src, b"kv@s@m" + EPOCH + b"e1")
        await p.send()
        await p.send()
        p.topic = b"kv@s@m" + EPOCH + b"e2"  # restarted, and its sequence happens to go on
        await p.send()
        await p.send(topic=b"kv@s@m" + EPOCH + b"e2\x00sgl-kv-snapshot=b1")  # a barrier
        await p.send(topic=b"kv@s@m" + EPOCH)  # an empty epoch: malformed
        await until(lambda: len(sink.batches()) == 4)
        assert [k for k, _v in sink.log] == ["batch", "batch", "reset", "batch", "batch"]
        (c,) = [c for _k, _n, c in src.members()]
        assert c.epoch_changes == 1 and src.counters.topic_malformed == 1
    finally:
        await src.stop()


async def test_bind_failure_raises(ctx: zmq.asyncio.Context) -> None:
    sink = Sink()
    src = await source(ctx, sink)
    try:
        taken = src.endpoints[0]
        other = ConnectSource(
            ConnectSpec(bind=(taken,), pattern=TopicPattern("{engine}"), kv_block_size=4),
            sink, context=ctx,
        )  # fmt: skip
        with pytest.raises(zmq.ZMQError):
            await other.start()
    finally:
        await src.stop()
