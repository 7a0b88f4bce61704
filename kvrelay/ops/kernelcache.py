"""Where numba's on-disk kernel cache lives, decided before numba is first imported.

In order: ``NUMBA_CACHE_DIR`` when set; systemd's ``CacheDirectory=`` (``$CACHE_DIRECTORY/numba``);
numba's own default, ``__pycache__`` next to the installed modules, when that is writable, else
numba's per-user directory (``$XDG_CACHE_HOME/numba``, by default ``~/.cache/numba``) when that
is writable. When none is (a read-only install run by a user without a writable home), numba
would refuse to import the kernels, so a per-user directory under the temp directory is used:
it works, but a reboot empties it and the next start compiles again.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import MutableMapping
from dataclasses import dataclass
from pathlib import Path

ENV = "NUMBA_CACHE_DIR"


@dataclass(frozen=True)
class KernelCache:
    path: str
    source: str  # NUMBA_CACHE_DIR | CACHE_DIRECTORY | modules | user | temporary

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
    if env.get(ENV):
        return KernelCache(env[ENV], ENV)
    cache = env.get("CACHE_DIRECTORY", "")
    if cache:
        env[ENV] = os.path.join(cache.split(":")[0], "numba")
        return KernelCache(env[ENV], "CACHE_DIRECTORY")
    pkg = package_dir or _package_dir()
    if all(_writable_dir(d) for d in (pkg / "__pycache__", pkg / "ingest" / "__pycache__")):
        return KernelCache(str(pkg / "**" / "__pycache__"), "modules")
    xdg = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    user = Path(xdg) / "numba"
    if _writable_dir(user):
        return KernelCache(str(user), "user")
    env[ENV] = _private_tmp()
    return KernelCache(env[ENV], "temporary")


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
