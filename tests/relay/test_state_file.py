"""The state-file container: round trips, and every kind of damage is a typed refusal."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import struct
from pathlib import Path

import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from kvrelay.relay import state_file as sf


def _arrays() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    return {
        "table": rng.integers(0, 2**63, size=1000, dtype=np.uint64),
        "cnt": rng.integers(0, 2**31, size=77, dtype=np.uint32),
        "flags": rng.integers(0, 2, size=13).astype(np.bool_),
        "empty": np.zeros(0, dtype=np.int64),
        "grid": np.arange(12, dtype=np.int32).reshape(3, 4),
    }


def test_round_trip_keeps_every_array_and_the_header(tmp_path: Path) -> None:
    arrays = _arrays()
    path = tmp_path / "p.kvstate"
    n = sf.write(path, {"pool": "ns/c/e", "members": [{"seq": 5}]}, arrays)
    assert n == path.stat().st_size
    got = sf.read(path)
    assert got.header == {"pool": "ns/c/e", "members": [{"seq": 5}]}
    assert set(got.arrays) == set(arrays)
    for name, a in arrays.items():
        b = got.arrays[name]
        assert b.dtype == a.dtype and b.shape == a.shape and np.array_equal(a, b)
        assert b.flags.writeable and b.flags.owndata
    assert [p.name for p in tmp_path.iterdir()] == ["p.kvstate"]  # no temporary left


@pytest.mark.parametrize("size", [0, 1, sf.DIRECT_BLOCK - 300, sf.DIRECT_BLOCK - 64,
                                  3 * sf.DIRECT_BLOCK + 4100])  # fmt: skip
def test_direct_and_page_cache_writes_give_the_same_file(tmp_path: Path, size: int) -> None:
    """Past the page cache (``O_DIRECT``: whole aligned blocks, the file cut to its size after
    the last) or through it, the bytes on disk are the same, whatever the size."""
    arrays = _arrays() | {"bulk": np.arange(size, dtype=np.uint8)}
    a, b = tmp_path / "direct.kvstate", tmp_path / "cached.kvstate"
    assert sf.write(a, {"k": 1}, arrays, direct=True) == sf.write(b, {"k": 1}, arrays, direct=False)
    assert a.read_bytes() == b.read_bytes() == sf.encode({"k": 1}, arrays)
    got = sf.read(a)
    assert all(np.array_equal(got.arrays[k], v) for k, v in arrays.items())


def test_a_direct_write_the_file_system_refuses_goes_through_the_page_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Some file systems take ``O_DIRECT`` when the file is opened and refuse the first write
    (``EINVAL``): the writer then goes on through the page cache, nothing lost."""
    refused = []
    real = sf.safe_files.write_all

    def picky(fd: int, data: bytes | memoryview) -> None:
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            refused.append(len(data))
            raise OSError(errno.EINVAL, "Invalid argument")
        real(fd, data)

    monkeypatch.setattr(sf.safe_files, "write_all", picky)
    arrays = _arrays() | {"bulk": np.arange(3 * sf.DIRECT_BLOCK + 7, dtype=np.uint8)}
    path = tmp_path / "p.kvstate"
    sf.write(path, {"k": 2}, arrays)
    assert refused == [sf.DIRECT_BLOCK], "one direct write tried, then the page cache"
    assert path.read_bytes() == sf.encode({"k": 2}, arrays)


def test_a_direct_write_refused_half_way_goes_on_with_the_rest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A direct write that wrote part of its block, then was refused (``EINVAL``): the page
    cache takes only the rest. Written again from the block's start, the file held those bytes
    twice, shifted everything after them, and was then refused as corrupt at the next start."""
    real = sf.safe_files.write_all
    calls = []

    def half(fd: int, data: bytes | memoryview) -> None:
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT and not calls:
            calls.append(len(data))
            k = len(data) // 2
            _set_flag(fd, False)  # the short write (unaligned memory would be refused direct)
            assert os.write(fd, bytes(data[:k])) == k
            _set_flag(fd, True)
            exc = OSError(errno.EINVAL, "Invalid argument")
            exc.written = k  # type: ignore[attr-defined]
            raise exc
        real(fd, data)

    monkeypatch.setattr(sf.safe_files, "write_all", half)
    monkeypatch.setattr(sf, "_set_direct", lambda fd, on: _set_flag(fd, on))
    arrays = _arrays() | {"bulk": np.arange(3 * sf.DIRECT_BLOCK + 7, dtype=np.uint8)}
    path = tmp_path / "p.kvstate"
    sf.write(path, {"k": 3}, arrays)
    assert calls == [sf.DIRECT_BLOCK]
    assert path.read_bytes() == sf.encode({"k": 3}, arrays)


def _set_flag(fd: int, on: bool) -> bool:
    """``O_DIRECT`` as a flag only (the test's file system may refuse the real thing): what the
    writer asks for is what it gets."""
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, (flags | os.O_DIRECT) if on else (flags & ~os.O_DIRECT))
    except OSError:
        return False
    return bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT) == on


@settings(max_examples=60, deadline=None)
@given(cut=st.floats(0.0, 0.9999))
def test_any_truncation_is_refused(cut: float) -> None:
    data = sf.encode({"x": 1}, _arrays())
    with pytest.raises(sf.StateFileError):
        sf.decode(data[: int(len(data) * cut)])


@settings(max_examples=60, deadline=None)
@given(pos=st.integers(0, 10**9), bit=st.integers(0, 7))
def test_any_flipped_bit_is_refused(pos: int, bit: int) -> None:
    data = bytearray(sf.encode({"x": 1}, _arrays()))
    data[pos % len(data)] ^= 1 << bit
    with pytest.raises(sf.StateFileError):
        sf.decode(bytes(data))


def _reseal(body: bytes) -> bytes:
    return body + xxhash.xxh3_128_digest(body)


def test_another_container_version_is_its_own_kind() -> None:
    data = sf.encode({}, {"a": np.arange(3, dtype=np.uint64)})
    body = bytearray(data[:-16])
    struct.pack_into("<I", body, 8, sf.FORMAT_VERSION + 1)
    with pytest.raises(sf.StateFileVersionError) as info:
        sf.decode(_reseal(bytes(body)))
    assert info.value.kind == "version"


@pytest.mark.parametrize(
    "lie",
    [
        {"nbytes": 9999},  # more bytes than the shape says
        {"offset": 10**9},  # past the end
        {"dtype": "O"},  # objects: never
        {"shape": [-1]},
        {"dtype": "u8", "shape": [4]},  # shape × itemsize != nbytes
    ],
)
def test_a_header_that_lies_is_refused_even_with_a_valid_checksum(lie: dict[str, object]) -> None:
    data = sf.encode({}, {"a": np.arange(3, dtype=np.uint64)})
    _magic, _version, head_len = struct.unpack_from("<8sII", data)
    head = json.loads(data[16 : 16 + head_len])
    head["arrays"][0].update(lie)
    new_head = json.dumps(head).encode()
    prefix = struct.pack("<8sII", sf.MAGIC, sf.FORMAT_VERSION, len(new_head)) + new_head
    prefix += b"\0" * ((-len(prefix)) % 64)
    old_start = 16 + head_len + ((-(16 + head_len)) % 64)
    with pytest.raises(sf.StateFileError):
        sf.decode(_reseal(prefix + data[old_start:-16]))


def test_not_a_state_file() -> None:
    with pytest.raises(sf.StateFileError, match="magic"):
        sf.decode(_reseal(b"PK\x03\x04" + b"\0" * 40))
