"""SGLang sources: field layouts of every revision, signed hashes, topic epochs.

Oracles: hand-assembled msgpack bytes, the pure-Python reference model (fed the events SGLang
meant, encoded here in SGLang's positions by a test-local encoder), and the msgspec path for the
numba walker.
"""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvrelay.ingest.decoder import Decoder
from kvrelay.ingest.errors import DecodeError, FrameCountError, FrameError, TopicMismatchError
from kvrelay.ingest.frames import check_live_sglang
from kvrelay.ingest.kinds import EngineKind
from kvrelay.ingest.options import DecodeOptions
from kvrelay.ingest.salt import namespace_part, request_salt
from kvrelay.ingest.sglang import split_topic
from kvrelay.pool.batch import OP_REMOVE, OP_STORE
from tests.ingest.test_decoder import _outcome
from tests.support.decoder_model import Ref, assert_batch_equal

B = 4
SGL = EngineKind.SGLANG
enc = msgspec.msgpack.encode
LAYOUTS = ("no_medium", "medium", "metadata", "aligned")


def dec(**kw: Any) -> Decoder:
    kw.setdefault("kv_block_size", B)
    kw.setdefault("dp_rank", 0)
    kw.setdefault("kind", SGL)
    return Decoder(**kw)


def sgl(ev: dict[str, Any], layout: str) -> list[Any]:
    """Test-local SGLang encoder: one event dict (vLLM field names) in ``layout``'s positions."""
    g = ev.get
    if ev["kind"] == "clear":
        return ["AllBlocksCleared", None] if layout == "aligned" else ["AllBlocksCleared"]
    if ev["kind"] == "remove":
        out: list[Any] = ["BlockRemoved", ev["block_hashes"]]
        if layout != "no_medium":
            out.append(g("medium"))
        if layout == "aligned":  # group, kind, window, locality, ownership
            out += [g("group_idx"), g("remove_kind"), None, g("locality"), None]
        return out
    out = ["BlockStored", ev["block_hashes"], g("parent_block_hash"), ev["token_ids"],
           ev["block_size"], None]  # fmt: skip
    if layout == "no_medium":
        return out
    out.append(g("medium"))
    salt = g("cache_salt")
    if layout == "metadata" and salt:
        out.append({"cache_salt": salt})
    if layout == "aligned":
        out += [g("lora_name"), None, g("group_idx"), g("kv_cache_spec_kind"), None,
                g("locality"), None]  # fmt: skip
        if salt:
            out.append({"cache_salt": salt})
    return out


def batch(events: list[list[Any]], rank: int | None = 0) -> bytes:
    return enc([1.0, events] if rank is None else [1.0, events, rank])


# ---- golden bytes ------------------------------------------------------------------------------
def test_golden_bytes_of_a_signed_hash_store() -> None:
    """``[1.0, [["BlockStored", [-2], nil, [1, 2, 3, 4], 4, nil, "GPU"]], 0]`` by hand."""
    payload = bytes.fromhex(
        "93" "cb3ff0000000000000" "91" "97" "ab" + b"BlockStored".hex() + "91fe" "c0"
        "9401020304" "04" "c0" "a3" + b"GPU".hex() + "00"
    )  # fmt: skip
    assert msgspec.msgpack.decode(payload)[1][0][1] == [-2]
    for fast in (True, False):
        res = dec(fast=fast).decode(payload)
        assert res.batch.ops.tolist() == [OP_STORE]
        assert res.batch.ext_hashes.tolist() == [2**64 - 2]  # two's complement
        assert res.batch.tokens.tolist() == [1, 2, 3, 4] and res.dp_rank == 0


# ---- layouts -----------------------------------------------------------------------------------
def test_salt_map_after_medium_needs_the_sglang_layout() -> None:
    """One revision put ``{"cache_salt": …}`` in vLLM's ``lora_name`` slot: as vLLM the store is
    malformed (dropped, counted); as SGLang it is a store whose namespace is that salt."""
    ev = {"kind": "store", "block_hashes": [-7], "token_ids": [1, 2, 3, 4], "block_size": B,
          "medium": "GPU", "cache_salt": "tenant-a"}  # fmt: skip
    payload = batch([sgl(ev, "metadata")])
    as_vllm = dec(kind=EngineKind.VLLM).decode(payload)
    assert as_vllm.batch.n_events == 0 and as_vllm.stats.malformed_events == 1
    for opts in (DecodeOptions(), DecodeOptions(cache_salt_namespacing=True)):  # always honoured
        ns = dec(options=opts).decode(payload)
        assert ns.batch.ops.tolist() == [OP_STORE]
        assert ns.batch.salt.tolist() == [request_salt(None, "tenant-a")]
        assert ns.batch.ns_part.tolist() == [namespace_part("tenant-a")]


@pytest.mark.parametrize("parent", [None, -9])
def test_aligned_salt_map_at_slot_14_namespaces_every_store(parent: int | None) -> None:
    """The newest layout carries the salt on every salted store (not only root ones), so a
    child store is namespaced even when the relay never saw its parent."""
    ev = {"kind": "store", "block_hashes": [-7], "parent_block_hash": parent,
          "token_ids": [1, 2, 3, 4], "block_size": B, "medium": "GPU", "cache_salt": "t-b"}
    payload = batch([sgl(ev, "aligned")])
    for fast in (True, False):  # by default, on both decoder paths
        res = dec(fast=fast).decode(payload)
        assert res.batch.salt.tolist() == [request_salt(None, "t-b")]
        assert res.batch.ns_part.tolist() == [namespace_part("t-b")]
        assert res.stats.unknown_fields == 0


def test_removes_read_locality_at_sglangs_position() -> None:
    """SGLang's remove: ``hashes, medium, group, kind, window, locality, ownership``. vLLM reads
    position 4 as ``locality``; as SGLang a kind there is ignored and position 6 is the gate."""
    kept = {"kind": "remove", "block_hashes": [5], "medium": "GPU", "remove_kind": "x"}
    remote = {"kind": "remove", "block_hashes": [6], "medium": "GPU", "locality": "REMOTE"}
    payload = batch([sgl(kept, "aligned"), sgl(remote, "aligned")])
    for fast in (True, False):
        res = dec(fast=fast).decode(payload)
        assert res.batch.ops.tolist() == [OP_REMOVE]
        assert res.batch.ext_hashes.tolist() == [5]
        assert res.stats.drops == {"locality": 1} and res.stats.unknown_fields == 0
    as_vllm = dec(kind=EngineKind.VLLM).decode(payload)  # both wrong: "x" read as a locality,
    assert as_vllm.batch.ext_hashes.tolist() == [6]  # and the REMOTE one's slot not read


def test_two_element_envelope_and_short_arrays() -> None:
    """The oldest revision: ``[ts, events]`` (no rank: the socket's), stores without medium."""
    st_ = {"kind": "store", "block_hashes": [-1], "token_ids": [9, 9, 9, 9], "block_size": B}
    rm = {"kind": "remove", "block_hashes": [-1]}
    payload = batch([sgl(st_, "no_medium"), sgl(rm, "no_medium")], rank=None)
    res = dec(dp_rank=3).decode(payload)
    assert res.dp_rank == 3 and res.batch.ops.tolist() == [OP_STORE, OP_REMOVE]


# ---- generated events: decoder == reference model, walker == msgspec path ---------------------
u32 = st.integers(0, 2**32 - 1)
i64 = st.integers(-(2**63), 2**63 - 1)


@st.composite
def sgl_events(draw: st.DrawFn, layout: str) -> dict[str, Any]:
    kind = draw(st.sampled_from(["store", "store", "store", "remove", "remove", "clear"]))
    if kind == "clear":
        return {"kind": "clear"}
    medium = None if layout == "no_medium" else draw(
        st.sampled_from([None, "GPU", "GPU", "CPU_PINNED", "DISK", "EXTERNAL"])
    )  # fmt: skip
    common: dict[str, Any] = {"medium": medium}
    if layout == "aligned":
        common["group_idx"] = draw(st.sampled_from([None, None, 0, 1]))
        common["locality"] = draw(st.sampled_from([None, None, "LOCAL", "REMOTE"]))
    if kind == "remove":
        if layout == "aligned":
            common["remove_kind"] = draw(st.sampled_from([None, "full_attention", "mamba"]))
        return {"kind": "remove", "block_hashes": draw(st.lists(i64, max_size=3)), **common}
    k = draw(st.integers(0, 3))
    ntok = max(0, k * B + draw(st.integers(-3, 1)))
    if draw(st.booleans()) and ntok >= 2:  # EAGLE bigram keys
        flat = draw(st.lists(u32, min_size=ntok, max_size=ntok))
        toks: list[Any] = [[flat[j], flat[j + 1]] for j in range(ntok - 1)]
    else:
        toks = draw(st.lists(u32, min_size=ntok, max_size=ntok))
    ev = {
        "kind": "store",
        "block_hashes": draw(st.lists(i64, min_size=k, max_size=k, unique=True)),
        "parent_block_hash": draw(st.one_of(st.none(), i64)),
        "token_ids": toks,
        "block_size": draw(st.sampled_from([B, B, B, 2 * B])),
        # only these layouts carry a salt (the reference model honours whatever it is given)
        "cache_salt": draw(st.sampled_from([None, None, "tenant-a"]))
        if layout in ("metadata", "aligned")
        else None,
        **common,
    }
    if layout == "aligned":
        ev["lora_name"] = draw(st.sampled_from([None, None, "adapter-a"]))
        ev["kv_cache_spec_kind"] = draw(st.sampled_from([None, None, "full_attention", "mamba"]))
    return ev


@pytest.mark.parametrize("layout", LAYOUTS)
@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_matches_reference_model(layout: str, data: st.DataObject) -> None:
    evs = data.draw(st.lists(sgl_events(layout), max_size=6))
    eagle = data.draw(st.booleans())
    payload = batch([sgl(e, layout) for e in evs])
    want = Ref(B, eagle=eagle).build(evs)
    for fast in (True, False):
        got = dec(hash_format=2 if eagle else 1, fast=fast).decode(payload)
        assert_batch_equal(got.batch, want)
        assert got.stats.malformed_events == 0 and got.stats.unknown_fields == 0
    assert _outcome(dec(), payload) == _outcome(dec(fast=False), payload)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=st.data(),
    muts=st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), min_size=1, max_size=4),
)
def test_walker_equals_msgspec_path_on_mutations(
    data: st.DataObject, muts: list[tuple[int, int]]
) -> None:
    layout = data.draw(st.sampled_from(LAYOUTS))
    buf = bytearray(batch([sgl(e, layout) for e in data.draw(st.lists(sgl_events(layout),
                                                                       min_size=1, max_size=4))]))
    for pos, val in muts:
        buf[pos % len(buf)] = val
    payload = bytes(buf)
    assert _outcome(dec(), payload) == _outcome(dec(fast=False), payload)


# ---- topic frames --------------------------------------------------------------------------------
EPOCH = b"\x00sgl-kv-epoch="
SNAP = b"\x00sgl-kv-snapshot="


def test_topic_epochs_and_barriers() -> None:
    assert split_topic(b"kv", b"kv") == (None, False)
    assert split_topic(b"kv" + EPOCH + b"e1", b"kv") == (b"e1", False)
    assert split_topic(b"kv" + EPOCH + b"e1" + SNAP + b"b7", b"kv") == (b"e1", True)
    assert split_topic(EPOCH + b"e1", b"") == (b"e1", False)  # the default empty topic
    for bad in (b"kv2", b"kv" + EPOCH, b"kv" + EPOCH + b"e\x00x", b"kv" + EPOCH + b"e" + SNAP,
                b"kv" + EPOCH + b"e" * 129, b"kv\x00other=1"):  # fmt: skip
        assert split_topic(bad, b"kv") is None, bad
    seq = (5).to_bytes(8, "big")
    assert check_live_sglang([b"kv" + EPOCH + b"e1", seq, b"p"], b"kv") == (5, b"p", b"e1")
    assert check_live_sglang([b"kv", seq, b"p"], b"kv") == (5, b"p", None)
    # the configured topic is a prefix (§15.3): the epoch follows whatever the engine's topic is
    assert check_live_sglang([b"kv-events" + EPOCH + b"e2", seq, b"p"], b"kv") == (5, b"p", b"e2")
    assert check_live_sglang([b"kv-events", seq, b"p"], b"kv") == (5, b"p", None)
    for bad in (b"xkv", b"kv" + EPOCH, b"kv" + EPOCH + b"e" + SNAP):
        with pytest.raises(TopicMismatchError):
            check_live_sglang([bad, seq, b"p"], b"kv")
    with pytest.raises(FrameCountError):
        check_live_sglang([b"kv", seq], b"kv")


@settings(max_examples=300, deadline=None)
@given(st.lists(st.binary(max_size=40), max_size=4), st.binary(max_size=3))
def test_fuzz_sglang_frames(frames: list[bytes], topic: bytes) -> None:
    try:
        check_live_sglang(frames, topic)
    except DecodeError as exc:
        assert isinstance(exc, FrameError)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=st.data(),
    slot14=st.sampled_from([None, 5, "x", {"cache_salt": "t"}, {"cache_salt": 3}, [1]]),
    extra=st.integers(0, 2),
)
def test_walker_equals_msgspec_path_on_odd_trailing_slots(
    data: st.DataObject, slot14: Any, extra: int
) -> None:
    """Aligned stores with any value at slot 14, and events with trailing slots past SGLang's
    layout: the walker and the msgspec path agree (the walker falls back where it must)."""
    evs = [sgl(e, "aligned") for e in data.draw(st.lists(sgl_events("aligned"), max_size=5))]
    for ev in evs:
        if ev[0] == "BlockStored":
            ev.append(slot14)
        ev += [None] * extra
    payload = batch(evs)
    assert _outcome(dec(), payload) == _outcome(dec(fast=False), payload)
    assert _outcome(dec(hash_format=2), payload) == _outcome(dec(hash_format=2, fast=False),
                                                             payload)  # fmt: skip
