"""Hand a numba cache filled under ``NUMBA_CACHE_DIR`` to the in-tree cache the test session
uses (``__pycache__`` beside each source file).

Why: a fresh clone's ``make test`` compiles every kernel twice, once for the session
(``kvrelay warm``, ~24 s on 2 cores) and once in the cold-start test, which must start with an
empty cache of its own. The cold-start test runs first and hands its cache over; ``kvrelay
warm`` then only loads (and compiles whatever is missing, so a failed hand-over costs time,
never a test). Numba names a source directory's cache ``<dir name>_<sha1 of its path>`` under
``NUMBA_CACHE_DIR``, with the same file names as in ``__pycache__``; the index files are keyed
by the source file's stamp, not by where they lie.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

__all__ = ["hand_over"]


def hand_over(cache: Path, package: Path) -> int:
    """Copy the kernel cache files under ``cache`` (a ``NUMBA_CACHE_DIR``) for the sources under
    ``package`` into their ``__pycache__`` directories; returns how many files were copied."""
    copied = 0
    for src in [package, *(p for p in package.rglob("*") if p.is_dir())]:
        if src.name == "__pycache__":
            continue
        path = os.path.abspath(src)
        sub = cache / f"{os.path.basename(path)}_{hashlib.sha1(path.encode()).hexdigest()}"
        if not sub.is_dir():
            continue
        dest = src / "__pycache__"
        dest.mkdir(exist_ok=True)
        for f in sub.iterdir():
            if f.suffix in (".nbi", ".nbc"):
                shutil.copy2(f, dest / f.name)
                copied += 1
    return copied
