"""Engine traffic the simulator never makes: a clear of one storage tier, hostile nesting, odd
LoRA names, odd time stamps. Each test names the exactness (or bound) it holds the relay to."""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np
import pytest
import zmq
import zmq.asyncio

from kvrelay.ingest.counters import LAG_CAP_S, SubscriberCounters
from kvrelay.ingest.decoder import Decoder
from kvrelay.ingest.errors import MalformedPayloadError
from kvrelay.ingest.kinds import EngineKind
from kvrelay.ingest.salt import request_salt
from kvrelay.ingest.sink import ResetReason, SourceKey, SourceSpec
from kvrelay.ingest.subscriber import Subscriber
from kvrelay.pool.batch import OP_CLEAR, AnyBatch, as_events
from kvrelay.pool.pool import Pool
from tests.ingest.test_connect import ctx  # noqa: F401 (fixture)
from tests.support.vllm_publisher import TestPublisher, until

B = 4
enc = msgspec.msgpack.encode


def store(hs: list[int], **kw: Any) -> dict[str, Any]:
    ev = {"type": "BlockStored", "block_hashes": hs, "parent_block_hash": None,
          "token_ids": list(range(1, len(hs) * B + 1)), "block_size": B, "lora_id": None,
          "medium": "GPU", "lora_name": None}  # fmt: skip
    ev.update(kw)
    return ev


def batch(events: list[Any], dp: int | None = 0) -> bytes:
    return enc([1700000000.5, events, dp])


def decoders(**kw: Any) -> list[Decoder]:
    """The walker first (falling back itself where it must) and the msgspec path alone."""
    return [Decoder(kv_block_size=B, dp_rank=0, fast=f, **kw) for f in (True, False)]


# ---- AllBlocksCleared of one medium ------------------------------------------------------------
@pytest.mark.parametrize("kind", [EngineKind.VLLM, EngineKind.SGLANG])
@pytest.mark.parametrize("medium", ["CPU", "cpu", "STORAGE", "CPU_PINNED", "SHARED_STORAGE"])
def test_a_clear_of_another_medium_leaves_the_gpu_tier_alone(
    kind: EngineKind, medium: str
) -> None:
    """A publisher that clears one tier names it (ROCm ATOM's ``AllBlocksCleared.medium``; a
    connector of vLLM's that clears its host tier would do the same). Applied as a clear of the
    member, it dropped every GPU block the engine still held: misses until each was stored
    again. It is dropped and counted like a store or remove of that medium."""
    payload = batch([{"type": "AllBlocksCleared", "medium": medium}])
    for d in decoders(kind=kind):
        res = d.decode(payload)
        assert res.batch.n_events == 0
        assert res.stats.cleared == 1
        assert sum(res.stats.drops.values()) == 1
        assert res.stats.unknown_fields == 0


@pytest.mark.parametrize("medium", ["CPU", "DISK"])
def test_a_positional_clear_of_another_medium_leaves_the_gpu_tier_alone(medium: str) -> None:
    """ATOM's positional form puts the medium right after the tag."""
    for d in decoders():
        res = d.decode(batch([["AllBlocksCleared", medium]]))
        assert res.batch.n_events == 0 and res.stats.cleared == 1


@pytest.mark.parametrize(
    "ev",
    [
        {"type": "AllBlocksCleared"},
        {"type": "AllBlocksCleared", "medium": None},
        {"type": "AllBlocksCleared", "medium": "GPU"},
        {"type": "AllBlocksCleared", "medium": ""},
        {"type": "AllBlocksCleared", "medium": "device"},
        ["AllBlocksCleared"],
        ["AllBlocksCleared", None],
        ["AllBlocksCleared", "GPU"],
    ],
)
def test_a_clear_of_the_device_tier_still_clears(ev: Any) -> None:
    for d in decoders():
        ops = as_events(d.decode(batch([ev])).batch).ops
        assert ops.tolist() == [OP_CLEAR]


def test_an_sglang_positional_clear_keeps_its_ownership_slot() -> None:
    """SGLang's newest positional clear carries ``ownership`` where ATOM puts a medium: it is
    still a clear of the member."""
    for d in decoders(kind=EngineKind.SGLANG):
        ops = as_events(d.decode(batch([["AllBlocksCleared", "CPU_PINNED"]])).batch).ops
        assert ops.tolist() == [OP_CLEAR]


class PoolSink:
    """The pool itself behind the subscriber: what the relay's member would hold."""

    def __init__(self) -> None:
        self.pool = Pool(256, 0x5EED, B, 1, 500)
        self.member = self.pool.add_member(42, 0)
        self.seqs: list[int] = []
        self.resets: list[ResetReason] = []

    def on_batch(self, source: SourceKey, seq: int, batch: AnyBatch) -> None:
        self.pool.apply(self.member, batch)
        self.seqs.append(seq)

    def on_reset(self, source: SourceKey, reason: ResetReason) -> None:
        self.resets.append(reason)
        self.pool.reset_member(self.member)

    def on_rebuild(self, source: SourceKey, active: bool) -> None:
        pass

    def on_vouched(self, source: SourceKey) -> None:
        pass

    def on_failed(self, source: SourceKey, error: BaseException) -> None:
        raise AssertionError(f"the subscriber crashed: {error!r}")

    def held(self) -> set[int]:
        return set(self.pool.lineage(self.member))


async def test_a_cpu_tier_clear_over_zmq_keeps_the_members_gpu_blocks(
    ctx: zmq.asyncio.Context,  # noqa: F811
) -> None:
    """End to end on loopback: GPU stores, then the offload tier is cleared (a map-form and a
    positional clear naming ``CPU``), then a clear naming no medium. The member holds its GPU
    blocks through the first two and nothing after the third; nothing is reset."""
    pub = TestPublisher(ctx)
    sink = PoolSink()
    spec = SourceSpec(endpoint=pub.endpoint, replay_endpoint=pub.replay_endpoint,
                      topic=pub.topic, dp_rank=0, worker_id=42, kv_block_size=B)  # fmt: skip
    sub = Subscriber(spec, sink, context=ctx, replay_timeout=1.0)
    try:
        await sub.start()
        await pub.wait_subscribed()
        await until(lambda: sub.state == "live")
        await pub.publish(batch([store([11, 12]), store([13], medium="CPU")]))
        await pub.publish(batch([{"type": "AllBlocksCleared", "medium": "CPU"}]))
        await pub.publish(batch([["AllBlocksCleared", "CPU"]]))
        await until(lambda: len(sink.seqs) >= 3)
        assert sink.held() == {11, 12}
        await pub.publish(batch([{"type": "AllBlocksCleared"}]))
        await until(lambda: len(sink.seqs) >= 4)
        assert sink.held() == set()
        assert sink.resets == []
        assert sub.counters.drops.get("medium_host_pinned") == 3  # the CPU store, two clears
    finally:
        await sub.stop()
        await pub.close()


# ---- hostile nesting ---------------------------------------------------------------------------
def _nested(depth: int) -> bytes:
    return b"\x91" * depth + b"\xc0"


def _store_with(key: str, raw_value: bytes) -> bytes:
    """A map-form store with one more key whose value is given as raw msgpack."""
    ev = store([1, 2])
    body = b"".join(enc(k) + enc(v) for k, v in ev.items()) + enc(key) + raw_value
    return bytes([0x80 | (len(ev) + 1)]) + body


def _raw_batch(*events: bytes) -> bytes:
    return b"\x93" + enc(1.5) + bytes([0x90 | len(events)]) + b"".join(events) + b"\x00"


@pytest.mark.parametrize("key", ["extra_keys", "session_id", "a_future_field"])
def test_nesting_past_the_recursion_limit_is_a_malformed_payload_on_both_paths(key: str) -> None:
    """msgspec reads nested values recursively: 2,000 levels raised ``RecursionError``, which
    was reported as an ``internal`` rejection (a bug, by its own label), and the walker,
    whose skip is iterative, applied the same message when the value sat in a field it skips:
    the two paths disagreed. Both now refuse it as ``malformed_payload``."""
    payload = _raw_batch(_store_with(key, _nested(2000)))
    for d in decoders():
        with pytest.raises(MalformedPayloadError):
            d.decode(payload)


@pytest.mark.parametrize("depth", [3, 64, 65, 200])
def test_moderate_nesting_decodes_the_same_on_both_paths(depth: int) -> None:
    """Up to 64 levels the walker skips a value itself; deeper it hands the message to the
    msgspec path, which reads it (far below Python's recursion limit): the same batch."""
    payload = _raw_batch(_store_with("extra_keys", _nested(depth)))
    fast, slow = (d.decode(payload) for d in decoders())
    assert fast.stats.slow_path == (1 if depth > 65 else 0)
    for res in (fast, slow):
        assert as_events(res.batch).ext_hashes.tolist() == [1, 2]


# ---- LoRA names --------------------------------------------------------------------------------
def test_long_lora_names_are_salted_but_not_cached() -> None:
    """The salt of each LoRA name was cached per source for up to 4,096 names of any length:
    an engine sending long names (one per message, up to a message's 64 MiB each) made the relay
    keep them all (200 names of 4 MiB kept 800 MiB per path). Only short names are cached now;
    a long one is still salted correctly, every time."""
    long_names = [f"{i:04d}" + "x" * (1 << 16) for i in range(8)]
    for d in decoders():
        for name in long_names:
            res = d.decode(batch([store([7], lora_name=name)]))
            assert as_events(res.batch).salt.tolist() == [request_salt(name, None)]
        res = d.decode(batch([store([7], lora_name="adapter-a")]))
        assert as_events(res.batch).salt.tolist() == [request_salt("adapter-a", None)]
        cached = sum(len(k) for k in d._lora_bytes) + sum(len(k) for k in d._salts)
        assert cached <= 256


# ---- engine time stamps ------------------------------------------------------------------------
@pytest.mark.parametrize("ts", [float("-inf"), float("nan"), -1e308])
def test_an_odd_engine_time_stamp_does_not_poison_the_lag_sum(ts: float) -> None:
    """The lag histogram's sum is a running total for the relay's life: one batch stamped
    ``-inf`` made it infinite for good (and ``-1e308`` swallowed every later observation).
    A non-finite stamp is not observed; a finite one adds at most ``LAG_CAP_S``."""
    d = Decoder(kv_block_size=B, dp_rank=0)
    c = SubscriberCounters()
    c.observe_applied(d.decode(enc([ts, [], 0])).ts, live=True)
    assert np.isfinite(c.lag_sum_s) and c.lag_sum_s <= LAG_CAP_S
    before = c.lag_sum_s
    c.observe_applied(c.last_message_unix - 0.002, live=True)  # a sane message afterwards
    assert 0.0 <= c.lag_sum_s - before < 1.0
    assert c.last_message_unix > 0
