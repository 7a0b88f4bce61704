"""Where numba's on-disk kernel cache lives, decided before numba is first imported.

In order, the first that is writable: ``NUMBA_CACHE_DIR``; systemd's ``CacheDirectory=``
(``$CACHE_DIRECTORY/numba``); numba's own default, ``__pycache__`` next to the installed modules,
else numba's per-user directory (``$XDG_CACHE_HOME/numba``, by default ``~/.cache/numba``). When
none is (a read-only install run by a user without a writable home, or a read-only root whose
``NUMBA_CACHE_DIR`` was not mounted writable), numba would refuse to import the kernels (a
traceback at the first import), so a per-user directory under the temp directory is used: it
works, but a reboot empties it and the next start compiles again. With no writable temp
directory either, ``NoKernelCache`` says so (numba cannot import a kernel anywhere).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import MutableMapping
from dataclasses import dataclass
from pathlib import Path

ENV = "NUMBA_CACHE_DIR"


class NoKernelCache(OSError):
    """No directory numba could keep its kernels in: without one it cannot import them."""


@dataclass(frozen=True)
class KernelCache:
    path: str
    source: str  # NUMBA_CACHE_DIR | CACHE_DIRECTORY | modules | user | temporary
    #: a ``NUMBA_CACHE_DIR`` (or ``CACHE_DIRECTORY``) given but not writable, passed over
    unusable: str | None = None

    @property
    def persistent(self) -> bool:
        return self.source != "temporary"


_chosen: KernelCache | None = None


def chosen() -> KernelCache | None:
    """What ``configure()`` decided for this process (``None`` before it ran)."""
    return _chosen


def _writable_dir(path: Path) -> bool:
    """Creates ``path`` if needed and writes a scratch file in it, as numba's own check does."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            return True
    except OSError:
        return False


def _package_dir() -> Path:
    return Path(__file__).resolve().parent.parent


def configure(
    env: MutableMapping[str, str] | None = None, package_dir: Path | None = None
) -> KernelCache:
    """Pick the cache directory (see the module docstring); sets ``NUMBA_CACHE_DIR`` in ``env``
    when kvrelay, not numba, chose it. Call before numba is imported."""
    global _chosen
    if env is None:
        _chosen = _configure(os.environ, package_dir)
        return _chosen
    return _configure(env, package_dir)


def _configure(env: MutableMapping[str, str], package_dir: Path | None) -> KernelCache:
    unusable = None
    if env.get(ENV):
        if _writable_dir(Path(env[ENV])):
            return KernelCache(env[ENV], ENV)
        unusable = env.pop(ENV)
    cache = env.get("CACHE_DIRECTORY", "")
    if cache:
        path = os.path.join(cache.split(":")[0], "numba")
        if _writable_dir(Path(path)):
            env[ENV] = path
            return KernelCache(path, "CACHE_DIRECTORY", unusable)
        unusable = unusable or path
    pkg = package_dir or _package_dir()
    if all(_writable_dir(d) for d in (pkg / "__pycache__", pkg / "ingest" / "__pycache__")):
        return KernelCache(str(pkg / "**" / "__pycache__"), "modules", unusable)
    xdg = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    user = Path(xdg) / "numba"
    if _writable_dir(user):
        return KernelCache(str(user), "user", unusable)
    try:
        env[ENV] = _private_tmp()
    except OSError as exc:  # no writable temp directory either
        given = f" ({unusable} is not writable)" if unusable else ""
        raise NoKernelCache(
            f"no writable directory for numba's kernel cache{given}, and no writable temp "
            f"directory ({exc}): set NUMBA_CACHE_DIR to a writable directory"
        ) from exc
    return KernelCache(env[ENV], "temporary", unusable)


def _private_tmp() -> str:
    """``$TMPDIR/kvrelay-numba-<uid>``, created 0700; a fresh ``mkdtemp`` if that name exists but
    is not ours alone (cache files are machine code: another user's directory must never be
    loaded from)."""
    path = Path(tempfile.gettempdir()) / f"kvrelay-numba-{os.getuid()}"
    try:
        path.mkdir(mode=0o700, exist_ok=True)
        st = path.lstat()
        if path.is_symlink() or st.st_uid != os.getuid() or st.st_mode & 0o077:
            raise PermissionError(str(path))
        return str(path)
    except OSError:
        return tempfile.mkdtemp(prefix="kvrelay-numba-")
