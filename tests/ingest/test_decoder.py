"""Decoder vs the pure-Python reference model, both encodings, gating, salts, typed rejections."""

from __future__ import annotations

import contextlib
from typing import Any

import msgspec
import numpy as np
import pytest
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvrelay.client.hashes import block_hashes, request_salt, sequence_hashes
from kvrelay.ingest.decoder import Decoder
from kvrelay.ingest.errors import (
    DecodeError,
    DpRankMismatchError,
    InternalDecodeError,
    MalformedEnvelopeError,
    MalformedPayloadError,
    MalformedRemovalError,
)
from kvrelay.ingest.options import DecodeOptions
from kvrelay.pool.batch import (
    OP_CLEAR,
    OP_REMOVE,
    OP_STORE,
    ORIGIN_NEW,
    ORIGIN_REPORT,
    ORIGIN_UNKNOWN,
)
from kvrelay.pool.pool import Pool
from tests.support import vllm_wire as W
from tests.support.decoder_model import Ref, assert_batch_equal, salt_of

B = 4
enc = msgspec.msgpack.encode


def dec(**kw: Any) -> Decoder:
    kw.setdefault("kv_block_size", B)
    kw.setdefault("dp_rank", 0)
    return Decoder(**kw)


def to_wire(ev: dict[str, Any], era: str) -> Any:
    fields = {k: v for k, v in ev.items() if k not in ("kind",)}
    if ev["kind"] == "clear":
        return W.cleared(era, ev.get("medium"))
    if ev["kind"] == "remove":
        hs = fields.pop("block_hashes")
        return W.removed(era, hs, **fields)
    return W.stored(era, **fields)


# ---- generated events: decoder == reference model ----------------------------------------------
hashes = st.one_of(
    st.integers(-(2**63), 2**64 - 1),
    st.binary(min_size=1, max_size=32),
)
u32 = st.integers(0, 2**32 - 1)


@st.composite
def events(draw: st.DrawFn, allow_bytes: bool) -> tuple[dict[str, Any], str]:
    era = draw(st.sampled_from(["array", "map"]))
    kind = draw(st.sampled_from(["store", "store", "store", "remove", "remove", "clear"]))
    h = hashes if allow_bytes else st.integers(-(2**63), 2**64 - 1)
    common = {
        "medium": draw(st.sampled_from([None, "GPU", "GPU", "DEVICE", "CPU", "STORAGE", "odd"])),
        "group_idx": draw(st.sampled_from([None, None, 0, 1])),
    }
    if era == "map":
        common["locality"] = draw(st.sampled_from([None, None, "LOCAL", "REMOTE"]))
    if kind == "clear":
        return {"kind": "clear", "medium": common["medium"]}, era
    if kind == "remove":
        return {"kind": "remove", "block_hashes": draw(st.lists(h, max_size=3)), **common}, era
    k = draw(st.integers(0, 4))
    bs = draw(st.sampled_from([B, B, B, 0, 2 * B]))
    ntok = max(0, k * B + draw(st.integers(-5, 2)))
    bigram = draw(st.booleans()) and ntok >= 2
    if bigram:
        toks: list[Any] = [
            list(p)
            for p in draw(st.lists(st.tuples(u32, u32), min_size=ntok - 1, max_size=ntok - 1))
        ]
    else:
        toks = draw(st.lists(u32, min_size=ntok, max_size=ntok))
    parent = draw(st.one_of(st.none(), h))
    hs = draw(st.lists(h, min_size=k, max_size=k))
    if hs and draw(st.integers(0, 9)) == 0:
        parent = hs[-1]  # self reference
    elif len(hs) >= 2 and draw(st.integers(0, 9)) == 0:
        hs[-1] = hs[0]  # a repeat, often where too few tokens truncate the store
    return {
        "kind": "store",
        "block_hashes": hs,
        "parent_block_hash": parent,
        "token_ids": toks,
        "block_size": bs,
        "lora_name": draw(st.sampled_from([None, "", "adapter-a", "λ-lora"])),
        "kv_cache_spec_kind": draw(
            st.sampled_from([None, None, "full_attention", "mla_attention", "sink_full_attention",
                             "sliding_window"])
        ),
        **common,
    }, era


@pytest.mark.parametrize("eagle", [False, True])
@pytest.mark.parametrize("allow_bytes", [False, True])
@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_matches_reference(eagle: bool, allow_bytes: bool, data: st.DataObject) -> None:
    evs = data.draw(st.lists(events(allow_bytes), max_size=8))
    payload = W.batch([to_wire(e, era) for e, era in evs], dp=data.draw(st.sampled_from([0, None])))
    res = dec(hash_format=2 if eagle else 1).decode(payload)
    want = Ref(B, eagle=eagle).build([e for e, _ in evs])
    assert_batch_equal(res.batch, want)
    assert res.dp_rank == 0
    assert res.ts == 1700000000.5
    st_ = res.stats
    assert st_.stored + st_.removed + st_.cleared == len(evs)
    assert st_.unknown_tags == 0 and st_.malformed_events == 0


# ---- targeted cases ----------------------------------------------------------------------------
def test_hash_forms_normalise_to_u64() -> None:
    digest = bytes(range(32))
    hs = [0, -1, -(2**63), 2**64 - 1, 2**63, digest, b"\x01\x02\x03"]
    for era in ("array", "map"):
        res = dec().decode(W.batch([W.removed(era, hs)]))
        assert res.batch.ext_hashes.tolist() == [
            0,
            2**64 - 1,
            2**63,
            2**64 - 1,
            2**63,
            int.from_bytes(digest[-8:], "big"),
            0x010203,
        ]
        assert res.batch.ops.tolist() == [OP_REMOVE]


def test_store_with_bytes_parent_and_truncation_by_tokens() -> None:
    parent = b"\xaa" * 16
    ev = W.stored(
        "map",
        block_hashes=[1, 2, 3],
        parent_block_hash=parent,
        token_ids=list(range(10)),
        block_size=B,
    )
    res = dec().decode(W.batch([ev]))
    b = res.batch
    assert b.ext_hashes.tolist() == [1, 2]  # 10 tokens → 2 full blocks of 4
    assert b.tokens.tolist() == list(range(8))
    assert b.parent.tolist() == [int.from_bytes(b"\xaa" * 8, "big")] and b.has_parent.tolist() == [
        True
    ]
    assert res.stats.truncated == 1


@pytest.mark.parametrize("fast", [True, False])
def test_a_repeat_among_the_hashes_a_truncation_drops_still_drops_the_store(fast: bool) -> None:
    """Dynamo checks a store's whole hash list (and its parent) for a repeat before it walks the
    blocks its tokens cover: a repeat past the truncation point drops the store too."""
    tail = W.stored("map", block_hashes=[1, 2, 1], token_ids=list(range(2 * B)), block_size=B)
    par = W.stored("map", block_hashes=[5, 6, 7], parent_block_hash=7,
                   token_ids=list(range(B)), block_size=B)  # fmt: skip
    ok = W.stored("map", block_hashes=[3, 4, 9], token_ids=list(range(2 * B)), block_size=B)
    res = dec(fast=fast).decode(W.batch([tail, par, ok]))
    assert res.batch.ext_hashes.tolist() == [3, 4]
    assert res.stats.drops.get("self_reference") == 2 and res.stats.truncated == 1


@pytest.mark.parametrize("fast", [True, False])
def test_a_long_store_is_checked_for_repeats_whole(fast: bool) -> None:
    """Past 32 hashes the walker compares a sorted copy: a repeat anywhere is found, the
    parent among them too, and a store without one is kept whole."""
    n = 5_000
    hs = list(range(10, 10 + n))
    toks = [1] * (n * B)
    for bad_hs, parent in (([*hs[:-1], hs[n // 2]], None), (hs, hs[n - 1]), (hs, None)):
        ev = W.stored("map", block_hashes=bad_hs, parent_block_hash=parent, token_ids=toks,
                      block_size=B)  # fmt: skip
        res = dec(fast=fast).decode(W.batch([ev]))
        kept = bad_hs is hs and parent is None
        assert res.batch.ext_hashes.tolist() == (hs if kept else [])
        assert res.stats.drops.get("self_reference", 0) == (0 if kept else 1)


def test_unknown_tags_and_fields_counted_not_fatal() -> None:
    events = [
        {"type": "BlockRemoved", "block_hashes": [7], "medium": "GPU", "future_field": [1, 2]},
        {"type": "SomethingNew", "x": 1},
        ["SomethingOld", 1, 2],
        ["BlockRemoved", [8], "GPU", None, None, None, "extra-a", "extra-b"],
        {"type": "AllBlocksCleared", "why": "reset"},
        {"type": "BlockStored", "block_hashes": "x"},  # a store that does not decode
    ]
    res = dec().decode(enc([1.0, events, 0]))
    assert res.batch.ops.tolist() == [OP_REMOVE, OP_REMOVE, OP_CLEAR]
    assert res.batch.ext_hashes.tolist() == [7, 8]
    assert res.stats.unknown_tags == 2
    assert res.stats.unknown_fields == 1 + 2 + 1
    assert res.stats.malformed_events == 1


@pytest.mark.parametrize("bad", [
    {"type": "BlockRemoved", "block_hashes": [9], "medium": 17},  # badly typed known field
    {"type": "BlockRemoved", "block_hashes": [9], "group_idx": "0"},
    ["BlockRemoved", "not a list"],
    5,  # not an event at all
    {"block_hashes": [9]},  # no kind
])  # fmt: skip
def test_a_removal_or_an_event_of_unknown_kind_that_does_not_decode_fails_the_batch(
    bad: object,
) -> None:
    """A store skipped costs a miss; a remove or clear skipped would leave what the engine
    dropped held (phantoms), and an event whose kind cannot be read may be either: the batch is
    refused whole (the subscriber re-fetches it once, else resets the member)."""
    events = [{"type": "BlockRemoved", "block_hashes": [7], "medium": "GPU"}, bad]
    with pytest.raises(MalformedRemovalError):
        dec().decode(enc([1.0, events, 0]))


def test_medium_locality_group_gating_counted_by_reason() -> None:
    toks = list(range(B))
    evs = [
        W.stored("map", block_hashes=[1], token_ids=toks, block_size=B, medium="CPU"),
        W.stored("map", block_hashes=[2], token_ids=toks, block_size=B, medium="STORAGE"),
        W.stored("map", block_hashes=[3], token_ids=toks, block_size=B, medium="NETWORK"),
        W.stored("map", block_hashes=[4], token_ids=toks, block_size=B, medium="weird"),
        W.stored("map", block_hashes=[5], token_ids=toks, block_size=B, locality="REMOTE"),
        W.stored(
            "map",
            block_hashes=[6],
            token_ids=toks,
            block_size=B,
            group_idx=1,
            kv_cache_spec_kind="sliding_window",
        ),
        W.removed("map", [6], group_idx=1),
        W.stored("map", block_hashes=[7], token_ids=toks, block_size=B, group_idx=2),
        W.stored("map", block_hashes=[8], token_ids=toks, block_size=B, group_idx=0),
        W.stored("map", block_hashes=[9], token_ids=[], block_size=0, medium="CPU"),
        W.stored("map", block_hashes=[10], token_ids=[], block_size=0),
        W.stored("map", block_hashes=[11], token_ids=toks, block_size=2 * B),
        W.stored("map", block_hashes=[12], token_ids=toks[:3], block_size=B),
        W.stored(
            "map",
            block_hashes=[13],
            token_ids=toks,
            block_size=B,
            medium="DEVICE",
            group_idx=3,
            kv_cache_spec_kind="mla_attention",
        ),
        W.removed("map", [13], group_idx=3, medium="GPU"),
    ]
    res = dec().decode(W.batch(evs))
    assert res.batch.ext_hashes.tolist() == [8, 13, 13]
    assert res.stats.drops == {
        "medium_host_pinned": 2,
        "medium_disk": 1,
        "medium_external": 1,
        "medium_unknown": 1,
        "locality": 1,
        "non_full_attention": 2,
        "group": 1,
        "placeholder": 1,
        "block_size_mismatch": 1,
        "tokens_short": 1,
    }


def test_a_sink_full_attention_group_is_full_attention() -> None:
    """vLLM manages a sink full-attention group (``StaticSinkAttention``) with its full-attention
    manager: the same prefixes hit. Its stores and removes count on both paths; read as another
    kind, every store was dropped, and the group's removes with it (an empty filter)."""
    toks = list(range(B))
    evs = [
        W.stored("map", block_hashes=[31], token_ids=toks, block_size=B, group_idx=0,
                 kv_cache_spec_kind="sink_full_attention"),
        W.stored("map", block_hashes=[32], token_ids=toks, block_size=B, group_idx=1,
                 kv_cache_spec_kind="sliding_window"),
        W.removed("map", [31], group_idx=0),
        W.removed("map", [32], group_idx=1),
    ]  # fmt: skip
    for fast in (True, False):
        res = dec(fast=fast).decode(W.batch(evs))
        assert res.batch.ext_hashes.tolist() == [31, 31], fast
        assert res.stats.drops == {"non_full_attention": 1, "group": 1}, fast


def test_tokens_beyond_the_hashes_are_not_aligned_from_the_head() -> None:
    """A store whose tokens span more whole blocks than it has hashes (a sliding window's
    tokens, the hashes its last blocks) cannot be aligned: dropped (``tokens_excess``) on both
    paths. Tokens of a trailing partial block are fine: the hashes are the leading blocks."""
    evs = [
        W.stored("map", block_hashes=[21], token_ids=list(range(3 * B)), block_size=B),
        W.stored("map", block_hashes=[22], token_ids=list(range(B + B // 2)), block_size=B),
    ]
    for fast in (True, False):
        res = dec(fast=fast).decode(W.batch(evs))
        assert res.batch.ext_hashes.tolist() == [22], fast
        assert res.batch.tokens.tolist() == list(range(B)), fast
        assert res.stats.drops == {"tokens_excess": 1}, fast


def test_eagle_bigrams_follow_the_pool_format() -> None:
    pairs = [[10 + i, 11 + i] for i in range(2 * B)]  # tokens 10..10+2B
    ev = W.stored("array", block_hashes=[1, 2], token_ids=pairs, block_size=B)
    std = dec(hash_format=1).decode(W.batch([ev]))
    assert std.batch.tokens.tolist() == list(range(10, 10 + 2 * B))
    assert std.stats.eagle_bigram == 1
    eag = dec(hash_format=2).decode(W.batch([ev]))
    assert eag.batch.tokens.tolist() == list(range(10, 11 + 2 * B))
    assert eag.batch.ext_hashes.tolist() == [1, 2]
    flat = W.stored("array", block_hashes=[1, 2], token_ids=list(range(2 * B)), block_size=B)
    eag_flat = dec(hash_format=2).decode(W.batch([flat]))  # last block lacks its lookahead token
    assert eag_flat.batch.ext_hashes.tolist() == [1]
    assert eag_flat.batch.tokens.tolist() == list(range(B + 1))


@pytest.mark.parametrize("fast", [True, False])
def test_eagle_window_of_the_last_block_comes_from_lookahead_tokens(fast: bool) -> None:
    """vLLM >= 0.33 sends ``lookahead_token_ids``: the tokens past each block that went into its
    hash. Under the EAGLE format the last block's window is then complete and it is kept."""
    la = [[B, B + 1], [2 * B + 5, 98]]  # block 0: token B, already in the store
    ev = W.stored("map", block_hashes=[1, 2], token_ids=list(range(2 * B)), block_size=B,
                  lookahead_token_ids=la)  # fmt: skip
    eag = dec(hash_format=2, fast=fast).decode(W.batch([ev]))
    assert eag.batch.ext_hashes.tolist() == [1, 2] and eag.stats.truncated == 0
    assert eag.batch.tokens.tolist() == [*range(2 * B), 2 * B + 5]
    std = dec(hash_format=1, fast=fast).decode(W.batch([ev]))  # standard windows: not needed
    assert std.batch.tokens.tolist() == list(range(2 * B))
    for bad in ([[1]], [[], []], [[1], ["x"]], [[1], [-1]], [[1], [1 << 32]]):
        odd = W.stored("map", block_hashes=[1, 2], token_ids=list(range(2 * B)), block_size=B,
                       lookahead_token_ids=bad)  # fmt: skip
        got = dec(hash_format=2, fast=fast).decode(W.batch([odd]))  # unusable: dropped as before
        assert got.batch.ext_hashes.tolist() == [1], bad
        assert got.batch.tokens.tolist() == list(range(B + 1))


@pytest.mark.parametrize("fast", [True, False])
def test_origin_says_whether_a_store_is_new_blocks_or_a_report(fast: bool) -> None:
    """The proposed ``BlockStored.origin`` (``NEW`` / ``REUSED``) reaches the pool as
    ``EventBatch.origin``; a stream without it has no origin array (the pool infers)."""
    def ev(origin: str | None, h: int) -> Any:
        return W.stored("map", block_hashes=[h], token_ids=list(range(B)), block_size=B,
                        origin=origin)  # fmt: skip

    got = dec(fast=fast).decode(W.batch([ev("NEW", 1), ev(None, 2), W.removed("map", [1]),
                                        ev("REUSED", 3), ev("other", 4)])).batch  # fmt: skip
    assert got.origin.tolist() == [ORIGIN_NEW, ORIGIN_UNKNOWN, 0, ORIGIN_REPORT, ORIGIN_UNKNOWN]
    plain = dec(fast=fast).decode(W.batch([ev(None, 1)])).batch
    assert plain.origin.shape == (0,)


def test_lora_salt_matches_xxhash() -> None:
    ev = W.stored(
        "map", block_hashes=[1], token_ids=list(range(B)), block_size=B, lora_name="adapter-a"
    )
    res = dec().decode(
        W.batch(
            [
                ev,
                W.stored(
                    "map", block_hashes=[2], token_ids=list(range(B)), block_size=B, lora_name=""
                ),
            ]
        )
    )
    want = (1337 + xxhash.xxh3_64_intdigest(b"adapter-a", seed=0)) % 2**64
    assert res.batch.salt.tolist() == [want, 1337]
    assert res.batch.ns_part.tolist() == [0, 0]


def test_cache_salt_ignored_by_default_and_namespaced_on_option() -> None:
    root = W.stored(
        "map",
        block_hashes=[1, 2],
        token_ids=list(range(2 * B)),
        block_size=B,
        lora_name="adapter-a",
        extra_keys=[["adapter-a", "tenant-7"], ["adapter-a"]],
    )
    child = W.stored(
        "map", block_hashes=[3], parent_block_hash=2, token_ids=list(range(B)), block_size=B
    )
    payload = W.batch([root, child])
    off = dec().decode(payload).batch
    assert off.salt.tolist() == [salt_of("adapter-a"), 1337]
    assert off.ns_part.tolist() == [0, 0] and off.ns_inherit.tolist() == [False, True]
    on = dec(options=DecodeOptions(cache_salt_namespacing=True)).decode(payload).batch
    ns = xxhash.xxh3_64_intdigest(b"tenant-7", seed=1)
    assert on.salt.tolist() == [salt_of("adapter-a", "tenant-7"), 1337]
    assert on.ns_part.tolist() == [ns, 0]
    assert on.ns_inherit.tolist() == [False, True]


def test_children_of_an_explicitly_salted_root_take_its_namespace() -> None:
    """A producer that salts a request's first store only (a map-form ``cache_salt``): its
    children, sent unsalted in later messages that the walker reads, stay in the salted chain
    with namespacing off, as Dynamo keeps them, so a query with the salt reaches every block."""
    d = dec()
    pool = Pool(1024, 0x5DEECE66D1B54A33, B, 1)
    m = pool.add_member(1, 0)
    toks = list(range(100, 100 + 3 * B))
    root = W.stored("map", block_hashes=[1], token_ids=toks[:B], block_size=B,
                    cache_salt="tenant-7")  # fmt: skip
    child = W.stored("map", block_hashes=[2], parent_block_hash=1, token_ids=toks[B : 2 * B],
                     block_size=B)  # fmt: skip
    grandchild = W.stored("array", block_hashes=[3], parent_block_hash=2,
                          token_ids=toks[2 * B :], block_size=B)  # fmt: skip
    kinds = []
    for ev in (root, child, grandchild):
        res = d.decode(W.batch([ev]), packed=True)
        kinds.append(type(res.batch).__name__)
        assert not pool.apply(m, res.batch).errors
    assert kinds == ["EventBatch", "PackedBatch", "PackedBatch"]  # the walker reads children
    salted = sequence_hashes(block_hashes(toks, B, request_salt(None, "tenant-7"))).tolist()
    assert pool.lineage(m) == dict(zip([1, 2, 3], salted, strict=True))
    # an unsalted chain beside it keeps no namespace: a query without the salt reaches it
    pool.apply(m, d.decode(W.batch([W.stored("map", block_hashes=[11], token_ids=toks[:B],
                                             block_size=B)]), packed=True).batch)  # fmt: skip
    pool.apply(m, d.decode(W.batch([W.stored("map", block_hashes=[12], parent_block_hash=11,
                                             token_ids=toks[B : 2 * B], block_size=B)]),
                           packed=True).batch)  # fmt: skip
    plain = sequence_hashes(block_hashes(toks[: 2 * B], B, 1337)).tolist()
    assert [pool.lineage(m)[11], pool.lineage(m)[12]] == plain


def test_a_cache_salt_equal_to_the_adapter_name_is_still_the_salt() -> None:
    """vLLM's block 0 keys are the LoRA name first, then (multimodal keys and) the salt: a salt
    spelled like the adapter is a salt, and the chain is namespaced by it."""
    ev = W.stored("map", block_hashes=[1], token_ids=list(range(B)), block_size=B,
                  lora_name="ad", extra_keys=[["ad", "ad"]])  # fmt: skip
    on = dec(options=DecodeOptions(cache_salt_namespacing=True)).decode(W.batch([ev])).batch
    assert on.salt.tolist() == [salt_of("ad", "ad")]
    assert on.ns_part.tolist() == [xxhash.xxh3_64_intdigest(b"ad", seed=1)]
    plain = W.stored("map", block_hashes=[1], token_ids=list(range(B)), block_size=B,
                     lora_name="ad", extra_keys=[["ad"]])  # fmt: skip
    off = dec(options=DecodeOptions(cache_salt_namespacing=True)).decode(W.batch([plain])).batch
    assert off.salt.tolist() == [salt_of("ad")] and off.ns_part.tolist() == [0]


def test_multimodal_extra_keys_option() -> None:
    hexid = "0123456789abcdef" + "f" * 48
    ev = W.stored(
        "map",
        block_hashes=[1, 2],
        token_ids=list(range(2 * B)),
        block_size=B,
        extra_keys=[[["img-b", 0], [hexid, 3], ["", 5]], None],  # an empty identifier: none
    )
    rm = W.removed("map", [9])
    off = dec().decode(W.batch([ev, rm])).batch
    assert off.mm_off.size == 0
    on = dec(options=DecodeOptions(multimodal_hashing=True)).decode(W.batch([ev, rm])).batch
    assert on.mm_off.tolist() == [0, 2, 2, 2]
    assert on.mm.tolist() == sorted(
        [0x0123456789ABCDEF, xxhash.xxh3_64_intdigest(b"img-b", seed=0)]
    )


def test_envelope_variants_and_dp_rank() -> None:
    ev = ["BlockRemoved", [5], "GPU"]
    assert dec().decode(enc([1, [ev]])).dp_rank == 0  # 0.9 two-element envelope, int ts
    assert dec(dp_rank=3).decode(enc([1.5, [ev], None, "extra", 7])).dp_rank == 3
    with pytest.raises(DpRankMismatchError):
        dec(dp_rank=1).decode(enc([1.5, [ev], 2]))
    for bad in (enc({"ts": 1}), enc([1.0]), enc([1.0, 5, 0]), enc(["x", [], 0]), enc(7)):
        with pytest.raises(MalformedEnvelopeError):
            dec().decode(bad)
    for bad in (b"", b"\xc1", enc([1.0, [ev], 0])[:-2], enc([1.0, [], 0]) + b"\x00"):
        with pytest.raises(MalformedPayloadError):
            dec().decode(bad)


def _int_encodings(v: int) -> list[bytes]:
    out = []
    if 0 <= v <= 0x7F:
        out.append(bytes([v]))
    for tag, w, signed in (
        (0xCC, 1, False),
        (0xCD, 2, False),
        (0xCE, 4, False),
        (0xCF, 8, False),
        (0xD0, 1, True),
        (0xD1, 2, True),
        (0xD2, 4, True),
        (0xD3, 8, True),
    ):
        with contextlib.suppress(OverflowError):
            out.append(bytes([tag]) + v.to_bytes(w, "big", signed=signed))
    return out


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.tuples(st.integers(-(2**40), 2**40), st.integers(0, 8)), min_size=B, max_size=3 * B)
)
def test_every_int_width_parses_like_msgspec(vals: list[tuple[int, int]]) -> None:
    body = b""
    plain: list[int] = []
    for v, pick in vals:
        encs = _int_encodings(v)
        body += encs[pick % len(encs)]
        plain.append(v)
    arr = (bytes([0xDC]) + len(vals).to_bytes(2, "big")) + body
    # splice the hand-encoded token array into a real event
    head = enc(["BlockStored", [1, 2, 3], None])
    tail = enc(B)[0:] + enc(None) + enc("GPU")
    event = bytes([0x97]) + head[1:] + arr + tail
    payload = bytes([0x93]) + enc(1.0) + bytes([0x91]) + event + enc(0)
    res = dec().decode(payload)
    k = min(3, len(plain) // B)
    need = plain[: k * B]
    if all(0 <= x < 2**32 for x in need):
        assert res.batch.tokens.tolist() == need
        assert res.stats.malformed_events == 0
    else:
        assert res.batch.n_events == 0 and res.stats.malformed_events == 1
        assert res.stats.drops == {"malformed_event": 1}


# ---- fuzz: nothing but typed DecodeError escapes ------------------------------------------------
def _check_consistent(res: Any) -> None:
    b = res.batch
    n = b.n_events
    assert b.blk_off.shape == (n + 1,) and b.tok_off.shape == (n + 1,)
    assert b.blk_off[-1] == b.ext_hashes.shape[0] and b.tok_off[-1] == b.tokens.shape[0]
    assert np.all(np.diff(b.blk_off) >= 0) and np.all(np.diff(b.tok_off) >= 0)
    for i in range(n):
        nb = b.blk_off[i + 1] - b.blk_off[i]
        nt = b.tok_off[i + 1] - b.tok_off[i]
        if b.ops[i] == OP_STORE:
            assert nb >= 1 and nt == nb * B
        else:
            assert nt == 0


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=300))
def test_fuzz_random_bytes(data: bytes) -> None:
    try:
        _check_consistent(dec().decode(data))
    except DecodeError as exc:
        assert not isinstance(exc, InternalDecodeError), exc


_VALID = W.batch(
    [
        W.stored(
            "map",
            block_hashes=[1, 2],
            parent_block_hash=9,
            token_ids=list(range(2 * B)),
            block_size=B,
            lora_name="a",
        ),
        W.removed("map", [3]),
        W.stored(
            "array",
            block_hashes=[b"\x01" * 32],
            parent_block_hash=None,
            token_ids=[[1, 2]] * B,
            block_size=B,
        ),
        W.cleared("array"),
    ]
)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, len(_VALID) - 1), st.integers(0, 255)), min_size=1, max_size=6
    ),
    st.integers(0, len(_VALID)),
)
def test_fuzz_mutated_valid_payload(muts: list[tuple[int, int]], cut: int) -> None:
    data = bytearray(_VALID)
    for pos, val in muts:
        data[pos] = val
    try:
        _check_consistent(dec().decode(bytes(data[: max(cut, 1)] if cut < 8 else data)))
    except DecodeError as exc:
        assert not isinstance(exc, InternalDecodeError), exc


# ---- numba walker == msgspec path ---------------------------------------------------------------
def _outcome(d: Decoder, payload: bytes) -> tuple[str, Any]:
    try:
        r = d.decode(payload)
    except DecodeError as exc:
        return "error", type(exc).__name__
    st_ = r.stats
    b = r.batch
    return "ok", (
        r.dp_rank,
        r.ts if r.ts == r.ts else "nan",  # a NaN time stamp (a mutated float) equals no float
        [
            getattr(b, f).tolist()
            for f in (
                "ops",
                "parent",
                "has_parent",
                "salt",
                "ns_part",
                "ns_inherit",
                "blk_off",
                "ext_hashes",
                "tok_off",
                "tokens",
                "mm_off",
                "mm",
            )
        ],
        (
            st_.stored,
            st_.removed,
            st_.cleared,
            st_.unknown_tags,
            st_.unknown_fields,
            st_.malformed_events,
            st_.eagle_bigram,
            st_.truncated,
            st_.drops,
        ),
    )


@pytest.mark.parametrize("eagle", [False, True])
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_walker_equals_msgspec_path(eagle: bool, data: st.DataObject) -> None:
    evs = data.draw(st.lists(events(False), max_size=8))
    payload = W.batch([to_wire(e, era) for e, era in evs], dp=data.draw(st.sampled_from([0, None])))
    fast = dec(hash_format=2 if eagle else 1)
    slow = dec(hash_format=2 if eagle else 1, fast=False)
    res = fast.decode(payload)
    # clean vLLM output never leaves the walker (an unknown medium string is left to msgspec,
    # and so is a clear naming a medium, which vLLM never sends)
    assert res.stats.slow_path == int(
        any(e.get("medium") == "odd" or (e["kind"] == "clear" and e["medium"]) for e, _ in evs)
    )
    assert _outcome(dec(hash_format=2 if eagle else 1), payload) == _outcome(slow, payload)
    # a second message on the same decoders: learned group state must agree too
    assert _outcome(fast, payload) == _outcome(slow, payload)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=st.data(),
    muts=st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), min_size=1, max_size=4),
)
def test_walker_equals_msgspec_path_on_mutations(
    data: st.DataObject, muts: list[tuple[int, int]]
) -> None:
    evs = data.draw(st.lists(events(False), min_size=1, max_size=5))
    buf = bytearray(W.batch([to_wire(e, era) for e, era in evs]))
    for pos, val in muts:
        buf[pos % len(buf)] = val
    payload = bytes(buf)
    assert _outcome(dec(), payload) == _outcome(dec(fast=False), payload)


@settings(max_examples=300, deadline=None)
@given(
    st.one_of(
        st.binary(max_size=12),
        st.text(max_size=6).map(lambda t: t.encode("utf-8", "surrogatepass")),
    )
)
def test_walker_utf8_check_matches_msgspec(raw: bytes) -> None:
    from kvrelay.ingest.fastwalk import _utf8_ok

    try:
        msgspec.msgpack.decode(
            enc(raw.decode("latin-1"))[:0] + bytes([0xD9, len(raw)]) + raw, type=str
        )
        want = True
    except msgspec.DecodeError:
        want = False
    assert _utf8_ok(np.frombuffer(raw, dtype=np.uint8), 0, len(raw)) == want


def test_mm_hash_takes_the_digest_prefix_only_for_64_hex_digits() -> None:
    from kvrelay.ingest.decoder import mm_hash

    digest = "0123456789abcdef" + "f" * 48
    assert mm_hash(digest) == 0x0123456789ABCDEF
    assert mm_hash(digest.upper()) == 0x0123456789ABCDEF
    for other in (
        "0x" + digest[2:],  # int(..., 16) would accept the prefix
        "0123_4567_89ab_cd" + "f" * 47,  # … and underscores
        " " + digest[1:],  # … and surrounding spaces
        "０" * 64,  # … and non-ASCII digits
        digest[:63] + "g",  # one non-hex character past the prefix
        digest[:63],  # 63 characters
        "image-42",
    ):
        assert mm_hash(other) == xxhash.xxh3_64_intdigest(other.encode("utf-8"), seed=0), other


def _fields(batch: Any) -> dict[str, Any]:
    return {k: np.array(getattr(batch, k), copy=True) for k in
            ("ops", "parent", "has_parent", "salt", "blk_off", "ext_hashes", "tok_off", "tokens")}


def test_walker_workspace_reuse_never_overwrites_a_live_batch() -> None:
    """The walker reuses its workspace only while nothing decoded from it is alive: a batch kept
    across the next decode keeps its contents, and one dropped lets the next decode reuse it."""
    d = dec()
    msgs = [
        W.batch([W.stored("map", block_hashes=[10 * i + j for j in range(1, 4)],
                          parent_block_hash=None, token_ids=list(range(i, i + 3 * B)),
                          block_size=B)])
        for i in range(1, 5)
    ]  # fmt: skip
    first = d.decode(msgs[0]).batch
    assert first.normalized  # the walker's result: views of its workspace
    kept = _fields(first)
    second = d.decode(msgs[1]).batch
    for k, v in _fields(first).items():
        np.testing.assert_array_equal(v, kept[k], err_msg=k)
    assert second.ext_hashes.tolist() == [21, 22, 23]
    base = id(second.ext_hashes.base)  # the workspace itself (an id: a reference would hold it)
    del first, second
    third = d.decode(msgs[2]).batch
    assert id(third.ext_hashes.base) == base  # nothing alive held it: reused
    assert third.ext_hashes.tolist() == [31, 32, 33]
    assert third.tokens.tolist() == list(range(3, 3 + 3 * B))
