"""SGLang event-stream conformance, one row per release shape (docs/contract.md §21).

The encoder here is written from the field tables of SGLang's released event structs (which
field appears in which release, which ones have a default, and how each release's msgspec
settings lay a struct out: positional arrays that drop trailing defaults up to 0.5.16, every
slot present in 0.5.17-0.5.19, tagged maps that leave defaults out from 0.5.20), not from
kvrelay's decoder nor SGLang's code: every release's shape must decode, on both decoder paths,
to the block state the format names.
"""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
import xxhash

from kvrelay.ingest.decoder import HASH_FORMAT_EAGLE, Decoder
from kvrelay.ingest.errors import DpRankMismatchError
from kvrelay.ingest.frames import END_SEQ, check_live_sglang, check_replay
from kvrelay.ingest.kinds import EngineKind
from kvrelay.pool.batch import OP_CLEAR, OP_REMOVE, OP_STORE, as_events

B = 4
M64 = (1 << 64) - 1
enc = msgspec.msgpack.encode
Version = tuple[int, int, int]

# (field, first release, last release or None, has a default); fields without a default are
# always sent. ``metadata`` is the salted store's own struct (0.5.18-0.5.19): present only
# when the request is salted, a ``{"cache_salt": str}`` map right after ``medium``.
STORE_FIELDS: list[tuple[str, Version, Version | None, bool]] = [
    ("block_hashes", (0, 4, 7), None, False), ("parent_block_hash", (0, 4, 7), None, False),
    ("token_ids", (0, 4, 7), None, False), ("block_size", (0, 4, 7), None, False),
    ("lora_id", (0, 4, 7), None, False), ("medium", (0, 5, 9), None, True),
    ("metadata", (0, 5, 18), (0, 5, 19), False), ("cache_salt", (0, 5, 20), None, True),
    ("session_id", (0, 5, 20), None, True), ("lora_name", (0, 5, 22), None, True),
]  # fmt: skip
REMOVE_FIELDS: list[tuple[str, Version, Version | None, bool]] = [
    ("block_hashes", (0, 4, 7), None, False), ("medium", (0, 5, 9), None, True),
]  # fmt: skip
EVERY_SLOT = (0, 5, 17)  # omit_defaults dropped: every positional slot sent, nil when unset
MAP_ERA = (0, 5, 20)  # tagged maps, defaults left out
TOPIC_IN_REPLAY = (0, 5, 22)  # replay replies carry the topic frame

RELEASES: list[Version] = [(0, 4, 7), (0, 5, 6), (0, 5, 9), (0, 5, 16), (0, 5, 17), (0, 5, 18),
                           (0, 5, 19), (0, 5, 20), (0, 5, 21), (0, 5, 22), (0, 5, 23)]  # fmt: skip


def _fields(v: Version, schema: list[tuple[str, Version, Version | None, bool]],
            values: dict[str, Any]) -> list[tuple[str, bool]]:  # fmt: skip
    out = []
    for name, since, until, default in schema:
        if since <= v and (until is None or v <= until):
            if name == "metadata" and values.get("cache_salt") is None:
                continue  # the unsalted store is the base struct, without the slot
            out.append((name, default))
    return out


def _event(v: Version, tag: str, schema: list[tuple[str, Version, Version | None, bool]],
           values: dict[str, Any]) -> bytes:  # fmt: skip
    """One event as that release's msgspec struct writes it."""
    vals = dict(values)
    if "metadata" in [f for f, *_ in schema] and vals.get("cache_salt") is not None:
        vals["metadata"] = {"cache_salt": vals["cache_salt"]}
    fields = _fields(v, schema, vals)
    if v >= MAP_ERA:
        return enc({"type": tag, **{f: vals.get(f) for f, d in fields
                                    if not d or vals.get(f) is not None}})  # fmt: skip
    slots = [vals.get(f) for f, _ in fields]
    if v < EVERY_SLOT:  # array_like + omit_defaults: the trailing run of unset defaults goes
        while fields and fields[-1][1] and slots[-1] is None:
            fields, slots = fields[:-1], slots[:-1]
    return enc([tag, *slots])


def _store(v: Version, **over: Any) -> bytes:
    vals: dict[str, Any] = {
        "block_hashes": [-1, -(1 << 63) + 5], "parent_block_hash": -123456789,
        "token_ids": list(range(100, 100 + 2 * B)), "block_size": B, "lora_id": None,
        "medium": "GPU",
    }  # fmt: skip
    vals.update(over)
    return _event(v, "BlockStored", STORE_FIELDS, vals)


def _remove(v: Version, hs: list[int], medium: str | None = "GPU") -> bytes:
    return _event(v, "BlockRemoved", REMOVE_FIELDS, {"block_hashes": hs, "medium": medium})


def _clear(v: Version) -> bytes:
    return enc({"type": "AllBlocksCleared"}) if v >= MAP_ERA else enc(["AllBlocksCleared"])


def _batch(events: list[bytes], rank: int = 0) -> bytes:
    """``[ts, events, attn_dp_rank]``: the publisher fills in its own rank when the batch has
    none, so every release sends three elements."""
    n = len(events)
    return b"\x93" + enc(1700000000.25) + b"\xdc" + n.to_bytes(2, "big") + b"".join(events) + \
        enc(rank)  # fmt: skip


def _decode(payload: bytes, fast: bool, rank: int = 0, **kw: Any) -> Any:
    d = Decoder(kv_block_size=B, dp_rank=rank, fast=fast, kind=EngineKind.SGLANG, **kw)
    return d.decode(payload)


def _xxh(s: str, seed: int) -> int:
    return xxhash.xxh3_64_intdigest(s.encode(), seed=seed)


def _salt(lora: str | None, ns: str | None) -> int:
    """§7.1 from its formula: ``1337 + xxh3(lora, 0) + xxh3(ns, 1)``, absent terms 0."""
    return (1337 + (_xxh(lora, 0) if lora else 0) + (_xxh(ns, 1) if ns else 0)) & M64


def _ids(v: Version) -> str:
    return ".".join(map(str, v))


@pytest.mark.parametrize("fast", [True, False])
@pytest.mark.parametrize("v", RELEASES, ids=_ids)
def test_every_release_shape_decodes_to_the_state_it_names(v: Version, fast: bool) -> None:
    payload = _batch([_store(v), _remove(v, [-(1 << 63) + 5]), _clear(v)])
    res = _decode(payload, fast)
    b = as_events(res.batch)
    assert res.dp_rank == 0 and res.ts == 1700000000.25
    assert b.ops.tolist() == [OP_STORE, OP_REMOVE, OP_CLEAR]
    # signed i64 hashes and parents read as their u64 two's complement
    assert b.ext_hashes.tolist() == [M64, (1 << 63) + 5, (1 << 63) + 5]
    assert b.has_parent.tolist()[0] and b.parent.tolist()[0] == (-123456789) & M64
    assert b.tokens.tolist() == list(range(100, 100 + 2 * B))
    assert b.salt.tolist()[0] == 1337 and b.ns_part.tolist()[0] == 0
    assert res.stats.unknown_fields == 0 and res.stats.drops == {}
    assert res.stats.slow_path == (0 if fast else 1)  # the walker reads every release's shape


@pytest.mark.parametrize("fast", [True, False])
@pytest.mark.parametrize("v", RELEASES, ids=_ids)
def test_request_salt_and_adapter_name_where_the_release_carries_them(
    v: Version, fast: bool
) -> None:
    """0.5.18 on: the salt of a salted request rides on each of its stores, root or not, and is
    its namespace; 0.5.22 on: the adapter's public name. Earlier shapes carry neither."""
    ev = _store(v, cache_salt="tenant-a", session_id="s-1", lora_name="adapter-a")
    b = as_events(_decode(_batch([ev]), fast).batch)
    salted = v >= (0, 5, 18)
    lora = "adapter-a" if v >= (0, 5, 22) else None
    assert b.ns_part.tolist() == [_xxh("tenant-a", 1) if salted else 0]
    assert b.salt.tolist() == [_salt(lora, "tenant-a" if salted else None)]
    assert b.ext_hashes.tolist() == [M64, (1 << 63) + 5]


@pytest.mark.parametrize("fast", [True, False])
@pytest.mark.parametrize("v", [r for r in RELEASES if r >= (0, 5, 9)], ids=_ids)
@pytest.mark.parametrize(
    ("medium", "reason"),
    [("CPU_PINNED", "medium_host_pinned"), ("DISK", "medium_disk"),
     ("EXTERNAL", "medium_external")],
)  # fmt: skip
def test_host_and_storage_tiers_never_reach_the_gpu_record(
    v: Version, medium: str, reason: str, fast: bool
) -> None:
    res = _decode(_batch([_store(v, medium=medium), _remove(v, [-1], medium)]), fast)
    assert as_events(res.batch).ops.tolist() == []
    assert res.stats.drops == {reason: 2}


@pytest.mark.parametrize("fast", [True, False])
@pytest.mark.parametrize("v", RELEASES, ids=_ids)
@pytest.mark.parametrize("pages", [1, 2])
def test_eagle_bigram_pages(v: Version, pages: int, fast: bool) -> None:
    """With EAGLE a page's key is ``page_size`` pairs ``(t[j], t[j+1])`` (msgpack arrays), and
    contiguous pages of one node come as one store (newest) or one store per page: B pairs span
    B + 1 tokens, the window an EAGLE block hashes."""
    toks = list(range(200, 200 + pages * B + 1))
    pairs = [[toks[j], toks[j + 1]] for j in range(pages * B)]
    hs = [-(i + 7) for i in range(pages)]
    res = _decode(_batch([_store(v, block_hashes=hs, token_ids=pairs, parent_block_hash=None)]),
                  fast, hash_format=HASH_FORMAT_EAGLE)  # fmt: skip
    b = as_events(res.batch)
    assert b.ext_hashes.tolist() == [h & M64 for h in hs]
    assert b.tokens.tolist() == toks
    assert res.stats.eagle_bigram == 1 and res.stats.drops == {}


@pytest.mark.parametrize("fast", [True, False])
@pytest.mark.parametrize("v", RELEASES, ids=_ids)
@pytest.mark.parametrize("page", [1, 8])
def test_page_size_other_than_the_pools_block_size_is_dropped(
    v: Version, page: int, fast: bool
) -> None:
    """``block_size`` is SGLang's page size (default 1); the pool's must equal it."""
    n = 16 // page
    ev = _store(v, block_hashes=[-(i + 1) for i in range(n)], token_ids=list(range(16)),
                block_size=page, parent_block_hash=None)  # fmt: skip
    res = _decode(_batch([ev]), fast)
    assert as_events(res.batch).ops.tolist() == []
    assert res.stats.drops == {"block_size_mismatch": 1}


@pytest.mark.parametrize("fast", [True, False])
def test_the_batch_names_the_publishers_port_rank(fast: bool) -> None:
    """The rank in the envelope is the publisher's port offset (attention-DP rank, or the
    replica in pure DP from 0.5.15): it must be the socket's."""
    v = RELEASES[-1]
    assert _decode(_batch([_clear(v)], rank=1), fast, rank=1).dp_rank == 1
    with pytest.raises(DpRankMismatchError):
        _decode(_batch([_clear(v)], rank=0), fast, rank=1)


@pytest.mark.parametrize("v", RELEASES, ids=_ids)
def test_live_and_replay_frames(v: Version) -> None:
    """Live ``[topic, seq, payload]``; replay replies as a DEALER reads them: ``[b"", seq,
    payload]``, from 0.5.22 ``[b"", topic, seq, payload]``, each ended by an all-0xFF sequence
    with an empty payload (and, from 0.5.22, an empty topic)."""
    payload = _batch([_clear(v)])
    seq = (7).to_bytes(8, "big")
    assert check_live_sglang([b"kv-events", seq, payload], b"kv-events") == (7, payload, None)
    head = [b"", b"kv-events"] if v >= TOPIC_IN_REPLAY else [b""]
    end = [b"", b""] if v >= TOPIC_IN_REPLAY else [b""]
    assert check_replay([*head, seq, payload], b"kv-events") == (7, payload)
    assert check_replay([*end, END_SEQ, b""], b"kv-events") is None
