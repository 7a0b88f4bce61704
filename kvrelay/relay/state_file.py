"""One pool's saved state on disk: a versioned, checksummed container of numpy arrays.

Layout (little-endian)::

    magic      8 B   b"KVRSTATE"
    version    u32   FORMAT_VERSION (the container; the pool layout has its own version inside)
    header_len u32
    header     JSON (UTF-8): metadata + one {name, dtype, shape, offset, nbytes} per array
    padding    to 64 B, then every array's bytes at its offset (each 64 B aligned)
    digest     16 B  XXH3-128 of everything before it

Why this and not pickle or ``np.savez``: loading must never execute anything or trust anything
it has not checked. A file is accepted only if its magic, version, length and digest check and
every array lies inside it with the size its dtype and shape say; otherwise a typed
:class:`StateFileError` says why, and the caller ignores the file. Writes are atomic and go
through ``relay/safe_files.py`` (an ``O_EXCL|O_NOFOLLOW`` temporary file, fsync, rename, fsync of
the directory), so a crash mid-write leaves the previous file or none, never a torn one.

Both directions stream: a write hashes and writes each array straight from its memory, a read
allocates each array once and reads the file into it, so neither holds a second copy of the
state (the whole file in ``bytes``, then arrays cut from it, was three). A file larger than the
caller's bound is refused from its size, before any of it is read, and every array's size is
checked against the file's length before anything is allocated.
"""

from __future__ import annotations

import io
import json
import os
import stat
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import numpy.typing as npt
import xxhash

from kvrelay.relay import safe_files

MAGIC = b"KVRSTATE"
FORMAT_VERSION = 1
_ALIGN = 64
_CHUNK = 4 << 20
_DIGEST = 16
_PREFIX = struct.Struct("<8sII")
#: dtypes a state file may hold (anything else is refused before numpy sees it).
_DTYPES = {"u1", "u2", "u4", "u8", "i1", "i2", "i4", "i8", "b1", "f8"}
#: Refuse headers beyond this (a corrupt length must not make the reader allocate gigabytes).
MAX_HEADER_BYTES = 16 << 20


class StateFileError(Exception):
    """The file cannot be used; ``kind`` is the counted reason."""

    kind = "corrupt"


class StateFileTooLarge(StateFileError):
    """Larger than any state of the pool it is meant for can be."""

    kind = "oversized"


class StateFileVersionError(StateFileError):
    """Another container version (written by another kvrelay release)."""

    kind = "version"


@dataclass(frozen=True, slots=True)
class StateFile:
    header: dict[str, Any]
    arrays: dict[str, npt.NDArray[Any]]


def _pad(n: int) -> int:
    return (-n) % _ALIGN


#: Told ``(raw, start, end)`` once bytes ``start:end`` of an array's flat view are written out
#: and hashed, never to be read again (a forked writer gives those pages back).
Written = Callable[[npt.NDArray[np.uint8], int, int], None]


def _layout(arrays: dict[str, npt.NDArray[Any]]) -> tuple[list[dict[str, Any]], list[Any]]:
    """Each array's spec and its bytes as a flat little-endian view (a copy only for an array
    that is not already C-contiguous and little-endian)."""
    specs: list[dict[str, Any]] = []
    views: list[Any] = []
    offset = 0
    for name, arr in arrays.items():
        dt = arr.dtype.newbyteorder("<") if arr.dtype.byteorder == ">" else arr.dtype
        code = dt.str.lstrip("<>|=")
        if code not in _DTYPES:
            raise ValueError(f"array {name!r}: dtype {arr.dtype} cannot be saved")
        a = np.ascontiguousarray(arr.astype(dt, copy=False))
        raw = a.reshape(-1).view(np.uint8)
        specs.append({"name": name, "dtype": code, "shape": list(a.shape), "offset": offset,
                      "nbytes": int(raw.shape[0])})  # fmt: skip
        views.append(raw)
        offset += int(raw.shape[0]) + _pad(int(raw.shape[0]))
    return specs, views


def _emit(put: Callable[[bytes | memoryview], object], header: dict[str, Any],
          arrays: dict[str, npt.NDArray[Any]],
          written: Written | None = None) -> int:
    """Stream the file's bytes to ``put`` (hashing them on the way); returns their count, and
    tells ``written`` of each piece of an array once it is out."""
    specs, views = _layout(arrays)
    head = json.dumps({**header, "arrays": specs}, separators=(",", ":")).encode()
    prefix = _PREFIX.pack(MAGIC, FORMAT_VERSION, len(head)) + head
    prefix += b"\0" * _pad(len(prefix))
    h = xxhash.xxh3_128()
    total = len(prefix)
    h.update(prefix)
    put(prefix)
    for raw in views:
        mv = memoryview(raw)
        for i in range(0, len(mv), _CHUNK):  # bounded pieces: other threads get the GIL
            piece = mv[i:i + _CHUNK]
            h.update(piece)
            put(piece)
            if written is not None:
                written(raw, i, i + len(piece))
        pad = b"\0" * _pad(len(mv))
        h.update(pad)
        put(pad)
        total += len(mv) + len(pad)
    put(h.digest())
    return total + _DIGEST


def encode(header: dict[str, Any], arrays: dict[str, npt.NDArray[Any]]) -> bytes:
    """The file's bytes in memory (tests; files are written by :func:`write`)."""
    out = io.BytesIO()
    _emit(out.write, header, arrays)
    return out.getvalue()


def write(
    path: Path,
    header: dict[str, Any],
    arrays: dict[str, npt.NDArray[Any]],
    written: Written | None = None,
) -> int:
    """Atomically replace ``path``; returns the bytes written. The arrays must not change
    meanwhile (callers write a stopped pool's state, a copy, or a forked child's image);
    ``written`` is told each piece once it is out (a forked child gives its pages back)."""
    fd, tmp = safe_files.create_temp(path.parent, path.name)
    try:
        n = _emit(lambda data: safe_files.write_all(fd, data), header, arrays, written)
    except BaseException:
        safe_files.abandon(fd, tmp)
        raise
    safe_files.commit(fd, tmp, path)
    return n


def read(path: Path, max_bytes: int = 1 << 34) -> StateFile:
    """Read and check ``path`` (OSError if it cannot be read, StateFileError if unusable). A
    symbolic link is not followed; a file over ``max_bytes`` is refused unread."""
    fd = os.open(path, safe_files.READ_FLAGS)
    with os.fdopen(fd, "rb", buffering=0) as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise StateFileError("not a regular file")
        if st.st_size > max_bytes:
            raise StateFileTooLarge(f"{st.st_size} bytes, more than this pool's state can be "
                                    f"({max_bytes} bytes)")  # fmt: skip
        return _read(f, st.st_size)  # type: ignore[arg-type]


def decode(data: bytes) -> StateFile:
    """Parse and check a file's bytes (as :func:`read` does a file's)."""
    return _read(io.BytesIO(data), len(data))


def _exact(f: BinaryIO, n: int, h: Any) -> bytes:
    data = f.read(n)
    if data is None or len(data) != n:
        raise StateFileError("truncated")
    h.update(data)
    return data


def _read_into(f: BinaryIO, raw: npt.NDArray[np.uint8], h: Any) -> None:
    mv = raw.data
    got = 0
    while got < len(mv):
        n = f.readinto(mv[got:])  # type: ignore[attr-defined]
        if not n:
            raise StateFileError("truncated")
        got += n
    h.update(mv)


def _read(f: BinaryIO, size: int) -> StateFile:
    if size < _PREFIX.size + _DIGEST:
        raise StateFileError(f"truncated: {size} bytes")
    h = xxhash.xxh3_128()
    magic, version, head_len = _PREFIX.unpack(_exact(f, _PREFIX.size, h))
    if magic != MAGIC:
        raise StateFileError("not a kvrelay state file (bad magic)")
    if version != FORMAT_VERSION:
        raise StateFileVersionError(f"container version {version}, this kvrelay reads "
                                    f"{FORMAT_VERSION}")  # fmt: skip
    body_len = size - _DIGEST
    if head_len > MAX_HEADER_BYTES or _PREFIX.size + head_len > body_len:
        raise StateFileError("header length out of range")
    raw_head = _exact(f, head_len, h)
    try:
        header = json.loads(raw_head.decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise StateFileError(f"header is not JSON: {exc}") from None
    if not isinstance(header, dict) or not isinstance(header.get("arrays"), list):
        raise StateFileError("header is not an object with an array list")
    start = _PREFIX.size + head_len
    start += _pad(start)
    if start > body_len:
        raise StateFileError("header length out of range")
    _exact(f, start - _PREFIX.size - head_len, h)
    specs = [_spec(spec) for spec in header.pop("arrays")]
    pos = 0
    for name, _dt, _count, _shape, offset, nbytes in specs:  # sizes checked before allocating
        if offset != pos:
            raise StateFileError(f"array {name!r}: not where the layout puts it")
        pos = offset + nbytes + _pad(nbytes)
    if start + pos != body_len:
        raise StateFileError("arrays do not fill the file exactly (truncated or corrupted)")
    arrays: dict[str, npt.NDArray[Any]] = {}
    for name, dt, _count, shape, _offset, nbytes in specs:
        a = np.empty(shape, dtype=dt)
        _read_into(f, a.reshape(-1).view(np.uint8), h)
        _exact(f, _pad(nbytes), h)
        if not dt.isnative:
            a = a.byteswap().view(dt.newbyteorder("="))
        arrays[name] = a
    if f.read(_DIGEST) != h.digest():
        raise StateFileError("checksum mismatch (truncated or corrupted)")
    return StateFile(header, arrays)


def _spec(spec: Any) -> tuple[str, np.dtype[Any], int, list[int], int, int]:
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
        raise StateFileError("array entry without a name")
    name, code, shape = spec["name"], spec.get("dtype"), spec.get("shape")
    offset, nbytes = spec.get("offset"), spec.get("nbytes")
    if code not in _DTYPES:
        raise StateFileError(f"array {name!r}: dtype {code!r} not allowed")
    if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)):
        raise StateFileError(f"array {name!r}: bad shape")
    if not (isinstance(offset, int) and isinstance(nbytes, int) and offset >= 0 and nbytes >= 0):
        raise StateFileError(f"array {name!r}: bad offset or size")
    dt = np.dtype("<" + code)
    count = 1
    for d in shape:
        count *= d
    if count * dt.itemsize != nbytes:
        raise StateFileError(f"array {name!r}: {nbytes} bytes for shape {shape} of {code}")
    return name, dt, count, shape, offset, nbytes
