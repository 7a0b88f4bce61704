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
:class:`StateFileError` says why, and the caller ignores the file. Writes are atomic (temporary
file in the same directory, fsync, rename, fsync of the directory), so a crash mid-write leaves
the previous file or none, never a torn one.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import xxhash

MAGIC = b"KVRSTATE"
FORMAT_VERSION = 1
_ALIGN = 64
_DIGEST = 16
_PREFIX = struct.Struct("<8sII")
#: dtypes a state file may hold (anything else is refused before numpy sees it).
_DTYPES = {"u1", "u2", "u4", "u8", "i1", "i2", "i4", "i8", "b1", "f8"}
#: Refuse headers beyond this (a corrupt length must not make the reader allocate gigabytes).
MAX_HEADER_BYTES = 16 << 20


class StateFileError(Exception):
    """The file cannot be used; ``kind`` is the counted reason."""

    kind = "corrupt"


class StateFileVersionError(StateFileError):
    """Another container version (written by another kvrelay release)."""

    kind = "version"


@dataclass(frozen=True, slots=True)
class StateFile:
    header: dict[str, Any]
    arrays: dict[str, npt.NDArray[Any]]


def _pad(n: int) -> int:
    return (-n) % _ALIGN


def encode(header: dict[str, Any], arrays: dict[str, npt.NDArray[Any]]) -> bytes:
    """The file's bytes (arrays are copied as C-contiguous little-endian)."""
    specs: list[dict[str, Any]] = []
    blobs: list[bytes] = []
    offset = 0
    for name, arr in arrays.items():
        a = np.ascontiguousarray(arr)
        dt = a.dtype.newbyteorder("<") if a.dtype.byteorder == ">" else a.dtype
        code = dt.str.lstrip("<>|=")
        if code not in _DTYPES:
            raise ValueError(f"array {name!r}: dtype {a.dtype} cannot be saved")
        raw = a.astype(dt, copy=False).tobytes()
        specs.append({"name": name, "dtype": code, "shape": list(a.shape), "offset": offset,
                      "nbytes": len(raw)})  # fmt: skip
        blobs.append(raw + b"\0" * _pad(len(raw)))
        offset += len(raw) + _pad(len(raw))
    head = json.dumps({**header, "arrays": specs}, separators=(",", ":")).encode()
    prefix = _PREFIX.pack(MAGIC, FORMAT_VERSION, len(head)) + head
    body = prefix + b"\0" * _pad(len(prefix)) + b"".join(blobs)
    return body + xxhash.xxh3_128_digest(body)


def decode(data: bytes) -> StateFile:
    """Parse and check a file's bytes; raises :class:`StateFileError` on any doubt."""
    if len(data) < _PREFIX.size + _DIGEST:
        raise StateFileError(f"truncated: {len(data)} bytes")
    magic, version, head_len = _PREFIX.unpack_from(data)
    if magic != MAGIC:
        raise StateFileError("not a kvrelay state file (bad magic)")
    if version != FORMAT_VERSION:
        raise StateFileVersionError(f"container version {version}, this kvrelay reads "
                                    f"{FORMAT_VERSION}")  # fmt: skip
    body, digest = data[:-_DIGEST], data[-_DIGEST:]
    if xxhash.xxh3_128_digest(body) != digest:
        raise StateFileError("checksum mismatch (truncated or corrupted)")
    if head_len > MAX_HEADER_BYTES or _PREFIX.size + head_len > len(body):
        raise StateFileError("header length out of range")
    try:
        header = json.loads(body[_PREFIX.size:_PREFIX.size + head_len].decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise StateFileError(f"header is not JSON: {exc}") from None
    if not isinstance(header, dict) or not isinstance(header.get("arrays"), list):
        raise StateFileError("header is not an object with an array list")
    start = _PREFIX.size + head_len
    start += _pad(start)
    arrays: dict[str, npt.NDArray[Any]] = {}
    for spec in header.pop("arrays"):
        arrays[_name(spec)] = _array(body, start, spec)
    return StateFile(header, arrays)


def _name(spec: Any) -> str:
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
        raise StateFileError("array entry without a name")
    return str(spec["name"])


def _array(body: bytes, start: int, spec: dict[str, Any]) -> npt.NDArray[Any]:
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
    lo = start + offset
    if lo + nbytes > len(body):
        raise StateFileError(f"array {name!r} extends past the end of the file")
    a = np.frombuffer(body, dtype=dt, count=count, offset=lo).reshape(shape)
    return a.astype(dt.newbyteorder("="), copy=True)  # native, writable, owns its memory


def write(path: Path, header: dict[str, Any], arrays: dict[str, npt.NDArray[Any]]) -> int:
    """Atomically replace ``path``; returns the bytes written."""
    data = encode(header, arrays)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        view = memoryview(data)
        while view:
            n = os.write(fd, view)
            view = view[n:]
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    dfd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
    return len(data)


def read(path: Path, max_bytes: int = 1 << 34) -> StateFile:
    """Read and check ``path`` (OSError if it cannot be read, StateFileError if unusable)."""
    size = path.stat().st_size
    if size > max_bytes:
        raise StateFileError(f"{size} bytes is more than any pool's state can be")
    return decode(path.read_bytes())
