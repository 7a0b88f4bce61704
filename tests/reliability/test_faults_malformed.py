"""Fault matrix, wire side: crafted frames and payloads on a static (pre-gRPC) source.

A raw PUB interleaves garbage with valid batches whose ground truth a detached simulator rank
knows. Every bad message is counted by kind and nothing crashes. Garbage that never consumes a
sequence number (bad frames) and bad events inside a good envelope leave the state exact; a
payload that cannot be decoded at all resets the member (its batch is unknown), never skipped.
"""

from __future__ import annotations

import os
from typing import Any

import msgspec

from tests.support.crafted import Oracle, RawPublisher, envelope
from tests.support.rig import eventually, rig, stored_after, subscribe, verify, wait_live

SEQ0 = (0).to_bytes(8, "big")


async def test_malformed_frames_and_events_are_counted_never_fatal() -> None:
    raw = RawPublisher(topic=b"kv")  # a topic prefix, so another topic is dropped
    oracle = Oracle()
    try:
        async with rig(
            [], static=(raw.spec(),), model="raw-model", kv_block_size=16, expected_blocks=65_536
        ) as r, r.channel() as ch:
            await wait_live(r.relay, 1)
            (sub,) = r.pool.subscribers.values()
            # ZMQ slow joiner: announce empty batches until the SUB sees one (the baseline)
            await raw.announce_until(lambda: sub.counters.batches > 0)
            consumer = await subscribe(r, ch)
            base_msgs = sub.counters.messages
            sent = 0

            async def valid(n: int, mixed: bool = False) -> None:
                nonlocal sent
                for _ in range(n):
                    await raw.send_payload(oracle.next_nonempty(mixed_hashes=mixed))
                    sent += 1

            async def frames(f: list[bytes]) -> None:
                nonlocal sent
                await raw.send(f)
                sent += 1

            async def payload(p: bytes) -> None:
                nonlocal sent
                await raw.send_payload(p)
                sent += 1

            await valid(5)
            seq = raw.seq.to_bytes(8, "big")
            ok = envelope([])
            # --- frame-level garbage (never consumes a sequence number)
            await frames([b"kv", seq])  # 2 frames
            await frames([b"kv", seq, ok, b"extra"])  # 4 frames
            await frames([b"kv"])
            await frames([b"kv", seq[:4], ok])  # short sequence
            await frames([b"kv", seq + b"\x00", ok])  # long sequence
            await frames([b"other-topic", seq, ok])  # does not start with "kv"
            await valid(3, mixed=True)  # int, negative-int and bytes hashes in one batch
            # unknown tags and a badly typed store inside a good envelope: skipped, rest applied
            # (a badly typed remove fails its batch: test_a_remove_that_does_not_decode_...)
            extra: list[Any] = [
                {"type": "KVCacheFutureEvent", "anything": [1, 2, 3]},
                ["ArrayFutureEvent", 7],
                {"type": "BlockStored", "block_hashes": "not-a-list", "block_size": 16},
            ]
            mixed = oracle.next_nonempty()
            obj = msgspec.msgpack.decode(mixed)
            obj[1] = extra[:2] + list(obj[1]) + extra[2:]
            await payload(msgspec.msgpack.encode(obj))
            # an oversized but valid batch: 60,000 removals of hashes nobody stored
            removals = [
                {"type": "BlockRemoved", "block_hashes": [h], "medium": "GPU"}
                for h in range(1, 60_001)
            ]
            await payload(envelope(removals))
            await valid(5)

            await eventually(
                lambda: sub.counters.messages >= base_msgs + sent, timeout=20,
                what="every crafted message seen",
            )
            c = sub.counters
            rej = c.rejections
            assert rej.get("frame_count", 0) == 3
            assert rej.get("seq_length", 0) == 2
            assert rej.get("topic_mismatch", 0) == 1
            assert c.unknown_tags >= 2 and c.malformed_events >= 1
            assert c.resets == 0 and r.pool.counters.member_resets == {}
            w = {"worker": "raw", "dp_rank": "0"}
            for kind, n in rej.items():
                assert r.metric("kvrelay_ingest_decode_rejections_total", kind=kind, **w) == n
            assert r.metric("kvrelay_ingest_decode_anomalies_total", kind="unknown_tags", **w) >= 2
            assert r.metric("kvrelay_pool_unknown_removals_total") >= 60_000
            assert sub.state == "live" and sub._task is not None and not sub._task.done()
            gen = r.pool.generation
            assert gen is not None and gen.pool.unknown_removals >= 60_000
            assert r.pool.counters.fences == 0
            await verify(r, consumer, truth={("raw", 0): oracle.truth()})
            assert consumer.end is None
            await consumer.stop()
    finally:
        raw.close()


async def test_undecodable_batches_reset_the_member_never_skipped() -> None:
    """A well-framed message whose payload cannot be decoded consumed a sequence number: whatever
    the engine did in that batch is unknown. Without a replay to re-fetch it from (a static
    source), the member is reset and continues after it — nothing phantom, every block stored
    after the last bad batch present, each bad batch counted."""
    raw = RawPublisher()
    oracle = Oracle()
    try:
        async with rig(
            [], static=(raw.spec(),), model="raw-model", kv_block_size=16, expected_blocks=65_536
        ) as r, r.channel() as ch:
            await wait_live(r.relay, 1)
            (sub,) = r.pool.subscribers.values()
            await raw.announce_until(lambda: sub.counters.batches > 0)
            consumer = await subscribe(r, ch)
            good = oracle.next_nonempty()
            bad = [
                b"\xc1",  # reserved msgpack byte
                os.urandom(256),
                good[: len(good) // 2],  # truncated
                msgspec.msgpack.encode({"ts": 1.0, "events": []}),  # not an envelope
                msgspec.msgpack.encode([1.0, "not-a-list", 0]),
                envelope([], dp_rank=5),  # another DP rank's batch
                os.urandom(4 << 20),  # 4 MiB of noise
            ]
            for p in bad:
                for _ in range(3):  # state to lose before each bad batch
                    await raw.send_payload(oracle.next_nonempty())
                await raw.send_payload(p)
            before = set(oracle.engine.held_blocks(0))  # what the last reset wiped
            for _ in range(8):
                await raw.send_payload(oracle.next_nonempty())
            resets = len(bad) - 1  # another rank's batch is dropped, not a bad batch
            await eventually(
                lambda: sub.counters.bad_batches == resets, timeout=20, what="bad batches seen"
            )
            rej = sub.counters.rejections
            # noise may happen to parse as msgpack: then it is a malformed envelope instead
            assert rej.get("malformed_payload", 0) >= 2  # 0xC1, truncated
            assert rej.get("malformed_envelope", 0) >= 2
            assert rej.get("malformed_payload", 0) + rej.get("malformed_envelope", 0) == 6
            assert rej.get("dp_rank_mismatch", 0) == 1
            assert sub.counters.resets_by_reason == {"bad_batch": resets}
            assert r.pool.counters.member_resets == {"bad_batch": resets}
            w = {"worker": "raw", "dp_rank": "0"}
            assert r.metric("kvrelay_ingest_member_resets_total", reason="bad_batch", **w) == resets
            assert sub.state == "live" and r.pool.counters.fences == 0
            await verify(
                r, consumer, exact=False, must_have=stored_after(oracle.engine, 0, before),
                truth={("raw", 0): oracle.truth()},
            )  # fmt: skip
            assert consumer.end is None
            await consumer.stop()
    finally:
        raw.close()
