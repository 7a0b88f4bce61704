"""Where the numba kernel cache goes (``kvrelay.ops.kernelcache``), decided before numba loads."""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

import pytest

from kvrelay.ops.kernelcache import ENV, configure

UNWRITABLE = Path("/proc/kvrelay-no-such-dir")  # cannot be created, not even by root


def test_explicit_numba_cache_dir_wins() -> None:
    env = {ENV: "/explicit", "CACHE_DIRECTORY": "/var/cache/kvrelay"}
    cache = configure(env)
    assert (cache.path, cache.source, cache.persistent) == ("/explicit", ENV, True)
    assert env[ENV] == "/explicit"


def test_systemd_cache_directory_first_entry() -> None:
    env = {"CACHE_DIRECTORY": "/var/cache/kvrelay/a:/var/cache/other"}
    cache = configure(env)
    assert cache.source == "CACHE_DIRECTORY"
    assert env[ENV] == cache.path == "/var/cache/kvrelay/a/numba"


def test_writable_package_dir_is_left_to_numba(tmp_path: Path) -> None:
    env: dict[str, str] = {}
    cache = configure(env, package_dir=tmp_path / "kvrelay")
    assert cache.source == "modules" and ENV not in env  # numba's own default applies
    assert (tmp_path / "kvrelay" / "ingest" / "__pycache__").is_dir()


def test_read_only_install_uses_the_user_cache(tmp_path: Path) -> None:
    env = {"XDG_CACHE_HOME": str(tmp_path / "xdg")}
    cache = configure(env, package_dir=UNWRITABLE / "kvrelay")
    assert cache.source == "user" and cache.path == str(tmp_path / "xdg" / "numba")
    assert ENV not in env  # numba's per-user locator finds the same directory itself


def test_nothing_writable_falls_back_to_a_private_temporary_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    env = {"XDG_CACHE_HOME": str(UNWRITABLE / "xdg")}
    cache = configure(env, package_dir=UNWRITABLE / "kvrelay")
    assert cache.source == "temporary" and not cache.persistent
    assert env[ENV] == cache.path == str(tmp_path / f"kvrelay-numba-{os.getuid()}")
    assert stat.S_IMODE(os.stat(cache.path).st_mode) == 0o700
    assert configure({"XDG_CACHE_HOME": str(UNWRITABLE)}, UNWRITABLE).path == cache.path


def test_a_shared_temporary_dir_is_never_used(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Cache files are machine code: a directory others can write to must not be loaded from."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    squatted = tmp_path / f"kvrelay-numba-{os.getuid()}"
    squatted.mkdir()
    squatted.chmod(0o777)
    env = {"XDG_CACHE_HOME": str(UNWRITABLE / "xdg")}
    cache = configure(env, package_dir=UNWRITABLE / "kvrelay")
    assert cache.source == "temporary"
    assert cache.path != str(squatted) and Path(cache.path).parent == tmp_path
    assert stat.S_IMODE(os.stat(cache.path).st_mode) == 0o700
