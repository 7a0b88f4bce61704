"""The one-call delta kernel against its numpy twin (the hub's checks + ``cbi1.encode_delta``)."""

from __future__ import annotations

import numpy as np
import pytest

from kvrelay._proto.dynamo.kvrelay import v1 as pb
from kvrelay.publication import cbi1
from kvrelay.publication.delta_body import (
    LENGTHS,
    NO_FRAME,
    OK,
    OUT_OF_RANGE,
    REPEATED,
    delta_frame,
    delta_message,
    delta_message_cap,
    scatter,
)
from kvrelay.publication.hub import PublicationInvariantError, _checked
from kvrelay.publication.splice import KIND_DELTA
from tests.publication.test_hub import DC, SEED, make_hub

BC = 1 << 12


def kernel_payload(b: np.ndarray, w: np.ndarray, base: int, epoch: int) -> bytes:
    out = np.empty(cbi1.delta_frame_len(b.size), dtype=np.uint8)
    assert delta_frame(b, w, BC, base, out) == OK
    return cbi1.seal_delta(out, seed=SEED, bucket_count=BC, dc_id=DC, epoch=epoch)


@pytest.mark.parametrize("k", [0, 1, 2, 7, 300, 4096])
def test_the_kernel_writes_the_bytes_the_codec_writes(k: int) -> None:
    rng = np.random.default_rng(k)
    b = rng.permutation(BC)[:k].astype(np.uint32)
    w = rng.integers(0, 2**64, size=k, dtype=np.uint64)
    base = int(rng.integers(0, 2**63))
    want = cbi1.encode_delta(b, w, seed=SEED, bucket_count=BC, dc_id=DC, base_epoch=base,
                             epoch=base + 1)
    assert kernel_payload(b, w, base, base + 1) == want
    d = cbi1.decode(want, expected_seed=SEED, expected_bucket_count=BC)
    assert isinstance(d, cbi1.Delta) and d.buckets.tolist() == b.tolist()


def test_bad_publications_get_the_twins_verdict_and_leave_out_untouched() -> None:
    rng = np.random.default_rng(3)
    cases = {
        OUT_OF_RANGE: np.array([3, BC, 5], dtype=np.uint32),
        REPEATED: np.array([9, 4, 9, 1], dtype=np.uint32),
    }
    for want, b in cases.items():
        w = rng.integers(0, 2**64, size=b.size, dtype=np.uint64)
        out = np.full(cbi1.delta_frame_len(b.size), 0xAB, dtype=np.uint8)
        assert delta_frame(b, w, BC, 0, out) == want
        assert delta_frame(b, w, BC, 0, NO_FRAME) == want
        assert (out == 0xAB).all()
        with pytest.raises(PublicationInvariantError):
            _checked(b, w, BC)  # the twin refuses it as well
    b = np.array([1, 2], dtype=np.uint32)
    w = np.array([1, 2, 3], dtype=np.uint64)
    assert delta_frame(b, w, BC, 0, NO_FRAME) == LENGTHS
    short = np.zeros(cbi1.delta_frame_len(2) - 1, dtype=np.uint8)
    assert delta_frame(b, w[:2], BC, 0, short) == LENGTHS
    assert (short == 0).all()


def test_random_publications_agree_with_the_twin() -> None:
    rng = np.random.default_rng(11)
    for _ in range(300):
        k = int(rng.integers(1, 40))
        b = rng.integers(0, BC + 3, size=k).astype(np.uint32)
        w = rng.integers(0, 2**64, size=k, dtype=np.uint64)
        try:
            _checked(b, w, BC)
            twin = OK
        except PublicationInvariantError:
            twin = -1
        code = delta_frame(b, w, BC, 0, NO_FRAME)
        assert (code == OK) == (twin == OK)


@pytest.mark.parametrize("k", [0, 1, 2, 64, 3000])
def test_the_message_kernel_writes_what_the_codec_and_encoder_write(k: int) -> None:
    """``delta_message`` against its twins: ``cbi1.encode_delta`` inside
    ``FilterUpdateEncoder.encode``, byte for byte, for sequences and times whose varints take one
    to ten bytes and a base sequence of 0 (a field protobuf omits)."""
    hub, _ = make_hub(bc=BC)
    enc = hub.encoder
    prefix = np.frombuffer(enc.prefix, dtype=np.uint8)
    rng = np.random.default_rng(k)
    for base, ts in ((0, 1), (1, 127), (127, 128), (2**35, 1_733_400_000_000_000),
                     (2**63, 2**64 - 1)):  # fmt: skip
        b = rng.permutation(BC)[:k].astype(np.uint32)
        w = rng.integers(0, 2**64, size=k, dtype=np.uint64)
        epoch = (base + 1) % 2**64
        out = np.full(delta_message_cap(prefix.size, k), 0xAB, dtype=np.uint8)
        n = delta_message(b, w, BC, base, epoch, ts, SEED, DC, prefix, out)
        payload = cbi1.encode_delta(b, w, seed=SEED, bucket_count=BC, dc_id=DC, base_epoch=base,
                                    epoch=epoch)  # fmt: skip
        assert out[:n].tobytes() == enc.encode(KIND_DELTA, base, epoch, payload, send_ts_us=ts)
        msg = pb.FilterUpdate.parse(out[:n].tobytes())
        assert (msg.base_sequence, msg.sequence, msg.send_ts_us) == (base, epoch, ts)


def test_the_message_kernel_refuses_what_delta_frame_refuses_and_writes_nothing() -> None:
    hub, _ = make_hub(bc=BC)
    prefix = np.frombuffer(hub.encoder.prefix, dtype=np.uint8)
    w = np.ones(4, dtype=np.uint64)
    for want, b in ((OUT_OF_RANGE, np.array([3, BC, 5, 6], dtype=np.uint32)),
                    (REPEATED, np.array([9, 4, 9, 1], dtype=np.uint32))):  # fmt: skip
        out = np.full(delta_message_cap(prefix.size, 4), 0xAB, dtype=np.uint8)
        assert delta_message(b, w, BC, 1, 2, 3, SEED, DC, prefix, out) == -want
        assert (out == 0xAB).all()
    b = np.array([1, 2, 3, 4], dtype=np.uint32)
    short = np.full(delta_message_cap(prefix.size, 4) - 1, 0xAB, dtype=np.uint8)
    assert delta_message(b, w, BC, 1, 2, 3, SEED, DC, prefix, short) == -LENGTHS
    assert (short == 0xAB).all()
    assert delta_message(b, w[:3], BC, 1, 2, 3, SEED, DC, prefix, short) == -LENGTHS


def test_scatter_writes_what_numpy_fancy_assignment_writes() -> None:
    """``scatter`` (the hub's mirror update) against ``mirror[b] = w``, its twin; a bucket past
    the mirror or lengths that disagree write nothing."""
    rng = np.random.default_rng(5)
    for k in (0, 1, 2, 64, 700):
        mirror = rng.integers(0, 2**64, size=BC, dtype=np.uint64)
        twin = mirror.copy()
        b = rng.permutation(BC)[:k].astype(np.uint32)
        w = rng.integers(0, 2**64, size=k, dtype=np.uint64)
        assert scatter(mirror, b, w) == OK
        twin[b] = w
        assert np.array_equal(mirror, twin)
    mirror = np.zeros(BC, dtype=np.uint64)
    assert scatter(mirror, np.array([1, BC], dtype=np.uint32), np.ones(2, np.uint64)) == LENGTHS
    assert scatter(mirror, np.array([1, 2], dtype=np.uint32), np.ones(3, np.uint64)) == LENGTHS
    assert not mirror.any()
    with pytest.raises(TypeError):  # not its array types: the hub takes numpy's path
        scatter(mirror, np.array([1], dtype=np.int64), np.ones(1, np.uint64))


async def test_the_hub_sends_the_same_frames_from_any_array_type() -> None:
    """The pool's own arrays take the kernel; lists and other dtypes take the numpy twin. Both
    put the same delta bytes on the wire and refuse the same bad publications."""
    frames: dict[str, list[bytes]] = {}
    for kind in ("native", "int64", "list"):
        hub, _ = make_hub(seq=4)
        sub = await hub.subscribe()
        await sub._snapshot
        rng = np.random.default_rng(5)
        for seq in range(5, 9):
            b = rng.permutation(1024)[: 3 + seq].astype(np.uint32)
            w = rng.integers(0, 2**64, size=b.size, dtype=np.uint64)
            if kind == "native":
                hub.publish(seq, b, w)
            elif kind == "int64":
                hub.publish(seq, b.astype(np.int64), w)
            else:
                hub.publish(seq, b.tolist(), w)
        with pytest.raises(PublicationInvariantError, match="repeated"):
            bad = np.array([1, 1], dtype=np.uint32)
            hub.publish(9, bad if kind == "native" else bad.tolist(), np.zeros(2, np.uint64))
        # send_ts_us differs per run: compare every other field (the kernel writes the whole
        # message, the numpy twin's goes through the encoder)
        msgs = [pb.FilterUpdate.parse(f) for f, _, _ in sub._frames]
        assert all(m.send_ts_us > 0 for m in msgs)
        for m in msgs:
            m.send_ts_us = 0
        frames[kind] = [bytes(m) for m in msgs]
        hub.retire(None)
        sub.close()
    assert len(frames["native"]) == 4
    assert frames["native"] == frames["int64"] == frames["list"]
