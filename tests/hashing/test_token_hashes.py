"""§7 token → block → sequence hashes: golden vectors and the pure-Python twin as oracle."""

from __future__ import annotations

import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from kvrelay._proto.dynamo.kvrelay import v1 as pb
from kvrelay.hashing._reference import (
    ref_block_hash,
    ref_block_hashes,
    ref_salt,
    ref_sequence_hashes,
)
from kvrelay.hashing.tokens import (
    HashFormat,
    TokenHashError,
    block_hashes,
    namespace_part,
    request_salt,
    sequence_hashes,
)


def _le32(tokens: list[int]) -> bytes:
    return b"".join(t.to_bytes(4, "little") for t in tokens)


def test_hash_format_matches_proto() -> None:
    assert HashFormat(pb.KvQueryHashFormat.DYNAMO_EAGLE_V1) is HashFormat.EAGLE
    assert HashFormat.STANDARD == pb.KvQueryHashFormat.DYNAMO_STANDARD_V1.value == 1
    assert HashFormat.EAGLE == pb.KvQueryHashFormat.DYNAMO_EAGLE_V1.value == 2


def test_a1_compute_block_hash() -> None:
    assert xxhash.xxh3_64_intdigest(b"test data", 1337) == 13226331709069118873
    assert request_salt(None, None) == 1337


def test_a1_chain_vector() -> None:
    local = np.array([0x0123456789ABCDEF, 0x1111222233334444, 0xDEADBEEFCAFEBABE], np.uint64)
    assert sequence_hashes(local).tolist() == [
        0x0123456789ABCDEF,
        0x98E7E55F299CF592,
        0x65D53B99C5252D19,
    ]


@pytest.mark.parametrize("b", [11, 32, 64])
def test_a1_block_counts(b: int) -> None:
    for n, expected in [(b, 1), (b + 1, 1), (2 * b + 1, 2), (b - 1, 0)]:
        assert block_hashes(np.arange(n, dtype=np.uint32), b, 1337).size == expected


def test_a1_eagle_windows() -> None:
    toks = list(range(6))
    eagle = block_hashes(np.array(toks, np.uint32), 2, 1337, eagle=True)
    assert eagle.tolist() == [
        xxhash.xxh3_64_intdigest(_le32([0, 1, 2]), 1337),
        xxhash.xxh3_64_intdigest(_le32([2, 3, 4]), 1337),
    ]
    assert block_hashes(np.array(toks, np.uint32), 2, 1337).size == 3


def test_a1_lora_contract() -> None:
    salt = request_salt("adapter-a", None)
    assert salt == (1337 + xxhash.xxh3_64_intdigest(b"adapter-a", 0)) % 2**64
    got = block_hashes(np.arange(4, dtype=np.uint32), 4, salt)
    assert got.tolist() == [xxhash.xxh3_64_intdigest(_le32([0, 1, 2, 3]), salt)]
    assert got[0] != block_hashes(np.arange(4, dtype=np.uint32), 4, 1337)[0]


def test_vllm_events_local_vectors() -> None:
    t32 = np.arange(32, dtype=np.uint32)
    bh = block_hashes(t32, 16, request_salt(None, None))
    assert bh.tolist() == [0xD47A8F41C833328A, 0xD43939178ABD00DB]
    assert sequence_hashes(bh).tolist() == [0xD47A8F41C833328A, 0xBF15DFFB16447F38]
    one = block_hashes(np.array([1, 2, 3, 4], np.uint32), 4, 1337)
    assert one.tolist() == [0xCB38E4D7FB2DCA5C]
    assert sequence_hashes(one).tolist() == [0xCB38E4D7FB2DCA5C]
    lora = block_hashes(t32, 16, request_salt("adapter-a", None))
    assert lora.tolist() == [0xF1E20C61558F16BB, 0x17EAB4607C24352E]


def test_reference_relay_vector() -> None:
    assert block_hashes(np.arange(1, 17, dtype=np.uint32), 16, 1337).tolist() == [
        16863443419780771464
    ]


def test_salt_terms_and_empty_is_absent() -> None:
    assert request_salt("", "") == 1337
    assert namespace_part(None) == namespace_part("") == 0
    ns = xxhash.xxh3_64_intdigest("tenant-ü".encode(), 1)
    assert namespace_part("tenant-ü") == ns
    lora = xxhash.xxh3_64_intdigest(b"x", 0)
    assert request_salt("x", "tenant-ü") == (1337 + lora + ns) % 2**64
    assert request_salt(None, "tenant-ü") == (1337 + ns) % 2**64


@settings(max_examples=100, deadline=None)
@given(lora=st.one_of(st.none(), st.text(max_size=20)), ns=st.one_of(st.none(), st.text()))
def test_salt_vs_reference(lora: str | None, ns: str | None) -> None:
    assert request_salt(lora, ns) == ref_salt(lora, ns)


@settings(max_examples=100, deadline=None)
@given(
    toks=st.lists(st.integers(0, 2**32 - 1), max_size=200),
    bs=st.integers(1, 40),
    salt=st.integers(0, 2**64 - 1),
    eagle=st.booleans(),
)
def test_block_and_sequence_vs_reference(toks: list[int], bs: int, salt: int, eagle: bool) -> None:
    got = block_hashes(np.array(toks, dtype=np.uint32), bs, salt, eagle)
    exp = ref_block_hashes(toks, bs, salt, eagle)
    assert got.tolist() == exp
    assert sequence_hashes(got).tolist() == ref_sequence_hashes(exp)
    # A Python list of ints is accepted too and gives the same answer.
    assert block_hashes(toks, bs, salt, eagle).tolist() == exp


def test_mm_reference_sorts_values() -> None:
    from kvrelay.hashing.xxh3 import xxh3_64_tokens_mm

    toks = np.arange(16, dtype=np.uint32)
    mm = np.array([9, 3], dtype=np.uint64)
    expect = ref_block_hash(toks.tolist(), 77, mm=[9, 3])
    assert int(xxh3_64_tokens_mm(toks, 0, 16, np.sort(mm), 0, 2, np.uint64(77))) == expect


def test_readonly_and_strided_token_arrays() -> None:
    base = np.arange(64, dtype=np.uint32)
    ro = np.frombuffer(base.tobytes(), dtype=np.uint32)
    assert not ro.flags.writeable
    exp = ref_block_hashes(base.tolist(), 16, 1337, False)
    assert block_hashes(ro, 16, 1337).tolist() == exp
    strided = base[::2]
    assert block_hashes(strided, 8, 99).tolist() == ref_block_hashes(strided.tolist(), 8, 99, False)
    assert block_hashes(base.astype(np.int64), 16, 1337).tolist() == exp


def test_bad_inputs_are_typed_errors() -> None:
    with pytest.raises(TokenHashError):
        block_hashes(np.array([1, -1]), 1, 1337)
    with pytest.raises(TokenHashError):
        block_hashes(np.array([2**32]), 1, 1337)
    with pytest.raises(TokenHashError):
        block_hashes(np.array([1.5]), 1, 1337)
    with pytest.raises(TokenHashError):
        block_hashes(np.arange(4, dtype=np.uint32), 0, 1337)
    with pytest.raises(TokenHashError):
        block_hashes(np.arange(4, dtype=np.uint32), 2, -1)
    with pytest.raises(TokenHashError):
        block_hashes(np.zeros((2, 2), dtype=np.uint32), 2, 1)
    assert block_hashes(np.array([], dtype=np.int64), 4, 1337).size == 0
    assert block_hashes(np.array([], dtype=np.uint32), 4, 1337, eagle=True).size == 0
    assert sequence_hashes(np.array([], dtype=np.uint64)).size == 0
