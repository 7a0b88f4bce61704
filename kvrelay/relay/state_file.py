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

Both directions stream: a write hashes and writes each array straight from its memory (or, for
a :class:`Source` such as a checkpoint's image of a pool that keeps changing, through one
bounded buffer it reads into), a read allocates each array once and reads the file into it, so
neither holds a second copy of the state (the whole file in ``bytes``, then arrays cut from it,
was three). A file larger than the caller's bound is refused from its size, before any of it is
read, and every array's size is checked against the file's length before anything is allocated.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import io
import json
import mmap
import os
import stat
import struct
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Protocol

import numpy as np
import numpy.typing as npt
import xxhash

from kvrelay.pool.cow import copy_bytes
from kvrelay.relay import safe_files

MAGIC = b"KVRSTATE"
FORMAT_VERSION = 1
_ALIGN = 64
_CHUNK = 4 << 20  # pieces of an array in memory
#: Pieces of a :class:`Source` (a checkpoint image read while the pool changes): each read and
#: hash of one holds a CPU for a fraction of a millisecond, without the GIL; the writer takes the
#: GIL back a few times a piece (a busy event loop makes each of those wait its turn).
SOURCE_PIECE = 1 << 20
#: The direct writer's buffer: one ``write`` per MiB, page-aligned as ``O_DIRECT`` wants.
DIRECT_BLOCK = 1 << 20
_DIRECT_ALIGN = 4096
_DIGEST = 16
_PREFIX = struct.Struct("<8sII")
#: dtypes a state file may hold (anything else is refused before numpy sees it).
_DTYPES = {"u1", "u2", "u4", "u8", "i1", "i2", "i4", "i8", "b1", "f8"}
#: Refuse headers beyond this (a corrupt length must not make the reader allocate gigabytes).
MAX_HEADER_BYTES = 16 << 20
#: A header's JSON is parsed into Python objects that cost far more than its bytes (an empty
#: object, 3 bytes, is a dict of about 80): a hostile 16 MiB header of ``{},`` made the reader
#: hold 420 MiB. So its containers (``{``, ``[``) and separators (``,``, ``:``) are counted first,
#: those inside strings too (a bound from above), and a header over either bound is refused
#: unparsed: the objects of any header then stay under about 150 MiB (measured: short strings,
#: ``"ab",``, the costliest). A real header needs about 22 containers and 106 separators (and
#: 840 bytes) per member, so these admit the 20K members that ``MAX_HEADER_BYTES`` does.
MAX_HEADER_CONTAINERS = 1 << 19
MAX_HEADER_SEPARATORS = 1 << 21
#: An array's dimensions (numpy's own limit is 64, and a dimension must fit its index type).
MAX_DIMS = 8
MAX_DIM = 1 << 48


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


class Source(Protocol):
    """An array written from something other than its memory: its bytes are asked for in order,
    ``_CHUNK`` at a time, each once (``pool/image.py``'s armed arrays)."""

    dtype: np.dtype[Any]
    shape: tuple[int, ...]
    nbytes: int

    def read(self, lo: int, hi: int, out: npt.NDArray[np.uint8]) -> memoryview:
        """Bytes ``[lo, hi)`` (native order), written into ``out`` and returned as a view."""
        ...


#: What a file is written from: arrays, or sources, by name, in file order.
Arrays = Mapping[str, npt.NDArray[Any] | Source]


def _pad(n: int) -> int:
    return (-n) % _ALIGN


#: Told ``(raw, start, end)`` once bytes ``start:end`` of an array's flat view are written out
#: and hashed, never to be read again (a forked writer gives those pages back).
Written = Callable[[npt.NDArray[np.uint8], int, int], None]


def _layout(arrays: Arrays) -> tuple[list[dict[str, Any]], list[Any]]:
    """Each array's spec and its bytes as a flat little-endian view (a copy only for an array
    that is not already C-contiguous and little-endian), or its :class:`Source`."""
    specs: list[dict[str, Any]] = []
    views: list[Any] = []
    offset = 0
    for name, arr in arrays.items():
        view: npt.NDArray[np.uint8] | Source
        if isinstance(arr, np.ndarray):
            dt = arr.dtype.newbyteorder("<") if arr.dtype.byteorder == ">" else arr.dtype
            a = np.ascontiguousarray(arr.astype(dt, copy=False))
            shape, view, nbytes = list(a.shape), a.reshape(-1).view(np.uint8), int(a.nbytes)
        else:
            dt, shape, view, nbytes = arr.dtype, list(arr.shape), arr, int(arr.nbytes)
            if dt.byteorder == ">" or (dt.byteorder == "=" and sys.byteorder != "little"):
                raise ValueError(f"array {name!r}: a source must be little-endian")
        code = dt.str.lstrip("<>|=")
        if code not in _DTYPES:
            raise ValueError(f"array {name!r}: dtype {dt} cannot be saved")
        specs.append({"name": name, "dtype": code, "shape": shape, "offset": offset,
                      "nbytes": nbytes})  # fmt: skip
        views.append(view)
        offset += nbytes + _pad(nbytes)
    return specs, views


class _Sink:
    """Where a file's bytes go. Through one aligned buffer straight to the disk (``O_DIRECT``)
    where the file system takes it: no page cache to fill and write back. A checkpoint of a 10M
    pool put 227 MiB into the page cache in about half a second of kernel time, and its fsync
    then wrote them back in one burst; both took the CPU the event loop wakes up on, and the page
    cache counts against a container's memory. Elsewhere (tmpfs, or a first direct write that
    fails with ``EINVAL``) through the page cache, as any file."""

    def __init__(self, fd: int, direct: bool) -> None:
        self.fd = fd
        self.direct = direct and _set_direct(fd, True)
        self._map: mmap.mmap | None = None
        self.buf = np.zeros(0, dtype=np.uint8)
        self.n = 0  # bytes waiting in ``buf``
        if self.direct:
            self._map = mmap.mmap(-1, DIRECT_BLOCK, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            self.buf = np.frombuffer(self._map, dtype=np.uint8)

    def space(self, most: int) -> npt.NDArray[np.uint8] | None:
        """Up to ``most`` bytes of the buffer to read into directly (then :meth:`advance`), or
        None when bytes must come through :meth:`put` (no buffer)."""
        if not self.direct:
            return None
        if self.n == len(self.buf):
            self._flush()
        return self.buf[self.n:min(len(self.buf), self.n + most)]

    def advance(self, k: int) -> None:
        self.n += k
        if self.n == len(self.buf):
            self._flush()

    def put(self, data: bytes | memoryview) -> None:
        if not self.direct:
            safe_files.write_all(self.fd, data)
            return
        src = np.frombuffer(data, dtype=np.uint8)
        at = 0
        while at < len(src):
            if not self.direct:  # refused on the way: the rest through the page cache
                safe_files.write_all(self.fd, src.data[at:])
                return
            k = min(len(src) - at, len(self.buf) - self.n)
            if k < 4096:
                self.buf[self.n:self.n + k] = src[at:at + k]
            else:
                copy_bytes(self.buf, self.n, src, at, k)
            at += k
            self.advance(k)

    def _flush(self) -> None:
        """Write the buffer out: whole aligned blocks while direct (the last one padded, cut by
        :meth:`finish`), its exact bytes otherwise."""
        n = self.n
        done = 0  # bytes of the buffer already in the file
        if self.direct:
            try:
                safe_files.write_all(self.fd, self.buf.data[:_aligned(n)])
                self.n = 0
                return
            except OSError as exc:
                if exc.errno != errno.EINVAL or not _set_direct(self.fd, False):
                    raise
                self.direct = False  # the file system refused it after all: the page cache then
                done = getattr(exc, "written", 0)
        # the rest only: after a short direct write the file already holds the buffer's start
        safe_files.write_all(self.fd, self.buf.data[min(done, n):n])
        self.n = 0

    def finish(self, size: int) -> None:
        """The last bytes out; the file cut to ``size`` (a direct write ends on a whole block)."""
        if self.n:
            self.buf[self.n:_aligned(self.n)] = 0
            self._flush()
        if os.fstat(self.fd).st_size != size:
            os.ftruncate(self.fd, size)

    def close(self) -> None:
        self.buf = np.zeros(0, dtype=np.uint8)
        if self._map is not None:
            with contextlib.suppress(BufferError):
                self._map.close()


def _aligned(n: int) -> int:
    return -(-n // _DIRECT_ALIGN) * _DIRECT_ALIGN


def _set_direct(fd: int, on: bool) -> bool:
    """Turn ``O_DIRECT`` on or off for ``fd``; False where it cannot be (no such flag, refused)."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return False
    try:
        fl = fcntl.fcntl(fd, fcntl.F_GETFL)
        fcntl.fcntl(fd, fcntl.F_SETFL, (fl | flag) if on else (fl & ~flag))
    except OSError:
        return False
    return True


def _emit(sink: _Sink, header: dict[str, Any], arrays: Arrays,
          written: Written | None = None) -> int:
    """Stream the file's bytes to ``sink`` (hashing them on the way); returns their count, and
    tells ``written`` of each piece of an array in memory once it is out."""
    specs, views = _layout(arrays)
    head = json.dumps({**header, "arrays": specs}, separators=(",", ":")).encode()
    prefix = _PREFIX.pack(MAGIC, FORMAT_VERSION, len(head)) + head
    prefix += b"\0" * _pad(len(prefix))
    h = xxhash.xxh3_128()
    total = len(prefix)
    h.update(prefix)
    sink.put(prefix)
    bounce: npt.NDArray[np.uint8] | None = None  # a source's pieces, without a direct buffer
    for raw in views:
        if isinstance(raw, np.ndarray):
            n = int(raw.shape[0])
            for i in range(0, n, _CHUNK):  # bounded pieces: other threads get the GIL
                j = min(n, i + _CHUNK)
                piece = raw.data[i:j]
                h.update(piece)
                sink.put(piece)
                if written is not None:
                    written(raw, i, j)
        else:
            n = raw.nbytes
            i = 0
            while i < n:
                # a source is read in whole chunks of its own (``pool/cow.py``), into the
                # direct buffer where there is one
                want = min(n - i, SOURCE_PIECE)
                out = sink.space(want)
                if out is not None and (len(out) == want or len(out) >= _DIRECT_ALIGN):
                    k = len(out) if len(out) == want else len(out) // _DIRECT_ALIGN * _DIRECT_ALIGN
                    piece = raw.read(i, i + k, out)
                    h.update(piece)
                    sink.advance(k)
                else:
                    if bounce is None:
                        bounce = np.empty(SOURCE_PIECE, dtype=np.uint8)
                    k = want
                    piece = raw.read(i, i + k, bounce)
                    h.update(piece)
                    sink.put(piece)
                i += k
        pad = b"\0" * _pad(n)
        h.update(pad)
        sink.put(pad)
        total += n + len(pad)
    sink.put(h.digest())
    return total + _DIGEST


class _MemorySink(_Sink):
    def __init__(self) -> None:
        super().__init__(-1, False)
        self.out = io.BytesIO()

    def put(self, data: bytes | memoryview) -> None:
        self.out.write(data)


def encode(header: dict[str, Any], arrays: Arrays) -> bytes:
    """The file's bytes in memory (tests; files are written by :func:`write`)."""
    sink = _MemorySink()
    _emit(sink, header, arrays)
    return sink.out.getvalue()


def write(
    path: Path,
    header: dict[str, Any],
    arrays: Arrays,
    written: Written | None = None,
    *,
    direct: bool = True,
) -> int:
    """Atomically replace ``path``; returns the bytes written. The arrays must not change
    meanwhile (callers write a stopped pool's state, a copy, a forked child's image, or a
    checkpoint's image through its sources); ``written`` is told each piece of an array in
    memory once it is out (a forked child gives its pages back). ``direct``: past the page
    cache where the file system allows (``_Sink``)."""
    fd, tmp = safe_files.create_temp(path.parent, path.name)
    sink = _Sink(fd, direct)
    try:
        n = _emit(sink, header, arrays, written)
        sink.finish(n)
    except BaseException:
        safe_files.abandon(fd, tmp)
        raise
    finally:
        sink.close()
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
    header = _header(_exact(f, head_len, h))
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
        try:
            a = np.empty(shape, dtype=dt)
        except (ValueError, TypeError, OverflowError, MemoryError) as exc:
            raise StateFileError(f"array {name!r}: shape {shape}: {exc}") from None
        _read_into(f, a.reshape(-1).view(np.uint8), h)
        _exact(f, _pad(nbytes), h)
        if not dt.isnative:
            a = a.byteswap().view(dt.newbyteorder("="))
        arrays[name] = a
    if f.read(_DIGEST) != h.digest():
        raise StateFileError("checksum mismatch (truncated or corrupted)")
    return StateFile(header, arrays)


def _header(raw: bytes) -> Any:
    """The header's JSON, parsed only within bounded memory. Anything the parser refuses is a
    :class:`StateFileError`: not only invalid JSON, but an integer beyond Python's digit limit
    (``ValueError``) and nesting beyond the recursion limit (``RecursionError``), which escaped
    untyped (a hot upgrade's successor then failed with a traceback instead of refusing the cut)
    and left the file to be read again at every start."""
    containers = raw.count(b"{") + raw.count(b"[")
    separators = raw.count(b",") + raw.count(b":")
    if containers > MAX_HEADER_CONTAINERS or separators > MAX_HEADER_SEPARATORS:
        raise StateFileError(f"header too complex: {containers} containers, {separators} "
                             f"separators (at most {MAX_HEADER_CONTAINERS} and "
                             f"{MAX_HEADER_SEPARATORS})")  # fmt: skip
    try:
        return json.loads(raw.decode())
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError, JSONDecodeError among them
        raise StateFileError(f"header is not JSON: {str(exc)[:200]}") from None


def _spec(spec: Any) -> tuple[str, np.dtype[Any], int, list[int], int, int]:
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
        raise StateFileError("array entry without a name")
    name, code, shape = spec["name"], spec.get("dtype"), spec.get("shape")
    offset, nbytes = spec.get("offset"), spec.get("nbytes")
    if code not in _DTYPES:
        raise StateFileError(f"array {name!r}: dtype {code!r} not allowed")
    if not (isinstance(shape, list) and len(shape) <= MAX_DIMS
            and all(type(d) is int and 0 <= d <= MAX_DIM for d in shape)):  # fmt: skip
        raise StateFileError(f"array {name!r}: bad shape")
    if not (type(offset) is int and type(nbytes) is int and offset >= 0 and nbytes >= 0):
        raise StateFileError(f"array {name!r}: bad offset or size")
    dt = np.dtype("<" + code)
    count = 1
    for d in shape:
        count *= d
    if count * dt.itemsize != nbytes:
        raise StateFileError(f"array {name!r}: {nbytes} bytes for shape {shape} of {code}")
    return name, dt, count, shape, offset, nbytes
