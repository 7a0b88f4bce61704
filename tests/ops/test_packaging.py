"""Install from a clone, as deploy/README.md says: a fresh virtualenv, ``pip install ./kvrelay``.

The copy of the tree is what a clone holds (tracked and not-ignored files). ``--no-deps`` keeps the
test fast and offline for numba & co.; what it checks needs none of them: the console script, the
files a pip user gets without the repository (example config, units), the licence metadata
(PEP 639) and the ``py.typed`` markers SDK users' type checkers read.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import venv
from pathlib import Path

import pytest

from kvrelay.ops.files import ASSETS

REPO = Path(__file__).resolve().parents[2]


def _clone_files(dest: Path) -> None:
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO, capture_output=True, check=True, timeout=60,
    ).stdout.split(b"\0")
    for raw in filter(None, listed):
        rel = Path(os.fsdecode(raw))
        if not (REPO / rel).is_file():
            continue  # deleted in the work tree but still in the index
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / rel, dest / rel)


@pytest.mark.slow
def test_install_from_a_clone_into_a_venv(tmp_path: Path) -> None:
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.fail("the packaging test needs the git checkout it documents")
    src, env_dir = tmp_path / "kvrelay", tmp_path / "venv"
    _clone_files(src)
    venv.EnvBuilder(with_pip=True).create(env_dir)
    py, kvrelay = env_dir / "bin" / "python", env_dir / "bin" / "kvrelay"
    res = subprocess.run(
        [str(py), "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
         "--no-deps", str(src)],
        capture_output=True, text=True, timeout=400, cwd=tmp_path,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]

    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    out = subprocess.run(
        [str(kvrelay), "--version"], capture_output=True, text=True, env=env, cwd=tmp_path,
        timeout=60,
    )  # fmt: skip
    assert out.returncode == 0 and out.stdout.startswith("kvrelay 0."), out.stderr
    for argv, name in (
        (["example-config"], "kvrelay.example.toml"),
        (["systemd-unit"], "kvrelay.service"),
        (["systemd-unit", "--template"], "kvrelay@.service"),
    ):
        out = subprocess.run(
            [str(kvrelay), *argv], capture_output=True, text=True, env=env, cwd=tmp_path,
            timeout=60,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr
        assert out.stdout == (REPO / "deploy" / name).read_text(), argv
    assert set(ASSETS) == {"kvrelay.example.toml", "kvrelay.service", "kvrelay@.service"}

    site = next((env_dir / "lib").glob("python3*/site-packages"))
    pkg = site / "kvrelay"
    assert (pkg / "py.typed").is_file() and (pkg / "_proto" / "py.typed").is_file()
    assert not (pkg / "ops" / "assets" / "__init__.py").exists()
    (dist,) = site.glob("kvrelay-*.dist-info")
    meta = (dist / "METADATA").read_text()
    assert "License-Expression: Apache-2.0" in meta
    assert "License-File: LICENSE" in meta and "License-File: NOTICE" in meta
    assert "Classifier: Typing :: Typed" in meta and "Project-URL: " in meta
    licences = dist / "licenses"
    assert (licences / "LICENSE").read_text() == (REPO / "LICENSE").read_text()
    assert "relay.proto" in (licences / "NOTICE").read_text()


def test_licence_files_are_what_the_metadata_says() -> None:
    text = (REPO / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text
    notice = (REPO / "NOTICE").read_text()
    for proto in ("protos/dynamo/kvrelay/v1/relay.proto", "protos/vllm/control.proto"):
        assert proto in notice
        header = (REPO / proto).read_text().splitlines()[:3]
        assert any("SPDX-License-Identifier: Apache-2.0" in line for line in header), proto


def test_the_repository_url_is_one_placeholder_the_install_docs_explain() -> None:
    """pyproject.toml's Source URL is the one the install instructions clone, and while it is the
    documented placeholder the docs say so (a reader must never guess a URL)."""
    import tomllib

    meta = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    url = meta["urls"]["Source"]
    readme = (REPO / "deploy" / "README.md").read_text()
    assert f"KVRELAY_GIT={url}" in readme and 'git clone "$KVRELAY_GIT"' in readme
    if url.split("/")[2].endswith(".invalid"):
        assert "placeholder" in readme.split("## Install (systemd)", 1)[1].split("```", 1)[0]
