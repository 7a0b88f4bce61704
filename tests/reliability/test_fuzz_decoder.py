"""Fuzzing the frame checks + msgpack decoder, directly and through a live subscriber.

Contract (ingest/decoder.py): ``decode`` returns a batch or raises a ``DecodeError`` subclass,
nothing else, and a returned batch is well-formed enough for the pool to apply without error or
invariant violation. Over a real socket: no crafted message stops the ingest loop, and after a
reset the state is again exactly the simulator's ground truth.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvrelay.ingest.decoder import Decoder
from kvrelay.ingest.errors import DecodeError, FrameError
from kvrelay.ingest.frames import check_live
from kvrelay.pool.pool import Pool
from tests.support.crafted import Oracle, RawPublisher
from tests.support.fuzz_inputs import edit_lists, encode, envelopes, mutate, raw_messages
from tests.support.rig import eventually, rig, subscribe, verify, wait_live

FUZZ = settings(
    max_examples=150, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow]
)
_ORACLE = Oracle(seed=77)
VALID = [p for p in (_ORACLE.next_payload(mixed_hashes=True) for _ in range(60)) if p]


def decode_and_apply(decoder: Decoder, pool: Pool, payload: bytes) -> None:
    try:
        res = decoder.decode(payload)
    except DecodeError:
        return
    member = pool.add_member(1, 0)
    before = pool.invariant_violations
    pool.apply(member, res.batch)  # raises on a malformed batch: the decoder's fault
    assert pool.invariant_violations == before


def fresh(fast: bool) -> tuple[Decoder, Pool]:
    return (
        Decoder(kv_block_size=16, dp_rank=0, fast=fast),
        Pool(bucket_count=1024, seed=1, block_size=16, hash_format=1),
    )


@pytest.mark.parametrize("fast", [True, False])
@given(payload=st.binary(max_size=1024))
@FUZZ
def test_decoder_on_random_bytes(fast: bool, payload: bytes) -> None:
    decode_and_apply(*fresh(fast), payload)


@pytest.mark.parametrize("fast", [True, False])
@given(env=envelopes)
@FUZZ
def test_decoder_on_hostile_envelopes(fast: bool, env: Any) -> None:
    decode_and_apply(*fresh(fast), encode(env))


@pytest.mark.parametrize("fast", [True, False])
@given(idx=st.integers(0, len(VALID) - 1), edits=edit_lists)
@FUZZ
def test_decoder_on_mutated_valid_batches(fast: bool, idx: int, edits: list[Any]) -> None:
    decoder, pool = fresh(fast)
    for p in VALID[:idx]:  # a realistic prior state (parents known)
        decode_and_apply(decoder, pool, p)
    decode_and_apply(decoder, pool, mutate(VALID[idx], edits))


@given(frames=raw_messages)
@FUZZ
def test_frame_checks_raise_only_frame_errors(frames: list[bytes]) -> None:
    try:
        seq, payload = check_live(frames, b"")
    except FrameError:
        return
    assert len(frames) == 3 and len(frames[1]) == 8 and payload == frames[2]
    assert seq == int.from_bytes(frames[1], "big")


async def test_crafted_frames_never_stop_the_ingest_loop() -> None:
    corpus: list[list[bytes]] = []

    @given(frames=raw_messages)
    @settings(max_examples=200, deadline=None, database=None)
    def collect(frames: list[bytes]) -> None:
        corpus.append(frames)

    collect()
    raw = RawPublisher()
    oracle = Oracle(seed=78)
    try:
        async with rig(
            [], static=(raw.spec(),), model="raw-model", kv_block_size=16
        ) as r, r.channel() as ch:
            await wait_live(r.relay, 1)
            (sub,) = r.pool.subscribers.values()
            raw.seq = 1000
            await raw.announce_until(lambda: sub.counters.batches > 0)  # baseline seq >= 1000
            consumer = await subscribe(r, ch)
            before = sub.counters.messages
            for i, frames in enumerate(corpus):
                await raw.send(frames)
                if i % 25 == 0:
                    await asyncio.sleep(0)
            await eventually(
                lambda: sub.counters.messages >= before + len(corpus), what="corpus consumed"
            )
            assert sub._task is not None and not sub._task.done(), "ingest loop died"
            assert sub.state == "live"
            # sequence 0 after anything: a new incarnation (reset), then exact again
            raw.seq = 0
            for _ in range(12):
                await raw.send_payload(oracle.next_nonempty(mixed_hashes=True))
            await verify(r, consumer, truth={("raw", 0): oracle.truth()})
            assert sub.counters.rejections, "the corpus held no rejected message"
            await consumer.stop()
    finally:
        raw.close()
