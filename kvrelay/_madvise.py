"""``madvise(2)`` for the layers that manage memory themselves: one binding, its constants.

The pool's checkpoint images (``pool/cow.py``: populating their buffers ahead of the event
loop), forked children (``relay/forked.py``), the huge-page fold (``relay/hugepages.py``) and the
daemon's release of the compiler's pages (``ops/memory.py``) all call it.
"""

from __future__ import annotations

import ctypes
import errno
import functools
from typing import Any

MADV_DONTNEED = 4
MADV_POPULATE_WRITE = 23  # Linux 5.14+: fault the range in for writing, now
MADV_COLLAPSE = 25  # Linux 6.1+: fold the range onto huge pages


@functools.cache
def _libc_madvise() -> Any:
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    fn.restype = ctypes.c_int
    return fn


def madvise(at: int, length: int, advice: int) -> int:
    """``madvise(2)`` on ``[at, at + length)``: 0, or the errno it failed with (``ENOSYS``
    where the C library has none). It releases the GIL while the kernel works."""
    fn = _libc_madvise()
    if fn is None:
        return errno.ENOSYS
    return 0 if fn(at, length, advice) == 0 else ctypes.get_errno()
