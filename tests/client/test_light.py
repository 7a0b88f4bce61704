"""The SDK stays light: no numba, no relay internals; its own hashing and CKF probe agree with the
relay's numba kernels, the pure-Python reference and Dynamo's golden vectors."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvrelay.client import hashes, probe
from kvrelay.hashing import _reference as ref
from kvrelay.hashing import tokens as kernels
from kvrelay.pool import ckf

U64 = (1 << 64) - 1


def test_importing_the_sdk_loads_no_numba_and_no_relay_internals() -> None:
    code = (
        "import sys, kvrelay.client;"
        "bad = sorted(m for m in sys.modules if m == 'numba' or m.startswith(('numba.', "
        "'kvrelay.pool', 'kvrelay.service', 'kvrelay.relay', 'kvrelay.ingest', 'kvrelay.ops', "
        "'kvrelay.hashing')));"
        "print(','.join(bad))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_ckf_addressing_golden_vectors() -> None:
    seed = 0x1234_5678_9ABC_DEF0
    for h, fp, a, b in (
        (0, 7750, 587, 372),
        (1, 64153, 348, 36),
        (0x0123456789ABCDEF, 45802, 865, 909),
        (0xFFFFFFFFFFFFFFFF, 31767, 112, 217),
    ):
        assert probe.address(h, seed, 1024) == (fp, a, b)


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, U64),
    log_buckets=st.integers(1, 12),
    n=st.integers(0, 300),
    data=st.data(),
)
def test_probe_matches_the_relay_kernel(
    seed: int, log_buckets: int, n: int, data: st.DataObject
) -> None:
    bc = 1 << log_buckets
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    table = rng.integers(0, 2**64, size=bc, dtype=np.uint64)
    table[rng.random(bc) < 0.3] = 0
    hashes_ = rng.integers(0, 2**64, size=n, dtype=np.uint64)
    # plant some members (a free slot each, first come first served) so hits are exercised too
    used: dict[int, int] = {}
    planted = []
    for i, h in enumerate(hashes_[: n // 2].tolist()):
        fp, a, _b = probe.address(int(h), seed, bc)
        slot = used.get(a, 0)
        if slot < 4:
            used[a] = slot + 1
            table[a] = (int(table[a]) & ~(0xFFFF << (16 * slot))) | (fp << (16 * slot))
            planted.append(i)
    got = probe.contains(table, seed, hashes_)
    want = ckf.contains(table, np.uint64(seed), hashes_)
    assert got.dtype == np.bool_ and np.array_equal(got, want)
    assert got[planted].all()


def test_query_hash_golden_vectors() -> None:
    assert hashes.request_salt(None, None) == 1337
    bh = hashes.block_hashes(np.arange(32), 16, 1337)
    assert bh.tolist() == [0xD47A8F41C833328A, 0xD43939178ABD00DB]
    assert hashes.sequence_hashes(bh).tolist() == [0xD47A8F41C833328A, 0xBF15DFFB16447F38]
    chain = [0x0123456789ABCDEF, 0x1111222233334444, 0xDEADBEEFCAFEBABE]
    assert hashes.sequence_hashes(chain).tolist() == [
        0x0123456789ABCDEF,
        0x98E7E55F299CF592,
        0x65D53B99C5252D19,
    ]
    eagle = hashes.block_hashes(np.arange(6), 2, 1337, eagle=True)
    assert eagle.tolist() == [
        ref.ref_block_hash([0, 1, 2], 1337),
        ref.ref_block_hash([2, 3, 4], 1337),
    ]


@settings(max_examples=80, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 2**32 - 1), max_size=200),
    block_size=st.integers(1, 40),
    eagle=st.booleans(),
    lora=st.one_of(st.none(), st.text(max_size=8)),
    ns=st.one_of(st.none(), st.text(max_size=8)),
)
def test_query_hashes_match_reference_and_kernels(
    tokens: list[int], block_size: int, eagle: bool, lora: str | None, ns: str | None
) -> None:
    salt = hashes.request_salt(lora, ns)
    assert salt == ref.ref_salt(lora, ns) == kernels.request_salt(lora, ns)
    bh = hashes.block_hashes(tokens, block_size, salt, eagle)
    assert bh.tolist() == ref.ref_block_hashes(tokens, block_size, salt, eagle)
    assert (
        bh.tolist()
        == kernels.block_hashes(np.array(tokens, dtype=np.int64), block_size, salt, eagle).tolist()
    )
    seq = hashes.sequence_hashes(bh)
    assert seq.tolist() == ref.ref_sequence_hashes(bh.tolist())
    assert seq.tolist() == kernels.sequence_hashes(bh).tolist()
