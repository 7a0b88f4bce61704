"""Where the numba kernel cache goes (``kvrelay.ops.kernelcache``), decided before numba loads."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from kvrelay.ops.kernelcache import ENV, NoKernelCache, configure
from tests.support.commands import MINIMAL, clean_env
from tests.support.read_only_root import can_unshare, read_only_root

UNWRITABLE = Path("/proc/kvrelay-no-such-dir")  # cannot be created, not even by root


def test_explicit_numba_cache_dir_wins(tmp_path: Path) -> None:
    explicit = str(tmp_path / "explicit")
    env = {ENV: explicit, "CACHE_DIRECTORY": str(tmp_path / "systemd")}
    cache = configure(env)
    assert (cache.path, cache.source, cache.persistent) == (explicit, ENV, True)
    assert env[ENV] == explicit and cache.unusable is None


def test_systemd_cache_directory_first_entry(tmp_path: Path) -> None:
    env = {"CACHE_DIRECTORY": f"{tmp_path}/a:{tmp_path}/other"}
    cache = configure(env)
    assert cache.source == "CACHE_DIRECTORY"
    assert env[ENV] == cache.path == f"{tmp_path}/a/numba"


def test_a_cache_dir_given_but_not_writable_is_passed_over(tmp_path: Path) -> None:
    """A read-only root whose ``NUMBA_CACHE_DIR`` (the image's default) was not mounted
    writable: numba refused to import the kernels, a traceback at start. The next writable
    choice is taken, and the one passed over is said (``kernel_cache``'s ``unusable``)."""
    env = {ENV: str(UNWRITABLE / "numba"), "CACHE_DIRECTORY": str(UNWRITABLE / "systemd"),
           "XDG_CACHE_HOME": str(tmp_path / "xdg")}  # fmt: skip
    cache = configure(env, package_dir=UNWRITABLE / "kvrelay")
    assert (cache.source, cache.path) == ("user", str(tmp_path / "xdg" / "numba"))
    assert cache.unusable == str(UNWRITABLE / "numba") and ENV not in env


def test_nowhere_writable_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """No writable cache choice and no writable temp directory: numba can import no kernel.
    A typed error that says what to set, not ``tempfile``'s "No usable temporary directory"."""
    monkeypatch.setattr(tempfile, "tempdir", str(UNWRITABLE / "tmp"))
    env = {ENV: str(UNWRITABLE / "numba"), "XDG_CACHE_HOME": str(UNWRITABLE / "xdg")}
    with pytest.raises(NoKernelCache, match="set NUMBA_CACHE_DIR to a writable directory"):
        configure(env, package_dir=UNWRITABLE / "kvrelay")


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


@pytest.mark.skipif(not can_unshare(), reason="needs a private mount namespace (root)")
def test_check_config_on_a_read_only_root_without_its_cache_dir(tmp_path: Path) -> None:
    """``docker run --read-only`` of the image (``NUMBA_CACHE_DIR`` set, its volume not
    mounted): ``check-config`` (and ``reload``, ``upgrade``) chose no cache and numba refused
    to import the kernels, a traceback; ``serve`` took the unwritable directory as it was. Now
    every command chooses, passing over the unwritable one (here to a private temp directory);
    with nothing writable at all it fails with one line that says what to set."""
    conf = tmp_path / "kvrelay.toml"
    conf.write_text(MINIMAL)
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    command = read_only_root([sys.executable, "-m", "kvrelay", "check-config", str(conf)])

    def run(**env: str) -> subprocess.CompletedProcess[str]:
        env = clean_env(NUMBA_CACHE_DIR=str(tmp_path / "not-mounted"), HOME=str(tmp_path / "h"),
                        KVRELAY_TEST_PROBE=str(tmp_path / "probe"), **env)  # fmt: skip
        return subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)

    ok = run(TMPDIR=str(scratch), KVRELAY_TEST_WRITABLE=str(scratch))
    assert ok.returncode == 0 and "ok:" in ok.stdout, ok.stderr
    assert "Traceback" not in ok.stderr
    assert [p.name for p in scratch.iterdir()] == [f"kvrelay-numba-{os.getuid()}"]
    nowhere = run(KVRELAY_TEST_WRITABLE="")
    assert nowhere.returncode == 1 and "Traceback" not in nowhere.stderr, nowhere.stderr
    assert "set NUMBA_CACHE_DIR to a writable directory" in nowhere.stderr
